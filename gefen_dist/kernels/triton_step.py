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
torch's reduction, so ``v`` can differ in the last bit and ``sigma`` by about one float32 ulp:
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

__all__ = ["available", "quantized_step_"]

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

def _gefen_step_kernel(
    p_ptr, g_ptr, idx_ptr, scale_ptr, v_ptr, cb_ptr, lut_ptr,
    nrows, B, B_f, scan_steps,
    lerp_c, beta2, alpha2, sqrt_bc2, eps, inv_bc1, lr, decay, lut_h, lut_nbm1,
    PER_ELEM: tl.constexpr, LERP_SMALL: tl.constexpr, FUSED_LERP: tl.constexpr,
    FUSED_AXPY: tl.constexpr, HAS_WD: tl.constexpr, LUT_FAST: tl.constexpr,
    IS_BF16: tl.constexpr, ROWS: tl.constexpr, BLOCK_SIZE: tl.constexpr,
):
    pid = tl.program_id(0)
    rows = pid * ROWS + tl.arange(0, ROWS)
    rmask = rows < nrows
    rbase = rows.to(tl.int64) * B
    cols0 = tl.arange(0, BLOCK_SIZE)
    M = tl.load(scale_ptr + rows, mask=rmask, other=0.0)
    Mb = M[:, None]

    # ---- sweep 1: absmax of m (NaN-propagating), sum of g^2 -------------------------
    ss = tl.zeros([ROWS, BLOCK_SIZE], dtype=tl.float32)
    amax = tl.zeros([ROWS, BLOCK_SIZE], dtype=tl.float32)
    for c0 in range(0, B, BLOCK_SIZE):
        cols = c0 + cols0
        mask = rmask[:, None] & (cols < B)[None, :]
        offs = rbase[:, None] + cols[None, :]
        if IS_BF16:
            g = (tl.load(g_ptr + offs, mask=mask, other=0).to(tl.uint16, bitcast=True).to(tl.uint32) << 16).to(
                tl.float32, bitcast=True)
        else:
            g = tl.load(g_ptr + offs, mask=mask, other=0.0)
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
        if not PER_ELEM:
            ss += g * g
        am = tl.where(mask, tl.abs(m), 0.0)
        amax = tl.where((am > amax) | (am != am), am, amax)
    bad = amax != amax
    A = tl.max(tl.where(bad, 0.0, amax), axis=1)
    nan_sum = tl.sum(tl.where(bad, amax, 0.0), axis=1)  # NaN where any m is NaN, else 0
    A = tl.where(nan_sum != nan_sum, nan_sum, A)
    tl.store(scale_ptr + rows, A, mask=rmask)
    pos = A > 0.0
    Ad = tl.where(pos, A, 1.0)[:, None]
    posb = pos[:, None]
    Ab = A[:, None]

    if not PER_ELEM:
        r = tl.div_rn(tl.sum(ss, axis=1), B_f)
        vt = tl.load(v_ptr + rows, mask=rmask, other=0.0) * beta2
        if FUSED_AXPY:
            vb = tl.fma(r, alpha2, vt)
        else:
            vb = vt + r * alpha2
        tl.store(v_ptr + rows, vb, mask=rmask)
        sb = tl.div_rn(tl.sqrt_rn(vb), sqrt_bc2) + eps
        sigma_row = (tl.div_rn(1.0, sb) * inv_bc1)[:, None]

    # ---- sweep 2: quantize, update v (P == 1) and the parameter -----------------------
    for c0 in range(0, B, BLOCK_SIZE):
        cols = c0 + cols0
        mask = rmask[:, None] & (cols < B)[None, :]
        offs = rbase[:, None] + cols[None, :]
        if IS_BF16:
            g = (tl.load(g_ptr + offs, mask=mask, other=0).to(tl.uint16, bitcast=True).to(tl.uint32) << 16).to(
                tl.float32, bitcast=True)
        else:
            g = tl.load(g_ptr + offs, mask=mask, other=0.0)
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

        if PER_ELEM:
            vt = tl.load(v_ptr + offs, mask=mask, other=0.0) * beta2
            r2 = g * g
            if FUSED_AXPY:
                ve = tl.fma(r2, alpha2, vt)
            else:
                ve = vt + r2 * alpha2
            tl.store(v_ptr + offs, ve, mask=mask)
            se = tl.div_rn(tl.sqrt_rn(ve), sqrt_bc2) + eps
            sg = tl.div_rn(1.0, se) * inv_bc1
        else:
            sg = sigma_row
        u = (cq * Ab) * sg
        u = u * lr
        if IS_BF16:
            pf = (tl.load(p_ptr + offs, mask=mask, other=0).to(tl.uint16, bitcast=True).to(tl.uint32) << 16).to(
                tl.float32, bitcast=True)
        else:
            pf = tl.load(p_ptr + offs, mask=mask, other=0.0)
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


_kernels: Dict[bool, object] = {}
_kernels_lock = threading.Lock()


def _kernel():
    interp = _interpret()
    with _kernels_lock:
        k = _kernels.get(interp)
        if k is None:
            k = triton.jit(_gefen_step_kernel)
            _kernels[interp] = k
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
) -> None:
    """One Gefen update of a quantized piece, in place (Triton kernel; same contract as
    :func:`gefen_dist.core.step.quantized_step_eager_`). CUDA tensors, or CPU tensors with
    ``TRITON_INTERPRET=1``."""
    _launch(param, grad, idx, scale, v, codebook, lr=lr, beta1=beta1, beta2=beta2, eps=eps,
            weight_decay=weight_decay, bc1=bc1, bc2=bc2, period=period, scale_block=scale_block)


def _launch(param, grad, idx, scale, v, codebook, *, lr, beta1, beta2, eps, weight_decay, bc1,
            bc2, period, scale_block, block_size: Optional[int] = None) -> None:
    n = param.numel()
    if n == 0:
        return
    if not _HAVE_TRITON:
        raise RuntimeError("triton is not importable")
    device = param.device
    if device.type != "cuda" and not _interpret():
        raise ValueError(f"the Triton step needs CUDA tensors (or TRITON_INTERPRET=1), got {device}")
    P, B = int(period), int(scale_block)
    if P < 1 or B < 1 or not (P == 1 or P == B):
        raise ValueError(f"need period == scale_block or period == 1 (got P={P}, B={B})")
    if n % B or n % P:
        raise ValueError(f"numel {n} is not a multiple of the blocks (P={P}, B={B})")
    if param.dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"param dtype {param.dtype} not supported (float32, bfloat16)")
    _check("param", param, device, None, n)
    _check("grad", grad, device, param.dtype, n)
    _check("idx", idx, device, torch.uint8, n)
    _check("scale", scale, device, torch.float32, n // B)
    _check("v", v, device, torch.float32, n // P)
    tab = _device_table(codebook, device)

    w = 1.0 - beta1
    small = abs(w) < 0.5
    wf = np.float32(w)
    fused_lerp, fused_axpy = _fma_flags(device, small)
    nrows = n // B
    rows, bs, warps = _config(B, nrows, block_size)
    grid = (triton.cdiv(nrows, rows),)
    kern = _kernel()
    bf16 = param.dtype == torch.bfloat16
    # bfloat16 travels as int16 bits (converted by hand in the kernel)
    pk, gk = (param.view(torch.int16), grad.view(torch.int16)) if bf16 else (param, grad)
    ctx = torch.cuda.device(device) if device.type == "cuda" else _nullcontext()
    # scalars as torch converts them (Python double -> float32 opmath)
    with ctx:
        kern[grid](
            pk, gk, idx, scale, v, tab.cb, tab.lut,
            nrows, B, float(B), tab.scan_steps,
            float(wf) if small else float(wf - np.float32(1.0)),
            float(np.float32(beta2)), float(np.float32(1.0 - beta2)),
            float(np.float32(np.sqrt(bc2))), float(np.float32(eps)), float(np.float32(1.0 / bc1)),
            float(np.float32(lr)), float(np.float32(1.0 - lr * weight_decay)),
            tab.h, float(tab.nb - 1),
            PER_ELEM=(P == 1), LERP_SMALL=small, FUSED_LERP=fused_lerp, FUSED_AXPY=fused_axpy,
            HAS_WD=(weight_decay != 0.0), LUT_FAST=tab.fast, IS_BF16=bf16, ROWS=rows, BLOCK_SIZE=bs,
            num_warps=warps, enable_fp_fusion=False,
        )
    for t in (param, idx, scale, v):
        torch.autograd.graph.increment_version(t)
