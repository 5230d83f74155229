"""The native CPU step of tensors kept per block of rows (D16, ``narrow_rows="span"``).

The same two phases as :func:`gefen_dist.core.span.span_statistics` and
:func:`~gefen_dist.core.span.span_update_`, with the same signatures, so that every backend runs
them in either form (a sharded piece computes its statistics, the caller reduces them over the
ranks, every rank applies the update). The per-element work runs in ``gefen_span_stats`` and
``gefen_span_update`` of ``csrc/gefen_step.c``; the replicated block state (a few floats per block
and column) is :func:`~gefen_dist.core.span.span_state_`, torch operations, as in the reference.

Results against the reference: the first moment, the block maxima, the indices and the parameter
are its float32 operations in its order (bitwise, ``tests/test_span.py``); the float64 column and
block sums of ``g^2`` are added in another order (a difference in the last float64 bits that the
float32 rounding of their means does not show in practice, as for the factored column sums). Falls
back to the reference for tensors the kernel does not take (not CPU, a dtype other than
float32/bfloat16) or without the native library.
"""
from __future__ import annotations

import ctypes
import math
from typing import Optional

import torch

from ..core import span as _ref
from ..core.step import column_factors
from .cpu import _lib, _make_args
from .cpu_tables import codebook_table

_KERNEL_DTYPES = (torch.float32, torch.bfloat16)
_COL_SEGS = 16  # csrc/gefen_step.c SPAN_COL_SEGS: fixed segments of blocks for the column sums


def _usable(*ts: torch.Tensor) -> Optional[ctypes.CDLL]:
    if any(t.device.type != "cpu" for t in ts):
        return None
    return _lib()


def _args(t: torch.Tensor, n: int, tab, **kw):
    """The kernel's argument struct for ``n`` elements of ``t``'s dtype (hyperparameters as
    :func:`gefen_dist.kernels.cpu._make_args` rounds them)."""
    return _make_args(t, n, 1, 1, tab, simd=1, **kw)


def span_statistics(grad, idx, scale, codebook, sp: _ref.SpanPiece, beta1: float, bid=None):
    """:func:`gefen_dist.core.span.span_statistics`, natively for CPU float32/bfloat16 gradients."""
    lib = _usable(grad, idx, scale)
    if lib is None or grad.dtype not in _KERNEL_DTYPES:
        return _ref.span_statistics(grad, idx, scale, codebook, sp, beta1, bid)
    g = grad.contiguous()
    ix = idx.contiguous()
    sc = scale.detach().to(torch.float32).contiguous()
    tab = codebook_table(codebook)
    n = sp.numel
    a = _args(g, n, tab, lr=0.0, beta1=beta1, beta2=0.0, eps=0.0, weight_decay=0.0, bc1=1.0, bc2=1.0,
              bound=None)
    m = torch.empty(n, dtype=torch.float32)  # flat: a piece may cut rows (a DeepSpeed partition edge)
    col = torch.zeros(sp.slab, dtype=torch.float64)
    blk = torch.zeros(sp.nb, dtype=torch.float64)
    amax = torch.zeros(sp.nb, dtype=torch.float32)
    if n:
        acc = torch.empty(_COL_SEGS * sp.k * sp.slab, dtype=torch.float64)
        lib.gefen_span_stats(ctypes.byref(a), g.data_ptr(), ix.data_ptr(), sc.data_ptr(), tab.cb.data_ptr(),
                             n, sp.slab, sp.k, sp.start, m.data_ptr(), col.data_ptr(), blk.data_ptr(),
                             amax.data_ptr(), acc.data_ptr())
    return m, col, blk, amax


def _update_args(param, v_blk, v_col, codebook, sp, lr, beta1, beta2, eps, weight_decay, bc1, bc2, bound):
    """The kernel's arguments of the second phase's per-element part: the struct, the codebook
    table, ``sqrt(v_blk)`` per block and the column factors tiled over a block (float32, as the
    reference computes them), and the bound (+inf for none)."""
    tab = codebook_table(codebook)
    a = _args(param, sp.numel, tab, lr=lr, beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay, bc1=bc1,
              bc2=bc2, bound=bound)
    rms = v_blk.sqrt()  # float32, as the reference's sqrt per block
    colt = column_factors(v_col).repeat(sp.k)  # tiled over a block of k rows
    return a, tab, rms, colt, math.inf if bound is None else float(bound)


def span_update_(param, idx, scale, v_blk, v_col, m, col_sum, blk_sum, amax, codebook, sp: _ref.SpanPiece,
                 **hp) -> None:
    """:func:`gefen_dist.core.span.span_update_`: the replicated block state
    (:func:`~gefen_dist.core.span.span_state_`), then :func:`span_apply_`."""
    _ref.span_state_(scale, v_blk, v_col, col_sum, blk_sum, amax, sp, hp["beta2"])
    span_apply_(param, idx, scale, v_blk, v_col, m, codebook, sp, **hp)


def span_apply_(param, idx, scale, v_blk, v_col, m, codebook, sp: _ref.SpanPiece, **hp) -> None:
    """:func:`gefen_dist.core.span.span_apply_` (the indices and the parameter from the updated block
    state), natively for a contiguous CPU float32/bfloat16 ``param`` (``hp``: its keyword arguments;
    ``nearest`` and ``bid`` are the reference's, unused here)."""
    lib = _usable(param, idx, scale, v_blk, v_col, m)
    if (lib is None or param.dtype not in _KERNEL_DTYPES or not param.is_contiguous() or not idx.is_contiguous()
            or m.dtype != torch.float32):
        return _ref.span_apply_(param, idx, scale, v_blk, v_col, m, codebook, sp, **hp)
    lr, eps, weight_decay, bc1, bc2 = (hp[k] for k in ("lr", "eps", "weight_decay", "bc1", "bc2"))
    bound, beta1, beta2 = hp.get("bound"), hp.get("beta1", 0.0), hp.get("beta2", 0.0)
    n = sp.numel
    if n == 0:
        return
    a, tab, rms, colt, lim = _update_args(param, v_blk, v_col, codebook, sp, lr, beta1, beta2, eps,
                                          weight_decay, bc1, bc2, bound)
    mc = m.contiguous()
    sc = scale.contiguous()
    lib.gefen_span_update(ctypes.byref(a), param.data_ptr(), mc.data_ptr(), idx.data_ptr(), sc.data_ptr(),
                          rms.data_ptr(), colt.data_ptr(), tab.cb.data_ptr(), tab.lut.data_ptr(), n, sp.slab, sp.k,
                          sp.start, lim)
    for t in (param, idx):
        torch.autograd.graph.increment_version(t)


def span_apply_indices_(param, idx, scale, v_blk, v_col, codebook, sp: _ref.SpanPiece, *, lr, eps, weight_decay, bc1,
                        bc2, bound=None, bid=None, **_) -> None:
    """:func:`gefen_dist.core.span.span_apply_indices_` (the parameter update alone from given new
    indices: ZeroGefen's other ranks), natively for a contiguous CPU float32/bfloat16 ``param``: the
    second phase's operations, so bitwise the reference's and the native phase's."""
    lib = _usable(param, idx, scale, v_blk, v_col)
    if (lib is None or param.dtype not in _KERNEL_DTYPES or not param.is_contiguous() or idx.dtype != torch.uint8
            or not sp.whole_rows):
        return _ref.span_apply_indices_(param, idx, scale, v_blk, v_col, codebook, sp, lr=lr, eps=eps,
                                        weight_decay=weight_decay, bc1=bc1, bc2=bc2, bound=bound, bid=bid)
    if sp.numel == 0:
        return
    ix = idx.contiguous()
    sc = scale.detach().to(torch.float32).contiguous()
    a, tab, rms, colt, lim = _update_args(param, v_blk, v_col, codebook, sp, lr, 0.0, 0.0, eps, weight_decay,
                                          bc1, bc2, bound)
    lib.gefen_span_update(ctypes.byref(a), param.data_ptr(), None, ix.data_ptr(), sc.data_ptr(), rms.data_ptr(),
                          colt.data_ptr(), tab.cb.data_ptr(), tab.lut.data_ptr(), sp.numel, sp.slab, sp.k, sp.start,
                          lim)
    torch.autograd.graph.increment_version(param)
