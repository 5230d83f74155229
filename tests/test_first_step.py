"""Native first-step kernels (gefen_dist/kernels/first_step.py) against the numpy/torch fallback:
period statistics (same periods, scores close, more accurate than the fallback), log_sq, and
bitwise-equal histograms; plus the GEFEN_DIST_NO_NATIVE switch and thread-count independence."""
import math

import numpy as np
import pytest
import torch

from gefen_dist import Gefen
from gefen_dist.core import periods as P
from gefen_dist.core.quant import block_histogram_eager
from gefen_dist.kernels import dispatch as D
from gefen_dist.kernels.dispatch import block_histogram
from gefen_dist.kernels import first_step as F

pytestmark = pytest.mark.skipif(not F.available(), reason="native first-step library unavailable")

# 16384-element chunks, 16 chunks per super-chunk: 600x768 spans two super-chunks
SHAPES = [(4, 3), (7, 5), (64, 30), (129, 96), (600, 768), (3, 50257)]


def _grad(shape, seed, dtype=torch.float32):
    """Row-structured synthetic gradient: log-normal scale per row (the realistic case)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, generator=g) * 1e-3
    if len(shape) == 2:
        x = x * torch.exp(torch.randn(shape[0], 1, generator=g))
    return x.to(dtype)


def _exact_scores(l: torch.Tensor, cands):
    """Scores from block sums in extended precision (no prefix sums)."""
    ln = l.numpy().astype(np.longdouble)
    out = []
    for p in cands:
        mu = ln.reshape(-1, p).sum(axis=1) / p
        out.append(float(np.abs(np.diff(mu)).sum() / (ln.size // p - 1)))
    return np.array(out)


def _cuts(n, rng, k):
    return [0, *sorted(set(int(c) for c in rng.integers(1, n, size=k))), n] if n > 1 else [0, n]


@pytest.mark.parametrize("shape", SHAPES)
def test_partials_match_fallback_and_select_same_period(shape):
    g = _grad(shape, 1)
    n = g.numel()
    cands = P.candidate_periods(n)
    l = P.log_sq_eager(g)
    ref = np.array(P.combine_partials([P.period_partials_eager(l, 0, n, cands)], n))
    exact = _exact_scores(l, cands)
    rng = np.random.default_rng(n)
    for cuts in ([0, n], _cuts(n, rng, 1), _cuts(n, rng, 5)):
        parts = [D.period_partials(l[a:b], a, n, cands) for a, b in zip(cuts[:-1], cuts[1:])]
        eparts = [P.period_partials_eager(l[a:b], a, n, cands) for a, b in zip(cuts[:-1], cuts[1:])]
        for q, e in zip(parts, eparts):
            assert (q.start, q.length, q.periods, q.edge_blocks) == (e.start, e.length, e.periods, e.edge_blocks)
            np.testing.assert_allclose(q.internal, e.internal, rtol=1e-9, atol=1e-9)
            for s, t in zip(q.edge_sums, e.edge_sums):
                np.testing.assert_allclose(s, t, rtol=1e-11, atol=1e-9)
        nat = np.array(P.combine_partials(parts[::-1], n))
        np.testing.assert_allclose(nat, ref, rtol=1e-9, atol=0)    # fallback: its own rounding
        np.testing.assert_allclose(nat, exact, rtol=1e-12, atol=0)  # native: near exact
        if len(cands) >= 3:
            assert P.select_paper_period(cands, nat) == P.select_paper_period(cands, ref)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_grad_partials_fused_from_gradient(dtype):
    g = _grad((300, 96), 2, dtype)
    n = g.numel()
    cands = P.candidate_periods(n)
    l = P.log_sq_eager(g)
    ref = P.combine_partials([P.period_partials_eager(l, 0, n, cands)], n)
    cuts = [0, 1000, 1001, 17000, 20000, n]  # pieces starting/ending inside blocks
    parts = [D.grad_period_partials(g.reshape(-1)[a:b], a, n, cands) for a, b in zip(cuts[:-1], cuts[1:])]
    nat = P.combine_partials(parts, n)
    np.testing.assert_allclose(nat, ref, rtol=1e-9)
    np.testing.assert_allclose(nat, _exact_scores(l, cands), rtol=1e-12)
    assert D.paper_period(g) == P.select_paper_period(cands, ref)


def test_log_sq_native_matches_torch():
    g = torch.cat([_grad((100, 77), 3).reshape(-1),
                   torch.tensor([0.0, -0.0, 1e-30, 1e-45, 3e19, -1e20, 3.4e38, 1.0, 2.0, 0.5]),
                   torch.tensor([float("inf"), float("-inf"), float("nan")])])
    nat, ref = D.log_sq(g), P.log_sq_eager(g)
    assert nat.dtype == torch.float64 and nat.shape == ref.shape
    fin = torch.isfinite(ref)
    assert torch.equal(torch.isnan(nat), torch.isnan(ref)) and torch.equal(nat[~fin & ~torch.isnan(ref)],
                                                                            ref[~fin & ~torch.isnan(ref)])
    rel = ((nat[fin] - ref[fin]).abs() / ref[fin].abs().clamp(min=1e-300)).max()
    assert float(rel) <= 4.5e-16  # last bit of the logarithm at most
    for dt in (torch.bfloat16, torch.float16):
        h = g[:7700].to(dt)
        np.testing.assert_allclose(D.log_sq(h).numpy(), P.log_sq_eager(h).numpy(), rtol=5e-16)


def test_results_independent_of_thread_count():
    g = _grad((700, 768), 4)
    n = g.numel()
    cands = P.candidate_periods(n)
    out = []
    for t in (1, 2, 3):
        torch.set_num_threads(t)
        part = D.grad_period_partials(g.reshape(-1)[5:], 5, n, cands)
        out.append((part.internal, part.edge_sums, block_histogram(g, 768).tolist()))
    assert out[0] == out[1] == out[2]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
@pytest.mark.parametrize("shape,block", [((64, 30), 30), ((129, 96), 96), ((600, 768), 768),
                                         ((3, 50257), 50257), ((40, 64), 1), ((16, 2048), 32768)])
def test_histogram_bitwise_equal(dtype, shape, block):
    g = _grad(shape, 5).to(dtype)
    g.view(-1)[:block] = 0  # an all-zero block
    out = torch.full((4096,), 7, dtype=torch.int64)
    nat = block_histogram(g, block, out=out)
    assert nat is out
    ref = block_histogram_eager(g, block, torch.full((4096,), 7, dtype=torch.int64))
    assert torch.equal(nat, ref)


@pytest.mark.parametrize("values", [
    torch.zeros(4096), torch.full((4096,), 1e-40), torch.tensor([1e30, -1e30, 3.0, 0.0] * 1024),
    torch.tensor([float("nan"), 1.0, 2.0, -3.0] * 1024), torch.tensor([1.0, -1.0, 0.5, -0.25] * 1024),
])
def test_histogram_extreme_values(values):
    for b in (4, 64, 4096):
        assert torch.equal(block_histogram(values, b), block_histogram_eager(values, b))


def test_histogram_infinity_raises_like_fallback():
    v = torch.tensor([float("inf"), 1.0, 2.0, 3.0] * 16)
    with pytest.raises(RuntimeError):
        block_histogram_eager(v, 4)
    with pytest.raises(RuntimeError):
        block_histogram(v, 4)


def test_env_forces_fallback(monkeypatch):
    g = _grad((64, 30), 6)
    n = g.numel()
    cands = P.candidate_periods(n)
    monkeypatch.setenv("GEFEN_DIST_NO_NATIVE", "1")
    assert not F.available()
    l = D.log_sq(g)
    assert torch.equal(l, P.log_sq_eager(g))
    a = D.period_partials(l, 0, n, cands)
    b = P.period_partials_eager(l, 0, n, cands)
    assert (a.internal, a.edge_sums) == (b.internal, b.edge_sums)
    c = D.grad_period_partials(g, 0, n, cands)
    assert (c.internal, c.edge_sums) == (b.internal, b.edge_sums)
    assert torch.equal(block_histogram(g, 30), block_histogram_eager(g, 30))
    monkeypatch.delenv("GEFEN_DIST_NO_NATIVE")
    assert F.available()


def test_gefen_first_step_native_equals_fallback(monkeypatch):
    def run():
        torch.manual_seed(0)
        ws = [torch.nn.Parameter(torch.randn(r, c)) for r, c in ((256, 96), (128, 300), (64, 1024))]
        opt = Gefen(ws, lr=1e-3)
        for w in ws:
            w.grad = _grad(tuple(w.shape), w.numel())
        opt.step()
        return [opt.state[w].get("period", 0) for w in ws], opt.codebook.clone()

    p1, c1 = run()
    monkeypatch.setenv("GEFEN_DIST_NO_NATIVE", "1")  # (also switches the fused step off)
    p2, c2 = run()
    assert p1 == p2
    assert torch.equal(c1, c2)  # histograms bitwise equal -> same codebook
    assert math.prod(p1) > 1
