"""Fused kernels: a native CPU kernel (C + OpenMP, built on first use) and a Triton GPU kernel.

Pure math like :mod:`gefen_dist.core`; no ``torch.distributed``.
"""

from typing import Dict, Optional


def build_native() -> Dict[str, Optional[str]]:
    """Compile every native CPU library now (or find it in ``$GEFEN_DIST_CACHE``), so that a job's
    first step does not (``gefen-dist build-kernels``; ``scripts/setup.sh`` runs it). Returns each
    library's name and path, ``None`` where it could not be built (no C compiler, or
    ``GEFEN_DIST_NO_NATIVE=1``: the eager path then runs, as the log says)."""
    from . import cpu, cpu_build, dp, first_step

    out: Dict[str, Optional[str]] = {}
    for name, load in (("gefen_step", lambda: cpu._lib(cpu_build.NATIVE)), ("gefen_dp", dp._lib),
                       ("gefen_first_step", first_step._lib)):
        lib = load()
        out[name] = None if lib is None else str(lib._name)
    if out["gefen_step"] is not None and cpu_build.build_name() != cpu_build.NATIVE:
        # the step kernel's AVX2 build, where this process chose it (kernels/cpu_build.py)
        lib = cpu._lib()
        out[cpu_build.AVX2] = None if lib is None else str(lib._name)
    return out
