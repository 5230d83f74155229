"""The nearest-codeword table of the native CPU kernel (:mod:`gefen_dist.kernels.cpu`): built once per
codebook in numpy/torch from :func:`gefen_dist.core.quant.nearest_codeword` at the exact float
boundaries of its buckets, and cached by the codebook's float32 contents. Its design is the
"Nearest codeword" section of :mod:`gefen_dist.kernels.cpu`'s docstring; the lookups that call the
library (``nearest_lut``, ``nearest_sweep``) stay there."""
from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch

from gefen_dist.core.quant import NUM_CODEWORDS, bucket_entries, nearest_codeword

logger = logging.getLogger(__name__)

__all__ = ["CodebookTable", "codebook_table"]

_MIN_LUT_BITS = 12
_MAX_LUT_BITS = 18
_SCAN_LUT_BITS = 16
_TABLE_CACHE_SIZE = 32
_ENT_MAX_BUCKETS = 16384  # per-bucket entries (16 B each) of tables up to this size; larger ones gather



@dataclass(frozen=True)
class CodebookTable:
    cb: torch.Tensor   # float32 [257], cb[256] = +inf
    lut: torch.Tensor  # int32 [nb]
    mode: int          # 1: two candidates; 0: lower bound + scan
    h: float           # nb / 2
    nb: int
    # mode 1 and nb <= _ENT_MAX_BUCKETS: core.quant.bucket_entries, float32 [nb, 4] (the AVX2 path's
    # per-bucket candidates and flip point; built once per codebook), else None
    ent: Optional[torch.Tensor] = None


_tables: "OrderedDict[bytes, CodebookTable]" = OrderedDict()
_tables_lock = threading.Lock()


def _to_ord(x: np.ndarray) -> np.ndarray:
    b = x.astype(np.float32).view(np.int32).astype(np.int64)
    return np.where(b >= 0, b, -(b & 0x7FFFFFFF))


def _from_ord(o: np.ndarray) -> np.ndarray:
    o = np.asarray(o, dtype=np.int64)
    bits = np.where(o >= 0, o, (-o) | 0x80000000).astype(np.uint32)
    return bits.view(np.float32)


def _bucket(z: np.ndarray, h: np.float32, nb: int) -> np.ndarray:
    """The kernel's bucket function, in float32 (z * h is exact; one rounding in + h)."""
    with np.errstate(invalid="ignore", over="ignore"):
        t = z.astype(np.float32) * h + h
        t = np.where(t > 0, t, np.float32(0))
        t = np.where(t < np.float32(nb - 1), t, np.float32(nb - 1))
    return t.astype(np.int64)


def _bucket_lower_bounds(nb: int) -> np.ndarray:
    """L[k] = smallest float32 z with bucket(z) >= k (k >= 1); L[0] = -inf."""
    h = np.float32(nb // 2)
    k = np.arange(1, nb, dtype=np.int64)
    lo = np.full(k.shape, int(_to_ord(np.array([-2.0]))[0]), dtype=np.int64)  # bucket < k
    hi = np.full(k.shape, int(_to_ord(np.array([2.0]))[0]), dtype=np.int64)   # bucket >= k
    while True:
        open_ = hi - lo > 1
        if not open_.any():
            break
        mid = (lo + hi) >> 1
        ge = _bucket(_from_ord(mid), h, nb) >= k
        hi = np.where(open_ & ge, mid, hi)
        lo = np.where(open_ & ~ge, mid, lo)
    out = np.empty(nb, dtype=np.float32)
    out[0] = -np.inf
    out[1:] = _from_ord(hi)
    return out


def _build_table(cbf: torch.Tensor) -> CodebookTable:
    c = cbf.numpy()
    if c.shape != (NUM_CODEWORDS,) or not np.all(np.isfinite(c)) or not np.all(np.diff(c) > 0):
        raise ValueError("codebook must be 256 finite, strictly ascending float32 values")
    if c[0] != -1.0 or c[-1] != 1.0:
        raise ValueError("codebook must start at -1 and end at +1")
    cb = torch.empty(NUM_CODEWORDS + 1, dtype=torch.float32)
    cb[:NUM_CODEWORDS] = cbf
    cb[NUM_CODEWORDS] = float("inf")
    for bits in range(_MIN_LUT_BITS, _MAX_LUT_BITS + 1):
        nb = 1 << bits
        lower = _bucket_lower_bounds(nb)
        upper = np.empty(nb, dtype=np.float32)
        upper[:-1] = _from_ord(_to_ord(lower[1:]) - 1)
        upper[-1] = np.inf
        n_lo = nearest_codeword(torch.from_numpy(lower), cbf).to(torch.int32)
        n_hi = nearest_codeword(torch.from_numpy(upper), cbf).to(torch.int32)
        if int((n_hi - n_lo).max()) <= 1:
            lut = n_lo.contiguous()
            ent = bucket_entries(cb, lut) if nb <= _ENT_MAX_BUCKETS else None
            return CodebookTable(cb, lut, 1, float(nb // 2), nb, ent)
    nb = 1 << _SCAN_LUT_BITS
    lower = torch.from_numpy(_bucket_lower_bounds(nb))
    lut = torch.searchsorted(cbf, lower, right=False).to(torch.int32)
    logger.debug("gefen_dist: codebook too dense for a two-candidate table; scanning")
    return CodebookTable(cb, lut.contiguous(), 0, float(nb // 2), nb)


def codebook_table(codebook: torch.Tensor) -> CodebookTable:
    """The (cached) nearest-codeword table of a codebook, keyed by its float32 contents."""
    cbf = codebook.detach().to("cpu", torch.float32).contiguous().reshape(-1)
    key = cbf.numpy().tobytes()
    with _tables_lock:
        t = _tables.get(key)
        if t is not None:
            _tables.move_to_end(key)
            return t
    t = _build_table(cbf.clone())
    with _tables_lock:
        _tables[key] = t
        while len(_tables) > _TABLE_CACHE_SIZE:
            _tables.popitem(last=False)
    return t
