"""The Triton step of tensors kept per block of rows (D16, ``narrow_rows="span"``) on CUDA.

The same two phases as :func:`gefen_dist.core.span.span_statistics` and
:func:`~gefen_dist.core.span.span_update_` (and the update alone from given indices,
:func:`~gefen_dist.core.span.span_apply_indices_`), with the same signatures, as the native CPU ones
(:mod:`gefen_dist.kernels.cpu_span`). One program per block of rows (about 1024 elements, in tiles of
rows x a power of two of columns): the first phase is one launch plus a torch sum of the blocks'
column sums, the second one launch after the replicated block state (a few floats per block and
column, :func:`~gefen_dist.core.span.span_state_`, torch operations as in the reference).

Results against the reference: the first moment, the block maxima, the indices and the parameter
are its float32 operations in its order (bitwise through the interpreter, ``tests/test_triton_step.py``,
with the GPU's numerics flags as the other kernels: :mod:`gefen_dist.kernels.triton_kernels`); the
float64 sums of ``g^2`` are added in another order. Pieces that cut rows (a DeepSpeed partition
edge) are masked element by element; other dtypes, devices without the kernel or non-contiguous
tensors take the reference.
"""
from __future__ import annotations

from contextlib import nullcontext

import torch

from ..core import span as _ref
from ..core.step import column_factors
from .triton_kernels import _HAVE_TRITON, _interpret, _kernel
from .triton_multi import multi_launch_options
from .triton_tables import _device_table, _step_scalars

_TILE = 1024  # elements per tile of a program (rows x a power of two of columns)
_WARPS = 8  # 4 elements per thread, every register ptxas wants (MultiStep's maxnreg): no spills on sm_90


def _usable(sp: _ref.SpanPiece, *ts: torch.Tensor) -> bool:
    if not _HAVE_TRITON:
        return False
    dev = ts[0].device
    if dev.type != "cuda" and not _interpret():
        return False
    return all(t.device == dev and t.is_contiguous() for t in ts)


def _geometry(sp: _ref.SpanPiece):
    """(first block, programs, tile rows R, tile columns SP) of a piece: a program per block touched,
    or (blocks of one row, D19) per tile of ``R`` rows."""
    b0 = sp.row0 // sp.k
    SP = 1 << max(0, (sp.slab - 1).bit_length())
    R = max(1, _TILE // SP)
    if sp.k == 1:
        return b0, -(-sp.nrows // R), R, SP
    nbp = (sp.row0 + sp.nrows - 1) // sp.k - b0 + 1 if sp.nrows else 0
    return b0, nbp, R, SP


def _ctx(device: torch.device):
    return torch.cuda.device(device) if device.type == "cuda" else nullcontext()


def _bits(t: torch.Tensor) -> torch.Tensor:
    """bfloat16 tensors travel as int16 bits (converted by hand in the kernels)."""
    return t.view(torch.int16) if t.dtype == torch.bfloat16 else t


def span_statistics(grad, idx, scale, codebook, sp: _ref.SpanPiece, beta1: float, bid=None):
    """:func:`gefen_dist.core.span.span_statistics`, by the Triton kernel (``m`` flat, float32)."""
    if grad.dtype not in (torch.float32, torch.bfloat16) or not _usable(sp, grad, idx, scale):
        return _ref.span_statistics(grad, idx, scale, codebook, sp, beta1, bid)
    dev = grad.device
    b0, nbp, R, SP = _geometry(sp)
    tab = _device_table(codebook, dev)
    scalars, consts = _step_scalars(dev, tab, lr=0.0, beta1=beta1, beta2=0.0, eps=0.0, weight_decay=0.0,
                                    bc1=1.0, bc2=1.0)
    m = torch.empty(sp.numel, dtype=torch.float32, device=dev)
    part = torch.empty((nbp, sp.slab), dtype=torch.float64, device=dev)
    blk = torch.zeros(sp.nb, dtype=torch.float64, device=dev)
    amax = torch.zeros(sp.nb, dtype=torch.float32, device=dev)
    if nbp:
        sc = scale if scale.dtype == torch.float32 else scale.float()
        geo = (sp.nrows, sp.slab, sp.row0) if sp.k == 1 else (sp.nrows, sp.slab, sp.k, sp.row0, b0)
        with _ctx(dev):
            _kernel("span_rows_stats" if sp.k == 1 else "span_stats")[(nbp,)](
                _bits(grad), idx, sc, tab.cb, m, part, blk, amax, *geo, sp.lead,
                sp.numel, scalars[0], LERP_SMALL=consts["LERP_SMALL"], FUSED_LERP=consts["FUSED_LERP"],
                IS_BF16=grad.dtype == torch.bfloat16, R=R, SP=SP, num_warps=_WARPS, enable_fp_fusion=False,
                **multi_launch_options())
    return m, part.sum(dim=0), blk, amax


def _launch_update(param, m, idx, scale, v_blk, v_col, codebook, sp, *, apply, lr, eps, weight_decay, bc1, bc2,
                   bound):
    dev = param.device
    b0, nbp, R, SP = _geometry(sp)
    if not nbp:
        return
    tab = _device_table(codebook, dev)
    scalars, consts = _step_scalars(dev, tab, lr=lr, beta1=0.0, beta2=0.0, eps=eps, weight_decay=weight_decay,
                                    bc1=bc1, bc2=bc2, bound=bound)
    _, _, _, sqrt_bc2, eps32, inv_bc1, lr32, decay, lut_h, lut_nbm1, ubound = scalars
    rms = v_blk.sqrt()  # float32, as the reference's sqrt per block
    cf = column_factors(v_col).contiguous()
    geo = (sp.nrows, sp.slab, sp.row0) if sp.k == 1 else (sp.nrows, sp.slab, sp.k, sp.row0, b0)
    with _ctx(dev):
        _kernel("span_rows_update" if sp.k == 1 else "span_update")[(nbp,)](
            _bits(param), m if m is not None else rms, idx, scale, rms, cf, tab.cb, tab.kernel_table(2),
            *geo, sp.lead, sp.numel, tab.scan_steps,
            sqrt_bc2, eps32, inv_bc1, lr32, decay, lut_h, lut_nbm1, ubound,
            APPLY=apply, HAS_WD=consts["HAS_WD"], LUT_FAST=consts["LUT_FAST"],
            IS_BF16=param.dtype == torch.bfloat16, R=R, SP=SP, num_warps=_WARPS, enable_fp_fusion=False,
            **multi_launch_options())
    for t in (param,) if apply else (param, idx):
        torch.autograd.graph.increment_version(t)


def span_update_(param, idx, scale, v_blk, v_col, m, col_sum, blk_sum, amax, codebook, sp: _ref.SpanPiece,
                 **hp) -> None:
    """:func:`gefen_dist.core.span.span_update_`: the replicated block state
    (:func:`~gefen_dist.core.span.span_state_`), then :func:`span_apply_`."""
    _ref.span_state_(scale, v_blk, v_col, col_sum, blk_sum, amax, sp, hp["beta2"])
    span_apply_(param, idx, scale, v_blk, v_col, m, codebook, sp, **hp)


def span_apply_(param, idx, scale, v_blk, v_col, m, codebook, sp: _ref.SpanPiece, **hp) -> None:
    """:func:`gefen_dist.core.span.span_apply_` (the indices and the parameter from the updated block
    state), by the Triton kernel for a contiguous float32/bfloat16 ``param`` (``hp``: its keyword
    arguments; ``nearest`` and ``bid`` are the reference's, unused here)."""
    if (param.dtype not in (torch.float32, torch.bfloat16) or m.dtype != torch.float32 or scale.dtype != torch.float32
            or not _usable(sp, param, idx, scale, v_blk, v_col, m)):
        return _ref.span_apply_(param, idx, scale, v_blk, v_col, m, codebook, sp, **hp)
    _launch_update(param, m.reshape(-1), idx, scale, v_blk, v_col, codebook, sp, apply=False,
                   **{k: hp.get(k) for k in ("lr", "eps", "weight_decay", "bc1", "bc2", "bound")})


def span_apply_indices_(param, idx, scale, v_blk, v_col, codebook, sp: _ref.SpanPiece, *, lr, eps, weight_decay, bc1,
                        bc2, bound=None, bid=None, **_) -> None:
    """:func:`gefen_dist.core.span.span_apply_indices_` (the update alone from given new indices), by
    the Triton kernel for a contiguous float32/bfloat16 ``param`` (any piece; the reference takes whole
    rows)."""
    if (param.dtype not in (torch.float32, torch.bfloat16) or idx.dtype != torch.uint8 or scale.dtype != torch.float32
            or not _usable(sp, param, idx, scale, v_blk, v_col)):
        return _ref.span_apply_indices_(param, idx, scale, v_blk, v_col, codebook, sp, lr=lr, eps=eps,
                                        weight_decay=weight_decay, bc1=bc1, bc2=bc2, bound=bound, bid=bid)
    _launch_update(param, None, idx, scale, v_blk, v_col, codebook, sp, apply=True, lr=lr, eps=eps,
                   weight_decay=weight_decay, bc1=bc1, bc2=bc2, bound=bound)


__all__ = ["span_statistics", "span_update_", "span_apply_", "span_apply_indices_"]
