"""What Gefen's state costs, tensor by tensor: :meth:`gefen_dist.Gefen.report` and ``state_bytes``."""
from __future__ import annotations

import math
from typing import Any, Dict, Iterable, Tuple

import torch

from .layout import KIND_EXACT, KIND_QUANTIZED, global_shape, local_tensor
from .state import MODE_EXACT, tensor_keys

__all__ = ["Report", "build_report", "state_bytes", "nbytes"]


def nbytes(t: torch.Tensor) -> int:
    """Bytes this rank holds of tensor ``t`` (a DTensor's local piece)."""
    t = local_tensor(t)
    return t.numel() * t.element_size()


class Report(list):
    """Per-tensor records (dicts) with a readable table as ``str(report)``."""

    def summary(self) -> str:
        lines = [f"{'name':<40} {'shape':<18} {'kind':<9} {'period':>6} {'block':>6} {'bytes':>12} {'B/param':>8}"]
        tot_b = tot_n = 0
        for r in self:
            n = max(1, r["local_numel"])
            tot_b += r["state_bytes"]
            tot_n += r["local_numel"]
            lines.append(
                f"{r['name'][:40]:<40} {str(tuple(r['shape'])):<18} {r['kind']:<9} {r['period']:>6} "
                f"{r['scale_block']:>6} {r['state_bytes']:>12,} {r['state_bytes'] / n:>8.3f}"
            )
        lines.append(f"total: {tot_n:,} parameters, {tot_b:,} state bytes ({tot_b / max(1, tot_n):.4f} B/param)")
        if getattr(self, "backend", None):
            lines.append(f"stepped by gefen_dist, backend: {self.backend}")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.summary()


def state_bytes(state: Dict[Any, Dict[str, Any]]) -> int:
    """Exact bytes held in the state tensors of ``state`` (storage shared between entries, such as
    the one codebook, counted once). The per-tensor ``step`` counters (a 4-byte tensor each, as
    AdamW keeps them) are bookkeeping, not counted here, in the report or by ``gefen-dist plan``."""
    seen = set()
    total = 0
    for st in state.values():
        for k, v in st.items():
            if isinstance(v, torch.Tensor) and k != "step":
                v = local_tensor(v)
                key = (v.untyped_storage().data_ptr(), v.device)
                if key in seen:
                    continue
                seen.add(key)
                total += v.numel() * v.element_size()
    return total


def build_report(items: Iterable[Tuple[str, torch.Tensor, Dict[str, Any], str]]) -> Report:
    """One record per (name, parameter, its state, its mode): name, shape, numel, local_numel,
    dtype, kind (``pending`` before any state), mode (exact/shared/factored/elementwise, once there
    is state), period, scale_block, state_bytes and, quantized, learned. The mode is the
    optimizer's (its state spec's), not read off the state's keys."""
    rep = Report()
    for name, p, st, mode in items:
        shape = global_shape(p)
        rec = dict(name=name, shape=tuple(shape), numel=int(math.prod(shape)),
                   local_numel=local_tensor(p).numel(), dtype=str(p.dtype).replace("torch.", ""))
        if not st:
            rec.update(kind="pending", period=0, scale_block=0, state_bytes=0)
        else:
            held = sum(nbytes(st[k]) for k in tensor_keys(mode))
            if mode != MODE_EXACT:
                rec.update(kind=KIND_QUANTIZED, mode=mode, period=st["period"], scale_block=st["scale_block"],
                           state_bytes=held, learned=bool(st["learned"]))
            else:
                rec.update(kind=KIND_EXACT, mode=MODE_EXACT, period=0, scale_block=0, state_bytes=held)
        rep.append(rec)
    return rep
