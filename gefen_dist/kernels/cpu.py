"""Fused CPU step for quantized tensors (ctypes wrapper of ``csrc/gefen_step.c``).

``quantized_step_`` has the signature and the math of
:func:`gefen_dist.core.step.quantized_step_eager_`, and ``quantized_step_factored_`` those of
:func:`gefen_dist.core.step.quantized_step_factored_eager_` (``second_moment="factored"``: the
``slab``-long ``v_col`` update and the column factors ``sqrt(v_col / mean(v_col))`` are the
eager path's torch operations; each row, its ``v_row`` and its scale blocks run in the kernel,
rows distributed over threads). Both run in one pass per scale block,
multi-threaded with OpenMP over blocks (``torch.get_num_threads()`` threads; each block is
handled by exactly one thread, so the result does not depend on the thread count). Extra
memory: one block of float32 per thread (at most 16 MiB in all; longer blocks recompute
``m`` in the second sweep instead) plus the nearest-codeword table (at most 1 MiB, cached
per codebook).

Agreement with the eager path
-----------------------------
The kernel replays torch's float32 CPU arithmetic operation by operation. Three details of
torch's kernels are probed once per process (see :func:`numerics`) and replayed:

* ``lerp`` with a scalar weight and ``add_(x, alpha=a)`` are fused multiply-adds in torch's
  vectorised kernels on FMA hardware (``fma(w, g - m, m)`` and ``fma(r, 1-beta2, beta2*v)``);
  the kernel uses ``fmaf`` exactly where torch does.
* ``(g*g).mean(dim=1)`` is ``sum / P`` where the sum follows torch's cascade order
  (``aten/src/ATen/native/cpu/SumKernel.cpp``: 4 interleaved vector accumulators of the
  CPU's vector width, 4 cascade levels, then a scalar tail and the lanes in order). The
  kernel replays that order for the probed width; if no width reproduces torch on the probe
  it accumulates the exact squares in double and rounds once (``(float)sum / P``), which
  differs from torch in the last bit for roughly a third of the blocks.
* With that, ``idx``, ``scale`` and ``v`` are bitwise identical to the eager path (``m`` and
  its quantisation never depend on ``v``), except where torch itself changes order: a
  v-block of more than 2^21 elements (the eager path then reduces a single row per chunk,
  which torch splits across threads in a two-pass reduction). With AVX-512 the cascade is
  replayed with one vector register per item (same additions, same order).

Deliberate relaxations (cheaper than torch's operation sequence, all below the tolerance
stated next; ``idx`` and ``scale`` stay bitwise equal to the eager path):

* ``z = m / A`` is computed from ``y = 1/A`` as ``q = m*y; z = fma(m - A*q (fma), y, q)``
  (one Markstein correction step), which is the correctly rounded quotient whenever ``A`` is
  in ``[2^-125, 2^125]`` (otherwise the kernel divides) and ``z`` is not subnormal, so the
  nearest codeword is unchanged (a subnormal ``z`` could round differently only if a
  decision boundary lay among the subnormals).
* The parameter update ``u = ((C[idx] * A) * sigma) * lr`` is computed as
  ``C[idx] * ((A * sigma) * lr)`` (the product of the block's scalars first; for per-element
  sigma ``C[idx] * (sigma * (A * lr))``): up to ~2 float32 ulps of ``u``, far below one ulp of
  the parameter.
* Per-element sigma (``period == 1`` and the factored mode) is ``(1/bc1) / (x * s + eps)`` with
  ``s = 1/sqrt(bc2)`` (``x = sqrt(v)``) or ``s = sqrt(v_row)/sqrt(bc2)`` per row
  (``x = col_f``), one division instead of torch's division, reciprocal and product: within
  ~3 ulps of torch's sigma, the same order as the ``sqrt`` difference below.

Not replayed: ``sqrt``. torch's ``Tensor.sqrt`` may use MKL's ``vsSqrt`` (observed up to
0.75 ulp on AVX-512 machines), the kernel uses the correctly rounded ``sqrtf``. So sigma can
differ by about one float32 ulp (6e-8 relative) per block, which changes the parameter
update by the same relative amount, and the float32 parameter then rounds differently in a
fraction of the elements: after 100 float32 steps parameters differ by one or two ulps of
their largest values, ~1e-7 of ``max|p|`` (tests: rtol 1e-6, atol 1e-6 * max|p|; a
purely elementwise relative bound is meaningless for elements that pass near zero). For bfloat16 parameters the update is computed in float32 and
rounded once to bfloat16 (round to nearest even, like ``Tensor.copy_``); a one-ulp sigma
difference flips that rounding only when the float32 result lies within ~1e-7 relative of a
bfloat16 rounding boundary, so a small fraction of elements differ by one bfloat16 ulp
(2^-8 relative) per step; the tests bound the mismatch fraction and the size. NaN
parameters are written as 0x7FC0 (torch's vectorised copy writes 0xFFFF; both are NaN).

Vectorisation
-------------
The portable C loops are written for the auto-vectoriser (``#pragma omp simd``). The library is
built with ``-march=native``, and two intrinsics paths replace them where the CPU allows:

* AVX-512 VBMI (Intel Ice Lake and later, AMD Zen 4 and later): the 256-entry codebook lookups
  (``C[idx]`` when dequantising, the two candidate codewords when quantising) are done in
  registers with byte permutes of the codebook's four byte planes rather than with gathers
  (GCC emulates byte-indexed gathers with scalar loads, which made the dequantisation the most
  expensive part of the step);
* AVX2 + FMA (every other x86-64 CPU of the last decade: AMD Zen 2/3, Intel Haswell to Cascade
  Lake): 8 lanes; ``C[idx]`` by scalar loads, and the nearest codeword from one 16-byte entry per
  table bucket holding its two candidate codewords, the lower index and the pair's exact flip
  point (the smallest ``z`` the two-candidate rule sends to the upper codeword, found by
  bisection over the floats, once per codebook: :func:`gefen_dist.core.quant.bucket_entries`), so a
  quantisation is one comparison; the second
  sweep runs in short passes over the buffered block so the out-of-order core overlaps many
  iterations, and the factored row sum of ``g^2`` is taken from the first sweep's loads.

All paths execute the same float operations in the same order and are tested to be bitwise
equal (the step functions' ``simd=`` argument chooses between them). On an AVX-512 CPU the AVX2 path
is compiled into a second build of the file, which steps instead where it measures faster
(:mod:`gefen_dist.kernels.cpu_build`).

Nearest codeword
----------------
``z = m / A`` is mapped to ``k = (int) clamp(z * H + H, 0, NB - 1)`` (``H = NB / 2`` a power
of two, so ``z * H`` is exact and ``k`` is monotone in ``z``). The table is built from the
reference :func:`gefen_dist.core.quant.nearest_codeword` at the exact float boundaries of
every bucket: when each bucket's nearest codeword is one of two consecutive indices (``NB``
is doubled from 4096 up to 2^18 until it is), the kernel compares ``z`` with those two
codewords using the reference's tie rule; otherwise the table holds a lower bound of
``#{C < z}`` and a short forward scan finishes the search. Both give results identical to
``searchsorted`` + the tie rule for every float32 ``z`` (NaN -> 255).

On the AVX-512 path the table's lower candidate is found without gathers when the table has
4096 buckets whose entries rise by at most one from bucket to bucket within each group of 16
(checked when the call starts; realistic codebooks qualify): per group, a base index and a
16-bit mask of the buckets where the entry rises, kept as three 256-byte tables; 64 elements
at a time the kernel packs group and position into bytes, looks the three up with byte
permutes, and adds the popcount of the mask bits up to the position (a 16-bit popcount,
AVX-512 BITALG). Otherwise it gathers from a byte copy of the table. Measured side by side
with ``python research/lut_ab.py`` (then on whole steps): the gather from the original int32
table cost about a fifth of the whole step on this CPU.
"""
from __future__ import annotations

import ctypes
import functools
import logging
import math
import os
import threading
from dataclasses import dataclass
from typing import Optional, Tuple

import numpy as np
import torch

from gefen_dist.core.quant import NUM_CODEWORDS
from gefen_dist.core.step import check_col_blocks, check_tensor, column_factors, per_column_block
from gefen_dist.kernels import cpu_build, native
from gefen_dist.kernels.cpu_tables import CodebookTable, codebook_table  # the kernel's table (re-exported)
from gefen_dist.kernels.state_only import factored_state_only_, state_only_

logger = logging.getLogger(__name__)

__all__ = ["available", "simd_compiled", "simd_isa", "quantized_step_", "quantized_step_factored_", "apply_compressed_",
           "apply_factored_", "numerics", "nearest_lut", "nearest_sweep", "CodebookTable", "codebook_table"]

_ABI = 18
_LIB_NAME = cpu_build.NATIVE  # the -march=native build (cpu_build.py: which build a process uses)
_SOURCES = ["gefen_step.c"]
_BUF_BYTES_TOTAL = 16 << 20  # per-thread block buffers, all threads together
_BUF_MAX_ELEMS = 1 << 20     # per thread
# ``simd=`` of the step functions (the intrinsics path compiled in, :func:`simd_isa`): 1 (default) the
# fastest form of the nearest-codeword table (AVX-512 VBMI: a two-level form in registers when the
# table allows it, else gathers from a byte copy; AVX2: per-bucket entries with the flip point),
# 2 gathers from the int32 table, 3 from its byte copy, 0 the portable loops. All are bitwise equal
# (tests compare them); research/lut_ab.py times them.
SIMD_MODES = (0, 1, 2, 3)


class _Args(ctypes.Structure):
    _fields_ = [
        ("n", ctypes.c_int64),
        ("period", ctypes.c_int64),
        ("block", ctypes.c_int64),
        ("buf_max", ctypes.c_int64),
        ("dtype", ctypes.c_int32),
        ("nthreads", ctypes.c_int32),
        ("sum_lanes", ctypes.c_int32),
        ("fused_lerp", ctypes.c_int32),
        ("fused_axpy", ctypes.c_int32),
        ("lerp_small", ctypes.c_int32),
        ("has_wd", ctypes.c_int32),
        ("lut_mode", ctypes.c_int32),
        ("lut_n", ctypes.c_int32),
        ("simd", ctypes.c_int32),
        ("lerp_c", ctypes.c_float),
        ("beta2", ctypes.c_float),
        ("alpha2", ctypes.c_float),
        ("sqrt_bc2", ctypes.c_float),
        ("eps", ctypes.c_float),
        ("inv_bc1", ctypes.c_float),
        ("lr", ctypes.c_float),
        ("decay", ctypes.c_float),
        ("lut_h", ctypes.c_float),
        ("ulim", ctypes.c_float),
        ("ent", ctypes.c_void_p),
    ]


class _NibbleArgs(ctypes.Structure):
    """gefen_nibble_args (csrc/gefen_step.c): the one-byte layout's arguments beside _Args (D20)."""
    _fields_ = [
        ("ratio_old", ctypes.c_void_p),
        ("ratio_new", ctypes.c_void_p),
        ("cb", ctypes.c_void_p),
        ("row0", ctypes.c_int64),
        ("rb", ctypes.c_int64),
        ("bound", ctypes.c_float),
        ("key", ctypes.c_uint32),
        ("decoded", ctypes.c_int32),
    ]


_lock = threading.Lock()
_configured: set = set()


def _lib(build: Optional[str] = None) -> Optional[ctypes.CDLL]:
    """The native library, configured (None without it, or with ``GEFEN_DIST_NO_NATIVE=1``, which is
    read at every call so that it switches the kernels off at any time): the build
    :func:`gefen_dist.kernels.cpu_build.build_name` chose for this process, or ``build`` (a name of
    :mod:`~gefen_dist.kernels.cpu_build`; :data:`_LIB_NAME` is the ``-march=native`` one)."""
    if os.environ.get("GEFEN_DIST_NO_NATIVE", "0") not in ("", "0"):
        return None
    return _load(build or cpu_build.build_name())


def _load(name: str) -> Optional[ctypes.CDLL]:
    """The build ``name`` (:data:`cpu_build.NATIVE` or :data:`cpu_build.AVX2`), loaded and configured."""
    # the fast path: the cached library once configured (one swapped into the cache, as research's
    # timing builds do, is configured below)
    lib = native._cache.get(name)
    if lib is not None and id(lib) in _configured:
        return lib
    lib = native.load_library(name, _SOURCES, cpu_build.AVX2_FLAGS if name == cpu_build.AVX2 else ())
    if lib is None:
        return None
    with _lock:
        if id(lib) not in _configured:
            lib.gefen_step_abi.restype = ctypes.c_int
            lib.gefen_step_simd.restype = ctypes.c_int
            lib.gefen_step_args_size.restype = ctypes.c_int
            if lib.gefen_step_abi() != _ABI or lib.gefen_step_args_size() != ctypes.sizeof(_Args):
                logger.warning("gefen_dist: %s has an unexpected ABI; using the eager path", name)
                return None
            vp, i64, i32, f32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int32, ctypes.c_float
            lib.gefen_quantized_step.restype = ctypes.c_int
            lib.gefen_quantized_step.argtypes = [ctypes.POINTER(_Args)] + [vp] * 7
            lib.gefen_quantized_step_factored.restype = ctypes.c_int
            lib.gefen_quantized_step_factored.argtypes = [ctypes.POINTER(_Args)] + [vp] * 8 + [i64, i64]
            lib.gefen_quantized_step_factored_k.restype = ctypes.c_int
            lib.gefen_quantized_step_factored_k.argtypes = [ctypes.POINTER(_Args)] + [vp] * 8 + [i64, i64, i64]
            lib.gefen_apply_compressed.restype = ctypes.c_int
            lib.gefen_apply_compressed.argtypes = [ctypes.POINTER(_Args)] + [vp] * 5
            lib.gefen_apply_factored.restype = ctypes.c_int
            lib.gefen_apply_factored.argtypes = [ctypes.POINTER(_Args)] + [vp] * 6 + [i64, i64]
            lib.gefen_apply_factored_k.restype = ctypes.c_int
            lib.gefen_apply_factored_k.argtypes = [ctypes.POINTER(_Args)] + [vp] * 6 + [i64, i64, i64]
            lib.gefen_nearest.restype = None
            lib.gefen_nearest.argtypes = [vp, i64, vp, vp, i32, f32, i32, vp]
            lib.gefen_nearest_sweep.restype = i64
            lib.gefen_nearest_sweep.argtypes = [ctypes.c_uint32, ctypes.c_uint32, vp, vp, i32, f32,
                                                i32, i32, vp]
            lib.gefen_probe.restype = None
            lib.gefen_probe.argtypes = [i32, i32, i64, vp, vp, f32, f32, vp]
            lib.gefen_sumsq_mean.restype = None
            lib.gefen_sumsq_mean.argtypes = [vp, i64, i64, i32, vp]
            lib.gefen_column_sumsq.restype = ctypes.c_int
            lib.gefen_column_sumsq.argtypes = [vp, i32, i64, i64, vp, i32]
            lib.gefen_span_stats.restype = None  # D16's phases (kernels/cpu_span.py)
            lib.gefen_span_stats.argtypes = [vp] * 5 + [i64] * 4 + [vp] * 5
            lib.gefen_span_update.restype = None
            lib.gefen_span_update.argtypes = [vp] * 9 + [i64] * 4 + [f32]
            lib.gefen_multi_step.restype = i64  # many tensors per call (kernels/cpu_multi.py)
            lib.gefen_multi_step.argtypes = [ctypes.POINTER(_Args), vp, i64, vp, vp]
            lib.gefen_multi_column_sumsq.restype = i64
            lib.gefen_multi_column_sumsq.argtypes = [vp, i64, i32]
            lib.gefen_multi_item_size.restype = ctypes.c_int
            lib.gefen_colsum_item_size.restype = ctypes.c_int
            lib.gefen_nibble_step.restype = ctypes.c_int  # second_moment="nibbles" (D20)
            lib.gefen_nibble_step.argtypes = [ctypes.POINTER(_Args), ctypes.POINTER(_NibbleArgs)] + [vp] * 5
            lib.gefen_nibble_args_size.restype = ctypes.c_int
            lib.gefen_multi_nibble_step.restype = i64  # many "nibbles" tensors per call (kernels/cpu_multi.py)
            lib.gefen_multi_nibble_step.argtypes = [ctypes.POINTER(_Args), ctypes.POINTER(_NibbleArgs), vp, i64]
            lib.gefen_nibble_item_size.restype = ctypes.c_int
            if lib.gefen_nibble_args_size() != ctypes.sizeof(_NibbleArgs):
                logger.warning("gefen_dist: %s has an unexpected ABI; using the eager path", name)
                return None
            lib.gefen_two_level_table.restype = ctypes.c_int
            lib.gefen_two_level_table.argtypes = [vp, i32]
            _configured.add(id(lib))
    return lib


def two_level_table(codebook: torch.Tensor) -> bool:
    """Whether the default AVX-512 path finds ``codebook``'s nearest codewords with the two-level
    table in registers (no gathers): it needs AVX-512 BITALG and a 4096-bucket two-candidate table
    whose entries rise by at most 1 per bucket; otherwise it gathers from a byte copy."""
    lib = _lib()
    if lib is None or not lib.gefen_step_simd():
        return False
    t = codebook_table(codebook)
    return t.mode == 1 and bool(lib.gefen_two_level_table(t.lut.data_ptr(), t.nb))


def available() -> bool:
    """Whether the native library is built and loaded (else callers use the eager path)."""
    return _lib() is not None


def simd_compiled() -> bool:
    """Whether the library has an intrinsics path (AVX-512 VBMI or AVX2; built for a CPU that has it)."""
    return simd_isa() is not None


def simd_isa() -> Optional[str]:
    """The intrinsics path the library was built with: ``"avx512vbmi"``, ``"avx2"``, or None (the
    portable C loops only, or no native library)."""
    lib = _lib()
    code = lib.gefen_step_simd() if lib is not None else 0
    return {1: "avx512vbmi", 2: "avx2"}.get(int(code))


# --------------------------------------------------------------------------------------
# probes of torch's float32 arithmetic
# --------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Numerics:
    fused_lerp_small: bool  # lerp, |weight| < 0.5
    fused_lerp_large: bool  # lerp, |weight| >= 0.5
    fused_axpy: bool        # add_(x, alpha=a)
    sum_lanes: int          # cascade-sum vector width replayed; 0 = double accumulation




def _probe_fused(lib, op: int, torch_out: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                 s1: float, s2: float, what: str) -> bool:
    n = a.numel()
    hits = []
    for fused in (1, 0):
        out = torch.empty(n, dtype=torch.float32)
        lib.gefen_probe(op, fused, n, a.data_ptr(), b.data_ptr(), s1, s2, out.data_ptr())
        hits.append(int((out.view(torch.int32) == torch_out.view(torch.int32)).sum()))
    if max(hits) != n:
        logger.debug("gefen_dist: torch %s matches neither fused (%d/%d) nor unfused (%d/%d)",
                     what, hits[0], n, hits[1], n)
    return hits[0] >= hits[1]


@functools.lru_cache(maxsize=None)
def numerics() -> Optional[Numerics]:
    """Probe (once, cached) how torch rounds the operations the kernel replays; None without the
    native library."""
    lib = _lib()
    if lib is None:
        return None
    gen = torch.Generator().manual_seed(1234)
    n = 4099
    a = torch.randn(n, generator=gen) * torch.exp(torch.randn(n, generator=gen) * 3)
    b = torch.randn(n, generator=gen) * torch.exp(torch.randn(n, generator=gen) * 3)
    flags = []
    for w in (0.1, 0.7):
        t = a.clone().lerp_(b, w)
        c = float(np.float32(w)) if abs(w) < 0.5 else float(np.float32(w) - np.float32(1.0))
        flags.append(_probe_fused(lib, 0, t, a, b, c, 1.0 if abs(w) < 0.5 else 0.0, f"lerp(w={w})"))
    va = a.abs()
    r = b * b
    beta2 = 0.999
    t = va.clone().mul_(beta2).add_(r, alpha=1.0 - beta2)
    fa = _probe_fused(lib, 1, t, va, r, float(np.float32(beta2)), float(np.float32(1.0 - beta2)),
                      "add_(alpha)")

    lanes = 0
    cases = []
    for P in (1, 3, 7, 16, 17, 64, 100, 255, 768, 1031, 4099, 20000):
        rows = 4
        g = torch.randn(rows, P, generator=gen) * 1e-3
        cases.append((g, (g * g).mean(dim=1)))
    for w in (16, 8, 4, 32):
        ok = True
        for g, ref in cases:
            out = torch.empty(g.shape[0], dtype=torch.float32)
            lib.gefen_sumsq_mean(g.data_ptr(), g.shape[0], g.shape[1], w, out.data_ptr())
            if not torch.equal(out.view(torch.int32), ref.view(torch.int32)):
                ok = False
                break
        if ok:
            lanes = w
            break
    if lanes == 0:
        logger.info("gefen_dist: torch's sum order not reproduced; fused kernel sums g^2 in "
                    "double (v may differ from the eager path in the last bit)")
    found = Numerics(flags[0], flags[1], fa, lanes)
    logger.debug("gefen_dist: fused step numerics %s", found)
    return found


# --------------------------------------------------------------------------------------
# the nearest codeword through the library's table lookup (the table: cpu_tables.py)
# --------------------------------------------------------------------------------------

def nearest_lut(z: torch.Tensor, codebook: torch.Tensor) -> torch.Tensor:
    """The kernel's table lookup on float32 ``z`` (uint8), for tests and diagnostics."""
    lib = _lib()
    if lib is None:
        raise RuntimeError("native gefen_step library unavailable")
    t = codebook_table(codebook)
    zf = z.detach().to(torch.float32).contiguous().reshape(-1)
    out = torch.empty(zf.numel(), dtype=torch.uint8)
    lib.gefen_nearest(zf.data_ptr(), zf.numel(), t.cb.data_ptr(), t.lut.data_ptr(), t.mode,
                      t.h, t.nb, out.data_ptr())
    return out.view(z.shape)


def _nearest_bruteforce(z: torch.Tensor, codebook: torch.Tensor) -> torch.Tensor:
    """The C brute-force reference (binary search + tie rule) used by :func:`nearest_sweep`."""
    lib = _lib()
    if lib is None:
        raise RuntimeError("native gefen_step library unavailable")
    t = codebook_table(codebook)
    zf = z.detach().to(torch.float32).contiguous().reshape(-1)
    out = torch.empty(zf.numel(), dtype=torch.uint8)
    lib.gefen_nearest(zf.data_ptr(), zf.numel(), t.cb.data_ptr(), t.lut.data_ptr(), 2, t.h,
                      t.nb, out.data_ptr())
    return out.view(z.shape)


def nearest_sweep(codebook: torch.Tensor, first: int, last: int) -> Tuple[int, int]:
    """Compare the table lookup with a brute-force searchsorted + tie rule over every
    float32 bit pattern in [first, last] (uint32). Returns (mismatches, first mismatch)."""
    lib = _lib()
    if lib is None:
        raise RuntimeError("native gefen_step library unavailable")
    t = codebook_table(codebook)
    where = ctypes.c_uint32(0)
    bad = lib.gefen_nearest_sweep(first, last, t.cb.data_ptr(), t.lut.data_ptr(), t.mode, t.h,
                                  t.nb, torch.get_num_threads(), ctypes.addressof(where))
    return int(bad), int(where.value)


# --------------------------------------------------------------------------------------
# the step
# --------------------------------------------------------------------------------------

def _check(name: str, t: torch.Tensor, dtype, numel: int) -> None:
    if t.device.type != "cpu":
        raise ValueError(f"{name} must be a CPU tensor")
    check_tensor(name, t, dtype, numel)


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
    simd: int = 1,
) -> None:
    """One Gefen update of a quantized piece, in place (fused kernel; same contract as
    :func:`gefen_dist.core.step.quantized_step_eager_`). ``simd`` picks the code path (one of
    :data:`SIMD_MODES`; all give the same bits). Falls back to the eager path when the native
    library is unavailable."""
    n = param.numel()
    if n == 0:
        return
    lib = _lib()
    if lib is None:
        from gefen_dist.core.step import quantized_step_eager_

        quantized_step_eager_(param, grad, idx, scale, v, codebook, lr=lr, beta1=beta1,
                              beta2=beta2, eps=eps, weight_decay=weight_decay, bc1=bc1,
                              bc2=bc2, period=period, scale_block=scale_block, bound=bound)
        return
    P, B = int(period), int(scale_block)
    if P < 1 or B < 1 or not (P == 1 or P == B):
        raise ValueError(f"need period == scale_block or period == 1 (got P={P}, B={B})")
    if n % B or n % P:
        raise ValueError(f"numel {n} is not a multiple of the blocks (P={P}, B={B})")
    if param.dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"param dtype {param.dtype} not supported (float32, bfloat16)")
    _check("param", param, None, n)
    _check("grad", grad, param.dtype, n)
    _check("idx", idx, torch.uint8, n)
    _check("scale", scale, torch.float32, n // B)
    _check("v", v, torch.float32, n // P)
    tab = codebook_table(codebook)
    a = _make_args(param, n, P, B, tab, lr=lr, beta1=beta1, beta2=beta2, eps=eps,
                   weight_decay=weight_decay, bc1=bc1, bc2=bc2, bound=bound, simd=simd)
    rc = lib.gefen_quantized_step(ctypes.byref(a), param.data_ptr(), grad.data_ptr(),
                                  idx.data_ptr(), scale.data_ptr(), v.data_ptr(),
                                  tab.cb.data_ptr(), tab.lut.data_ptr())
    if rc != 0:
        raise RuntimeError(f"gefen_quantized_step failed with code {rc}")
    for t in (param, idx, scale, v):
        torch.autograd.graph.increment_version(t)


def _make_args(param, n, P, B, tab, *, lr, beta1, beta2, eps, weight_decay, bc1, bc2, bound, simd) -> _Args:
    num = numerics()
    w = 1.0 - beta1
    small = abs(w) < 0.5
    wf = np.float32(w)
    a = _Args()
    # per element a block buffer holds m (float32) and, on the AVX2 path, sweep 2's bucket (int32)
    a.buf_max = min(_BUF_MAX_ELEMS, _BUF_BYTES_TOTAL // (8 * max(1, torch.get_num_threads())))
    a.sum_lanes = num.sum_lanes
    a.fused_lerp = int(num.fused_lerp_small if small else num.fused_lerp_large)
    a.fused_axpy = int(num.fused_axpy)
    a.lerp_small = int(small)
    a.lut_mode, a.lut_n, a.lut_h = tab.mode, tab.nb, tab.h
    a.ent = tab.ent.data_ptr() if tab.ent is not None else None  # kept alive by the cached table
    # scalars as torch converts them (Python double -> float32 opmath)
    a.lerp_c = float(wf) if small else float(wf - np.float32(1.0))
    a.beta2 = beta2
    a.alpha2 = 1.0 - beta2
    return _update_args(a, param, n, P, B, lr=lr, eps=eps, weight_decay=weight_decay, bc1=bc1, bc2=bc2,
                        bound=bound, simd=simd)


def _update_args(a: _Args, param, n, P, B, *, lr, eps, weight_decay, bc1, bc2, bound, simd) -> _Args:
    """The fields of ``a`` that the parameter update reads (all the apply-only entry points read)."""
    if simd not in SIMD_MODES:
        raise ValueError(f"simd must be one of {SIMD_MODES}, got {simd!r}")
    a.n, a.period, a.block = n, P, B
    a.dtype = 0 if param.dtype == torch.float32 else 1
    a.nthreads = max(1, torch.get_num_threads())
    a.has_wd = int(weight_decay != 0.0)
    a.simd = int(simd)
    a.sqrt_bc2 = math.sqrt(bc2)
    a.eps = eps
    a.inv_bc1 = 1.0 / bc1
    a.lr = lr
    a.decay = 1.0 - lr * weight_decay
    a.ulim = math.inf if bound is None else bound * lr  # the bound times lr, rounded once to float32
    return a


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
    bound: Optional[float] = None,
    simd: int = 1,
) -> None:
    """Gefen update with a factored second moment, in place (fused kernel; same contract as
    :func:`gefen_dist.core.step.quantized_step_factored_eager_`). ``v_col`` and the column
    factors ``sqrt(v_col / mean(v_col))`` are computed with the eager path's torch operations
    (``slab`` elements); rows run in the kernel, each by one thread. ``simd`` as for
    :func:`quantized_step_`. Falls back to the eager path when the native library is unavailable."""
    lib = _lib()
    if lib is None:
        from gefen_dist.core.step import quantized_step_factored_eager_

        quantized_step_factored_eager_(param, grad, idx, scale, v_row, v_col, codebook, col_mean_sq,
                                       lr=lr, beta1=beta1, beta2=beta2, eps=eps,
                                       weight_decay=weight_decay, bc1=bc1, bc2=bc2,
                                       scale_block=scale_block, row0=row0, row_block=row_block, bound=bound)
        return
    n = param.numel()
    S, B = v_col.shape[-1], int(scale_block)
    if B < 1 or S < 1 or S % B:
        raise ValueError(f"scale block {B} must divide the row length {S}")
    if n % S:
        raise ValueError(f"numel {n} is not a multiple of the row length {S}")
    if param.dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"param dtype {param.dtype} not supported (float32, bfloat16)")
    G = v_col.numel() // S if S else 1
    K = check_col_blocks(v_row, v_col, B)  # column blocks (D21)
    _check("v_col", v_col, torch.float32, G * S)
    _check("col_mean_sq", col_mean_sq, torch.float32, G * S)
    if G > 1 and (row_block < 1 or row0 < 0 or row0 + n // S > G * row_block):
        raise ValueError(f"v_col has {G} row blocks: need row_block >= 1 and rows [{row0}, {row0 + n // S}) "
                         f"inside {G} x {row_block} rows")
    if n:
        _check("param", param, None, n)
        _check("grad", grad, param.dtype, n)
        _check("idx", idx, torch.uint8, n)
        _check("scale", scale, torch.float32, n // B)
        _check("v_row", v_row, torch.float32, n // S * K)
    v_col.mul_(beta2).add_(col_mean_sq.view_as(v_col), alpha=1.0 - beta2)
    if n == 0:
        return
    col_f = per_column_block(_column_factors_cpu, K)(v_col)
    rb = int(row_block) if G > 1 else row0 + n // S + 1  # one block: every row in block 0
    tab = codebook_table(codebook)
    a = _make_args(param, n, S, B, tab, lr=lr, beta1=beta1, beta2=beta2, eps=eps,
                   weight_decay=weight_decay, bc1=bc1, bc2=bc2, bound=bound, simd=simd)
    rc = lib.gefen_quantized_step_factored_k(ctypes.byref(a), param.data_ptr(), grad.data_ptr(),
                                             idx.data_ptr(), scale.data_ptr(), v_row.data_ptr(),
                                             col_f.data_ptr(), tab.cb.data_ptr(), tab.lut.data_ptr(),
                                             int(row0), rb, K)
    if rc != 0:
        raise RuntimeError(f"gefen_quantized_step_factored failed with code {rc}")
    for t in (param, idx, scale, v_row):
        torch.autograd.graph.increment_version(t)


def _column_factors_cpu(v_col: torch.Tensor, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """:func:`gefen_dist.core.step.column_factors` of a CPU ``v_col`` (``[slab]`` or ``[G, slab]``),
    bitwise, in four operations where every row block's mean is positive (the usual case; the
    ``where`` that zeroes the factors of a profile whose mean is not positive then selects
    ``v_col / mean`` everywhere), the general function otherwise. On CPU reading the mean costs no
    device synchronisation. ``out``: written in place (``v_col``'s shape) and returned."""
    mean_c = v_col.mean(dim=-1, keepdim=True)  # per row block (D12): [G, 1]
    if float(mean_c.min()) > 0:  # (False for a NaN mean)
        return torch.div(v_col, mean_c, out=out).sqrt_()
    f = column_factors(v_col)
    return f.contiguous() if out is None else out.copy_(f)


_SCRATCH_ELEMS = 1 << 20  # parameter scratch of a state-only call (chunks of whole blocks)


def quantized_state_(grad, idx, scale, v, codebook, *, beta1, beta2, eps, bc1, bc2, period,
                     scale_block) -> torch.Tensor:
    """The kernel's state update of :func:`quantized_step_` (``v``, ``idx``, ``scale`` in place,
    bitwise the full step's) without the parameter update, for ZeRO-1's owners; returns ``sigma``
    per v-block as the kernel computes it (its float32 operations with a correctly rounded sqrt:
    a float64 sqrt rounded once to float32), so an update applied with :func:`apply_compressed_`
    is the kernel's, bitwise.
    The kernel runs with ``lr = wd = 0`` on a scratch parameter of ``grad``'s dtype."""
    state_only_(quantized_step_, grad, idx, scale, v, codebook, period=period, scale_block=scale_block,
                hp=dict(beta1=beta1, beta2=beta2, eps=eps, bc1=bc1, bc2=bc2), max_elems=_SCRATCH_ELEMS)
    sigma = v.double().sqrt().float().div_(math.sqrt(bc2)).add_(eps).reciprocal_()
    return sigma.mul_(1.0 / bc1)


def factored_state_(grad, idx, scale, v_row, codebook, *, slab, beta1, beta2, eps, bc1, bc2,
                    scale_block) -> torch.Tensor:
    """The kernel's row-local state update of :func:`quantized_step_factored_` (``v_row``, ``idx``,
    ``scale`` in place) without the column factor and the parameter update, for ZeRO-1's owners;
    returns ``sqrt(v_row)`` correctly rounded, as the kernel's ``sqrtf`` (what :func:`apply_factored_`
    reads). The state never depends
    on ``v_col``, so the kernel runs against a zero column profile, with ``lr = wd = 0``, on a
    scratch parameter of ``grad``'s dtype, chunk by chunk of rows (:mod:`.state_only`)."""
    factored_state_only_(quantized_step_factored_, grad, idx, scale, v_row, codebook, slab=slab,
                         scale_block=scale_block, hp=dict(beta1=beta1, beta2=beta2, eps=eps, bc1=bc1, bc2=bc2),
                         max_elems=_SCRATCH_ELEMS)
    return v_row.reshape(-1).double().sqrt().float()


# --------------------------------------------------------------------------------------
# apply only: the step's parameter update from its compressed results (ZeRO-1's replicas)
# --------------------------------------------------------------------------------------

def _apply_inputs(param, idx, M, rates, codebook, *, n_blocks: int, n_rates: int):
    """The C inputs of an apply-only call (contiguous, checked) and the 257-entry codebook."""
    if param.dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"param dtype {param.dtype} not supported (float32, bfloat16)")
    _check("param", param, None, param.numel())
    idx, M, rates = idx.reshape(-1).contiguous(), M.reshape(-1).contiguous(), rates.reshape(-1).contiguous()
    _check("idx", idx, torch.uint8, param.numel())
    _check("M", M, torch.float32, n_blocks)
    _check("sigma/rsq", rates, torch.float32, n_rates)
    cb = torch.empty(NUM_CODEWORDS + 1, dtype=torch.float32)
    cb[:NUM_CODEWORDS] = codebook.detach().to("cpu", torch.float32).reshape(-1)
    cb[NUM_CODEWORDS] = float("inf")
    return idx, M, rates, cb


def apply_compressed_(pf: torch.Tensor, idx: torch.Tensor, M: torch.Tensor, sigma: torch.Tensor,
                      cb: torch.Tensor, P: int, hp: dict, simd: int = 1) -> None:
    """The parameter update of :func:`quantized_step_` (``period == scale_block == P``) from its
    results, in the kernel (``gefen_apply_compressed``, the code of the step's last sweep): ``pf``
    (float32/bfloat16, contiguous) <- ``pf*(1-lr*wd) - clamp(C[idx] * ((M*sigma)*lr), +-bound*lr)``
    with the new ``idx``, the new scales ``M`` and ``sigma`` per block as :func:`quantized_state_`
    returns it, so a replica equals the owner's full step bitwise. The contract of
    :func:`gefen_dist.core.apply.apply_compressed` (whose order is the eager step's); falls back to it
    without the native library."""
    lib = _lib()
    if lib is None:
        from gefen_dist.core.apply import apply_compressed

        return apply_compressed(pf, idx, M, sigma, cb, P, hp)
    n, P = pf.numel(), int(P)
    if P < 1 or n % P:
        raise ValueError(f"numel {n} is not a multiple of the block {P}")
    if n == 0:
        return None
    idx, M, sigma, cb = _apply_inputs(pf, idx, M, sigma, cb, n_blocks=n // P, n_rates=n // P)
    a = _update_args(_Args(), pf, n, P, P, lr=hp["lr"], eps=hp["eps"], weight_decay=hp["weight_decay"],
                     bc1=hp["bc1"], bc2=hp["bc2"], bound=hp.get("bound"), simd=simd)
    rc = lib.gefen_apply_compressed(ctypes.byref(a), pf.data_ptr(), idx.data_ptr(), M.data_ptr(),
                                    sigma.data_ptr(), cb.data_ptr())
    if rc != 0:
        raise RuntimeError(f"gefen_apply_compressed failed with code {rc}")
    torch.autograd.graph.increment_version(pf)
    return None


def apply_factored_(pf: torch.Tensor, idx: torch.Tensor, M: torch.Tensor, rsq: torch.Tensor,
                    col_f: torch.Tensor, cb: torch.Tensor, B: int, slab: int, hp: dict, row0: int = 0,
                    row_block: int = 0, simd: int = 1, col_blocks: int = 1) -> None:
    """The parameter update of :func:`quantized_step_factored_` from its results, in the kernel
    (``gefen_apply_factored``, the code of the step's last sweep): the new ``idx`` and scales ``M``
    (per ``B`` elements), ``rsq = sqrt(v_row)`` per row of ``slab`` elements as
    :func:`factored_state_` returns it, the column factors ``col_f`` (``[slab]``, or ``[G, slab]``
    per block of ``row_block`` rows, this range's first row being global row ``row0``); bitwise the
    full step's parameter. ``col_blocks`` ``K`` (D21): ``rsq`` per row and block of ``slab / K`` columns,
    ``col_f`` normalised per block. The contract of :func:`gefen_dist.core.apply.apply_factored`; falls back
    to it without the native library."""
    lib = _lib()
    if lib is None:
        from gefen_dist.core.apply import apply_factored

        return apply_factored(pf, idx, M, rsq, col_f, cb, B, slab, hp, row0=row0, row_block=row_block,
                              col_blocks=col_blocks)
    n, B, S, K = pf.numel(), int(B), int(slab), int(col_blocks)
    if B < 1 or S < 1 or S % B or n % S:
        raise ValueError(f"need the scale block {B} to divide the row length {S}, and {S} to divide numel {n}")
    if n == 0:
        return None
    G = col_f.numel() // S
    cf = col_f.detach().reshape(-1).contiguous()
    _check("col_f", cf, torch.float32, G * S)
    if G > 1 and (row_block < 1 or row0 < 0 or row0 + n // S > G * row_block):
        raise ValueError(f"col_f has {G} row blocks: need row_block >= 1 and rows [{row0}, {row0 + n // S}) "
                         f"inside {G} x {row_block} rows")
    rb = int(row_block) if G > 1 else row0 + n // S + 1  # one block: every row in block 0
    if K < 1 or S % K or (S // K) % B or (K > 1 and G > 1):
        raise ValueError(f"col_blocks={K}: need one column profile and the scale block {B} dividing a block of "
                         f"{S} / {K} columns")
    idx, M, rsq, cb = _apply_inputs(pf, idx, M, rsq, cb, n_blocks=n // B, n_rates=n // S * K)
    a = _update_args(_Args(), pf, n, S, B, lr=hp["lr"], eps=hp["eps"], weight_decay=hp["weight_decay"],
                     bc1=hp["bc1"], bc2=hp["bc2"], bound=hp.get("bound"), simd=simd)
    rc = lib.gefen_apply_factored_k(ctypes.byref(a), pf.data_ptr(), idx.data_ptr(), M.data_ptr(), rsq.data_ptr(),
                                    cf.data_ptr(), cb.data_ptr(), int(row0), rb, K)
    if rc != 0:
        raise RuntimeError(f"gefen_apply_factored failed with code {rc}")
    torch.autograd.graph.increment_version(pf)
    return None


def column_sumsq(grad: torch.Tensor, slab: int) -> torch.Tensor:
    """Per-column sum of the float32 squares ``g * g`` over the rows of ``slab`` elements that
    ``grad`` holds, accumulated in float64 (``[slab]``): the contract of
    :func:`gefen_dist.core.step.column_sumsq`, in one multi-threaded pass without temporaries.
    The summation order is fixed (at most 16 row segments, added in order), so the result does
    not depend on the thread count; it can differ from the eager function's float64 sum in the
    last float64 bits (never, in practice, after the float32 rounding that follows). A NaN or
    inf in ``grad`` makes its column's sum non-finite. Falls back to the eager function for
    non-CPU tensors, other dtypes, or without the native library."""
    from gefen_dist.core.step import column_sumsq as eager

    lib = _lib()
    n = grad.numel()
    if (lib is None or grad.device.type != "cpu" or grad.dtype not in (torch.float32, torch.bfloat16)
            or slab < 1 or n % slab):
        return eager(grad, slab)
    g = grad.contiguous()
    out = torch.empty(slab, dtype=torch.float64)
    rc = lib.gefen_column_sumsq(g.data_ptr(), 0 if g.dtype == torch.float32 else 1, n // slab, slab,
                                out.data_ptr(), torch.get_num_threads())
    if rc != 0:
        raise MemoryError(f"gefen_column_sumsq: cannot allocate {min(16, n // slab) * slab * 8} bytes")
    return out
