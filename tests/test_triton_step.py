"""The Triton step kernel (gefen_dist.kernels.triton_step) against the eager reference.

The checks run on CPU tensors through the Triton interpreter, so shapes are small.
TRITON_INTERPRET must be set before triton is first imported (triton's standard library is
jit-compiled at import), and other modules of a test session (deepspeed) import triton
early; so ``test_interpreter_suite`` re-runs this file in a subprocess with
TRITON_INTERPRET=1, where the ``interp`` tests run. On a CUDA machine
``test_cuda_matches_eager`` also runs the compiled kernel in-process.

Agreement contract (see the module docstring of gefen_dist.kernels.triton_step):
* idx and scale bitwise equal to quantized_step_eager_ (m never depends on v);
* v within a few float32 ulp (mean(g^2) summed in another order);
* float32 parameters within rtol 1e-6 (atol 1e-6 * max|p|): sigma may differ by one ulp;
* bfloat16 parameters: that ulp flips the single float32 -> bf16 rounding for a tiny
  fraction of elements, by one bf16 ulp.
"""
from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
import torch

_CHILD_ENV = "_GEFEN_TRITON_INTERP_CHILD"
_CHILD = os.environ.get(_CHILD_ENV) == "1"
if _CHILD:
    os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported

pytest.importorskip("triton", reason="triton is not installed")

from gefen_dist.core.quant import nearest_codeword  # noqa: E402
from gefen_dist.core.step import bias_corrections, quantized_step_eager_  # noqa: E402
from gefen_dist.kernels import triton_step  # noqa: E402

interp = pytest.mark.skipif(not _CHILD, reason="runs in the TRITON_INTERPRET=1 subprocess "
                                               "(test_interpreter_suite)")


@pytest.mark.skipif(_CHILD, reason="this is the subprocess")
def test_interpreter_suite():
    """Run the ``interp`` tests of this file in a fresh interpreter with TRITON_INTERPRET=1."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, TRITON_INTERPRET="1", **{_CHILD_ENV: "1"})
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "addopts=",
           os.path.abspath(__file__)]
    t0 = time.time()
    r = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=600)
    out = r.stdout + r.stderr
    assert r.returncode == 0, f"interpreter suite failed (rc {r.returncode}):\n{out[-6000:]}"
    last = [ln for ln in out.splitlines() if ln.strip()][-1]
    assert " passed" in last, last
    print(f"interpreter suite: {last} ({time.time() - t0:.1f} s)")


# --------------------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------------------

def _pinned(inner: torch.Tensor) -> torch.Tensor:
    inner = torch.unique(inner.float().clamp(-0.999999, 0.999999))
    assert inner.numel() == 254
    return torch.cat([torch.tensor([-1.0]), inner, torch.tensor([1.0])])


def random_codebook(seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return _pinned(torch.rand(254, generator=g) * 2 - 1)


def dense_codebook() -> torch.Tensor:
    """Codewords 1e-6 apart near 0: too dense for a two-candidate table (scan mode)."""
    g = torch.Generator().manual_seed(3)
    outer = torch.rand(224, generator=g) * 2 - 1
    outer = outer[outer.abs() > 1e-3]
    dense = (torch.arange(254 - outer.numel(), dtype=torch.float64) * 1e-6 - 1e-5).float()
    return _pinned(torch.cat([outer, dense]))


def _state(n, P, B, dtype, seed, device="cpu"):
    gen = torch.Generator().manual_seed(seed)
    p = torch.randn(n, generator=gen).to(dtype)
    idx = torch.randint(0, 256, (n,), generator=gen, dtype=torch.uint8)
    scale = torch.rand(n // B, generator=gen) * 1e-2
    scale[0] = 0.0  # an all-zero block in the first step
    v = torch.rand(n // P, generator=gen) * 1e-4
    return [t.to(device) for t in (p, idx, scale, v)], gen


def _grad(n, dtype, gen, device="cpu"):
    # magnitudes spread over a few decades, per element
    g = torch.randn(n, generator=gen) * torch.exp(torch.randn(n, generator=gen))
    return (g * 1e-2).to(dtype).to(device)


def _run_both(n, P, B, dtype, *, steps=4, codebook=None, beta1=0.9, beta2=0.999, wd=0.1,
              block_size=None, seed=0, device="cpu", grad_hook=None):
    cb = (random_codebook() if codebook is None else codebook).to(device)
    st, gen = _state(n, P, B, dtype, seed, device)
    ref = [t.clone() for t in st]
    out = [t.clone() for t in st]
    for s in range(1, steps + 1):
        g = _grad(n, dtype, gen, device)
        if grad_hook is not None:
            g = grad_hook(g, s)
        bc1, bc2 = bias_corrections(s, beta1, beta2)
        kw = dict(lr=1e-3, beta1=beta1, beta2=beta2, eps=1e-8, weight_decay=wd, bc1=bc1, bc2=bc2,
                  period=P, scale_block=B)
        quantized_step_eager_(ref[0], g, ref[1], ref[2], ref[3], cb, **kw)
        if block_size is None:
            triton_step.quantized_step_(out[0], g, out[1], out[2], out[3], cb, **kw)
        else:
            triton_step._launch(out[0], g, out[1], out[2], out[3], cb, block_size=block_size, **kw)
    return ref, out


def _assert_agree(ref, out, *, idx_frac=0.0):
    p_r, i_r, s_r, v_r = ref
    p_o, i_o, s_o, v_o = out
    mism = (i_r != i_o).float().mean().item()
    assert mism <= idx_frac, f"idx mismatch fraction {mism}"
    if idx_frac == 0.0:
        assert torch.equal(s_r.view(torch.int32), s_o.view(torch.int32)), "scale not bitwise equal"
    else:
        torch.testing.assert_close(s_o, s_r, rtol=1e-6, atol=0, equal_nan=True)
    torch.testing.assert_close(v_o, v_r, rtol=1e-6, atol=0, equal_nan=True)
    if p_r.dtype == torch.float32:
        scale = torch.nan_to_num(p_r, nan=0.0).abs().max().item()
        torch.testing.assert_close(p_o, p_r, rtol=1e-6, atol=1e-6 * scale, equal_nan=True)
    else:
        diff = (p_o.float() != p_r.float()) & ~(torch.isnan(p_o) & torch.isnan(p_r))
        assert diff.float().mean().item() <= 1e-3 + idx_frac
        a, b = p_r[diff].float(), p_o[diff].float()
        # one bf16 ulp: 2^-7 relative at most
        assert torch.all((a - b).abs() <= a.abs() * 2.0 ** -7), (a, b)


# --------------------------------------------------------------------------------------
# agreement with the eager path
# --------------------------------------------------------------------------------------

CASES = {
    # name: (n, P, B)
    "P1_B256": (256 * 32, 1, 256),
    "P1_B96": (96 * 48, 1, 96),
    "P64": (64 * 128, 64, 64),
    "P96": (96 * 72, 96, 96),
    "P768": (768 * 8, 768, 768),
    "P1031": (1031 * 5, 1031, 1031),
    "P1536": (1536 * 4, 1536, 1536),
}


@interp
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_matches_eager(case, dtype):
    n, P, B = CASES[case]
    ref, out = _run_both(n, P, B, dtype, steps=3)
    _assert_agree(ref, out)


@interp
@pytest.mark.parametrize("P,B,bs", [(96, 96, 32), (1, 256, 64), (1031, 1031, 256)])
def test_multi_chunk(P, B, bs):
    """Blocks longer than one chunk (the column loop with a ragged last chunk)."""
    ref, out = _run_both(B * 24, P, B, torch.float32, steps=2, block_size=bs, seed=5)
    _assert_agree(ref, out)


@interp
def test_large_lerp_weight_no_decay():
    """beta1 < 0.5: torch's lerp takes its other branch; weight_decay == 0 skips the decay."""
    ref, out = _run_both(64 * 64, 64, 64, torch.float32, steps=3, beta1=0.3, wd=0.0, seed=2)
    _assert_agree(ref, out)


@interp
def test_scan_mode_codebook():
    cb = dense_codebook()
    tab = triton_step._device_table(cb, torch.device("cpu"))
    assert not tab.fast and tab.scan_steps >= 1
    ref, out = _run_both(128 * 48, 128, 128, torch.float32, steps=2, codebook=cb, seed=3)
    _assert_agree(ref, out)


@interp
def test_nan_and_zero_blocks():
    def hook(g, s):
        g = g.clone()
        g[64 * 3 + 5] = float("nan")     # block 3: NaN
        g[64 * 7:64 * 8] = 0.0           # block 7: zero gradient
        return g

    for dtype in (torch.float32, torch.bfloat16):
        ref, out = _run_both(64 * 16, 64, 64, dtype, steps=2, grad_hook=hook, seed=4)
        assert torch.isnan(ref[2][3]) and torch.isnan(out[2][3])
        _assert_agree(ref, out)


@interp
@pytest.mark.parametrize("which", ["random", "dense"])
def test_nearest_codeword_exact(which):
    """beta1 = 0 makes m = g; with g = 1 leading every block, z = m / A = g exactly, so idx
    must equal nearest_codeword(g) for hard values: codewords, midpoints and their
    neighbouring floats, +-0, tiny values and NaN (whose block then has A = NaN)."""
    cb = random_codebook(7) if which == "random" else dense_codebook()
    c = cb.double()
    mids = ((c[1:] + c[:-1]) / 2).float()
    vals = torch.cat([cb, mids, torch.nextafter(mids, torch.full_like(mids, 2.0)),
                      torch.nextafter(mids, torch.full_like(mids, -2.0)),
                      torch.nextafter(cb, torch.full_like(cb, 2.0)),
                      torch.nextafter(cb, torch.full_like(cb, -2.0)),
                      torch.rand(2000, generator=torch.Generator().manual_seed(1)) * 2 - 1,
                      torch.tensor([0.0, -0.0, float("nan"), 1e-30, -1e-30])])
    vals = vals.clamp(-1.0, 1.0).where(~torch.isnan(vals), vals)
    B = 64
    per = B - 1
    nblk = -(-vals.numel() // per)
    z = torch.zeros(nblk * per)
    z[:vals.numel()] = vals
    g = torch.cat([torch.ones(nblk, 1), z.view(nblk, per)], dim=1).reshape(-1)
    nan_blocks = torch.isnan(g.view(nblk, B)).any(dim=1)
    n = g.numel()
    p = torch.zeros(n)
    idx = torch.zeros(n, dtype=torch.uint8)
    scale = torch.zeros(nblk)
    v = torch.zeros(nblk)
    triton_step.quantized_step_(p, g, idx, scale, v, cb, lr=1e-3, beta1=0.0, beta2=0.999, eps=1e-8,
                                weight_decay=0.0, bc1=1.0, bc2=1.0, period=B, scale_block=B)
    want = nearest_codeword(g, cb)
    # a block holding NaN has A = NaN and z = 0 throughout (as the eager path)
    want.view(nblk, B)[nan_blocks] = nearest_codeword(torch.zeros(1), cb)
    assert torch.equal(idx, want), int((idx != want).sum())


# --------------------------------------------------------------------------------------
# configuration and argument checks
# --------------------------------------------------------------------------------------

def test_config():
    assert triton_step._config(768, 100) == (8, 256, 4)
    assert triton_step._config(1536, 100)[1] == 512
    assert triton_step._config(3072, 100)[1] == 1024
    assert triton_step._config(64, 1000)[:2] == (32, 64)
    assert triton_step._config(64, 3)[:2] == (4, 64)       # no more rows than needed
    assert triton_step._config(1 << 20, 4)[1] == 2048       # long blocks loop over chunks
    for B in (1, 7, 96, 1031, 4099):
        rows, bs, _ = triton_step._config(B, 10)
        assert bs & (bs - 1) == 0 and rows * bs <= 2048


@interp
def test_available_and_errors():
    assert triton_step.available()
    cb = random_codebook()
    n, B = 256, 64
    st = [torch.zeros(n), torch.zeros(n), torch.zeros(n, dtype=torch.uint8), torch.zeros(n // B),
          torch.zeros(n // B)]
    kw = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0, bc1=0.1, bc2=0.001)
    with pytest.raises(ValueError):
        triton_step.quantized_step_(*st, cb, period=32, scale_block=B, **kw)
    with pytest.raises(ValueError):
        triton_step.quantized_step_(st[0], st[1].double(), *st[2:], cb, period=B, scale_block=B, **kw)
    old = os.environ.pop("TRITON_INTERPRET")
    try:
        if not torch.cuda.is_available():
            assert not triton_step.available()
        assert not triton_step.available("cpu")
        with pytest.raises(ValueError):
            triton_step.quantized_step_(*st, cb, period=B, scale_block=B, **kw)
    finally:
        os.environ["TRITON_INTERPRET"] = old


# --------------------------------------------------------------------------------------
# the compiled kernel (CUDA machines only)
# --------------------------------------------------------------------------------------

@pytest.mark.skipif(_CHILD or not torch.cuda.is_available() or not triton_step.available("cuda"),
                    reason="needs CUDA (compiled kernel)")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("case", ["P1_B256", "P96", "P1031", "P1536"])
def test_cuda_matches_eager(case, dtype):
    n, P, B = CASES[case]
    ref, out = _run_both(n * 16, P, B, dtype, steps=3, device="cuda")
    # torch's CUDA lerp may round differently from the kernel's fma in rare elements
    _assert_agree([t.cpu() for t in ref], [t.cpu() for t in out], idx_frac=1e-4)
