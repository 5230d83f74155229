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

import _span_phases
import numpy as np
import pytest
import torch

_CHILD_ENV = "_GEFEN_TRITON_INTERP_CHILD"
_CHILD = os.environ.get(_CHILD_ENV) == "1"
if _CHILD:
    os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported

pytest.importorskip("triton", reason="triton is not installed")
if _CHILD:
    import _fast_interpreter

    _fast_interpreter.install()  # the interpreter patches triton.language once per launch

from gefen_dist.core.quant import nearest_codeword  # noqa: E402
from gefen_dist.core.step import bias_corrections, hyperparameters, quantized_step_eager_  # noqa: E402
from gefen_dist.kernels import triton_multi, triton_step  # noqa: E402

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
    r = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=1500)
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
@pytest.mark.parametrize("P", [1, None], ids=["elementwise-entries", "shared-distances"])
def test_nearest_at_every_flip_point(P):
    """z exactly at each codeword pair's flip point (core.quant.flip_points) and one float below it
    (beta1 = 0: m = g; the block's absmax 1: z = m): the kernel's indices are the reference's, with
    the per-bucket entries (mode 1: z >= flip point) and with the distance comparison (mode 0)."""
    from gefen_dist.core.quant import flip_points

    cb = random_codebook()
    thr = flip_points(cb).numpy()
    thr = thr[np.isfinite(thr) & (np.abs(thr) < 1)]
    z = np.concatenate([thr, np.nextafter(thr, np.float32(-2)), np.float32([1.0, -1.0, 0.0])]).astype(np.float32)
    n = z.size + (-z.size) % 64
    g = torch.zeros(n)
    g[: z.size] = torch.from_numpy(z)
    P = n if P is None else P
    kw = dict(lr=1e-3, beta1=0.0, beta2=0.999, eps=1e-8, weight_decay=0.0, bc1=1.0, bc2=1e-3,
              period=P, scale_block=n)
    p, idx, sc, v = (torch.zeros(n), torch.zeros(n, dtype=torch.uint8), torch.zeros(1), torch.zeros(n // P))
    triton_step.quantized_step_(p, g, idx, sc, v, cb, **kw)
    assert float(sc[0]) == 1.0
    assert torch.equal(idx[: z.size], nearest_codeword(torch.from_numpy(z), cb))


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
# the factored second moment (second_moment="factored", the default; D12 row blocks)
# --------------------------------------------------------------------------------------

def _factored_state(rows, S, B, G, dtype, seed, device="cpu"):
    gen = torch.Generator().manual_seed(seed)
    n = rows * S
    p = torch.randn(n, generator=gen).to(dtype)
    idx = torch.randint(0, 256, (n,), generator=gen, dtype=torch.uint8)
    scale = torch.rand(n // B, generator=gen) * 1e-2
    scale[1] = 0.0
    v_row = torch.rand(rows, generator=gen) * 1e-4
    v_col = (torch.rand(G, S, generator=gen) * 1e-4).squeeze(0) if G > 1 else torch.rand(S, generator=gen) * 1e-4
    return [t.to(device) for t in (p, idx, scale, v_row, v_col)], gen


def _run_both_factored(rows, S, B, dtype, *, G=1, row0=0, row_block=0, steps=3, seed=0, device="cpu",
                       block_size=None, grad_hook=None, col_blocks=1):
    """A piece of ``rows`` rows (global rows ``row0 ..``) of a factored tensor stepped by the eager
    path and the kernel; col_mean_sq is a made-up column statistic (the kernel takes it as given).
    ``col_blocks``: a ``v_row`` of that many columns (D21)."""
    from gefen_dist.core.step import quantized_step_factored_eager_

    cb = random_codebook().to(device)
    st, gen = _factored_state(rows, S, B, G, dtype, seed, device)
    if col_blocks > 1:
        st[3] = (torch.rand(rows, col_blocks, generator=gen) * 1e-4).to(device)
    ref = [t.clone() for t in st]
    out = [t.clone() for t in st]
    for s in range(1, steps + 1):
        g = _grad(rows * S, dtype, gen, device)
        if grad_hook is not None:
            g = grad_hook(g, s)
        cms = (torch.rand(st[4].shape, generator=gen) * 1e-4).to(device)
        bc1, bc2 = bias_corrections(s, 0.9, 0.95)
        kw = dict(lr=1e-3, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1, bc1=bc1, bc2=bc2,
                  scale_block=B, row0=row0, row_block=row_block)
        quantized_step_factored_eager_(ref[0], g, ref[1], ref[2], ref[3], ref[4], cb, cms, **kw)
        triton_step.quantized_step_factored_(out[0], g, out[1], out[2], out[3], out[4], cb, cms,
                                             block_size=block_size, **kw)
    return ref, out


def _assert_agree_factored(ref, out, idx_frac=0.0):
    # v_col: the same torch operations on both sides
    assert torch.equal(ref[4], out[4])
    _assert_agree(ref[:4], out[:4], idx_frac=idx_frac)


FACTORED_CASES = {
    # name: (rows, S, B, G, row0, row_block)
    "one_profile": (24, 96, 96, 1, 0, 0),
    "two_scale_blocks": (16, 192, 96, 1, 0, 0),
    "row_blocks": (40, 64, 64, 4, 0, 10),
    "row_blocks_cut_piece": (23, 96, 32, 3, 7, 12),   # global rows 7..29 of 3 x 12: cuts blocks 0 and 2
    "ragged_chunks": (9, 1031, 1031, 1, 0, 0),
}


@interp
def test_column_factors_match_core():
    """ColumnFactors (one launch for many tensors' ``sqrt(v_col / mean(v_col))``, per row block)
    against core.step.column_factors: within a few float32 ulps (the mean is summed in another order,
    which torch's vectorisation also changes with the CPU: up to ~log2(n) ulps of the mean, halved by
    the square root, plus the rounding of the division and the root: 6e-7 relative for these n),
    exactly 0 for a profile whose mean is 0 or NaN (as the core); the views keep their storage across
    runs (the update kernels hold their pointers)."""
    from gefen_dist.core.step import column_factors

    gen = torch.Generator().manual_seed(7)
    v_cols = [torch.rand(96, generator=gen) * 1e-4, torch.rand(3, 1031, generator=gen) * 1e-3,
              torch.zeros(2, 64), torch.rand(2048 + 5, generator=gen)]
    v_cols[2][1] = torch.rand(64, generator=gen)  # block 0 all zero, block 1 not
    nan = torch.rand(40, generator=gen)
    nan[3] = float("nan")
    v_cols.append(nan)
    cfs = triton_step.ColumnFactors(v_cols, torch.device("cpu"))
    ptrs = [v.data_ptr() for v in cfs.views]
    for rnd in range(2):
        out = cfs.run()
        assert [v.data_ptr() for v in out] == ptrs
        for v, got in zip(v_cols, out):
            ref = column_factors(v)
            assert got.shape == v.shape
            torch.testing.assert_close(got, ref, rtol=6e-7, atol=0, equal_nan=True)
        assert torch.equal(out[2][0], torch.zeros(64)) and bool((out[2][1] > 0).all())
        assert torch.equal(out[4], torch.zeros(40))  # a NaN mean is not positive: 0, as the core's
        for v in v_cols:
            v.mul_(0.5)  # the next run reads the tensors as they are then
    with pytest.raises(ValueError, match="contiguous float32"):
        triton_step.ColumnFactors([torch.zeros(4, 8).t()], torch.device("cpu"))


@interp
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("case", sorted(FACTORED_CASES))
def test_factored_matches_eager(case, dtype):
    rows, S, B, G, row0, rb = FACTORED_CASES[case]
    ref, out = _run_both_factored(rows, S, B, dtype, G=G, row0=row0, row_block=rb)
    _assert_agree_factored(ref, out)


@interp
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("rows,S,B,K,bs", [(24, 192, 64, 3, None), (9, 300, 50, 3, 32), (6, 192, 24, 8, 16)],
                         ids=["k3", "k3_tails", "k8_chunks"])
def test_factored_column_blocks_match_eager(rows, S, B, K, bs, dtype):
    """Column blocks (D21): ``v_row`` per block of ``S / K`` columns from each block's mean of ``g^2``, each
    scale block with its block's, the column factors per block; chunks that do not divide a block."""
    ref, out = _run_both_factored(rows, S, B, dtype, col_blocks=K, block_size=bs, seed=4)
    assert tuple(out[3].shape) == (rows, K)
    _assert_agree_factored(ref, out)
    with pytest.raises(ValueError, match="column blocks"):  # a scale block across two column blocks
        _run_both_factored(6, 192, 96, torch.float32, col_blocks=4, steps=1)


@interp
def test_factored_small_chunks_nan_and_zero():
    """Several chunks per scale block, a NaN gradient (its row and block) and a zero row."""
    def hook(g, s):
        g = g.clone()
        g[96 * 2 + 40] = float("nan")
        g[96 * 5:96 * 6] = 0.0
        return g

    ref, out = _run_both_factored(12, 96, 48, torch.float32, G=2, row_block=6, block_size=16,
                                  grad_hook=hook, seed=3)
    assert torch.isnan(ref[2][4]) and torch.isnan(out[2][4]) and torch.isnan(out[3][2])
    _assert_agree_factored(ref, out)


@interp
@pytest.mark.parametrize("second_moment", ["factored", "shared"])
def test_optimizer_cuda_path_through_interpreter(monkeypatch, second_moment):
    """Gefen's CUDA code path (Triton kernels, foreach exact tensors, device-side column sums),
    forced onto CPU tensors through the interpreter, against the eager path: same periods,
    codebook and scales, parameters within the kernel's tolerance after 6 steps."""
    from torch import nn

    from gefen_dist import Gefen

    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(32, 96), nn.GELU(), nn.Linear(96, 192), nn.GELU(), nn.Linear(192, 8))
    a, b = [__import__("copy").deepcopy(base) for _ in range(2)]
    hp = dict(lr=1e-3, weight_decay=0.1, second_moment=second_moment)
    oa = Gefen(a.parameters(), fused=False, **hp)
    ob = Gefen(b.parameters(), **hp)
    from gefen_dist.kernels import dispatch

    monkeypatch.setattr(ob, "_impl", lambda t, p=None, group=None: dispatch._triton())
    monkeypatch.setattr(ob, "_foreach_exact", lambda p, group=None: "exp_avg" in ob.state.get(p, {}))
    gen = torch.Generator().manual_seed(1)
    for _ in range(6):
        x, y = torch.randn(16, 32, generator=gen), torch.randn(16, 8, generator=gen)
        oa.zero_grad()
        ((a(x) - y) ** 2).mean().backward()
        for p, q in zip(a.parameters(), b.parameters()):
            q.grad = p.grad.clone()  # the same gradients on both sides
        oa.step()
        ob.step()
    assert torch.equal(oa.codebook, ob.codebook)
    kinds = set()
    for p, q in zip(a.parameters(), b.parameters()):
        sa, sb = oa.state[p], ob.state[q]
        kinds.add("exp_avg" in sa)
        assert sa.get("period") == sb.get("period")
        if "scale" in sa:
            torch.testing.assert_close(sb["scale"], sa["scale"], rtol=1e-5, atol=1e-9)
        torch.testing.assert_close(q.detach(), p.detach(), rtol=1e-6, atol=1e-6 * p.abs().max().item())
    assert kinds == {True, False}  # both exact and quantized tensors took part


@interp
def test_optimizer_column_blocks_through_interpreter(monkeypatch, caplog):
    """Gefen(col_blocks="auto") with the Triton kernels (the per-tensor path, beside nothing) against the eager
    path: a (64, 192) weight in three column blocks (D21) keeps v_row [64, 3] on both, no eager fallback is
    logged, and the parameters agree within the kernel's tolerance after 5 steps."""
    import logging

    from torch import nn

    from gefen_dist import Gefen
    from gefen_dist.kernels import dispatch

    torch.manual_seed(2)
    a = nn.Parameter(torch.randn(64, 192) * 0.1)
    b = nn.Parameter(a.detach().clone())
    oa = Gefen([a], lr=1e-3, col_blocks="auto", fused=False)
    ob = Gefen([b], lr=1e-3, col_blocks="auto")
    monkeypatch.setattr(ob, "_impl", lambda t, p=None, group=None: dispatch._triton())
    gen = torch.Generator().manual_seed(3)
    with caplog.at_level(logging.INFO, logger="gefen_dist.engine.tensor_step"):
        for _ in range(5):
            g = torch.randn(64, 192, generator=gen) * (1 + torch.arange(192) // 64).float()
            a.grad, b.grad = g.clone(), g.clone()
            oa.step()
            ob.step()
    assert not any("column blocks" in r.getMessage() for r in caplog.records)
    assert tuple(ob.state[b]["v_row"].shape) == (64, 3) and torch.equal(oa.codebook, ob.codebook)
    torch.testing.assert_close(ob.state[b]["v_row"], oa.state[a]["v_row"], rtol=1e-5, atol=0)
    torch.testing.assert_close(b.detach(), a.detach(), rtol=1e-6, atol=1e-6 * a.abs().max().item())


@interp
def test_optimizer_span_tensors_through_interpreter_equal_the_eager_path(monkeypatch):
    """narrow_rows="span" (D16) tensors on Gefen's CUDA code path (the Triton span kernels), through
    the interpreter, against Gefen with fused=False: parameters and state bitwise after 5 steps (a
    (5000, 3) tensor of sparse rows, blocks of 342 rows; a float32 and a bfloat16 copy); and
    narrow_rows="rows8" (D19: the span kernels with blocks of one row, the row codes between the
    phases) on a (120, 40) tensor, 3 steps."""
    from gefen_dist import Gefen
    from gefen_dist.kernels import dispatch

    for dtype, setting, (N, S), steps in ((torch.float32, "span", (5000, 3), 5), (torch.bfloat16, "span", (5000, 3), 5),
                                          (torch.float32, "rows8", (120, 40), 3),
                                          (torch.bfloat16, "rows8", (120, 40), 3)):
        gen = torch.Generator().manual_seed(3)
        w0 = (torch.randn(N, S, generator=gen) * 0.1).to(dtype)
        a, b = torch.nn.Parameter(w0.clone()), torch.nn.Parameter(w0.clone())
        oa = Gefen([a], lr=1e-3, weight_decay=0.1, narrow_rows=setting, fused=False)
        ob = Gefen([b], lr=1e-3, weight_decay=0.1, narrow_rows=setting)
        monkeypatch.setattr(ob, "_impl", lambda t, p=None, group=None: dispatch._triton())
        for _ in range(steps):
            g = torch.zeros(N, S)
            rows = torch.randint(0, N, (N // 12,), generator=gen)
            g[rows] = torch.randn(N // 12, S, generator=gen)
            a.grad, b.grad = g.to(dtype), g.to(dtype)
            oa.step()
            ob.step()
        assert ob._mode(b) == setting
        assert torch.equal(a, b), dtype
        for k, v in oa.state[a].items():
            if isinstance(v, torch.Tensor):
                assert torch.equal(v, ob.state[b][k]), (dtype, k)


@interp
def test_zerogefen_on_the_triton_path_equals_gefen(monkeypatch):
    """ZeroGefen with the Triton kernels (CUDA's implementation, through the interpreter): the owners'
    state-only updates and the appliers of kernels/triton_state.py give single-process Gefen's Triton
    parameters and state bitwise after 4 steps, for a factored group (row blocks: a (128, 64) weight
    of two 64-row blocks; a bfloat16 (512, 8) tensor that travels dense), a shared group, a span group,
    a rows8 group (D19: a (60, 70) weight, rows of 70 in one-byte codes) and exact tensors; the
    state-only steps in chunks of a few rows or blocks."""
    from torch import nn

    from gefen_dist import Gefen, ZeroGefen
    from gefen_dist.kernels import dispatch

    def build():
        torch.manual_seed(0)
        m = nn.ModuleDict(dict(a=nn.Linear(64, 128), b=nn.Linear(128, 96), e=nn.Linear(96, 16)))
        m.c = nn.Parameter((torch.randn(512, 8) * 0.05).to(torch.bfloat16))
        m.s = nn.Parameter(torch.randn(3000, 4) * 0.05)
        m.r = nn.Parameter(torch.randn(60, 70) * 0.05)
        return m

    def groups(m):
        return [{"params": [m.a.weight, m.c], "second_moment": "factored", "narrow_rows": "rows"},  # c per row
                {"params": [m.b.weight], "weight_decay": 0.0, "second_moment": "shared"},
                {"params": [m.s], "narrow_rows": "span"},
                {"params": [m.r], "narrow_rows": "rows8"},
                {"params": [m.a.bias, m.b.bias, m.e.weight, m.e.bias]}]

    def loss(m, x, w):
        h = torch.tanh(m.a(x))
        out = m.e(torch.tanh(m.b(h))) + h.repeat(1, 4) @ m.c.float()[:, :1]
        return ((out - torch.tanh(x @ w)) ** 2).mean() + (m.s[torch.arange(0, 3000, 7)] ** 2).sum() * 1e-3 \
            + (torch.tanh(x[:, :60] @ m.r) ** 2).mean()

    from gefen_dist.kernels import triton_state

    monkeypatch.setattr(triton_state, "_SCRATCH_ELEMS", 300)  # the owners' state-only steps in chunks of rows
    a, b = build(), build()
    oa = Gefen(groups(a), lr=1e-2, weight_decay=0.1)
    ob = ZeroGefen(groups(b), lr=1e-2, weight_decay=0.1)
    for o in (oa, ob):
        monkeypatch.setattr(o, "_impl", lambda t, p=None, group=None: dispatch._triton())
    monkeypatch.setattr(oa, "_foreach_exact", lambda p, group=None: "exp_avg" in oa.state.get(p, {}))
    g = torch.Generator().manual_seed(1)
    w = torch.randn(64, 16, generator=g)
    for _ in range(4):
        x = torch.randn(32, 64, generator=g)
        for m, o in ((a, oa), (b, ob)):
            o.zero_grad()
            loss(m, x, w).backward()
            o.step()
    assert ob._mode(b.s) == "span" and ob._mode(b.b.weight) == "shared" and ob._mode(b.a.weight) == "factored"
    assert ob._mode(b.r) == "rows8" and "v_code" in ob.state[b.r]
    batch = ob._zero_batch  # the batched phases (zero/batch.py) took steps 2-4: the owners' state in StateMany
    assert batch is not None and len(batch.fact) == 2 and {L["mode"] for _, sm in batch._states
                                                           for L in sm.multi._launches} == {0, 2}
    many = ob._apply_cache[3]  # the factored and compressed ranges went through one launch per mode
    assert many is not None and {L["mode"] for L in many._launches} == {0, 2}
    for (name, p), q in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(p, q), name
        for k, v in oa.state[p].items():
            if isinstance(v, torch.Tensor) and k in ob.state[q]:  # ZeroGefen keeps flat slices
                assert torch.equal(v.reshape(-1), ob.state[q][k].reshape(-1)), (name, k)


@interp
def test_zerogefen_batch_checks_and_fallback(monkeypatch, caplog):
    """ZeroGefen's batched phases on the Triton path (zero/batch.py) keep the per-tensor path's
    guarantees: a NaN gradient skips the step ("skip") or raises naming the tensor ("raise") with
    nothing changed, a squared gradient that overflows float32 raises before anything changes, and a
    non-contiguous gradient sends that step to the per-tensor path (INFO once, the same results as a
    ZeroGefen that never batches)."""
    import logging

    from torch import nn

    from gefen_dist import ZeroGefen
    from gefen_dist.kernels import dispatch
    from gefen_dist.zero import batch as zbatch

    def build():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(64, 96), nn.Tanh(), nn.Linear(96, 128), nn.Tanh(), nn.Linear(128, 8))

    def run(nonfinite):
        m = build()
        o = ZeroGefen(m.named_parameters(), lr=1e-2, weight_decay=0.1, nonfinite=nonfinite)
        o._impl = lambda t, p=None, group=None: dispatch._triton()
        return m, o

    def grads(m, seed):
        g = torch.Generator().manual_seed(seed)
        for q in m.parameters():
            q.grad = torch.randn(q.shape, generator=g) * 1e-2

    def snap(m, o):
        return [q.detach().clone() for q in m.parameters()] + [
            t.clone() for q in m.parameters() for t in o.state[q].values() if isinstance(t, torch.Tensor)]

    def same(a, b):
        return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))

    m, o = run("skip")
    for s in range(3):
        grads(m, s)
        o.step()
    assert o._zero_batch is not None and o._zero_batch._prep is None  # holds no gradient between steps
    assert o._zero_batch.prepare(o) is False
    before = snap(m, o)
    grads(m, 9)
    m[2].weight.grad[5, 7] = float("nan")
    o.step()
    assert same(before, snap(m, o)) and o.skipped_steps == 1
    m, o = run("raise")
    for s in range(3):
        grads(m, s)
        o.step()
    for bad in (float("inf"), 1e30):  # a non-finite gradient; a finite one whose square overflows float32
        before = snap(m, o)
        grads(m, 9)
        m[2].weight.grad[5, 7] = bad
        with pytest.raises(RuntimeError, match="2.weight"):
            o.step()
        assert same(before, snap(m, o)), bad
    # a non-contiguous gradient: that step per tensor; a tensor without a gradient at step 3 (its step
    # count then lags: a launch group of its own); bitwise a ZeroGefen whose batch is off
    def train(m, o):
        for s in range(6):
            grads(m, s)
            if s == 2:
                m[2].weight.grad = m[2].weight.grad.t().contiguous().t()
            if s == 3:
                m[0].weight.grad = None
            o.step()

    ref_m, ref_o = run("raise")
    monkeypatch.setattr(zbatch.ZeroBatch, "prepare", lambda self, opt: None)
    train(ref_m, ref_o)
    monkeypatch.undo()
    m, o = run("raise")
    with caplog.at_level(logging.INFO, logger="gefen_dist.zero.batch"):
        train(m, o)
    assert any("non-contiguous" in r.getMessage() and "per-tensor path" in r.getMessage() for r in caplog.records)
    assert int(o.state[m[0].weight]["step"]) == int(o.state[m[2].weight]["step"]) - 1
    assert len(o._zero_batch._states) == 2  # the lagging tensor's own launch group
    assert same(snap(ref_m, ref_o), snap(m, o))


@interp
def test_zerogefen_nibbles_batch_equals_its_per_tensor_path(monkeypatch):
    """ZeroGefen with ``second_moment="nibbles"`` (D20) on the Triton path: the batch (zero/batch.py) takes
    the column statistics, every rank's ``v_col`` EMAs between the column ratios (``ColumnRatios``) and the
    owners' dense steps in one ``NibbleStep`` per (group, step count); bitwise ZeroGefen's per-tensor path
    (its owners' ``nibble_step_factored_`` on the Triton kernel) after 5 steps, a weight of two row blocks
    and a group of another lr among them; a NaN gradient raises naming it with nothing changed."""
    import copy

    from torch import nn

    from gefen_dist import ZeroGefen
    from gefen_dist.kernels import dispatch
    from gefen_dist.zero import batch as zbatch

    monkeypatch.setattr(dispatch, "native_cpu_usable", lambda t: False)  # the owners' per-tensor nibble kernel:
    monkeypatch.setattr(dispatch, "triton_usable", lambda t: t.dtype in (torch.float32, torch.bfloat16))  # Triton
    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 16), nn.GELU(), nn.Linear(16, 8))
    a, b = copy.deepcopy(base), copy.deepcopy(base)

    def groups(m):
        return [{"params": [m[0].weight, m[0].bias, m[4].weight]}, {"params": [m[2].weight, m[2].bias], "lr": 3e-3}]

    oa, ob = (ZeroGefen(groups(m), lr=1e-2, weight_decay=0.1, second_moment="nibbles", small_threshold=0)
              for m in (a, b))
    for o in (oa, ob):
        monkeypatch.setattr(o, "_impl", lambda t, p=None, group=None: dispatch._triton())
    monkeypatch.setattr(zbatch.ZeroBatch, "prepare", lambda self, opt, _p=zbatch.ZeroBatch.prepare: (
        None if opt is oa else _p(self, opt)))
    gen = torch.Generator().manual_seed(3)
    for step in range(5):
        x, y = torch.randn(16, 32, generator=gen), torch.randn(16, 8, generator=gen)
        for m, o in ((a, oa), (b, ob)):
            o.zero_grad()
            ((m(x) - y) ** 2).mean().backward()
            o.step()
    zb = ob._zero_batch
    assert zb is not None and zb.nibbles and sum(1 for nb in zb._nibs if "step" in nb) == 2  # two lrs: two steps
    assert oa.__dict__.get("_zero_batch") is not None  # (built, its prepare refused every step)
    for (name, p), q in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(p, q), name
        for k, v in oa.state[p].items():
            if isinstance(v, torch.Tensor):
                assert torch.equal(v, ob.state[q][k]), (name, k)
    ob.zero_grad()
    ((b(x) - y) ** 2).mean().backward()
    b[2].weight.grad[3, 5] = float("nan")
    before = [t.clone() for q in b.parameters() for t in [q] + [v for v in ob.state[q].values()
                                                                 if isinstance(v, torch.Tensor)]]
    with pytest.raises(RuntimeError, match=r"group1\.param0"):
        ob.step()
    after = [t for q in b.parameters() for t in [q] + [v for v in ob.state[q].values() if isinstance(v, torch.Tensor)]]
    assert all(torch.equal(u, w) for u, w in zip(before, after))


@interp
def test_zerogefen_batch_not_taken_is_logged_once_with_the_fix(monkeypatch, caplog):
    """No silent cliff (issue 27): a quantized parameter the batch cannot take (here one that is not
    contiguous) sends ZeroGefen's steps to the per-tensor path with one WARNING naming the tensor and
    the fix, however many steps; the first step (state still to learn) logs nothing; made contiguous,
    the same model takes the batch, and both end bitwise equal."""
    import logging

    from torch import nn

    from gefen_dist import ZeroGefen
    from gefen_dist.kernels import dispatch

    def build(contiguous):
        torch.manual_seed(0)
        m = nn.Sequential(nn.Linear(64, 96), nn.Tanh(), nn.Linear(96, 128))
        if not contiguous:  # the same values, column-major
            m[2].weight = nn.Parameter(m[2].weight.detach().t().contiguous().t())
        o = ZeroGefen(m.named_parameters(), lr=1e-2, weight_decay=0.1)
        o._impl = lambda t, p=None, group=None: dispatch._triton()
        return m, o

    def train(m, o):
        g = torch.Generator().manual_seed(4)
        for _ in range(4):
            for q in m.parameters():
                q.grad = (torch.randn(q.shape, generator=g) * 1e-2).contiguous()
            o.step()

    m, o = build(contiguous=False)
    with caplog.at_level(logging.WARNING, logger="gefen_dist.zero.batch"):
        train(m, o)
    msgs = [r.getMessage() for r in caplog.records if "batched step is not used" in r.getMessage()]
    assert len(msgs) == 1 and "'2.weight'" in msgs[0] and "param.data = param.data.contiguous()" in msgs[0], msgs
    assert o.__dict__.get("_zero_batch") is None
    ref_m, ref_o = build(contiguous=True)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="gefen_dist.zero.batch"):
        train(ref_m, ref_o)
    assert ref_o._zero_batch is not None and not caplog.records
    for (name, p), q in zip(m.named_parameters(), ref_m.parameters()):
        assert torch.equal(p, q), name


@interp
def test_apply_many_equals_the_per_range_appliers():
    """ApplyMany (ZeroGefen's appliers in one launch per mode and dtype) gives every range the bits of
    apply_factored_ / apply_compressed_: ranges of several tensors at byte offsets of one buffer (as
    an all-gather leaves them), row blocks with a range starting inside one (row0), one column
    profile, a bfloat16 parameter, a NaN scale, the bound and none, weight decay and none."""
    from gefen_dist.kernels import triton_state as zs

    cb = random_codebook()
    gen = torch.Generator().manual_seed(4)
    specs = [  # (dtype, rows, S, B, mode, G, row0, row_block, hp)
        (torch.float32, 12, 64, 32, 2, 4, 6, 5, dict(lr=1e-2, weight_decay=0.1, bound=2.5)),
        (torch.bfloat16, 7, 96, 96, 2, 1, 0, 0, dict(lr=3e-3, weight_decay=0.0, bound=None)),
        (torch.float32, 9, 48, 48, 0, 1, 0, 0, dict(lr=1e-2, weight_decay=0.05, bound=1.5)),
        (torch.float32, 5, 128, 64, 2, 3, 0, 2, dict(lr=2e-2, weight_decay=0.1, bound=None)),
    ]
    buf, ranges, ref, mine, scal, cfs = bytearray(), [], [], [], [], []
    for h, (dt, rows, S, B, mode, G, row0, rb, hp) in enumerate(specs):
        hp = dict(hp, eps=1e-8, bc1=1 - 0.9 ** 3, bc2=1 - 0.95 ** 3)
        n = rows * S
        p = (torch.randn(n + 3 * S, generator=gen) * 0.1).to(dt)  # the range starts at row 3 of the tensor
        idx = torch.randint(0, 256, (n,), generator=gen, dtype=torch.uint8)
        M = torch.rand(n // B, generator=gen)
        M[1] = float("nan")
        s = torch.rand(rows if mode == 2 else n // B, generator=gen) * (1e-2 if mode == 2 else 50.0)
        cf = torch.rand(G, S, generator=gen) * 2 if G > 1 else torch.rand(S, generator=gen) * 2
        offs = []
        for t in (idx, M, s):
            offs.append(len(buf))
            raw = t.numpy().tobytes()
            buf += raw + bytes(-len(raw) % 8)
        ranges.append((p, 3 * S, rows, mode, S, B, row0, rb, tuple(offs), h))
        want = p.clone()
        kw = dict(row0=row0, row_block=rb) if G > 1 else {}
        if mode == 2:
            zs.apply_factored_(want[3 * S:], idx, M, s, cf, cb, B, S, hp, **kw)
        else:
            zs.apply_compressed_(want[3 * S:], idx, M, s, cb, S, hp)
        ref.append(want)
        mine.append(p)
        scal.append(zs.ApplyMany.scalars(hp))
        cfs.append(cf if mode == 2 else None)
    chunk = torch.frombuffer(bytearray(buf), dtype=torch.uint8)
    am = zs.ApplyMany(ranges, torch.device("cpu"))
    assert am.launches == 4  # (mode, dtype, launch configuration) buckets
    am.run(chunk.data_ptr(), cb, scal, cfs)
    for i, (want, got) in enumerate(zip(ref, mine)):
        assert torch.equal(got.view(torch.int16) if got.dtype == torch.bfloat16 else got,
                           want.view(torch.int16) if want.dtype == torch.bfloat16 else want) or \
            torch.equal(got.isnan(), want.isnan()) and torch.equal(got.nan_to_num(), want.nan_to_num()), i


@interp
def test_state_many_equals_the_per_range_state_functions(monkeypatch):
    """StateMany (ZeroGefen's owners' state updates in one launch per mode, dtype and tile) gives every
    range the bits of factored_state_ / quantized_state_: idx, scale, v / v_row and the returned
    sqrt(v_row) or sigma, for factored ranges of both dtypes and a compressed one, each cut into the
    state-only functions' chunks (a scratch of a few hundred elements), a NaN-free zero gradient row."""
    from gefen_dist.kernels import triton_state as zs

    monkeypatch.setattr(zs, "_SCRATCH_ELEMS", 300)  # ranges of several chunks, as the per-range calls cut them
    cb = random_codebook()
    gen = torch.Generator().manual_seed(6)
    hp = dict(beta1=0.9, beta2=0.95, eps=1e-8, bc1=1 - 0.9 ** 4, bc2=1 - 0.95 ** 4)
    specs = [(torch.float32, 11, 64, 32, 2), (torch.bfloat16, 7, 96, 96, 2), (torch.float32, 40, 16, 16, 0),
             (torch.float32, 3, 128, 64, 2)]  # (dtype, rows, S, B, mode); S == B == period for mode 0
    ranges, grads, ref = [], [], []
    for dt, rows, S, B, mode in specs:
        n = rows * S
        g = (torch.randn(n, generator=gen) * torch.exp(2 * torch.randn(n, generator=gen)) * 1e-3).to(dt)
        g[:S] = 0  # a zero row
        idx = torch.randint(0, 256, (n,), generator=gen, dtype=torch.uint8)
        scale = torch.rand(n // B, generator=gen) * 1e-3
        v = torch.rand(rows if mode == 2 else n // B, generator=gen) * 1e-6
        mine = (idx.clone(), scale.clone(), v.clone())
        if mode == 2:
            third = zs.factored_state_(g, idx, scale, v, cb, slab=S, scale_block=B, **hp)
        else:
            third = zs.quantized_state_(g, idx, scale, v, cb, period=S, scale_block=S, **hp)
        ref.append((idx, scale, v, third))
        ranges.append((dt, *mine, S, B, mode))
        grads.append(g)
    sm = zs.StateMany(ranges, torch.device("cpu"))
    chunks = sum(len(c) for c in sm._cuts)  # the per-range functions' launches (one per chunk)
    assert chunks == 11 and sm.launches < chunks  # one per (mode, dtype, tile, alignment) bucket
    thirds = sm.run(grads, cb, **hp)
    for i, ((dt, idx, scale, v, *_), want) in enumerate(zip(ranges, ref)):
        for name, got, exp in zip(("idx", "scale", "v", "third"), (idx, scale, v, thirds[i]), want):
            assert torch.equal(got, exp), (i, name)


@interp
def test_column_sums_match_block_column_sumsq():
    """The two-launch column sums (chunks of rows, fixed order) against the eager per-block sums,
    for pieces that cut row blocks, both dtypes and a tensor with more rows than chunks."""
    from gefen_dist.core.step import block_column_sumsq

    gen = torch.Generator().manual_seed(0)
    specs, grads = [], []
    for rows, S, row0, rb, G, dt in [(40, 64, 0, 10, 4, torch.float32), (23, 96, 7, 12, 3, torch.bfloat16),
                                     (700, 32, 0, 1, 1, torch.float32), (5, 300, 0, 1, 1, torch.bfloat16),
                                     (0, 16, 0, 1, 1, torch.float32)]:
        g = torch.randn(rows * S, generator=gen) * torch.exp(3 * torch.randn(rows * S, generator=gen))
        specs.append((rows, S, row0, rb, G, dt))
        grads.append(g.to(dt))
    out = triton_step.ColumnSums(specs, torch.device("cpu")).run(grads)
    ref = torch.cat([block_column_sumsq(g, S, row0, rb, G) if g.numel() else torch.zeros(G * S, dtype=torch.float64)
                     for g, (rows, S, row0, rb, G, _) in zip(grads, specs)])
    torch.testing.assert_close(out, ref, rtol=1e-13, atol=0)


def test_column_sums_launch_only_tiles_with_columns_on_a_1d_grid():
    """The column-sum launches take a table of (chunk, column tile) with only the tiles that hold
    columns, on a 1-D grid: a row of 20M elements (stacked MoE experts; a second grid dimension
    stops at 65,535 tiles = 16.78M elements) is 78,125 tiles, and a short row next to a long one
    launches its own few tiles, not the long row's count."""
    specs = [(1, 20_000_000, 0, 1, 1, torch.float32), (64, 768, 0, 1, 1, torch.float32)]
    cs = triton_step.ColumnSums(specs, torch.device("cpu"))
    tab, ttab, n = cs._chunk_tabs[False]
    long_tiles = -(-20_000_000 // triton_multi._CS_BLOCK_C)
    short_chunks = sum(1 for row in tab.tolist() if row[0] == 1)
    assert n == long_tiles + short_chunks * 3 == ttab.shape[0]  # 768 columns: 3 tiles per chunk
    assert ttab[:, 1].max().item() == long_tiles - 1
    assert cs.programs == n + long_tiles + 3  # and the reduction's tiles: one entry per tensor


@interp
def test_multi_step_bitwise_equals_one_launch_per_tensor():
    """MultiStep (one launch per mode/dtype/config) gives each tensor exactly the bits of its own
    single-tensor launch: shared, per-element and factored (row blocks, a cut piece, column blocks) items."""
    cb = random_codebook()
    gen = torch.Generator().manual_seed(2)
    specs = [  # (rows, S, B, mode, G, row0, row_block, dtype, column blocks K)
        (24, 96, 96, 0, 1, 0, 1, torch.float32, 1), (10, 64, 64, 0, 1, 0, 1, torch.bfloat16, 1),
        (12, 256, 256, 1, 1, 0, 1, torch.float32, 1), (40, 64, 32, 2, 4, 0, 10, torch.float32, 1),
        (23, 96, 48, 2, 3, 7, 12, torch.bfloat16, 1), (9, 1031, 1031, 2, 1, 0, 1, torch.float32, 1),
        (16, 96, 96, 0, 1, 0, 1, torch.float32, 1), (24, 192, 64, 2, 1, 0, 1, torch.float32, 3),
        (6, 192, 24, 2, 1, 5, 1, torch.bfloat16, 8),
    ]
    hp = dict(lr=1e-3, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1)
    mine, ref, grads = [], [], []
    for rows, S, B, mode, G, row0, rb, dt, K in specs:
        n = rows * S
        nv = rows * K if mode == 2 else (n if mode == 1 else n // B)
        st = [torch.randn(n, generator=gen).to(dt), torch.randint(0, 256, (n,), generator=gen, dtype=torch.uint8),
              torch.rand(n // B, generator=gen) * 1e-2, torch.rand(nv, generator=gen) * 1e-4,
              torch.rand(G, S, generator=gen) * 1e-4]
        mine.append([t.clone() for t in st])
        ref.append([t.clone() for t in st])
        grads.append(_grad(n, dt, gen))
    items = [triton_step.StepItem(m[0], m[1], m[2], m[3], m[4].view(-1) if sp[3] == 2 else None, sp[1], sp[2],
                                  sp[3], sp[5], sp[6], sp[8]) for m, sp in zip(mine, specs)]
    ms = triton_step.MultiStep(items, torch.device("cpu"))
    assert ms.launches == 8  # nine tensors: the two (mode 0, fp32, B 96) ones share a launch
    for step in (1, 2):
        bc1, bc2 = bias_corrections(step, 0.9, 0.95)
        ms.run(grads, cb, bc1=bc1, bc2=bc2, **hp)
        for r, g, (rows, S, B, mode, G, row0, rb, dt, K) in zip(ref, grads, specs):
            kw = dict(hp, bc1=bc1, bc2=bc2, scale_block=B)
            if mode == 2:
                triton_step._run(r[0], g, r[1], r[2], r[3], r[4], cb, S=S, B=B, mode=2, row0=row0,
                                 row_block=rb if G > 1 else row0 + rows + 1, block_size=None, col_blocks=K,
                                 **{k: v for k, v in kw.items() if k != "scale_block"})
            else:
                triton_step.quantized_step_(r[0], g, r[1], r[2], r[3], cb, period=1 if mode == 1 else B, **kw)
    for a, b in zip(mine, ref):
        for x, y in zip(a, b):
            assert torch.equal(x.view(torch.uint8), y.view(torch.uint8))


@interp
def test_multi_step_aligned_and_unaligned_members_agree():
    """The ALIGNED promise (16-byte pointers, S and B multiples of 16) is per launch bucket: a member
    whose parameter starts 4 bytes into its storage goes to an unaligned launch, a gradient that
    moves off alignment switches its launch to the unaligned kernel for that run; the hints change
    no bit of the result."""
    cb = random_codebook()
    gen = torch.Generator().manual_seed(5)
    rows, S, B, n = 8, 64, 64, 8 * 64
    base = [torch.randn(n, generator=gen), torch.randint(0, 256, (n,), generator=gen, dtype=torch.uint8),
            torch.rand(n // B, generator=gen) * 1e-2, torch.rand(rows, generator=gen) * 1e-4,
            torch.rand(1, S, generator=gen) * 1e-4]

    def member(offset):
        out = []
        for t in base:
            buf = torch.empty(t.numel() + offset, dtype=t.dtype)[offset:].view(t.shape)
            out.append(buf.copy_(t))
        return out

    a, u = member(0), member(1)  # u: every tensor 1 element (4 or 1 bytes) off its storage's alignment
    assert a[0].data_ptr() % 16 == 0 and u[0].data_ptr() % 16 != 0
    items = [triton_step.StepItem(m[0], m[1], m[2], m[3], m[4], S, B, 2, 0, rows + 1) for m in (a, u)]
    ms = triton_step.MultiStep(items, torch.device("cpu"))
    assert sorted(L["aligned"] for L in ms._launches) == [False, True]
    hp = dict(lr=1e-3, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1)
    for step in (1, 2, 3):
        g = _grad(n, torch.float32, gen)
        g_off = torch.empty(n + 1)[1:].copy_(g) if step == 2 else g  # off alignment at step 2 only
        bc1, bc2 = bias_corrections(step, 0.9, 0.95)
        ms.run([g_off, g.clone()], cb, bc1=bc1, bc2=bc2, **hp)
        for x, y in zip(a, u):
            assert torch.equal(x.view(torch.uint8), y.view(torch.uint8)), step


@interp
def test_multi_step_forced_config():
    """MultiStep's ``config`` (benchmarks/gpu_step.py --tune) forces one (ROWS, BLOCK_SIZE, num_warps)
    on every tensor: one launch per (mode, dtype), the same update up to the summation order of the
    row statistics; a malformed config is refused."""
    cb = random_codebook()
    gen = torch.Generator().manual_seed(4)
    specs = [(24, 96, 96, 0, torch.float32), (10, 64, 64, 0, torch.float32), (12, 256, 256, 1, torch.float32),
             (40, 64, 32, 2, torch.float32), (9, 128, 128, 2, torch.bfloat16)]  # (rows, S, B, mode, dtype)
    hp = dict(lr=1e-3, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1, bc1=0.1, bc2=0.05)
    states, grads = [], []
    for rows, S, B, mode, dt in specs:
        n = rows * S
        nv = rows if mode == 2 else (n if mode == 1 else n // B)
        states.append([torch.randn(n, generator=gen).to(dt), torch.randint(0, 256, (n,), generator=gen, dtype=torch.uint8),
                       torch.rand(n // B, generator=gen) * 1e-2, torch.rand(nv, generator=gen) * 1e-4,
                       torch.rand(1, S, generator=gen) * 1e-4])
        grads.append(_grad(n, dt, gen))

    def run(config):
        st = [[t.clone() for t in s] for s in states]
        items = [triton_step.StepItem(m[0], m[1], m[2], m[3], m[4] if sp[3] == 2 else None, sp[1], sp[2], sp[3])
                 for m, sp in zip(st, specs)]
        ms = triton_step.MultiStep(items, torch.device("cpu"), config=config)
        ms.run(grads, cb, **hp)
        return ms.launches, st

    n_auto, auto = run(None)
    n_forced, forced = run((2, 64, 4))
    assert n_auto == 5 and n_forced == 4  # forced: the two shared fp32 tensors share one launch
    for a, b, sp in zip(auto, forced, specs):
        # a different summation order of the row statistics moves sigma by an ulp or so, and the
        # parameter by a few float32 ulps of itself (these unbounded factored steps move some weights
        # by hundreds); a bfloat16 parameter can flip its single rounding by one bfloat16 ulp (2^-8
        # relative) where the float32 result lies next to a rounding boundary
        rtol = 2.0 ** -8 if sp[4] == torch.bfloat16 else 1e-6
        torch.testing.assert_close(a[0].float(), b[0].float(), rtol=rtol, atol=1e-4)
        assert float((a[1] != b[1]).float().mean()) < 0.01  # isolated codeword flips at most
    with pytest.raises(ValueError, match="config"):
        triton_step.MultiStep([], torch.device("cpu"), config=(2, 64))


def _three_kinds_model():
    from torch import nn

    torch.manual_seed(0)
    # Linear(96, 192): factored with 2 row blocks; Linear(192, 200): factored, one block;
    # Linear(200, 8) and the biases: exact
    return nn.Sequential(nn.Linear(32, 96), nn.GELU(), nn.Linear(96, 192), nn.GELU(), nn.Linear(192, 200),
                         nn.GELU(), nn.Linear(200, 8))


def _per_tensor_and_batch(monkeypatch, **hp):
    """Two copies of the three-kinds model on CPU, each with Gefen(**hp) on the Triton kernels
    (interpreter): ``oa`` always per tensor, ``ob`` through the multi-tensor CUDA batch."""
    import copy

    from gefen_dist import Gefen
    from gefen_dist.engine import cuda_batch as cuda_path
    from gefen_dist.kernels import dispatch

    monkeypatch.setattr(cuda_path, "_DEVICE_TYPES", ("cuda", "cpu"))
    if hp.get("second_moment") == "nibbles":  # its per-tensor path asks dispatch.select_nibbles
        monkeypatch.setattr(dispatch, "native_cpu_usable", lambda t: False)
        monkeypatch.setattr(dispatch, "triton_usable", lambda t: t.dtype in (torch.float32, torch.bfloat16))
    if hp.get("second_moment") == "nibbles":  # smaller (the interpreter runs each program of its kernel slowly)
        from torch import nn

        torch.manual_seed(0)
        base = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 16), nn.GELU(), nn.Linear(16, 8))
        hp = dict(hp, small_threshold=0)  # every 2-D weight quantized (64 x 32: two row blocks)
    elif hp.get("col_blocks") == "auto":  # (192, 32): six row blocks; (48, 192): four column blocks (D21)
        from torch import nn

        torch.manual_seed(0)
        base = nn.Sequential(nn.Linear(32, 192), nn.GELU(), nn.Linear(192, 48), nn.GELU(), nn.Linear(48, 8))
    else:
        base = _three_kinds_model()
    a, b = copy.deepcopy(base), copy.deepcopy(base)
    oa, ob = Gefen(a.named_parameters(), **hp), Gefen(b.named_parameters(), **hp)
    for o in (oa, ob):
        monkeypatch.setattr(o, "_impl", lambda t, p=None, group=None: dispatch._triton())
    monkeypatch.setattr(oa, "_foreach_exact", lambda p, group=None: "exp_avg" in oa.state.get(p, {}))
    monkeypatch.setattr(cuda_path.CudaBatch, "plan", classmethod(
        lambda cls, opt, entries, _plan=cuda_path.CudaBatch.plan.__func__: None if opt is oa else _plan(cls, opt,
                                                                                                         entries)))
    return a, b, oa, ob


def _train_both(a, b, oa, ob, steps, seed, between=None):
    """``steps`` steps of both copies on the same gradients (``a``'s, copied); ``between(step, when)``
    runs after ``a``'s backward (``"grads"``: it may drop a gradient) and after the steps
    (``"stepped"``). Returns ``ob``'s batch after each step and the last input batch."""
    gen = torch.Generator().manual_seed(seed)
    plans = []
    for step in range(steps):
        x, y = torch.randn(16, 32, generator=gen), torch.randn(16, 8, generator=gen)
        oa.zero_grad()
        ((a(x) - y) ** 2).mean().backward()
        if between is not None:
            between(step, "grads")
        for p, q in zip(a.parameters(), b.parameters()):
            q.grad = None if p.grad is None else p.grad.clone()
        oa.step()
        ob.step()
        plans.append(getattr(ob, "_cuda_batch", None))
        if between is not None:
            between(step, "stepped")
    return plans, (x, y)


def _assert_same_state(a, b, oa, ob):
    for (name, p), q in zip(a.named_parameters(), b.parameters()):
        for k, v in oa.state[p].items():
            if isinstance(v, torch.Tensor):
                assert torch.equal(v, ob.state[q][k]), (name, k)
        assert torch.equal(p, q), name


def _nan_raises_unchanged(b, ob, batch, where, name, extra=()):
    """A NaN at ``where`` of ``b``'s gradient: ``ob.step()`` raises naming ``name`` and changes nothing
    (parameters and the ``extra`` state tensors)."""
    x, y = batch
    ob.zero_grad()
    ((b(x) - y) ** 2).mean().backward()
    where.grad[tuple(int(i) for i in torch.unravel_index(torch.tensor(7), where.grad.shape))] = float("nan")
    before = [q.clone() for q in b.parameters()] + [t.clone() for t in extra]
    with pytest.raises(RuntimeError, match=rf"non-finite gradient.*'{name}'"):
        ob.step()
    assert all(torch.equal(u, w) for u, w in zip(before, list(b.parameters()) + list(extra)))


@interp
@pytest.mark.parametrize("second_moment", ["factored", "shared", "elementwise", "nibbles"])
def test_cuda_batch_through_interpreter(monkeypatch, second_moment):
    """The multi-tensor CUDA step (gefen_dist.engine.cuda_batch), run on CPU tensors through the
    interpreter, against the per-tensor Triton path on the same gradients: bitwise equal (on CPU the
    foreach operations are the per-tensor ones and the float64 column sums round to the same
    float32; "nibbles": its column ratios by shape are the per-tensor ones on CPU, its multi-tensor
    kernel runs each row as the per-tensor launch). The plan is built at the second step, reused, and
    rebuilt after load_state_dict; a non-finite gradient goes to the per-tensor path, which raises
    naming the tensor."""
    a, b, oa, ob = _per_tensor_and_batch(monkeypatch, lr=1e-3, weight_decay=0.1, second_moment=second_moment)

    def reload(step, when):
        if step == 3 and when == "stepped":
            ob.load_state_dict(ob.state_dict())

    plans, batch = _train_both(a, b, oa, ob, 5, 1, reload)
    assert plans[0] is None and plans[1] is not None and plans[2] is plans[1] and plans[3] is plans[1]
    assert plans[4] is not None and plans[4] is not plans[1]
    assert oa.codebook is not None and torch.equal(oa.codebook, ob.codebook)
    assert all(oa.state[p]["step"] == ob.state[q]["step"] == 5 for p, q in zip(a.parameters(), b.parameters()))
    _assert_same_state(a, b, oa, ob)
    if second_moment == "nibbles":
        from gefen_dist.kernels.triton_nibbles import NibbleStep

        assert isinstance(plans[4].groups[0]["nibs"]["step"], NibbleStep) and plans[4].groups[0]["multi"] is None
    # a NaN gradient: the plan hands the step back; the per-tensor path raises with the name
    _nan_raises_unchanged(b, ob, batch, b[2].weight, "2.weight")


@interp
@pytest.mark.parametrize("capturable", [False, True])
def test_cuda_batch_with_column_blocks_through_interpreter(monkeypatch, capturable):
    """Gefen(col_blocks="auto") through the multi-tensor CUDA batch (interpreter): the (48, 192) weight's four
    column blocks (D21) are a member of the batch (its own launch group: the multi kernel's COLB path), bitwise
    the per-tensor path; with capturable=True too (the quantized tensors bitwise, the exact ones, torch's fused
    AdamW there, within rounding)."""
    hp = dict(lr=1e-3, weight_decay=0.1, col_blocks="auto")
    if capturable:
        hp.update(capturable=True, nonfinite="skip")
    a, b, oa, ob = _per_tensor_and_batch(monkeypatch, **hp)
    plans, _ = _train_both(a, b, oa, ob, 4, 1)
    batch = plans[-1]
    assert batch is not None and plans[2] is batch
    items = [it for gi in batch.groups if gi["multi"] is not None for it in gi["multi"].items]
    assert sorted(it.K for it in items) == [1, 4] and tuple(ob.state[b[2].weight]["v_row"].shape) == (48, 4)
    assert any(L["colb"] for gi in batch.groups if gi["multi"] is not None for L in gi["multi"]._launches)
    assert (batch.dstep is not None) == capturable
    if not capturable:
        _assert_same_state(a, b, oa, ob)
        return
    for (name, p), q in zip(a.named_parameters(), b.parameters()):  # exact tensors: torch's fused AdamW there
        if "idx" in oa.state[p]:
            assert torch.equal(p, q) and all(torch.equal(v, ob.state[q][k]) for k, v in oa.state[p].items()
                                             if isinstance(v, torch.Tensor) and k != "step"), name
        else:
            torch.testing.assert_close(q, p, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("betas", [(0.9, 0.95), (0.9, 0.999), (0.0, 0.99), (0.5, 0.0), (0.8, 0.64)])
@pytest.mark.parametrize("bounded", [2.0, True, False])
def test_device_step_scalars_are_the_host_ones(betas, bounded):
    """capturable=True: the scalars computed on the device from a step-count tensor
    (core.step.device_hyperparameters, triton_tables.device_step_scalars) are, in float32, exactly the
    ones the host passes as kernel arguments (triton_tables._step_scalars) at every step 1..2000 and
    a few far ones, for a float and a tensor lr: the capturable step's quantized tensors step bitwise
    as the host-driven ones."""
    from gefen_dist.core.step import device_hyperparameters
    from gefen_dist.kernels.triton_tables import DEVICE_HP_FIELDS, _step_scalars, device_step_scalars

    class Tab:  # the table fields _step_scalars reads (not compared)
        h, nb, fast = 0.5, 2, True

    names = ("lerp_c", "beta2", "alpha2", "sqrt_bc2", "eps", "inv_bc1", "lr", "decay", "lut_h", "lut_nbm1", "bound")
    steps = list(range(1, 2001)) + [4321, 10 ** 5, 10 ** 7]
    for lr in (3e-4, torch.tensor(2e-3)):
        group = dict(lr=lr, betas=betas, eps=1e-8, weight_decay=0.1)
        t = torch.tensor(steps, dtype=torch.float32)
        out = torch.empty(len(steps), len(DEVICE_HP_FIELDS))
        for i in range(len(steps)):  # (one step tensor at a time, as the optimizer has it)
            device_step_scalars(out[i], None, **device_hyperparameters(group, t[i], bounded))
        for i, step in enumerate(steps):
            host = dict(zip(names, _step_scalars(torch.device("cpu"), Tab, **hyperparameters(group, step, bounded))[0]))
            dev = dict(zip(DEVICE_HP_FIELDS, out[i].tolist()))
            for k in ("sqrt_bc2", "inv_bc1", "lr", "decay", "bound"):
                assert host[k] == dev[k], (step, k, host[k], dev[k])


class _HostReads:
    """Counts what would make a CUDA step wait for the device: the dispatched operations that read a
    tensor's value on the host (``item``, ``bool``, ``float``, data-dependent shapes, ``torch.equal``)
    and ``Tensor.tolist``, during a ``with`` block (on CPU tensors they are cheap, but each one is a
    host synchronisation on a GPU)."""

    OPS = {"aten::_local_scalar_dense", "aten::nonzero", "aten::equal", "aten::is_nonzero", "aten::item",
           "aten::masked_select", "aten::unique", "aten::_unique2"}

    def __init__(self, monkeypatch):
        from torch.utils._python_dispatch import TorchDispatchMode

        self.reads, self.ops = [], 0
        outer = self

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                outer.ops += 1
                if func._schema.name in outer.OPS:
                    outer.reads.append(func._schema.name)
                return func(*args, **(kwargs or {}))

        self._mode = Mode()
        tolist = torch.Tensor.tolist

        def counting_tolist(t):
            self.reads.append("tolist")
            return tolist(t)

        monkeypatch.setattr(torch.Tensor, "tolist", counting_tolist)

    def __enter__(self):
        self.reads.clear()
        self._mode.__enter__()
        return self

    def __exit__(self, *exc):
        return self._mode.__exit__(*exc)


@interp
@pytest.mark.parametrize("second_moment", ["factored", "shared", "nibbles"])
def test_capturable_step_reads_nothing_on_the_host(monkeypatch, second_moment):
    """capturable=True (engine/device_step.py): through the interpreter, the multi-tensor step against
    the per-tensor Triton path on the same gradients, a non-finite gradient of a quantized tensor at
    step 4 and of an exact one at step 6 (both skipped, on the device), 7 steps. Quantized state and
    parameters bitwise equal, step counts equal (on the parameters' device), the exact tensors (torch's
    fused AdamW) within float32 rounding; a step reads no value on the host (the same batch without
    capturable reads its verdict once)."""
    a, b, oa, ob = _per_tensor_and_batch(monkeypatch, lr=torch.tensor(1e-3), weight_decay=0.1,
                                         second_moment=second_moment, nonfinite="skip", capturable=True)
    host = _HostReads(monkeypatch)

    # (2.weight quantized; 6.weight exact; in the smaller "nibbles" model every weight is quantized: 4.bias exact)
    exact_w = a[4].bias if second_moment == "nibbles" else a[6].weight

    def poison(step, when):
        if when == "grads" and step in (3, 5):
            w = a[2].weight if step == 3 else exact_w
            w.grad.view(-1)[1] = float("inf") if step == 5 else float("nan")

    plans, batch = _train_both(a, b, oa, ob, 7, 2, poison)
    assert plans[0] is None and all(p is plans[1] and p.dstep is not None for p in plans[1:])
    assert oa.skipped_steps == 2 and ob.skipped_steps == 0 and float(ob.device_skipped_steps) == 2.0
    for (name, p), q in zip(a.named_parameters(), b.parameters()):
        exact = "exp_avg" in oa.state[p]
        assert float(oa.state[p]["step"]) == float(ob.state[q]["step"]) == 5.0, name
        for k, v in oa.state[p].items():
            if isinstance(v, torch.Tensor) and k != "step":
                if exact:
                    torch.testing.assert_close(v, ob.state[q][k], rtol=1e-6, atol=1e-12, msg=(name, k))
                else:
                    assert torch.equal(v, ob.state[q][k]), (name, k)
        if exact:
            torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7, msg=name)
        else:
            assert torch.equal(p, q), name
    x, y = batch
    ob.zero_grad()
    ((b(x) - y) ** 2).mean().backward()
    with host as h:
        ob.step()
    assert h.reads == [] and h.ops > 50, (h.reads, h.ops)
    # the same batch without capturable: its verdict is read on the host
    oc = _gefen_on_triton(ob, b, capturable=False)
    for _ in range(2):
        oc.zero_grad()
        ((b(x) - y) ** 2).mean().backward()
        with host as h:
            oc.step()
    assert oc._cuda_batch is not None and oc._cuda_batch.dstep is None and len(h.reads) >= 1, h.reads


@interp
def test_capturable_warns_of_a_float_lr_under_capture(monkeypatch, caplog):
    """A CUDA graph that captures step() with a float lr replays it as a constant (a scheduler's later
    values would not reach it): one WARNING says so and names the fix; a tensor lr gets none. (Capture
    itself needs a GPU: the check on the capturing stream is patched here.)"""
    import logging

    from gefen_dist.engine import device_step

    def train(b, ob, steps, seed):  # the batch alone (no per-tensor copy to compare with here)
        gen = torch.Generator().manual_seed(seed)
        for _ in range(steps):
            x, y = torch.randn(16, 32, generator=gen), torch.randn(16, 8, generator=gen)
            ob.zero_grad()
            ((b(x) - y) ** 2).mean().backward()
            ob.step()

    for lr, warned in ((1e-3, True), (torch.tensor(1e-3), False)):
        _, b, _, ob = _per_tensor_and_batch(monkeypatch, lr=lr, nonfinite="skip", capturable=True)
        train(b, ob, 2, 3)
        assert ob._cuda_batch is not None and ob._cuda_batch.dstep is not None
        monkeypatch.setattr(device_step, "_capturing", lambda: True)
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="gefen_dist.engine.device_step"):
            train(b, ob, 2, 4)
        msgs = [r.getMessage() for r in caplog.records if "float lr" in r.getMessage()]
        assert len(msgs) == (1 if warned else 0), msgs
        monkeypatch.setattr(device_step, "_capturing", lambda: False)


def _gefen_on_triton(opt, model, **kw):
    """A new Gefen over ``model`` with ``opt``'s Triton implementation (through the interpreter)."""
    from gefen_dist import Gefen
    from gefen_dist.kernels import dispatch

    o = Gefen(model.named_parameters(), lr=1e-3, weight_decay=0.1, nonfinite="skip", **kw)
    o._impl = lambda t, p=None, group=None: dispatch._triton()
    return o


@interp
def test_cuda_batch_steps_around_span_tensors(monkeypatch):
    """narrow_rows="span" (D16): the first weight, (96, 32), keeps its state per block of rows and is
    not in the batch; the batch still steps the other tensors (one plan, reused), the span tensor is
    stepped beside it, and everything equals the per-tensor path bitwise. A NaN in the span tensor's
    gradient raises before anything changes."""
    a, b, oa, ob = _per_tensor_and_batch(monkeypatch, lr=1e-3, weight_decay=0.1, narrow_rows="span",
                                         small_threshold=2048)
    plans, batch = _train_both(a, b, oa, ob, 4, 2)
    assert ob._mode(b[0].weight) == "span" and plans[1] is not None and plans[3] is plans[1]
    assert all(p is not b[0].weight for _, p in plans[1].entries)
    _assert_same_state(a, b, oa, ob)
    st = ob.state[b[0].weight]
    _nan_raises_unchanged(b, ob, batch, b[0].weight, "0.weight", (st["v_blk"], st["scale"], st["idx"]))


@interp
@pytest.mark.parametrize("shape,start,n", _span_phases.PIECES)
@pytest.mark.parametrize("dtype", _span_phases.DTYPES)
@pytest.mark.parametrize("bound,wd", _span_phases.BOUND_WD)
def test_span_phases_equal_the_reference(shape, start, n, dtype, bound, wd):
    """The Triton span phases (kernels/triton_span.py) against core/span.py's on one piece
    (tests/_span_phases.py: whole rows and rows cut at either end, float32 and bfloat16, with and
    without the bound and weight decay): everything bitwise but the float64 sums of ``g^2`` (to
    1e-13); on whole rows the update alone from the new indices too."""
    from gefen_dist.kernels import triton_span as tri

    _span_phases.check_phases_equal_the_reference(tri, shape, start, n, dtype, bound, wd)


@interp
@pytest.mark.parametrize("shape,start,n", _span_phases.PIECES_ROWS)
@pytest.mark.parametrize("dtype", _span_phases.DTYPES)
def test_span_phases_with_blocks_of_one_row_equal_the_reference(shape, start, n, dtype):
    """The Triton span phases with blocks of one row (D19: ``_span_rows_stats_kernel`` and
    ``_span_rows_update_kernel``, a tile of rows per program, each row its own scale and ``v``)
    against core/span.py's, as above (with the bound and weight decay)."""
    from gefen_dist.kernels import triton_span as tri

    _span_phases.check_phases_equal_the_reference(tri, shape, start, n, dtype, 1.5, 0.1, rows=True)


@interp
def test_cuda_batch_mixed_step_counts_and_logged_fallbacks(monkeypatch, caplog):
    """A tensor that missed steps (no gradient at step 2: an expert without tokens) keeps the batch:
    its own launches with its own bias corrections, bitwise equal to the per-tensor path. A model
    whose only quantized tensor is a non-contiguous parameter has nothing to batch: the per-tensor
    path, with one WARNING naming it and the fix."""
    from gefen_dist import Gefen

    a, b, oa, ob = _per_tensor_and_batch(monkeypatch, lr=1e-3)

    def skip_one(step, when):
        if step == 2 and when == "grads":
            a[2].weight.grad = None  # the factored 192x96 weight misses this step

    plans, _ = _train_both(a, b, oa, ob, 6, 4, skip_one)
    assert plans[4] is not None and plans[5] is plans[4]  # built with two step counts, reused
    assert int(ob.state[b[2].weight]["step"]) == 5 and int(ob.state[b[0].weight]["step"]) == 6
    assert len(plans[5].groups) == 2
    _assert_same_state(a, b, oa, ob)
    w = torch.nn.Parameter(torch.randn(96, 64).t())  # (64, 96), stride (1, 64)
    oc = Gefen([w], lr=1e-3)
    with caplog.at_level("WARNING", logger="gefen_dist.engine.cuda_batch"):
        for _ in range(3):
            w.grad = torch.randn(64, 96)
            oc.step()
    warned = [r.getMessage() for r in caplog.records if "multi-tensor CUDA step is not used" in r.getMessage()]
    assert len(warned) == 1 and "'group0.param0'" in warned[0] and "not contiguous" in warned[0], warned
    assert getattr(oc, "_cuda_batch", None) is None


def _non_contiguous(lin):
    """``lin.weight`` replaced by a parameter of the same values and a transposed layout."""
    lin.weight = torch.nn.Parameter(lin.weight.detach().t().contiguous().t())


@interp
def test_cuda_batch_steps_beside_what_it_cannot_take(monkeypatch, caplog):
    """In a single process a quantized tensor the batch cannot take (here a non-contiguous (192, 96)
    weight) is stepped on its own beside the batch, which keeps every other tensor (a non-contiguous
    exact (8, 200) weight included: foreach operations take any layout); one INFO line names it, and
    the results equal the per-tensor path bitwise. A NaN in its gradient raises before anything
    changes, and so does a NaN in a batched tensor's."""
    import copy

    from gefen_dist import Gefen
    from gefen_dist.engine import cuda_batch as cuda_path
    from gefen_dist.kernels import dispatch

    monkeypatch.setattr(cuda_path, "_DEVICE_TYPES", ("cuda", "cpu"))
    base = _three_kinds_model()
    _non_contiguous(base[2])
    _non_contiguous(base[6])
    a, b = copy.deepcopy(base), copy.deepcopy(base)
    assert not b[2].weight.is_contiguous() and not b[6].weight.is_contiguous()
    oa, ob = Gefen(a.named_parameters(), lr=1e-3, weight_decay=0.1), Gefen(b.named_parameters(), lr=1e-3,
                                                                           weight_decay=0.1)
    for o in (oa, ob):
        monkeypatch.setattr(o, "_impl", lambda t, p=None, group=None: dispatch._triton())
    monkeypatch.setattr(cuda_path.CudaBatch, "plan", classmethod(
        lambda cls, opt, entries, _plan=cuda_path.CudaBatch.plan.__func__: None if opt is oa else _plan(cls, opt,
                                                                                                         entries)))
    with caplog.at_level("INFO", logger="gefen_dist.engine.cuda_batch"):
        plans, batch = _train_both(a, b, oa, ob, 4, 5)
    assert plans[1] is not None and plans[3] is plans[1]
    batched = {id(p) for _, p in plans[1].entries}
    assert id(b[2].weight) not in batched and id(b[6].weight) in batched and id(b[4].weight) in batched
    said = [r.getMessage() for r in caplog.records if "beside the multi-tensor CUDA step" in r.getMessage()]
    assert len(said) == 1 and "'2.weight'" in said[0] and "not contiguous" in said[0], said
    assert not [r for r in caplog.records if "is not used" in r.getMessage()]
    _assert_same_state(a, b, oa, ob)
    st = ob.state[b[2].weight]
    _nan_raises_unchanged(b, ob, batch, b[2].weight, "2.weight", (st["idx"], st["scale"], st["v_row"]))
    _nan_raises_unchanged(b, ob, batch, b[4].weight, "4.weight", (st["idx"], st["scale"], st["v_row"]))


@interp
@pytest.mark.parametrize("nonfinite", ["raise", "skip"])
def test_several_batches_are_all_checked_before_any_steps(monkeypatch, nonfinite):
    """A single process with parameters on several CUDA devices gets one batch per device. Here the
    split is forced into two batches on the CPU device: the results equal the per-tensor path bitwise,
    and a NaN in the second batch's gradient raises (or skips the step) before the first batch
    changes anything."""
    from gefen_dist.engine import cuda_batch as cuda_path

    orig = cuda_path.CudaBatch.split

    def two(opt, entries):
        groups, beside, why = orig(opt, entries)
        if groups is None:
            return groups, beside, why
        (dev, es), = groups
        return [(dev, es[:3]), (dev, es[3:])], beside, why

    a, b, oa, ob = _per_tensor_and_batch(monkeypatch, lr=1e-3, weight_decay=0.1, nonfinite=nonfinite)
    monkeypatch.setattr(cuda_path.CudaBatch, "split", staticmethod(two))
    plans, batch = _train_both(a, b, oa, ob, 4, 6)
    assert plans[1] is not None and plans[3] is plans[1] and len(ob._cuda_batches) == 2
    assert ob._cuda_batches[1] is not plans[1] and ob._cuda_batches[1].entries
    _assert_same_state(a, b, oa, ob)
    where = ob._cuda_batches[1].entries[0][1]
    if nonfinite == "raise":
        name = dict((id(p), n) for n, p in b.named_parameters())[id(where)]
        _nan_raises_unchanged(b, ob, batch, where, name)
        return
    x, y = batch
    ob.zero_grad()
    ((b(x) - y) ** 2).mean().backward()
    where.grad.view(-1)[3] = float("nan")
    before = [q.clone() for q in b.parameters()] + [ob.state[q]["step"].clone() for q in b.parameters()]
    skipped = ob.skipped_steps
    ob.step()
    assert ob.skipped_steps == skipped + 1
    assert all(torch.equal(u, w) for u, w in zip(before, list(b.parameters()) +
                                                 [ob.state[q]["step"] for q in b.parameters()]))


@pytest.mark.parametrize("device", [
    pytest.param("cpu", marks=interp),
    pytest.param("cuda", marks=pytest.mark.skipif(
        _CHILD or not torch.cuda.is_available() or not triton_step.available("cuda"), reason="needs CUDA")),
])
@pytest.mark.parametrize("second_moment", ["factored", "shared"])
def test_flat_segments_with_triton_kernels(second_moment, device):
    """DeepSpeed's flat-buffer step (gefen_dist.engine.flat) with the Triton kernels for whole rows /
    blocks (what the integration runs on CUDA) against its eager step: same indices and scales,
    parameters within the kernel's tolerance."""
    from gefen_dist.engine.comm import LocalComm
    from gefen_dist.kernels import dispatch
    from gefen_dist.engine.flat import FlatSegments, Segment, counts_to_codebook

    shapes = [("a", (96, 64)), ("b", (192, 64)), ("c", (64, 200)), ("bias", (64,))]
    gen = torch.Generator().manual_seed(0)
    segs, off = [], 0
    for name, shape in shapes:
        n = shape[0] * (shape[1] if len(shape) > 1 else 1)
        segs.append(Segment(name, name, shape, 0, off, n))
        off += n
    flat0 = (torch.randn(off, generator=gen) * 0.02).to(device)
    runs = []
    for kernels in (True, False):
        fs = FlatSegments(segs, LocalComm(), 4096)
        flat = flat0.clone()
        st = fs.new_state(flat, torch.zeros(256, device=device), factored=second_moment == "factored")
        g0 = torch.Generator().manual_seed(1)
        for step in range(1, 4):
            grad = (torch.randn(off, generator=g0) * 1e-2).to(device)
            if step == 1:
                st["codebook"] = counts_to_codebook(fs.learn(st, grad, codebook_needed=True, second_moment=second_moment)).codebook.float().to(device)
            st["step"] = step
            kw = dict(impl=dispatch._triton()) if kernels else {}
            hp = hyperparameters(dict(lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1), step, bounded=False)
            fs.step(flat, grad, st, second_moment=second_moment, hp=hp, **kw)
        runs.append((flat, st))
    (fa, sa), (fb, sb) = runs
    if device == "cpu":
        assert torch.equal(sa["idx"], sb["idx"]) and torch.equal(sa["scale"], sb["scale"])
    else:  # torch's CUDA lerp may round differently from the kernel's fma in rare elements
        assert (sa["idx"] != sb["idx"]).float().mean().item() <= 1e-4
    torch.testing.assert_close(fa, fb, rtol=1e-6, atol=1e-6 * fb.abs().max().item())


@pytest.mark.parametrize("device", [
    pytest.param("cpu", marks=interp),
    pytest.param("cuda", marks=pytest.mark.skipif(
        _CHILD or not torch.cuda.is_available() or not triton_step.available("cuda"), reason="needs CUDA")),
])
@pytest.mark.parametrize("second_moment", ["factored", "shared", "nibbles", "colblocks"])
def test_flat_batch_equals_the_per_segment_step_triton(monkeypatch, second_moment, device):
    """DeepSpeed's flat-buffer step batched (engine/flat_batch.py: a fixed number of launches) equals
    its per-segment step bitwise on the Triton kernels (tests/test_flat_batch.py: the native ones);
    factored and "nibbles" with rows and scale blocks cut by partition edges and row blocks. On a GPU the two
    paths' float64 column sums (a Triton reduction, torch's) may differ in their last bits, so the
    comparison allows what test_flat_segments_with_triton_kernels allows."""
    from test_flat_batch import assert_same, flat_run

    from gefen_dist.kernels import dispatch

    colb = second_moment == "colblocks"  # factored, with a (32, 128) tensor in four column blocks (D21), cut
    second_moment = "factored" if colb else second_moment
    segs = ([("w", (32, 128), 41, 32 * 128 - 41), ("c", (64, 200), 0, 64 * 200), ("bias", (64,), 0, 64)] if colb else
            [("a", (32, 64), 37, 32 * 64 - 37), ("qkv", (96, 64), 0, 96 * 64), ("few", (2, 2048), 0, 4096),
             ("bias", (64,), 0, 64)] if second_moment == "factored" else
            [("a", (64, 64), 0, 64 * 64), ("c", (32, 200), 0, 6400), ("bias", (64,), 0, 64)] if second_moment == "shared"
            else [("a", (32, 64), 37, 32 * 64 - 37), ("qkv", (96, 64), 0, 96 * 64), ("bias", (64,), 0, 64)])
    impl = dispatch._triton()
    cb = "auto" if colb else 1
    batched = flat_run(impl, second_moment, True, steps=3, segments=segs, device=device, col_blocks=cb)
    assert batched[2].__dict__["_flat_batch"] is not None
    if colb:
        assert sorted(it.K for it in batched[2].__dict__["_flat_batch"].fmulti.items) == [1, 4]
    other = flat_run(impl, second_moment, False, steps=3, segments=segs, monkeypatch=monkeypatch, device=device,
                     col_blocks=cb)
    if device == "cpu":
        assert_same(batched, other)
    else:
        (fa, sa, _), (fb, sb, _) = batched, other
        assert (sa["idx"] != sb["idx"]).float().mean().item() <= 1e-4
        torch.testing.assert_close(fa, fb, rtol=1e-6, atol=1e-6 * fb.abs().max().item())


@interp
def test_factored_errors():
    cb = random_codebook()
    rows, S = 8, 64
    st = [torch.zeros(rows * S), torch.zeros(rows * S), torch.zeros(rows * S, dtype=torch.uint8),
          torch.zeros(rows), torch.zeros(rows), torch.zeros(2, S)]
    kw = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0, bc1=0.1, bc2=0.001)
    with pytest.raises(ValueError, match="must divide the row length"):
        triton_step.quantized_step_factored_(*st[:5], st[5], cb, torch.zeros(2, S), scale_block=48,
                                             row_block=4, **kw)
    with pytest.raises(ValueError, match="row blocks"):
        triton_step.quantized_step_factored_(*st[:5], st[5], cb, torch.zeros(2, S), scale_block=64,
                                             row_block=0, **kw)
    with pytest.raises(ValueError, match="col_mean_sq"):
        triton_step.quantized_step_factored_(*st[:5], st[5], cb, torch.zeros(S), scale_block=64,
                                             row_block=4, **kw)


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


@pytest.mark.skipif(_CHILD or not torch.cuda.is_available() or not triton_step.available("cuda"),
                    reason="needs CUDA (compiled kernel)")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("case", sorted(FACTORED_CASES))
def test_cuda_factored_matches_eager(case, dtype):
    rows, S, B, G, row0, rb = FACTORED_CASES[case]
    ref, out = _run_both_factored(rows * 8, S, B, dtype, G=G, row0=row0 * 8, row_block=rb * 8, device="cuda")
    _assert_agree_factored([t.cpu() for t in ref], [t.cpu() for t in out], idx_frac=1e-4)


@pytest.mark.skipif(_CHILD or not torch.cuda.is_available() or not triton_step.available("cuda"),
                    reason="needs CUDA (compiled kernel)")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("shape,start,n", [((200_000, 4), 0, 800_000), ((3001, 10), 2047, 13339),
                                           ((50_000, 1), 0, 50_000)])
def test_cuda_span_phases_match_the_reference(shape, start, n, dtype):
    """The compiled span kernels (D16) against core/span.py's torch operations on the same CUDA
    tensors, three steps: scales and v within float32 rounding, parameters within 1e-6 of their
    largest value, indices equal but for a tiny fraction (torch's CUDA lerp may round differently
    from the kernel's fma in rare elements)."""
    import math

    from gefen_dist.core import span as ref
    from gefen_dist.kernels import triton_span as tri

    dev = torch.device("cuda")
    S = math.prod(shape[1:])
    sp = ref.SpanPiece.of(shape, start, n)
    gen = torch.Generator().manual_seed(7)
    cb = torch.sort(torch.cat([torch.tensor([-1.0, 0.0, 1.0]), torch.rand(253, generator=gen) * 2 - 1]))[0].to(dev)
    p0 = (torch.randn(n, generator=gen) * 0.02).to(dtype).to(dev)
    states = []
    for _ in range(2):
        states.append(dict(p=p0.clone(), idx=torch.zeros(n, dtype=torch.uint8, device=dev),
                           scale=torch.zeros(sp.nb, device=dev), vb=torch.zeros(sp.nb, device=dev),
                           vc=torch.zeros(S, device=dev)))
    for t in range(1, 4):
        g = (torch.randn(n, generator=gen) * 0.1).to(dtype).to(dev)
        hp = dict(lr=1e-3, beta2=0.999, eps=1e-8, weight_decay=0.1, bc1=1 - 0.9 ** t, bc2=1 - 0.999 ** t, bound=2.0,
                  beta1=0.9)
        for impl, st in zip((ref, tri), states):
            m, col, blk, amax = impl.span_statistics(g, st["idx"], st["scale"], cb, sp, 0.9)
            impl.span_update_(st["p"], st["idx"], st["scale"], st["vb"], st["vc"], m, col, blk, amax, cb, sp, **hp)
    a, b = states
    torch.testing.assert_close(b["scale"], a["scale"], rtol=1e-6, atol=0)
    torch.testing.assert_close(b["vb"], a["vb"], rtol=1e-6, atol=0)
    torch.testing.assert_close(b["vc"], a["vc"], rtol=1e-6, atol=0)
    assert (a["idx"] != b["idx"]).float().mean().item() <= 1e-4
    torch.testing.assert_close(b["p"].float(), a["p"].float(), rtol=0,
                               atol=(1e-6 if dtype == torch.float32 else 1e-2) * a["p"].float().abs().max().item())


@pytest.mark.skipif(_CHILD or not torch.cuda.is_available() or not triton_step.available("cuda"),
                    reason="needs CUDA (compiled kernel)")
def test_cuda_zerogefen_equals_gefen_batch():
    """ZeroGefen on CUDA (one process: its batched phases, zero/batch.py, with the owners' state in
    StateMany and the appliers in ApplyMany) against Gefen's multi-tensor CUDA batch, which sums the
    columns in the same order, on the same CUDA tensors and gradients, 4 steps: parameters bitwise (the
    appliers replay the kernel's float32 operations; a mismatch names the tensor and how many elements
    differ)."""
    from torch import nn

    from gefen_dist import Gefen, ZeroGefen

    def build():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 512), nn.GELU(),
                             nn.Linear(512, 8)).cuda()

    a, b = build(), build()
    oa = Gefen(a.named_parameters(), lr=1e-2, weight_decay=0.1)
    ob = ZeroGefen(b.parameters(), lr=1e-2, weight_decay=0.1)
    g = torch.Generator(device="cuda").manual_seed(1)
    for _ in range(4):
        x, y = torch.randn(32, 64, device="cuda", generator=g), torch.randn(32, 8, device="cuda", generator=g)
        for m, o in ((a, oa), (b, ob)):
            o.zero_grad()
            ((m(x) - y) ** 2).mean().backward()
            o.step()
    assert oa._cuda_batch is not None and ob._zero_batch is not None  # both batched
    assert ob._apply_cache[3] is not None  # the one-launch appliers ran
    for (name, p), q in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(p, q), (name, int((p != q).sum()), p.numel())
