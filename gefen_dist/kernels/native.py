"""Build and load gefen_dist's small C libraries (no torch headers, no Python C-API).

The CPU kernels are plain C99 + OpenMP operating on raw pointers. They compile in about a
second with the system C compiler on first use and are cached under
``$GEFEN_DIST_CACHE`` (default ``~/.cache/gefen_dist``), keyed by a hash of the sources, the
compiler flags and the host CPU's feature flags, so a shared home directory on a
heterogeneous cluster never loads a library built for another micro-architecture.

Several processes (ranks) may build concurrently: each compiles to a private temporary file
and publishes it with an atomic ``os.replace``; whoever finishes last wins, and every
candidate is identical.

If no compiler is available the loader returns ``None`` and callers fall back to the eager
torch path (a warning is logged once per library).
"""
from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path
from typing import Dict, Optional, Sequence

logger = logging.getLogger(__name__)

CSRC = Path(__file__).resolve().parent / "csrc"

_lock = threading.Lock()
_cache: Dict[str, Optional[ctypes.CDLL]] = {}

_BASE_FLAGS = ["-O3", "-std=c99", "-shared", "-fPIC", "-fno-math-errno"]


def _cpu_signature() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return line.strip()
    except OSError:
        pass
    return platform.machine() + platform.processor()


def cache_dir() -> Path:
    root = os.environ.get("GEFEN_DIST_CACHE") or os.path.join(
        os.path.expanduser("~"), ".cache", "gefen_dist"
    )
    return Path(root)


def _compiler() -> Optional[str]:
    cc = os.environ.get("CC")
    if cc and shutil.which(cc):
        return cc
    for cand in ("cc", "gcc", "clang"):
        if shutil.which(cand):
            return cand
    return None


def _try_compile(cc: str, sources: Sequence[Path], out: Path, flags: Sequence[str]) -> Optional[str]:
    cmd = [cc, *flags, "-o", str(out), *map(str, sources), "-lm"]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        return f"{' '.join(cmd)}\n{proc.stderr[-2000:]}"
    return None


def load_library(name: str, sources: Sequence[str]) -> Optional[ctypes.CDLL]:
    """Compile (once, cached) and load ``sources`` (file names under ``csrc/``) as ``name``.

    Returns ``None`` when no working C compiler is found; the reason is logged once.
    Set ``GEFEN_DIST_NO_NATIVE=1`` to force the fallback (used by tests of the eager path).
    """
    if os.environ.get("GEFEN_DIST_NO_NATIVE", "0") not in ("", "0"):
        return None
    with _lock:
        if name in _cache:
            return _cache[name]
        lib = _build_and_load(name, [CSRC / s for s in sources])
        _cache[name] = lib
        return lib


def _build_and_load(name: str, paths: Sequence[Path]) -> Optional[ctypes.CDLL]:
    cc = _compiler()
    if cc is None:
        logger.warning("gefen_dist: no C compiler found (set CC); %s falls back to eager torch", name)
        return None
    variants = [
        _BASE_FLAGS + ["-march=native", "-fopenmp"],
        _BASE_FLAGS + ["-fopenmp"],
        _BASE_FLAGS,
    ]
    h = hashlib.sha256()
    for p in paths:
        h.update(p.read_bytes())
    h.update(_cpu_signature().encode())
    h.update(cc.encode())
    digest = h.hexdigest()[:16]
    d = cache_dir()
    d.mkdir(parents=True, exist_ok=True)
    errors = []
    for i, flags in enumerate(variants):
        target = d / f"{name}-{digest}-v{i}.so"
        if not target.exists():
            fd, tmp = tempfile.mkstemp(prefix=f".{name}-", suffix=".so", dir=d)
            os.close(fd)
            err = _try_compile(cc, paths, Path(tmp), flags)
            if err is not None:
                errors.append(err)
                os.unlink(tmp)
                continue
            os.replace(tmp, target)
            logger.debug("gefen_dist: built %s with %s", target, " ".join(flags))
        try:
            return ctypes.CDLL(str(target))
        except OSError as e:  # e.g. built with -fopenmp but libgomp missing at load
            errors.append(str(e))
    logger.warning("gefen_dist: could not build native library %s; falling back to eager torch.\n%s",
                   name, "\n".join(errors))
    return None
