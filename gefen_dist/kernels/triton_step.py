"""Fused GPU step for quantized tensors (Triton).

``quantized_step_`` has the signature and the math of
:func:`gefen_dist.core.step.quantized_step_eager_` and runs it in one kernel launch per call.
It mirrors the choices of the CPU kernel (:mod:`gefen_dist.kernels.cpu`,
``csrc/gefen_step.c``).

Layout
------
The piece is viewed as ``[n / B, B]`` (one row per scale block; ``B == P`` or ``P == 1``).
Each program owns ``ROWS`` consecutive scale blocks and sweeps them in column chunks of a
power-of-two ``BLOCK_SIZE`` with masking, so any ``B`` works (768, 1031, 1536, ...):

* sweep 1: ``m = lerp(C[idx] * M, g, 1 - beta1)``, its absmax ``A`` (NaN-propagating like
  ``torch.amax``) and, for ``P == B``, ``sum(g^2)``; then ``scale <- A``, ``v`` and ``sigma``
  per block;
* sweep 2: ``m`` again (same operations, so the same bits), ``z = m / A``, the nearest
  codeword, ``idx``, for ``P == 1`` the per-element ``v`` and ``sigma``, and the parameter.

Sweep 2 reads ``g`` and ``idx`` again; a program's blocks (a few KiB) should still be in L2
by then, so DRAM traffic stays near one read of ``g``, ``idx`` and ``p`` and one write of
``p`` and ``idx`` (``benchmarks/gpu_step.py`` measures it). All arithmetic is float32; the
parameter is updated in float32 and rounded once to its dtype. bfloat16 tensors travel as
int16 bits and are converted by hand (round to nearest even, NaN -> 0x7FC0, as the C kernel),
so the GPU and the interpreter (whose float -> bfloat16 cast truncates) round the same way.

Numerics
--------
The kernel is compiled with ``enable_fp_fusion=False`` and uses ``tl.fma`` exactly where
torch's kernels fuse: ``lerp`` (``fma(w, g - m, m)``, or ``fma(w - 1, g - m, g)`` for
``w >= 0.5``) and ``v.mul_(beta2).add_(r, alpha=1 - beta2)`` (``fma(r, 1 - beta2, beta2 v)``).
On CUDA both are taken as fused (nvcc contracts them in torch's elementwise kernels by
default; a GPU test allows a tiny idx mismatch fraction in case it does not); on CPU (the
Triton interpreter) the flags come from :func:`gefen_dist.kernels.cpu.numerics` when the
native library is available. Division and sqrt are the correctly rounded ``div_rn`` /
``sqrt_rn`` (Triton's default ``/`` and ``sqrt`` are approximate on NVIDIA GPUs).

With that, ``idx`` and ``scale`` agree bitwise with the eager path (``m`` and its
quantisation never depend on ``v``). ``mean(g^2)`` is summed in a different order than
torch's reduction, so ``v`` can differ in the last bit, and a per-element step size is computed
as the C kernel computes it (``inv_bc1 / (sqrt(v) * (1 / sqrt(bc2)) + eps)``, one division per
element, where the eager path divides twice), so ``sigma`` differs by a float32 ulp or two:
float32 parameters agree to ~1e-7 relative, bfloat16 parameters differ by one bf16 ulp in a
tiny fraction of elements (where the float32 result lies next to a rounding boundary).

Nearest codeword
----------------
The lookup table of :func:`gefen_dist.kernels.cpu.codebook_table` (its ``nb`` index entries;
built once per codebook, copied to the device with the 257-entry codebook, ``C[256] = +inf``,
and cached per codebook tensor and version): bucket ``k = (int) clamp(z * H + H, 0, NB - 1)``; in the
two-candidate mode the nearest codeword is ``lut[k]`` or ``lut[k] + 1`` (one comparison with
the reference's tie rule); otherwise ``lut[k]`` is a lower bound of ``#{C < z}`` and a bounded
forward scan (at most ``max_k lut[k+1] - lut[k]`` steps) finishes ``searchsorted``. Both are
identical to ``searchsorted(left)`` + lower index on ties for every float32 ``z``; NaN -> 255.
"""
from __future__ import annotations

import functools
import math
import logging
import os
import threading
import weakref
from collections import OrderedDict
from contextlib import nullcontext as _nullcontext
from dataclasses import dataclass
from typing import Dict, Optional, Tuple

import numpy as np
import torch

logger = logging.getLogger(__name__)

__all__ = ["available", "quantized_step_", "quantized_step_factored_"]

try:  # pragma: no cover - depends on the environment
    import triton
    import triton.language as tl

    _HAVE_TRITON = True
except Exception as _e:  # ImportError, or a broken install
    triton = None
    tl = None
    _HAVE_TRITON = False
    logger.debug("gefen_dist: triton unavailable (%s)", _e)

_TILE_ELEMS = 2048       # elements per program and chunk (ROWS * BLOCK_SIZE)
_MIN_CHUNK = 128         # smallest chunk considered for long blocks
_MAX_CHUNK = 2048
_TABLE_CACHE_SIZE = 64


def _interpret() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "on", "yes")


def available(device: Optional[torch.device] = None) -> bool:
    """Whether the Triton kernel can run: triton importable and CUDA available (for ``device``
    when given), or ``TRITON_INTERPRET=1`` (CPU tensors through the Triton interpreter)."""
    if not _HAVE_TRITON:
        return False
    if _interpret():
        return True
    if device is not None and torch.device(device).type != "cuda":
        return False
    return torch.cuda.is_available()


# --------------------------------------------------------------------------------------
# the kernel: a plain function, wrapped by triton.jit on first use (compiled, or interpreted
# when TRITON_INTERPRET=1; triton's own library is jit-wrapped when triton is first imported,
# so the variable must be set before that import for the interpreter to work)
# --------------------------------------------------------------------------------------

def _load_f32(ptr, offs, mask, IS_BF16: tl.constexpr):
    """float32 values (bfloat16 tensors travel as int16 bits: widened exactly by a shift)."""
    if IS_BF16:
        x = (tl.load(ptr + offs, mask=mask, other=0).to(tl.uint16, bitcast=True).to(tl.uint32) << 16).to(
            tl.float32, bitcast=True)
    else:
        x = tl.load(ptr + offs, mask=mask, other=0.0)
    return x


def _ema_m(g, idx_ptr, offs, mask, cb_ptr, Mb, lerp_c, LERP_SMALL: tl.constexpr, FUSED_LERP: tl.constexpr):
    """The first moment's EMA ``lerp(C[idx] * M, g, 1 - beta1)`` as torch computes it (both sweeps
    call this, so they get the same bits)."""
    ix = tl.load(idx_ptr + offs, mask=mask, other=0).to(tl.int32)
    m0 = tl.load(cb_ptr + ix) * Mb
    d = g - m0
    if LERP_SMALL:
        base = m0
    else:
        base = g
    if FUSED_LERP:
        m = tl.fma(d, lerp_c, base)
    else:
        m = base + d * lerp_c
    return m


def _step_rows(
    p_ptr, g_ptr, idx_ptr, scale_ptr, v_ptr, vc_ptr, cb_ptr, lut_ptr,
    r_first, nrows, S, B, NBLK, B_f, S_f, scan_steps, row0, row_block,
    lerp_c, beta2, alpha2, sqrt_bc2, eps, inv_bc1, lr, decay, lut_h, lut_nbm1, ubound,
    MODE: tl.constexpr, LERP_SMALL: tl.constexpr, FUSED_LERP: tl.constexpr,
    FUSED_AXPY: tl.constexpr, HAS_WD: tl.constexpr, LUT_FAST: tl.constexpr,
    IS_BF16: tl.constexpr, ROWS: tl.constexpr, BLOCK_SIZE: tl.constexpr,
):
    """Rows ``r_first .. r_first + ROWS`` of one tensor (the body of both kernels).

    MODE 0: v per scale block (P == B, S == B, NBLK == 1); 1: v per element (P == 1, S == B);
    2: factored, rows of S == NBLK * B elements, v_row per row, and ``vc_ptr`` the column factors
    ``sqrt(v_col / mean(v_col))`` of this step, ``[G, S]`` (:func:`column_factors`, from the
    updated v_col); each row takes those of its block of rows (global row ``row0 + r``, blocks of
    ``row_block`` rows)."""
    rows = r_first + tl.arange(0, ROWS)
    rmask = rows < nrows
    isb = tl.div_rn(1.0, sqrt_bc2)  # 1 / sqrt(bc2): per-element step sizes multiply by it, as the C kernel
    rbase = rows.to(tl.int64) * S
    cols0 = tl.arange(0, BLOCK_SIZE)

    if MODE == 2:
        # ---- sweep 0: the row's mean of g^2 -> v_row, sqrt(v_row) -------------------
        ss = tl.zeros([ROWS, BLOCK_SIZE], dtype=tl.float32)
        for c0 in range(0, S, BLOCK_SIZE):
            cols = c0 + cols0
            mask = rmask[:, None] & (cols < S)[None, :]
            offs = rbase[:, None] + cols[None, :]
            g = _load_f32_jit(g_ptr, offs, mask, IS_BF16)
            ss += g * g
        r = tl.div_rn(tl.sum(ss, axis=1), S_f)
        vt = tl.load(v_ptr + rows, mask=rmask, other=0.0) * beta2
        if FUSED_AXPY:
            vr = tl.fma(r, alpha2, vt)
        else:
            vr = vt + r * alpha2
        tl.store(v_ptr + rows, vr, mask=rmask)
        xr = (tl.sqrt_rn(vr) * isb)[:, None]  # sqrt(v_row) / sqrt(bc2), once per row
        # this row's block of rows (D12): its column factors, computed once per step and tensor
        cfbase = ((rows + row0) // row_block).to(tl.int64) * S

    for kb in range(0, NBLK):
        bbase = rbase + kb * B
        srow = rows.to(tl.int64) * NBLK + kb
        M = tl.load(scale_ptr + srow, mask=rmask, other=0.0)
        Mb = M[:, None]

        # ---- sweep 1: absmax of m (NaN-propagating), sum of g^2 ---------------------
        ss = tl.zeros([ROWS, BLOCK_SIZE], dtype=tl.float32)
        amax = tl.zeros([ROWS, BLOCK_SIZE], dtype=tl.float32)
        for c0 in range(0, B, BLOCK_SIZE):
            cols = c0 + cols0
            mask = rmask[:, None] & (cols < B)[None, :]
            offs = bbase[:, None] + cols[None, :]
            g = _load_f32_jit(g_ptr, offs, mask, IS_BF16)
            m = _ema_m_jit(g, idx_ptr, offs, mask, cb_ptr, Mb, lerp_c, LERP_SMALL, FUSED_LERP)
            if MODE == 0:
                ss += g * g
            am = tl.where(mask, tl.abs(m), 0.0)
            amax = tl.where((am > amax) | (am != am), am, amax)
        bad = amax != amax
        A = tl.max(tl.where(bad, 0.0, amax), axis=1)
        nan_sum = tl.sum(tl.where(bad, amax, 0.0), axis=1)  # NaN where any m is NaN, else 0
        A = tl.where(nan_sum != nan_sum, nan_sum, A)
        tl.store(scale_ptr + srow, A, mask=rmask)
        pos = A > 0.0
        Ad = tl.where(pos, A, 1.0)[:, None]
        posb = pos[:, None]
        Ab = A[:, None]

        if MODE == 0:
            r = tl.div_rn(tl.sum(ss, axis=1), B_f)
            vt = tl.load(v_ptr + rows, mask=rmask, other=0.0) * beta2
            if FUSED_AXPY:
                vb = tl.fma(r, alpha2, vt)
            else:
                vb = vt + r * alpha2
            tl.store(v_ptr + rows, vb, mask=rmask)
            sb = tl.div_rn(tl.sqrt_rn(vb), sqrt_bc2) + eps
            sigma_row = (tl.div_rn(1.0, sb) * inv_bc1)[:, None]

        # ---- sweep 2: quantize, update v (P == 1) and the parameter -------------------
        for c0 in range(0, B, BLOCK_SIZE):
            cols = c0 + cols0
            mask = rmask[:, None] & (cols < B)[None, :]
            offs = bbase[:, None] + cols[None, :]
            g = _load_f32_jit(g_ptr, offs, mask, IS_BF16)
            m = _ema_m_jit(g, idx_ptr, offs, mask, cb_ptr, Mb, lerp_c, LERP_SMALL, FUSED_LERP)
            z = tl.where(posb, tl.div_rn(m, Ad), 0.0)

            # nearest codeword: bucket (z * H exact, H a power of two), then table
            t = z * lut_h + lut_h
            t = tl.where(t > 0.0, t, 0.0)  # NaN -> 0
            t = tl.where(t < lut_nbm1, t, lut_nbm1)
            k = t.to(tl.int32)
            if LUT_FAST:
                jl = tl.load(lut_ptr + k)
                c0v = tl.load(cb_ptr + jl)
                c1v = tl.load(cb_ptr + jl + 1)
                sel = (z > c1v) | (tl.abs(z - c1v) < tl.abs(z - c0v))
                j = jl + sel.to(tl.int32)
                cq = tl.where(sel, c1v, c0v)
            else:
                j = tl.load(lut_ptr + k)
                for _ in range(scan_steps):
                    j += (tl.load(cb_ptr + j) < z).to(tl.int32)
                lo = tl.maximum(j - 1, 0)
                hi = tl.minimum(j, 255)
                clo = tl.load(cb_ptr + lo)
                chi = tl.load(cb_ptr + hi)
                take = tl.abs(z - chi) < tl.abs(z - clo)
                j = tl.where(take, hi, lo)
                cq = tl.where(take, chi, clo)
            isn = z != z
            j = tl.where(isn, 255, j)
            cq = tl.where(isn, 1.0, cq)  # C[255] == +1
            tl.store(idx_ptr + offs, j.to(tl.uint8), mask=mask)

            if MODE == 1:
                vt = tl.load(v_ptr + offs, mask=mask, other=0.0) * beta2
                r2 = g * g
                if FUSED_AXPY:
                    ve = tl.fma(r2, alpha2, vt)
                else:
                    ve = vt + r2 * alpha2
                tl.store(v_ptr + offs, ve, mask=mask)
                # inv_bc1 / (sqrt(v) * (1 / sqrt(bc2)) + eps): one division per element, as the C kernel
                sg = tl.div_rn(inv_bc1, tl.sqrt_rn(ve) * isb + eps)
            elif MODE == 2:
                # inv_bc1 / ((sqrt(v_row) / sqrt(bc2)) * col_f + eps), as the C kernel, with
                # col_f = sqrt(v_col / mean(v_col)) read from vc_ptr (:class:`ColumnFactors`)
                cf = tl.load(vc_ptr + cfbase[:, None] + (kb * B + cols)[None, :], mask=mask, other=0.0)
                sg = tl.div_rn(inv_bc1, xr * cf + eps)
            else:
                sg = sigma_row
            u = (cq * Ab) * sg
            # the bound (D13; +inf: none); comparisons are false for NaN, so NaN stays NaN
            u = tl.where(u > ubound, ubound, tl.where(u < -ubound, -ubound, u))
            u = u * lr
            pf = _load_f32_jit(p_ptr, offs, mask, IS_BF16)
            if HAS_WD:
                pf = pf * decay
            pf = pf - u
            if IS_BF16:
                # round to nearest even by hand, NaN -> 0x7FC0 (as csrc/gefen_step.c; exact on the
                # GPU and in the interpreter, whose float -> bfloat16 cast truncates)
                bits = pf.to(tl.uint32, bitcast=True)
                rb = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
                rb = tl.where(pf != pf, 0x7FC0, rb)
                tl.store(p_ptr + offs, rb.to(tl.uint16).to(tl.int16, bitcast=True), mask=mask)
            else:
                tl.store(p_ptr + offs, pf, mask=mask)


def _gefen_step_kernel(
    p_ptr, g_ptr, idx_ptr, scale_ptr, v_ptr, vc_ptr, cb_ptr, lut_ptr,
    nrows, S, B, NBLK, B_f, S_f, scan_steps, row0, row_block,
    lerp_c, beta2, alpha2, sqrt_bc2, eps, inv_bc1, lr, decay, lut_h, lut_nbm1, ubound,
    MODE: tl.constexpr, LERP_SMALL: tl.constexpr, FUSED_LERP: tl.constexpr,
    FUSED_AXPY: tl.constexpr, HAS_WD: tl.constexpr, LUT_FAST: tl.constexpr,
    IS_BF16: tl.constexpr, ROWS: tl.constexpr, BLOCK_SIZE: tl.constexpr,
):
    """One tensor; program ``pid`` steps rows ``pid * ROWS ..``."""
    _step_rows_jit(
        p_ptr, g_ptr, idx_ptr, scale_ptr, v_ptr, vc_ptr, cb_ptr, lut_ptr,
        tl.program_id(0) * ROWS, nrows, S, B, NBLK, B_f, S_f, scan_steps, row0, row_block,
        lerp_c, beta2, alpha2, sqrt_bc2, eps, inv_bc1, lr, decay, lut_h, lut_nbm1, ubound,
        MODE, LERP_SMALL, FUSED_LERP, FUSED_AXPY, HAS_WD, LUT_FAST, IS_BF16, ROWS, BLOCK_SIZE,
    )


def _gefen_multi_kernel(
    meta_ptr, gptr_ptr, prog_ptr, cb_ptr, lut_ptr, scan_steps,
    lerp_c, beta2, alpha2, sqrt_bc2, eps, inv_bc1, lr, decay, lut_h, lut_nbm1, ubound,
    MODE: tl.constexpr, LERP_SMALL: tl.constexpr, FUSED_LERP: tl.constexpr,
    FUSED_AXPY: tl.constexpr, HAS_WD: tl.constexpr, LUT_FAST: tl.constexpr,
    IS_BF16: tl.constexpr, ROWS: tl.constexpr, BLOCK_SIZE: tl.constexpr, ALIGNED: tl.constexpr = False,
):
    """Many tensors in one launch: program ``pid`` steps rows ``prog[pid, 1] ..`` of tensor
    ``prog[pid, 0]``, whose pointers and sizes are row ``t`` of ``meta`` (see :class:`MultiStep`)
    and whose gradient's address is ``gptr[t]``.

    ``ALIGNED``: the host checked that every member's parameter, gradient, index and column-profile
    pointers are 16-byte aligned and its row length ``S`` and scale block ``B`` multiples of 16 (:class:`MultiStep`);
    the promise lets the compiler prove what it cannot see through the metadata table and issue
    128-bit loads (the hints change the code, not one result bit)."""
    pid = tl.program_id(0)
    t = tl.load(prog_ptr + 2 * pid)
    r_first = tl.load(prog_ptr + 2 * pid + 1).to(tl.int32)
    mb = meta_ptr + t * _META
    if IS_BF16:
        p_ptr = tl.load(mb + 0).to(tl.pointer_type(tl.int16))
        g_ptr = tl.load(gptr_ptr + t).to(tl.pointer_type(tl.int16))
    else:
        p_ptr = tl.load(mb + 0).to(tl.pointer_type(tl.float32))
        g_ptr = tl.load(gptr_ptr + t).to(tl.pointer_type(tl.float32))
    idx_ptr = tl.load(mb + 1).to(tl.pointer_type(tl.uint8))
    scale_ptr = tl.load(mb + 2).to(tl.pointer_type(tl.float32))
    v_ptr = tl.load(mb + 3).to(tl.pointer_type(tl.float32))
    vc_ptr = tl.load(mb + 4).to(tl.pointer_type(tl.float32))
    nrows = tl.load(mb + 5).to(tl.int32)
    S = tl.load(mb + 6).to(tl.int32)
    B = tl.load(mb + 7).to(tl.int32)
    if ALIGNED:
        p_ptr = tl.multiple_of(p_ptr, 16)
        g_ptr = tl.multiple_of(g_ptr, 16)
        idx_ptr = tl.multiple_of(idx_ptr, 16)
        vc_ptr = tl.multiple_of(vc_ptr, 16)
        S = tl.multiple_of(S, 16)
        B = tl.multiple_of(B, 16)
    _step_rows_jit(
        p_ptr, g_ptr, idx_ptr, scale_ptr, v_ptr, vc_ptr, cb_ptr, lut_ptr,
        r_first, nrows, S, B, S // B, B.to(tl.float32), S.to(tl.float32), scan_steps,
        tl.load(mb + 8).to(tl.int32), tl.load(mb + 9).to(tl.int32),
        lerp_c, beta2, alpha2, sqrt_bc2, eps, inv_bc1, lr, decay, lut_h, lut_nbm1, ubound,
        MODE, LERP_SMALL, FUSED_LERP, FUSED_AXPY, HAS_WD, LUT_FAST, IS_BF16, ROWS, BLOCK_SIZE,
    )


def _colsum_kernel(gptr_ptr, chunk_ptr, tile_ptr, part_ptr, IS_BF16: tl.constexpr, RB: tl.constexpr,
                   BLOCK_C: tl.constexpr):
    """Column sums of float32 squares, accumulated in float64, over one chunk of rows of one
    tensor and one tile of ``BLOCK_C`` columns. Program ``pid`` takes entry ``pid`` of the tile
    table, (chunk ``c``, column tile): only tiles that hold columns are launched, on a 1-D grid
    (a second grid dimension would cap rows at 65,535 tiles, 16.78M elements). Chunk ``c`` =
    (tensor, first row, end row, S, offset of its ``S`` partial sums)."""
    pid = tl.program_id(0)
    c = tl.load(tile_ptr + 2 * pid)
    tile = tl.load(tile_ptr + 2 * pid + 1)
    cb = chunk_ptr + c * 5
    t = tl.load(cb + 0)
    r0 = tl.load(cb + 1).to(tl.int32)
    r1 = tl.load(cb + 2).to(tl.int32)
    S = tl.load(cb + 3)
    off = tl.load(cb + 4)
    if IS_BF16:
        g_ptr = tl.load(gptr_ptr + t).to(tl.pointer_type(tl.int16))
    else:
        g_ptr = tl.load(gptr_ptr + t).to(tl.pointer_type(tl.float32))
    cols = tile * BLOCK_C + tl.arange(0, BLOCK_C)
    cmask = cols < S
    acc = tl.zeros([RB, BLOCK_C], dtype=tl.float64)
    for r in range(r0, r1, RB):
        rows = r + tl.arange(0, RB)
        mask = (rows < r1)[:, None] & cmask[None, :]
        offs = rows.to(tl.int64)[:, None] * S + cols[None, :]
        g = _load_f32_jit(g_ptr, offs, mask, IS_BF16)
        acc += (g * g).to(tl.float64)
    tl.store(part_ptr + off + cols, tl.sum(acc, axis=0), mask=cmask)


def _colsum_reduce_kernel(part_ptr, red_ptr, tile_ptr, out_ptr, CH: tl.constexpr, BLOCK_C: tl.constexpr):
    """Sum the partial column sums of one (tensor, row block) over one tile of columns (program
    ``pid``: entry ``pid`` of the tile table, (entry ``e``, column tile), 1-D grid): entry ``e`` =
    (offset of its first chunk's sums, chunks, S, output offset); chunks are added in their order."""
    pid = tl.program_id(0)
    e = tl.load(tile_ptr + 2 * pid)
    tile = tl.load(tile_ptr + 2 * pid + 1)
    rb = red_ptr + e * 4
    first = tl.load(rb + 0)
    nch = tl.load(rb + 1).to(tl.int32)
    S = tl.load(rb + 2)
    out = tl.load(rb + 3)
    cols = tile * BLOCK_C + tl.arange(0, BLOCK_C)
    cmask = cols < S
    acc = tl.zeros([CH, BLOCK_C], dtype=tl.float64)
    for c0 in range(0, nch, CH):
        ch = c0 + tl.arange(0, CH)
        mask = (ch < nch)[:, None] & cmask[None, :]
        acc += tl.load(part_ptr + first + ch.to(tl.int64)[:, None] * S + cols[None, :], mask=mask, other=0.0)
    tl.store(out_ptr + out + cols, tl.sum(acc, axis=0), mask=cmask)


def _colfactor_kernel(tab_ptr, CHUNK: tl.constexpr):
    """The column factors ``sqrt(v_col / mean(v_col))`` (0 where the mean is not positive
    or NaN, as :func:`gefen_dist.core.step.column_factors`) of one row block's column profile:
    program ``pid`` takes row ``pid`` of the table, (address of the profile's ``S`` float32
    values, address of its ``S`` factors, ``S``). Once per step and tensor, so the update kernel reads one factor per element instead of summing the
    profile per row and dividing and taking a square root per element."""
    pid = tl.program_id(0)
    vc_ptr = tl.load(tab_ptr + 3 * pid).to(tl.pointer_type(tl.float32))
    cf_ptr = tl.load(tab_ptr + 3 * pid + 1).to(tl.pointer_type(tl.float32))
    S = tl.load(tab_ptr + 3 * pid + 2).to(tl.int32)
    cols0 = tl.arange(0, CHUNK)
    acc = tl.zeros([CHUNK], dtype=tl.float32)
    for c0 in range(0, S, CHUNK):
        cols = c0 + cols0
        acc += tl.load(vc_ptr + cols, mask=cols < S, other=0.0)
    mean = tl.div_rn(tl.sum(acc, axis=0), S.to(tl.float32))
    pos = mean > 0.0
    md = tl.where(pos, mean, 1.0)
    for c0 in range(0, S, CHUNK):
        cols = c0 + cols0
        m = cols < S
        v = tl.load(vc_ptr + cols, mask=m, other=0.0)
        tl.store(cf_ptr + cols, tl.where(pos, tl.sqrt_rn(tl.div_rn(v, md)), 0.0), mask=m)


_META = tl.constexpr(10) if _HAVE_TRITON else 10  # int64 fields per tensor in MultiStep's table
_kernels: Dict[Tuple[bool, str], object] = {}
_kernels_lock = threading.Lock()
# the helpers the kernels call, by these module-level names (jit-wrapped on first use)
_HELPERS = {"_step_rows_jit": _step_rows, "_load_f32_jit": _load_f32, "_ema_m_jit": _ema_m}
_step_rows_jit = _load_f32_jit = _ema_m_jit = None


def _kernel(name: str = "step"):
    """The jit-wrapped kernel ``name`` (step, multi, colsum, reduce, colfactor) for the current mode
    (compiled, or interpreted under TRITON_INTERPRET=1); the helpers are wrapped first and bound
    to their module-level names, by which the kernels call them."""
    interp = _interpret()
    with _kernels_lock:
        for hname, fn in _HELPERS.items():
            h = _kernels.get((interp, hname))
            if h is None:
                h = _kernels[(interp, hname)] = triton.jit(fn)
            globals()[hname] = h
        k = _kernels.get((interp, name))
        if k is None:
            fn = {"step": _gefen_step_kernel, "multi": _gefen_multi_kernel, "colsum": _colsum_kernel,
                  "reduce": _colsum_reduce_kernel, "colfactor": _colfactor_kernel}[name]
            k = _kernels[(interp, name)] = triton.jit(fn)
    return k


# --------------------------------------------------------------------------------------
# device tables
# --------------------------------------------------------------------------------------

@dataclass(frozen=True)
class _DeviceTable:
    cb: torch.Tensor    # float32 [257], cb[256] = +inf
    lut: torch.Tensor   # int32 [nb]: lower index (fast) or lower bound of #{C < z} (scan)
    fast: bool
    h: float
    nb: int
    scan_steps: int


_tables: "OrderedDict[Tuple[int, str], Tuple[weakref.ref, int, _DeviceTable]]" = OrderedDict()
_by_content: "OrderedDict[Tuple[bytes, str], _DeviceTable]" = OrderedDict()
_tables_lock = threading.Lock()


def _build_device_table(codebook: torch.Tensor, device: torch.device) -> _DeviceTable:
    from gefen_dist.kernels.cpu import codebook_table

    cbf = codebook.detach().to("cpu", torch.float32).contiguous().reshape(-1)
    key = (cbf.numpy().tobytes(), str(device))
    with _tables_lock:
        t = _by_content.get(key)
        if t is not None:
            _by_content.move_to_end(key)
            return t
    tab = codebook_table(cbf)
    nb = tab.nb
    lut = tab.lut[:nb].to(torch.int32).clone()
    steps = 0
    if tab.mode != 1:
        # lut[k+1] = #{C < lower bound of bucket k+1} >= #{C < z} for every z in bucket k
        ext = np.concatenate([lut.numpy().astype(np.int64), [256]])
        steps = int(np.diff(ext).max())
    t = _DeviceTable(tab.cb.to(device), lut.to(device), tab.mode == 1, float(tab.h), nb, steps)
    with _tables_lock:
        _by_content[key] = t
        while len(_by_content) > _TABLE_CACHE_SIZE:
            _by_content.popitem(last=False)
    return t


def _device_table(codebook: torch.Tensor, device: torch.device) -> _DeviceTable:
    """The table for ``codebook`` on ``device``; cached per codebook tensor (object and
    version counter), so a step does not copy the codebook to the host."""
    key = (id(codebook), str(device))
    ver = codebook._version
    with _tables_lock:
        hit = _tables.get(key)
        if hit is not None and hit[0]() is codebook and hit[1] == ver:
            _tables.move_to_end(key)
            return hit[2]
    t = _build_device_table(codebook, device)
    with _tables_lock:
        _tables[key] = (weakref.ref(codebook), ver, t)
        while len(_tables) > _TABLE_CACHE_SIZE:
            _tables.popitem(last=False)
    return t


# --------------------------------------------------------------------------------------
# numerics flags and launch configuration
# --------------------------------------------------------------------------------------

def _fma_flags(device: torch.device, small: bool) -> Tuple[bool, bool]:
    """(fused lerp, fused add(alpha)) as torch's kernels on ``device`` compute them."""
    if device.type == "cpu":
        try:
            from gefen_dist.kernels.cpu import numerics

            num = numerics()
        except Exception:  # pragma: no cover - no native library
            num = None
        if num is not None:
            return (num.fused_lerp_small if small else num.fused_lerp_large), num.fused_axpy
    return True, True


def _next_pow2(x: int) -> int:
    return 1 << max(0, int(x) - 1).bit_length()


@functools.lru_cache(maxsize=1024)
def _config(B: int, nrows: int, block_size: Optional[int] = None) -> Tuple[int, int, int]:
    """(ROWS, BLOCK_SIZE, num_warps). BLOCK_SIZE: the power of two that pads B least (larger
    on ties), between 128 (or next_pow2(B) when smaller) and 2048; ROWS fills 2048 elements."""
    if block_size is None:
        top = min(_next_pow2(B), _MAX_CHUNK)
        bs = top
        best = -(-B // bs) * bs
        c = top // 2
        while c >= _MIN_CHUNK:
            padded = -(-B // c) * c
            if padded < best:
                bs, best = c, padded
            c //= 2
    else:
        bs = int(block_size)
        if bs < 1 or bs & (bs - 1):
            raise ValueError(f"block_size must be a power of two, got {bs}")
    rows = max(1, min(_TILE_ELEMS // bs, _next_pow2(nrows)))
    warps = 4 if rows * bs <= 2048 else 8
    return rows, bs, warps


# --------------------------------------------------------------------------------------
# the step
# --------------------------------------------------------------------------------------

def _check(name: str, t: torch.Tensor, device: torch.device, dtype, numel: int) -> None:
    if t.device != device:
        raise ValueError(f"{name} is on {t.device}, expected {device}")
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous")
    if dtype is not None and t.dtype != dtype:
        raise ValueError(f"{name} must be {dtype}, got {t.dtype}")
    if t.numel() != numel:
        raise ValueError(f"{name} has {t.numel()} elements, expected {numel}")


def quantized_step_(
    param: torch.Tensor,
    grad: torch.Tensor,
    idx: torch.Tensor,
    scale: torch.Tensor,
    v: torch.Tensor,
    codebook: torch.Tensor,
    *,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    bc1: float,
    bc2: float,
    period: int,
    scale_block: int,
    bound: Optional[float] = None,
) -> None:
    """One Gefen update of a quantized piece, in place (Triton kernel; same contract as
    :func:`gefen_dist.core.step.quantized_step_eager_`). CUDA tensors, or CPU tensors with
    ``TRITON_INTERPRET=1``."""
    _launch(param, grad, idx, scale, v, codebook, lr=lr, beta1=beta1, beta2=beta2, eps=eps,
            weight_decay=weight_decay, bc1=bc1, bc2=bc2, period=period, scale_block=scale_block, bound=bound)


def quantized_step_factored_(
    param: torch.Tensor,
    grad: torch.Tensor,
    idx: torch.Tensor,
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
    row0: int = 0,
    row_block: int = 0,
    block_size: Optional[int] = None,
    bound: Optional[float] = None,
) -> None:
    """Gefen update with a factored second moment, in place (Triton kernel; same contract as
    :func:`gefen_dist.core.step.quantized_step_factored_eager_`). The ``v_col`` EMA is two torch
    operations on the device, the column factors ``sqrt(v_col / mean(v_col))`` one launch
    (:class:`ColumnFactors`, the mean summed in its order), each row's ``v_row`` and its scale
    blocks the update kernel's, with no host synchronisation."""
    n = param.numel()
    S, B = v_col.shape[-1], int(scale_block)
    if B < 1 or S < 1 or S % B:
        raise ValueError(f"scale block {B} must divide the row length {S}")
    if n % S:
        raise ValueError(f"numel {n} is not a multiple of the row length {S}")
    G = v_col.numel() // S
    device = param.device
    _check("v_col", v_col, device, torch.float32, G * S)
    _check("col_mean_sq", col_mean_sq, device, torch.float32, G * S)
    if G > 1 and (row_block < 1 or row0 < 0 or row0 + n // S > G * row_block):
        raise ValueError(f"v_col has {G} row blocks: need row_block >= 1 and rows [{row0}, {row0 + n // S}) "
                         f"inside {G} x {row_block} rows")
    if n:
        _check("v_row", v_row, device, torch.float32, n // S)
    v_col.mul_(beta2).add_(col_mean_sq.view_as(v_col), alpha=1.0 - beta2)
    if n == 0:
        return
    rb = int(row_block) if G > 1 else row0 + n // S + 1  # one block: every row in block 0
    cf = ColumnFactors([v_col], device).run()[0]
    _run(param, grad, idx, scale, v_row, cf, codebook, S=S, B=B, mode=2, row0=int(row0), row_block=rb,
         lr=lr, beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay, bc1=bc1, bc2=bc2,
         block_size=block_size, bound=bound)


def _launch(param, grad, idx, scale, v, codebook, *, lr, beta1, beta2, eps, weight_decay, bc1,
            bc2, period, scale_block, block_size: Optional[int] = None, bound: Optional[float] = None) -> None:
    P, B = int(period), int(scale_block)
    if P < 1 or B < 1 or not (P == 1 or P == B):
        raise ValueError(f"need period == scale_block or period == 1 (got P={P}, B={B})")
    n = param.numel()
    if n % B or n % P:
        raise ValueError(f"numel {n} is not a multiple of the blocks (P={P}, B={B})")
    if n:
        _check("v", v, param.device, torch.float32, n // P)
    _run(param, grad, idx, scale, v, v, codebook, S=B, B=B, mode=1 if P == 1 else 0, row0=0, row_block=1,
         lr=lr, beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay, bc1=bc1, bc2=bc2,
         block_size=block_size, bound=bound)


def _step_scalars(device, tab, *, lr, beta1, beta2, eps, weight_decay, bc1, bc2, bound=None) -> Tuple[tuple, dict]:
    """The kernels' trailing scalar arguments (as torch converts them: Python double -> float32
    opmath) and the constexprs that depend on the hyperparameters and the codebook table."""
    w = 1.0 - beta1
    small = abs(w) < 0.5
    wf = np.float32(w)
    fused_lerp, fused_axpy = _fma_flags(device, small)
    args = (float(wf) if small else float(wf - np.float32(1.0)),
            float(np.float32(beta2)), float(np.float32(1.0 - beta2)),
            float(np.float32(np.sqrt(bc2))), float(np.float32(eps)), float(np.float32(1.0 / bc1)),
            float(np.float32(lr)), float(np.float32(1.0 - lr * weight_decay)),
            tab.h, float(tab.nb - 1), math.inf if bound is None else float(np.float32(bound)))
    consts = dict(LERP_SMALL=small, FUSED_LERP=fused_lerp, FUSED_AXPY=fused_axpy, HAS_WD=(weight_decay != 0.0),
                  LUT_FAST=tab.fast)
    return args, consts


def _run(param, grad, idx, scale, v, v_col, codebook, *, S, B, mode, row0, row_block, lr, beta1, beta2,
         eps, weight_decay, bc1, bc2, block_size, bound=None) -> None:
    """Check the common arguments and launch the kernel over ``numel / S`` rows of ``S``."""
    n = param.numel()
    if n == 0:
        return
    if not _HAVE_TRITON:
        raise RuntimeError("triton is not importable")
    device = param.device
    if device.type != "cuda" and not _interpret():
        raise ValueError(f"the Triton step needs CUDA tensors (or TRITON_INTERPRET=1), got {device}")
    if param.dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"param dtype {param.dtype} not supported (float32, bfloat16)")
    _check("param", param, device, None, n)
    _check("grad", grad, device, param.dtype, n)
    _check("idx", idx, device, torch.uint8, n)
    _check("scale", scale, device, torch.float32, n // B)
    tab = _device_table(codebook, device)

    scalars, consts = _step_scalars(device, tab, lr=lr, beta1=beta1, beta2=beta2, eps=eps,
                                    weight_decay=weight_decay, bc1=bc1, bc2=bc2, bound=bound)
    nrows = n // S
    rows, bs, warps = _config(B, nrows, block_size)
    grid = (triton.cdiv(nrows, rows),)
    kern = _kernel()
    bf16 = param.dtype == torch.bfloat16
    # bfloat16 travels as int16 bits (converted by hand in the kernel)
    pk, gk = (param.view(torch.int16), grad.view(torch.int16)) if bf16 else (param, grad)
    ctx = torch.cuda.device(device) if device.type == "cuda" else _nullcontext()
    with ctx:
        kern[grid](
            pk, gk, idx, scale, v, v_col, tab.cb, tab.lut,
            nrows, S, B, S // B, float(B), float(S), tab.scan_steps, row0, row_block, *scalars,
            MODE=mode, IS_BF16=bf16, ROWS=rows, BLOCK_SIZE=bs, num_warps=warps, enable_fp_fusion=False, **consts,
        )
    for t in (param, idx, scale, v):
        torch.autograd.graph.increment_version(t)


# --------------------------------------------------------------------------------------
# many tensors per launch (the optimizer's CUDA path)
# --------------------------------------------------------------------------------------

@dataclass(frozen=True)
class StepItem:
    """One contiguous tensor (or local piece) for :class:`MultiStep`: ``v`` is the per-block or
    per-element v (``mode`` 0 / 1) or ``v_row`` (``mode`` 2, factored, with ``v_col`` ``[G, S]``
    holding this step's column factors ``sqrt(v_col / mean(v_col))``, :class:`ColumnFactors`'
    view, rewritten in place each step; rows of this piece starting at global row ``row0``,
    blocks of ``row_block`` rows)."""

    param: torch.Tensor
    idx: torch.Tensor
    scale: torch.Tensor
    v: torch.Tensor
    v_col: Optional[torch.Tensor]
    S: int
    B: int
    mode: int
    row0: int = 0
    row_block: int = 1


def _pinned_to(values, device: torch.device) -> torch.Tensor:
    """An int64 table on ``device`` without a host synchronisation (pinned, non-blocking copy)."""
    t = torch.tensor(values, dtype=torch.int64)
    if device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t


class _GradTable:
    """The gradients' addresses on the device, copied again only when they change."""

    def __init__(self, device: torch.device):
        self.device = device
        self._ptrs: Optional[list] = None
        self._table: Optional[torch.Tensor] = None

    def __call__(self, grads) -> torch.Tensor:
        ptrs = [0 if g is None else g.data_ptr() for g in grads]
        if ptrs != self._ptrs:
            self._table = _pinned_to(ptrs, self.device)
            self._ptrs = ptrs
        return self._table


# ptxas's own choice for the multi kernel spilled a few registers to local memory in its prologue in
# some tile configurations (e.g. 96 registers and 4 spill stores for 4x512, shared mode); the
# register ceiling stated explicitly gives 115-168 registers and no spill in every shipped
# configuration (benchmarks/triton_sm90.py, sm_90, triton 3.9; tests/test_triton_sm90.py).
_MULTI_MAXNREG = 255


def multi_launch_options() -> Dict[str, int]:
    """The compiler options of every multi-kernel launch besides ``num_warps``."""
    return {"maxnreg": _MULTI_MAXNREG}


def _aligned(it) -> bool:
    """Whether item ``it`` of a :class:`MultiStep` meets the multi kernel's ``ALIGNED`` promise for its
    own tensors (16-byte aligned pointers, row length and scale block multiples of 16); the
    gradient is checked at each run."""
    ptrs = [it.param.data_ptr(), it.idx.data_ptr(), (it.v_col if it.v_col is not None else it.v).data_ptr()]
    return it.S % 16 == 0 and it.B % 16 == 0 and all(p % 16 == 0 for p in ptrs)


class MultiStep:
    """The Gefen update of many tensors with one kernel launch per (mode, dtype, chunk config):
    the same per-row work as :func:`quantized_step_` / :func:`quantized_step_factored_`, so each
    tensor's result is bitwise that of its own launch. Built once for a fixed set of tensors
    (their state tensors must stay in place); :meth:`run` takes this step's gradients.

    ``config`` = (ROWS, BLOCK_SIZE, num_warps) forces one launch configuration on every tensor
    instead of :func:`_config`'s choice (benchmarks/gpu_step.py --tune times them); results then
    differ from single-tensor launches in the summation order of mean(g^2)."""

    def __init__(self, items, device: torch.device, config: Optional[Tuple[int, int, int]] = None):
        if config is not None and (len(config) != 3 or any(int(c) < 1 for c in config)):
            raise ValueError(f"config must be (ROWS, BLOCK_SIZE, num_warps) of positive ints, got {config!r}")
        self.device = torch.device(device)
        self.items = list(items)
        buckets: Dict[tuple, list] = {}
        for i, it in enumerate(self.items):
            n = it.param.numel()
            if n == 0:
                continue
            if it.param.dtype not in (torch.float32, torch.bfloat16):
                raise ValueError(f"param dtype {it.param.dtype} not supported (float32, bfloat16)")
            if it.S % it.B or n % it.S or (it.mode != 2 and it.S != it.B):
                raise ValueError(f"bad item {i}: S={it.S}, B={it.B}, mode={it.mode}, numel={n}")
            rows, bs, warps = tuple(config) if config is not None else _config(it.B, n // it.S)
            buckets.setdefault((it.mode, it.param.dtype == torch.bfloat16, rows, bs, warps, _aligned(it)),
                               []).append(i)
        self._launches = []
        for (mode, bf16, rows, bs, warps, aligned), members in buckets.items():
            meta, prog = [], []
            for t, i in enumerate(members):
                it = self.items[i]
                nrows = it.param.numel() // it.S
                vc = it.v_col.data_ptr() if it.v_col is not None else it.v.data_ptr()
                one_block = it.v_col is None or it.v_col.numel() == it.S
                rb = it.row0 + nrows + 1 if one_block else it.row_block  # one block: every row in block 0
                meta.append([it.param.data_ptr(), it.idx.data_ptr(), it.scale.data_ptr(), it.v.data_ptr(), vc,
                             nrows, it.S, it.B, it.row0, rb])
                prog += [[t, r] for r in range(0, nrows, rows)]
            self._launches.append(dict(
                mode=mode, bf16=bf16, rows=rows, bs=bs, warps=warps, members=members, aligned=aligned,
                meta=_pinned_to(meta, self.device), prog=_pinned_to(prog, self.device), nprog=len(prog),
                grads=_GradTable(self.device)))

    @property
    def launches(self) -> int:
        return len(self._launches)

    def run(self, grads, codebook: torch.Tensor, *, lr: float, beta1: float, beta2: float, eps: float,
            weight_decay: float, bc1: float, bc2: float, bound: Optional[float] = None) -> None:
        """One step of every item; ``grads[i]`` (contiguous, the item's dtype and size) for item ``i``;
        ``bound`` as for :func:`quantized_step_`."""
        tab = _device_table(codebook, self.device)
        scalars, consts = _step_scalars(self.device, tab, lr=lr, beta1=beta1, beta2=beta2, eps=eps,
                                        weight_decay=weight_decay, bc1=bc1, bc2=bc2, bound=bound)
        kern = _kernel("multi")
        ctx = torch.cuda.device(self.device) if self.device.type == "cuda" else _nullcontext()
        with ctx:
            for L in self._launches:
                gs = [grads[i] for i in L["members"]]
                # the promise of ALIGNED covers the gradients too, which may move between steps
                aligned = L["aligned"] and all(g.data_ptr() % 16 == 0 for g in gs)
                kern[(L["nprog"],)](
                    L["meta"], L["grads"](gs), L["prog"], tab.cb, tab.lut, tab.scan_steps, *scalars,
                    MODE=L["mode"], IS_BF16=L["bf16"], ROWS=L["rows"], BLOCK_SIZE=L["bs"], ALIGNED=aligned,
                    num_warps=L["warps"], enable_fp_fusion=False, **multi_launch_options(), **consts,
                )
        for it in self.items:
            for t in (it.param, it.idx, it.scale, it.v):
                torch.autograd.graph.increment_version(t)


_CS_RB = 16        # rows per iteration of the column-sum kernel
_CS_BLOCK_C = 256  # columns per program
_CS_CHUNKS = 32    # chunks (programs along the rows) per block of rows, at most
_CS_CH = 32        # chunks added per iteration of the reduction


class ColumnSums:
    """Per-column sums of ``g^2`` (float32 squares added in float64) of many gradients, per block
    of rows (D12), in two launches per dtype plus one: each (tensor, row block) is cut into at
    most 32 chunks of rows whose partial sums are added in a fixed order, so the result does not
    depend on scheduling. ``specs[i]`` = (rows, S, row0, row_block, G, dtype) of gradient ``i``;
    :meth:`run` returns ``[sum_i G_i * S_i]`` float64 in that order (the layout of the
    optimizer's all-reduced column statistics)."""

    def __init__(self, specs, device: torch.device):
        self.device = torch.device(device)
        self.specs = list(specs)
        chunks: Dict[bool, list] = {}
        red = []
        part = out = 0
        for i, (rows, S, row0, row_block, G, dtype) in enumerate(self.specs):
            bf16 = dtype == torch.bfloat16
            for b in range(G):
                lo = max(0, b * row_block - row0) if G > 1 else 0
                hi = min(rows, (b + 1) * row_block - row0) if G > 1 else rows
                first, n = part, 0
                if hi > lo:
                    step = -(-(hi - lo) // _CS_CHUNKS)
                    step = -(-step // _CS_RB) * _CS_RB
                    for r in range(lo, hi, step):
                        chunks.setdefault(bf16, []).append([i, r, min(hi, r + step), S, part])
                        part += S
                        n += 1
                red.append([first, n, S, out + b * S])
            out += G * S
        self.total = out
        self._part_elems = max(1, part)

        def tiles(table, s_at):  # (entry, column tile) for every tile holding columns of the entry's S
            return [[j, t] for j, row in enumerate(table) for t in range(-(-int(row[s_at]) // _CS_BLOCK_C))]

        self._chunk_tabs = {}
        for bf16, c in chunks.items():  # chunk rows: (tensor, first row, end row, S, offset)
            ct = tiles(c, 3)
            self._chunk_tabs[bf16] = (_pinned_to(c, self.device), _pinned_to(ct, self.device), len(ct))
        self._members = {bf16: {c[0] for c in cs} for bf16, cs in chunks.items()}
        # the chunk table names gradients by their index in specs: one address table per dtype
        self._grads = {bf16: _GradTable(self.device) for bf16 in chunks}
        self._red = _pinned_to(red, self.device)
        self._nred = len(red)
        red_tiles = tiles(red, 2)  # reduction rows: (first chunk's offset, chunks, S, output offset)
        self._red_tiles, self._nred_tiles = _pinned_to(red_tiles, self.device), len(red_tiles)

    @property
    def programs(self) -> int:
        """Programs launched per :meth:`run` (every one has columns to sum)."""
        return sum(n for _, _, n in self._chunk_tabs.values()) + self._nred_tiles

    def run(self, grads) -> torch.Tensor:
        if not self._nred:
            return torch.zeros(self.total, dtype=torch.float64, device=self.device)
        # every element of both is written below (each chunk's S partial sums, each entry's S sums)
        out = torch.empty(self.total, dtype=torch.float64, device=self.device)
        part = torch.empty(self._part_elems, dtype=torch.float64, device=self.device)
        ctx = torch.cuda.device(self.device) if self.device.type == "cuda" else _nullcontext()
        with ctx:
            for bf16, (tab, ttab, n) in self._chunk_tabs.items():
                # addresses indexed by position in specs (gradients of the other dtype: 0, unused)
                mem = self._members[bf16]
                gt = self._grads[bf16]([g if i in mem else None for i, g in enumerate(grads)])
                _kernel("colsum")[(n,)](gt, tab, ttab, part, IS_BF16=bf16, RB=_CS_RB, BLOCK_C=_CS_BLOCK_C, num_warps=4)
            _kernel("reduce")[(self._nred_tiles,)](part, self._red, self._red_tiles, out, CH=_CS_CH,
                                                   BLOCK_C=_CS_BLOCK_C, num_warps=4)
        return out


_CF_CHUNK = 1024  # profile values per iteration of the column-factor kernel


class ColumnFactors:
    """The column factors ``sqrt(v_col / mean(v_col))`` of many factored tensors in one launch:
    ``v_cols[i]`` (``[S]`` or ``[G, S]``, float32, contiguous) gets ``views[i]``, a tensor of its
    shape in one flat buffer that every :meth:`run` rewrites (so update kernels built on it keep
    their pointers). One program per row block's profile."""

    def __init__(self, v_cols, device: torch.device):
        self.device = torch.device(device)
        self.v_cols = list(v_cols)
        for i, v in enumerate(self.v_cols):
            if v.dtype != torch.float32 or not v.is_contiguous() or v.device != self.device:
                raise ValueError(f"v_col {i}: need a contiguous float32 tensor on {self.device}, got "
                                 f"{v.dtype} on {v.device}{'' if v.is_contiguous() else ', non-contiguous'}")
        self.out = torch.empty(sum(v.numel() for v in self.v_cols), dtype=torch.float32, device=self.device)
        self.views, tab, o = [], [], 0
        for v in self.v_cols:
            S = v.shape[-1]
            self.views.append(self.out[o:o + v.numel()].view(v.shape))
            for b in range(v.numel() // S if S else 0):
                tab.append([v.data_ptr() + 4 * b * S, self.out.data_ptr() + 4 * (o + b * S), S])
            o += v.numel()
        self._n = len(tab)
        self._tab = _pinned_to(tab, self.device) if tab else None

    def run(self):
        """The factors of the ``v_cols`` as they are now (``views``)."""
        if self._n:
            ctx = torch.cuda.device(self.device) if self.device.type == "cuda" else _nullcontext()
            with ctx:
                _kernel("colfactor")[(self._n,)](self._tab, CHUNK=_CF_CHUNK, num_warps=4)
        return self.views
