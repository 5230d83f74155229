"""The few collectives Gefen needs, behind one small interface.

Gefen communicates only when it learns (the first step with a nonzero gradient, and the first
gradient of a parameter added later): a MAX to agree on which tensors have a nonzero gradient,
an all-gather of period partials (:mod:`gefen_dist.core.periods`), a SUM of the codebook
histogram, and a one-time agreement check. Every rank enters every call, in the same order,
whatever it holds locally (an empty shard contributes zeros), or the job would deadlock.

:class:`LocalComm` is the single-process identity; :class:`ProcessGroupComm` wraps a
``torch.distributed`` process group (CPU tensors travel through gloo; for NCCL groups they
are moved to the current CUDA device).
"""
from __future__ import annotations

import hashlib
import logging
from typing import Any, List, Optional

import torch

from .layout import Ranges

logger = logging.getLogger(__name__)


class LocalComm:
    """One process: every collective is the identity."""

    world_size = 1
    rank = 0

    def all_reduce_sum_(self, t: torch.Tensor) -> torch.Tensor:
        return t

    def all_reduce_max_(self, t: torch.Tensor) -> torch.Tensor:
        return t

    def all_gather_object(self, obj: Any) -> List[Any]:
        return [obj]

    def check_agreement(self, what: str, payload: bytes) -> None:
        """Raise if ranks disagree about ``payload`` (no-op for one process)."""


class ProcessGroupComm(LocalComm):
    """Collectives on a ``torch.distributed`` process group (default: WORLD)."""

    def __init__(self, group: Optional[Any] = None):
        import torch.distributed as dist

        self._dist = dist
        self.group = group if group is not None else dist.group.WORLD
        self.world_size = dist.get_world_size(self.group)
        self.rank = dist.get_rank(self.group)
        self._device = torch.device("cpu")
        if dist.get_backend(self.group) == "nccl":
            self._device = torch.device("cuda", torch.cuda.current_device())

    def _reduce(self, t: torch.Tensor, op) -> torch.Tensor:
        buf = t.to(self._device)
        self._dist.all_reduce(buf, op=op, group=self.group)
        if buf is not t:
            t.copy_(buf)
        return t

    def all_reduce_sum_(self, t: torch.Tensor) -> torch.Tensor:
        return self._reduce(t, self._dist.ReduceOp.SUM)

    def all_reduce_max_(self, t: torch.Tensor) -> torch.Tensor:
        return self._reduce(t, self._dist.ReduceOp.MAX)

    def all_gather_object(self, obj: Any) -> List[Any]:
        out: List[Any] = [None] * self.world_size
        self._dist.all_gather_object(out, obj, group=self.group)
        return out

    def check_agreement(self, what: str, payload: bytes) -> None:
        digest = hashlib.sha256(payload).hexdigest()
        digests = self.all_gather_object(digest)
        if len(set(digests)) != 1:
            bad = [r for r, d in enumerate(digests) if d != digests[0]]
            raise RuntimeError(
                f"gefen_dist: ranks disagree about {what} (ranks {bad} differ from rank 0). "
                "Every rank must build Gefen over the same parameters in the same order and see "
                "gradients of the same global tensors; check that the model and param groups are "
                "identical on all ranks."
            )


def comm_for(process_group: Optional[Any]) -> LocalComm:
    """The comm for a process group: local when torch.distributed is not initialised."""
    try:
        import torch.distributed as dist
    except ImportError:  # pragma: no cover - torch without distributed
        return LocalComm()
    if process_group is None and not (dist.is_available() and dist.is_initialized()):
        return LocalComm()
    return ProcessGroupComm(process_group)


ALIGN = 8  # every part in an exchanged byte buffer starts at a multiple of 8 bytes


def pad_bytes(nbytes: int) -> int:
    """Bytes a part occupies in an exchange buffer: padded to :data:`ALIGN` (every dtype's view of
    it stays aligned)."""
    return -(-nbytes // ALIGN) * ALIGN


def exchange_bytes(comm: LocalComm, parts, sizes, to: Optional[int], device: torch.device) -> Optional[List[torch.Tensor]]:
    """Gather every rank's parts (any dtypes; each padded to 8 bytes) as raw bytes.

    ``sizes[r]`` is rank ``r``'s padded byte count (every rank knows all of them). With ``to=None``
    an all-gather (every rank gets every chunk); else a gather onto group rank ``to`` (others get
    None). Returns one uint8 chunk per rank. Every rank must call this, even with nothing to send;
    it is skipped only when every rank sends nothing.
    """
    W = comm.world_size
    width = max(sizes) if sizes else 0
    if width == 0:
        return [torch.empty(0, dtype=torch.uint8, device=device) for _ in range(W)]
    dev = getattr(comm, "_device", device) if W > 1 else device
    buf = torch.zeros(width, dtype=torch.uint8, device=dev)  # padding is zeros, not garbage
    # each part as raw bytes (one view for a contiguous 1-D tensor: most parts are), and its slot of
    # the buffer from one split; a step packs hundreds of parts, and each torch call is host time
    src = [_raw_bytes(t) for t in parts]
    slots, off = [], 0
    for b in src:
        slots.append((off, off + b.numel()))
        off += pad_bytes(b.numel())
    if off != sizes[comm.rank]:
        raise RuntimeError(f"gefen_dist: internal error: this rank packed {off} bytes, the plan says {sizes[comm.rank]}")
    dst = [d for d, b in zip(Ranges(slots, width).of(buf), src) if b.numel()]
    if dst:  # one multi-tensor copy for every part (a launch or two on a GPU)
        torch._foreach_copy_(dst, [b for b in src if b.numel()])
    if W == 1:
        return [buf]
    import torch.distributed as dist

    group = comm.group
    if to is None:
        out = torch.empty(W * width, dtype=torch.uint8, device=dev)
        gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        gather_single(out, buf, group=group)
        return list(out.view(W, width).unbind(0))
    dst = dist.get_global_rank(group, to) if group is not None and group != dist.group.WORLD else to
    if comm.rank == to:
        outs = [torch.empty(width, dtype=torch.uint8, device=dev) for _ in range(W)]
        dist.gather(buf, outs, dst=dst, group=group)
        return outs
    dist.gather(buf, None, dst=dst, group=group)
    return None


def _raw_bytes(t: torch.Tensor) -> torch.Tensor:
    """The bytes of tensor ``t`` as a flat uint8 tensor (a view where ``t`` is contiguous)."""
    if t.requires_grad:
        t = t.detach()
    if not t.is_contiguous():
        t = t.contiguous()
    if t.dim() != 1:
        t = t.reshape(-1)
    return t if t.dtype == torch.uint8 else t.view(torch.uint8)


def take_bytes(chunk: torch.Tensor, off: int, n: int, dtype: torch.dtype):
    """``n`` values of ``dtype`` at byte ``off`` of an exchanged chunk, and the next part's offset."""
    nb = n * dtype.itemsize
    return chunk[off:off + nb].view(dtype), off + pad_bytes(nb)
