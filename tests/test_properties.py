"""Property tests (hypothesis) of the pure math in gefen_dist.core."""
import functools

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gefen_dist import Gefen
from gefen_dist.core import periods as P
from gefen_dist.core.codebook import solve_codebook
from gefen_dist.core.quant import block_histogram_eager as block_histogram, nearest_codeword

SETTINGS = dict(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@functools.lru_cache(maxsize=None)
def _codebook(seed):
    """(cached: the exact DP is solved once per seed; callers do not modify it)"""
    rng = np.random.default_rng(seed)
    counts = rng.integers(0, 50, 4096)
    counts[rng.random(4096) < 0.5] = 0
    return solve_codebook(counts).codebook


@settings(**SETTINGS)
@given(seed=st.integers(0, 2**31 - 1), scale=st.floats(1e-30, 1e30), n=st.integers(1, 3000))
def test_quantization_error_bounded_by_half_the_largest_gap(seed, scale, n):
    cb = _codebook(seed % 3)  # three codebooks (each an exact DP in numpy, ~1.4 s)
    g = torch.Generator().manual_seed(seed)
    m = torch.randn(n, generator=g) * scale
    a = m.abs().max()
    z = m / a if a > 0 else torch.zeros_like(m)
    idx = nearest_codeword(z, cb)
    q = cb[idx.long()] * a
    gap = float((cb[1:] - cb[:-1]).max())
    assert float((q - m).abs().max()) <= 0.5 * gap * float(a) * (1 + 1e-5) + 1e-45


@settings(**SETTINGS)
@given(z=st.lists(st.floats(-2, 2, allow_nan=False, width=32), min_size=1, max_size=200))
def test_nearest_codeword_is_nearest_with_lower_index_on_ties(z):
    cb = _codebook(1)
    zt = torch.tensor(z, dtype=torch.float32)
    idx = nearest_codeword(zt, cb).long()
    d = (zt[:, None] - cb[None, :]).abs()
    best = d.min(dim=1).values
    assert torch.equal(d.gather(1, idx[:, None]).squeeze(1), best)
    first = (d == best[:, None]).float().argmax(dim=1)  # lowest index attaining the minimum
    assert torch.equal(idx, first)


@settings(**SETTINGS)
@given(rows=st.integers(4, 40), cols=st.sampled_from([12, 16, 36, 60, 96]), seed=st.integers(0, 10**6),
       exponent=st.integers(-4, 20))
def test_period_divides_the_row_is_deterministic_and_scale_invariant(rows, cols, seed, exponent):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, cols, generator=g)
    # magnitudes well above sqrt(1e-12), the log's epsilon, where scaling only shifts every l_i
    grad = torch.sign(x) * (x.abs() + 0.1) * (torch.rand(rows, 1, generator=g) * 5 + 0.1)
    p1 = P.resolve_period(P.paper_period(grad), cols)
    assert cols % p1 == 0
    assert P.resolve_period(P.paper_period(grad.clone()), cols) == p1
    # scaling by a power of two (exact in float32) shifts every l_i by the same constant
    two = 2.0 ** exponent
    assert P.resolve_period(P.paper_period(grad * two), cols) == p1


@settings(**SETTINGS)
@given(n_rows=st.integers(4, 64), cols=st.sampled_from([8, 30, 64]), cut=st.data())
def test_period_scores_decompose_over_any_pieces(n_rows, cols, cut):
    g = torch.randn(n_rows, cols, dtype=torch.float64)
    n = g.numel()
    cands = P.candidate_periods(n)
    l = P.log_sq_eager(g)
    whole = P.combine_partials([P.period_partials_eager(l, 0, n, cands)], n)
    edges = sorted(set(cut.draw(st.lists(st.integers(1, n - 1), max_size=5))))
    bounds = [0, *edges, n]
    parts = [P.period_partials_eager(l[a:b], a, n, cands) for a, b in zip(bounds[:-1], bounds[1:])]
    split = P.combine_partials(parts[::-1], n)  # any order
    assert np.allclose(whole, split, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("values", [
    torch.zeros(4096),                                   # all-zero blocks
    torch.full((4096,), 1e-40),                          # subnormals
    torch.tensor([1e30, -1e30, 3.0, 0.0] * 1024),        # huge values
])
def test_histogram_and_step_handle_extreme_values(values):
    counts = block_histogram(values, 64)
    assert int(counts.sum()) == values.numel()
    w = torch.nn.Parameter(torch.ones(64, 64))
    if values.abs().max() > 1e19:
        # the default factored second moment cannot represent g^2 > float32 max: a clear error
        opt = Gefen([w], lr=1e-3)
        w.grad = values.view(64, 64).clone()
        with pytest.raises(RuntimeError, match="overflows float32"):
            opt.step()
        assert bool(torch.isfinite(w).all())
    opt = Gefen([w], lr=1e-3, second_moment="shared")
    w.grad = values.view(64, 64).clone()
    opt.step()
    if values.abs().max() > 0:
        assert bool(torch.isfinite(w).all())
        assert opt.codebook is not None
    else:
        assert opt.codebook is None  # all-zero gradient: nothing learned yet (D4)


def test_one_element_and_empty_tensors():
    a = torch.nn.Parameter(torch.ones(()))
    b = torch.nn.Parameter(torch.ones(0, 7))
    c = torch.nn.Parameter(torch.ones(1))
    opt = Gefen([a, b, c], lr=0.1, weight_decay=0.0)
    for p in (a, b, c):
        p.grad = torch.ones_like(p)
    opt.step()
    ref = torch.nn.Parameter(torch.ones(()))
    ref.grad = torch.ones(())
    torch.optim.AdamW([ref], lr=0.1, weight_decay=0.0, foreach=False).step()
    assert torch.equal(a, ref) and b.numel() == 0 and torch.equal(c.view(()), ref)
