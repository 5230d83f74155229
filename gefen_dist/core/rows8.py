"""D19: rows of 22-79 elements with their scale and second moment per row, in one byte each
(``narrow_rows="rows8"``).

Per row, the factored layout (D10) keeps an fp32 absmax scale ``M_i`` and an fp32 ``v_i``:
``1 + 8 / S`` B/param for rows of ``S`` elements (1.36 at 22, 1.1 at 80). Sharing them over a block
of rows (D16, span) reaches ~1.01 but costs a dense layer ~10 points (digits' ``(256, 64)`` input
layer: +9.6% against per-row state): research/narrow-rows.md. Here each row keeps both, each as a
one-byte code against a float32 reference per block of ``k = ceil(1024 / S)`` rows (the span blocks):

    M_i = M_b T_s[e_i],  T_s[e] = 2^(-e / 8)   (e = 0..254; 255: M_i = 0)
    v_i = V_b T_v[c_i],  T_v[c] = 2^(-c / 16)  (c = 0..254; 255: v_i = 0)

* ``e_i`` is the largest code with ``M_b T_s[e_i] >= max_j |m_ij|`` (``M_b`` the block's largest row
  maximum): the row is quantized by its decoded scale, so ``|m / M_i| <= 1`` and dequantising
  ``C[idx] M_i`` gives back what was quantized. The scale is recomputed every step (not an EMA), so
  rounding it up does not accumulate.
* ``v_i`` is an EMA, ``v_i <- beta2 v_i + (1 - beta2) mean_j g_ij^2``, from its decoded value; a step of
  ``1 - beta2`` (0.1% at 0.999) is far below one code (4.4%), so ``c_i`` is rounded
  *stochastically* between its two neighbours, with the probability of the upper code the fractional
  part of ``-16 log2(v_i / V_b)`` (unbiased in the code). The random numbers are a counter-based hash
  of (global row, step, the tensor's shape): every rank, world size, backend and device draws the same
  ones, so the state is the same at every world size.

The update is the factored one with the decoded per-row values (the span kernels with blocks of one
row, :class:`~gefen_dist.core.span.SpanPiece` ``k = 1``):
``sigma_ij = (1 / (sqrt(v_i) sqrt(v_col_j / mean v_col) / sqrt(bc2) + eps)) / bc1``. State:
``1 + 2 / S + 8 nb / numel + 4 S / numel`` B/param (1.04 at 64, 1.09 at 22). Measured with float32
side state first (``span_rows8`` in research/narrow_variants.py): the same held-out loss as fp32 per-row
state on four workloads (digits -0.06% against -0.08%). Pure math: torch operations, any device, no
``torch.distributed``.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Sequence, Tuple

import torch

from .periods import row_slab
from .span import SPAN_AUTO_BELOW, SPAN_BELOW, SpanPiece, span_blocks
from .step import ema_

__all__ = ["ROWS8_FROM", "ZERO_CODE", "rows8_eligible", "kernel_piece", "decode_scale", "decode_v", "decode_piece", "encode_scale",
           "encode_v", "row_uniform", "rows8_state_", "rows8_bytes"]

ROWS8_FROM = SPAN_AUTO_BELOW  # rows narrower than this keep span's blocks of rows under "rows8" (2 / S > 0.1)
SCALE_STEPS, V_STEPS = 8, 16  # codes per octave
ZERO_CODE = 255  # the code of a zero scale / zero v
_MAX = 254  # the largest code of a nonzero value


def rows8_eligible(shape: Sequence[int]) -> bool:
    """A tensor of ``ndim >= 2`` whose dim-0 rows hold 22 to 79 elements (what ``narrow_rows="rows8"``
    keeps per row in one-byte codes; narrower rows keep span's blocks of rows, wider ones fp32 per row)."""
    return len(shape) >= 2 and ROWS8_FROM <= row_slab(shape) < SPAN_BELOW


def kernel_piece(sp: SpanPiece) -> SpanPiece:
    """The piece ``sp`` (blocks of ``k`` rows: the codes' references) with blocks of one row: what the
    span kernels step, every row its own scale and second moment."""
    return dataclasses.replace(sp, k=1)


def _table(steps: int, device) -> torch.Tensor:
    """``fp32(2^(-c / steps))`` for the codes 0..254 and 0 for 255 (float32 ``[256]`` on ``device``)."""
    return _table_on(steps, str(torch.device(device)))


@functools.lru_cache(maxsize=None)
def _table_on(steps: int, device: str) -> torch.Tensor:
    t = torch.tensor([2.0 ** (-c / steps) for c in range(_MAX + 1)] + [0.0], dtype=torch.float64)
    return t.to(torch.float32).to(device)


def _per_row(ref: torch.Tensor, sp: SpanPiece) -> torch.Tensor:
    """The value of its block (``ref`` ``[nb]``, ``sp.k`` rows per block) of each row of the piece's
    rows ``[sp.row0, sp.row0 + sp.nrows)``: ``[nrows]``."""
    if sp.row0 == 0 and sp.nrows == sp.rows:
        return ref.unsqueeze(1).expand(sp.nb, sp.k).reshape(-1)[:sp.rows]
    bid = torch.div(torch.arange(sp.row0, sp.row0 + sp.nrows, device=ref.device), sp.k, rounding_mode="floor")
    return ref.index_select(0, bid)


def _block_max(x: torch.Tensor, sp: SpanPiece) -> Tuple[torch.Tensor, torch.Tensor]:
    """The block maxima of the rows' ``x`` (>= 0) and each row's block maximum."""
    pad = sp.nb * sp.k - sp.rows
    xp = torch.nn.functional.pad(x, (0, pad)) if pad else x
    ref = xp.view(sp.nb, sp.k).amax(dim=1)
    return ref, _per_row(ref, sp)


def decode_scale(codes: torch.Tensor, ref: torch.Tensor, sp: SpanPiece) -> torch.Tensor:
    """``M_i = M_b T_s[e_i]`` of the rows of piece ``sp`` (float32 ``[nrows]``; ``codes`` uint8 ``[nrows]``,
    the piece's; ``ref`` the whole tensor's block maxima)."""
    return _per_row(ref, sp) * _table(SCALE_STEPS, ref.device).index_select(0, codes.int())


def decode_v(codes: torch.Tensor, ref: torch.Tensor, sp: SpanPiece) -> torch.Tensor:
    """``v_i = V_b T_v[c_i]`` of the rows of piece ``sp`` (float32 ``[nrows]``)."""
    return _per_row(ref, sp) * _table(V_STEPS, ref.device).index_select(0, codes.int())


def decode_piece(scale_code: torch.Tensor, v_code: torch.Tensor, scale: torch.Tensor, v_blk: torch.Tensor,
                 sp: SpanPiece, v_from: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """The rows of piece ``sp`` (its codes; ``scale``, ``v_blk``: the whole tensor's block maxima) placed
    among every row of the tensor, zeros elsewhere: the decoded scales (float32 ``[rows]``, what the
    span kernels with blocks of one row index by row) and the decoded ``v`` of the rows from global
    row ``v_from`` on (float64 ``[rows]``: what a rank adds to the SUM over the ranks, each row once)."""
    full_scale = torch.zeros(sp.rows, dtype=torch.float32, device=scale.device)
    full_v = torch.zeros(sp.rows, dtype=torch.float64, device=scale.device)
    r0, r1 = sp.row0, sp.row0 + sp.nrows
    if sp.nrows:
        full_scale[r0:r1] = decode_scale(scale_code, scale, sp)
        full_v[v_from:r1] = decode_v(v_code, v_blk, sp).double()[v_from - r0:]
    return full_scale, full_v


def _log_codes(x: torch.Tensor, ref_row: torch.Tensor, steps: int) -> torch.Tensor:
    """``steps (log2 ref - log2 x)`` in float32 (0 where ``x`` is 0; ``0 < x <= ref`` elsewhere): a
    difference of logarithms, so a ratio below float32's range does not underflow."""
    pos = x > 0
    lx = torch.log2(torch.where(pos, x, torch.ones_like(x)))
    lr = torch.log2(torch.where(pos, ref_row, torch.ones_like(ref_row)))
    return lr.sub_(lx).mul_(steps)


def encode_scale(a: torch.Tensor, sp: SpanPiece) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The row maxima ``a`` (float32 ``[rows]``) as stored: ``(codes, M_b, decoded)`` with ``M_b`` the
    block maxima and each code the largest ``e`` whose decoded ``M_b T_s[e]`` is at least the row's
    maximum (code 255 for a zero row: scale 0). Exact in float32: the estimate from ``log2`` is
    corrected by comparing the decoded products themselves."""
    ref, ref_row = _block_max(a, sp)
    tab = _table(SCALE_STEPS, a.device)
    e = _log_codes(a, ref_row, SCALE_STEPS).floor_().clamp_(0, _MAX).int()
    # the estimate is off by at most one code (float32 rounding at a code's edge): one step down
    # where the decoded scale is below the maximum, one up where the next code still covers it
    e = e - ((ref_row * tab.index_select(0, e) < a) & (e > 0)).int()
    up = (e + 1).clamp_(max=_MAX)
    e = torch.where((ref_row * tab.index_select(0, up) >= a) & (e < _MAX), up, e)
    e = torch.where(a > 0, e, torch.full_like(e, ZERO_CODE))
    return e.to(torch.uint8), ref, ref_row * tab.index_select(0, e)


def _mul32(h: torch.Tensor, c: int) -> torch.Tensor:
    """``h * c mod 2^32`` for int64 ``h`` in ``[0, 2^32)`` without leaving int64's range."""
    lo, hi = c & 0xFFFF, c >> 16
    return (h * lo + (((h * hi) & 0xFFFF) << 16)) & 0xFFFFFFFF


def _mix32(h: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer finaliser (xor-shift-multiply, the constants of "lowbias32")."""
    h = h ^ (h >> 16)
    h = _mul32(h, 0x7FEB352D)
    h = h ^ (h >> 15)
    h = _mul32(h, 0x846CA68B)
    return h ^ (h >> 16)


def _key(step: int, shape: Sequence[int]) -> int:
    """The hash of (step, shape) that every row's draw starts from (a Python int in ``[0, 2^32)``)."""
    salt = 0
    for s in tuple(int(x) for x in shape):
        salt = (salt * 0x01000193 + s + 0x9E3779B9) & 0xFFFFFFFF
    return int(_mix32(torch.tensor([(int(step) * 0x9E3779B1 + salt) & 0xFFFFFFFF], dtype=torch.int64)))


def row_uniform(rows: torch.Tensor, step: int, shape: Sequence[int]) -> torch.Tensor:
    """Uniform numbers in ``[0, 1)`` (float32, multiples of ``2^-24``) for the global rows ``rows``
    (int64) at ``step`` of a tensor of ``shape``: a hash of the three, the same on every device and
    rank (rows past ``2^32`` mix their high bits in a second round)."""
    h = _mix32((rows & 0xFFFFFFFF) ^ _key(step, shape))
    if int(shape[0]) > 1 << 32:
        h = _mix32(h ^ ((rows >> 32) & 0xFFFFFFFF))
    return (h >> 8).float().mul_(2.0 ** -24)


def encode_v(v: torch.Tensor, sp: SpanPiece, step: int, shape: Sequence[int]
             ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The rows' second moments ``v`` (float32 ``[rows]``, >= 0) as stored: ``(codes, V_b, decoded)``
    with ``V_b`` the block maxima and each code rounded stochastically between its neighbours
    (:func:`row_uniform`), clamped to 254 (a ``v`` below ``2^-15.9 V_b`` is raised to it); 255 for 0."""
    ref, ref_row = _block_max(v, sp)
    x = _log_codes(v, ref_row, V_STEPS).clamp_(min=0.0)
    lo = x.floor()
    u = row_uniform(torch.arange(sp.rows, device=v.device), step, shape)
    c = lo.add_((u < x.sub_(lo)).float()).clamp_(0, _MAX).int()
    c = torch.where(v > 0, c, torch.full_like(c, ZERO_CODE))
    return c.to(torch.uint8), ref, ref_row * _table(V_STEPS, v.device).index_select(0, c)


def rows8_state_(v_old: torch.Tensor, scale: torch.Tensor, v_blk: torch.Tensor, v_col: torch.Tensor,
                 col_sum: torch.Tensor, row_sum: torch.Tensor, row_amax: torch.Tensor, sp: SpanPiece, beta2: float,
                 step: int, shape: Sequence[int]) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The state of a ``rows8`` tensor from the reduced statistics of this step, the same on every
    rank: ``v_col`` and each row's ``v`` (``v_old``: every row's decoded ``v`` before the step, float32
    ``[rows]``) advance with the column and row means of ``g^2`` (``col_sum``, ``row_sum``: float64 sums
    over the whole tensor), the row maxima of ``|m|`` (``row_amax``) become the rows' scales, and both
    are coded again against the blocks' new references (``scale``, ``v_blk``: written in place, like
    ``v_col``; ``sp`` the whole tensor, ``sp.k`` rows per block). Returns ``(scale codes, v codes,
    M_i, v_i)`` of every row (uint8 and float32 ``[rows]``): the caller keeps the codes of its rows,
    and the update uses the decoded values."""
    ema_(v_col, (col_sum / sp.rows).to(torch.float32), beta2)
    v = ema_(v_old.to(torch.float32).clone(), (row_sum / sp.slab).to(torch.float32), beta2)
    vc, vref, v_dec = encode_v(v, sp, step, shape)
    sc, sref, s_dec = encode_scale(row_amax.to(torch.float32), sp)
    scale.copy_(sref)
    v_blk.copy_(vref)
    return sc, vc, s_dec, v_dec


def rows8_bytes(shape: Sequence[int]) -> float:
    """State bytes per parameter of a ``rows8`` tensor of ``shape`` (indices, the two codes per row,
    two float32 references per block, the float32 column profile)."""
    rows, S = int(shape[0]), row_slab(shape)
    n = rows * S
    return (n + 2 * rows + 8 * span_blocks(shape) + 4 * S) / n
