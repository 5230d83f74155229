"""gefen_dist.core.nibbles, both moments in one byte per element: its random numbers, its stochastic
rounding, its 16-entry codebook and its step, against independent statements of what they must be
(plain-integer lowbias32, exact expectations over every draw, torch's AdamW, the whole tensor for a
shard)."""
import math

import numpy as np
import pytest
import torch

from gefen_dist.core import nibbles as nb
from gefen_dist.core import step as core_step
from gefen_dist.core.codebook import NUM_BINS, bin_centres, mirrored_counts, solve_codebook


def _lowbias32(x):
    x &= 0xFFFFFFFF
    x ^= x >> 16
    x = (x * 0x7FEB352D) & 0xFFFFFFFF
    x ^= x >> 15
    x = (x * 0x846CA68B) & 0xFFFFFFFF
    return x ^ (x >> 16)


def test_hash_and_uniforms_are_keyed_by_the_global_index():
    xs = [0, 1, 2, 12345, 0xFFFFFFFF, 0x9E3779B1, 2 ** 31 + 7, 2 ** 40 + 3]
    assert nb.hash32(torch.tensor(xs, dtype=torch.int64)).tolist() == [_lowbias32(x) for x in xs]
    assert [nb.hash32_int(x) for x in xs] == [_lowbias32(x) for x in xs]
    key = nb.step_key(3, 17, 5)
    um, uv = nb.uniforms(0, 20_000, key)
    # element i: h = lowbias32(i ^ lowbias32(key)); the first moment's draw h >> 16, v's h & 0xFFFF, over 2^16
    for i in (0, 1, 777, 19_999):
        h = _lowbias32(i ^ _lowbias32(key))
        assert (float(um[i]), float(uv[i])) == ((h >> 16) / 65536.0, (h & 0xFFFF) / 65536.0)
    sm, sv = nb.uniforms(7_000, 5_000, key)  # a shard draws what the whole tensor draws there
    assert torch.equal(sm, um[7_000:12_000]) and torch.equal(sv, uv[7_000:12_000])
    for u in (um, uv):
        assert 0.0 <= float(u.min()) and float(u.max()) < 1.0
        assert abs(float(u.mean()) - 0.5) < 0.01 and abs(float(u.var()) - 1 / 12) < 0.003
    assert float((um - uv).abs().mean()) > 0.2  # two different draws, not one
    assert not torch.equal(nb.uniforms(0, 100, nb.step_key(3, 18, 5))[0], um[:100])
    assert not torch.equal(nb.uniforms(0, 100, nb.step_key(3, 17, 6))[0], um[:100])
    # past 2^32 elements the high word enters the key; a range across the boundary is its two halves
    a = nb.uniforms(2 ** 32 - 5, 10, key)[0]
    assert torch.equal(a, torch.cat([nb.uniforms(2 ** 32 - 5, 5, key)[0], nb.uniforms(2 ** 32, 5, key)[0]]))
    h = _lowbias32((2 ** 32 + 1) & 0xFFFFFFFF ^ _lowbias32((key + 0x9E3779B1) & 0xFFFFFFFF))
    assert float(a[6]) == (h >> 16) / 65536.0


def test_v_levels_are_two_per_octave_around_the_estimate():
    lv = torch.tensor(nb.V_LEVELS, dtype=torch.float32)
    assert lv.numel() == 16 and lv[8] == 1.0 and lv[0] == 2.0 ** -4 and lv[15] == np.float32(2.0 ** 3.5)
    assert torch.allclose(lv[1:] / lv[:-1], torch.full((15,), math.sqrt(2.0)))


def test_stochastic_rounding_is_unbiased_over_every_draw():
    """Over all 2^16 draws the mean of the rounded value is x (to the draws' 2^-16 resolution) inside
    the levels, the nearer end outside them; a level maps to itself; NaN to code 0."""
    levels = torch.tensor([-1.0, -0.4, -0.05, 0.0, 0.1, 0.7, 1.0])
    u = torch.arange(65536, dtype=torch.float32) / 65536.0
    for x in (-1.0, -0.9, -0.4, -0.01, 0.0, 0.03, 0.5, 0.99, 1.0):
        codes = nb.round_stochastic(torch.full_like(u, x), levels, u)
        got = float(levels[codes].double().mean())
        assert abs(got - x) <= 2e-5, (x, got)
        lo = int((levels <= x).sum()) - 1
        assert set(codes.unique().tolist()) <= {max(lo, 0), min(lo + 1, 6)}
    for x, want in ((-3.0, 0), (1.5, 6), (float("nan"), 0)):
        assert set(nb.round_stochastic(torch.full_like(u, x), levels, u).unique().tolist()) == {want}
    for j in range(7):
        assert set(nb.round_stochastic(levels[j].expand(65536), levels, u).unique().tolist()) == {j}


def test_sixteen_codewords_by_the_dp():
    g = torch.Generator().manual_seed(0)
    z = (torch.randn(50_000, generator=g) * 0.3).clamp(-1, 1)
    counts = torch.bincount(((z.double() + 1) * (NUM_BINS / 2)).floor().clamp(0, NUM_BINS - 1).long(),
                            minlength=NUM_BINS)
    cb = solve_codebook(mirrored_counts(counts), k=nb.NIBBLE_CODEWORDS).codebook
    assert cb.shape == (16,) and cb[0] == -1 and cb[-1] == 1 and bool((cb[1:] > cb[:-1]).all())
    assert torch.allclose(cb, -cb.flip(0), atol=1e-6)
    w = torch.from_numpy(mirrored_counts(counts)).double()
    c = torch.from_numpy(bin_centres()).double()

    def sse(book):
        return float((w * (c[:, None] - book.double()[None, :]).abs().min(1).values ** 2).sum())

    assert sse(cb) < sse(torch.linspace(-1, 1, 16))
    with pytest.raises(ValueError, match="k >= 2"):
        solve_codebook(counts, k=1)


def _problem(rows=24, slab=96, G=1, seed=0):
    g = torch.Generator().manual_seed(seed)
    steps = [torch.randn(rows, slab, generator=g) * torch.rand(rows, 1, generator=g) * 1e-2 for _ in range(4)]
    p = torch.randn(rows, slab, generator=g)
    cb = solve_codebook(mirrored_counts(torch.randint(0, 50, (NUM_BINS,), generator=g)), k=16).codebook
    return steps, p, cb


def _run(steps, p, cb, *, G=1, B=32, rows=None, update="fp32", bound=None, hp=None, fn=None, dtype=None):
    """Steps whole rows ``rows`` (default all) of the tensor through ``fn`` (nibble_step_factored_eager_),
    the parameter and gradients in ``dtype`` (default float32)."""
    R, slab = p.shape
    r0, r1 = rows or (0, R)
    fn = fn or nb.nibble_step_factored_eager_
    st = dict(code=torch.zeros(r1 - r0, slab, dtype=torch.uint8), scale=torch.zeros(r1 - r0, slab // B),
              v_row=torch.zeros(r1 - r0), v_col=torch.zeros(G, slab) if G > 1 else torch.zeros(slab))
    p = p[r0:r1].clone().to(dtype or torch.float32)
    for t, g in enumerate(steps, 1):
        g = g.to(p.dtype)
        gf = g.float()
        col = (gf * gf).view(G, R // G, slab).mean(1) if G > 1 else (gf * gf).mean(0)  # over all global rows
        h = dict(lr=1e-2, beta1=0.9, beta2=0.99, eps=1e-8, weight_decay=0.1, bc1=1 - 0.9 ** t, bc2=1 - 0.99 ** t)
        h.update(hp or {})
        fn(p.view(-1), g[r0:r1].reshape(-1), st["code"], st["scale"], st["v_row"], st["v_col"], cb, col,
           scale_block=B, key=nb.step_key(0, t, 3), row0=r0, row_block=R // G, bound=bound, update=update, **h)
    return p, st


def test_first_step_is_adamws():
    steps, p, cb = _problem()
    got, _ = _run(steps[:1], p, cb)
    q = p.clone().requires_grad_()
    q.grad = steps[0].clone()
    torch.optim.AdamW([q], lr=1e-2, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.1).step()
    assert torch.allclose(got, q.detach(), rtol=0, atol=2e-7)


@pytest.mark.parametrize("G", [1, 3])
def test_a_shard_of_rows_steps_as_the_whole_tensor_does(G, monkeypatch):
    """Rows 5..17 stepped alone (their global row 5 given) end bit for bit where the whole tensor's
    rows 5..17 end, across a row block's boundary (G = 3: blocks of 8 rows), and in chunks of 2 rows."""
    steps, p, cb = _problem(G=G)
    whole, ws = _run(steps, p, cb, G=G)
    part, ps = _run(steps, p, cb, G=G, rows=(5, 17))
    assert torch.equal(part, whole[5:17])
    for k in ("code", "scale", "v_row"):
        assert torch.equal(ps[k], ws[k][5:17]), k
    assert torch.equal(ps["v_col"], ws["v_col"])
    monkeypatch.setattr(nb, "_EAGER_CHUNK_ELEMS", 2 * 96)
    chunked, cs = _run(steps, p, cb, G=G)
    assert torch.equal(chunked, whole) and torch.equal(cs["code"], ws["code"])


def test_the_state_decodes_to_unbiased_moments():
    """Over many keys the stored codes decode to the float32 moments on average (unbiased
    rounding); the decoded v is on its grid of the estimate."""
    g = torch.Generator().manual_seed(1)
    rows, slab, B = 16, 64, 32
    cb = solve_codebook(mirrored_counts(torch.randint(0, 50, (NUM_BINS,), generator=g)), k=16).codebook
    m = torch.randn(rows, slab, generator=g) * torch.rand(rows, 1, generator=g)
    fac = torch.rand(rows, 1, generator=g) * torch.rand(1, slab, generator=g) + 0.1
    v = fac * torch.exp2(torch.rand(rows, slab, generator=g) * 6 - 3.5)  # inside 2^-3.5 .. 2^2.5 of fac
    accm, accv, n = torch.zeros_like(m), torch.zeros_like(v), 400
    for k in range(n):
        um, uv = nb.uniforms(0, rows * slab, k)
        code, a = nb.encode(m, v, fac, cb, B, um.view(rows, slab), uv.view(rows, slab))
        dm, dv = nb.decode(code, a, fac, cb, B)
        accm += dm
        accv += dv
        k2 = dv / fac
        assert bool(torch.isin(k2, torch.tensor(nb.V_LEVELS)).all() | torch.isclose(
            k2[..., None], torch.tensor(nb.V_LEVELS)).any(-1).all())
    M = a.repeat_interleave(B, 1)
    assert float(((accm / n - m).abs() / M).mean()) < 0.01
    assert float(((accv / n - v).abs() / v).mean()) < 0.03


def test_decoded_update_is_adamws_of_the_stored_state():
    steps, p, cb = _problem()
    for update in ("decoded", "fp32"):
        before, _ = _run(steps[:3], p, cb, update=update, bound=5.0, hp=dict(weight_decay=0.0))
        after, st = _run(steps, p, cb, update=update, bound=5.0, hp=dict(weight_decay=0.0))
        t = 4
        vc = st["v_col"]
        fac = st["v_row"][:, None] * (vc / vc.mean())[None, :]
        m, v = nb.decode(st["code"], st["scale"], fac, cb, 32)
        u = ((m / (1 - 0.9 ** t)) / ((v / (1 - 0.99 ** t)).sqrt() + 1e-8)).clamp(-5.0, 5.0)
        close = torch.allclose((before - after) / 1e-2, u, rtol=1e-4, atol=1e-4)
        assert close == (update == "decoded"), update


def test_bad_arguments_raise_before_anything_changes():
    steps, p, cb = _problem()
    st = dict(code=torch.zeros(24, 96, dtype=torch.uint8), scale=torch.zeros(24, 3), v_row=torch.ones(24),
              v_col=torch.ones(2, 96))
    snap = {k: v.clone() for k, v in st.items()}
    h = dict(lr=1e-2, beta1=0.9, beta2=0.99, eps=1e-8, weight_decay=0.0, bc1=0.1, bc2=0.01, key=1)
    cases = [(dict(update="stored", scale_block=32, row_block=12), "update must be"),
             (dict(scale_block=40, row_block=12), "scale_block 40"),
             (dict(scale_block=32), "row_block >= 1")]
    for kw, msg in cases:
        with pytest.raises(ValueError, match=msg):
            nb.nibble_step_factored_eager_(p.reshape(-1), steps[0].reshape(-1), st["code"], st["scale"], st["v_row"],
                                           st["v_col"], cb, torch.ones(2, 96), **h, **kw)
        assert all(torch.equal(st[k], snap[k]) for k in st)


def test_trains_a_regression_as_adamw_does():
    """A two-layer regression, 300 steps: the one-byte layout's loss within 25% of AdamW's (both update
    rules), state one byte per element plus the factored and scale vectors."""
    def run(opt_of):
        torch.manual_seed(0)
        net = torch.nn.Sequential(torch.nn.Linear(64, 256, bias=False), torch.nn.GELU(),
                                  torch.nn.Linear(256, 64, bias=False))
        step = opt_of(net)
        g = torch.Generator().manual_seed(5)
        w = torch.randn(64, 64, generator=g) / 8
        for _ in range(300):
            x = torch.randn(64, 64, generator=g)
            for q in net.parameters():
                q.grad = None
            loss = (net(x) - x @ w).pow(2).mean()
            loss.backward()
            step()
        return loss.item()

    def nibble(update):
        def make(net):
            ps = list(net.parameters())
            sts = [dict(code=torch.zeros(q.shape, dtype=torch.uint8), scale=torch.zeros(q.shape[0], 1),
                        v_row=torch.zeros(q.shape[0]), v_col=torch.zeros(q.shape[1]), t=0) for q in ps]
            cb = torch.linspace(-1, 1, 16)

            def step():
                for i, (q, st) in enumerate(zip(ps, sts)):
                    st["t"] += 1
                    t, gr = st["t"], q.grad
                    hp = core_step.hyperparameters(dict(lr=3e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0), t)
                    nb.nibble_step_factored_eager_(q.data.view(-1), gr.reshape(-1), st["code"], st["scale"],
                                                   st["v_row"], st["v_col"], cb, (gr * gr).mean(0),
                                                   scale_block=q.shape[1], key=nb.step_key(0, t, i),
                                                   update=update, **hp)
            return step
        return make

    adamw = run(lambda net: torch.optim.AdamW(net.parameters(), lr=3e-3, weight_decay=0.0).step)
    for update in ("fp32", "decoded"):
        got = run(nibble(update))
        assert np.isfinite(got) and got < 1.25 * adamw, (update, got, adamw)


def test_steps_match_the_layout_written_out_plainly():
    """Four steps against the module's formulas written out in the test, whole tensor, no chunks: every
    stored code, scale and statistic equal, the parameters to rounding."""
    steps, p0, cb = _problem(rows=12, slab=64)
    B, (b1, b2, lr, wd, eps) = 32, (0.9, 0.99, 1e-2, 0.1, 1e-8)
    lv = torch.tensor(nb.V_LEVELS)
    code = torch.zeros(12, 64, dtype=torch.long)
    M, vr, vc, p = torch.zeros(12, 2), torch.zeros(12), torch.zeros(64), p0.clone()

    def codes(x, levels, u):  # lower neighbour by counting, then the draw
        j = ((levels[None, None, :] <= x[..., None]).sum(-1) - 1).clamp(0, levels.numel() - 2)
        frac = ((x - levels[j]) / (levels[j + 1] - levels[j])).clamp(0, 1)
        return j + (u < frac).long()

    for t, g in enumerate(steps, 1):
        fac = vr[:, None] * torch.where(vc.mean() > 0, vc / vc.mean(), torch.zeros(()))[None, :]
        m = torch.lerp(cb[code >> 4] * M.repeat_interleave(B, 1), g, 1 - b1)
        v = (fac * lv[code & 15]).mul_(b2).add_(g * g, alpha=1 - b2)
        vr.mul_(b2).add_((g * g).mean(1), alpha=1 - b2)
        vc.mul_(b2).add_((g * g).mean(0), alpha=1 - b2)
        fac = vr[:, None] * (vc / vc.mean())[None, :]
        M = m.view(12, 2, B).abs().amax(2)
        um, uv = (u.view(12, 64) for u in nb.uniforms(0, 12 * 64, nb.step_key(0, t, 3)))
        code = codes(m / M.repeat_interleave(B, 1), cb, um) << 4 | codes(v / fac, lv, uv)
        sigma = 1 / ((v.double().sqrt().float() / math.sqrt(1 - b2 ** t)) + eps) / (1 - b1 ** t)
        p = p * (1 - lr * wd) - lr * m * sigma
    got, st = _run(steps, p0, cb)
    assert torch.equal(st["code"].long(), code) and torch.equal(st["scale"], M)
    assert torch.equal(st["v_row"], vr) and torch.equal(st["v_col"], vc)
    assert torch.allclose(got, p, rtol=0, atol=1e-6)


# ------------------------------------------------------------------ Gefen(second_moment="nibbles")
def _mlp(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 64))


def _train(net, opt, steps, seed=5, start=0):
    g = torch.Generator().manual_seed(seed)
    for s in range(start + steps):
        x = torch.randn(32, 64, generator=g)
        if s < start:
            continue
        opt.zero_grad()
        (net(x) - x.flip(1)).pow(2).mean().backward()
        opt.step()


def test_gefen_nibbles_steps_through_the_core_with_its_keys(monkeypatch):
    """Each quantized tensor's step is core.nibbles' function on its whole rows, keyed by the step and the
    tensor's place in the optimizer; the codebook has 16 entries; the state is the default's tensors, byte
    for byte the same sizes."""
    from gefen_dist import Gefen
    from gefen_dist.kernels import dispatch

    calls = []
    real = nb.nibble_step_factored_eager_

    def spy(param, grad, code, *a, key, row0, **kw):
        calls.append((param.shape, key, row0, code.dtype))
        return real(param, grad, code, *a, key=key, row0=row0, **kw)

    monkeypatch.setattr(dispatch, "_eager", dispatch._eager.__wrapped__)
    monkeypatch.setattr(nb, "nibble_step_factored_eager_", spy)
    net = _mlp()
    opt = Gefen(net.parameters(), lr=3e-3, second_moment="nibbles", fused=False)
    _train(net, opt, 3)
    assert opt.codebook.shape == (16,) and opt.codebook[0] == -1 and opt.codebook[-1] == 1
    # two quantized weights (params 0 and 2 of the optimizer), three steps
    assert sorted((tuple(s), k, r) for s, k, r, _ in calls) == sorted(
        (tuple(w.shape), nb.step_key(0, t, i), 0) for t in (1, 2, 3) for i, w in ((0, net[0].weight),
                                                                                (2, net[2].weight)))
    ref = _mlp()
    dopt = Gefen(ref.parameters(), lr=3e-3)
    _train(ref, dopt, 1)
    for p, q in zip(net.parameters(), ref.parameters()):
        a, b = opt.state[p], dopt.state[q]
        assert {k: (v.shape, v.dtype) for k, v in a.items() if isinstance(v, torch.Tensor) and k != "codebook"} == \
            {k: (v.shape, v.dtype) for k, v in b.items() if isinstance(v, torch.Tensor) and k != "codebook"}
    from gefen_dist.optim.introspect import describe_step

    assert describe_step(opt, opt.report()).endswith("kernel: eager")
    # the default (fused=None) steps them with the native kernel where it builds, to the same bits
    fast, slow = _mlp(), _mlp()
    fo, so = (Gefen(m.parameters(), lr=3e-3, second_moment="nibbles", fused=f) for m, f in ((fast, None),
                                                                                          (slow, False)))
    _train(fast, fo, 4)
    _train(slow, so, 4)
    from gefen_dist.kernels import cpu, cpu_nibbles  # noqa: F401

    assert describe_step(fo, fo.report()).endswith("kernel: cpu (portable C)" if cpu.available() else "kernel: eager")
    for p, q in zip(fast.parameters(), slow.parameters()):
        assert torch.equal(p, q)
        for k in ("idx", "scale", "v_row", "v_col"):
            if k in fo.state[p]:
                assert torch.equal(fo.state[p][k], so.state[q][k]), k


def test_gefen_nibbles_resumes_bitwise_and_refuses_the_other_layout():
    from gefen_dist import Gefen

    net, again = _mlp(), _mlp()
    opt = Gefen(net.parameters(), lr=3e-3, second_moment="nibbles")
    _train(net, opt, 5)
    opt2 = Gefen(again.parameters(), lr=3e-3, second_moment="nibbles")
    _train(again, opt2, 3)
    sd = opt2.state_dict()
    resumed = Gefen(again.parameters(), lr=3e-3, second_moment="nibbles")
    resumed.load_state_dict(sd)
    _train(again, resumed, 2, start=3)
    for p, q in zip(net.parameters(), again.parameters()):
        assert torch.equal(p, q)
    for k in ("idx", "scale", "v_row", "v_col"):
        assert torch.equal(opt.state[net[0].weight][k], resumed.state[again[0].weight][k]), k
    with pytest.raises(ValueError, match="second_moment='nibbles'"):
        Gefen(again.parameters(), lr=3e-3).load_state_dict(sd)
    fact = _mlp()
    fopt = Gefen(fact.parameters(), lr=3e-3)
    _train(fact, fopt, 2)
    fresh = Gefen(fact.parameters(), lr=3e-3, second_moment="nibbles")
    with pytest.raises(ValueError, match="second_moment='factored'"):
        fresh.load_state_dict(fopt.state_dict())
    assert not fresh.state
    # a saved entry whose codebook is not 16 codewords (a state dict edited by hand) is refused by name
    bad = opt2.state_dict()
    for st in bad["state"].values():
        if "codebook" in st:
            st["codebook"] = torch.linspace(-1, 1, 256)
    with pytest.raises(ValueError, match="expected 16 floats"):
        Gefen(again.parameters(), lr=3e-3, second_moment="nibbles").load_state_dict(bad)
    adamw = torch.optim.AdamW(fact.parameters(), lr=3e-3)
    _train(fact, adamw, 1)
    with pytest.raises(ValueError, match="AdamW state dict into Gefen\\(second_moment='nibbles'\\)"):
        Gefen(fact.parameters(), lr=3e-3, second_moment="nibbles").load_state_dict(adamw.state_dict())


def test_gefen_nibbles_refusals_name_the_fix():
    from gefen_dist import Gefen, ZeroGefen

    net = _mlp()
    # capturable=True is taken (its CUDA batch reads its scalars on the device: tests/test_triton_step.py)
    Gefen(net.parameters(), second_moment="nibbles", capturable=True, nonfinite="skip")
    with pytest.raises(ValueError, match="every group that quantizes a tensor must use 'nibbles' or none"):
        Gefen([{"params": [net[0].weight], "second_moment": "nibbles"}, {"params": [net[2].weight]}])
    opt = Gefen([net[0].weight], second_moment="nibbles")
    with pytest.raises(ValueError, match="every group that quantizes a tensor must use 'nibbles' or none"):
        opt.add_param_group({"params": [net[2].weight], "second_moment": "factored"})
    assert len(opt.param_groups) == 1
    opt.add_param_group({"params": [net[2].bias], "second_moment": "factored"})  # exact only: moot
    assert opt.codebook is None and len(opt.param_groups) == 2
    ZeroGefen(net.parameters(), second_moment="nibbles")  # its owners' new values travel dense (test_zero.py)
    from gefen_dist.integrations import deepspeed as ds_gefen  # (the module imports deepspeed lazily)

    ds_gefen.Gefen(net.parameters(), second_moment="nibbles")  # its flat buffers: tests/test_nibbles_flat.py
    with pytest.raises(ValueError, match="Invalid second_moment"):
        Gefen(net.parameters(), second_moment="nibble")
    with pytest.raises(ValueError, match="narrow_rows='span' in param group 0 is a layout of second_moment='factored'"):
        Gefen(net.parameters(), second_moment="nibbles", narrow_rows="span")


def test_gefen_nibbles_trains_like_adamw():
    """The MLP regression, 200 steps: Gefen(second_moment='nibbles') within 15% of AdamW's final loss."""
    from gefen_dist import Gefen

    def final(make):
        net = _mlp()
        opt = make(net.parameters())
        g = torch.Generator().manual_seed(1)
        w = torch.randn(64, 64, generator=g) / 8
        for _ in range(200):
            x = torch.randn(64, 64, generator=g)
            opt.zero_grad()
            loss = (net(x) - x @ w).pow(2).mean()
            loss.backward()
            opt.step()
        return loss.item()

    adamw = final(lambda ps: torch.optim.AdamW(ps, lr=3e-3, weight_decay=0.0))
    got = final(lambda ps: Gefen(ps, lr=3e-3, weight_decay=0.0, second_moment="nibbles"))
    assert np.isfinite(got) and got < 1.15 * adamw, (got, adamw)


@pytest.mark.skipif(not __import__("gefen_dist.kernels.cpu", fromlist=["available"]).available(),
                    reason="needs the native CPU library")
@pytest.mark.parametrize("G,update,bound,dtype,threads", [
    (1, "fp32", None, torch.float32, 1), (3, "fp32", 2.0, torch.float32, 2), (1, "decoded", 2.0, torch.float32, 1),
    (3, "decoded", None, torch.bfloat16, 2), (1, "fp32", 2.0, torch.bfloat16, 1)])
def test_native_kernel_is_the_eager_reference_bit_for_bit(G, update, bound, dtype, threads):
    """kernels/cpu_nibbles.nibble_step_factored_ against the eager reference: every code, scale, statistic and
    parameter equal, with row blocks, both update rules, the bound, bf16 parameters, a NaN and an inf in
    the gradients (their blocks: NaN scales, codes 0), zero rows, weight decay, one or two threads."""
    from gefen_dist.kernels import cpu, cpu_nibbles  # noqa: F401

    steps, p, cb = _problem(rows=36, slab=192)
    steps[1][4, 7] = float("nan")
    steps[2][9, 100] = float("inf")
    steps[2][20:22] = 0.0
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        kw = dict(G=G, B=64, update=update, bound=bound, dtype=dtype)
        want, ws = _run(steps, p, cb, **kw)
        got, gs = _run(steps, p, cb, fn=cpu_nibbles.nibble_step_factored_, **kw)
        part, ps = _run(steps, p, cb, fn=cpu_nibbles.nibble_step_factored_, rows=(6, 30), **kw)
    finally:
        torch.set_num_threads(old)
    bits = torch.int16 if dtype == torch.bfloat16 else torch.int32
    nan = torch.isnan(want)  # (a NaN's sign bit is not specified: torch's bf16 keeps it, the kernel's not)
    assert torch.equal(torch.isnan(got), nan) and bool(nan.any())
    assert torch.equal(got.view(bits)[~nan], want.view(bits)[~nan])
    for k in ("code", "scale", "v_row", "v_col"):
        assert torch.equal(gs[k].view(torch.uint8), ws[k].view(torch.uint8)), k
        assert torch.equal(ps[k].view(torch.uint8), (ws[k] if k == "v_col" else ws[k][6:30]).view(torch.uint8)), k
    assert bool(torch.isnan(ws["scale"]).any())  # the NaN reached a scale: its block was coded as such


@pytest.mark.skipif(not __import__("gefen_dist.kernels.cpu", fromlist=["available"]).available(),
                    reason="needs the native CPU library")
def test_native_kernel_with_scale_blocks_over_256_and_the_nibbles_period():
    """Rows of 514 = 2 x 257 elements: the nibbles period (core.periods.nibble_period) keeps the row as the
    scale block (its largest divisor under 256 is 2), and the kernel steps blocks of 514 as the reference."""
    from gefen_dist.core.periods import nibble_period
    from gefen_dist.kernels import cpu, cpu_nibbles  # noqa: F401

    assert [nibble_period(s) for s in ((2304, 768), (768, 3072), (192, 576), (12, 514), (5, 300))] == \
        [256, 256, 192, 514, 150]
    steps, p, cb = _problem(rows=12, slab=514)
    want, ws = _run(steps, p, cb, B=514)
    got, gs = _run(steps, p, cb, B=514, fn=cpu_nibbles.nibble_step_factored_)
    assert torch.equal(got, want)
    for k in ("code", "scale", "v_row", "v_col"):
        assert torch.equal(gs[k], ws[k]), k


def test_plan_counts_the_nibbles_state_that_gefen_allocates():
    """gefen_dist.plan's bytes for second_moment='nibbles' equal the state a live optimizer holds (scale
    blocks of core.periods.nibble_period, so a little more than the factored default's per-row blocks)."""
    from gefen_dist import Gefen
    from gefen_dist.plan import tensor_state

    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(768, 96), torch.nn.Linear(96, 3072), torch.nn.Linear(514, 16))
    for mode in ("nibbles", "factored"):
        opt = Gefen(net.parameters(), lr=1e-3, second_moment=mode)
        opt.init_state()
        for p in net.parameters():
            held = sum(t.numel() * t.element_size() for k, t in opt.state[p].items()
                       if torch.is_tensor(t) and k not in ("step", "codebook"))
            assert held == tensor_state(tuple(p.shape), second_moment=mode)["gefen_bytes"], (mode, tuple(p.shape))
    assert tensor_state((768, 3072), second_moment="nibbles")["scale_block"] == 256
    assert tensor_state((768, 3072), second_moment="factored")["scale_block"] == 1536


@pytest.mark.skipif(not __import__("gefen_dist.kernels.cpu", fromlist=["available"]).available(),
                    reason="needs the native CPU library")
def test_native_kernel_over_a_wide_range_of_ratios():
    """Gradients whose elements span 10^-30 .. 10^8 (subnormal squares, ratios v / fac far outside the
    levels, exact zeros): the kernel's codes (its v levels built from exponent bits, not a table) equal the
    reference's."""
    from gefen_dist.kernels import cpu, cpu_nibbles  # noqa: F401

    g = torch.Generator().manual_seed(9)
    steps = [torch.randn(24, 128, generator=g) * torch.pow(10.0, torch.randint(-30, 9, (24, 128), generator=g).float())
             for _ in range(5)]
    steps[3][5] = 0.0
    steps[4][:, 7] = 0.0
    p = torch.randn(24, 128, generator=g)
    cb = solve_codebook(mirrored_counts(torch.randint(0, 50, (NUM_BINS,), generator=g)), k=16).codebook
    for update in ("fp32", "decoded"):
        want, ws = _run(steps, p, cb, B=64, update=update, bound=2.0)
        got, gs = _run(steps, p, cb, B=64, update=update, bound=2.0, fn=cpu_nibbles.nibble_step_factored_)
        codes = ws["code"] & 15
        assert len(codes.unique()) == 16  # every v level met
        torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)
        for k in ("code", "scale", "v_row", "v_col"):
            torch.testing.assert_close(gs[k], ws[k], rtol=0, atol=0, equal_nan=True)


def test_nibbles_takes_the_multi_tensor_cpu_batch_quietly(caplog):
    """No per-tensor cliff (issue 27): on CPU the optimizer's multi-tensor batch steps ``"nibbles"``
    (tests/test_cpu_batch.py: bitwise the per-tensor path; tests/test_triton_nibbles.py: the Triton batch),
    and nothing is logged about it."""
    import logging

    from gefen_dist import Gefen

    net = _mlp()
    opt = Gefen(net.parameters(), lr=3e-3, second_moment="nibbles")
    with caplog.at_level(logging.INFO, logger="gefen_dist.engine.cuda_batch"):
        _train(net, opt, 3)
    assert not [r for r in caplog.records if r.levelno >= logging.INFO]
    assert opt._cuda_batch is not None and opt._cuda_batch.native_cpu
    assert opt._cuda_batch.groups[0]["nibs"]["step"].launches == 1