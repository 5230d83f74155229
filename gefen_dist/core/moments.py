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
quantization of the first, as a step would make it. It works on a *piece* of whole rows (a
process's shard, or the whole tensor): :func:`moments_partials` gives what must be summed
(column and block sums of ``v``, float64) and maximised (block maxima of ``|m|``) over the pieces
of a tensor, :func:`state_from_moments` the piece's state from its rows and the reduced values.
Nothing here learns the period or the codebook; :mod:`gefen_dist.optim.adamw_import` does, as the
first step would.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, Optional, Tuple

import torch

from . import rows8 as _rows8
from . import span as _span
from .periods import row_slab
from .quant import nearest_codeword
from .step import quantize

__all__ = ["MomentsLayout", "moments_partials", "state_from_moments", "block_means", "factored_means", "span_means"]


def block_means(v: torch.Tensor, P: int) -> torch.Tensor:
    """float32 means of consecutive blocks of ``P`` elements of ``v`` (a whole number of blocks), in
    float64: the ``v`` of the shared and elementwise layouts, ``[numel / P]``."""
    return v.detach().reshape(-1, int(P)).double().mean(dim=1).float()


def factored_means(v: torch.Tensor, slab: int, G: int = 1, K: int = 1) -> tuple:
    """``(v_row, v_col)`` of whole rows of ``slab`` elements of ``v`` (float32 from float64 means):
    the row means ``[rows]`` (with ``K`` column blocks, D21: ``[rows * K]``, each row's mean over each
    block of ``slab / K`` columns) and the column means ``[slab]``, or ``[G, slab]`` per block of ``rows /
    G`` consecutive rows (D12)."""
    v64 = v.detach().reshape(-1, int(slab)).double()
    cols = v64.mean(dim=0) if G == 1 else v64.view(int(G), -1, int(slab)).mean(dim=1)
    rows = v64.mean(dim=1) if K == 1 else v64.view(v64.shape[0], int(K), -1).mean(dim=2).reshape(-1)
    return rows.float(), cols.float()


def _span_sums(v: torch.Tensor, sp: "_span.SpanPiece") -> torch.Tensor:
    """The column sums and the block sums of the rows of piece ``sp`` of ``v``: float64 ``[slab + blocks]``."""
    v64 = v.detach().reshape(sp.nrows, sp.slab).double()
    blk = torch.zeros(sp.nb, dtype=torch.float64, device=v.device).index_add_(0, sp.block_ids(v.device),
                                                                             v64.sum(dim=1))
    return torch.cat([v64.sum(dim=0), blk])


def _span_means(sums: torch.Tensor, sp: "_span.SpanPiece") -> tuple:
    """``(v_blk, v_col)`` from the whole tensor's :func:`_span_sums`: each block's and each column's mean."""
    return (sums[sp.slab:] / sp.counts(sums.device)).float(), (sums[:sp.slab] / sp.rows).float()


def span_means(v: torch.Tensor, sp: "_span.SpanPiece") -> tuple:
    """``(v_blk, v_col)`` of a whole tensor kept per block of rows (D16; ``sp`` its
    :class:`~gefen_dist.core.span.SpanPiece`): each block's mean and each column's mean of ``v``."""
    return _span_means(_span_sums(v, sp), sp)


@dataclass(frozen=True)
class MomentsLayout:
    """Where a piece of whole rows sits and how its tensor is kept: ``mode`` (``"shared"``,
    ``"elementwise"``, ``"factored"`` or ``"span"``), the global ``shape``, the piece's first row
    ``row0`` and number of rows ``nrows``, the ``period`` and ``scale_block`` and (factored) the
    number of ``row_blocks`` with their own column profile and of ``col_blocks`` with their own row
    statistic (D21)."""

    mode: str
    shape: Tuple[int, ...]
    row0: int
    nrows: int
    period: int
    scale_block: int
    row_blocks: int = 1
    col_blocks: int = 1

    @property
    def slab(self) -> int:
        return row_slab(self.shape)

    def span(self) -> "_span.SpanPiece":
        """The piece's blocks of the reduced statistics: blocks of rows (span), single rows (rows8, D19)."""
        sp = _span.SpanPiece.of(self.shape, self.row0 * self.slab, self.nrows * self.slab)
        return _rows8.kernel_piece(sp) if self.mode == "rows8" else sp


def moments_partials(m: torch.Tensor, v: torch.Tensor, lay: MomentsLayout) -> Tuple[torch.Tensor, torch.Tensor]:
    """This piece's contributions (``m``, ``v``: its rows) to what the tensor's state needs from every
    piece: float64 sums (factored: the column sums of ``v`` per block of rows, ``[G * slab]``; span:
    the column sums and the block sums, ``[slab + blocks]``) and float32 maxima (span: the blocks'
    maxima of ``|m|``); empty for the other modes. Sum and maximise them over the pieces (zeros from a
    replica that must not count twice), then pass them to :func:`state_from_moments`."""
    dev, slab = m.device, lay.slab
    empty64, empty32 = torch.zeros(0, dtype=torch.float64, device=dev), torch.zeros(0, device=dev)
    if lay.mode == "factored":
        v64 = v.detach().reshape(lay.nrows, slab).double()
        G = int(lay.row_blocks)
        out = torch.zeros(G, slab, dtype=torch.float64, device=dev)
        block = torch.div(torch.arange(lay.row0, lay.row0 + lay.nrows, device=dev), int(lay.shape[0]) // G,
                          rounding_mode="floor")
        return out.index_add_(0, block, v64).reshape(-1), empty32
    if lay.mode in ("span", "rows8"):
        sp = lay.span()
        amax = torch.zeros(sp.nb, dtype=torch.float32, device=dev)
        if lay.nrows:
            amax.scatter_reduce_(0, sp.block_ids(dev), m.detach().reshape(lay.nrows, slab).float().abs().amax(dim=1),
                                 "amax")
        return _span_sums(v, sp), amax
    return empty64, empty32


def state_from_moments(m: torch.Tensor, v: torch.Tensor, lay: MomentsLayout, codebook: torch.Tensor,
                       sums: torch.Tensor, maxima: torch.Tensor,
                       nearest: Optional[Callable] = None) -> Dict[str, torch.Tensor]:
    """The state tensors of a piece of whole rows (``m``, ``v``: its AdamW moments, any float dtype)
    from ``sums`` and ``maxima``, :func:`moments_partials` reduced over every piece of the tensor:
    ``idx`` (uint8, the piece's shape) and ``scale``, and by ``lay.mode`` ``v`` (``[rows, slab /
    period]``), ``v_row`` (``[rows, col_blocks]``) and ``v_col`` (``[row_blocks, slab]``, or ``[slab]``), or
    ``v_blk`` (``[blocks]``, the whole tensor's) and ``v_col`` (``[slab]``) with a whole-tensor
    ``scale``; float32 and uint8, on ``m``'s device. ``nearest``: the nearest-codeword function
    (default the reference's)."""
    nearest = nearest_codeword if nearest is None else nearest
    rows, slab = lay.nrows, lay.slab
    local_shape = (rows,) + tuple(lay.shape[1:])
    m32 = m.detach().reshape(rows, slab).float()
    if lay.mode == "span":
        sp = lay.span()
        scale = maxima.to(m.device, torch.float32)
        idx = quantize(m32, scale.index_select(0, sp.block_ids(m.device)).unsqueeze(1), codebook, nearest)
        v_blk, v_col = _span_means(sums, sp)
        return {"idx": idx.view(local_shape), "scale": scale, "v_blk": v_blk, "v_col": v_col}
    if lay.mode == "rows8":  # D19: the rows' maxima and means coded against blocks of rows (the draw of step 0)
        whole = _span.SpanPiece.of(lay.shape)
        sc, sref, s_dec = _rows8.encode_scale(maxima.to(m.device, torch.float32), whole)
        v_row, v_col = _span_means(sums.to(m.device), lay.span())
        vc, vref, _ = _rows8.encode_v(v_row, whole, 0, lay.shape)
        r = slice(lay.row0, lay.row0 + rows)
        return {"idx": quantize(m32, s_dec[r].unsqueeze(1), codebook, nearest).view(local_shape), "scale": sref,
                "v_blk": vref, "v_col": v_col, "scale_code": sc[r], "v_code": vc[r]}
    B = int(lay.scale_block)
    blocks = m32.view(rows, slab // B, B)
    scale = blocks.abs().amax(dim=2)
    out = {"idx": quantize(blocks, scale.unsqueeze(2), codebook, nearest).view(local_shape), "scale": scale}
    if lay.mode == "factored":
        G = int(lay.row_blocks)
        K = int(lay.col_blocks)
        out["v_row"] = v.detach().reshape(rows, K, slab // K).double().mean(dim=2).float()
        col = (sums.view(G, slab) / (int(lay.shape[0]) // G)).float()
        out["v_col"] = col if G > 1 else col.view(slab)
    elif lay.mode in ("shared", "elementwise"):
        out["v"] = block_means(v, int(lay.period)).view(rows, slab // int(lay.period))
    else:
        raise ValueError(f"state_from_moments: unknown mode {lay.mode!r}")
    return out
