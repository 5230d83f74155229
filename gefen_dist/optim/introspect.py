"""What a :class:`gefen_dist.Gefen` holds and what it steps (a mixin): names, ``report()``,
``state_bytes()``, the one INFO line logged at the first completed step, and the refusal of
tensors DeepSpeed put in its param groups.

The INFO line (logger ``gefen_dist.optim.gefen``) says that Gefen, not some other optimizer, is
stepping, and how::

    Gefen is stepping 6 tensors (4 quantized: factored 3, shared 1; 2 exact), 1,050,624 parameters at
    1.031 B/param of state; backend: replicas over 2 ranks (DDP or gradients all-reduced by the caller);
    kernel: cpu (avx2)

It is logged once per optimizer, on rank 0 of its process group (every process when it is a
single process). See ``docs/huggingface.md`` for set-ups where another optimizer steps instead.
"""
from __future__ import annotations

import logging
import os
import sys
from collections import Counter
from typing import Any, Dict, List

from ..engine.flat_layout import LayoutError
from ..engine.layout import is_dtensor, local_tensor
from ..engine.report import Report, build_report, state_bytes
from ..engine.state import MODE_SHARED, nibbles_in
from ..kernels import dispatch as _dispatch

logger = logging.getLogger("gefen_dist.optim.gefen")

__all__ = ["Introspection", "describe_step", "DS_WRAPPER_ATTRS"]

# Attributes of the DeepSpeed ZeRO wrappers that own a client optimizer's flat partitions.
DS_WRAPPER_ATTRS = ("single_partition_of_fp32_groups", "fp32_partitioned_groups_flat", "fp32_groups_flat_partition")


def describe_step(opt, rep: List[Dict[str, Any]]) -> str:
    """The one-line description of what ``opt`` steps, from its report ``rep``."""
    kinds = Counter(r.get("mode", r["kind"]) if r["kind"] != "exact" else "exact" for r in rep)
    exact, pending = kinds.pop("exact", 0), kinds.pop("pending", 0)
    quant = sum(kinds.values())
    modes = ", ".join(f"{k} {v}" for k, v in sorted(kinds.items(), key=lambda kv: -kv[1]))
    n = sum(r["local_numel"] for r in rep)
    b = sum(r["state_bytes"] for r in rep)
    parts = [f"{quant} quantized" + (f": {modes}" if modes else ""), f"{exact} exact"]
    if pending:
        parts.append(f"{pending} without a gradient yet")
    return (f"{type(opt).__name__} is stepping {len(rep)} tensors ({'; '.join(parts)}), {n:,} parameters at "
            f"{b / max(1, n):.3f} B/param of state; backend: {opt._backend()}; kernel: {opt._kernel_name()}")


class Introspection:
    """Uses the optimizer's ``param_groups``, ``state``, ``_comm`` and ``fused``."""

    def _warn_unsized_shared(self) -> None:
        """Log once (WARNING) when ``state_dict()`` is taken while some ``second_moment="shared"``
        tensors hold placeholder state (periods not learned yet): that is the fresh optimizer of
        the generic DCP resume flow (``get_state_dict`` -> ``dcp.load``), which then fails inside
        DCP with a size mismatch on ``v``, because the shared mode sizes ``v`` by the periods its
        first gradient showed. The fix is named before DCP's error."""
        if self.__dict__.get("_warned_unsized"):
            return
        n = sum(1 for g in self.param_groups for p in g["params"]
                if self.state.get(p) and self._mode(p) == MODE_SHARED and not self.state[p].get("learned", 1))
        if n:
            self._warned_unsized = True
            logger.warning(
                "Gefen.state_dict(): %d second_moment='shared' tensor(s) have not learned their periods yet, so "
                "their `v` has a placeholder size. Loading a checkpoint into this optimizer with the generic DCP "
                "flow (get_state_dict -> dcp.load -> set_state_dict) fails with a size mismatch on `v`: call "
                "gefen_dist.checkpoint.prepare_for_load(model, optimizer, checkpoint_dir) first (or use "
                "gefen_dist.checkpoint.load, or the default second_moment='factored', whose state shapes depend "
                "on the parameter shapes only)", n)


    def _names(self) -> Dict[int, str]:
        names: Dict[int, str] = {}
        for gi, g in enumerate(self.param_groups):
            pn = g.get("param_names")
            for pi, p in enumerate(g["params"]):
                names[id(p)] = pn[pi] if pn is not None else f"group{gi}.param{pi}"
        return names

    def state_bytes(self) -> int:
        """Exact bytes held in optimizer state tensors (the shared codebook counted once)."""
        return state_bytes(self.state)

    def report(self) -> Report:
        """One record per parameter: name, shape, numel, kind, mode, period, scale_block,
        state_bytes. ``str(report)`` ends with the backend that steps them."""
        names = self._names()
        rep = build_report([(names[id(p)], p, self.state.get(p, {}), self._mode(p)) for g in self.param_groups
                            for p in g["params"] if p.requires_grad])
        rep.backend = self._backend()
        return rep

    # ------------------------------------------------------------------ what steps
    def _backend(self) -> str:
        ws = self._comm.world_size
        if ws == 1:
            env = os.environ.get("WORLD_SIZE")
            if env and env.isdigit() and int(env) > 1:
                return (f"single process, although WORLD_SIZE={env}: torch.distributed is not initialised, so "
                        "every process trains alone (under the HF Trainer on CPU: TrainingArguments(use_cpu=True))")
            return "single process"
        if any(is_dtensor(p) for g in self.param_groups for p in g["params"]):
            return f"FSDP2 (DTensor shards over {ws} ranks)"
        return f"replicas over {ws} ranks (DDP or gradients all-reduced by the caller)"

    def _kernel_name(self) -> str:
        """The implementations stepping this optimizer's tensors; the native CPU kernel with the
        instruction set its intrinsics path was built for (a 2-5x difference on one CPU)."""
        ps = [p for g in self.param_groups for p in g["params"] if p.requires_grad]
        if nibbles_in(self.param_groups, self.small_threshold):  # D20 (kernels.dispatch.select_nibbles)
            names = sorted({_dispatch.select_nibbles(local_tensor(p), self._fused(p)).name for p in ps})
            return ", ".join("cpu (portable C)" if n == "cpu" else n for n in names) if names else "none"
        names = sorted({self._impl(local_tensor(p), p).name for p in ps})
        if "cpu" in names:
            from ..kernels import cpu

            names[names.index("cpu")] = f"cpu ({cpu.simd_isa() or 'portable C'})"
        return ", ".join(names) if names else "none"

    def _announce(self) -> None:
        """Log :func:`describe_step` once, after the first completed step (INFO, rank 0)."""
        if self.__dict__.get("_announced"):
            return
        self._announced = True
        if self._comm.rank == 0 and logger.isEnabledFor(logging.INFO):
            logger.info("%s", describe_step(self, self.report()))

    # ------------------------------------------------------------------ tensors DeepSpeed put in
    def _check_own(self, entries) -> None:
        """Refuse DeepSpeed ZeRO flat partitions (a client ``gefen_dist.Gefen``, whose param groups
        DeepSpeed refilled): stepped as 1-D tensors they would train as plain AdamW at 8 B/param.
        Only tensors this optimizer was not built with are looked at, once each."""
        own = self.__dict__.get("_own_ids")
        if own is None:  # after unpickling or a deepcopy: what it holds now is its own
            own = self._own_ids = {id(p) for g in self.param_groups for p in g["params"]}
        new = [p for _, p in entries if id(p) not in own]
        if not new:
            return
        if "deepspeed" in sys.modules and any(p.dim() == 1 and not is_dtensor(p) for p in new):
            wrapper = _deepspeed_owner(self)
            if wrapper is not None:
                raise LayoutError(
                    f"gefen_dist.Gefen is being stepped by DeepSpeed's {type(wrapper).__name__} on flat ZeRO "
                    f"partitions ({len(new)} flat buffer(s), {sum(p.numel() for p in new):,} elements, each "
                    "concatenating many tensors), which it would train as plain AdamW at 8 B/param. Nothing was "
                    "updated. Use the DeepSpeed-aware subclass: build gefen_dist.integrations.deepspeed.Gefen "
                    "instead of gefen_dist.Gefen (same arguments), or gefen_dist.integrations.deepspeed.initialize"
                    "(model=..., optimizer=..., config=...), or name it in the DeepSpeed JSON "
                    '("optimizer": {"type": "Gefen"}); under the HF Trainer / Accelerate, '
                    "gefen_dist.integrations.hf.gefen_optimizer_cls_and_kwargs(args) picks it by itself.")
        own.update(id(p) for p in new)  # another swap (Accelerate's FSDP2 prepare): accepted


def referrers_with_optimizer(opt, attrs) -> List[Any]:
    """Objects whose ``.optimizer`` is ``opt`` and that have one of ``attrs`` (the ZeRO wrapper that
    owns a client optimizer, or the engine that owns a wrapper), found without importing DeepSpeed."""
    import gc

    out = []
    for r in gc.get_referrers(opt):
        cands = [r]
        if isinstance(r, dict):
            cands = [rr for rr in gc.get_referrers(r) if getattr(rr, "__dict__", None) is r]
        for c in cands:
            if getattr(c, "optimizer", None) is opt and any(hasattr(c, a) for a in attrs):
                out.append(c)
    return out


def _deepspeed_owner(opt):
    """The DeepSpeed ZeRO wrapper whose ``.optimizer`` is ``opt``, or None."""
    owners = referrers_with_optimizer(opt, DS_WRAPPER_ATTRS)
    return owners[0] if owners else None
