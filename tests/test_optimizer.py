"""Gefen as a torch.optim drop-in: API semantics, errors, state_dict, introspection."""
import copy
import io
import logging
import math

import pytest
import torch
from torch import nn

from gefen_dist import Gefen


def mlp(seed=0, bias=True, dtype=torch.float32):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(64, 128, bias=bias), nn.GELU(), nn.Linear(128, 128, bias=bias),
                         nn.GELU(), nn.Linear(128, 16, bias=bias)).to(dtype)


def data(n, seed=1, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(64, 16, generator=g)
    out = []
    for _ in range(n):
        x = torch.randn(32, 64, generator=g)
        # row-structured targets so that gradients have row structure
        out.append((x.to(dtype), torch.tanh(x @ w).to(dtype)))
    return out


def train(model, opt, batches, sched=None):
    losses = []
    for x, y in batches:
        opt.zero_grad()
        loss = ((model(x) - y) ** 2).mean()
        loss.backward()
        opt.step()
        if sched is not None:
            sched.step()
        losses.append(loss.item())
    return losses


def test_exact_tensors_equal_torch_adamw_bitwise():
    # with a huge small_threshold every tensor keeps exact AdamW state
    a, b = mlp(), mlp()
    oa = torch.optim.AdamW(a.parameters(), lr=1e-2, weight_decay=0.1, foreach=False)
    ob = Gefen(b.parameters(), lr=1e-2, weight_decay=0.1, small_threshold=10**9)
    batches = data(5)
    train(a, oa, batches)
    train(b, ob, batches)
    for p, q in zip(a.parameters(), b.parameters()):
        assert torch.equal(p, q)
    assert all(r["kind"] == "exact" for r in ob.report())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_adamw_foreach_equals_single_tensor_steps(dtype):
    """The batched exact step (CUDA's path for small tensors) is adamw_step_ tensor by tensor."""
    from gefen_dist.core.step import adamw_foreach_, adamw_step_, bias_corrections

    gen = torch.Generator().manual_seed(0)
    shapes = [(7,), (0,), (33,), (4, 5)]
    ps = [torch.randn(s, generator=gen).to(dtype) for s in shapes]
    st = [[torch.zeros(s), torch.zeros(s)] for s in shapes]
    qs, su = [p.clone() for p in ps], [[a.clone(), b.clone()] for a, b in st]
    for step in range(1, 4):
        gs = [torch.randn(s, generator=gen).to(dtype) for s in shapes]
        bc1, bc2 = bias_corrections(step, 0.9, 0.95)
        hp = dict(lr=1e-2, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1, bc1=bc1, bc2=bc2)
        for p, g, (m, v) in zip(ps, gs, st):
            adamw_step_(p, g, m, v, **hp)
        adamw_foreach_(qs, gs, [m for m, _ in su], [v for _, v in su], **hp)
    for a, b in zip(ps + [t for x in st for t in x], qs + [t for x in su for t in x]):
        assert torch.equal(a, b)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_cuda_batch_matches_per_tensor_path(monkeypatch, dtype):
    """On a GPU: the multi-tensor plan (gefen_dist.engine.cuda_batch) against the same optimizer stepping
    tensor by tensor with the same Triton kernels, the same gradients: same indices and scales,
    parameters equal up to the column sums' summation order (fp32 and bf16, whose exact tensors
    take the foreach dtype copies)."""
    pytest.importorskip("triton")
    from gefen_dist.engine import cuda_batch as cuda_path

    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 768), nn.GELU(),
                         nn.Linear(768, 16)).cuda().to(dtype)
    a, b = copy.deepcopy(base), copy.deepcopy(base)
    oa, ob = Gefen(a.parameters(), lr=1e-3, weight_decay=0.1), Gefen(b.parameters(), lr=1e-3, weight_decay=0.1)
    get = cuda_path.CudaBatch.__dict__["get"].__func__
    monkeypatch.setattr(cuda_path.CudaBatch, "get", classmethod(
        lambda cls, opt, entries: None if opt is oa else get(cls, opt, entries)))
    for x, y in data(12, dtype=dtype):
        oa.zero_grad()
        ((a(x.cuda()) - y.cuda()) ** 2).mean().backward()
        for p, q in zip(a.parameters(), b.parameters()):
            q.grad = p.grad.clone()
        oa.step()
        ob.step()
    assert ob._cuda_batch is not None and getattr(oa, "_cuda_batch", None) is None
    for p, q in zip(a.parameters(), b.parameters()):
        sa, sb = oa.state[p], ob.state[q]
        if "idx" in sa:
            assert (sa["idx"] != sb["idx"]).float().mean().item() <= 1e-4
        torch.testing.assert_close(q.float(), p.float(), rtol=1e-2 if dtype == torch.bfloat16 else 1e-5,
                                   atol=1e-5 * p.float().abs().max().item())


def test_cuda_without_triton_warns_once(monkeypatch, caplog):
    """CUDA parameters without a usable triton: the eager path, and one warning that says why."""
    import types

    pytest.importorskip("triton")
    from gefen_dist.kernels import triton_step

    from gefen_dist.kernels import dispatch

    monkeypatch.setattr(triton_step, "available", lambda device=None: False)
    dispatch._warn_no_triton.cache_clear()  # once per process: start this test's count from zero
    opt = Gefen(mlp().parameters())
    fake = types.SimpleNamespace(device=torch.device("cuda"), dtype=torch.float32)
    with caplog.at_level(logging.WARNING, logger="gefen_dist.kernels.dispatch"):
        assert opt._impl(fake).name == "eager"
        assert opt._impl(fake).name == "eager"
    msgs = [r.getMessage() for r in caplog.records if "triton is not importable" in r.getMessage()]
    assert len(msgs) == 1 and "pip install triton" in msgs[0]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("second_moment", ["factored", "shared"])
def test_cuda_step_matches_cpu_eager(second_moment):
    """Gefen on a CUDA model (Triton kernels, foreach exact tensors, no per-tensor host syncs)
    against the eager path on CPU: same periods and codebook, parameters close after 20 steps."""
    pytest.importorskip("triton")
    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 512), nn.GELU(), nn.Linear(512, 16))
    a, b = copy.deepcopy(base), copy.deepcopy(base).cuda()
    oa = Gefen(a.parameters(), lr=1e-3, weight_decay=0.1, fused=False, second_moment=second_moment)
    ob = Gefen(b.parameters(), lr=1e-3, weight_decay=0.1, second_moment=second_moment)
    batches = data(20)
    for x, y in batches:
        for model, opt, dev in ((a, oa, "cpu"), (b, ob, "cuda")):
            opt.zero_grad()
            ((model(x.to(dev)) - y.to(dev)) ** 2).mean().backward()
        for p, q in zip(a.parameters(), b.parameters()):
            q.grad.copy_(p.grad)  # the same gradients on both sides
        oa.step()
        ob.step()
    assert torch.equal(oa.codebook, ob.codebook.cpu())
    for p, q in zip(a.parameters(), b.parameters()):
        sa, sb = oa.state[p], ob.state[q]
        assert sa.get("period") == sb.get("period")
        scale = p.abs().max().item()
        torch.testing.assert_close(q.detach().cpu(), p.detach(), rtol=1e-5, atol=1e-5 * scale)


def test_named_params_groups_kept_and_report():
    m = mlp()
    decay = [(n, p) for n, p in m.named_parameters() if p.ndim >= 2]
    no_decay = [(n, p) for n, p in m.named_parameters() if p.ndim < 2]
    opt = Gefen([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0, "lr": 5e-4}],
                lr=1e-3)
    assert len(opt.param_groups) == 2
    assert opt.param_groups[1]["lr"] == 5e-4 and opt.param_groups[0]["weight_decay"] == 0.1
    train(m, opt, data(2))
    rep = opt.report()
    names = [r["name"] for r in rep]
    assert names == [n for n, _ in decay] + [n for n, _ in no_decay]
    by = {r["name"]: r for r in rep}
    assert by["2.weight"]["kind"] == "quantized" and by["2.weight"]["period"] >= 1
    assert by["0.bias"]["kind"] == "exact"  # 1-D (D2)
    assert by["4.weight"]["kind"] == "exact"  # 2048 elements < 4096 (D2)
    for r in rep:
        assert {"name", "shape", "period", "scale_block", "state_bytes", "kind"} <= set(r)
    assert sum(r["state_bytes"] for r in rep) + 256 * 4 == opt.state_bytes()
    assert "B/param" in str(rep)
    # the codebook: 256 ascending fp32 codewords with pinned ends
    cb = opt.codebook
    assert cb.dtype == torch.float32 and cb.shape == (256,)
    assert cb[0] == -1 and cb[-1] == 1 and bool((cb[1:] > cb[:-1]).all())


def test_state_bytes_and_layout_of_a_quantized_tensor():
    w = nn.Parameter(torch.zeros(64, 512))
    opt = Gefen([w], lr=1e-3, second_moment="shared")
    torch.manual_seed(0)
    w.grad = torch.randn(64, 512) * torch.rand(64, 1)
    opt.step()
    st = opt.state[w]
    P, B = st["period"], st["scale_block"]
    assert st["idx"].dtype == torch.uint8 and st["idx"].shape == w.shape
    assert st["scale"].shape == (64, 512 // B) and st["v"].shape == (64, 512 // P)
    assert st["scale"].dtype == torch.float32 and st["v"].dtype == torch.float32
    assert opt.state_bytes() == 64 * 512 + 4 * (64 * 512 // B + 64 * 512 // P) + 1024


def test_factored_is_the_default_layout():
    w = nn.Parameter(torch.zeros(64, 512))
    opt = Gefen([w], lr=1e-3)
    torch.manual_seed(0)
    w.grad = torch.randn(64, 512) * torch.rand(64, 1) * torch.rand(1, 512)
    opt.step()
    st = opt.state[w]
    B = st["scale_block"]
    assert "v" not in st and st["v_row"].shape == (64, 1) and st["v_col"].shape == (512,)
    assert opt.state_bytes() == 64 * 512 + 4 * (64 * 512 // B + 64 + 512) + 1024
    # one step of the factored estimator equals its definition: v = (1-b2) * rowmean * colmean / mean
    g2 = w.grad.double() ** 2
    assert torch.allclose(st["v_row"].view(-1).double(), 0.001 * g2.mean(1), rtol=1e-5)
    assert torch.allclose(st["v_col"].double(), 0.001 * g2.mean(0), rtol=1e-5)


@pytest.mark.parametrize("fused", [False, None])
def test_elementwise_group_is_period_one(fused):
    """second_moment="elementwise" (here for one param group): v per element, the first moment still
    8-bit, and the same numbers as the shared layout with that tensor's period forced to 1."""
    def make(m, mode):
        w = m[2].weight
        rest = [p for p in m.parameters() if p is not w]
        return Gefen([{"params": [w], "second_moment": mode}, {"params": rest}], lr=1e-2, weight_decay=0.1,
                     fused=fused)

    m1, m2 = mlp(), mlp()
    o1 = make(m1, "elementwise")
    o2 = make(m2, "shared")
    learn = o2._learn_periods  # the shared layout with the period of m2[2].weight forced to 1
    o2._learn_periods = lambda live: [1 if p is m2[2].weight else q for (p, _), q in zip(live, learn(live))]
    train(m1, o1, data(4))
    train(m2, o2, data(4))
    st = o1.state[m1[2].weight]
    assert st["period"] == 1 and st["v"].shape == (128, 128) and st["idx"].dtype == torch.uint8
    assert "v_row" in o1.state[m1[0].weight]  # the other group keeps the default (factored)
    for a, b in zip(m1.parameters(), m2.parameters()):
        assert torch.equal(a, b)
    for k in ("idx", "scale", "v"):
        assert torch.equal(st[k], o2.state[m2[2].weight][k])
    rec = {r["shape"]: r for r in o1.report()}[(128, 128)]
    assert rec["period"] == 1 and rec["state_bytes"] == 128 * 128 * 5 + 4 * 128 * 128 // rec["scale_block"]


def test_plan_knows_elementwise():
    from gefen_dist.plan import tensor_state

    r = tensor_state((768, 768), second_moment="elementwise")
    assert r["period"] == 1 and r["gefen_bytes"] == 768 * 768 * 5 + 4 * 768 * 768 // r["scale_block"]


def test_closure_evaluated_before_learning():
    m = mlp()
    opt = Gefen(m.parameters(), lr=1e-3)
    x, y = data(1)[0]

    def closure():
        opt.zero_grad()
        loss = ((m(x) - y) ** 2).mean()
        loss.backward()
        return loss

    loss = opt.step(closure)  # the very first grads come from the closure
    assert isinstance(loss, torch.Tensor)
    assert opt.codebook is not None and opt.codebook[0] == -1


def test_zero_grad_first_step_does_not_freeze_codebook():
    m = mlp()
    opt = Gefen(m.parameters(), lr=0.0)
    for p in m.parameters():
        p.grad = torch.zeros_like(p)
    before = [p.clone() for p in m.parameters()]
    opt.step()  # what DCP's _init_optim_state does: zero grads, lr=0
    assert opt.codebook is None
    assert all(torch.equal(a, b) for a, b in zip(before, m.parameters()))
    assert all(not r.get("learned", True) for r in opt.report() if r["kind"] == "quantized")
    for g in opt.param_groups:
        g["lr"] = 1e-3
    train(m, opt, data(2))
    assert opt.codebook is not None and len(torch.unique(opt.codebook)) == 256
    assert all(r["learned"] for r in opt.report() if r["kind"] == "quantized")


def test_add_param_group_after_codebook_learned():
    m = mlp()
    extra = nn.Parameter(torch.zeros(32, 256))
    opt = Gefen(m.parameters(), lr=1e-3)
    train(m, opt, data(2))
    cb = opt.codebook.clone()
    opt.add_param_group({"params": [extra], "lr": 1e-2})
    torch.manual_seed(3)
    extra.grad = torch.randn(32, 256) * torch.rand(32, 1)
    opt.step()
    assert torch.equal(opt.codebook, cb)  # never re-learned
    st = opt.state[extra]
    assert st["learned"] == 1 and 256 % st["period"] == 0
    assert extra.abs().sum() > 0


def test_group_lookup_follows_changes_to_the_groups():
    """``_group_of`` keeps a table by parameter id (a step looks each tensor up in O(1)); it must follow
    add_param_group, a params list replaced in place (as DeepSpeed does with its flat partitions),
    group-level options changed between steps, and refuse a foreign tensor."""
    a, b, c = (nn.Parameter(torch.zeros(64, 64)) for _ in range(3))
    opt = Gefen([{"params": [a]}, {"params": [b], "fused": False}], lr=1e-3)
    g0, g1 = opt.param_groups
    assert opt._group_of(a) is g0 and opt._group_of(b) is g1 and opt._fused(b) is False
    g0["fused"] = False  # an option changed in place: read from the group at every call
    assert opt._fused(a) is False
    opt.add_param_group({"params": [c], "lr": 1e-2})
    assert opt._group_of(c) is opt.param_groups[2]
    g1["params"] = [c]  # the list replaced: b left the groups, c is in two
    with pytest.raises(KeyError):
        opt._group_of(b)
    with pytest.raises(KeyError):
        opt._group_of(nn.Parameter(torch.zeros(2)))
    g1["params"] = [b]
    for p in (a, b, c):
        p.grad = torch.randn(64, 64)
    opt.step()  # every tensor steps with its own group
    assert all(opt.state[p]["step"] == 1 for p in (a, b, c))
    opt2 = copy.deepcopy(opt)  # the table is rebuilt for the copy's parameters
    pa = opt2.param_groups[0]["params"][0]
    assert opt2._group_of(pa) is opt2.param_groups[0]


def test_lr_scheduler_and_tensor_lr():
    m = mlp()
    opt = Gefen(m.parameters(), lr=torch.tensor(1e-3))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    losses = train(m, opt, data(4), sched)
    assert all(math.isfinite(v) for v in losses)
    assert float(opt.param_groups[0]["lr"]) == pytest.approx(1e-3 / 5)


def test_params_without_grad_skipped_and_frozen_ignored():
    m = mlp()
    m[0].weight.requires_grad_(False)
    opt = Gefen(m.parameters(), lr=1e-3)
    frozen = m[0].weight.clone()
    x, y = data(1)[0]
    ((m[2](m[1](m[0](x))) ** 2).mean()).backward()  # layer 4 gets no grad
    opt.step()
    assert m[4].weight not in opt.state and m[0].weight not in opt.state
    assert torch.equal(frozen, m[0].weight)
    assert all(r["name"] != "group0.param0" for r in opt.report())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_params(dtype):
    m = mlp(dtype=dtype)
    opt = Gefen(m.parameters(), lr=1e-3)
    losses = train(m, opt, data(8, dtype=dtype))
    assert all(math.isfinite(v) for v in losses)
    assert losses[-1] < losses[0]
    for p in m.parameters():
        assert p.dtype == dtype
        st = opt.state[p]
        for k in ("scale", "v", "exp_avg", "exp_avg_sq"):
            if k in st:
                assert st[k].dtype == torch.float32  # D5: fp32 state whatever the param dtype


def test_errors_name_the_value():
    m = mlp()
    with pytest.raises(ValueError, match="learning rate.*-1"):
        Gefen(m.parameters(), lr=-1)
    with pytest.raises(ValueError, match="beta parameter at index 1.*1.5"):
        Gefen(m.parameters(), betas=(0.9, 1.5))
    with pytest.raises(ValueError, match="epsilon.*-1e-08"):
        Gefen(m.parameters(), eps=-1e-8)
    with pytest.raises(ValueError, match="weight_decay.*nan"):
        Gefen(m.parameters(), weight_decay=float("nan"))
    with pytest.raises(ValueError, match="small_threshold"):
        Gefen(m.parameters(), small_threshold=-5)
    with pytest.raises(ValueError, match="second_moment.*'rowwise'.*elementwise"):
        Gefen(m.parameters(), second_moment="rowwise")
    with pytest.raises(TypeError, match="floating-point.*torch.int64"):
        Gefen([torch.zeros(4, dtype=torch.int64)])
    with pytest.raises(ValueError, match="beta parameter at index 0 in param group 1: 1.0"):
        opt = Gefen(m.parameters())
        opt.add_param_group({"params": [nn.Parameter(torch.zeros(3))], "betas": (1.0, 0.9)})
    emb = nn.Embedding(10, 4, sparse=True)
    opt = Gefen(emb.parameters())
    emb(torch.tensor([1, 2])).sum().backward()
    with pytest.raises(RuntimeError, match="sparse gradients.*'group0.param0'"):
        opt.step()
    # complex parameters are stepped as their real view (tests/test_conformance.py::test_complex)


def _roundtrip(sd):
    buf = io.BytesIO()
    torch.save(sd, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_state_dict_roundtrip_resumes_bit_identically(dtype):
    batches = data(12, dtype=dtype)
    a = mlp(dtype=dtype)
    oa = Gefen(a.parameters(), lr=1e-3, weight_decay=0.05)
    train(a, oa, batches)

    b = mlp(dtype=dtype)
    ob = Gefen(b.parameters(), lr=1e-3, weight_decay=0.05)
    train(b, ob, batches[:6])
    model_sd, opt_sd = _roundtrip(b.state_dict()), _roundtrip(ob.state_dict())

    c = mlp(seed=99, dtype=dtype)
    c.load_state_dict(model_sd)
    oc = Gefen(c.parameters(), lr=1e-3, weight_decay=0.05)
    oc.load_state_dict(opt_sd)
    for p, q in zip(b.parameters(), c.parameters()):
        for k, v in ob.state[p].items():
            w = oc.state[q][k]
            if isinstance(v, torch.Tensor):
                assert w.dtype == v.dtype and torch.equal(w, v), k  # uint8 stays uint8
            else:
                assert w == v, k
    assert torch.equal(oc.codebook, ob.codebook)
    # the codebook is shared again, not one copy per tensor
    cbs = {id(st["codebook"]) for st in oc.state.values() if "codebook" in st}
    assert len(cbs) == 1
    train(c, oc, batches[6:])
    for p, q in zip(a.parameters(), c.parameters()):
        assert torch.equal(p, q)


def test_load_state_dict_rejects_other_model():
    a = mlp()
    oa = Gefen(a.parameters())
    train(a, oa, data(1))
    torch.manual_seed(0)
    b = nn.Sequential(nn.Linear(64, 96), nn.GELU(), nn.Linear(96, 128), nn.GELU(), nn.Linear(128, 16))
    ob = Gefen(b.parameters())
    with pytest.raises(ValueError, match="shape"):
        ob.load_state_dict(oa.state_dict())


def test_codebook_learned_log_line(caplog):
    m = mlp()
    opt = Gefen(m.parameters())
    with caplog.at_level(logging.INFO, logger="gefen_dist.optim.gefen"):
        train(m, opt, data(2))
    lines = [r for r in caplog.records if "learned its symmetric codebook" in r.getMessage()]  # D17
    assert len(lines) == 1
    assert "RMS quantization error" in lines[0].getMessage()


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_nonfinite_gradients_raise_or_skip(bad):
    m = mlp()
    opt = Gefen(m.named_parameters(), lr=1e-3)
    train(m, opt, data(2))
    before = copy.deepcopy(opt.state_dict())
    params = [p.clone() for p in m.parameters()]
    x, y = data(1, seed=5)[0]
    ((m(x) - y) ** 2).mean().backward()
    m[2].weight.grad[3, 7] = bad
    with pytest.raises(RuntimeError, match=r"non-finite gradient.*'2.weight'.*nonfinite='skip'"):
        opt.step()
    opt.nonfinite = "skip"
    opt.step()
    assert opt.skipped_steps == 1
    assert all(torch.equal(a, b) for a, b in zip(params, m.parameters()))
    after = opt.state_dict()
    for k, st in before["state"].items():
        for key, v in st.items():
            assert (torch.equal(v, after["state"][k][key]) if isinstance(v, torch.Tensor)
                    else v == after["state"][k][key])
    with pytest.raises(ValueError, match="nonfinite"):
        Gefen(m.parameters(), nonfinite="warn")


def test_fsdp1_flat_parameter_refused_with_pointer_to_fully_shard():
    # FSDP1 itself cannot be built on a CPU-only machine; its FlatParameter class can.
    from torch.distributed.fsdp._flat_param import FlatParameter

    fp = FlatParameter(torch.zeros(10), requires_grad=True)
    with pytest.raises(TypeError, match=r"FSDP1 FlatParameter.*fully_shard"):
        Gefen([fp])
