"""Both moments in one byte per element (research/quality-log.md, "One byte per element for both
moments"): the math of the layout, eager torch, on flat local pieces of whole rows.

Per element the state's ``uint8`` holds two 4-bit codes: the high nibble the first moment's index
into a 16-entry codebook ``C`` (the exact DP of :func:`gefen_dist.core.codebook.solve_codebook` with
``k=16`` on the first step's histogram), times the scale block's absmax ``M`` as today; the low
nibble the second moment's code against the factored estimate (the default's row and column EMAs,
D12's row blocks included)::

    m = C[code >> 4] * M                 v = fac * L[code & 15]
    fac_ij = v_row_i * v_col_j / mean(v_col)      L[c] = 2^((c - 8) / 2)   (2^-4 .. 2^3.5)

A step decodes both moments (against the previous step's estimate), advances them in float32
(``m <- lerp(m, g, 1 - beta1)``, ``v <- beta2 v + (1 - beta2) g^2``), advances ``v_row`` / ``v_col``,
and stores both again, each rounded *stochastically* to one of its two neighbouring levels with the
probability that makes the stored value unbiased (four bits of first moment rounded to the nearest
codeword stall training; measured in the log). The parameter update is AdamW's of the float32
moments (``update="fp32"``) or of the stored ones (``update="decoded"``), clamped as D13.

Reproducible by construction, so that every kernel can match this reference bit for bit:

* the random numbers are a 32-bit integer hash (:func:`hash32`, "lowbias32") of the element's index in
  the *global* tensor, keyed by (seed, step, tensor): any sharding draws the same bits; one hash per
  element gives both uniforms (16 bits each);
* a code's two candidates come from comparisons, its rounding probability from one subtraction and one
  division, and the draw from one comparison: no ``log2`` or ``exp2`` of data, no fused operations;
* the update's square root is correctly rounded (torch's float32 ``sqrt`` on CPU is not on every build).
"""
from __future__ import annotations

import math
from typing import Tuple

import torch

from .step import _EAGER_CHUNK_ELEMS, apply_, check_tensor, column_ratios, ema_, inv_rms_, row_factors

NIBBLE_CODEWORDS = 16
_M32 = 0xFFFFFFFF
_U16 = 1.0 / 65536.0
# v's levels relative to the factored estimate, two per octave; float32 of 2^((c - 8) / 2)
V_LEVELS = tuple(float(torch.tensor(2.0 ** ((c - 8) / 2.0), dtype=torch.float32)) for c in range(16))


def hash32(x: torch.Tensor) -> torch.Tensor:
    """The "lowbias32" integer hash (two xorshift-multiply rounds) of int64 ``x``'s low 32 bits, in
    int64 arithmetic masked to 32 bits: the bits a ``uint32`` C or Triton expression computes."""
    x = x & _M32
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _M32
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & _M32
    return x ^ (x >> 16)


def hash32_int(x: int) -> int:
    """:func:`hash32` of one Python integer."""
    x &= _M32
    x ^= x >> 16
    x = (x * 0x7FEB352D) & _M32
    x ^= x >> 15
    x = (x * 0x846CA68B) & _M32
    return x ^ (x >> 16)


# step_key's odd multipliers of the seed, the step and the tensor's index
KEY_SEED, KEY_STEP, KEY_TENSOR = 0x9E3779B1, 0x85EBCA77, 0xC2B2AE3D


def step_key(seed: int, step: int, tensor: int) -> int:
    """The 32-bit key of one tensor's draws at one step (``tensor``: its index in the optimizer,
    the same on every rank)."""
    return (int(seed) * KEY_SEED + int(step) * KEY_STEP + int(tensor) * KEY_TENSOR) & _M32


def uniforms(start: int, numel: int, key: int, device=None) -> Tuple[torch.Tensor, torch.Tensor]:
    """float32 uniforms in [0, 1) on the 2^-16 grid for elements ``start .. start + numel - 1`` of the
    global tensor under ``key``: ``h = hash32(i_lo ^ hash32(key + i_hi * 0x9E3779B1))``, the first
    moment's number ``h >> 16``, the second moment's ``h & 0xFFFF`` (``i_lo``, ``i_hi``: the index's
    low and high 32 bits)."""
    i = torch.arange(start, start + numel, dtype=torch.int64, device=device)
    hi = i >> 32
    if int(start + numel - 1) >> 32 == int(start) >> 32:  # one high word (every tensor under 2^32 elements)
        k = torch.tensor(hash32_int(key + (int(start) >> 32) * 0x9E3779B1), dtype=torch.int64, device=device)
    else:
        k = hash32((key + hi * 0x9E3779B1) & _M32)
    h = hash32(i ^ k)
    return ((h >> 16).to(torch.float32) * _U16, (h & 0xFFFF).to(torch.float32) * _U16)


def round_stochastic(x: torch.Tensor, levels: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Codes (int64, ``0 .. K-1``) of ``x`` over the ascending ``levels`` ``[K]``: the lower neighbour
    ``j`` (``levels[j] <= x < levels[j + 1]``, clamped to ``0 .. K-2``), plus one where
    ``u < (x - levels[j]) / (levels[j + 1] - levels[j])`` (clamped to [0, 1]): unbiased between the ends,
    the nearer end beyond them; NaN gives code 0."""
    k = levels.numel()
    j = (torch.searchsorted(levels, x.contiguous(), right=True) - 1).clamp_(0, k - 2)
    j = torch.where(torch.isnan(x), torch.zeros_like(j), j)
    lo = levels[j]
    frac = ((x - lo) / (levels[j + 1] - lo)).clamp_(0.0, 1.0)
    return j + (u < frac).to(torch.int64)


def _block_absmax(m: torch.Tensor, B: int) -> torch.Tensor:
    """``[n / B]``: the largest ``|m|`` of each block of ``B`` (NaN if the block holds one)."""
    a = m.reshape(-1, B).abs()
    return torch.where(torch.isnan(a).any(1), torch.full((a.shape[0],), math.nan, device=a.device), a.amax(1))


def decode(code: torch.Tensor, scale: torch.Tensor, fac: torch.Tensor, codebook: torch.Tensor,
           scale_block: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(m, v)`` float32 of ``code`` (``[rows, slab]`` uint8) with its scales ``[rows, slab / B]`` and
    the factored estimate ``fac`` (broadcasting to ``[rows, slab]``)."""
    rows, slab = code.shape
    M = scale.reshape(rows, -1, 1).expand(rows, slab // scale_block, scale_block).reshape(rows, slab)
    return decode_with(code, M, fac, codebook)


def encode(m: torch.Tensor, v: torch.Tensor, fac: torch.Tensor, codebook: torch.Tensor, scale_block: int,
           u_m: torch.Tensor, u_v: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(code uint8 [rows, slab], scale float32 [rows, slab / B])`` of float32 ``m``, ``v``
    (``[rows, slab]``) against ``fac``: ``M`` the absmax per scale block, then :func:`encode_with`."""
    rows, slab = m.shape
    B = scale_block
    a = _block_absmax(m, B).view(rows, slab // B, 1)
    code = encode_with(m.view(rows, slab // B, B), v.view(rows, slab // B, B), fac.expand(rows, slab).reshape(
        rows, slab // B, B), a, codebook, u_m.view(rows, slab // B, B), u_v.view(rows, slab // B, B))
    return code.view(rows, slab), a.view(rows, slab // B)


def encode_with(m: torch.Tensor, v: torch.Tensor, fac: torch.Tensor, absmax: torch.Tensor, codebook: torch.Tensor,
                u_m: torch.Tensor, u_v: torch.Tensor) -> torch.Tensor:
    """The codes (uint8, ``m``'s shape) of float32 ``m``, ``v`` given each element's scale ``absmax``
    and factored estimate ``fac`` (both broadcasting to ``m``): the first moment's code of ``m / M``
    (0 where ``M == 0``) over ``codebook``, v's of ``v / fac`` (0 where ``fac`` is not positive) over
    :data:`V_LEVELS`, both by :func:`round_stochastic`. The pieces of a row that a partition edge cuts
    (the DeepSpeed flat buffers) call it with their reconciled scales."""
    zero = torch.zeros((), device=m.device)
    mc = round_stochastic(torch.where(absmax > 0, m / absmax, zero), codebook, u_m)
    fac = fac.expand_as(v)
    vc = round_stochastic(torch.where(fac > 0, v / fac, zero), torch.tensor(V_LEVELS, dtype=torch.float32,
                                                                           device=v.device), u_v)
    return (mc << 4 | vc).to(torch.uint8)


def decode_with(code: torch.Tensor, absmax: torch.Tensor, fac: torch.Tensor,
                codebook: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(m, v)`` float32 of ``code`` with each element's scale ``absmax`` and estimate ``fac``
    (broadcasting to ``code``): :func:`decode` for any piece of a row."""
    c = code.long()
    lv = torch.tensor(V_LEVELS, dtype=torch.float32, device=code.device)
    return codebook[c >> 4] * absmax, fac * lv[c & 15]


def first_moment(code: torch.Tensor, absmax: torch.Tensor, g: torch.Tensor, codebook: torch.Tensor,
                 beta1: float) -> torch.Tensor:
    """The new first moment ``lerp(C[code >> 4] * M, g, 1 - beta1)`` in float32 of a piece of a row
    (``absmax``: each element's old scale): what the step computes before the scale blocks' new
    absmax, which a block cut by a partition edge reconciles over the ranks first."""
    return torch.lerp(codebook[code.long() >> 4] * absmax, g, 1.0 - beta1)


def update_(param: torch.Tensor, m: torch.Tensor, v: torch.Tensor, *, lr: float, weight_decay: float, eps: float,
            bc1: float, sqrt_bc2: float, bound) -> None:
    """AdamW's update of ``param`` from float32 ``m``, ``v``, clamped as D13; the square root correctly
    rounded (through float64: torch's float32 ``sqrt`` on CPU is not, on some builds), as every
    kernel's ``sqrtf`` / ``sqrt_rn``, so that the update is the same bits everywhere."""
    apply_(param, m, inv_rms_(v.double().sqrt_().float(), eps, bc1, sqrt_bc2), lr, weight_decay, bound)


def check_piece(param, grad, code, scale, v_row, v_col, col_mean_sq, *, scale_block: int, row_block: int,
                update: str, grad_like_param: bool = False) -> int:
    """The checks of every implementation of :func:`nibble_step_factored_eager_`, before anything changes:
    ``update``, whole rows of whole scale blocks, ``row_block`` for a 2-D ``v_col``, and each tensor's device,
    layout, dtype and size (``grad_like_param``: the kernels read the gradient in the parameter's dtype).
    Each error names the tensor and what it should be. Returns the number of row blocks of ``v_col``."""
    if update not in ("fp32", "decoded"):
        raise ValueError(f"update must be 'fp32' or 'decoded', got {update!r}")
    n, S, B = param.numel(), v_col.shape[-1], int(scale_block)
    if B < 1 or S < 1 or S % B or n % S:
        raise ValueError(f"scale_block {B} does not divide the row length {S}, or {n} elements are not whole rows")
    G = v_col.numel() // S
    if v_col.dim() > 1 and row_block < 1:
        raise ValueError(f"a v_col of shape {tuple(v_col.shape)} (row blocks) needs row_block >= 1")
    want = [("v_col", v_col, torch.float32, G * S), ("col_mean_sq", col_mean_sq, torch.float32, G * S)]
    if n:
        want += [("grad", grad, param.dtype if grad_like_param else None, n), ("code", code, torch.uint8, n),
                 ("scale", scale, torch.float32, n // B), ("v_row", v_row, torch.float32, n // S)]
    for name, t, dtype, numel in want:
        if t.device != param.device:
            raise ValueError(f"{name} is on {t.device}, the parameter on {param.device}")
        check_tensor(name, t, dtype, numel)
    return G


def ratios_around_ema_(v_col: torch.Tensor, col_mean_sq: torch.Tensor, beta2: float):
    """``v_col``'s EMA by ``col_mean_sq``, in place, with the column ratios ``v_col / mean(v_col)`` from
    before it (what the stored codes are relative to) and after it (what the new ones will be), both
    contiguous: the step's only work on the replicated column statistics, shared by every implementation."""
    ratio_old = column_ratios(v_col).contiguous()
    ema_(v_col, col_mean_sq.view_as(v_col), beta2)
    return ratio_old, column_ratios(v_col).contiguous()


def nibble_step_factored_eager_(
    param: torch.Tensor,
    grad: torch.Tensor,
    code: torch.Tensor,
    scale: torch.Tensor,
    v_row: torch.Tensor,
    v_col: torch.Tensor,
    codebook: torch.Tensor,
    col_mean_sq: torch.Tensor,
    *,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    bc1: float,
    bc2: float,
    scale_block: int,
    key: int,
    row0: int = 0,
    row_block: int = 0,
    bound: float | None = None,
    update: str = "fp32",
) -> None:
    """One step of a piece of whole rows in the one-byte layout (the module's text), in place on
    ``param``, ``code`` (uint8, one per element), ``scale`` (float32 per scale block), ``v_row``
    (``[rows]`` of this piece) and ``v_col`` (``[slab]`` or D12's ``[G, slab]``, the same on every
    rank, advanced here by ``col_mean_sq``: the column means of ``g^2`` over all global rows, or over
    each row block's). ``row0``: the piece's first global row (the random numbers are keyed by the
    global element index ``row0 * slab + ...``); ``row_block``: global rows per block of a 2-D
    ``v_col``. ``key``: :func:`step_key` of this tensor at this step. ``bound``: D13's clamp, or None.
    ``update``: ``"fp32"`` (AdamW's update of the float32 moments) or ``"decoded"`` (of the stored)."""
    check_piece(param, grad, code, scale, v_row, v_col, col_mean_sq, scale_block=scale_block, row_block=row_block,
                update=update)
    slab, B = v_col.shape[-1], int(scale_block)
    ratio_old, ratio_new = ratios_around_ema_(v_col, col_mean_sq, beta2)
    if param.numel() == 0:
        return
    sqrt_bc2 = math.sqrt(bc2)
    p_all, g_all = param.view(-1, slab), grad.reshape(-1, slab)
    c_all, s_all, vr_all = code.view(-1, slab), scale.view(-1, slab // B), v_row.view(-1)
    rows_per = max(1, _EAGER_CHUNK_ELEMS // slab)
    for r0 in range(0, g_all.shape[0], rows_per):
        r1 = min(g_all.shape[0], r0 + rows_per)
        g = g_all[r0:r1].float()
        g2 = g * g
        m, v = decode(c_all[r0:r1], s_all[r0:r1],
                      vr_all[r0:r1].unsqueeze(1) * row_factors(ratio_old, row0, r0, r1, row_block), codebook, B)
        m = torch.lerp(m, g, 1.0 - beta1)
        v = ema_(v, g2, beta2)
        ema_(vr_all[r0:r1], g2.mean(dim=1), beta2)
        fac = vr_all[r0:r1].unsqueeze(1) * row_factors(ratio_new, row0, r0, r1, row_block)
        u_m, u_v = uniforms((row0 + r0) * slab, (r1 - r0) * slab, key, device=g.device)
        new, a = encode(m, v, fac, codebook, B, u_m.view(r1 - r0, slab), u_v.view(r1 - r0, slab))
        c_all[r0:r1] = new
        s_all[r0:r1] = a
        if update == "decoded":
            m, v = decode(new, a, fac, codebook, B)
        update_(p_all[r0:r1], m, v, lr=lr, weight_decay=weight_decay, eps=eps, bc1=bc1, sqrt_bc2=sqrt_bc2,
                bound=bound)
