"""Gefen's updates are bounded like AdamW's on every gradient sequence (issue "Updates bounded like
AdamW's on every gradient"; research/update_bound/).

AdamW's per-element normalised update |m_hat_t| / (sqrt(v_hat_t) + eps) never exceeds
``K_t = (1-b1)/(1-b1^t) * sqrt((1-b2^t)/(1-b2)) * sqrt(sum_{j<t} (b1^2/b2)^j)`` (Cauchy-Schwarz; tight;
1 at t = 1, 7.27 for (0.9, 0.999) and 1.165 for (0.9, 0.95) as t -> inf). Gefen satisfies ``c`` times
that bound for every element of every quantized tensor, whatever its second moment, shape or fused
path: ``|dp| <= c (1 + b1^(t-1)) K_t * lr`` (weight_decay 0) at every step, with ``c = bound_updates``
(default 2.0, :data:`gefen_dist.core.step.DEFAULT_BOUND_UPDATES`; ``True`` is ``c = 1``): ``c K_t``
relaxed by up to 2x in the first steps (:func:`gefen_dist.core.step.clamp_bound`).

The bound is :func:`gefen_dist.core.step.clamp_bound`; every path (eager, native CPU, Triton)
clamps the normalised update to it (tests/test_bound_kernels.py checks the kernels
against the reference). These tests were written against the research prototype in
``research/update_bound/`` before the library change, and fail on the unbounded update
(``Gefen(bound_updates=False)``).
"""
from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from gefen_dist import Gefen
from gefen_dist.core.step import DEFAULT_BOUND_UPDATES, bound_factor, clamp_bound, update_bound

from _workloads import dead_first_batch_mlp

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

SETTINGS = dict(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
FUSED = (None, False)


def _adamw_ratio(g, b1, b2):
    """AdamW's |m_hat_t| / sqrt(v_hat_t) (eps 0) after the float64 sequence g."""
    t = len(g)
    m = sum((1 - b1) * b1 ** (t - 1 - k) * x for k, x in enumerate(g)) / (1 - b1 ** t)
    v = sum((1 - b2) * b2 ** (t - 1 - k) * x * x for k, x in enumerate(g)) / (1 - b2 ** t)
    return abs(m) / math.sqrt(v)


# ------------------------------------------------------------------ the bound itself
def test_update_bound_values():
    assert update_bound(0.9, 0.999, 1) == pytest.approx(1.0, abs=1e-15)
    assert update_bound(0.9, 0.95, 1) == pytest.approx(1.0, abs=1e-15)
    assert update_bound(0.9, 0.999, 10 ** 7) == pytest.approx(0.1 / math.sqrt(0.001) / math.sqrt(1 - 0.81 / 0.999))
    assert update_bound(0.9, 0.999, 10 ** 7) == pytest.approx(7.2703, abs=1e-4)
    assert update_bound(0.9, 0.95, 10 ** 7) == pytest.approx(1.1650, abs=1e-4)
    for b1, b2 in ((0.9, 0.999), (0.9, 0.95), (0.5, 0.9), (0.95, 0.9)):
        ks = [update_bound(b1, b2, t) for t in range(1, 200)]
        assert all(b >= a for a, b in zip(ks, ks[1:]))  # non-decreasing in t


@pytest.mark.parametrize("betas", [(0.9, 0.999), (0.9, 0.95), (0.5, 0.9)])
def test_update_bound_is_adamws_tight_bound(betas):
    """K_t is attained by g_k = (b1/b2)^(t-k) and never exceeded by torch's AdamW."""
    b1, b2 = betas
    for t in (1, 2, 5, 20, 80):
        eq = [(b1 / b2) ** (t - 1 - k) for k in range(t)]
        assert _adamw_ratio(eq, b1, b2) == pytest.approx(update_bound(b1, b2, t), rel=1e-12)
    gen = torch.Generator().manual_seed(0)
    p = nn.Parameter(torch.zeros(4096, dtype=torch.float64))
    opt = torch.optim.AdamW([p], lr=1e-3, betas=betas, eps=1e-8, weight_decay=0.0)
    for t in range(1, 60):
        g = torch.distributions.Cauchy(0.0, 1.0).sample((4096,)).double() * (torch.rand(4096, generator=gen) < 0.3)
        g[:64] = (b1 / b2) ** (-t)  # the equality sequence in the first elements
        p.grad = g
        before = p.detach().clone()
        opt.step()
        assert float((p.detach() - before).abs().max()) <= update_bound(b1, b2, t) * 1e-3 * (1 + 1e-9)


# ------------------------------------------------------------------ adversarial gradients
SHAPES = [(1, 512), (512, 1), (512, 2), (1, 4, 128), (24, 40), (3, 5, 64), (96, 16), (2, 257)]
KINDS = ["gauss", "cauchy", "sparse", "onehot", "zero", "rowscale", "colscale", "tiny", "spike", "constant"]


def _grad(kind, shape, gen):
    n = math.prod(shape)
    rows = shape[0]
    if kind == "gauss":
        return torch.randn(shape, generator=gen)
    if kind == "cauchy":
        return torch.distributions.Cauchy(0.0, 1.0).sample(shape).clamp_(-1e30, 1e30)
    if kind == "sparse":
        return torch.randn(shape, generator=gen) * (torch.rand(shape, generator=gen) < 0.01)
    if kind == "onehot":
        g = torch.zeros(n)
        g[int(torch.randint(0, n, (1,), generator=gen))] = float(torch.randn(1, generator=gen)) * 10
        return g.view(shape)
    if kind == "zero":
        return torch.zeros(shape)
    if kind == "rowscale":  # rows of very different scales
        s = 10.0 ** torch.empty(rows).uniform_(-6, 6, generator=gen)
        return torch.randn(shape, generator=gen) * s.view(-1, *([1] * (len(shape) - 1)))
    if kind == "colscale":
        s = 10.0 ** torch.empty(shape[-1]).uniform_(-6, 6, generator=gen)
        return torch.randn(shape, generator=gen) * s
    if kind == "tiny":
        return torch.randn(shape, generator=gen) * 1e-30
    if kind == "spike":
        g = torch.randn(shape, generator=gen) * 1e-3
        g.view(-1)[int(torch.randint(0, n, (1,), generator=gen))] = 1e3
        return g
    if kind == "constant":
        return torch.full(shape, 0.5)
    raise ValueError(kind)


@settings(**SETTINGS)
@given(shape=st.sampled_from(SHAPES), mode=st.sampled_from(["factored", "shared", "elementwise", "span"]),
       fused=st.sampled_from(FUSED), betas=st.sampled_from([(0.9, 0.999), (0.9, 0.95), (0.5, 0.9), (0.95, 0.9)]),
       lr=st.sampled_from([1e-3, 3e-2]), kinds=st.lists(st.sampled_from(KINDS), min_size=1, max_size=7),
       first_dense=st.sampled_from([1.0, 0.01, 0.0005]), seed=st.integers(0, 2 ** 16),
       bound=st.sampled_from([None, True, 1.5]))
def test_every_step_within_the_bound(shape, mode, fused, betas, lr, kinds, first_dense, seed, bound):
    """``|dp| <= c K_t lr`` at every step, for the default ``c`` (``bound`` None), AdamW's own (True)
    and another factor."""
    gen = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    p = nn.Parameter(torch.randn(shape, generator=gen) * 0.02)
    kw = {} if bound is None else dict(bound_updates=bound)
    c = bound_factor(DEFAULT_BOUND_UPDATES if bound is None else bound)
    if mode == "span":  # narrow rows in blocks of rows (D16): (512, 1), (512, 2), (96, 16), (24, 40)
        kw.update(second_moment="factored", narrow_rows="span")
    else:
        kw.update(second_moment=mode)
    opt = Gefen([p], lr=lr, betas=betas, eps=1e-8, weight_decay=0.0, small_threshold=256, fused=fused, **kw)
    for i, kind in enumerate(kinds):
        g = _grad(kind, shape, gen)
        if i == 0 and first_dense < 1.0:  # a mostly-zero first gradient
            g = g * (torch.rand(shape, generator=gen) < first_dense)
        p.grad = g
        before = p.detach().double().clone()
        opt.step()
        t = opt.state[p]["step"]
        dp = float((p.detach().double() - before).abs().max())
        slack = 4 * torch.finfo(torch.float32).eps * max(1.0, float(before.abs().max()))
        K = clamp_bound(c, betas[0], betas[1], t)
        assert math.isfinite(dp) and dp <= K * lr * (1 + 1e-5) + slack, (
            f"step {t} ({kind}): max|dp|/lr = {dp / lr:.4g} > c (1 + b1^(t-1)) K_t = {K:.4g}")


@pytest.mark.parametrize("fused", FUSED)
@pytest.mark.parametrize("shape,mode", [((1, 197, 768), "factored"), ((1, 4096), "factored"),
                                        ((1000, 1000), "elementwise"), ((1, 4096), "shared")])
@pytest.mark.parametrize("bound", [None, True])
def test_one_gaussian_step_moves_each_weight_at_most_c_lr(shape, mode, fused, bound):
    """The issue's one-step rows (unbounded: up to thousands of lr): at t = 1 AdamW moves every weight
    by lr (K_1 = 1); Gefen by at most 2c lr (the first step's relaxed clamp): 4 lr with the default
    factor, 2 lr with ``bound_updates=True``."""
    torch.manual_seed(0)
    p = nn.Parameter(torch.randn(shape) * 0.02)
    kw = {} if bound is None else dict(bound_updates=bound)
    c = bound_factor(DEFAULT_BOUND_UPDATES if bound is None else bound)
    opt = Gefen([p], lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, second_moment=mode, fused=fused,
                **kw)
    p.grad = torch.randn(shape)
    before = p.detach().clone()
    opt.step()
    assert float((p.detach() - before).abs().max()) / 1e-3 <= 2 * c * (1.0 + 1e-3)


# ------------------------------------------------------------------ training workloads
def _make(name, params, fused):
    kw = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)
    if name == "adamw":
        return torch.optim.AdamW(params, **kw)
    return Gefen(params, fused=fused, **kw)


def _bag(name, fused, steps=300, feats=2000, hidden=64, out=8, batch=48, active=8):
    """Linear(2000 sparse Zipf one-hot features, 64) -> ReLU -> Linear(64, 8), MSE to a linear teacher
    (the issue's 400 steps at batch 64 shortened for time: AdamW 7.90, unbounded Gefen 17.20, the
    clamp 6.76, measured with research/update_bound/workloads.py's bag at these settings)."""
    g = torch.Generator().manual_seed(1000)
    zipf = 1.0 / torch.arange(1, feats + 1, dtype=torch.float64) ** 1.1
    zipf = (zipf / zipf.sum()).float()
    teacher = torch.randn(feats, out, generator=g) * 1.6

    def batch_at(t):
        gg = torch.Generator().manual_seed(10_000 + t)
        ids = torch.multinomial(zipf.expand(batch, feats), active, replacement=False, generator=gg)
        x = torch.zeros(batch, feats).scatter_(1, ids, 1.0)
        return x, x @ teacher

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(feats, hidden), nn.ReLU(), nn.Linear(hidden, out))
    opt = _make(name, model.parameters(), fused)
    for t in range(steps):
        x, y = batch_at(t)
        opt.zero_grad(set_to_none=True)
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    xe, ye = zip(*(batch_at(100_000 + i) for i in range(8)))
    with torch.no_grad():
        return float(nn.functional.mse_loss(model(torch.cat(xe)), torch.cat(ye)))


def _mlp(name, fused, density):
    """tests/_workloads.py's ReLU MLP on a tanh teacher, the first gradient kept ``density`` dense."""
    return dead_first_batch_mlp(lambda ps: _make(name, ps, fused), density=density)[1]


WORKLOADS = {
    "bag_of_features": _bag,
    "dead_first_batch": lambda name, fused: _mlp(name, fused, density=0.01),
    "plain_mlp": lambda name, fused: _mlp(name, fused, density=1.0),
}


@pytest.mark.parametrize("workload", list(WORKLOADS))
def test_training_within_5_percent_of_adamw(workload):
    """The issue's three workloads with the default (``c = 2``): final loss within 5% of AdamW's."""
    fused = None
    run = WORKLOADS[workload]
    ref = run("adamw", fused)
    got = run("gefen", fused)
    assert math.isfinite(got) and got <= 1.05 * ref, f"{workload}: Gefen {got:.4f} vs AdamW {ref:.4f}"


def test_default_bound_is_twice_adamws():
    p = nn.Parameter(torch.zeros(64, 64))
    assert Gefen([p]).bound_updates == DEFAULT_BOUND_UPDATES == 2.0
    # the relaxation: 2c K_1 at the first step, c K_t once the first moment has forgotten it
    assert clamp_bound(2.0, 0.9, 0.95, 1) == pytest.approx(4.0)
    assert clamp_bound(2.0, 0.9, 0.95, 400) == pytest.approx(2 * update_bound(0.9, 0.95, 400), rel=1e-15)


@pytest.mark.parametrize("fused", FUSED)
@pytest.mark.parametrize("mode", ["factored", "shared", "elementwise"])
def test_bound_factor_clamps_at_c_times_adamws_bound(mode, fused):
    """``bound_updates=c`` (a factor >= 1) clamps at ``c (1 + b1^(t-1)) K_t``: on a (1, 4096) value head
    one Gaussian step moves some weight by more than K_1 = 1 lr (unbounded: tens of lr) and none by more
    than 4 lr, and every later step of a sparse/spiky sequence by at most the relaxed 2 K_t lr."""
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(3)
    shape = (1, 4096) if mode != "elementwise" else (64, 64)
    p = nn.Parameter(torch.randn(shape) * 0.02)
    opt = Gefen([p], lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0, second_moment=mode, fused=fused,
                bound_updates=2.0)
    moved = []
    for kind in ("gauss", "sparse", "spike", "onehot", "gauss"):
        p.grad = _grad(kind, shape, gen)
        before = p.detach().double().clone()
        opt.step()
        t = int(opt.state[p]["step"])
        K = update_bound(0.9, 0.95, t)
        dp = float((p.detach().double() - before).abs().max()) / 1e-3
        assert dp <= clamp_bound(2.0, 0.9, 0.95, t) * (1 + 1e-5) + 1e-3, (kind, dp, K)
        moved.append(dp / K)
    assert max(moved) > 1.05, moved  # the looser clamp is not AdamW's: some step exceeds K_t


@pytest.mark.parametrize("bad", [0.5, 0.0, -1.0, float("inf"), float("nan"), "yes", None, [2.0]])
def test_bound_updates_rejects_values_that_are_not_a_factor(bad):
    p = nn.Parameter(torch.zeros(64, 64))
    with pytest.raises(ValueError, match="bound_updates"):
        Gefen([p], bound_updates=bad)
