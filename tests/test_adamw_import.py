"""``Gefen.load_state_dict`` of a ``torch.optim.AdamW`` state dict (gefen_dist/optim/adamw_import.py):
the quantized tensors are warm-started from AdamW's moments, checked against torch's own AdamW state
and against continuing with AdamW."""
import copy

import pytest
import torch

from gefen_dist import Gefen
from gefen_dist.optim.adamw_import import is_adamw_entry

BETAS = (0.9, 0.95)


class Net(torch.nn.Module):
    """Tensors of every layout: factored with row blocks (256, 128), factored (96, 64, 2) (3-D),
    narrow rows kept per block of rows (512, 8), exact biases; a second group shared, a third
    elementwise."""

    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(512, 8)
        self.up = torch.nn.Linear(128, 256)
        self.mid = torch.nn.Linear(128, 96)
        self.w3 = torch.nn.Parameter(torch.randn(96, 64, 2) * 0.05)
        self.sh = torch.nn.Linear(96, 128)
        self.el = torch.nn.Linear(128, 64)

    def forward(self, tok, x):
        h = torch.relu(self.up(x))
        h = torch.relu(self.mid(h[:, :128] * h[:, 128:]))
        out = self.el(torch.relu(self.sh(h))) + torch.einsum("bi,ijk->bj", h, self.w3)
        return out + self.emb(tok).sum(1, keepdim=True)


def _groups(net, lr=1e-3):
    rest = [p for n, p in net.named_parameters() if not n.startswith(("sh.", "el."))]
    return [dict(params=rest, lr=lr), dict(params=list(net.sh.parameters()), lr=lr, second_moment="shared"),
            dict(params=list(net.el.parameters()), lr=lr, second_moment="elementwise")]


def _batch(gen):
    tok = torch.randint(0, 512, (32,), generator=gen) ** 2 // 512  # a skewed token distribution
    x = torch.randn(32, 128, generator=gen)
    return tok, x, torch.randn(32, 64, generator=gen) * 0.5


def _loss(net, b):
    tok, x, y = b
    return torch.nn.functional.mse_loss(net(tok, x), y)


def _train(net, opt, steps, gen):
    """``steps`` steps on the batches of ``gen`` (a generator: fresh batches), or on one batch (a tuple)."""
    losses = []
    for _ in range(steps):
        b = gen if isinstance(gen, tuple) else _batch(gen)
        opt.zero_grad()
        loss = _loss(net, b)
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    return losses


def _adamw_run(steps=30, seed=0):
    torch.manual_seed(seed)
    net = Net()
    opt = torch.optim.AdamW(_groups(net), betas=BETAS, weight_decay=0.01)
    gen = torch.Generator().manual_seed(seed + 100)
    _train(net, opt, steps, gen)
    return net, opt, gen


def test_adamw_state_dict_warm_starts_every_layout():
    """After 30 AdamW steps: the step count carries over, exact tensors take AdamW's moments bitwise,
    every quantized tensor's first moment dequantizes to AdamW's ``exp_avg`` within the codebook's
    resolution, and its second moment is the block / row / column means of AdamW's ``exp_avg_sq``
    (float64 means rounded once), in each layout."""
    net, adamw, _ = _adamw_run()
    sd = adamw.state_dict()
    opt = Gefen(_groups(net), betas=BETAS, weight_decay=0.01, small_threshold=1024)
    opt.load_state_dict(copy.deepcopy(sd))
    names = {id(p): n for n, p in net.named_parameters()}
    cb = opt.codebook
    assert cb is not None and float(cb[0]) == -1.0 and float(cb[-1]) == 1.0 and bool((cb[1:] >= cb[:-1]).all())
    modes = {}
    for p, st in opt.state.items():
        ref = adamw.state[p]
        assert int(st["step"]) == int(ref["step"]) == 30
        m, v = ref["exp_avg"], ref["exp_avg_sq"].double()
        if "exp_avg" in st:  # exact
            assert torch.equal(st["exp_avg"], m) and torch.equal(st["exp_avg_sq"], ref["exp_avg_sq"])
            modes[names[id(p)]] = "exact"
            continue
        assert st["learned"] == 1 and st["idx"].shape == p.shape
        rows, slab = p.shape[0], p.numel() // p.shape[0]
        if "v_blk" in st:  # narrow rows: blocks of k whole rows
            k = slab and -(-1024 // slab)
            blocks = torch.arange(rows) // k
            mq = cb[st["idx"].reshape(rows, slab).long()] * st["scale"][blocks].unsqueeze(1)
            vr = v.reshape(rows, slab)
            blk = torch.stack([vr[blocks == b].mean() for b in range(int(blocks.max()) + 1)])
            torch.testing.assert_close(st["v_blk"], blk.float(), rtol=0, atol=0)
            torch.testing.assert_close(st["v_col"], vr.mean(0).float(), rtol=0, atol=0)
            modes[names[id(p)]] = "span"
        else:
            B = st["scale_block"]
            mq = (cb[st["idx"].reshape(-1, B).long()] * st["scale"].reshape(-1, 1)).reshape(rows, slab)
            vr = v.reshape(rows, slab)
            if "v_row" in st:
                torch.testing.assert_close(st["v_row"], vr.mean(1, keepdim=True).float(), rtol=0, atol=0)
                G = st["v_col"].shape[0] if st["v_col"].dim() == 2 else 1
                want = vr.view(G, rows // G, slab).mean(1) if G > 1 else vr.mean(0)
                torch.testing.assert_close(st["v_col"], want.float(), rtol=0, atol=0)
                modes[names[id(p)]] = f"factored G={G}"
            else:
                P = st["period"]
                torch.testing.assert_close(st["v"], vr.view(rows, slab // P, P).mean(2).float(), rtol=0, atol=0)
                modes[names[id(p)]] = f"P={P}"
        m2 = m.reshape(rows, slab)
        err = (mq - m2).norm() / m2.norm()
        assert err < 0.02, (names[id(p)], float(err))
    assert modes["emb.weight"] == "span" and modes["up.weight"] == "factored G=2" and modes["el.weight"] == "P=1"
    assert modes["w3"].startswith("factored") and modes["sh.weight"].startswith("P=") and modes["up.bias"] == "exact"
    # Gefen's own state dict round-trips (a Gefen checkpoint from here on)
    again = Gefen(_groups(net), betas=BETAS, weight_decay=0.01, small_threshold=1024)
    again.load_state_dict(opt.state_dict())
    for p, st in opt.state.items():
        for k, t in st.items():
            if isinstance(t, torch.Tensor):
                assert torch.equal(t, again.state[p][k]), (names[id(p)], k)


def _full_batch_task(seed):
    """A teacher network's outputs on 256 fixed inputs (full batch): near convergence a reset optimizer
    state shows, because AdamW's steps there are far shorter than lr and a fresh optimizer's are not."""
    gen = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed + 7)
    teacher = Net()
    tok = torch.randint(0, 512, (256,), generator=gen) ** 2 // 512
    x = torch.randn(256, 128, generator=gen)
    with torch.no_grad():
        return tok, x, teacher(tok, x)


def test_continuing_from_adamw_state_tracks_adamw():
    """Switch optimizers after 150 full-batch AdamW steps (loss 26 -> 0.004) and take 30 more: Gefen
    warm-started from AdamW's state stays near AdamW's losses; Gefen started fresh, like a fresh
    AdamW, throws the model far off (its first steps move every weight by about lr)."""
    batch = _full_batch_task(1)
    torch.manual_seed(1)
    net = Net()
    adamw = torch.optim.AdamW(_groups(net, lr=3e-3), betas=BETAS, weight_decay=0.0)
    _train(net, adamw, 150, batch)
    sd, weights = adamw.state_dict(), copy.deepcopy(net.state_dict())

    def branch(cls, load, **kw):
        net.load_state_dict(weights)
        opt = cls(_groups(net, lr=3e-3), betas=BETAS, weight_decay=0.0, **kw)
        if load:
            opt.load_state_dict(copy.deepcopy(sd))
        return torch.tensor(_train(net, opt, 30, batch))

    ref = branch(torch.optim.AdamW, True)
    warm = branch(Gefen, True, small_threshold=1024)
    cold = branch(Gefen, False, small_threshold=1024)
    assert float(warm.mean()) < 3 * float(ref.mean()) and float(warm.max()) < 10 * float(ref.max()), (warm, ref)
    assert float(cold.mean()) > 20 * float(warm.mean()), (cold, warm)


def test_bad_adamw_state_is_refused_and_changes_nothing():
    """A NaN moment, a shape from another model, or AdamW moments for a quantized tensor beside Gefen
    state (a mixed checkpoint) raise a ValueError naming the parameter; the optimizer keeps its state."""
    net, adamw, gen = _adamw_run(steps=3)
    opt = Gefen(_groups(net), betas=BETAS, small_threshold=1024)
    _train(net, opt, 2, gen)
    before = copy.deepcopy(opt.state_dict())
    sd = adamw.state_dict()
    ids = {id(p): i for i, p in enumerate(p for g in adamw.param_groups for p in g["params"])}
    k_up = ids[id(net.up.weight)]

    bad = copy.deepcopy(sd)
    bad["state"][k_up]["exp_avg"][3, 4] = float("nan")
    with pytest.raises(ValueError, match=r"AdamW state of parameter 'group0.param\d' holds NaN"):
        opt.load_state_dict(bad)
    bad = copy.deepcopy(sd)
    bad["state"][k_up]["exp_avg_sq"] = bad["state"][k_up]["exp_avg_sq"][:, :64]
    with pytest.raises(ValueError, match=r"'exp_avg_sq' of parameter 'group0.param\d' has shape \(256, 64\)"):
        opt.load_state_dict(bad)
    mixed = copy.deepcopy(before)
    mixed["state"][k_up] = copy.deepcopy(sd["state"][k_up])
    assert is_adamw_entry(mixed["state"][k_up])
    with pytest.raises(ValueError, match=r"'group0.param\d'.*exact moments.*small_threshold"):
        opt.load_state_dict(mixed)
    after = opt.state_dict()
    for k, st in before["state"].items():
        for key, t in st.items():
            if isinstance(t, torch.Tensor):
                assert torch.equal(t, after["state"][k][key]), (k, key)


def test_a_tensor_adamw_never_stepped_is_learned_at_its_first_gradient():
    """A parameter whose AdamW moments are zero (no gradient yet: a frozen then unfrozen layer) gets
    the placeholder state, and learns its period at its first gradient under the imported codebook."""
    net, adamw, gen = _adamw_run(steps=5)
    sd = adamw.state_dict()
    ids = {id(p): i for i, p in enumerate(p for g in adamw.param_groups for p in g["params"])}
    k = ids[id(net.mid.weight)]
    sd["state"][k]["exp_avg"].zero_()
    sd["state"][k]["exp_avg_sq"].zero_()
    opt = Gefen(_groups(net), betas=BETAS, small_threshold=1024)
    opt.load_state_dict(sd)
    assert opt.state[net.mid.weight]["learned"] == 0 and opt.state[net.up.weight]["learned"] == 1
    cb = opt.codebook.clone()
    _train(net, opt, 1, gen)
    assert opt.state[net.mid.weight]["learned"] == 1 and torch.equal(opt.codebook, cb)


def test_zerogefen_warm_starts_like_gefen():
    """ZeroGefen (one process here; every rank keeps its slices of the same full entries) loads an
    AdamW state dict into the state Gefen builds: after one more step on the same gradients both
    hold the same parameters."""
    from gefen_dist import ZeroGefen

    net, adamw, gen = _adamw_run(steps=5)
    sd = adamw.state_dict()
    b = _batch(gen)
    params = {}
    for cls in (Gefen, ZeroGefen):
        torch.manual_seed(0)
        twin = Net()
        twin.load_state_dict(net.state_dict())
        opt = cls(_groups(twin), betas=BETAS, weight_decay=0.01, small_threshold=1024)
        opt.load_state_dict(copy.deepcopy(sd))
        _loss(twin, b).backward()
        opt.step()
        params[cls.__name__] = {n: p.detach().clone() for n, p in twin.named_parameters()}
        if cls is ZeroGefen:
            assert int(opt.state[twin.up.weight]["step"]) == 6 and opt.state[twin.up.weight]["learned"] == 1
    for n, p in params["Gefen"].items():
        torch.testing.assert_close(params["ZeroGefen"][n], p, rtol=1e-6, atol=1e-7, msg=n)


def test_amsgrad_state_is_refused_by_both():
    """AdamW with amsgrad keeps a third moment Gefen has no place for: both optimizers refuse it, unchanged."""
    from gefen_dist import ZeroGefen

    torch.manual_seed(0)
    net = Net()
    gen = torch.Generator().manual_seed(1)
    adamw = torch.optim.AdamW(_groups(net), betas=BETAS, amsgrad=True)
    _train(net, adamw, 2, gen)
    for cls in (Gefen, ZeroGefen):
        opt = cls(_groups(net), betas=BETAS, small_threshold=1024)
        with pytest.raises(ValueError, match="amsgrad"):
            opt.load_state_dict(copy.deepcopy(adamw.state_dict()))
        assert not opt.state, cls.__name__


def test_dcp_checkpoint_of_adamw_loads_as_the_warm_start(tmp_path, caplog):
    """``gefen_dist.checkpoint.load`` of a DCP checkpoint that AdamW's run saved (model and optimizer) gives
    the state ``Gefen.load_state_dict`` builds from the same AdamW state dict; amsgrad's is refused
    before anything loads. (FSDP2 and HSDP: tests/dist/fsdp_vs_single.py --adamw-import.)"""
    from gefen_dist import checkpoint as gck

    net, adamw, _ = _adamw_run(steps=4)
    gck.save(net, adamw, tmp_path / "ck")
    ref = Gefen(_groups(net), betas=BETAS, small_threshold=1024)
    ref.load_state_dict(copy.deepcopy(adamw.state_dict()))
    weights = copy.deepcopy(net.state_dict())
    with torch.no_grad():
        for p in net.parameters():
            p.add_(1.0)  # the load restores the model too
    opt = Gefen(_groups(net), betas=BETAS, small_threshold=1024)
    with caplog.at_level("INFO", logger="gefen_dist"):
        gck.load(net, opt, tmp_path / "ck")
    assert not [r for r in caplog.records if r.levelname == "WARNING"], caplog.text  # (a warm start is no surprise)
    assert "warm start from AdamW state" in caplog.text
    assert all(torch.equal(t, weights[k]) for k, t in net.state_dict().items())
    assert torch.equal(opt.codebook, ref.codebook)
    for p, st in ref.state.items():
        for k, t in st.items():
            if isinstance(t, torch.Tensor):
                assert torch.equal(t, opt.state[p][k]), k
    ams = torch.optim.AdamW(_groups(net), betas=BETAS, amsgrad=True)
    _train(net, ams, 1, torch.Generator().manual_seed(3))
    gck.save(net, ams, tmp_path / "ams")
    fresh = Gefen(_groups(net), betas=BETAS, small_threshold=1024)
    with pytest.raises(ValueError, match="amsgrad"):
        gck.load(net, fresh, tmp_path / "ams")
    assert not fresh.state
