"""The multi-tensor CUDA step without a host synchronisation (``Gefen(capturable=True)``).

:class:`~gefen_dist.engine.cuda_batch.CudaBatch` decides the non-finite check on the host: one
synchronisation per step, and the bias corrections, the update bound and the learning rate are
host floats baked into the launches. With ``capturable=True`` a batch keeps a :class:`DeviceStep`,
and a step is device work only, so it can be captured in a CUDA graph and replayed:

* every member's ``step`` count is a float32 tensor on the device (as torch's capturable AdamW
  keeps it), advanced by ``1 - skip``;
* ``skip`` (``nonfinite="skip"``) is a 0-dim device tensor: 1 when a gradient is not finite or a
  column statistic overflows float32 (all-reduced with MAX when several ranks take part); every
  launch then changes nothing: the quantized kernels mask every row, the ``v_col`` EMAs keep their
  values (a copy taken before them is restored by ``torch.where``), torch's fused AdamW takes it as
  ``found_inf`` for the exact tensors, and :attr:`Gefen.device_skipped_steps` counts it;
* each launch group's scalars (lr, the bias corrections, the bound) are computed from its step
  count on the device (:func:`gefen_dist.core.step.device_hyperparameters`) into a float32 vector
  the kernel reads (``DEVICE_HP``), rounded to the same float32 values as the host's.

With several ranks (DDP replicas, FSDP2 shards) the flag is all-reduced (MAX) after the column sums
SUM, where the host-driven batch and the per-tensor path agree through a fixed-size summary first: so
every rank must take the same path, which they do when their gradients have the same dtypes and
layouts (as DDP and FSDP2 give them).

Quantized tensors step bitwise as without ``capturable``; the exact (AdamW) tensors are stepped by
``torch._fused_adamw_`` (torch's fused AdamW, which reads its step count and ``found_inf`` on the
device) instead of the foreach operations of :func:`gefen_dist.core.step.adamw_foreach_`, equal to
them within float32 rounding. ``nonfinite="raise"`` needs the host to know, so it is refused with
``capturable=True`` (``gefen_dist.optim.validation``).
"""
from __future__ import annotations

import logging
from typing import List, Optional

import torch

from ..core.step import adamw_fused_, device_hyperparameters
from .nonfinite import any_overflow, device_flags

__all__ = ["DeviceStep"]

logger = logging.getLogger(__name__)


def _capturing() -> bool:
    """Whether the current CUDA stream is capturing a graph."""
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


class DeviceStep:
    """The device-side state of one capturable batch: its members' step counts moved to the device,
    a skip flag, a scalar vector per launch group and, under ``nonfinite="skip"``, the buffers that
    keep the ``v_col`` EMAs unchanged on a skipped step."""

    def __init__(self, batch, opt):
        dev = batch.device
        self.check = opt.nonfinite != "ignore"
        for gi in batch.groups:
            for p in gi["members"]:
                st = opt.state[p]
                if st["step"].device != dev:
                    st["step"] = st["step"].to(device=dev, dtype=torch.float32)
            gi["steps"] = [opt.state[p]["step"] for p in gi["members"]]  # (the exact tensors' last)
            gi["hp"] = torch.zeros(6, dtype=torch.float32, device=dev)
        self.skip = torch.zeros((), dtype=torch.float32, device=dev)
        self.keep = torch.ones((), dtype=torch.float32, device=dev)  # 1 - skip: what each step count advances by
        self._prev = self._new = None
        cols = batch.cols
        if self.check and cols is not None:  # every v_col before the EMAs, restored on a skipped step
            self._vcols = cols.vcols
            self._prev = torch.empty(cols.total, dtype=torch.float32, device=dev)
            self._new = torch.empty_like(self._prev)
            self._prev_views, self._new_views = cols.views_of(self._prev), cols.views_of(self._new)
        if getattr(opt, "device_skipped_steps", None) is None or opt.device_skipped_steps.device != dev:
            opt.device_skipped_steps = torch.zeros((), dtype=torch.float32, device=dev)

    def flag(self, opt, buf: Optional[torch.Tensor], cms: Optional[torch.Tensor], others: List[torch.Tensor]):
        """The step's skip flag on the device (None under ``nonfinite="ignore"``): any non-finite
        column sum (``buf``) or other gradient, or an overflowing column statistic (``cms``); MAX
        over the ranks. Raises nothing and reads nothing on the host."""
        if not self.check:
            return None
        # (an overflowing norm of finite values skips too: the host path confirms it exactly)
        flags = device_flags(buf, others) + ([any_overflow(cms)] if buf is not None else [])
        if flags:
            self.skip.copy_(torch.stack(flags).any())
        else:
            self.skip.zero_()
        if opt._comm.world_size > 1:
            opt._comm.all_reduce_max_(self.skip)
        torch.sub(1.0, self.skip, out=self.keep)
        opt.device_skipped_steps.add_(self.skip)
        return self.skip

    def advance(self, groups) -> None:
        """Every member's step count advances by one, or by nothing on a skipped step."""
        steps = [s for gi in groups for s in gi["steps"]]
        if self.check:
            torch._foreach_add_(steps, [self.keep] * len(steps))  # (the List overload: the Tensor one reads it on the host on CPU)
        else:
            torch._foreach_add_(steps, 1.0)

    def keep_vcols(self) -> None:
        """Copy every ``v_col`` before the batch's EMAs (which stay the host path's operations, so
        the same bits): :meth:`restore_vcols_if_skipped` puts them back on a skipped step."""
        if self._prev is not None:
            torch._foreach_copy_(self._prev_views, self._vcols)

    def restore_vcols_if_skipped(self) -> None:
        """After the EMAs: every ``v_col`` as :meth:`keep_vcols` found it when the step is skipped."""
        if self._prev is not None:
            torch._foreach_copy_(self._new_views, self._vcols)
            torch.where(self.skip != 0, self._prev, self._new, out=self._new)
            torch._foreach_copy_(self._vcols, self._new_views)

    def scalars(self, gi, opt) -> dict:
        """The launch group's hyperparameters from its step count on the device, written into its
        scalar vector (``gi["hp"]``) for the kernel; returns them (``hp`` added). A float ``lr`` met
        while a CUDA graph is being captured is a constant of the graph: a WARNING (once) says so."""
        from ..kernels.triton_tables import device_step_scalars

        if not isinstance(gi["group"]["lr"], torch.Tensor) and _capturing() and not opt.__dict__.get("_lr_warned"):
            opt._lr_warned = True
            logger.warning("Gefen(capturable=True): a CUDA graph is capturing step() with a float lr (%g), which the "
                           "graph replays as a constant: an LR scheduler's later values will not reach it. Pass lr "
                           "as a tensor on the parameters' device (Gefen(params, lr=torch.tensor(lr, device=...)))",
                           gi["group"]["lr"])
        hp = device_hyperparameters(gi["group"], gi["steps"][0], opt.bound_updates)
        device_step_scalars(gi["hp"], self.skip if self.check else None, **hp)
        return dict(hp, hp=gi["hp"])

    def exact(self, gi, grads) -> None:
        """The group's exact tensors: torch's fused AdamW with the device step counts and the skip
        flag as ``found_inf``."""
        ps, ms, vs = gi["exact_state"]
        group = gi["group"]
        lr = group["lr"]
        lr = lr.to(ps[0].device) if isinstance(lr, torch.Tensor) and ps else lr
        adamw_fused_(ps, grads, ms, vs, gi["steps"][len(gi["item_entries"]):], lr=lr,
                     betas=group["betas"], eps=group["eps"], weight_decay=group["weight_decay"],
                     found_inf=self.skip if self.check else None)
