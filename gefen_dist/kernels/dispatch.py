"""The one place that picks an implementation of Gefen's math for the data at hand.

:mod:`gefen_dist.core` holds the reference of every operation (pure torch/numpy, any device);
the native CPU kernels (:mod:`.first_step`, :mod:`.dp`, :mod:`.cpu`) and the Triton kernels
(:mod:`.triton_step`) implement the same math faster. Callers above the kernels (the engine, the
backends, the integrations) call the functions here and never choose for themselves; ``core``
never imports this package.

First-step statistics (period scores, the codebook histogram) and the codebook DP use the native
kernels for CPU data when they build (``GEFEN_DIST_NO_NATIVE=1`` disables them), else the
reference. Their results equal the reference's (bitwise for the histogram and the DP; within
the reference's own rounding for the period scores, see :mod:`.first_step`).
"""
from __future__ import annotations

from typing import Optional, Sequence

import numpy as np
import torch

from ..core import codebook as _codebook
from ..core import periods as _periods
from ..core.quant import NUM_BINS, block_histogram_eager

__all__ = ["log_sq", "period_partials", "grad_period_partials", "paper_period", "block_histogram",
           "solve_codebook", "dp_segments"]


def _first_step():
    from . import first_step

    return first_step if first_step.available() else None


def log_sq(grad: torch.Tensor) -> torch.Tensor:
    """:func:`gefen_dist.core.periods.log_sq_eager`, natively for CPU tensors when available (its
    logarithm may differ from torch's in the last bit)."""
    nat = _first_step()
    if nat is not None:
        out = nat.log_sq(grad)
        if out is not None:
            return out
    return _periods.log_sq_eager(grad)


def period_partials(l: torch.Tensor, start: int, numel: int, periods: Sequence[int]) -> _periods.PeriodPartials:
    """:func:`gefen_dist.core.periods.period_partials_eager` of ``l`` (float64), natively when
    available (one pass, chunk-local prefix sums: scores within ~1e-10 relative of the numpy path)."""
    nat = _first_step() if (l.numel() and len(periods)) else None
    if nat is not None:
        res = nat.period_partials(l, start, periods, is_log=True)
        if res is not None:
            return _periods.partials_from(start, int(l.numel()), periods, res)
    return _periods.period_partials_eager(l, start, numel, periods)


def grad_period_partials(grad: torch.Tensor, start: int, numel: int, periods: Sequence[int]
                         ) -> _periods.PeriodPartials:
    """:func:`period_partials` of ``log_sq(grad)`` for a gradient piece, fused: the native kernel
    computes ``l`` on the fly (never stored)."""
    g = grad.reshape(-1)
    nat = _first_step() if (g.numel() and len(periods)) else None
    if nat is not None:
        res = nat.period_partials(g, start, periods, is_log=False)
        if res is not None:
            return _periods.partials_from(start, int(g.numel()), periods, res)
    return period_partials(log_sq(g).cpu(), start, numel, periods)


def paper_period(grad: torch.Tensor) -> int:
    """:func:`gefen_dist.core.periods.paper_period` with the statistics of :func:`grad_period_partials`."""
    return _periods.paper_period(grad, partials=grad_period_partials)


def block_histogram(values: torch.Tensor, block: int, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """:func:`gefen_dist.core.quant.block_histogram_eager` (added to ``out``), natively for CPU
    tensors when available (bitwise the same counts)."""
    if out is None:
        out = torch.zeros(NUM_BINS, dtype=torch.int64)
    flat = values.reshape(-1)
    if flat.numel() == 0:
        return out
    if flat.numel() % block:
        raise ValueError(f"block_histogram: {flat.numel()} values are not a whole number of blocks of {block}")
    if flat.device.type == "cpu":
        nat = _first_step()
        if nat is not None and nat.block_histogram_(flat, block, out):
            return out
    return block_histogram_eager(flat, block, out)


def _dp_solver(backend: str):
    if backend not in ("auto", "native", "numpy"):
        raise ValueError(f"unknown codebook DP backend {backend!r} (expected 'auto', 'native' or 'numpy')")
    if backend == "numpy":
        return None
    from . import dp

    solver = dp.solver()
    if backend == "native" and solver is None:
        raise RuntimeError("native DP library unavailable (no compiler or GEFEN_DIST_NO_NATIVE)")
    return solver


def dp_segments(centres: np.ndarray, weights: np.ndarray, K: int = _codebook.NUM_CODEWORDS,
                backend: str = "auto"):
    """:func:`gefen_dist.core.codebook.dp_segments` with the DP solver of ``backend``: "auto" (native
    if it builds), "native" (error if unavailable) or "numpy"."""
    return _codebook.dp_segments(centres, weights, K, dp=_dp_solver(backend))


def solve_codebook(counts, backend: str = "auto") -> _codebook.CodebookResult:
    """:func:`gefen_dist.core.codebook.solve_codebook` with the DP solver of ``backend`` (as
    :func:`dp_segments`); the same codebook bit for bit whichever solver runs."""
    return _codebook.solve_codebook(counts, dp=_dp_solver(backend))
