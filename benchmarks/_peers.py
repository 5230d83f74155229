"""Peer optimizers for the benchmarks (``step_speed.py``, ``quality.py``): construction, state
bytes, peak-memory probe, and the gefen-x subprocess plumbing. Benchmark code only.

Peers (pinned in ``pyproject.toml``'s ``peers`` extra; none is needed by the library or its tests):

* ``torchao.optim.AdamW8bit`` / ``AdamW4bit`` (torchao 0.18.0): block-wise quantized m and v
  (blocks of 256; tensors under 4,096 elements stay fp32); the step is ``torch.compile``-d, on CPU
  through Inductor's C++ backend (the first step of every new shape compiles).
* ``bitsandbytes.optim.AdamW8bit`` (bitsandbytes 0.50.2): dynamic 8-bit block-wise m and v;
  0.50 has a CPU path (tensors under 4,096 elements stay fp32).
* ``adam_mini.Adam_mini`` (adam-mini 1.1.1): fp32 m, one v per block chosen by parameter *name*
  (per head for query/key, per output neuron for value/MLP/projections, per token for embeddings).
* ``deepspeed.ops.adam.DeepSpeedCPUAdam`` (deepspeed 0.19.8): fp32 m and v, native AVX kernel;
  JIT-built on first use (``DS_BUILD_OPS=0``; a few minutes once, then cached in
  ``~/.cache/torch_extensions``).
* ``torch.optim.Adafactor`` (torch 2.13): factored v, no first moment.
* the reference ``gefen`` 1.2.3 and ``gefen-x`` 0.5.0. gefen-x installs a top-level package also
  named ``gefen``, so it must never share an environment with the reference: it is installed with
  ``pip install --no-deps --target DIR gefen-x==0.5.0`` and used only in a subprocess with
  ``PYTHONPATH=DIR`` (``gefenx_env``). ``DIR`` is ``$GEFENX_PATH`` or
  ``~/.cache/gefen_dist/peers/gefenx``.
"""
from __future__ import annotations

import contextlib
import ctypes
import io
import os
import warnings
import sys
from pathlib import Path


sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
# construction and state bytes are shared with launch/train.py --optimizer <peer>
from launch.peers import adam_mini, quiet, state_bytes  # noqa: E402,F401

PEER_VERSIONS = {
    "torchao": "0.18.0",
    "bitsandbytes": "0.50.2",
    "adam-mini": "1.1.1",
    "deepspeed": "0.19.8",
    "gefen": "1.2.3",
    "gefen-x": "0.5.0",
}

# --------------------------------------------------------------------------------------------
# gefen-x (subprocess only)
# --------------------------------------------------------------------------------------------


def gefenx_path() -> Path:
    return Path(os.environ.get("GEFENX_PATH", str(Path.home() / ".cache" / "gefen_dist" / "peers" / "gefenx")))


def gefenx_install_hint(path: Path | None = None) -> str:
    path = path or gefenx_path()
    return (f"pip install --no-deps --target {path} gefen-x==0.5.0   (then GEFENX_PATH={path}; never install "
            "gefen-x into the venv: its package `gefen` collides with the reference gefen 1.2.3)")


def gefenx_available(path: Path | None = None) -> bool:
    path = path or gefenx_path()
    return (path / "gefen" / "__init__.py").exists() and any(path.glob("gefen_x-*.dist-info"))


def gefenx_env(path: Path | None = None) -> dict:
    """Environment for a child process that imports gefen-x as ``gefen``."""
    path = path or gefenx_path()
    env = dict(os.environ)
    env["PYTHONPATH"] = str(path) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env["GEFEN_BENCH_GEFENX_CHILD"] = "1"
    return env


def imported_gefen_flavour() -> str:
    """'gefen-x <version>' or 'reference' for the ``gefen`` package this process imports."""
    import gefen

    v = getattr(gefen, "__version__", None)  # gefen-x defines it; the reference 1.2.3 does not
    return f"gefen-x {v}" if v is not None else "reference"


def require_gefen(flavour: str):
    """Import ``gefen`` and check it is the wanted one (``'reference'`` or ``'gefen-x'``)."""
    got = imported_gefen_flavour()
    if not got.startswith(flavour):
        raise RuntimeError(f"this process imports {got} as `gefen`, wanted {flavour}: "
                           + ("run gefen-x only in a subprocess with PYTHONPATH=<gefen-x target dir>; "
                              + gefenx_install_hint() if flavour == "gefen-x" else
                              "the reference must not run in a process whose PYTHONPATH holds gefen-x"))
    import gefen

    return gefen


def make_gefenx(params, lr, betas, eps=1e-8, weight_decay=0.0):
    gefen = require_gefen("gefen-x")
    with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
        warnings.simplefilter("ignore")  # "fused=True but CUDA is not available" -> fused=False
        return gefen.Gefen(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)


# --------------------------------------------------------------------------------------------
# imports and constructors
# --------------------------------------------------------------------------------------------


def import_torchao_optim():
    with quiet():
        import torchao.optim as tao
    return tao


def import_bnb():
    with quiet():
        import bitsandbytes as bnb
    return bnb


def import_ds_cpu_adam():
    os.environ.setdefault("DS_BUILD_OPS", "0")
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    with quiet():
        from deepspeed.ops.adam import DeepSpeedCPUAdam
    return DeepSpeedCPUAdam


def adam_mini_step_quiet(opt):
    """Adam-mini prints its block census on the first step."""
    with contextlib.redirect_stdout(io.StringIO()):
        return opt.step()


# --------------------------------------------------------------------------------------------
# measurements
# --------------------------------------------------------------------------------------------


_LIBC = None


def _malloc_trim() -> None:
    global _LIBC
    try:
        if _LIBC is None:
            _LIBC = ctypes.CDLL("libc.so.6")
        _LIBC.malloc_trim(0)
    except OSError:
        pass


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise KeyError(field)


def rss_peak_method_ok() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        _status_kib("VmHWM")
        return True
    except OSError:
        return False


def rss_peak_growth(fn) -> int | None:
    """Bytes by which the process's resident set peaked above its level just before ``fn()``.

    Method (Linux): ``gc`` + ``malloc_trim(0)`` (hand free heap pages back, so the step cannot
    hide its temporaries in already-resident free memory), then write ``5`` to
    ``/proc/self/clear_refs`` (resets the peak RSS, ``VmHWM``, to the current RSS), run ``fn``,
    and read ``VmHWM - VmRSS(before)``. It counts every temporary the step touches (torch's CPU
    allocator, native kernels, numba), at page granularity, and includes anything allocated for
    the first time in the step (run a warm-up step first). Other threads of this process count
    too. ``None`` where ``/proc/self/clear_refs`` is not writable."""
    import gc

    gc.collect()
    _malloc_trim()
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        before = _status_kib("VmRSS")
    except OSError:
        return None
    fn()
    peak = _status_kib("VmHWM")
    return max(0, peak - before) * 1024
