"""Applying a Gefen update that arrives in compressed form (pure math, no ``torch.distributed``).

ZeRO-1 (:mod:`gefen_dist.zero.optimizer`) sends each owner's update as new ``idx`` bytes plus per-block
absmax scales ``M`` and step sizes (``sigma`` per block, or ``sqrt(v_row)`` per row for the
factored second moment); every rank then applies it to its replica. These functions are the
reference appliers: they replay the parameter update of
:func:`gefen_dist.core.step.quantized_step_eager_` /
:func:`~gefen_dist.core.step.quantized_step_factored_eager_` operation by operation, so a replica
equals single-process eager :class:`~gefen_dist.Gefen` bitwise. Each implementation of the step
brings its own appliers (:class:`gefen_dist.kernels.dispatch.StepImpl`; the native CPU kernel's
are entry points of its C library), so the order of an implementation's arithmetic is written once.
"""
from __future__ import annotations

import math

import torch

from .step import _EAGER_CHUNK_ELEMS, apply_, column_factors, ema_, inv_rms_, row_factors

__all__ = ["apply_compressed", "apply_factored", "update_v_col"]


def update_v_col(st: dict, col_mean_sq: torch.Tensor, hp: dict, factors=column_factors) -> torch.Tensor:
    """``v_col`` <- EMA (every rank, identically); returns the column factor
    ``sqrt(v_col / mean(v_col))`` by ``factors`` (default: exactly as
    :func:`quantized_step_factored_eager_` does; an implementation's own, for its appliers)."""
    v_col = st["v_col"]
    ema_(v_col, col_mean_sq.view_as(v_col), hp["beta2"])
    return factors(v_col)


def apply_factored(pf: torch.Tensor, idx: torch.Tensor, M: torch.Tensor, rsq: torch.Tensor,
                   col_f: torch.Tensor, cb: torch.Tensor, B: int, slab: int, hp: dict,
                   row0: int = 0, row_block: int = 0, col_blocks: int = 1) -> None:
    """``p <- p*(1-lr*wd) - ((C[idx]*M) * sigma)*lr`` with ``sigma_ij = (1/((sqrt(v_row_i) *
    col_f_j)/sqrt(bc2) + eps)) * (1/bc1)``: quantized_step_factored_eager_'s update, same order.
    ``col_f`` is ``[slab]``, or ``[G, slab]`` per block of ``row_block`` rows (D12), this range's
    first row being global row ``row0``. ``col_blocks`` ``K`` (D21): ``rsq`` holds ``K`` per row, one per
    block of ``slab / K`` columns, and ``col_f`` is normalised per block."""
    K = int(col_blocks)
    n = pf.numel()
    lr, wd, eps, bc1 = hp["lr"], hp["weight_decay"], hp["eps"], hp["bc1"]
    sqrt_bc2 = math.sqrt(hp["bc2"])
    rows = n // slab
    rows_per = max(1, _EAGER_CHUNK_ELEMS // slab)
    for r0 in range(0, rows, rows_per):
        r1 = min(rows, r0 + rows_per)
        ib = idx[r0 * slab:r1 * slab]
        a = M[r0 * slab // B:r1 * slab // B].view(-1, 1)
        q = cb.index_select(0, ib.int()).view(-1, B)
        cf = row_factors(col_f, row0, r0, r1, row_block)
        p = pf[r0 * slab:r1 * slab].view(r1 - r0, slab)
        rms = (rsq[r0 * K:r1 * K].view(r1 - r0, K).repeat_interleave(slab // K, dim=1) * col_f if K > 1
               else rsq[r0:r1].unsqueeze(1) * cf)
        sigma = inv_rms_(rms, eps, bc1, sqrt_bc2)
        apply_(p, (q * a).view(r1 - r0, slab), sigma, lr, wd, hp.get("bound"))


def apply_compressed(pf: torch.Tensor, idx: torch.Tensor, M: torch.Tensor, sigma: torch.Tensor,
                     cb: torch.Tensor, P: int, hp: dict) -> None:
    """``p <- p*(1-lr*wd) - ((C[idx]*M)*sigma)*lr``: quantized_step_eager_'s update, same order."""
    n = pf.numel()
    lr, wd = hp["lr"], hp["weight_decay"]
    chunk = max(P, (_EAGER_CHUNK_ELEMS // P) * P)
    for c0 in range(0, n, chunk):
        c1 = min(n, c0 + chunk)
        ib = idx[c0:c1].view(-1, P)
        a = M[c0 // P:c1 // P].view(-1, 1)
        sg = sigma[c0 // P:c1 // P].view(-1, 1)
        # cb.index_select(int32) reads the same codewords as the eager cb[idx.long()], 5x faster
        q = cb.index_select(0, ib.reshape(-1).int()).view(-1, P)
        apply_(pf[c0:c1], q * a, sg, lr, wd, hp.get("bound"))
