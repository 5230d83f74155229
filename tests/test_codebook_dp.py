"""The fast codebook DP (divide-and-conquer, native C and numpy) against the plain O(K N^2) DP."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from gefen_dist.core.codebook import NUM_BINS, NUM_CODEWORDS, bin_centres
from gefen_dist.kernels import dp as native_dp
from gefen_dist.kernels.dispatch import dp_segments, solve_codebook


def brute_force_dp(centres, weights, K):
    """Reference DP, written plainly: O(K N^2), loop over k, vectorised over (s, e).

    Returns (codebook float32 [K], seg_start int64 [K] (1-based), objective).
    """
    c = np.asarray(centres, dtype=np.float32).astype(np.float64)
    w = np.asarray(weights, dtype=np.float64)
    n = c.shape[0]
    W = [0.0] * (n + 1)
    S = [0.0] * (n + 1)
    Q = [0.0] * (n + 1)
    for i in range(1, n + 1):  # sequential prefix sums
        wi = float(w[i - 1])
        ci = float(c[i - 1])
        W[i] = W[i - 1] + wi
        S[i] = S[i - 1] + wi * ci
        Q[i] = Q[i - 1] + (wi * ci) * ci
    W, S, Q = np.array(W), np.array(S), np.array(Q)

    s = np.arange(1, n + 1)[:, None]
    e = np.arange(1, n + 1)[None, :]
    valid = s <= e
    with np.errstate(divide="ignore", invalid="ignore"):
        Wm = W[e] - W[s - 1]
        Sm = S[e] - S[s - 1]
        Qm = Q[e] - Q[s - 1]
        inf = np.inf
        cost_first = np.where(valid, Qm - 2 * (-1.0) * Sm + (-1.0) * (-1.0) * Wm, inf)
        cost_last = np.where(valid, Qm - 2 * 1.0 * Sm + 1.0 * 1.0 * Wm, inf)
        cost_mid = np.where(valid, Qm - Sm * Sm / Wm, inf)

    D = np.full((n + 1, K + 1), np.inf)
    D[0, 0] = 0.0
    arg = np.zeros((n + 1, K + 1), dtype=np.int64)
    for k in range(1, K + 1):
        cost = cost_first if k == 1 else cost_last if k == K else cost_mid
        tot = D[:n, k - 1][:, None] + cost  # row s-1 -> D[s-1][k-1]
        best = np.argmin(tot, axis=0)  # first minimum = smallest s (strict <)
        vals = tot[best, np.arange(n)]
        D[1:, k] = vals
        D[1:k, k] = np.inf  # e < k is infeasible
        arg[1:, k] = best + 1
    starts = np.empty(K, dtype=np.int64)
    e_ = n
    for k in range(K, 0, -1):
        starts[k - 1] = arg[e_, k]
        e_ = starts[k - 1] - 1
    assert e_ == 0
    ends = np.append(starts[1:] - 1, n)
    cb = ((S[ends] - S[starts - 1]) / (W[ends] - W[starts - 1])).astype(np.float32)
    cb[0], cb[-1] = -1.0, 1.0
    return cb, starts, float(D[n, K])


def _native_available() -> bool:
    return native_dp.solver() is not None


BACKENDS = [
    pytest.param("native", marks=pytest.mark.skipif(not _native_available(),
                                                   reason="no C compiler")),
    "numpy",
]


def _histogram(seed: int, n_active: int, dist: str) -> np.ndarray:
    rng = np.random.default_rng(seed)
    if dist == "gauss":  # realistic: bins concentrated around 0
        z = np.clip(rng.normal(0.0, 0.25, 200_000), -1, 1)
        counts = np.bincount(np.clip(np.floor((z + 1) * 2048).astype(np.int64), 0, NUM_BINS - 1),
                             minlength=NUM_BINS).astype(np.int64)
        keep = rng.choice(np.flatnonzero(counts), n_active, replace=False)
        out = np.zeros(NUM_BINS, dtype=np.int64)
        out[keep] = counts[keep]
        return out
    if dist == "grid":  # equally spaced, equal weights: exact ties everywhere
        out = np.zeros(NUM_BINS, dtype=np.int64)
        out[np.linspace(0, NUM_BINS - 1, n_active).round().astype(np.int64)] = 1
        return out
    bins = rng.choice(NUM_BINS, n_active, replace=False)
    if dist == "uniform":
        w = rng.integers(1, 1000, n_active)
    elif dist == "pareto":  # heavy-tailed
        w = np.minimum(np.ceil(rng.pareto(0.8, n_active) * 10), 1e12).astype(np.int64) + 1
    elif dist == "ones":
        w = np.ones(n_active, dtype=np.int64)
    elif dist == "few":  # many equal weights
        w = rng.choice([1, 2, 3], n_active)
    else:
        raise ValueError(dist)
    out = np.zeros(NUM_BINS, dtype=np.int64)
    out[bins] = w
    return out


CASES = [
    (0, 256, "uniform"),
    (1, 257, "ones"),
    (2, 300, "pareto"),
    (3, 450, "few"),
    (4, 520, "grid"),
    (5, 700, "gauss"),
    (6, 610, "pareto"),
]

_bf_cache: dict = {}


def _reference(case):
    if case not in _bf_cache:
        counts = _histogram(*case)
        idx = np.flatnonzero(counts)
        _bf_cache[case] = (counts, brute_force_dp(bin_centres()[idx], counts[idx], NUM_CODEWORDS))
    return _bf_cache[case]


def _assert_matches(cb, obj, ref_cb, ref_obj):
    assert obj == pytest.approx(ref_obj, rel=1e-9, abs=1e-300)
    if not np.array_equal(cb, ref_cb):  # float64 near-tie: a different, equally good split
        np.testing.assert_allclose(cb, ref_cb, rtol=0, atol=1e-6)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", CASES, ids=[f"{d}-{n}-s{s}" for s, n, d in CASES])
def test_matches_brute_force(case, backend):
    counts, (ref_cb, ref_starts, ref_obj) = _reference(case)
    res = solve_codebook(counts, backend=backend)
    assert res.method == ("native-dc" if backend == "native" else "numpy-dc")
    assert res.active_bins == case[1]
    cb = res.codebook.numpy()
    assert res.codebook.dtype == torch.float32 and cb.shape == (NUM_CODEWORDS,)
    _assert_matches(cb, res.sse, ref_cb, ref_obj)
    assert np.all(np.diff(cb) > 0)
    assert cb[0] == -1.0 and cb[-1] == 1.0


@pytest.mark.parametrize("case", CASES[:4], ids=[f"{d}-{n}-s{s}" for s, n, d in CASES[:4]])
def test_backends_bit_identical(case):
    if not _native_available():
        pytest.skip("no C compiler")
    counts = _histogram(*case)
    a = solve_codebook(counts, backend="native")
    b = solve_codebook(counts, backend="numpy")
    assert torch.equal(a.codebook, b.codebook)
    assert a.sse == b.sse
    np.testing.assert_array_equal(a.assignment, b.assignment)


@pytest.mark.parametrize("backend", BACKENDS)
def test_small_k_many_seeds(backend):
    """Small K and N, many seeds and tie-heavy weights, exact agreement with the brute force."""
    rng = np.random.default_rng(1234)
    for trial in range(150):
        K = int(rng.integers(2, 9))
        n = int(rng.integers(K, 45))
        idx = np.sort(rng.choice(NUM_BINS, n, replace=False))
        if trial % 3 == 0:
            idx = np.linspace(0, NUM_BINS - 1, n).round().astype(np.int64)
        w = rng.choice([1, 1, 2, 5], n) if trial % 2 else rng.integers(1, 10**6, n)
        c = bin_centres()[idx]
        ref_cb, ref_starts, ref_obj = brute_force_dp(c, w, K)
        cb, starts, obj, _ = dp_segments(c, w, K, backend=backend)
        _assert_matches(cb, obj, ref_cb, ref_obj)


def test_env_forces_numpy(monkeypatch):
    monkeypatch.setenv("GEFEN_DIST_NO_NATIVE", "1")
    res = solve_codebook(_histogram(0, 256, "uniform"))
    assert res.method == "numpy-dc"
    with pytest.raises(RuntimeError):
        solve_codebook(_histogram(0, 256, "uniform"), backend="native")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", [(7, 4096, "uniform"), (8, 900, "pareto"), (9, 2000, "few")])
def test_codewords_are_cluster_means(case, backend):
    counts = _histogram(*case)
    res = solve_codebook(counts, backend=backend)
    idx = np.flatnonzero(counts)
    c = bin_centres()[idx].astype(np.float64)
    w = counts[idx].astype(np.float64)
    a = res.assignment
    assert a.shape == (idx.size,) and np.all(np.diff(a) >= 0)
    assert np.array_equal(np.unique(a), np.arange(NUM_CODEWORDS))  # every cluster non-empty
    sw = np.bincount(a, weights=w, minlength=NUM_CODEWORDS)
    swc = np.bincount(a, weights=w * c, minlength=NUM_CODEWORDS)
    mean = swc / sw
    cb = res.codebook.numpy()
    assert cb[0] == -1.0 and cb[-1] == 1.0
    np.testing.assert_allclose(cb[1:-1], mean[1:-1].astype(np.float32), rtol=0, atol=1e-6)
    # the reported objective is the weighted SSE of that assignment (means for middle clusters)
    centre = np.where(np.isin(a, [0, NUM_CODEWORDS - 1]), cb[a].astype(np.float64), mean[a])
    sse = float(np.sum(w * (c - centre) ** 2))
    assert res.sse == pytest.approx(sse, rel=1e-6, abs=1e-9)


@pytest.mark.parametrize("n_active", [0, 1, 3, 255])
def test_pad_path(n_active):
    rng = np.random.default_rng(n_active)
    counts = np.zeros(NUM_BINS, dtype=np.int64)
    bins = rng.choice(NUM_BINS, n_active, replace=False)
    if n_active >= 3:
        bins[:2] = [0, NUM_BINS - 1]  # edge bins next to the pinned ends
    counts[bins] = rng.integers(1, 100, n_active)
    res = solve_codebook(torch.from_numpy(counts))
    cb = res.codebook.numpy()
    assert res.method == "pad" and res.active_bins == n_active
    assert cb.dtype == np.float32 and cb.shape == (NUM_CODEWORDS,)
    assert np.all(np.diff(cb) > 0)
    assert cb[0] == -1.0 and cb[-1] == 1.0
    inside = np.isin(bin_centres()[bins], cb)
    if n_active < NUM_CODEWORDS - 1:
        assert inside.all() and res.sse == 0.0
    else:
        # -1, +1 and 255 centres are 257 values: the centre cheapest to snap is left out
        assert inside.sum() == n_active - 1
        vals = np.sort(np.concatenate(([-1.0, 1.0], bin_centres()[bins].astype(np.float64))))
        w = counts[np.flatnonzero(counts)].astype(np.float64)
        d = np.diff(vals)
        snap = w * np.minimum(d[:-1], d[1:]) ** 2
        assert res.sse == pytest.approx(snap.min(), rel=1e-12)
        assert not inside[np.argsort(bin_centres()[bins])][np.argmin(snap)]
    again = solve_codebook(counts)
    assert torch.equal(again.codebook, res.codebook)  # deterministic


def test_pad_empty_is_midpoint_fill():
    cb = solve_codebook(np.zeros(NUM_BINS, dtype=np.int64)).codebook.numpy()
    # {-1, 1}, then 0, then +-0.5, ...: 129 values on the 1/64 grid after 127 insertions,
    # then the remaining 127 insertions split the leftmost 127 of its 128 equal gaps
    grid = np.linspace(-1, 1, 129)
    mids = (grid[:127] + grid[1:128]) / 2
    expected = np.sort(np.concatenate((grid, mids))).astype(np.float32)
    np.testing.assert_array_equal(cb, expected)


def test_bin_centres_exact():
    c = bin_centres()
    assert c.dtype == np.float32 and c.shape == (NUM_BINS,)
    j = np.arange(NUM_BINS)
    assert np.array_equal(c.astype(np.float64), -1 + (2 * j + 1) / 4096)


def test_bad_input():
    with pytest.raises(ValueError):
        solve_codebook(np.zeros(10, dtype=np.int64))
    bad = np.zeros(NUM_BINS, dtype=np.int64)
    bad[3] = -1
    with pytest.raises(ValueError):
        solve_codebook(bad)
