"""Build and load gefen_dist's small C libraries (no torch headers, no Python C-API).

The CPU kernels are plain C99 + OpenMP operating on raw pointers. They compile with the system C
compiler on first use (the step kernel, ``gefen_step``, in ~20 s; the others in about a second;
``gefen-dist build-kernels`` does it ahead of a job, e.g. in an image build) and are cached under
``$GEFEN_DIST_CACHE`` (default ``~/.cache/gefen_dist``), keyed by a hash of the sources, the
compiler flags and the host CPU's feature flags, so a shared home directory on a
heterogeneous cluster never loads a library built for another micro-architecture.

Several processes (the ranks of a job on a new machine) may need a library at once: one compiles it
while the others wait on an advisory lock file beside it (``fcntl.flock``, released if the process
dies) and then load its result, instead of each spending the compile's CPU time. The compile writes
a private temporary file published with an atomic ``os.replace``, so a reader never sees a
partial library (and where there is no ``fcntl``, concurrent builds stay correct: every candidate
is identical).

If no compiler is available the loader returns ``None`` and callers fall back to the eager
torch path (a warning is logged once per library).

``GEFEN_DIST_CFLAGS`` (split like a shell's words) is appended to every set of flags and is part of the
cache key, e.g. ``-fsanitize=address -g`` for a sanitizer build (``scripts/asan_tests.sh`` runs the test
suite so) or ``-O2`` to compare builds; the libraries then built are cached apart from the default ones.
"""
from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shlex
import shutil
import subprocess
import tempfile
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Dict, Iterator, Optional, Sequence

try:
    import fcntl
except ImportError:  # pragma: no cover (not POSIX)
    fcntl = None

logger = logging.getLogger(__name__)

CSRC = Path(__file__).resolve().parent / "csrc"

_lock = threading.Lock()
_cache: Dict[str, Optional[ctypes.CDLL]] = {}

# -fno-trapping-math: no floating-point operation's result changes (no reassociation, no contraction),
# but the compiler may compute a division or product on both sides of a select, which is what lets
# an AVX2 build vectorise the loops whose operations sit under a condition (AVX-512 masks them): the
# one-byte layout's step (D20) ran 5.6x faster on AVX2 with it (research/speed-log.md)
_BASE_FLAGS = ["-O3", "-std=c99", "-shared", "-fPIC", "-fno-math-errno", "-fno-trapping-math"]
# GCC splits unaligned 256-bit stores in two 128-bit halves when it tunes for the first Zen cores, and
# virtual machines that hide the CPU model often present an AMD EPYC as exactly that (family 23,
# model 1): the step kernel then spends ~4% of its time on the split stores (research/speed-log.md).
# The instructions' results are the same; a compiler without the option falls back to the next set.
_X86_STORE_FLAGS = ["-mno-avx256-split-unaligned-store"]


def flag_variants() -> list:
    """The sets of compiler flags tried in turn (the first that compiles and loads is used)."""
    native = ["-march=native", "-fopenmp"]
    variants = [_BASE_FLAGS + native, _BASE_FLAGS + ["-fopenmp"], _BASE_FLAGS]
    if platform.machine().lower() in ("x86_64", "amd64"):
        variants.insert(0, _BASE_FLAGS + native + _X86_STORE_FLAGS)
    return variants


def user_flags() -> list:
    """``GEFEN_DIST_CFLAGS`` as a list (module docstring); a value the shell rules cannot split
    (an open quote) is refused with the value and the fix."""
    raw = os.environ.get("GEFEN_DIST_CFLAGS", "")
    try:
        return shlex.split(raw)
    except ValueError as e:
        raise ValueError(f"GEFEN_DIST_CFLAGS={raw!r} cannot be split into compiler flags ({e}); quote it as a shell "
                         "would, e.g. GEFEN_DIST_CFLAGS='-fsanitize=address -g'") from None


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


_COMPILE_TIMEOUT = 900.0  # s: a compile that hangs fails (the ranks waiting on its lock go on)


def _try_compile(cc: str, sources: Sequence[Path], out: Path, flags: Sequence[str]) -> Optional[str]:
    cmd = [cc, *flags, "-o", str(out), *map(str, sources), "-lm"]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=_COMPILE_TIMEOUT)
    except subprocess.TimeoutExpired:
        return f"{' '.join(cmd)}\ntimed out after {_COMPILE_TIMEOUT:g} s"
    if proc.returncode != 0:
        return f"{' '.join(cmd)}\n{proc.stderr[-2000:]}"
    return None


def load_library(name: str, sources: Sequence[str], extra_flags: Sequence[str] = ()) -> Optional[ctypes.CDLL]:
    """Compile (once, cached) and load ``sources`` (file names under ``csrc/``) as ``name``, with
    ``extra_flags`` after each set of :func:`flag_variants` (e.g. ``-mno-avx512f`` for the step
    kernel's AVX2 build on an AVX-512 host, ``kernels/cpu_build.py``).

    Returns ``None`` when no working C compiler is found; the reason is logged once.
    Set ``GEFEN_DIST_NO_NATIVE=1`` to force the fallback (used by tests of the eager path).
    """
    if os.environ.get("GEFEN_DIST_NO_NATIVE", "0") not in ("", "0"):
        return None
    with _lock:
        if name in _cache:
            return _cache[name]
        lib = _build_and_load(name, [CSRC / s for s in sources], tuple(extra_flags))
        _cache[name] = lib
        return lib


def _build_and_load(name: str, paths: Sequence[Path], extra_flags: Sequence[str] = ()) -> Optional[ctypes.CDLL]:
    cc = _compiler()
    if cc is None:
        logger.warning("gefen_dist: no C compiler found (set CC); %s falls back to eager torch", name)
        return None
    variants = [v + list(extra_flags) + user_flags() for v in flag_variants()]
    h = hashlib.sha256()
    for p in paths:
        h.update(p.read_bytes())
    h.update(repr(variants).encode())
    h.update(_cpu_signature().encode())
    h.update(cc.encode())
    digest = h.hexdigest()[:16]
    d = cache_dir()
    try:
        d.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        logger.warning("gefen_dist: cannot use %s as the kernel cache (%s); %s falls back to eager torch. Set "
                       "GEFEN_DIST_CACHE to a writable directory.", d, e, name)
        return None
    errors = []
    for i, flags in enumerate(variants):
        target = d / f"{name}-{digest}-v{i}.so"
        try:
            err = _build_once(cc, paths, target, flags)
        except OSError as e:  # an unwritable cache (the lock file, the temporary library)
            err = f"{target}: {e} (set GEFEN_DIST_CACHE to a writable directory)"
        if err is not None:
            errors.append(err)
            continue
        try:
            return ctypes.CDLL(str(target))
        except OSError as e:  # e.g. built with -fopenmp but libgomp missing at load
            errors.append(str(e))
    logger.warning("gefen_dist: could not build native library %s; falling back to eager torch.\n%s",
                   name, "\n".join(errors))
    return None


@contextmanager
def _exclusive(lock_path: Path) -> Iterator[None]:
    """An advisory inter-process lock on ``lock_path`` (held until the block ends or the process
    dies); a no-op where the platform has no ``fcntl``."""
    if fcntl is None:
        yield
        return
    with open(lock_path, "a") as f:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f.fileno(), fcntl.LOCK_UN)


_FAILED_FOR = 600.0  # s: how long a failed build's record spares the processes that wait for it a rebuild


def _build_once(cc: str, paths: Sequence[Path], target: Path, flags: Sequence[str]) -> Optional[str]:
    """Compile ``target`` unless it exists, one process at a time (the others wait, then find it);
    None when it is there, else the compiler's error. A failure is recorded beside it for
    :data:`_FAILED_FOR` seconds, so that the ranks that waited for it take the next variant at once
    instead of repeating the failing compile one after another (a later job tries again)."""
    if target.exists():
        return None
    failed = target.with_name("." + target.name + ".failed")
    with _exclusive(target.with_name("." + target.name + ".lock")):
        if target.exists():  # built by the process that held the lock
            return None
        try:
            age = time.time() - failed.stat().st_mtime
            if age < _FAILED_FOR:
                return (f"{failed.read_text()}\n(the build that failed {age:.0f} s ago; tried again after "
                        f"{_FAILED_FOR:g} s)")
        except OSError:
            pass
        logger.info("gefen_dist: compiling %s into %s (once per source version, CPU type and compiler; "
                    "up to ~20 s)", target.name, target.parent)
        t0 = time.monotonic()
        fd, tmp = tempfile.mkstemp(prefix=f".{target.stem}-", suffix=".so", dir=target.parent)
        os.close(fd)
        err = _try_compile(cc, paths, Path(tmp), flags)
        if err is not None:
            os.unlink(tmp)
            failed.write_text(err)
            return err
        os.replace(tmp, target)
        failed.unlink(missing_ok=True)
        logger.info("gefen_dist: built %s in %.1f s (%s)", target.name, time.monotonic() - t0, " ".join(flags))
    return None
