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
import logging
import os
import warnings
from pathlib import Path

import torch

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


@contextlib.contextmanager
def quiet():
    """Silence peers' import-time chatter (torchao's optional CUDA libraries, bitsandbytes'
    optional CPU kernels package, deepspeed's accelerator notice)."""
    lv = logging.root.manager.disable
    logging.disable(logging.WARNING)
    try:
        with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()), \
                contextlib.redirect_stderr(io.StringIO()):
            warnings.simplefilter("ignore")
            yield
    finally:
        logging.disable(lv)


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


def adam_mini(named, lr, betas, eps, weight_decay, dim, n_heads):
    """Adam-mini on nanoGPT-style names. ``c_attn`` (fused q, k, v) is registered as a query/key
    name, so it gets one v per head (of ``dim * dim / n_heads`` elements) over q, k *and* v;
    ``c_proj`` (attention and MLP output projections) one v per output neuron; ``wte``/``wpe``
    are embeddings (one v per token/position); 1-D tensors (``bias``/``ln``) plain Adam."""
    with quiet():
        import adam_mini as am
        opt = am.Adam_mini(named, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, dim=dim,
                           n_heads=n_heads, verbose=False)
    opt.wqk_names.add("c_attn")
    opt.attn_proj_names.add("c_proj")
    opt.embd_names.add("wpe")
    return opt


def adam_mini_step_quiet(opt):
    """Adam-mini prints its block census on the first step."""
    with contextlib.redirect_stdout(io.StringIO()):
        return opt.step()


# --------------------------------------------------------------------------------------------
# measurements
# --------------------------------------------------------------------------------------------


def _tensor_leaves(t: torch.Tensor):
    """The plain tensors holding ``t``'s data (torchao's quantized states are tensor subclasses
    whose ``numel() * element_size()`` would report the dense fp32 size)."""
    if hasattr(t, "__tensor_flatten__") and type(t) is not torch.Tensor and not isinstance(t, torch.nn.Parameter):
        names, _ = t.__tensor_flatten__()
        for n in names:
            yield from _tensor_leaves(getattr(t, n))
    else:
        yield t


def state_bytes(opt) -> int:
    """Bytes of optimizer state: every tensor in ``opt.state`` (tensor subclasses flattened to their
    inner tensors, a tensor seen twice counted once), plus a Gefen codebook kept outside ``state``;
    ``opt.state_bytes()`` when the optimizer defines it (gefen_dist)."""
    if hasattr(opt, "state_bytes"):
        return int(opt.state_bytes())
    seen, total = set(), 0

    def add(t):
        nonlocal total
        for leaf in _tensor_leaves(t):
            key = (leaf.data_ptr(), leaf.numel(), leaf.dtype)
            if key in seen or leaf.numel() == 0:
                continue
            seen.add(key)
            total += leaf.numel() * leaf.element_size()

    for st in opt.state.values():
        for v in st.values():
            if isinstance(v, torch.Tensor):
                add(v)
    cb = getattr(opt, "_gefen_codebook", None)
    if isinstance(cb, torch.Tensor):
        add(cb)
    return total


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
