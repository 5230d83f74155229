"""Native codebook DP (ctypes wrapper of ``csrc/dp.c``): the middle layers of the exact
divide-and-conquer DP of :mod:`gefen_dist.core.codebook`, with the same IEEE operations as its
numpy solver (the tests compare them bit for bit)."""
from __future__ import annotations

import ctypes
import threading
from typing import Optional, Tuple

import numpy as np

from .native import load_library

__all__ = ["solver"]

_lib_lock = threading.Lock()
_configured: set = set()


def _lib() -> Optional[ctypes.CDLL]:
    """The native DP library, or None (no compiler, or ``GEFEN_DIST_NO_NATIVE=1``).

    ``load_library`` checks the environment variable on every call and caches the build, so
    this stays cheap and honours the variable even after the library was first loaded.
    """
    lib = load_library("gefen_dp", ["dp.c"])
    if lib is None:
        return None
    with _lib_lock:
        if id(lib) not in _configured:
            fn = lib.gefen_dp_solve
            fn.restype = ctypes.c_int
            fn.argtypes = [ctypes.c_int64, ctypes.c_int64] + [ctypes.c_void_p] * 5
            _configured.add(id(lib))
    return lib


class _NativeDP:
    """A :data:`gefen_dist.core.codebook.DPSolver` backed by the C library."""

    method = "native-dc"

    def __init__(self, lib: ctypes.CDLL):
        self._lib = lib

    def __call__(self, W: np.ndarray, S: np.ndarray, Q: np.ndarray, K: int) -> Tuple[np.ndarray, float]:
        n = W.shape[0] - 1
        starts = np.empty(K, dtype=np.int64)
        obj = np.empty(1, dtype=np.float64)
        rc = self._lib.gefen_dp_solve(n, K, W.ctypes.data, S.ctypes.data, Q.ctypes.data,
                                      starts.ctypes.data, obj.ctypes.data)
        if rc != 0:
            raise RuntimeError(f"gefen_dp_solve failed with code {rc} (n={n}, K={K})")
        return starts, float(obj[0])


def solver() -> Optional[_NativeDP]:
    """The native DP solver, or None when the library cannot be built or is disabled."""
    lib = _lib()
    return _NativeDP(lib) if lib is not None else None
