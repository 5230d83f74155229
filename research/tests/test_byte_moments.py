"""research/byte_moments.py, the prototype of one byte per element for both moments: its random numbers,
codebook, codes and first step, against independent statements of what they must be."""
import numpy as np
import torch
from torch import nn

import byte_moments as bm


def test_hash_is_lowbias32_and_a_shard_draws_the_whole_tensors_numbers():
    # lowbias32 (Wellons) in plain Python integers, as a C/Triton uint32 kernel computes it
    def ref(x):
        x &= 0xFFFFFFFF
        x ^= x >> 16
        x = (x * 0x7FEB352D) & 0xFFFFFFFF
        x ^= x >> 15
        x = (x * 0x846CA68B) & 0xFFFFFFFF
        return x ^ (x >> 16)

    xs = [0, 1, 2, 12345, 0xFFFFFFFF, 0x9E3779B1, 2 ** 31 + 7]
    assert bm.hash32(torch.tensor(xs, dtype=torch.int64)).tolist() == [ref(x) for x in xs]
    whole = bm.uniforms(10_000, key=77)
    assert torch.equal(bm.uniforms(3_000, key=77, start=4_000), whole[4_000:7_000])
    assert 0.0 <= float(whole.min()) and float(whole.max()) < 1.0
    assert abs(float(whole.mean()) - 0.5) < 0.01 and abs(float(whole.var()) - 1 / 12) < 0.003
    assert not torch.equal(bm.uniforms(100, key=78), whole[:100])


def test_codebook16_is_the_dp_on_the_mirrored_histogram():
    g = torch.Generator().manual_seed(0)
    z = (torch.randn(50_000, generator=g) * 0.3).clamp(-1, 1)
    cb = bm.fit_codebook16([z])
    assert cb.shape == (16,) and cb[0] == -1 and cb[-1] == 1 and bool((cb[1:] > cb[:-1]).all())
    assert torch.allclose(cb, -cb.flip(0), atol=1e-6)  # the mirror image makes it symmetric
    # no other ascending 16-level codebook with the ends pinned does better on the (mirrored) data than the DP's
    zz = torch.cat([z, -z])

    def sse(c):
        return float((zz[:, None] - c[None, :]).abs().min(1).values.pow(2).sum())

    even = torch.linspace(-1, 1, 16)
    assert sse(cb) < sse(even)
    assert torch.equal(bm.fit_codebook16([torch.tensor([0.5, -0.5, 1.0])]), torch.linspace(-1, 1, 16))


def _opt(ref, model, **kw):
    return bm.ByteMoments(model.parameters(), lr=1e-2, betas=(0.9, 0.99), weight_decay=0.0, ref=ref, **kw)


def test_first_step_is_adamws_and_the_state_is_one_byte_per_element():
    for ref in ("fac", "block"):
        torch.manual_seed(0)
        a = nn.Linear(300, 64)
        b = nn.Linear(300, 64)
        b.load_state_dict(a.state_dict())
        x = torch.randn(32, 300)
        for m in (a, b):
            m(x).pow(2).mean().backward()
        ob = _opt(ref, b)
        ob.step()
        torch.optim.AdamW(a.parameters(), lr=1e-2, betas=(0.9, 0.99), weight_decay=0.0, eps=1e-8).step()
        assert torch.allclose(a.weight, b.weight, atol=1e-7) and torch.allclose(a.bias, b.bias, atol=1e-7)
        st = ob.state[b.weight]
        assert st["code"].dtype == torch.uint8 and st["code"].shape == (64, 300)
        extra = {"fac": 4 * (64 + 300), "block": 4 * 64 * 2}[ref]
        held = sum(t.numel() * t.element_size() for t in st.values() if isinstance(t, torch.Tensor))
        assert held == 64 * 300 + 4 * 64 * 2 + extra  # code, scale (2 blocks a row), the v reference


def test_codes_decode_unbiased_first_moment_and_v_on_its_grid():
    """Over many keys the decoded first moment averages to the float32 one (stochastic rounding between
    the two nearest codewords is unbiased in the value); v's decoded values are its reference times
    2^(k/2 - 4) (fac) or 2^-k (block)."""
    g = torch.Generator().manual_seed(1)
    for ref in ("fac", "block"):
        model = nn.Linear(256, 32)
        opt = _opt(ref, model)
        model(torch.randn(16, 256, generator=g)).pow(2).mean().backward()
        opt.step()  # learns the codebook and makes the state
        st = opt.state[model.weight]
        m = torch.randn(32, 256, generator=g) * torch.rand(32, 1, generator=g)
        v = torch.rand(32, 256, generator=g) ** 4 * 1e-3
        acc = torch.zeros_like(m)
        n = 300
        for k in range(n):
            opt._encode(st, m, v, 32, 256, (0, 10 + k, 0))
            dm, dv = opt._decode(st, 32, 256)
            acc += dm
            if ref == "fac":
                k2 = 2 * torch.log2(dv / opt._factored(st)) + 8
            else:
                k2 = -torch.log2(dv / bm._expand(st["vmax"], 256))
            assert ((k2 - k2.round()).abs() < 1e-3).all()
        err = (acc / n - m).abs() / bm._expand(st["scale"], 256)
        assert float(err.mean()) < 0.01 and float(err.max()) < 0.08


def test_prototype_trains_a_regression_as_adamw_does():
    def run(make):
        torch.manual_seed(0)
        net = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64))
        opt = make(net)
        g = torch.Generator().manual_seed(5)
        w = torch.randn(64, 64, generator=g) / 8
        for _ in range(300):
            x = torch.randn(64, 64, generator=g)
            opt.zero_grad()
            loss = (net(x) - x @ w).pow(2).mean()
            loss.backward()
            opt.step()
        return loss.item()

    adamw = run(lambda n: torch.optim.AdamW(n.parameters(), lr=3e-3, weight_decay=0.0))
    for ref in ("fac", "block", "core"):
        got = run(lambda n: bm.ByteMoments(n.parameters(), lr=3e-3, ref=ref))
        assert np.isfinite(got) and got < 1.25 * adamw, (ref, got, adamw)


def test_nearest_rounding_draws_nothing_and_stochastic_does():
    """ref="none" (the default's layout: 8-bit first moment, factored v): with m_round="nearest" the seed
    changes nothing; stochastic rounding depends on it; every stored index is a codeword of 256."""
    def run(seed, m_round):
        torch.manual_seed(0)
        net = nn.Linear(128, 64)
        opt = bm.ByteMoments(net.parameters(), lr=1e-2, ref="none", seed=seed, m_round=m_round)
        g = torch.Generator().manual_seed(2)
        for _ in range(5):
            opt.zero_grad()
            net(torch.randn(16, 128, generator=g)).pow(2).mean().backward()
            opt.step()
        assert opt.codebook.numel() == 256 and opt.state[net.weight]["code"].dtype == torch.uint8
        return net.weight.detach().clone()

    assert torch.equal(run(0, "nearest"), run(1, "nearest"))
    assert not torch.equal(run(0, "stochastic"), run(1, "stochastic"))


def test_decoded_update_is_adamws_update_of_the_stored_codes():
    """update="decoded": the step moves each weight by AdamW's (clamped) update of the moments decoded from
    the state the step stored, not of the float32 ones; update="fp32" does not."""
    def stepped(update):
        torch.manual_seed(0)
        net = nn.Linear(256, 48, bias=False)
        opt = bm.ByteMoments(net.parameters(), lr=1e-2, betas=(0.9, 0.99), ref="fac", update=update)
        g = torch.Generator().manual_seed(3)
        for _ in range(3):
            opt.zero_grad()
            net(torch.randn(16, 256, generator=g)).pow(2).mean().backward()
            before = net.weight.detach().clone()
            opt.step()
        st = opt.state[net.weight]
        m, v = opt._decode(st, 48, 256)
        t = st["step"]
        u = (m / (1 - 0.9 ** t)) / ((v / (1 - 0.99 ** t)).sqrt() + 1e-8)
        k = bm.clamp_bound(opt.bound, 0.9, 0.99, t)
        return (before - net.weight.detach()) / 1e-2, u.clamp(-k, k)

    moved, want = stepped("decoded")
    assert torch.allclose(moved, want, rtol=1e-4, atol=1e-5)
    moved, want = stepped("fp32")
    assert not torch.allclose(moved, want, rtol=1e-4, atol=1e-5)
