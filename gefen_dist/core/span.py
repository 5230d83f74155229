"""D16: state per block of whole rows for tensors whose rows are narrow (``narrow_rows="span"``).

The factored second moment (D10) keeps, per row of ``S`` elements, an fp32 absmax scale and an fp32
``v_row``: ``8 / S`` bytes per parameter, more than 0.1 when ``S < 80`` (an ``(N, 10)`` tensor: 1.8
B/param; ``(N, 1)`` would be 9, which is why such tensors keep exact AdamW state, D2). With
``narrow_rows="span"`` a tensor whose rows hold fewer than :data:`SPAN_BELOW` elements keeps both per
block of ``k = ceil(SPAN_TARGET / S)`` consecutive rows (the last block may hold fewer) and its
column profile per column, as the factored mode does:

    v_col_j <- beta2 v_col_j + (1 - beta2) mean_i g_ij^2            (all N rows)
    v_blk_b <- beta2 v_blk_b + (1 - beta2) mean_{(i, j) in b} g_ij^2
    m_ij    <- lerp(C[idx_ij] M_b(i), g_ij, 1 - beta1)
    M_b     <- max_{(i, j) in b} |m_ij|;   idx_ij <- nearest(m_ij / M_b(i))
    sigma_ij = (1 / (sqrt(v_blk_b(i)) sqrt(v_col_j / mean v_col) / sqrt(bc2) + eps)) / bc1
    p_ij    <- p_ij (1 - lr wd) - lr clamp(C[idx_ij] M_b(i) sigma_ij, +-bound)

i.e. the factored estimator with a block of rows in place of a row (``v_blk`` is the block's mean of
``g^2``; for ``S = 1`` the column profile is one value and the estimate is the block's mean). State:
1 byte per element plus ``8 nb + 4 S`` bytes (``nb`` blocks), about ``1 + 8 / 1024`` B/param.

``scale``, ``v_blk`` and ``v_col`` are small and replicated. A piece of whole rows (an FSDP2 shard
cuts blocks anywhere) computes this rank's contributions to the block and column sums of ``g^2``
and to the block maxima of ``|m|`` (:func:`span_statistics`); the caller reduces them over the ranks
(SUM, MAX; replicas that must not count twice add zeros) and every rank applies the same state
update (:func:`span_update_`), so the state is the same at every world size. Pure math: no
``torch.distributed`` here, and every operation is a torch operation (any device).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Sequence, Tuple

import torch

from .periods import row_slab
from .quant import nearest_codeword, scaled_histogram
from .step import apply_, column_factors, ema_, first_moment, inv_rms_, quantize

__all__ = ["SPAN_BELOW", "SPAN_AUTO_BELOW", "SPAN_TARGET", "span_eligible", "span_by_default", "span_rows", "span_period", "span_blocks", "SpanPiece",
           "span_statistics", "span_state_", "span_update_", "span_apply_", "span_grad_absmax", "span_histogram", "rows_reached", "span_apply_indices_", "span_square_sums"]

SPAN_BELOW = 80  # rows narrower than this spend more than 0.1 B/param on per-row fp32 state
SPAN_TARGET = 1024  # a block holds at least this many elements (the default's scale blocks reach ~1024)
# narrow_rows="auto" (the default) keeps rows narrower than this per block of rows: per row they would
# spend more than 0.1 B/param even as two one-byte codes (2 / S plus the block maxima), so sharing is
# forced there by the byte budget; measured on dense layers of rows of 4, 8 and 16 elements it cost
# +1.15%, +0.47% and +0.05% against per-row state, and it gained on sparse embeddings (docs/algorithm.md D18)
SPAN_AUTO_BELOW = 22


def span_eligible(shape: Sequence[int]) -> bool:
    """A tensor of ``ndim >= 2`` whose dim-0 rows hold fewer than :data:`SPAN_BELOW` elements."""
    return len(shape) >= 2 and row_slab(shape) < SPAN_BELOW


def span_by_default(shape: Sequence[int]) -> bool:
    """A tensor of ``ndim >= 2`` whose dim-0 rows hold fewer than :data:`SPAN_AUTO_BELOW` elements
    (what ``narrow_rows="auto"`` keeps per block of rows)."""
    return len(shape) >= 2 and row_slab(shape) < SPAN_AUTO_BELOW


def span_rows(shape: Sequence[int]) -> int:
    """Rows per block: ``ceil(SPAN_TARGET / S)`` for rows of ``S`` elements."""
    return max(1, -(-SPAN_TARGET // max(1, row_slab(shape))))


def span_period(shape: Sequence[int]) -> int:
    """Elements per block (``k S``): the period a tensor kept per block of rows has in the layouts."""
    return span_rows(shape) * row_slab(shape)


def span_blocks(shape: Sequence[int]) -> int:
    """Blocks of a tensor of global ``shape`` (the last one may hold fewer rows)."""
    return -(-int(shape[0]) // span_rows(shape))


@dataclass(frozen=True)
class SpanPiece:
    """The elements ``[lead, lead + count)`` of the rows ``[row0, row0 + nrows)`` of a tensor of
    ``rows`` rows of ``slab`` elements, in blocks of ``k`` rows: whole rows (an FSDP2 shard, a
    whole tensor: ``lead = 0``, ``count = nrows * slab``) or a piece that cuts a row at either end
    (a DeepSpeed partition edge)."""

    rows: int
    slab: int
    k: int
    row0: int = 0
    nrows: int = -1  # -1: every row (row0 must be 0)
    lead: int = 0  # elements of row row0 before the piece
    count: int = -1  # elements held; -1: nrows * slab

    @classmethod
    def of(cls, shape: Sequence[int], start: int = 0, numel: int = -1) -> "SpanPiece":
        """The piece of a tensor of global ``shape`` that starts at flat element ``start`` and holds
        ``numel`` elements (-1: the rest of the tensor)."""
        S = row_slab(shape)
        total = int(math.prod(shape))
        n = total - start if numel < 0 else numel
        if start < 0 or n < 0 or start + n > total:
            raise ValueError(f"elements [{start}, {start + n}) are not inside a tensor of shape {tuple(shape)}")
        row0 = start // S
        nrows = -(-(start + n) // S) - row0 if n else 0
        return cls(int(shape[0]), S, span_rows(shape), row0, nrows, start - row0 * S, n)

    @property
    def nb(self) -> int:
        return -(-self.rows // self.k)

    @property
    def numel(self) -> int:
        return self.nrows * self.slab if self.count < 0 else self.count

    @property
    def start(self) -> int:
        """The piece's first element in the flattened tensor."""
        return self.row0 * self.slab + self.lead

    @property
    def whole_rows(self) -> bool:
        return self.lead == 0 and self.numel == self.nrows * self.slab

    def rows_piece(self) -> "SpanPiece":
        """The whole rows this piece touches."""
        return SpanPiece(self.rows, self.slab, self.k, self.row0, self.nrows)

    def element_blocks(self, device) -> torch.Tensor:
        """The block of each element of the piece (int64, ``[numel]``)."""
        e = torch.arange(self.start, self.start + self.numel, device=device)
        return torch.div(e, self.k * self.slab, rounding_mode="floor")

    def block_ids(self, device) -> torch.Tensor:
        """The block of each row of the piece (int64, ``[nrows]``)."""
        return torch.div(torch.arange(self.row0, self.row0 + self.nrows, device=device), self.k,
                         rounding_mode="floor")

    def counts(self, device) -> torch.Tensor:
        """Elements per block (float64, ``[nb]``)."""
        rows = torch.full((self.nb,), float(self.k), dtype=torch.float64, device=device)
        rows[-1] = float(self.rows - (self.nb - 1) * self.k)
        return rows * self.slab


def span_statistics(grad: torch.Tensor, idx: torch.Tensor, scale: torch.Tensor, codebook: torch.Tensor,
                    sp: SpanPiece, beta1: float, bid: Optional[torch.Tensor] = None
                    ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The first phase of a step of piece ``sp``: the new first moment ``m`` (float32, ``[nrows,
    slab]``; ``scale`` holds the previous step's ``M`` of every block) and this piece's
    contributions: column sums of ``g^2`` (float64 ``[slab]``), block sums of ``g^2`` (float64
    ``[nb]``) and block maxima of ``|m|`` (float32 ``[nb]``), zero for blocks it does not hold. The
    float32 squares are added in float64, so the order in which pieces are combined does not show in
    the float32 statistics (as the factored column sums, D10). ``bid``: ``sp.block_ids`` if the
    caller has them. A piece that cuts rows is computed on its rows with zeros around it (``m``
    then holds only the piece's elements, flat)."""
    dev = codebook.device
    if not sp.whole_rows:
        m, col, blk, _ = span_statistics(_in_rows(grad.float(), sp), _in_rows(idx, sp), scale, codebook,
                                         sp.rows_piece(), beta1)
        m = m.reshape(-1)[sp.lead:sp.lead + sp.numel]
        amax = torch.zeros(sp.nb, dtype=torch.float32, device=dev)
        if sp.numel:
            amax.scatter_reduce_(0, sp.element_blocks(dev), m.abs(), "amax")
        return m, col, blk, amax
    g = grad.reshape(sp.nrows, sp.slab).float()
    bid = sp.block_ids(dev) if bid is None else bid
    m = first_moment(idx.reshape(sp.nrows, sp.slab), scale.index_select(0, bid).unsqueeze(1), g, codebook, beta1)
    col, blk = _square_sums(g, sp, bid)
    one = sp.slab == 1  # rows of one element: the row reductions are the values themselves
    amax = torch.zeros(sp.nb, dtype=torch.float32, device=dev)
    if sp.nrows:
        amax.scatter_reduce_(0, bid, m.abs().view(-1) if one else m.abs().amax(dim=1), "amax")
    return m, col, blk, amax


def _square_sums(g: torch.Tensor, sp: SpanPiece, bid: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """Column and block sums (float64) of the float32 squares of ``g`` (float32 ``[nrows, slab]``)."""
    sq = g * g
    col = sq.sum(dim=0, dtype=torch.float64)
    rowsq = sq.view(-1).double() if sp.slab == 1 else sq.sum(dim=1, dtype=torch.float64)
    return col, torch.zeros(sp.nb, dtype=torch.float64, device=g.device).index_add_(0, bid, rowsq)


def span_square_sums(grad: torch.Tensor, sp: SpanPiece) -> torch.Tensor:
    """This piece's column sums and block sums of ``g^2`` (float64 ``[slab + nb]``, the statistics of
    :func:`span_statistics` that do not need the state): what a first step checks for an overflow
    before it learns anything."""
    g = grad.float() if sp.whole_rows else _in_rows(grad.float(), sp)
    g = g.reshape(sp.nrows, sp.slab)
    return torch.cat(_square_sums(g, sp, sp.block_ids(g.device)))


def _in_rows(x: torch.Tensor, sp: SpanPiece) -> torch.Tensor:
    """The elements of piece ``sp`` (``x``, any shape) placed in the whole rows it touches, zeros
    around them (flat, ``x``'s dtype and device)."""
    out = torch.zeros(sp.nrows * sp.slab, dtype=x.dtype, device=x.device)
    out[sp.lead:sp.lead + sp.numel] = x.reshape(-1)
    return out


def span_state_(scale: torch.Tensor, v_blk: torch.Tensor, v_col: torch.Tensor, col_sum: torch.Tensor,
                blk_sum: torch.Tensor, amax: torch.Tensor, sp: SpanPiece, beta2: float) -> None:
    """The replicated block state of :func:`span_update_` from the reduced statistics (in place):
    ``v_col`` and ``v_blk`` advance with the column and block means of ``g^2``, ``scale`` becomes
    the blocks' new ``M``. Every implementation of the second phase starts with this."""
    ema_(v_col, (col_sum / sp.rows).to(torch.float32), beta2)
    ema_(v_blk, (blk_sum / sp.counts(blk_sum.device)).to(torch.float32), beta2)
    scale.copy_(amax)


def span_update_(param: torch.Tensor, idx: torch.Tensor, scale: torch.Tensor, v_blk: torch.Tensor,
                 v_col: torch.Tensor, m: torch.Tensor, col_sum: torch.Tensor, blk_sum: torch.Tensor,
                 amax: torch.Tensor, codebook: torch.Tensor, sp: SpanPiece, *, lr: float, beta2: float, eps: float,
                 weight_decay: float, bc1: float, bc2: float, bound=None, beta1: float = 0.0,
                 bid: Optional[torch.Tensor] = None, nearest=None) -> None:
    """The second phase, from the statistics summed (``col_sum``, ``blk_sum``) and maximised
    (``amax``) over every piece of the tensor: the replicated state of every block (``v_col``,
    ``v_blk``, ``scale``: :func:`span_state_`), then this piece's indices and parameter
    (:func:`span_apply_`; ``param``, ``idx``: the piece, in place; ``m`` as :func:`span_statistics`
    returns it, or flat). ``beta1`` is accepted so that one hyperparameter dict serves every phase;
    ``bid`` (``sp.block_ids``) and ``nearest`` (:func:`~gefen_dist.core.step.quantize`'s; None:
    :func:`~gefen_dist.core.quant.nearest_codeword`) may come from the caller."""
    span_state_(scale, v_blk, v_col, col_sum, blk_sum, amax, sp, beta2)
    span_apply_(param, idx, scale, v_blk, v_col, m, codebook, sp, lr=lr, eps=eps, weight_decay=weight_decay, bc1=bc1,
                bc2=bc2, bound=bound, bid=bid, nearest=nearest)


def span_apply_(param: torch.Tensor, idx: torch.Tensor, scale: torch.Tensor, v_blk: torch.Tensor,
                v_col: torch.Tensor, m: torch.Tensor, codebook: torch.Tensor, sp: SpanPiece, *, lr: float, eps: float,
                weight_decay: float, bc1: float, bc2: float, bound=None, bid: Optional[torch.Tensor] = None,
                nearest=None, **_) -> None:
    """The second phase's per-element part from the updated block state (``scale``, ``v_blk``,
    ``v_col``): this piece's new indices (``m / M_b`` to the nearest codeword) and its parameter, in
    place. What :func:`span_update_` runs after :func:`span_state_`, and the update of a ``rows8``
    tensor (D19: blocks of one row whose state is the decoded codes, :mod:`gefen_dist.core.rows8`)."""
    nearest = nearest_codeword if nearest is None else nearest
    if sp.nrows == 0:
        return
    hp = dict(lr=lr, eps=eps, weight_decay=weight_decay, bc1=bc1, bc2=bc2, bound=bound, nearest=nearest)
    if not sp.whole_rows:  # a piece that cuts rows: its rows, with zeros around it
        full, sl = sp.rows_piece(), slice(sp.lead, sp.lead + sp.numel)
        pp, ip = _in_rows(param, sp), _in_rows(idx, sp)
        _span_apply_(pp, ip, scale, v_blk, v_col, _in_rows(m, sp).view(full.nrows, full.slab), codebook, full, **hp)
        param.reshape(-1).copy_(pp[sl])
        idx.reshape(-1).copy_(ip[sl])
        return
    _span_apply_(param, idx, scale, v_blk, v_col, m.reshape(sp.nrows, sp.slab), codebook, sp, bid=bid, **hp)


def _span_apply_(param, idx, scale, v_blk, v_col, m, codebook, sp: SpanPiece, *, lr, eps, weight_decay, bc1, bc2,
                 bound, nearest, bid=None) -> None:
    """The indices and the parameter of a piece of whole rows from the updated block state."""
    bid = sp.block_ids(codebook.device) if bid is None else bid
    new = quantize(m, scale.index_select(0, bid).unsqueeze(1), codebook, nearest)
    idx.view(sp.nrows, sp.slab).copy_(new)
    span_apply_indices_(param, new, scale, v_blk, v_col, codebook, sp, lr=lr, eps=eps, weight_decay=weight_decay,
                        bc1=bc1, bc2=bc2, bound=bound, bid=bid)


def span_apply_indices_(param, idx, scale, v_blk, v_col, codebook, sp: SpanPiece, *, lr, eps, weight_decay, bc1, bc2,
                        bound=None, bid=None, **_) -> None:
    """The parameter update of a piece of whole rows from its new indices ``idx`` and the updated
    block state (``scale``, ``v_blk``, ``v_col``): ``p <- p (1 - lr wd) - lr clamp(C[idx] M_b sigma,
    +-bound)``, the operations of the second phase in its order, so a rank that receives another's
    indices (ZeroGefen) applies that rank's update bitwise."""
    if sp.nrows == 0:
        return
    bid = sp.block_ids(codebook.device) if bid is None else bid
    a = scale.index_select(0, bid).unsqueeze(1)
    rms = v_blk.sqrt().index_select(0, bid).unsqueeze(1) * column_factors(v_col).unsqueeze(0)
    sigma = inv_rms_(rms, eps, bc1, math.sqrt(bc2))
    q = codebook.index_select(0, idx.reshape(-1).int()).view(sp.nrows, sp.slab)  # codebook[idx], no int64 indices
    apply_(param.view(sp.nrows, sp.slab), q * a, sigma, lr, weight_decay, bound)


def span_grad_absmax(grad: torch.Tensor, sp: SpanPiece) -> torch.Tensor:
    """This piece's block maxima of ``|g|`` (float32 ``[nb]``, zero elsewhere): reduced (MAX) over the
    pieces, the scales the codebook histogram normalises a first gradient by (D3)."""
    out = torch.zeros(sp.nb, dtype=torch.float32, device=grad.device)
    if not sp.whole_rows:  # a piece that cuts rows: element by element
        if sp.numel:
            out.scatter_reduce_(0, sp.element_blocks(grad.device), grad.reshape(-1).float().abs(), "amax")
        return out
    g = grad.reshape(sp.nrows, sp.slab).float()
    if sp.nrows:
        out.scatter_reduce_(0, sp.block_ids(g.device), g.abs().amax(dim=1), "amax")
    return out


def span_histogram(grad: torch.Tensor, absmax: torch.Tensor, sp: SpanPiece, out: torch.Tensor) -> torch.Tensor:
    """Add the histogram of this piece's gradient normalised by its blocks' absmax (``absmax``: the
    reduced :func:`span_grad_absmax`) to ``out``."""
    if not sp.whole_rows:  # a piece that cuts rows: element by element (the same counts)
        if sp.numel:
            g = grad.reshape(-1).float()
            scaled_histogram(g, absmax.to(g.device).index_select(0, sp.element_blocks(g.device)), out)
    elif sp.nrows:
        g = grad.reshape(sp.nrows, sp.slab).float()
        scaled_histogram(g, absmax.to(g.device).index_select(0, sp.block_ids(g.device)).unsqueeze(1), out)
    return out


def rows_reached(grad: torch.Tensor, sp: SpanPiece) -> float:
    """The share of the rows piece ``sp`` touches on which ``grad`` (the piece's gradient) has a
    nonzero element: near 1 for a dense layer, small for a sparse embedding's batch (0 for an empty
    piece)."""
    if not sp.numel or not sp.nrows:
        return 0.0
    g = grad.reshape(-1) if sp.whole_rows else _in_rows(grad, sp)
    return float((g.reshape(sp.nrows, sp.slab) != 0).any(dim=1).float().mean())
