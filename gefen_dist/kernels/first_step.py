"""Native first-step kernels (ctypes wrapper of ``csrc/first_step.c``): period statistics and
the codebook histogram, multi-threaded with OpenMP (``torch.get_num_threads()`` threads).

:mod:`gefen_dist.kernels.dispatch` calls these when the library is available and the data is on
the CPU; otherwise (no compiler, ``GEFEN_DIST_NO_NATIVE=1``, a CUDA tensor) it runs the reference
in :mod:`gefen_dist.core.periods` / :mod:`gefen_dist.core.quant`.

``log_sq``
    ``l_i = ln(f64(f32(g_i)^2) + 1e-12)``, the float64 square where the float32 one overflows,
    exactly like :func:`gefen_dist.core.periods.log_sq_eager` except for the logarithm itself: a
    vectorised fdlibm-style ``ln`` (< 1 ulp) instead of torch's (SLEEF, <= 1 ulp), so a small
    fraction of the ``l_i`` differ in the last bit.

``period_partials``
    The same statistics as :func:`gefen_dist.core.periods.period_partials_eager` in one pass, from
    ``l`` (float64) or straight from the gradient (float32 / bfloat16 / float16; ``l`` is then
    computed on the fly and never stored). Extra memory: per thread three chunk buffers of
    16384 elements (~320 KiB), plus ``ceil(length / 2^18) * n_candidates * 56`` bytes of
    records (e.g. 150 * 69 * 56 B = 0.6 MB for a 50257x768 tensor); no O(length) buffer.

    Summation order (why the scores differ from the numpy path in the ~11th digit): the
    numpy path takes block sums as differences of one float64 prefix sum over the whole piece;
    near its end that prefix is ~``length * |l|`` (~8e8 for 38.6M elements), so each block sum
    carries an absolute rounding error of ~1e-7 and the small-period and large-period scores
    are off by up to ~3e-10 relative (measured on a 50257x768 gradient against block sums in
    extended precision). Here the prefix restarts at every chunk of 16384 elements (magnitude
    <= ~5e5; a full chunk is summed as 8 interleaved runs to break the add latency chain), block sums inside a chunk are differences of that local prefix, and a block that
    spans chunks is the left-to-right sum of its per-chunk parts; so the result is *more*
    accurate (<= 1e-13 relative to extended precision on that gradient; the tests require
    1e-12) and differs from the numpy
    path by the numpy path's own rounding error. Chunks are grouped into super-chunks
    (16 chunks or more, a function of the length only) processed in parallel and merged left to
    right, so the result does not depend on the number of threads.

``block_histogram_``
    Bitwise the counts of :func:`gefen_dist.core.quant.block_histogram_eager` (same float32
    division, ``floor``, clamp); blocks whose absmax is NaN count as zero blocks (bin 2048) like
    the torch path. A block holding an infinity gives a NaN bin, on which the torch path raises
    in ``bincount``: the wrapper then reports failure and the caller runs the torch path, which
    raises the same error.
"""
from __future__ import annotations

import ctypes
import logging
import threading
from typing import List, Optional, Sequence, Tuple

import numpy as np
import torch

logger = logging.getLogger(__name__)

__all__ = ["available", "log_sq", "period_partials", "block_histogram_"]

_ABI = 1
_LIB_NAME = "gefen_first_step"
_SOURCES = ["first_step.c"]
_DTYPES = {torch.float32: 1, torch.bfloat16: 2, torch.float16: 3}
_NUM_BINS = 4096

_lock = threading.Lock()
_configured: set = set()


def _lib() -> Optional[ctypes.CDLL]:
    from gefen_dist.kernels.native import load_library

    lib = load_library(_LIB_NAME, _SOURCES)
    if lib is None:
        return None
    with _lock:
        if id(lib) not in _configured:
            lib.gefen_first_step_abi.restype = ctypes.c_int
            if lib.gefen_first_step_abi() != _ABI:
                logger.warning("gefen_dist: %s has an unexpected ABI; using the eager path", _LIB_NAME)
                return None
            vp, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
            lib.gefen_log_sq.restype = i32
            lib.gefen_log_sq.argtypes = [vp, i32, i64, vp, i32]
            lib.gefen_period_partials.restype = i32
            lib.gefen_period_partials.argtypes = [vp, i32, i64, i64, vp, i64, vp, vp, vp, vp, i32]
            lib.gefen_block_histogram.restype = i32
            lib.gefen_block_histogram.argtypes = [vp, i32, i64, i64, vp, i32]
            _configured.add(id(lib))
    return lib


def available() -> bool:
    """Whether the native library is built and loaded (``GEFEN_DIST_NO_NATIVE=1`` says no)."""
    return _lib() is not None


def _threads() -> int:
    return max(1, torch.get_num_threads())


def _grad_f32_like(t: torch.Tensor) -> Optional[Tuple[torch.Tensor, int]]:
    """A contiguous CPU tensor the kernel reads (float32/bfloat16/float16) and its code;
    other floating types are converted to float32 first (as ``.float()`` does); None for
    tensors that are not on the CPU."""
    if t.device.type != "cpu":
        return None
    flat = t.detach().reshape(-1)
    if flat.dtype not in _DTYPES:
        flat = flat.float()
    return flat.contiguous(), _DTYPES[flat.dtype]


def log_sq(grad: torch.Tensor) -> Optional[torch.Tensor]:
    """Native ``log_sq`` of a CPU tensor (float64, 1-D), or None when not applicable."""
    lib = _lib()
    if lib is None:
        return None
    src = _grad_f32_like(grad)
    if src is None:
        return None
    flat, code = src
    out = torch.empty(flat.numel(), dtype=torch.float64)
    if flat.numel() == 0:
        return out
    rc = lib.gefen_log_sq(flat.data_ptr(), code, flat.numel(), out.data_ptr(), _threads())
    if rc != 0:
        return None
    return out


def period_partials(values: torch.Tensor, start: int, periods: Sequence[int], is_log: bool
                    ) -> Optional[Tuple[List[float], List[List[int]], List[List[float]]]]:
    """``(internal, edge_blocks, edge_sums)`` of the piece ``values`` (its first element at flat
    offset ``start``) for every candidate in ``periods``; ``values`` is ``l`` (float64) when
    ``is_log`` else the gradient piece. None when the native path does not apply."""
    lib = _lib()
    if lib is None or not periods:
        return None
    if is_log:
        if values.device.type != "cpu":
            return None
        flat, code = values.detach().reshape(-1).to(torch.float64).contiguous(), 0
    else:
        src = _grad_f32_like(values)
        if src is None:
            return None
        flat, code = src
    n = flat.numel()
    if n == 0:
        return None
    k = len(periods)
    ps = np.ascontiguousarray(periods, dtype=np.int64)
    internal = np.zeros(k, dtype=np.float64)
    e0 = np.zeros(k, dtype=np.int64)
    e1 = np.zeros(k, dtype=np.int64)
    sums = np.zeros(4 * k, dtype=np.float64)
    rc = lib.gefen_period_partials(flat.data_ptr(), code, n, int(start), ps.ctypes.data, k,
                                   internal.ctypes.data, e0.ctypes.data, e1.ctypes.data,
                                   sums.ctypes.data, _threads())
    if rc != 0:
        return None
    edge_blocks: List[List[int]] = []
    edge_sums: List[List[float]] = []
    s4 = sums.reshape(k, 4).tolist()
    for j, (a, b) in enumerate(zip(e0.tolist(), e1.tolist())):
        seen = {}
        for q, blk in enumerate((a, a + 1, b - 1, b)):
            if a <= blk <= b and blk not in seen:
                seen[blk] = s4[j][q]
        blocks = sorted(seen)
        edge_blocks.append(blocks)
        edge_sums.append([seen[blk] for blk in blocks])
    return internal.tolist(), edge_blocks, edge_sums


def block_histogram_(values: torch.Tensor, block: int, out: torch.Tensor) -> bool:
    """Add the block histogram of ``values`` to ``out`` (int64, CPU) natively; False when the
    native path does not apply (then nothing was added)."""
    lib = _lib()
    if lib is None or out.device.type != "cpu" or out.dtype != torch.int64 or not out.is_contiguous():
        return False
    src = _grad_f32_like(values)
    if src is None:
        return False
    flat, code = src
    if flat.numel() % block:
        return False
    counts = torch.zeros(_NUM_BINS, dtype=torch.int64)
    rc = lib.gefen_block_histogram(flat.data_ptr(), code, flat.numel(), int(block), counts.data_ptr(),
                                   _threads())
    if rc != 0:
        return False
    out += counts
    return True
