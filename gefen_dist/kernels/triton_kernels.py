"""The Triton kernels of the GPU step: plain functions, wrapped by ``triton.jit`` on first use
(:func:`_kernel`; compiled, or interpreted under ``TRITON_INTERPRET=1``). The update kernels have
the math of :func:`gefen_dist.core.step.quantized_step_eager_` /
:func:`~gefen_dist.core.step.quantized_step_factored_eager_` and mirror the choices of the CPU
kernel (:mod:`gefen_dist.kernels.cpu`, ``csrc/gefen_step.c``); their entry points are
:mod:`gefen_dist.kernels.triton_step` (one tensor) and :mod:`gefen_dist.kernels.triton_multi`
(many tensors per launch).

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
The lookup table of :func:`gefen_dist.kernels.cpu_tables.codebook_table` (its ``nb`` index entries;
built once per codebook, copied to the device with the 257-entry codebook, ``C[256] = +inf``,
and cached per codebook tensor and version): bucket ``k = (int) clamp(z * H + H, 0, NB - 1)``; in the
two-candidate mode the nearest codeword is ``lut[k]`` or ``lut[k] + 1``: with per-element step sizes
(modes 1 and 2) the kernel reads the bucket's 16-byte entry ``(C[lut[k]], C[lut[k] + 1], flip point,
lut[k])`` (``tab_ptr``, float32 ``[nb, 4]``; :func:`gefen_dist.core.quant.flip_points`) with one
128-bit load and takes the upper codeword when ``z >= flip point``, in mode 0 it reads ``lut[k]`` and
the two codewords and compares the two distances (both exactly the reference's rule and tie);
otherwise ``tab_ptr`` is the int32 table, ``lut[k]`` a lower bound of ``#{C < z}``, and a bounded
forward scan (at most ``max_k lut[k+1] - lut[k]`` steps) finishes ``searchsorted``. Both are
identical to ``searchsorted(left)`` + lower index on ties for every float32 ``z``; NaN -> 255.
"""
from __future__ import annotations

import logging
import os
import threading
from typing import Dict, Tuple

logger = logging.getLogger(__name__)

try:  # pragma: no cover - depends on the environment
    import triton
    import triton.language as tl

    _HAVE_TRITON = True
except Exception as _e:  # ImportError, or a broken install
    triton = None
    tl = None
    _HAVE_TRITON = False
    logger.debug("gefen_dist: triton unavailable (%s)", _e)


def _interpret() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "on", "yes")


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


def _nearest(z, cb_ptr, tab_ptr, lut_h, lut_nbm1, scan_steps, MODE: tl.constexpr, LUT_FAST: tl.constexpr,
             ROWS: tl.constexpr, BLOCK_SIZE: tl.constexpr):
    """The nearest codeword of ``z`` (``[ROWS, BLOCK_SIZE]``): its index (int32; 255 for NaN) and
    value (the module docstring's table lookup; ``MODE`` as :func:`_step_rows`'s, which selects the
    table that ``tab_ptr`` is)."""
    # bucket (z * H exact, H a power of two), then table
    t = z * lut_h + lut_h
    t = tl.where(t > 0.0, t, 0.0)  # NaN -> 0
    t = tl.where(t < lut_nbm1, t, lut_nbm1)
    k = t.to(tl.int32)
    if LUT_FAST and MODE != 0:
        # the bucket's entry (c0, c1, flip point, lower index's bits): one 16-byte load, no
        # dependent lookups; z >= flip point is the two-candidate rule (core.quant.flip_points)
        e = tl.load(tab_ptr + (k * 4)[:, :, None] + tl.arange(0, 4)[None, None, :])
        # split takes the last axis: [.., a, b] = e[.., 2a + b], so b = 0 is (c0, thr), b = 1 (c1, j)
        even, odd = tl.split(tl.reshape(e, (ROWS, BLOCK_SIZE, 2, 2)))
        c0v, thr = tl.split(even)
        c1v, jf = tl.split(odd)
        sel = z >= thr
        j = jf.to(tl.int32, bitcast=True) + sel.to(tl.int32)
        cq = tl.where(sel, c1v, c0v)
    elif LUT_FAST:  # mode 0: tab_ptr is the int32 table (TritonTables.kernel_table)
        jl = tl.load(tab_ptr + k)
        c0v = tl.load(cb_ptr + jl)
        c1v = tl.load(cb_ptr + jl + 1)
        sel = (z > c1v) | (tl.abs(z - c1v) < tl.abs(z - c0v))
        j = jl + sel.to(tl.int32)
        cq = tl.where(sel, c1v, c0v)
    else:
        j = tl.load(tab_ptr + k)
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
    return j, cq


def _update_param(p_ptr, offs, mask, u, decay, HAS_WD: tl.constexpr, IS_BF16: tl.constexpr):
    """``p <- p * decay - u`` in float32 (decay only with weight decay), rounded once to the
    parameter's dtype."""
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


def _step_rows(
    p_ptr, g_ptr, idx_ptr, scale_ptr, v_ptr, vc_ptr, cb_ptr, tab_ptr,
    r_first, nrows, S, B, NBLK, B_f, S_f, scan_steps, row0, row_block,
    lerp_c, beta2, alpha2, sqrt_bc2, eps, inv_bc1, lr, decay, lut_h, lut_nbm1, ubound, K, C, C_f,
    MODE: tl.constexpr, LERP_SMALL: tl.constexpr, FUSED_LERP: tl.constexpr,
    FUSED_AXPY: tl.constexpr, HAS_WD: tl.constexpr, LUT_FAST: tl.constexpr,
    IS_BF16: tl.constexpr, ROWS: tl.constexpr, BLOCK_SIZE: tl.constexpr, COLB: tl.constexpr,
):
    """Rows ``r_first .. r_first + ROWS`` of one tensor (the body of both kernels).

    MODE 0: v per scale block (P == B, S == B, NBLK == 1); 1: v per element (P == 1, S == B);
    2: factored, rows of S == NBLK * B elements, v_row per row, and ``vc_ptr`` the column factors
    ``sqrt(v_col / mean(v_col))`` of this step, ``[G, S]``
    (:class:`~gefen_dist.kernels.triton_multi.ColumnFactors`, from the updated v_col); each row takes those of its block of rows (global row ``row0 + r``, blocks of
    ``row_block`` rows). ``COLB`` (MODE 2, D21): ``K`` column blocks of ``C`` columns (``C_f`` as a float), the
    scale block dividing ``C``: ``v_row`` ``[rows, K]`` from each block's mean of ``g^2``, each scale block with
    its column block's ``sqrt(v_row)``, the column factors one block of rows normalised per column block."""
    rows = r_first + tl.arange(0, ROWS)
    rmask = rows < nrows
    isb = tl.div_rn(1.0, sqrt_bc2)  # 1 / sqrt(bc2): per-element step sizes multiply by it, as the C kernel
    rbase = rows.to(tl.int64) * S
    cols0 = tl.arange(0, BLOCK_SIZE)

    if MODE == 2 and COLB:
        # ---- sweep 0, column blocks (D21): each block's mean of g^2 -> v_row[r, c] ---------
        for c in range(0, K):
            ss = tl.zeros([ROWS, BLOCK_SIZE], dtype=tl.float32)
            for c0 in range(0, C, BLOCK_SIZE):
                cols = c * C + c0 + cols0
                mask = rmask[:, None] & (cols < (c + 1) * C)[None, :]
                offs = rbase[:, None] + cols[None, :]
                g = _load_f32_jit(g_ptr, offs, mask, IS_BF16)
                ss += g * g
            r = tl.div_rn(tl.sum(ss, axis=1), C_f)
            vt = tl.load(v_ptr + rows * K + c, mask=rmask, other=0.0) * beta2
            if FUSED_AXPY:
                vr = tl.fma(r, alpha2, vt)
            else:
                vr = vt + r * alpha2
            tl.store(v_ptr + rows * K + c, vr, mask=rmask)
        cfbase = tl.zeros([ROWS], dtype=tl.int64)  # one block of rows
    elif MODE == 2:
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
        if MODE == 2 and COLB:  # this scale block's column block (D21): its sqrt(v_row) / sqrt(bc2)
            vrb = tl.load(v_ptr + rows * K + (kb * B) // C, mask=rmask, other=0.0)
            xr = (tl.sqrt_rn(vrb) * isb)[:, None]
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

            j, cq = _nearest_jit(z, cb_ptr, tab_ptr, lut_h, lut_nbm1, scan_steps, MODE, LUT_FAST, ROWS, BLOCK_SIZE)
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
            _update_param_jit(p_ptr, offs, mask, u, decay, HAS_WD, IS_BF16)


def _gefen_step_kernel(
    p_ptr, g_ptr, idx_ptr, scale_ptr, v_ptr, vc_ptr, cb_ptr, tab_ptr,
    nrows, S, B, NBLK, B_f, S_f, scan_steps, row0, row_block,
    lerp_c, beta2, alpha2, sqrt_bc2, eps, inv_bc1, lr, decay, lut_h, lut_nbm1, ubound, K, C, C_f,
    MODE: tl.constexpr, LERP_SMALL: tl.constexpr, FUSED_LERP: tl.constexpr,
    FUSED_AXPY: tl.constexpr, HAS_WD: tl.constexpr, LUT_FAST: tl.constexpr,
    IS_BF16: tl.constexpr, ROWS: tl.constexpr, BLOCK_SIZE: tl.constexpr, COLB: tl.constexpr,
):
    """One tensor; program ``pid`` steps rows ``pid * ROWS ..`` (``COLB``: column blocks, D21)."""
    _step_rows_jit(
        p_ptr, g_ptr, idx_ptr, scale_ptr, v_ptr, vc_ptr, cb_ptr, tab_ptr,
        tl.program_id(0) * ROWS, nrows, S, B, NBLK, B_f, S_f, scan_steps, row0, row_block,
        lerp_c, beta2, alpha2, sqrt_bc2, eps, inv_bc1, lr, decay, lut_h, lut_nbm1, ubound, K, C, C_f,
        MODE, LERP_SMALL, FUSED_LERP, FUSED_AXPY, HAS_WD, LUT_FAST, IS_BF16, ROWS, BLOCK_SIZE, COLB,
    )


def _table_ptrs(meta_row, gptr_ptr, t, IS_BF16: tl.constexpr):
    """A multi-tensor table's parameter pointer (``meta_row[0]``) and gradient pointer (``gptr[t]``) of
    tensor ``t``, typed for its dtype (bf16 as int16 bits)."""
    if IS_BF16:
        p_ptr = tl.load(meta_row + 0).to(tl.pointer_type(tl.int16))
        g_ptr = tl.load(gptr_ptr + t).to(tl.pointer_type(tl.int16))
    else:
        p_ptr = tl.load(meta_row + 0).to(tl.pointer_type(tl.float32))
        g_ptr = tl.load(gptr_ptr + t).to(tl.pointer_type(tl.float32))
    return p_ptr, g_ptr


def _device_scalars(hp_ptr, nrows):
    """``capturable=True``: the step's scalars read on the device (``hp_ptr`` = skip, sqrt(bc2), 1 / bc1, lr,
    1 - lr wd, bound; :data:`~gefen_dist.kernels.triton_tables.DEVICE_HP_FIELDS`) and ``nrows``, zero
    when the step is skipped (no row of the program is stepped)."""
    return (tl.where(tl.load(hp_ptr) != 0.0, 0, nrows), tl.load(hp_ptr + 1), tl.load(hp_ptr + 2),
            tl.load(hp_ptr + 3), tl.load(hp_ptr + 4), tl.load(hp_ptr + 5))


def _gefen_multi_kernel(
    meta_ptr, gptr_ptr, prog_ptr, cb_ptr, tab_ptr, scan_steps, hp_ptr,
    lerp_c, beta2, alpha2, sqrt_bc2, eps, inv_bc1, lr, decay, lut_h, lut_nbm1, ubound,
    MODE: tl.constexpr, LERP_SMALL: tl.constexpr, FUSED_LERP: tl.constexpr,
    FUSED_AXPY: tl.constexpr, HAS_WD: tl.constexpr, LUT_FAST: tl.constexpr,
    IS_BF16: tl.constexpr, ROWS: tl.constexpr, BLOCK_SIZE: tl.constexpr, ALIGNED: tl.constexpr = False,
    DEVICE_HP: tl.constexpr = False, COLB: tl.constexpr = False,
):
    """Many tensors in one launch: program ``pid`` steps rows ``prog[pid, 1] ..`` of tensor
    ``prog[pid, 0]``, whose pointers and sizes are row ``t`` of ``meta`` (see :class:`MultiStep`)
    and whose gradient's address is ``gptr[t]``.

    ``ALIGNED``: the host checked that every member's parameter, gradient, index and column-profile
    pointers are 16-byte aligned and its row length ``S`` and scale block ``B`` multiples of 16 (:class:`MultiStep`);
    the promise lets the compiler prove what it cannot see through the metadata table and issue
    128-bit loads (the hints change the code, not one result bit).

    ``DEVICE_HP`` (``capturable=True``): the step's scalars that change from step to step are read
    from the device, ``hp_ptr`` = (skip, sqrt(bc2), 1 / bc1, lr, 1 - lr wd, bound) in float32
    (:func:`~gefen_dist.kernels.triton_tables.device_step_scalars`), replacing the arguments of those
    names; a non-zero ``skip`` (a non-finite gradient under ``nonfinite="skip"``) makes every row
    masked, so the launch changes nothing. Otherwise ``hp_ptr`` is not read.

    ``COLB`` (MODE 2, D21): every member has column blocks, ``K = meta[t, 10]`` of them (the per-tensor
    kernel's ``COLB`` path: the same arithmetic on the same arguments)."""
    pid = tl.program_id(0)
    t = tl.load(prog_ptr + 2 * pid)
    r_first = tl.load(prog_ptr + 2 * pid + 1).to(tl.int32)
    mb = meta_ptr + t * _META
    p_ptr, g_ptr = _table_ptrs_jit(mb, gptr_ptr, t, IS_BF16)
    idx_ptr = tl.load(mb + 1).to(tl.pointer_type(tl.uint8))
    scale_ptr = tl.load(mb + 2).to(tl.pointer_type(tl.float32))
    v_ptr = tl.load(mb + 3).to(tl.pointer_type(tl.float32))
    vc_ptr = tl.load(mb + 4).to(tl.pointer_type(tl.float32))
    nrows = tl.load(mb + 5).to(tl.int32)
    S = tl.load(mb + 6).to(tl.int32)
    B = tl.load(mb + 7).to(tl.int32)
    if DEVICE_HP:
        nrows, sqrt_bc2, inv_bc1, lr, decay, ubound = _device_scalars_jit(hp_ptr, nrows)
    if ALIGNED:
        p_ptr = tl.multiple_of(p_ptr, 16)
        g_ptr = tl.multiple_of(g_ptr, 16)
        idx_ptr = tl.multiple_of(idx_ptr, 16)
        vc_ptr = tl.multiple_of(vc_ptr, 16)
        S = tl.multiple_of(S, 16)
        B = tl.multiple_of(B, 16)
    if COLB:
        K = tl.load(mb + 10).to(tl.int32)
    else:
        K = 1
    C = S // K
    _step_rows_jit(
        p_ptr, g_ptr, idx_ptr, scale_ptr, v_ptr, vc_ptr, cb_ptr, tab_ptr,
        r_first, nrows, S, B, S // B, B.to(tl.float32), S.to(tl.float32), scan_steps,
        tl.load(mb + 8).to(tl.int32), tl.load(mb + 9).to(tl.int32),
        lerp_c, beta2, alpha2, sqrt_bc2, eps, inv_bc1, lr, decay, lut_h, lut_nbm1, ubound, K, C, C.to(tl.float32),
        MODE, LERP_SMALL, FUSED_LERP, FUSED_AXPY, HAS_WD, LUT_FAST, IS_BF16, ROWS, BLOCK_SIZE, COLB,
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


def _span_rows(b, k, row0, nrows):
    """The local rows ``[lo, hi)`` of block ``b`` (blocks of ``k`` global rows) in a piece of whole rows
    that starts at global row ``row0`` and holds ``nrows``."""
    return tl.maximum(b * k - row0, 0), tl.minimum((b + 1) * k - row0, nrows)


def _span_tile(p_ptr, m_ptr, idx_ptr, cb_ptr, tab_ptr, offs, mask, M, Md, pos, sg, scan_steps, lr, decay, lut_h,
               lut_nbm1, ubound, APPLY: tl.constexpr, HAS_WD: tl.constexpr, LUT_FAST: tl.constexpr,
               IS_BF16: tl.constexpr, R: tl.constexpr, SP: tl.constexpr):
    """The span update of one tile (both span update kernels): ``idx <- nearest(m / M)`` (0 where ``M`` is
    not > 0; ``APPLY``: the given ``idx``), then ``p <- p decay - clamp(C[idx] M sg, +-bound) lr``, the
    reference's float32 operations in its order (``M``, ``Md``, ``pos``: per block or per row; ``sg``:
    the step size of each element)."""
    if APPLY:
        j = tl.load(idx_ptr + offs, mask=mask, other=0).to(tl.int32)
        cq = tl.load(cb_ptr + j)
    else:
        m = tl.load(m_ptr + offs, mask=mask, other=0.0)
        z = tl.where(pos, tl.div_rn(m, Md), 0.0)
        j, cq = _nearest_jit(z, cb_ptr, tab_ptr, lut_h, lut_nbm1, scan_steps, 2, LUT_FAST, R, SP)
        tl.store(idx_ptr + offs, j.to(tl.uint8), mask=mask)
    u = (cq * M) * sg
    u = tl.where(u > ubound, ubound, tl.where(u < -ubound, -ubound, u))  # NaN stays NaN
    _update_param_jit(p_ptr, offs, mask, u * lr, decay, HAS_WD, IS_BF16)


def _span_stats_kernel(g_ptr, idx_ptr, scale_ptr, cb_ptr, m_ptr, part_ptr, blk_ptr, amax_ptr,
                       nrows, S, k, row0, b_first, lead, count, lerp_c,
                       LERP_SMALL: tl.constexpr, FUSED_LERP: tl.constexpr, IS_BF16: tl.constexpr,
                       R: tl.constexpr, SP: tl.constexpr):
    """The first phase of a tensor kept per block of rows (D16, :func:`gefen_dist.core.span.span_statistics`)
    on a piece (``count`` elements from position ``lead`` of the ``nrows`` rows it touches, which start
    at global row ``row0``; the tensors hold the piece's elements): program ``i`` takes block
    ``b_first + i`` in tiles of ``R`` rows x ``SP``
    (a power of two >= ``S``) columns: ``m = lerp(C[idx] M_b, g, 1 - beta1)`` (stored), the block's
    float64 column sums of the float32 squares (row ``i`` of ``part``), their sum (``blk[b]``) and
    the NaN-propagating maximum of ``|m|`` (``amax[b]``)."""
    i = tl.program_id(0)
    b = b_first + i
    lo, hi = _span_rows_jit(b, k, row0, nrows)
    M = tl.load(scale_ptr + b)
    cols = tl.arange(0, SP)
    cmask = cols < S
    acc = tl.zeros([R, SP], dtype=tl.float64)
    amax = tl.zeros([R, SP], dtype=tl.float32)
    for r0 in range(lo, hi, R):
        rows = r0 + tl.arange(0, R)
        offs = rows.to(tl.int64)[:, None] * S + cols[None, :] - lead
        mask = (rows < hi)[:, None] & cmask[None, :] & (offs >= 0) & (offs < count)
        g = _load_f32_jit(g_ptr, offs, mask, IS_BF16)
        m = _ema_m_jit(g, idx_ptr, offs, mask, cb_ptr, M, lerp_c, LERP_SMALL, FUSED_LERP)
        tl.store(m_ptr + offs, m, mask=mask)
        acc += (g * g).to(tl.float64)  # masked lanes load g = 0
        am = tl.where(mask, tl.abs(m), 0.0)
        amax = tl.where((am > amax) | (am != am), am, amax)
    colp = tl.sum(acc, axis=0)
    tl.store(part_ptr + i.to(tl.int64) * S + cols, colp, mask=cmask)
    tl.store(blk_ptr + b, tl.sum(colp, axis=0))
    bad = amax != amax
    A = tl.max(tl.max(tl.where(bad, 0.0, amax), axis=1), axis=0)
    nan_sum = tl.sum(tl.sum(tl.where(bad, amax, 0.0), axis=1), axis=0)  # NaN where any m is NaN
    tl.store(amax_ptr + b, tl.where(nan_sum != nan_sum, nan_sum, A))


def _span_update_kernel(p_ptr, m_ptr, idx_ptr, scale_ptr, rms_ptr, cf_ptr, cb_ptr, tab_ptr,
                        nrows, S, k, row0, b_first, lead, count, scan_steps,
                        sqrt_bc2, eps, inv_bc1, lr, decay, lut_h, lut_nbm1, ubound,
                        APPLY: tl.constexpr, HAS_WD: tl.constexpr, LUT_FAST: tl.constexpr,
                        IS_BF16: tl.constexpr, R: tl.constexpr, SP: tl.constexpr):
    """The second phase's per-element part (:func:`gefen_dist.core.span.span_update_`, once the block
    state is updated: ``scale`` the new ``M_b``, ``rms`` ``sqrt(v_blk)``, ``cf`` the column factors):
    ``idx <- nearest(m / M_b)`` (0 where ``M_b`` is not > 0), then ``p <- p decay - clamp(C[idx] M_b
    sigma, +-bound) lr`` with ``sigma = (1 / ((rms_b cf_j) / sqrt(bc2) + eps)) (1 / bc1)``, the
    reference's float32 operations in its order. ``APPLY``: the update alone from the given ``idx``
    (:func:`~gefen_dist.core.span.span_apply_indices_`). Program ``i``: block ``b_first + i`` of the
    piece (as :func:`_span_stats_kernel`'s)."""
    i = tl.program_id(0)
    b = b_first + i
    lo, hi = _span_rows_jit(b, k, row0, nrows)
    M = tl.load(scale_ptr + b)
    pos = M > 0.0
    Md = tl.where(pos, M, 1.0)
    cols = tl.arange(0, SP)
    cmask = cols < S
    # the step size of each column of this block (the same for all its rows)
    x = tl.div_rn(tl.load(rms_ptr + b) * tl.load(cf_ptr + cols, mask=cmask, other=0.0), sqrt_bc2)
    sg = (tl.div_rn(1.0, x + eps) * inv_bc1)[None, :]
    for r0 in range(lo, hi, R):
        rows = r0 + tl.arange(0, R)
        offs = rows.to(tl.int64)[:, None] * S + cols[None, :] - lead
        mask = (rows < hi)[:, None] & cmask[None, :] & (offs >= 0) & (offs < count)
        _span_tile_jit(p_ptr, m_ptr, idx_ptr, cb_ptr, tab_ptr, offs, mask, M, Md, pos, sg, scan_steps, lr, decay,
                       lut_h, lut_nbm1, ubound, APPLY, HAS_WD, LUT_FAST, IS_BF16, R, SP)


def _span_rows_stats_kernel(g_ptr, idx_ptr, scale_ptr, cb_ptr, m_ptr, part_ptr, blk_ptr, amax_ptr,
                            nrows, S, row0, lead, count, lerp_c,
                            LERP_SMALL: tl.constexpr, FUSED_LERP: tl.constexpr, IS_BF16: tl.constexpr,
                            R: tl.constexpr, SP: tl.constexpr):
    """:func:`_span_stats_kernel` for blocks of one row (D19, ``narrow_rows="rows8"``): program ``i``
    takes the piece's local rows ``i R ..`` (each its own block, at global row ``row0 + r``) in one
    tile, so a program is not one short row: per row its scale ``M_r``, ``m`` (stored), the float64
    sum of its float32 squares (``blk``) and the NaN-propagating maximum of ``|m|`` (``amax``); the
    tile's column sums (row ``i`` of ``part``)."""
    i = tl.program_id(0)
    rows = i * R + tl.arange(0, R)
    rmask = rows < nrows
    cols = tl.arange(0, SP)
    offs = rows.to(tl.int64)[:, None] * S + cols[None, :] - lead
    mask = rmask[:, None] & (cols < S)[None, :] & (offs >= 0) & (offs < count)
    M = tl.load(scale_ptr + row0 + rows, mask=rmask, other=0.0)
    g = _load_f32_jit(g_ptr, offs, mask, IS_BF16)
    m = _ema_m_jit(g, idx_ptr, offs, mask, cb_ptr, M[:, None], lerp_c, LERP_SMALL, FUSED_LERP)
    tl.store(m_ptr + offs, m, mask=mask)
    sq = (g * g).to(tl.float64)  # masked lanes load g = 0
    tl.store(part_ptr + i.to(tl.int64) * S + cols, tl.sum(sq, axis=0), mask=cols < S)
    tl.store(blk_ptr + row0 + rows, tl.sum(sq, axis=1), mask=rmask)
    am = tl.where(mask, tl.abs(m), 0.0)
    bad = am != am
    A = tl.max(tl.where(bad, 0.0, am), axis=1)
    nan_sum = tl.sum(tl.where(bad, am, 0.0), axis=1)  # NaN where any m of the row is NaN
    tl.store(amax_ptr + row0 + rows, tl.where(nan_sum != nan_sum, nan_sum, A), mask=rmask)


def _span_rows_update_kernel(p_ptr, m_ptr, idx_ptr, scale_ptr, rms_ptr, cf_ptr, cb_ptr, tab_ptr,
                             nrows, S, row0, lead, count, scan_steps,
                             sqrt_bc2, eps, inv_bc1, lr, decay, lut_h, lut_nbm1, ubound,
                             APPLY: tl.constexpr, HAS_WD: tl.constexpr, LUT_FAST: tl.constexpr,
                             IS_BF16: tl.constexpr, R: tl.constexpr, SP: tl.constexpr):
    """:func:`_span_update_kernel` for blocks of one row (D19): program ``i`` takes the piece's local
    rows ``i R ..``, each with its own ``M_r`` and ``rms_r``; the same float32 operations in the same
    order, per row."""
    i = tl.program_id(0)
    rows = i * R + tl.arange(0, R)
    rmask = rows < nrows
    cols = tl.arange(0, SP)
    cmask = cols < S
    offs = rows.to(tl.int64)[:, None] * S + cols[None, :] - lead
    mask = rmask[:, None] & cmask[None, :] & (offs >= 0) & (offs < count)
    M = tl.load(scale_ptr + row0 + rows, mask=rmask, other=0.0)[:, None]
    pos = M > 0.0
    Md = tl.where(pos, M, 1.0)
    rb = tl.load(rms_ptr + row0 + rows, mask=rmask, other=0.0)[:, None]
    x = tl.div_rn(rb * tl.load(cf_ptr + cols, mask=cmask, other=0.0)[None, :], sqrt_bc2)
    sg = tl.div_rn(1.0, x + eps) * inv_bc1
    _span_tile_jit(p_ptr, m_ptr, idx_ptr, cb_ptr, tab_ptr, offs, mask, M, Md, pos, sg, scan_steps, lr, decay,
                   lut_h, lut_nbm1, ubound, APPLY, HAS_WD, LUT_FAST, IS_BF16, R, SP)


def _apply_multi_kernel(meta_ptr, prog_ptr, hp_ptr, cf_ptr, cb_ptr, base, MODE: tl.constexpr,
                        IS_BF16: tl.constexpr, ROWS: tl.constexpr, BLOCK_SIZE: tl.constexpr):
    """ZeroGefen's appliers in one launch (:class:`~gefen_dist.kernels.triton_state.ApplyMany`): program
    ``pid`` applies rows ``prog[pid, 1] ..`` of range ``prog[pid, 0]``, the parameter update of
    :func:`_step_rows`'s last sweep from an owner's compressed results, which sit in the exchanged
    buffer at address ``base`` (byte offsets in ``meta``): the new indices, the scales ``M`` and, per
    row (``MODE`` 2, factored) ``sqrt(v_row)`` or, per block (``MODE`` 0) ``sigma``. The column factors'
    address and the scalars (1 / sqrt(bc2), eps, 1 / bc1, lr, 1 - lr wd, bound) are those of the
    range's tensor ``h`` (``cf_ptr[h]``, ``hp_ptr[6 h ..]``), rewritten each step. The same float32
    operations in the same order as the step kernel's, so each range gets that kernel's bits."""
    pid = tl.program_id(0)
    t = tl.load(prog_ptr + 2 * pid)
    r_first = tl.load(prog_ptr + 2 * pid + 1).to(tl.int32)
    mb = meta_ptr + t * _AMETA
    if IS_BF16:
        p_ptr = tl.load(mb + 0).to(tl.pointer_type(tl.int16))
    else:
        p_ptr = tl.load(mb + 0).to(tl.pointer_type(tl.float32))
    idx_ptr = (base + tl.load(mb + 1)).to(tl.pointer_type(tl.uint8))
    m_ptr = (base + tl.load(mb + 2)).to(tl.pointer_type(tl.float32))
    s_ptr = (base + tl.load(mb + 3)).to(tl.pointer_type(tl.float32))
    nrows = tl.load(mb + 4).to(tl.int32)
    S = tl.load(mb + 5).to(tl.int32)
    B = tl.load(mb + 6).to(tl.int32)
    row0 = tl.load(mb + 7).to(tl.int32)
    row_block = tl.load(mb + 8).to(tl.int32)
    h = tl.load(mb + 9)
    hb = hp_ptr + 6 * h
    isb = tl.load(hb)
    eps = tl.load(hb + 1)
    inv_bc1 = tl.load(hb + 2)
    lr = tl.load(hb + 3)
    decay = tl.load(hb + 4)
    ubound = tl.load(hb + 5)
    rows = r_first + tl.arange(0, ROWS)
    rmask = rows < nrows
    rbase = rows.to(tl.int64) * S
    cols0 = tl.arange(0, BLOCK_SIZE)
    NBLK = S // B
    if MODE == 2:
        vc_ptr = tl.load(cf_ptr + h).to(tl.pointer_type(tl.float32))
        xr = (tl.load(s_ptr + rows, mask=rmask, other=0.0) * isb)[:, None]  # sqrt(v_row) / sqrt(bc2)
        cfbase = ((rows + row0) // row_block).to(tl.int64) * S
    for kb in range(0, NBLK):
        srow = rows.to(tl.int64) * NBLK + kb
        Ab = tl.load(m_ptr + srow, mask=rmask, other=0.0)[:, None]
        if MODE == 0:
            sigma_row = tl.load(s_ptr + srow, mask=rmask, other=0.0)[:, None]
        for c0 in range(0, B, BLOCK_SIZE):
            cols = c0 + cols0
            mask = rmask[:, None] & (cols < B)[None, :]
            offs = (rbase + kb * B)[:, None] + cols[None, :]
            ix = tl.load(idx_ptr + offs, mask=mask, other=0).to(tl.int32)
            cq = tl.load(cb_ptr + ix)
            if MODE == 2:
                cf = tl.load(vc_ptr + cfbase[:, None] + (kb * B + cols)[None, :], mask=mask, other=0.0)
                sg = tl.div_rn(inv_bc1, xr * cf + eps)
            else:
                sg = sigma_row
            u = (cq * Ab) * sg
            u = tl.where(u > ubound, ubound, tl.where(u < -ubound, -ubound, u))  # NaN stays NaN
            u = u * lr
            _update_param_jit(p_ptr, offs, mask, u, decay, True, IS_BF16)


_META = tl.constexpr(11) if _HAVE_TRITON else 11  # int64 fields per tensor in MultiStep's table
_AMETA = tl.constexpr(10) if _HAVE_TRITON else 10  # int64 fields per range in ApplyMany's table
_kernels: Dict[Tuple[bool, str], object] = {}
_kernels_lock = threading.Lock()
# the helpers the kernels call, by these module-level names (jit-wrapped on first use)
_HELPERS = {"_step_rows_jit": _step_rows, "_load_f32_jit": _load_f32, "_ema_m_jit": _ema_m,
            "_nearest_jit": _nearest, "_update_param_jit": _update_param, "_span_rows_jit": _span_rows,
            "_span_tile_jit": _span_tile, "_table_ptrs_jit": _table_ptrs, "_device_scalars_jit": _device_scalars}
_step_rows_jit = _load_f32_jit = _ema_m_jit = _nearest_jit = _update_param_jit = _span_rows_jit = _span_tile_jit = None
_table_ptrs_jit = _device_scalars_jit = None


def _kernel(name: str = "step"):
    """The jit-wrapped kernel ``name`` (step, multi, colsum, reduce, colfactor, span_stats, span_update, apply)
    for the current mode
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
                  "reduce": _colsum_reduce_kernel, "colfactor": _colfactor_kernel,
                  "span_stats": _span_stats_kernel, "span_update": _span_update_kernel,
                  "span_rows_stats": _span_rows_stats_kernel, "span_rows_update": _span_rows_update_kernel,
                  "apply": _apply_multi_kernel}[name]
            k = _kernels[(interp, name)] = triton.jit(fn)
    return k
