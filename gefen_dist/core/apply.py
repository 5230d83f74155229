"""Applying a Gefen update that arrives in compressed form (pure math, no ``torch.distributed``).

ZeRO-1 (:mod:`gefen_dist.zero`) sends each owner's update as new ``idx`` bytes plus per-block
absmax scales ``M`` and step sizes (``sigma`` per block, or ``sqrt(v_row)`` per row for the
factored second moment); every rank then applies it to its replica with these functions. They
replay the parameter update of :func:`gefen_dist.core.step.quantized_step_eager_` /
:func:`~gefen_dist.core.step.quantized_step_factored_eager_` operation by operation, or, with
``kernel_order=True``, the float32 sequence of the native CPU kernel, so a replica equals
single-process :class:`~gefen_dist.Gefen` with the same ``fused`` setting bitwise.
"""
from __future__ import annotations

import math

import torch

from .step import _EAGER_CHUNK_ELEMS, column_factors, row_factors

__all__ = ["apply_compressed", "apply_factored", "update_v_col"]


def update_v_col(st: dict, col_mean_sq: torch.Tensor, hp: dict) -> torch.Tensor:
    """``v_col`` <- EMA (every rank, identically); returns the column factor
    ``sqrt(v_col / mean(v_col))`` exactly as :func:`quantized_step_factored_eager_` does."""
    v_col = st["v_col"]
    v_col.mul_(hp["beta2"]).add_(col_mean_sq.view_as(v_col), alpha=1.0 - hp["beta2"])
    return column_factors(v_col)


def apply_factored(pf: torch.Tensor, idx: torch.Tensor, M: torch.Tensor, rsq: torch.Tensor,
                   col_f: torch.Tensor, cb: torch.Tensor, B: int, slab: int, hp: dict,
                   kernel_order: bool = False, row0: int = 0, row_block: int = 0) -> None:
    """``p <- p*(1-lr*wd) - ((C[idx]*M) * sigma)*lr`` with ``sigma_ij = (1/((sqrt(v_row_i) *
    col_f_j)/sqrt(bc2) + eps)) * (1/bc1)``: quantized_step_factored_eager_'s update, same order.
    ``col_f`` is ``[slab]``, or ``[G, slab]`` per block of ``row_block`` rows (D12), this range's
    first row being global row ``row0``."""
    n = pf.numel()
    lr, wd, eps, bc1 = hp["lr"], hp["weight_decay"], hp["eps"], hp["bc1"]
    sqrt_bc2 = math.sqrt(hp["bc2"])
    decay = 1.0 - lr * wd
    rows = n // slab
    rows_per = max(1, _EAGER_CHUNK_ELEMS // slab)
    for r0 in range(0, rows, rows_per):
        r1 = min(rows, r0 + rows_per)
        ib = idx[r0 * slab:r1 * slab]
        a = M[r0 * slab // B:r1 * slab // B].view(-1, 1)
        q = cb.index_select(0, ib.int()).view(-1, B)
        cf = row_factors(col_f, row0, r0, r1, row_block)
        if kernel_order:
            # the native kernel's float32 sequence: srs = sqrt(v_row)*(1/sqrt(bc2)),
            # sigma = (1/bc1) / (col_f*srs + eps), u = C[idx] * (sigma * (M*lr))
            f32 = lambda x: torch.tensor(x, dtype=torch.float32)  # noqa: E731
            srs = rsq[r0:r1] * (f32(1.0) / f32(sqrt_bc2))
            sigma = f32(1.0 / bc1) / ((cf * srs.unsqueeze(1)) + f32(eps))
            us = (a * f32(lr)).view(r1 - r0, slab // B, 1)
            u = q.view(r1 - r0, slab // B, B) * (sigma.view(r1 - r0, slab // B, B) * us)
            u = u.view(r1 - r0, slab)
        else:
            denom = (rsq[r0:r1].unsqueeze(1) * cf).div_(sqrt_bc2).add_(eps)
            sigma = denom.reciprocal_().mul_(1.0 / bc1)
            u = (q * a).view(r1 - r0, slab).mul_(sigma).mul_(lr)
        p = pf[r0 * slab:r1 * slab].view(r1 - r0, slab)
        if p.dtype == torch.float32:
            if wd != 0.0:
                p.mul_(decay)
            p.sub_(u)
        else:
            p32 = p.float()
            if wd != 0.0:
                p32.mul_(decay)
            p32.sub_(u)
            p.copy_(p32)


def apply_compressed(pf: torch.Tensor, idx: torch.Tensor, M: torch.Tensor, sigma: torch.Tensor,
                     cb: torch.Tensor, P: int, hp: dict, kernel_order: bool = False) -> None:
    """``p <- p*(1-lr*wd) - ((C[idx]*M)*sigma)*lr``: quantized_step_eager_'s update, same order;
    with ``kernel_order`` the native kernel's ``C[idx] * ((M*sigma)*lr)`` (per-block coefficient
    first), so replicas equal single-process Gefen with the same ``fused`` setting bitwise."""
    n = pf.numel()
    lr, wd = hp["lr"], hp["weight_decay"]
    decay = 1.0 - lr * wd
    chunk = max(P, (_EAGER_CHUNK_ELEMS // P) * P)
    for c0 in range(0, n, chunk):
        c1 = min(n, c0 + chunk)
        ib = idx[c0:c1].view(-1, P)
        a = M[c0 // P:c1 // P].view(-1, 1)
        # cb.index_select(int32) reads the same codewords as the eager cb[idx.long()], 5x faster
        q = cb.index_select(0, ib.reshape(-1).int()).view(-1, P)
        if kernel_order:
            u = q * (a * sigma[c0 // P:c1 // P].view(-1, 1)).mul_(lr)
        else:
            u = (q * a).view(-1, P).mul_(sigma[c0 // P:c1 // P].view(-1, 1)).mul_(lr)
        p = pf[c0:c1]
        if p.dtype == torch.float32:
            if wd != 0.0:
                p.mul_(decay)
            p.sub_(u.view(-1))
        else:
            p32 = p.float()
            if wd != 0.0:
                p32.mul_(decay)
            p32.sub_(u.view(-1))
            p.copy_(p32)
