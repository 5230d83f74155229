"""Which build of the CPU step kernel (``csrc/gefen_step.c``) steps the default's tensors.

The kernel has two intrinsics paths, AVX-512 VBMI and AVX2 (``kernels/cpu.py``), bitwise equal to each
other and to the eager path. A ``-march=native`` build on an AVX-512 CPU compiles the first; the same
source built with ``-mno-avx512f`` compiles the second. Which is faster depends on the core, not on the
instruction count: on an AMD EPYC host with AVX-512 VBMI (reported as family 26) whose 512-bit operations
issue at half the rate of 256-bit ones, the AVX2 build took 0.93x the AVX-512 build's time for
``Gefen.step()`` on GPT-2 small, 0.74x on the `small` LM's tensors and 0.89x for
``second_moment="shared"``, and 1.59x for ``second_moment="nibbles"`` (research/speed-log.md). CPU
family numbers are not a reliable guide (virtual machines rewrite them), so the choice is measured:

* ``GEFEN_DIST_CPU_ISA=auto`` (the default): where the native build has the AVX-512 path, the AVX2
  build is compiled too (cached like the native one) and both step the same synthetic factored tensor
  (one million float32 elements, the thread count of the process) a few times, interleaved, once per
  process; the AVX2 build is used when it takes under 0.97x the native build's time. Elsewhere there is
  nothing to choose and nothing extra is built. The choice is logged (INFO).
* ``GEFEN_DIST_CPU_ISA=native``: the ``-march=native`` build, no measurement (what the tests use, so
  that the AVX-512 path stays under test on hosts that have it).
* ``GEFEN_DIST_CPU_ISA=avx2``: the AVX2 build, no measurement.

Results do not depend on the choice (bitwise equal builds: ``tests/test_cpu_build.py``), so ranks of one
job may choose differently. The one-byte layout's step (``second_moment="nibbles"``) always takes the
native build, which was the faster one for it where the two differ.
"""
from __future__ import annotations

import logging
import os
import threading
import time
from typing import Dict, Optional, Tuple

logger = logging.getLogger(__name__)

ENV = "GEFEN_DIST_CPU_ISA"
CHOICES = ("auto", "native", "avx2")
NATIVE = "gefen_step"  # -march=native
AVX2 = "gefen_step_avx2"  # -march=native -mno-avx512f: the AVX2 path on an AVX-512 host
AVX2_FLAGS = ("-mno-avx512f",)
_MARGIN = 0.97  # the AVX2 build must be at least 3% faster to be taken (the native build is the tested default)

_lock = threading.Lock()
_state: Dict[str, Optional[str]] = {"name": None, "trying": None}
_timings: Dict[str, float] = {}


def setting() -> str:
    """The value of :data:`ENV` (``auto`` when unset); a value outside :data:`CHOICES` raises."""
    v = (os.environ.get(ENV) or "auto").strip().lower()
    if v not in CHOICES:
        raise ValueError(f"{ENV}={os.environ.get(ENV)!r} is not one of {', '.join(CHOICES)}: unset it (auto: the "
                         f"faster build on this CPU, measured once per process) or name the build")
    return v


def build_name() -> str:
    """The name of the build the CPU kernels use in this process (decided on first use)."""
    trying = _state["trying"]
    if trying is not None:  # inside the measurement: the build being timed
        return trying
    name = _state["name"]
    if name is None:
        with _lock:
            if _state["name"] is None:
                _state["name"] = _decide()
            name = _state["name"]
    return name


def reset() -> None:
    """Forget the choice (the next kernel call decides again, reading :data:`ENV`); for tests."""
    with _lock:
        _state["name"] = None
        _timings.clear()


def timings() -> Dict[str, float]:
    """The seconds per step each build took in this process's measurement (empty when none ran)."""
    return dict(_timings)


def _decide() -> str:
    from . import cpu

    v = setting()
    if v == "native":
        return NATIVE
    if v == "avx2":
        if cpu._load(AVX2) is None:
            logger.warning("gefen_dist: %s=avx2 but the AVX2 build could not be made or loaded; using the native "
                           "build", ENV)
            return NATIVE
        return AVX2
    lib = cpu._load(NATIVE)
    if lib is None or lib.gefen_step_simd() != 1:
        return NATIVE  # no AVX-512 path compiled in: the native build is the AVX2 (or portable) one already
    alt = cpu._load(AVX2)
    if alt is None or alt.gefen_step_simd() != 2:
        logger.info("gefen_dist: no AVX2 build of the step kernel beside the AVX-512 one; using the latter")
        return NATIVE
    try:
        t_native, t_avx2 = _measure()
    except Exception as e:  # noqa: BLE001 (a failed measurement must not fail the step: the native build is correct)
        logger.warning("gefen_dist: timing the two CPU step builds failed (%s: %s); using the AVX-512 build",
                       type(e).__name__, e)
        return NATIVE
    name = AVX2 if t_avx2 < _MARGIN * t_native else NATIVE
    logger.info("gefen_dist: CPU step kernel: the %s build (a factored step of 1M elements: AVX-512 %.2f ms, "
                "AVX2 %.2f ms; set %s=native or avx2 to fix the choice)",
                "AVX2" if name == AVX2 else "AVX-512", 1e3 * t_native, 1e3 * t_avx2, ENV)
    return name


def _measure(rounds: int = 5) -> Tuple[float, float]:
    """Seconds per factored step of a synthetic (512, 2048) float32 tensor with each build: the
    minimum over ``rounds`` interleaved calls after one warm-up call each."""
    import torch

    from . import cpu

    rows, cols, block = 512, 2048, 256
    gen = torch.Generator().manual_seed(0)
    grad = torch.randn(rows, cols, generator=gen).mul_(1e-3).reshape(-1)
    cms = grad.view(rows, cols).square().mean(dim=0)
    codebook = torch.linspace(-1.0, 1.0, 256)
    state = {}
    for name in (NATIVE, AVX2):
        state[name] = (torch.randn(rows * cols, generator=gen).mul_(0.02), torch.full((rows * cols,), 127, dtype=torch.uint8),
                       torch.zeros(rows * cols // block), torch.zeros(rows, 1), torch.zeros(cols))
    best = {NATIVE: float("inf"), AVX2: float("inf")}
    try:
        for r in range(rounds + 1):
            for name in (NATIVE, AVX2):
                _state["trying"] = name
                p, idx, sc, vr, vc = state[name]
                t0 = time.perf_counter()
                cpu.quantized_step_factored_(p, grad, idx, sc, vr, vc, codebook, cms, lr=1e-3, beta1=0.9, beta2=0.95,
                                             eps=1e-8, weight_decay=0.0, bc1=1.0, bc2=1.0, scale_block=block)
                if r:  # the first round warms the tables and the caches
                    best[name] = min(best[name], time.perf_counter() - t0)
    finally:
        _state["trying"] = None
    _timings.update({"native": best[NATIVE], "avx2": best[AVX2]})
    return best[NATIVE], best[AVX2]
