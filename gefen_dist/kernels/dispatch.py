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

import functools
import logging
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import numpy as np
import torch

from ..core import codebook as _codebook
from ..core import periods as _periods
from ..core import span as _span
from ..core.quant import NUM_BINS, block_histogram_eager, nearest_codeword
from ..core.step import column_factors as _column_factors
from . import cpu as _cpu

logger = logging.getLogger(__name__)

__all__ = ["log_sq", "period_partials", "grad_period_partials", "paper_period", "block_histogram",
           "solve_codebook", "dp_segments", "StepImpl", "select", "select_nibbles", "native_cpu_usable", "triton_usable"]


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


def nearest(z: torch.Tensor, codebook: torch.Tensor) -> torch.Tensor:
    """:func:`gefen_dist.core.quant.nearest_codeword` (uint8 indices of float32 ``z``), by the native
    kernel's table lookup for CPU tensors when the library is available: the same indices
    (``tests/test_fused_cpu.py``: adversarial values and every float32 of magnitude 2^-8 to 1;
    all 2^32 patterns opt-in), about 10x faster than ``torch.searchsorted``."""
    if z.device.type == "cpu" and z.dtype == torch.float32 and codebook.device.type == "cpu" \
            and native_cpu_usable(z):
        return _cpu.nearest_lut(z, codebook)
    return nearest_codeword(z, codebook)


def block_histogram(values: torch.Tensor, block: int, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """:func:`gefen_dist.core.quant.block_histogram_eager` (added to ``out``), natively for CPU
    tensors when available (bitwise the same counts)."""
    flat = values.reshape(-1)
    if flat.numel() and flat.numel() % block == 0 and flat.device.type == "cpu":
        nat = _first_step()
        if out is None:
            out = torch.zeros(NUM_BINS, dtype=torch.int64)
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


def solve_codebook(counts, backend: str = "auto", k: int = _codebook.NUM_CODEWORDS) -> _codebook.CodebookResult:
    """:func:`gefen_dist.core.codebook.solve_codebook` (``k`` codewords) with the DP solver of ``backend``
    (as :func:`dp_segments`); the same codebook bit for bit whichever solver runs."""
    return _codebook.solve_codebook(counts, dp=_dp_solver(backend), k=k)


# ---------------------------------------------------------------------------------------------
# The step: which implementation updates a tensor of this device and dtype
# ---------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class StepImpl:
    """One implementation of Gefen's update, as the engine and the backends call it.

    ``quantized_step_`` / ``quantized_step_factored_`` have the contracts of
    :func:`gefen_dist.core.step.quantized_step_eager_` / :func:`~gefen_dist.core.step.quantized_step_factored_eager_`;
    ``column_sumsq`` that of :func:`gefen_dist.core.step.column_sumsq`. ``quantized_state_`` /
    ``factored_state_`` are the state updates without the parameter update (ZeRO-1's owners), and
    ``apply_compressed_`` / ``apply_factored_`` (the contracts of
    :func:`gefen_dist.core.apply.apply_compressed` / :func:`~gefen_dist.core.apply.apply_factored`)
    the parameter update alone from the state functions' results (ZeRO-1's replicas), in this
    implementation's own arithmetic, so state function + applier equal its full step bitwise.
    ``span_statistics`` / ``span_update_``: the two phases of a tensor kept per block of rows (D16),
    the contracts of :func:`gefen_dist.core.span.span_statistics` / :func:`~gefen_dist.core.span.span_update_`,
    ``span_apply_`` the second phase's indices and parameter update from the updated state (what
    ``span_update_`` runs after :func:`~gefen_dist.core.span.span_state_`; the update of a ``rows8``
    tensor, D19), and ``span_apply_indices_`` the parameter update from given indices (ZeroGefen's
    other ranks; :func:`~gefen_dist.core.span.span_apply_indices_`).
    ``column_factors``: ``sqrt(v_col / mean(v_col))`` as this implementation's factored step computes
    it (what its ``apply_factored_`` must be given). Every implementation has them all (the Triton
    ones: :mod:`.triton_state`)."""

    name: str
    quantized_step_: Callable
    quantized_step_factored_: Callable
    column_sumsq: Callable
    quantized_state_: Optional[Callable] = None
    factored_state_: Optional[Callable] = None
    apply_compressed_: Optional[Callable] = None
    apply_factored_: Optional[Callable] = None
    span_statistics: Callable = _span.span_statistics  # D16's two phases (the reference's contracts)
    span_update_: Callable = _span.span_update_
    span_apply_indices_: Callable = _span.span_apply_indices_  # the second phase's update from given indices
    column_factors: Callable = _column_factors  # sqrt(v_col / mean(v_col)) as this implementation's appliers read it
    # many ranges' appliers at once (factored and compressed; the Triton kernels' ApplyMany): built
    # with (ranges, device), then .run(buffer address, codebook, per-tensor scalars, column factors)
    apply_many: Optional[Callable] = None
    # many ranges' owner state updates at once (the Triton kernels' StateMany): built with (ranges,
    # device), then .run(gradients, codebook, **state hyperparameters)
    state_many: Optional[Callable] = None
    grad_in_param_dtype: bool = True  # the kernels read g in the parameter's dtype; the reference any dtype
    # second_moment="nibbles" (D20): the contract of gefen_dist.core.nibbles.nibble_step_factored_eager_
    nibble_step_factored_: Optional[Callable] = None
    span_apply_: Callable = _span.span_apply_  # span_update_'s per-element part from the updated state (D16, D19)
    col_blocks: bool = False  # quantized_step_factored_ takes column blocks (D21: a [rows, K] v_row)

    def grad_for(self, grad: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
        """The gradient as this implementation reads it next to ``param``."""
        return grad.to(param.dtype) if self.grad_in_param_dtype else grad


@functools.lru_cache(maxsize=None)
def _eager() -> StepImpl:
    from ..core import apply as ap
    from ..core import nibbles as nb
    from ..core import step as s

    return StepImpl("eager", s.quantized_step_eager_, s.quantized_step_factored_eager_, s.column_sumsq,
                    s.quantized_state_eager_, s.factored_state_eager_, ap.apply_compressed, ap.apply_factored,
                    grad_in_param_dtype=False, nibble_step_factored_=nb.nibble_step_factored_eager_, col_blocks=True)


@functools.lru_cache(maxsize=None)
def _native_cpu() -> StepImpl:
    from . import cpu, cpu_nibbles, cpu_span

    return StepImpl("cpu", cpu.quantized_step_, cpu.quantized_step_factored_, cpu.column_sumsq,
                    cpu.quantized_state_, cpu.factored_state_, cpu.apply_compressed_, cpu.apply_factored_,
                    cpu_span.span_statistics, cpu_span.span_update_, cpu_span.span_apply_indices_,
                    span_apply_=cpu_span.span_apply_, nibble_step_factored_=cpu_nibbles.nibble_step_factored_,
                    col_blocks=True)


@functools.lru_cache(maxsize=None)
def _triton() -> StepImpl:
    from ..core.step import column_sumsq
    from . import triton_span as span
    from . import triton_state as zs
    from . import triton_step as tri

    from . import triton_nibbles as nib

    return StepImpl("triton", tri.quantized_step_, tri.quantized_step_factored_, column_sumsq,
                    zs.quantized_state_, zs.factored_state_, zs.apply_compressed_, zs.apply_factored_,
                    span_statistics=span.span_statistics, span_update_=span.span_update_,
                    span_apply_indices_=span.span_apply_indices_, span_apply_=span.span_apply_,
                    column_factors=zs.column_factors,
                    apply_many=zs.ApplyMany, state_many=zs.StateMany,
                    nibble_step_factored_=nib.nibble_step_factored_, col_blocks=True)


_KERNEL_DTYPES = (torch.float32, torch.bfloat16)


@functools.lru_cache(maxsize=None)
def _warn_no_triton() -> None:
    logger.warning("Gefen: CUDA parameters but triton is not importable, so they step with the eager torch path "
                   "(20-50x slower per step than the Triton kernels on an H200, docs/benchmarks.md); install "
                   "triton (pip install triton) to use the kernels.")


def triton_usable(t: torch.Tensor) -> bool:
    """Whether the Triton kernels can step tensor ``t`` (a CUDA float32/bfloat16 tensor, triton
    importable and working on its device); logs once per process when triton is missing."""
    if t.device.type != "cuda" or t.dtype not in _KERNEL_DTYPES:
        return False
    try:
        from . import triton_step as tri
    except ImportError:
        ok = False
    else:
        ok = tri.available(t.device)
    if not ok:
        _warn_no_triton()
    return ok


def native_cpu_usable(t: torch.Tensor) -> bool:
    """Whether the native CPU kernel can step tensor ``t`` (a CPU float32/bfloat16 tensor, the
    library built)."""
    if t.device.type != "cpu" or t.dtype not in _KERNEL_DTYPES:
        return False
    return _cpu.available()


def select_nibbles(t: torch.Tensor, fused: Optional[bool] = None) -> StepImpl:
    """The implementation that steps tensor ``t`` under ``second_moment="nibbles"`` (D20): as
    :func:`select` (the native CPU kernel, the Triton kernel, else the eager reference), one tensor per
    call; on CPU the optimizer's multi-tensor batch steps its tensors with the same kernel
    (:class:`gefen_dist.kernels.cpu_multi.NibbleStep`), on CUDA there is no multi-tensor kernel for it yet."""
    return select(t, fused)


def select(t: torch.Tensor, fused: Optional[bool] = None) -> StepImpl:
    """The implementation that steps tensor ``t``: with ``fused`` not False, the native CPU kernel
    for CPU float32/bfloat16 tensors or the Triton kernels for CUDA ones when they are usable; the
    eager reference otherwise (any device and dtype)."""
    if fused is not False:
        if native_cpu_usable(t):
            return _native_cpu()
        if triton_usable(t):
            return _triton()
    return _eager()
