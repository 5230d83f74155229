"""What Gefen's state costs, tensor by tensor: :meth:`gefen_dist.Gefen.report` and ``state_bytes``."""
from __future__ import annotations

import math
from typing import Any, Dict, Iterable, Tuple

import torch

from .layout import KIND_EXACT, KIND_QUANTIZED, global_shape, local_tensor

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
    the one codebook, counted once)."""
    seen = set()
    total = 0
    for st in state.values():
        for v in st.values():
            if isinstance(v, torch.Tensor):
                v = local_tensor(v)
                key = (v.untyped_storage().data_ptr(), v.device)
                if key in seen:
                    continue
                seen.add(key)
                total += v.numel() * v.element_size()
    return total


def build_report(items: Iterable[Tuple[str, torch.Tensor, Dict[str, Any]]]) -> Report:
    """One record per (name, parameter, its state): name, shape, numel, local_numel, dtype, kind
    (``pending`` before any state), mode (exact/shared/factored/elementwise, once there is state),
    period, scale_block, state_bytes and, quantized, learned."""
    rep = Report()
    for name, p, st in items:
        shape = global_shape(p)
        rec = dict(name=name, shape=tuple(shape), numel=int(math.prod(shape)),
                   local_numel=local_tensor(p).numel(), dtype=str(p.dtype).replace("torch.", ""))
        if not st:
            rec.update(kind="pending", period=0, scale_block=0, state_bytes=0)
        elif "idx" in st:
            held = sum(nbytes(st[k]) for k in ("idx", "scale", "v", "v_row", "v_col") if k in st)
            mode = "factored" if "v_col" in st else ("elementwise" if st["period"] == 1 else "shared")
            rec.update(kind=KIND_QUANTIZED, mode=mode, period=st["period"], scale_block=st["scale_block"],
                       state_bytes=held, learned=bool(st["learned"]))
        else:
            held = sum(nbytes(st[k]) for k in ("exp_avg", "exp_avg_sq"))
            rec.update(kind=KIND_EXACT, mode="exact", period=0, scale_block=0, state_bytes=held)
        rep.append(rec)
    return rep
