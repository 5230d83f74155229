"""Gefen's state of a tensor from AdamW's moments: a warm start from ``exp_avg`` and ``exp_avg_sq``.

A ``torch.optim.AdamW`` (or Adam) state holds, per element, the first moment ``m`` (``exp_avg``)
and the second moment ``v`` (``exp_avg_sq``), both EMAs of the same gradients Gefen's state
summarises. Gefen's state of the same tensor after the same gradients would hold:

* the first moment quantized: per scale block (``B`` elements of a row, or a block of whole rows,
  D16) its absmax ``M`` and the nearest codeword of ``m / M`` (what every step stores);
* the second moment at its layout's resolution, which for every layout is a mean of the
  per-element EMA, because a mean of EMAs is the EMA of the means: the block mean of ``v``
  (``shared``, ``elementwise``: ``P = 1``), its row means and its column means per block of rows
  (``factored``, D12), its block means and column means (D16's blocks of rows).

So the conversion is exact for the second moment (up to float32 rounding of a float64 mean) and a
quantization of the first, as a step would make it. Whole tensors only: the caller passes the
global ``m`` and ``v`` (a sharded checkpoint must be gathered first). Nothing here learns the
period or the codebook; :mod:`gefen_dist.optim.adamw_import` does, as the first step would.
"""
from __future__ import annotations

from typing import Callable, Dict, Optional, Sequence

import torch

from . import span as _span
from .periods import row_slab
from .quant import nearest_codeword
from .step import quantize

__all__ = ["state_from_moments"]


def _rows(t: torch.Tensor, shape: Sequence[int]) -> torch.Tensor:
    """``t`` as float64 ``[rows, slab]`` (the means are taken in float64, then rounded once)."""
    return t.detach().reshape(int(shape[0]), row_slab(shape)).double()


def _quantize_blocks(m: torch.Tensor, B: int, codebook: torch.Tensor, nearest: Callable) -> tuple:
    """``idx`` (uint8, ``m``'s shape) and ``scale`` (``[rows, slab / B]``) of a ``[rows, slab]`` float32 ``m``."""
    rows, slab = m.shape
    blocks = m.view(rows, slab // B, B)
    scale = blocks.abs().amax(dim=2)
    idx = quantize(blocks, scale.unsqueeze(2), codebook, nearest)
    return idx.view(rows, slab), scale


def _span_state(m: torch.Tensor, v: torch.Tensor, shape: Sequence[int], codebook: torch.Tensor,
                nearest: Callable) -> Dict[str, torch.Tensor]:
    """D16's layout: per block of whole rows its absmax and its mean of ``v``; ``v_col`` the column
    means of ``v`` over every row."""
    sp = _span.SpanPiece.of(shape)
    bid = sp.block_ids(m.device)
    rows32 = m.reshape(sp.nrows, sp.slab)
    scale = torch.zeros(sp.nb, dtype=torch.float32, device=m.device)
    if sp.nrows:
        scale.scatter_reduce_(0, bid, rows32.abs().amax(dim=1), "amax")
    idx = quantize(rows32, scale.index_select(0, bid).unsqueeze(1), codebook, nearest)
    v64 = _rows(v, shape)
    blk = torch.zeros(sp.nb, dtype=torch.float64, device=v.device).index_add_(0, bid, v64.sum(dim=1))
    return {"idx": idx.view(tuple(shape)), "scale": scale,
            "v_blk": (blk / sp.counts(v.device)).float(), "v_col": v64.mean(dim=0).float()}


def state_from_moments(m: torch.Tensor, v: torch.Tensor, *, mode: str, shape: Sequence[int], period: int,
                       scale_block: int, row_blocks: int, codebook: torch.Tensor,
                       nearest: Optional[Callable] = None) -> Dict[str, torch.Tensor]:
    """The state tensors of a whole quantized tensor of global ``shape`` from its AdamW moments ``m``
    and ``v`` (any float dtype, ``shape``'s number of elements): ``idx`` and ``scale`` and, by
    ``mode`` (``"shared"``, ``"elementwise"``, ``"factored"`` or ``"span"``), ``v`` ``[rows, slab /
    period]``, ``v_row`` ``[rows, 1]`` and ``v_col`` (``[row_blocks, slab]``, or ``[slab]`` for one
    block), or ``v_blk`` ``[blocks]`` and ``v_col`` ``[slab]``; float32 and uint8, on ``m``'s
    device. ``nearest``: the nearest-codeword function (default the reference's)."""
    nearest = nearest_codeword if nearest is None else nearest
    shape = tuple(int(s) for s in shape)
    m32 = m.detach().reshape(int(shape[0]), row_slab(shape)).float()
    if mode == "span":
        return _span_state(m32, v, shape, codebook, nearest)
    idx, scale = _quantize_blocks(m32, int(scale_block), codebook, nearest)
    out = {"idx": idx.view(shape), "scale": scale}
    v64 = _rows(v, shape)
    rows, slab = v64.shape
    if mode == "factored":
        out["v_row"] = v64.mean(dim=1, keepdim=True).float()
        G = int(row_blocks)
        out["v_col"] = (v64.mean(dim=0) if G == 1 else v64.view(G, rows // G, slab).mean(dim=1)).float()
    elif mode in ("shared", "elementwise"):
        P = int(period)
        out["v"] = v64.view(rows, slab // P, P).mean(dim=2).float()
    else:
        raise ValueError(f"state_from_moments: unknown mode {mode!r}")
    return out
