"""The CPU step kernel's two builds (gefen_dist/kernels/cpu_build.py): the AVX2 build steps a model bitwise
like the -march=native one (on an AVX-512 host: the other intrinsics path), the measured choice, the
one-byte layout pinned to the native build, and a bad GEFEN_DIST_CPU_ISA refused before anything changes."""
import pytest
import torch
from torch import nn

from gefen_dist import Gefen
from gefen_dist.kernels import cpu, cpu_build

pytestmark = pytest.mark.skipif(not cpu.available(), reason="no native library (no C compiler)")


@pytest.fixture
def isa(monkeypatch):
    """Set GEFEN_DIST_CPU_ISA and forget the process's choice; restored (and forgotten again) after."""
    def set_(value):
        monkeypatch.setenv(cpu_build.ENV, value)
        cpu_build.reset()
    yield set_
    monkeypatch.undo()
    cpu_build.reset()


def _train(second_moment="factored", steps=4):
    """A few steps of a model with factored, span (narrow rows), bfloat16 and shared tensors (the CPU
    batch and the per-tensor kernels); its parameters and state afterwards."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 64))
    narrow = nn.Parameter(torch.randn(2048, 8) * 0.02)
    bf = nn.Parameter((torch.randn(128, 64) * 0.02).bfloat16())
    sh = nn.Parameter(torch.randn(96, 128) * 0.02)
    groups = [{"params": list(model.parameters()) + [narrow, bf]}]
    if second_moment == "factored":
        groups.append({"params": [sh], "second_moment": "shared"})
    else:
        groups[0]["params"].append(sh)
    opt = Gefen(groups, lr=1e-3, second_moment=second_moment)
    g = torch.Generator().manual_seed(1)
    params = [p for grp in groups for p in grp["params"]]
    for _ in range(steps):
        x = torch.randn(32, 64, generator=g)
        loss = model(x).square().mean() + narrow.sum(1).square().mean() + bf.float().square().sum() + sh.pow(3).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
    state = [{k: v.clone() for k, v in opt.state[p].items() if torch.is_tensor(v)} for p in params]
    return [p.detach().clone() for p in params], state


def _same(a, b):
    (pa, sa), (pb, sb) = a, b
    for x, y in zip(pa, pb):
        assert torch.equal(x.view(torch.uint8) if x.dtype == torch.bfloat16 else x,
                           y.view(torch.uint8) if y.dtype == torch.bfloat16 else y)
    for x, y in zip(sa, sb):
        assert x.keys() == y.keys()
        for k in x:
            assert torch.equal(x[k], y[k]), k


def test_avx2_build_steps_bitwise_like_the_native_build(isa):
    isa("native")
    ref = _train()
    assert cpu._lib() is cpu._load(cpu_build.NATIVE)
    isa("avx2")
    got = _train()
    lib = cpu._lib()
    assert lib is cpu._load(cpu_build.AVX2) and lib is not cpu._load(cpu_build.NATIVE)
    if cpu._load(cpu_build.NATIVE).gefen_step_simd() == 1:  # two intrinsics paths compared, not one build with itself
        assert lib.gefen_step_simd() == 2
    _same(ref, got)


def test_auto_measures_where_there_is_a_choice(isa):
    isa("auto")
    name = cpu_build.build_name()
    t = cpu_build.timings()
    if cpu._load(cpu_build.NATIVE).gefen_step_simd() == 1:
        assert name in (cpu_build.NATIVE, cpu_build.AVX2) and set(t) == {"native", "avx2"}
        assert all(0 < s < 1.0 for s in t.values())
        assert (name == cpu_build.AVX2) == (t["avx2"] < cpu_build._MARGIN * t["native"])
    else:  # no AVX-512 path compiled: nothing to choose, nothing measured or built
        assert name == cpu_build.NATIVE and t == {}
    assert cpu._lib() is cpu._load(name)


def test_a_failed_measurement_falls_back_to_the_native_build(isa, monkeypatch, caplog):
    if cpu._load(cpu_build.NATIVE).gefen_step_simd() != 1:
        pytest.skip("no AVX-512 path: nothing is measured")

    def boom(*a, **k):
        raise MemoryError("no room for the synthetic tensors")
    monkeypatch.setattr(cpu_build, "_measure", boom)
    isa("auto")
    assert cpu_build.build_name() == cpu_build.NATIVE
    assert "timing the two CPU step builds failed (MemoryError" in caplog.text


def test_nibbles_takes_the_native_build(isa, monkeypatch):
    isa("native")
    ref = _train("nibbles", steps=3)
    isa("avx2")
    seen = []
    real = cpu._load
    monkeypatch.setattr(cpu, "_load", lambda name: seen.append(name) or real(name))
    got = _train("nibbles", steps=3)
    assert cpu_build.NATIVE in seen  # the one-byte step's rows
    _same(ref, got)


def test_bad_setting_raises_before_anything_changes(isa):
    torch.manual_seed(0)
    lin = nn.Linear(128, 64)
    opt = Gefen(lin.parameters(), lr=1e-3)
    lin(torch.randn(4, 128)).sum().backward()
    before = [p.detach().clone() for p in lin.parameters()]
    isa("avx512")
    with pytest.raises(ValueError, match=r"GEFEN_DIST_CPU_ISA='avx512' is not one of auto, native, avx2"):
        opt.step()
    assert all(torch.equal(a, p) for a, p in zip(before, lin.parameters()))
    assert not opt.state or all(not s for s in opt.state.values())
    isa("native")
    opt.step()  # the same step goes through once the setting is fixed
    assert any(not torch.equal(a, p) for a, p in zip(before, lin.parameters()))
