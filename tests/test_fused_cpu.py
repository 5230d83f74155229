"""The fused CPU step kernel (gefen_dist.kernels.cpu) against the eager reference.

Agreement contract (see the module docstring of gefen_dist.kernels.cpu):
* idx, scale and v bitwise equal to quantized_step_eager_ (v: when torch's sum order is
  reproduced on this machine; otherwise v differs in the last bit in some blocks); the same
  for the factored mode (idx, scale, v_row; v_col is computed with torch);
* float32 parameters within rtol 1e-6 (atol 1e-6 * max|p|) after 100 steps: the kernel's
  sqrt is correctly rounded, torch's (MKL) is not, so sigma may differ by one ulp, and the
  kernel's documented relaxations (update as C[idx] times the block's scalar product,
  per-element sigma with one division) move the update by a few ulps of itself;
* bfloat16 parameters: the same one-ulp sigma difference flips the single float32 -> bf16
  rounding for a tiny fraction of elements (at most 1e-3 here), by one bf16 ulp.
"""
from __future__ import annotations

import functools
import math
import os

import numpy as np
import pytest
import torch

from gefen_dist.core.quant import nearest_codeword
from gefen_dist.core.step import bias_corrections, quantized_step_eager_
from gefen_dist.kernels import cpu, cpu_tables

pytestmark = pytest.mark.skipif(not cpu.available(),
                                reason="native gefen_step library unavailable (no C compiler)")


# --------------------------------------------------------------------------------------
# codebooks
# --------------------------------------------------------------------------------------

def _pinned(inner: torch.Tensor) -> torch.Tensor:
    inner = torch.unique(inner.float().clamp(-0.999999, 0.999999))
    assert inner.numel() == 254
    return torch.cat([torch.tensor([-1.0]), inner, torch.tensor([1.0])])


def random_codebook(seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return _pinned(torch.rand(254, generator=g) * 2 - 1)


def dp_codebook() -> torch.Tensor:
    """A realistic codebook: the optimal one for a bell-shaped histogram."""
    return _dp_codebook().clone()


@functools.lru_cache(maxsize=None)
def _dp_codebook() -> torch.Tensor:
    from gefen_dist.core.codebook import NUM_BINS, solve_codebook

    c = (np.arange(NUM_BINS) + 0.5) / NUM_BINS * 2 - 1
    counts = np.round(1e6 * np.exp(-0.5 * (c / 0.15) ** 2)).astype(np.int64) + 1
    return solve_codebook(counts).codebook.float()


def dense_codebook() -> torch.Tensor:
    """Codewords 1e-6 apart near 0: too dense for a two-candidate table (scan mode)."""
    g = torch.Generator().manual_seed(3)
    outer = torch.rand(224, generator=g) * 2 - 1
    outer = outer[outer.abs() > 1e-3]
    dense = (torch.arange(254 - outer.numel(), dtype=torch.float64) * 1e-6 - 1e-5).float()
    return _pinned(torch.cat([outer, dense]))


CODEBOOKS = {"random": random_codebook, "dp": dp_codebook, "dense": dense_codebook}


@pytest.fixture(scope="module", params=sorted(CODEBOOKS))
def codebook(request):
    return CODEBOOKS[request.param]()


def test_table_modes():
    assert cpu.codebook_table(random_codebook()).mode == 1
    assert cpu.codebook_table(dp_codebook()).mode == 1
    assert cpu.codebook_table(dense_codebook()).mode == 0


def test_table_cache_keyed_by_contents():
    cb = random_codebook(5)
    t1 = cpu.codebook_table(cb)
    assert cpu.codebook_table(cb.clone()) is t1
    cb2 = cb.clone()
    cb2[100] = (cb2[99] + cb2[100]) / 2  # same tensor object edited in place -> new table
    assert cpu.codebook_table(cb2) is not t1


# --------------------------------------------------------------------------------------
# nearest codeword: table lookup == searchsorted + tie rule, for every float32 z
# --------------------------------------------------------------------------------------

def _ulp_neighbours(x: np.ndarray, k: int = 3) -> np.ndarray:
    x = np.asarray(x, dtype=np.float32)
    out = [x]
    up, down = x.copy(), x.copy()
    for _ in range(k):
        up = np.nextafter(up, np.float32(np.inf))
        down = np.nextafter(down, np.float32(-np.inf))
        out += [up, down]
    return np.concatenate(out)


def adversarial_z(cb: torch.Tensor) -> np.ndarray:
    c = cb.numpy().astype(np.float64)
    mids64 = (c[1:] + c[:-1]) / 2
    specials = np.array([0.0, -0.0, 1.0, -1.0, 2.0, -2.0, 1e30, -1e30, np.inf, -np.inf, np.nan,
                         1e-45, -1e-45, 1e-40, -1e-40, 1.1754944e-38, -1.1754944e-38, 0.5, -0.5],
                        dtype=np.float32)
    tab = cpu.codebook_table(cb)
    bounds = cpu_tables._bucket_lower_bounds(tab.nb)[1:]
    parts = [
        _ulp_neighbours(c.astype(np.float32)),
        _ulp_neighbours(mids64.astype(np.float32)),
        # exact float32 midpoints where they exist, and float32 rounding of the double ones
        _ulp_neighbours(((c[1:].astype(np.float32) + c[:-1].astype(np.float32)) / 2)),
        _ulp_neighbours(specials, 2),
        _ulp_neighbours(bounds, 1),
    ]
    rng = np.random.default_rng(0)
    parts.append(rng.integers(0, 2**32, 1 << 20, dtype=np.uint64).astype(np.uint32).view(np.float32))
    parts.append(rng.uniform(-1, 1, 1 << 20).astype(np.float32))
    parts.append((rng.standard_normal(1 << 18) * 1e-3).astype(np.float32))
    return np.concatenate(parts)


def test_lut_nearest_matches_reference(codebook):
    z = torch.from_numpy(adversarial_z(codebook))
    ref = nearest_codeword(z, codebook)
    got = cpu.nearest_lut(z, codebook)
    bad = torch.nonzero(ref != got).flatten()
    assert bad.numel() == 0, (z[bad[:5]].tolist(), ref[bad[:5]].tolist(), got[bad[:5]].tolist())


def test_sweep_reference_is_torch(codebook):
    """The C brute-force reference that the sweeps below compare the table with agrees with
    torch's searchsorted + tie rule."""
    z = torch.from_numpy(adversarial_z(codebook))
    assert torch.equal(cpu._nearest_bruteforce(z, codebook), nearest_codeword(z, codebook))


def test_lut_sweep_binades(codebook):
    """Every float32 with 2^-8 <= |z| <= 1 (both signs, 2*8*2^23 patterns) plus the 4096
    patterns just beyond +-1 (smaller |z|: random and adversarial sets above, and the
    opt-in sweep of all 2^32 patterns)."""
    lo = np.float32(2.0 ** -8).view(np.uint32)
    one = np.float32(1.0).view(np.uint32)
    for sign in (0, 0x80000000):
        bad, where = cpu.nearest_sweep(codebook, int(lo) | sign, (int(one) + 4096) | sign)
        assert bad == 0, hex(where)


@pytest.mark.slow
@pytest.mark.skipif(os.environ.get("GEFEN_DIST_SLOW_TESTS", "0") in ("", "0"),
                    reason="~2 min; set GEFEN_DIST_SLOW_TESTS=1")
def test_lut_sweep_all_floats():
    """All 2^32 float32 bit patterns, three codebooks."""
    for cb in (random_codebook(), dp_codebook(), dense_codebook()):
        bad, where = cpu.nearest_sweep(cb, 0, 2**32 - 1)
        assert bad == 0, hex(where)


# --------------------------------------------------------------------------------------
# the step against the eager path
# --------------------------------------------------------------------------------------

HP = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1)


def _state(n, P, B, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    p = (torch.randn(n, generator=g) * 0.02).to(dtype)
    idx = torch.full((n,), 127, dtype=torch.uint8)
    return p, idx, torch.zeros(n // B), torch.zeros(n // P)


@pytest.fixture
def one_thread():
    """Eager comparisons run single-threaded: torch's intra-op threads make the many small
    eager ops slow on a loaded machine. (1 vs 2 kernel threads is tested bitwise below.)"""
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


def _run_both(shape, P, B, dtype, cb, steps, seed=0, hp=HP, grad_hook=None):
    n = math.prod(shape)
    ref = _state(n, P, B, dtype, seed)
    fus = tuple(t.clone() for t in ref)
    g = torch.Generator().manual_seed(seed + 1)
    row_scale = torch.exp(torch.randn(shape[0], 1, generator=g)).expand(shape).reshape(-1)
    for step in range(1, steps + 1):
        grad = (torch.randn(n, generator=g) * 1e-3 * row_scale).to(dtype)
        if grad_hook is not None:
            grad_hook(step, grad)
        bc1, bc2 = bias_corrections(step, hp["beta1"], hp["beta2"])
        kw = dict(hp, bc1=bc1, bc2=bc2, period=P, scale_block=B)
        quantized_step_eager_(*ref[:1], grad, *ref[1:], cb, **kw)
        cpu.quantized_step_(*fus[:1], grad, *fus[1:], cb, **kw)
    return ref, fus


def _assert_state_equal(ref, fus):
    _, idx, sc, v = ref
    _, idx2, sc2, v2 = fus
    assert torch.equal(idx, idx2), (idx != idx2).float().mean().item()
    assert torch.equal(sc.view(torch.int32), sc2.view(torch.int32))
    if cpu.numerics().sum_lanes:
        assert torch.equal(v.view(torch.int32), v2.view(torch.int32)), (v != v2).float().mean().item()
    else:  # double accumulation: last-bit differences in some blocks
        torch.testing.assert_close(v2, v, rtol=1e-6, atol=0)


def _assert_params_close(p, p2):
    if p.dtype == torch.float32:
        torch.testing.assert_close(p2, p, rtol=1e-6, atol=1e-6 * p.abs().max().item())
    else:
        a, b = p.float(), p2.float()
        diff = (a - b).abs()
        assert (diff > 0).float().mean().item() <= 1e-3
        assert bool((diff <= a.abs() * 2.0 ** -7 + 1e-30).all())


CASES = [
    # (shape, P, B)
    ((64, 384), 1, 256),
    ((64, 192), 64, 64),
    ((32, 768), 768, 768),
    ((16, 1031), 1031, 1031),
]


@pytest.mark.parametrize("shape,P,B", CASES)
def test_matches_eager_fp32(shape, P, B, one_thread):
    cb = dp_codebook()
    ref, fus = _run_both(shape, P, B, torch.float32, cb, steps=100)
    _assert_state_equal(ref, fus)
    _assert_params_close(ref[0], fus[0])


@pytest.mark.parametrize("shape,P,B", [CASES[0], CASES[2]])
def test_matches_eager_bf16(shape, P, B, one_thread):
    cb = dp_codebook()
    ref, fus = _run_both(shape, P, B, torch.bfloat16, cb, steps=100)
    _assert_state_equal(ref, fus)
    _assert_params_close(ref[0], fus[0])


@pytest.mark.parametrize("cbname", ["random", "dense"])
def test_matches_eager_other_codebooks(cbname, one_thread):
    ref, fus = _run_both((32, 768), 768, 768, torch.float32, CODEBOOKS[cbname](), steps=20)
    _assert_state_equal(ref, fus)
    _assert_params_close(ref[0], fus[0])


def test_large_prime_period(one_thread):
    ref, fus = _run_both((8, 4099), 4099, 4099, torch.float32, dp_codebook(), steps=20)
    _assert_state_equal(ref, fus)
    _assert_params_close(ref[0], fus[0])


def test_per_element_v_odd_scale_block(one_thread):
    ref, fus = _run_both((1031, 12), 1, 1031, torch.float32, dp_codebook(), steps=20)
    _assert_state_equal(ref, fus)
    _assert_params_close(ref[0], fus[0])


@pytest.mark.parametrize("hp", [dict(HP, weight_decay=0.0), dict(HP, beta1=0.3, lr=3e-2)])
def test_no_decay_and_large_lerp_weight(hp, one_thread):
    ref, fus = _run_both((16, 768), 768, 768, torch.float32, dp_codebook(), steps=20, hp=hp)
    _assert_state_equal(ref, fus)
    _assert_params_close(ref[0], fus[0])


def test_nonfinite_gradients_like_eager(one_thread):
    def hook(step, grad):
        if step == 3:
            grad[5] = float("nan")
            grad[800] = float("inf")

    ref, fus = _run_both((4, 768), 768, 768, torch.float32, dp_codebook(), steps=4,
                         grad_hook=hook)
    assert torch.equal(ref[1], fus[1])
    assert torch.equal(ref[2].isnan(), fus[2].isnan())
    assert torch.equal(ref[0].isnan(), fus[0].isnan())
    assert torch.equal(ref[3].isnan(), fus[3].isnan())


# --------------------------------------------------------------------------------------
# determinism
# --------------------------------------------------------------------------------------

def _fused_run(shape, P, B, dtype, steps=3):
    cb = dp_codebook()
    n = math.prod(shape)
    p, idx, sc, v = _state(n, P, B, dtype, 7)
    g = torch.Generator().manual_seed(8)
    for step in range(1, steps + 1):
        grad = (torch.randn(n, generator=g) * 1e-3).to(dtype)
        bc1, bc2 = bias_corrections(step, 0.9, 0.999)
        cpu.quantized_step_(p, grad, idx, sc, v, cb, **HP, bc1=bc1, bc2=bc2, period=P,
                            scale_block=B)
    return p, idx, sc, v


def _bitwise(a, b):
    for x, y in zip(a, b):
        assert torch.equal(x.view(torch.uint8), y.view(torch.uint8))


@pytest.mark.parametrize("shape,P,B,dtype", [((512, 768), 768, 768, torch.float32),
                                             ((512, 768), 1, 256, torch.float32),
                                             ((64, 4099), 4099, 4099, torch.bfloat16)])
def test_thread_count_independent(shape, P, B, dtype):
    old = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = _fused_run(shape, P, B, dtype)
        torch.set_num_threads(2)
        two = _fused_run(shape, P, B, dtype)
    finally:
        torch.set_num_threads(old)
    _bitwise(one, two)


def test_recompute_path_equals_buffered(monkeypatch):
    for P, B in ((768, 768), (1, 256)):
        buffered = _fused_run((128, 768), P, B, torch.float32)
        monkeypatch.setattr(cpu, "_BUF_MAX_ELEMS", 0)
        recomputed = _fused_run((128, 768), P, B, torch.float32)
        monkeypatch.undo()
        _bitwise(buffered, recomputed)


@pytest.mark.skipif(not cpu.simd_compiled(), reason="no intrinsics path (AVX-512 VBMI or AVX2) for this CPU")
@pytest.mark.parametrize("shape,P,B,dtype", [((8, 768), 768, 768, torch.float32),
                                             ((4, 1031), 1031, 1031, torch.bfloat16),
                                             ((16, 256), 1, 256, torch.float32),
                                             ((1031, 4), 1, 1031, torch.bfloat16),
                                             ((10, 100), 100, 100, torch.float32),
                                             ((7, 7), 7, 7, torch.bfloat16),
                                             ((5, 5), 1, 1, torch.float32)])
@pytest.mark.parametrize("variant", ["plain", "recompute", "nonfinite", "no_decay_large_w"])
def test_simd_path_equals_portable(monkeypatch, shape, P, B, dtype, variant):
    """The intrinsics path is bitwise the portable C path, including block tails (B not a multiple
    of 64 or 8), NaN/inf gradients and both lerp forms, with each of its table forms: on AVX-512
    VBMI the two-level nearest-codeword table in registers (simd=1, the default), gathers from the
    int32 table (simd=2) and from its byte copy (simd=3); on AVX2 per-bucket entries with the
    pair's flip point (simd=1), gathers from the int32 table (2) and from its byte copy (3)."""
    cb = dp_codebook()
    n = math.prod(shape)
    hp = dict(HP, weight_decay=0.0, beta1=0.3) if variant == "no_decay_large_w" else HP
    if variant == "recompute":
        monkeypatch.setattr(cpu, "_BUF_MAX_ELEMS", 0)
    outs = []
    for simd in (1, 2, 3, 0):
        p, idx, sc, v = _state(n, P, B, dtype, 11)
        g = torch.Generator().manual_seed(12)
        for step in range(1, 4):
            grad = (torch.randn(n, generator=g) * 1e-3).to(dtype)
            if variant == "nonfinite" and step == 2:
                grad[n // 3] = float("nan")
                grad[n // 2] = float("inf")
            bc1, bc2 = bias_corrections(step, hp["beta1"], hp["beta2"])
            cpu.quantized_step_(p, grad, idx, sc, v, cb, **hp, bc1=bc1, bc2=bc2, period=P,
                                scale_block=B, simd=simd)
        outs.append((p, idx, sc, v))
    for other in outs[1:]:
        _bitwise(outs[0], other)


def _has_cpu_flag(flag: str) -> bool:
    try:
        with open("/proc/cpuinfo") as f:
            return any(line.startswith("flags") and flag in line.split() for line in f)
    except OSError:
        return False


@pytest.mark.skipif(not cpu.simd_compiled(), reason="no intrinsics path (AVX-512 VBMI or AVX2) for this CPU")
def test_two_level_table_every_bucket():
    """The register two-level table gives the same codeword as the gathered table in every one of
    the 4096 buckets, at both ends of each (z = each bucket's lower bound and the float below it)."""
    cb = dp_codebook()
    if _has_cpu_flag("avx512_bitalg") and _has_cpu_flag("avx512vbmi") and "-mno-avx512" not in os.environ.get(
            "GEFEN_DIST_CFLAGS", ""):  # (the two-level table is the VBMI path's, which such flags leave out)
        assert cpu.two_level_table(cb)  # a realistic codebook takes the gather-free path
    nb = cpu.codebook_table(cb).nb
    lo = torch.from_numpy(cpu_tables._bucket_lower_bounds(nb)[1:].copy())
    z = torch.cat([lo, torch.nextafter(lo, torch.full_like(lo, -2.0)), torch.tensor([-1.0, 0.0, 1.0])])
    n = z.numel() - z.numel() % 64 + 64
    g = torch.zeros(n)
    g[: z.numel()] = z
    outs = []
    for simd in (1, 2):
        p, idx, sc, v = _state(n, n, n, torch.float32, 3)
        idx.fill_(0)
        bc1, bc2 = bias_corrections(1, HP["beta1"], HP["beta2"])
        cpu.quantized_step_(p, g, idx, sc, v, cb, **HP, bc1=bc1, bc2=bc2, period=n, scale_block=n, simd=simd)
        outs.append((p, idx, sc, v))
    assert len(set(outs[0][1].tolist())) > 200  # the codewords are really spanned
    _bitwise(*outs)


def _flip_points(cb: torch.Tensor) -> np.ndarray:
    """For each adjacent codeword pair, the smallest float32 z the two-candidate rule sends to the
    upper one (nearest_fast: z > c1 or |z - c1| < |z - c0|, float32 arithmetic), by bisection over
    the float32 bit patterns of [c0, c1]: the AVX2 entries' thresholds, computed independently."""
    c = cb.numpy().astype(np.float32)

    def upper(z, c0, c1):
        z = np.float32(z)
        return bool(z > c1 or abs(np.float32(z - c1)) < abs(np.float32(z - c0)))

    def key(x):  # float32 order as a signed integer
        u = int(np.array(x, dtype=np.float32).view(np.uint32))
        return -(u & 0x7FFFFFFF) if u >> 31 else u

    def unkey(k):
        u = (-k) | 0x80000000 if k < 0 else k
        return np.array(u, dtype=np.uint32).view(np.float32)[()]

    out = []
    for k in range(c.size - 1):
        c0, c1 = c[k], c[k + 1]
        lo, hi = key(c0), key(c1) + 1
        assert not upper(c0, c0, c1)
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (lo, mid) if upper(unkey(mid), c0, c1) else (mid, hi)
        out.append(unkey(hi))
    return np.array(out, dtype=np.float32)


def crowded_codebook() -> torch.Tensor:
    """Three codewords 3e-5 apart: a two-candidate table needs 65,536 buckets (the AVX2 path then
    gathers from the table instead of building per-bucket entries)."""
    inner = random_codebook(1)[1:-1].clone()
    x = float(inner[99])
    inner[100], inner[101] = x + 3e-5, x + 6e-5
    return torch.cat([torch.tensor([-1.0]), torch.sort(inner)[0], torch.tensor([1.0])])


@pytest.mark.skipif(not cpu.simd_compiled(), reason="no intrinsics path (AVX-512 VBMI or AVX2) for this CPU")
def test_simd_equals_portable_with_a_large_table():
    """A codebook whose two-candidate table is large (65,536 buckets): every simd form is bitwise the
    portable loops, factored and shared, with z values near the crowded codewords."""
    cb = crowded_codebook()
    tab = cpu.codebook_table(cb)
    assert tab.mode == 1 and tab.nb == 65536
    rows, slab = 6, 768
    g = torch.Generator().manual_seed(9)
    outs = []
    for simd in (1, 2, 3, 0):
        p, idx, sc, v = _state(rows * slab, slab, slab, torch.float32, 3)
        st = _fstate(rows, slab, slab, torch.float32, 4)
        gen = torch.Generator().manual_seed(9)
        for step in range(1, 4):
            grad = torch.randn(rows * slab, generator=gen) * 1e-3
            grad[::7] = float(cb[101]) * 1e-3  # m near the crowded codewords once scaled
            bc1, bc2 = bias_corrections(step, HP["beta1"], HP["beta2"])
            cpu.quantized_step_(p, grad, idx, sc, v, cb, **HP, bc1=bc1, bc2=bc2, period=slab, scale_block=slab,
                                simd=simd)
            from gefen_dist.core.step import column_sumsq
            cms = (column_sumsq(grad, slab) / rows).float()
            cpu.quantized_step_factored_(st[0], grad, st[1], st[2], st[3], st[4], cb, cms, **HP, bc1=bc1, bc2=bc2,
                                         scale_block=slab, simd=simd)
        outs.append((p, idx, sc, v, *st))
    for other in outs[1:]:
        _bitwise(outs[0], other)


@pytest.mark.skipif(not cpu.simd_compiled(), reason="no intrinsics path (AVX-512 VBMI or AVX2) for this CPU")
@pytest.mark.parametrize("cbname", ["dp", "random"])
def test_nearest_at_every_flip_point(cbname):
    """z exactly at each codeword pair's flip point and one float below it (beta1 = 0 makes m = g and
    the block's absmax 1 makes z = m): every simd table form picks the reference's codeword (the AVX2
    entries decide by z >= a precomputed flip point instead of comparing distances)."""
    cb = CODEBOOKS[cbname]()
    thr = _flip_points(cb)
    thr = thr[np.isfinite(thr) & (np.abs(thr) < 1)]
    z = np.concatenate([thr, np.nextafter(thr, np.float32(-2)), np.float32([1.0, -1.0, 0.0])])
    n = z.size + (-z.size) % 8 + 8  # vector lanes only, and a short scalar tail
    g = torch.zeros(n)
    g[: z.size] = torch.from_numpy(z)
    hp = dict(HP, beta1=0.0)
    bc1, bc2 = bias_corrections(1, hp["beta1"], hp["beta2"])
    outs = []
    for simd in (1, 2, 3, 0):
        p, idx, sc, v = _state(n, n, n, torch.float32, 3)
        cpu.quantized_step_(p, g, idx, sc, v, cb, **hp, bc1=bc1, bc2=bc2, period=n, scale_block=n, simd=simd)
        outs.append((p, idx, sc, v))
    assert float(outs[0][2][0]) == 1.0
    assert torch.equal(outs[0][1][: z.size], nearest_codeword(torch.from_numpy(z), cb).to(torch.uint8))
    for other in outs[1:]:
        _bitwise(outs[0], other)


# --------------------------------------------------------------------------------------
# factored second moment
# --------------------------------------------------------------------------------------

def _fstate(rows, slab, B, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    p = (torch.randn(rows * slab, generator=g) * 0.02).to(dtype)
    idx = torch.full((rows * slab,), 127, dtype=torch.uint8)
    return p, idx, torch.zeros(rows * slab // B), torch.zeros(rows, 1), torch.zeros(slab)


def _run_factored(rows, slab, B, dtype, steps, fns, seed=0, hp=HP, grad_hook=None):
    """The same gradients through each step function in ``fns``; returns their states."""
    from gefen_dist.core.step import column_sumsq

    states = [_fstate(rows, slab, B, dtype, seed) for _ in fns]
    g = torch.Generator().manual_seed(seed + 1)
    row_scale = torch.exp(torch.randn(rows, 1, generator=g))
    col_scale = torch.exp(0.5 * torch.randn(1, slab, generator=g))
    for step in range(1, steps + 1):
        grad = (torch.randn(rows, slab, generator=g) * 1e-3 * row_scale * col_scale).reshape(-1).to(dtype)
        if grad_hook is not None:
            grad_hook(step, grad)
        cms = (column_sumsq(grad, slab) / rows).float()
        bc1, bc2 = bias_corrections(step, hp["beta1"], hp["beta2"])
        for fn, (p, idx, sc, vr, vc) in zip(fns, states):
            fn(p, grad, idx, sc, vr, vc, dp_codebook(), cms, **hp, bc1=bc1, bc2=bc2, scale_block=B)
    return states


FCASES = [((64, 768), 256), ((32, 384), 384), ((16, 1031), 1031), ((8, 4099), 4099)]


@pytest.mark.parametrize("shape,B", FCASES)
def test_factored_matches_eager_fp32(shape, B, one_thread):
    from gefen_dist.core.step import quantized_step_factored_eager_

    ref, fus = _run_factored(*shape, B, torch.float32, 100,
                             [quantized_step_factored_eager_, cpu.quantized_step_factored_])
    _assert_state_equal((None, *ref[1:4]), (None, *fus[1:4]))
    assert torch.equal(ref[4].view(torch.int32), fus[4].view(torch.int32))  # v_col: same torch ops
    _assert_params_close(ref[0], fus[0])


@pytest.mark.parametrize("shape,B", [FCASES[0], FCASES[2]])
def test_factored_matches_eager_bf16(shape, B, one_thread):
    from gefen_dist.core.step import quantized_step_factored_eager_

    ref, fus = _run_factored(*shape, B, torch.bfloat16, 100,
                             [quantized_step_factored_eager_, cpu.quantized_step_factored_])
    _assert_state_equal((None, *ref[1:4]), (None, *fus[1:4]))
    _assert_params_close(ref[0], fus[0])


def test_factored_nonfinite_like_eager(one_thread):
    from gefen_dist.core.step import quantized_step_factored_eager_

    def hook(step, grad):
        if step == 3:
            grad[5] = float("nan")
            grad[800] = float("inf")

    ref, fus = _run_factored(4, 768, 256, torch.float32, 4,
                             [quantized_step_factored_eager_, cpu.quantized_step_factored_],
                             grad_hook=hook)
    assert torch.equal(ref[1], fus[1])
    for a, b in zip(ref, fus):
        assert torch.equal(a.isnan(), b.isnan())


def test_factored_thread_count_independent():
    old = torch.get_num_threads()
    outs = []
    try:
        for nt in (1, 2):
            torch.set_num_threads(nt)
            outs.append(_run_factored(256, 768, 256, torch.float32, 3, [cpu.quantized_step_factored_],
                                      seed=3)[0])
    finally:
        torch.set_num_threads(old)
    _bitwise(*outs)


# (rows, slab), scale block, dtype: blocks shorter than the row; rows that are one block (the AVX2
# path then takes the row sum in its first sweep), with 8-lane items that fill no group of four
# (slab 12), a leftover item and a scalar remainder (slab 44), and enough groups of four for the
# row sum's upper cascade levels (slab 20000: 625 groups, level 2 after 256)
SIMD_FCASES = [((8, 768), 256, torch.float32), ((4, 1031), 1031, torch.bfloat16), ((6, 100), 50, torch.float32),
               ((5, 768), 768, torch.float32), ((7, 12), 12, torch.float32), ((3, 44), 44, torch.bfloat16),
               ((3, 20000), 20000, torch.float32), ((2, 20000), 20000, torch.bfloat16)]


@pytest.mark.skipif(not cpu.simd_compiled(), reason="no intrinsics path (AVX-512 VBMI or AVX2) for this CPU")
@pytest.mark.parametrize("shape,B,dtype", SIMD_FCASES)
@pytest.mark.parametrize("nonfinite", [False, True])
def test_factored_simd_equals_portable(shape, B, dtype, nonfinite):
    """The intrinsics path's factored step (every simd table form) is bitwise the portable C loops,
    NaN/inf gradients included (a NaN row and an inf row at step 2)."""
    rows, slab = shape

    def hook(step, grad):
        if nonfinite and step == 2:
            grad[slab // 3] = float("nan")
            grad[slab + 1] = float("inf")

    outs = []
    for simd in (1, 2, 3, 0):
        step = functools.partial(cpu.quantized_step_factored_, simd=simd)
        outs.append(_run_factored(*shape, B, dtype, 3, [step], seed=5, grad_hook=hook)[0])
    for other in outs[1:]:
        _bitwise(outs[0], other)


def test_factored_falls_back_to_eager_without_native(monkeypatch, one_thread):
    from gefen_dist.core.step import quantized_step_factored_eager_

    monkeypatch.setenv("GEFEN_DIST_NO_NATIVE", "1")
    assert not cpu.available()
    ref, fus = _run_factored(8, 768, 256, torch.float32, 3,
                             [quantized_step_factored_eager_, cpu.quantized_step_factored_])
    _bitwise(ref, fus)


def test_factored_rejects_bad_arguments():
    p, idx, sc, vr, vc = _fstate(4, 768, 256, torch.float32, 0)
    kw = dict(HP, bc1=0.1, bc2=0.001)
    with pytest.raises(ValueError):  # scale block does not divide the row
        cpu.quantized_step_factored_(p, torch.zeros_like(p), idx, sc, vr, vc, dp_codebook(),
                                     torch.zeros(768), **kw, scale_block=500)


def test_optimizer_dispatches_factored_to_kernel(monkeypatch):
    """Gefen sends factored tensors to the fused kernel (fused=None) and to the eager path
    with fused=False, and both agree."""
    from gefen_dist import Gefen

    import dataclasses

    from gefen_dist.kernels import dispatch

    calls = []
    real = dispatch._native_cpu()

    def spy(*a, **k):
        calls.append(1)
        return real.quantized_step_factored_(*a, **k)

    # the dispatcher caches its implementations, so spy on the one it hands out (patching the
    # cpu module's function would miss a table built by an earlier test)
    spied = dataclasses.replace(real, quantized_step_factored_=spy)
    monkeypatch.setattr(dispatch, "_native_cpu", lambda: spied)
    outs = []
    for fused in (None, False):
        torch.manual_seed(0)
        w = torch.nn.Parameter(torch.randn(64, 256) * 0.02)
        opt = Gefen([w], lr=1e-3, second_moment="factored", fused=fused)
        g = torch.Generator().manual_seed(1)
        for _ in range(5):
            w.grad = torch.randn(64, 256, generator=g) * 1e-3
            opt.step()
        outs.append(w.detach().clone())
        if fused is None:
            assert calls, "factored step did not reach the fused kernel"
            n = len(calls)
    assert len(calls) == n  # fused=False: eager only
    torch.testing.assert_close(outs[0], outs[1], rtol=1e-6, atol=1e-6 * outs[1].abs().max().item())


# --------------------------------------------------------------------------------------
# contract
# --------------------------------------------------------------------------------------

def test_rejects_bad_arguments():
    cb = dp_codebook()
    p, idx, sc, v = _state(768 * 2, 768, 768, torch.float32, 0)
    g = torch.zeros_like(p)
    kw = dict(HP, bc1=0.1, bc2=0.001)
    with pytest.raises(ValueError):
        cpu.quantized_step_(p, g, idx, sc, v, cb, **kw, period=64, scale_block=768)
    with pytest.raises(ValueError):
        cpu.quantized_step_(p, g.double(), idx, sc, v, cb, **kw, period=768, scale_block=768)
    with pytest.raises(ValueError):
        cpu.quantized_step_(p, g, idx, sc, v, cb.flip(0), **kw, period=768, scale_block=768)
    if cpu.available():  # the path is checked where the kernel runs
        with pytest.raises(ValueError, match="simd"):
            cpu.quantized_step_(p, g, idx, sc, v, cb, **kw, period=768, scale_block=768, simd=4)


def test_falls_back_to_eager_without_native(monkeypatch, one_thread):
    monkeypatch.setenv("GEFEN_DIST_NO_NATIVE", "1")
    assert not cpu.available()
    ref, fus = _run_both((8, 768), 768, 768, torch.float32, dp_codebook(), steps=3)
    _bitwise(ref, fus)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows,slab", [(1, 7), (5, 768), (37, 5), (3000, 64), (40, 4099)])
def test_native_column_sumsq(rows, slab, dtype):
    """The one-pass native column statistics: the float64 sums agree with the eager
    ``column_sumsq`` to float64 rounding, the float32 means Gefen uses are bitwise equal, the
    result does not depend on the thread count, and a NaN or inf reaches its column."""
    from gefen_dist.core.step import column_sumsq as eager

    g = torch.Generator().manual_seed(rows * 7919 + slab)
    grad = (torch.randn(rows, slab, generator=g) * torch.exp(2 * torch.randn(rows, 1, generator=g))).to(dtype)
    nat, ref = cpu.column_sumsq(grad, slab), eager(grad, slab)
    assert nat.dtype == torch.float64 and nat.shape == (slab,)
    torch.testing.assert_close(nat, ref, rtol=1e-13, atol=0.0)
    assert torch.equal((nat / rows).to(torch.float32), (ref / rows).to(torch.float32))
    old = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = cpu.column_sumsq(grad, slab)
    finally:
        torch.set_num_threads(old)
    assert torch.equal(one, nat)
    bad = grad.clone()
    bad[rows // 2, slab // 3] = float("nan")
    bad[rows - 1, slab - 1] = float("inf")
    out = cpu.column_sumsq(bad, slab)
    assert math.isnan(out[slab // 3]) and not math.isfinite(out[slab - 1])
    mask = torch.ones(slab, dtype=torch.bool)
    mask[[slab // 3, slab - 1]] = False
    assert bool(torch.isfinite(out[mask]).all())


def test_step_floor_loops_move_their_bytes():
    """benchmarks/step_floor.py's memory-floor loops (benchmarks/csrc/stream_floor.c) do the work
    they claim on every element, at one and two threads: a floor that skipped elements (or that
    the compiler folded away) would report a bandwidth the machine does not have."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "step_floor.py"
    spec = importlib.util.spec_from_file_location("step_floor", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    lib = mod.load_floor()
    n = 100_003  # not a multiple of the thread ranges' 64-element rounding
    gen = torch.Generator().manual_seed(0)
    for nt in (1, 2):
        p, g = torch.randn(n, generator=gen), torch.randn(n, generator=gen)
        idx = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=gen)
        p0, idx0 = p.clone(), idx.clone()
        lib.floor_gefen(p.data_ptr(), g.data_ptr(), idx.data_ptr(), n, 0.5, 0.25, nt)
        torch.testing.assert_close(p, p0 * 0.5 - 0.25 * g, rtol=1e-6, atol=1e-7)
        assert torch.equal(idx, (idx0.to(torch.int32) + 1).remainder(256).to(torch.uint8))
        want = int(np.bitwise_or.reduce(g.numpy().view(np.uint32)))
        assert lib.floor_read(g.data_ptr(), n, nt) == want
        m, v = torch.randn(n, generator=gen), torch.rand(n, generator=gen)
        p0, m0, v0 = p.clone(), m.clone(), v.clone()
        lib.floor_adamw(p.data_ptr(), g.data_ptr(), m.data_ptr(), v.data_ptr(), n, 0.1, 0.05, 0.01, nt)
        m1 = m0 + 0.1 * (g - m0)
        torch.testing.assert_close(m, m1, rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(v, v0 + 0.05 * (g * g - v0), rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(p, p0 - 0.01 * m1, rtol=1e-6, atol=1e-7)


# --------------------------------------------------------------------------------------
# factored second moment with row blocks (D12)
# --------------------------------------------------------------------------------------

def _blocks_grads(G, rb, slab, steps, seed=3):
    """Gradients whose column profile differs from block to block (as q, k, v of an attention
    projection do), so one profile per tensor cannot fit them."""
    g = torch.Generator().manual_seed(seed)
    cols = torch.exp(1.5 * torch.randn(G, 1, slab, generator=g))
    rows = torch.exp(torch.randn(G, rb, 1, generator=g))
    return [(torch.randn(G, rb, slab, generator=g) * 1e-3 * rows * cols).reshape(-1) for _ in range(steps)]


@pytest.mark.parametrize("fused", [False, True])
def test_row_blocks_are_separate_tensors(fused, one_thread):
    """Oracle: a [G * rb, slab] tensor with G row blocks steps exactly as its G sections would as
    separate tensors of rb rows, each with one column profile (the same codebook and scale
    blocks). Every row, scale block and column profile is computed by the same operations."""
    from gefen_dist.core.step import block_column_sumsq, column_sumsq, quantized_step_factored_eager_

    fn = cpu.quantized_step_factored_ if fused else quantized_step_factored_eager_
    G, rb, slab, B = 3, 24, 96, 48
    grads = _blocks_grads(G, rb, slab, 12)
    cb = dp_codebook()
    whole = _fstate(G * rb, slab, B, torch.float32, 0)
    whole = (whole[0], whole[1], whole[2], whole[3], torch.zeros(G, slab))
    parts = [tuple(t.clone() for t in _fstate(rb, slab, B, torch.float32, 0)) for _ in range(G)]
    for b in range(G):  # the same initial parameters, section by section
        parts[b][0].copy_(whole[0].view(G, -1)[b])
    for step, grad in enumerate(grads, 1):
        bc1, bc2 = bias_corrections(step, HP["beta1"], HP["beta2"])
        cms = (block_column_sumsq(grad, slab, 0, rb, G) / rb).float()
        fn(whole[0], grad, *whole[1:5], cb, cms, **HP, bc1=bc1, bc2=bc2, scale_block=B, row0=0, row_block=rb)
        for b, (p, idx, sc, vr, vc) in enumerate(parts):
            gb = grad.view(G, -1)[b].contiguous()
            fn(p, gb, idx, sc, vr, vc, cb, (column_sumsq(gb, slab) / rb).float(), **HP, bc1=bc1, bc2=bc2,
               scale_block=B)
    for k in range(4):
        assert torch.equal(whole[k].view(G, -1), torch.stack([pt[k].view(-1) for pt in parts])), k
    assert torch.equal(whole[4], torch.stack([pt[4] for pt in parts]))
    # and it is not the single-profile step: the per-block profiles moved the parameters differently
    single = _fstate(G * rb, slab, B, torch.float32, 0)
    for step, grad in enumerate(grads, 1):
        bc1, bc2 = bias_corrections(step, HP["beta1"], HP["beta2"])
        fn(single[0], grad, *single[1:5], cb, (column_sumsq(grad, slab) / (G * rb)).float(), **HP, bc1=bc1,
           bc2=bc2, scale_block=B)
    assert float((single[0] - whole[0]).abs().max()) > 1e-4


def test_row_blocks_pieces_with_row_offsets(one_thread):
    """A tensor's rows split into pieces at offsets that cut the row blocks (as FSDP2 shards do),
    each stepped with its global first row and the full column statistics, equals the whole tensor
    stepped at once: fused and eager, bitwise for the state."""
    from gefen_dist.core.step import block_column_sumsq, column_sumsq, quantized_step_factored_eager_

    G, rb, slab, B = 4, 10, 64, 32
    R = G * rb
    grads = _blocks_grads(G, rb, slab, 6, seed=7)
    cb = dp_codebook()
    for fn in (quantized_step_factored_eager_, cpu.quantized_step_factored_):
        whole = _fstate(R, slab, B, torch.float32, 1)
        whole = (*whole[:4], torch.zeros(G, slab))
        pieces = _fstate(R, slab, B, torch.float32, 1)
        pieces = (*pieces[:4], torch.zeros(G, slab))
        cuts = [0, 7, 23, 24, 40]  # piece edges inside blocks 0 and 2, one at a block edge
        for step, grad in enumerate(grads, 1):
            bc1, bc2 = bias_corrections(step, HP["beta1"], HP["beta2"])
            full = block_column_sumsq(grad, slab, 0, rb, G)
            summed = sum(block_column_sumsq(grad[a * slab:e * slab], slab, a, rb, G,
                                            lambda x, s: column_sumsq(x, s)) for a, e in zip(cuts, cuts[1:]))
            assert torch.allclose(full, summed, rtol=1e-12, atol=0)
            cms = (full / rb).float()
            fn(whole[0], grad, *whole[1:5], cb, cms, **HP, bc1=bc1, bc2=bc2, scale_block=B, row0=0, row_block=rb)
            vcs = []
            for a, e in zip(cuts, cuts[1:]):
                vc = pieces[4].clone()
                fn(pieces[0][a * slab:e * slab], grad[a * slab:e * slab], pieces[1][a * slab:e * slab],
                   pieces[2][a * slab // B:e * slab // B], pieces[3][a:e], vc, cb, cms, **HP, bc1=bc1, bc2=bc2,
                   scale_block=B, row0=a, row_block=rb)
                vcs.append(vc)
            pieces[4].copy_(vcs[0])  # every piece advanced its own copy identically
            assert all(torch.equal(v, vcs[0]) for v in vcs)
        for k in range(5):
            assert torch.equal(whole[k], pieces[k]), (fn, k)


def test_row_blocks_rule_and_errors():
    from gefen_dist import Gefen
    from gefen_dist.core.periods import factored_row_blocks

    assert factored_row_blocks((2304, 768)) == 3  # GPT-2 c_attn: q, k, v
    assert factored_row_blocks((3072, 768)) == 4  # GPT-2 mlp.c_fc
    assert factored_row_blocks((768, 3072)) == 1  # mlp.c_proj
    assert factored_row_blocks((50257, 768)) == 1  # wte
    assert factored_row_blocks((768, 768)) == 1
    assert factored_row_blocks((9 * 64, 64)) == 1  # more than 8 blocks: not measured, one profile
    assert factored_row_blocks((8 * 64, 64)) == 8
    assert factored_row_blocks((96, 8, 4)) == 3  # rows of 32 elements
    assert factored_row_blocks((2304, 768), 1) == 1 and factored_row_blocks((2304, 768), None) == 1
    assert factored_row_blocks((2304, 768), 6) == 6
    with pytest.raises(ValueError, match="does not divide the 2304 rows"):
        factored_row_blocks((2304, 768), 5)
    w = torch.nn.Parameter(torch.randn(3 * 64, 64))
    opt = Gefen([w], lr=1e-3)
    w.grad = torch.randn_like(w)
    opt.step()
    assert opt.state[w]["v_col"].shape == (3, 64)
    opt1 = Gefen([w], lr=1e-3, row_blocks=1)
    opt1.step()
    assert opt1.state[w]["v_col"].shape == (64,)
    for bad in (0, -2, "yes", 2.0, True):
        with pytest.raises(ValueError, match="row_blocks"):
            Gefen([w], lr=1e-3, row_blocks=bad)
    with pytest.raises(ValueError, match=r"'w'.*row_blocks=5 does not divide the 192 rows"):
        Gefen([("w", w)], lr=1e-3, row_blocks=5).step()
    # a checkpoint keeps its own block count (one saved before D12 loads and keeps one profile)
    sd = opt1.state_dict()
    opt2 = Gefen([w], lr=1e-3)
    opt2.load_state_dict(sd)
    assert opt2.state[w]["v_col"].shape == (64,)
    opt2.step()


# --------------------------------------------------------------------------------------
# apply only: the kernel's parameter update from the state functions' results (what a
# ZeroGefen replica does with an owner's idx, M and sigma / sqrt(v_row))
# --------------------------------------------------------------------------------------

def _apply_hp(variant: str, step: int) -> dict:
    from gefen_dist.core.step import update_bound

    hp = dict(HP, weight_decay=0.0) if variant == "no_decay_unbounded" else dict(HP)
    bc1, bc2 = bias_corrections(step, hp["beta1"], hp["beta2"])
    bound = {"no_decay_unbounded": None, "tight_bound": 0.05}.get(variant, update_bound(0.9, 0.999, step))
    return dict(hp, bc1=bc1, bc2=bc2, bound=bound)


def _state_kw(hp: dict) -> dict:
    return {k: hp[k] for k in ("beta1", "beta2", "eps", "bc1", "bc2")}


def _apply_grad(n, dtype, g, step, variant):
    grad = (torch.randn(n, generator=g) * 1e-3).to(dtype)
    if variant == "nonfinite" and step == 3:
        grad[n // 3] = float("nan")
        grad[n // 2] = float("inf")
    return grad


APPLY_VARIANTS = ["plain", "nonfinite", "no_decay_unbounded", "tight_bound"]


@pytest.mark.parametrize("shape,P,dtype", [((8, 768), 768, torch.float32), ((4, 1031), 1031, torch.bfloat16),
                                           ((10, 100), 100, torch.float32), ((7, 7), 7, torch.bfloat16)])
@pytest.mark.parametrize("variant", APPLY_VARIANTS)
def test_apply_compressed_equals_fused_step(shape, P, dtype, variant):
    """quantized_state_ then apply_compressed_ (gefen_apply_compressed) is bitwise the fused step
    (gefen_quantized_step) on the same input: the parameter, and idx / scale / v of the state
    function; on the AVX-512 path (simd=1) and the portable one (simd=0), block tails included."""
    cb = dp_codebook()
    n = math.prod(shape)
    p, idx, sc, v = _state(n, P, P, dtype, 21)
    g = torch.Generator().manual_seed(22)
    for step in range(1, 5):
        hp = _apply_hp(variant, step)
        grad = _apply_grad(n, dtype, g, step, variant)
        ref = tuple(t.clone() for t in (p, idx, sc, v))
        cpu.quantized_step_(ref[0], grad, *ref[1:], cb, **hp, period=P, scale_block=P)
        sigma = cpu.quantized_state_(grad, idx, sc, v, cb, **_state_kw(hp), period=P, scale_block=P)
        _bitwise(ref[1:], (idx, sc, v))
        for simd in (1, 0):
            out = p.clone()
            cpu.apply_compressed_(out, idx, sc, sigma, cb, P, hp, simd=simd)
            _bitwise((out,), ref[:1])
        p = ref[0]


@pytest.mark.parametrize("rows,slab,B,dtype,G", [(8, 768, 256, torch.float32, 1), (4, 1031, 1031, torch.bfloat16, 1),
                                                 (6, 100, 50, torch.float32, 1), (12, 64, 32, torch.float32, 3),
                                                 (12, 96, 48, torch.bfloat16, 4)])
@pytest.mark.parametrize("variant", APPLY_VARIANTS)
def test_apply_factored_equals_fused_step(rows, slab, B, dtype, G, variant):
    """factored_state_ then apply_factored_ (gefen_apply_factored), piece by piece with the pieces'
    first rows (as ZeroGefen's ranges, cutting row blocks), is bitwise the fused factored step on
    the whole tensor, on both code paths."""
    from gefen_dist.core.step import block_column_sumsq, column_factors, column_sumsq

    cb = dp_codebook()
    n, rb = rows * slab, rows // G
    p, idx, sc, vr, _ = _fstate(rows, slab, B, dtype, 31)
    vc = torch.zeros(G, slab) if G > 1 else torch.zeros(slab)
    blocks = dict(row0=0, row_block=rb) if G > 1 else {}
    cuts = [0, 1, rows // 2 + 1, rows]
    g = torch.Generator().manual_seed(32)
    for step in range(1, 5):
        hp = _apply_hp(variant, step)
        grad = _apply_grad(n, dtype, g, step, variant)
        cms = (block_column_sumsq(grad, slab, 0, rb, G) / rb if G > 1 else column_sumsq(grad, slab) / rows).float()
        ref = tuple(t.clone() for t in (p, idx, sc, vr, vc))
        cpu.quantized_step_factored_(ref[0], grad, *ref[1:], cb, cms, **hp, scale_block=B, **blocks)
        rsq = cpu.factored_state_(grad, idx, sc, vr, cb, slab=slab, **_state_kw(hp), scale_block=B)
        _bitwise(ref[1:4], (idx, sc, vr))
        col_f = column_factors(ref[4])
        for simd in (1, 0):
            out = p.clone()
            for a, e in zip(cuts, cuts[1:]):
                cpu.apply_factored_(out[a * slab:e * slab], idx[a * slab:e * slab], sc[a * slab // B:e * slab // B],
                                    rsq[a:e], col_f, cb, B, slab, hp, simd=simd,
                                    **(dict(row0=a, row_block=rb) if G > 1 else {}))
            _bitwise((out,), ref[:1])
        p, vc = ref[0], ref[4]


def _apply_inputs_random(n, P, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    p = (torch.randn(n, generator=g) * 0.02).to(dtype)
    idx = torch.randint(0, 256, (n,), generator=g, dtype=torch.uint8)
    M = torch.rand(n // P, generator=g) * 1e-3
    return p, idx, M, g


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bound", [None, 3.0, 0.05])
def test_apply_entry_points_match_eager_reference(dtype, bound):
    """apply_compressed_ / apply_factored_ against the reference appliers of core.apply (the eager
    step's order): within the kernel's documented relaxation (the update as C[idx] times the
    product of the block's scalars, per-element sigma with one division: a few ulps of the update,
    far below one ulp of the parameter)."""
    from gefen_dist.core.apply import apply_compressed, apply_factored

    cb = dp_codebook()
    hp = dict(HP, bc1=0.19, bc2=0.002, bound=bound)
    P = 384
    p, idx, M, g = _apply_inputs_random(64 * P, P, dtype, 41)
    sigma = torch.exp(torch.randn(64, generator=g)) * 300.0
    ref, out = p.clone(), p.clone()
    apply_compressed(ref, idx, M, sigma, cb, P, hp)
    cpu.apply_compressed_(out, idx, M, sigma, cb, P, hp)
    _assert_params_close(ref, out)
    slab, B, rows = 256, 128, 48
    p, idx, M, g = _apply_inputs_random(rows * slab, B, dtype, 42)
    rsq = torch.exp(torch.randn(rows, generator=g)) * 3e-3
    col_f = torch.exp(0.5 * torch.randn(3, slab, generator=g))
    ref, out = p.clone(), p.clone()
    apply_factored(ref, idx, M, rsq, col_f, cb, B, slab, hp, row0=0, row_block=rows // 3)
    cpu.apply_factored_(out, idx, M, rsq, col_f, cb, B, slab, hp, row0=0, row_block=rows // 3)
    _assert_params_close(ref, out)
    assert not torch.equal(out, p)


def test_apply_entry_points_fall_back_and_check(monkeypatch):
    """Bad arguments are refused; without the native library the entry points are the reference
    appliers (bitwise); the dispatcher hands each implementation's own appliers out."""
    from gefen_dist.core import apply as ap
    from gefen_dist.kernels import dispatch

    cb = dp_codebook()
    hp = dict(HP, bc1=0.19, bc2=0.002, bound=3.0)
    p, idx, M, g = _apply_inputs_random(4 * 64, 64, torch.float32, 43)
    sigma = torch.rand(4, generator=g) * 300.0
    for bad in (dict(pf=p.double()), dict(idx=idx[:-1]), dict(M=M.double()), dict(P=48)):
        kw = dict(dict(pf=p.clone(), idx=idx, M=M, sigma=sigma, cb=cb, P=64, hp=hp), **bad)
        with pytest.raises(ValueError):
            cpu.apply_compressed_(**kw)
    with pytest.raises(ValueError, match="simd"):
        cpu.apply_compressed_(p.clone(), idx, M, sigma, cb, 64, hp, simd=4)
    with pytest.raises(ValueError, match="row blocks"):
        cpu.apply_factored_(p.clone(), idx, M, torch.ones(4), torch.ones(2, 64), cb, 64, 64, hp)
    assert dispatch._native_cpu().apply_compressed_ is cpu.apply_compressed_
    assert dispatch._native_cpu().apply_factored_ is cpu.apply_factored_
    assert dispatch._eager().apply_compressed_ is ap.apply_compressed
    assert dispatch._eager().apply_factored_ is ap.apply_factored
    monkeypatch.setenv("GEFEN_DIST_NO_NATIVE", "1")
    ref, out = p.clone(), p.clone()
    ap.apply_compressed(ref, idx, M, sigma, cb, 64, hp)
    cpu.apply_compressed_(out, idx, M, sigma, cb, 64, hp)
    _bitwise((ref,), (out,))
    rsq, col_f = torch.rand(4, generator=g) * 3e-3, torch.rand(64, generator=g) + 0.5
    ref, out = p.clone(), p.clone()
    ap.apply_factored(ref, idx, M, rsq, col_f, cb, 64, 64, hp)
    cpu.apply_factored_(out, idx, M, rsq, col_f, cb, 64, 64, hp)
    _bitwise((ref,), (out,))


def test_cpu_column_factors_bitwise_core():
    """The CPU wrapper's column factors (three operations where the mean is positive) are
    core.step.column_factors bit for bit, including profiles whose mean is 0 or NaN."""
    from gefen_dist.core.step import column_factors
    from gefen_dist.kernels.cpu import _column_factors_cpu

    g = torch.Generator().manual_seed(0)
    mixed = torch.rand(3, 96, generator=g)
    mixed[1] = 0.0  # one row block's profile all zero: its factors are 0, the others' v / mean
    cases = [torch.rand(768, generator=g) ** 4, torch.zeros(64), torch.rand(3, 96, generator=g), mixed,
             torch.tensor([float("nan"), 1.0, 2.0]), torch.tensor([0.0, 0.0, 1e-38]),
             torch.tensor([float("inf"), 1.0])]
    for v in cases:
        assert torch.equal(_column_factors_cpu(v).nan_to_num(-7.0), column_factors(v).nan_to_num(-7.0)), v
