"""Tests of the research scripts' timing-only kernel builds (not collected by CI: run
``python -m pytest research/tests``)."""
import os

import pytest
import torch

from gefen_dist.kernels import cpu

from test_fused_cpu import dp_codebook  # noqa: E402  (tests/ on sys.path: research/tests/conftest.py)


def test_timing_patch_applies_to_the_production_source(tmp_path):
    """The patch still applies to the production kernel, and the production kernel has no timing
    switches of its own."""
    import importlib.util
    from pathlib import Path

    from gefen_dist.kernels import native

    prod = (native.CSRC / "gefen_step.c").read_text()
    assert "GEFEN_ABLATE" not in prod and "GEFEN_COLACC" not in prod
    path = Path(__file__).resolve().parents[1] / "kernel_breakdown.py"
    spec = importlib.util.spec_from_file_location("kernel_breakdown", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    patched = mod.patched_source(tmp_path).read_text()
    assert "#define GEFEN_ABLATE 0" in patched and "#define GEFEN_COLACC 0" in patched


def test_kernel_breakdown_builds(tmp_path):
    """research/kernel_breakdown.py's timing-only builds (the production source with
    research/patches/timing_builds.patch applied) really leave their stage out (the step differs),
    so the costs the script reports are those of the stages it names; and research/lagcol_speed.py's
    ``GEFEN_COLACC`` build, which only adds work, steps bitwise as the library does."""
    import importlib.util
    from pathlib import Path

    if cpu.simd_isa() != "avx512vbmi":
        pytest.skip("no AVX-512 VBMI on this CPU: the ablated stages are not compiled here")
    path = Path(__file__).resolve().parents[1] / "kernel_breakdown.py"
    spec = importlib.util.spec_from_file_location("kernel_breakdown", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    from gefen_dist.kernels import native

    rows, S, B = 12, 256, 128
    n = rows * S
    gen = torch.Generator().manual_seed(5)
    g = torch.randn(n, generator=gen) * 1e-3
    p0 = torch.randn(n, generator=gen) * 0.02
    idx0 = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=gen)
    sc0 = torch.rand(n // B, generator=gen) * 1e-3
    vr0, vc0 = torch.rand(rows, generator=gen) * 1e-6, torch.rand(1, S, generator=gen) * 1e-6
    cm = torch.rand(1, S, generator=gen) * 1e-6
    cb = dp_codebook()
    hp = dict(lr=1e-3, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1, bc1=0.1, bc2=0.05)

    def step():
        st = [t.clone() for t in (p0, idx0, sc0, vr0, vc0)]
        cpu.quantized_step_factored_(st[0], g, st[1], st[2], st[3], st[4], cb, cm, scale_block=B, **hp)
        return st

    want = step()
    # research/lagcol_speed.py's build too: the column sums it adds are discarded, its step is the library's
    spec = importlib.util.spec_from_file_location("lagcol_speed", path.parent / "lagcol_speed.py")
    lag = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(lag)
    # the single-stage builds (no_nearest = no_table + no_candidates is not rebuilt here), compiled in parallel
    # (~16 s of CPU each); GEFEN_ABLATE=0 is exactly the library's build, tested everywhere else
    single = {name: bits for name, (bits, _) in mod.BUILDS.items() if bits and bits & (bits - 1) == 0}
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max_workers=max(1, os.cpu_count() or 1)) as ex:
        futs = {name: ex.submit(mod.build, bits, tmp_path) for name, bits in single.items()}
        futs["colacc"] = ex.submit(lag.build_colacc, tmp_path)
        libs = {name: f.result() for name, f in futs.items()}
    saved = native._cache.get(cpu._LIB_NAME)
    try:
        for name, lib in libs.items():
            mod.use(lib)
            same = all(torch.equal(a, b) for a, b in zip(step(), want))
            assert same == (name == "colacc"), name
    finally:
        native._cache[cpu._LIB_NAME] = saved


