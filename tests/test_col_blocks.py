"""Column blocks of the factored second moment (D21, ``col_blocks``): D12's row blocks transposed, for
``(R, k x R)`` weights such as Hugging Face GPT-2's ``Conv1D`` ``(in, out)`` layers. Single process here
(ZeroGefen at one rank too); FSDP2 (rows cut by the shards, an empty shard) in tests/test_fsdp2.py
(``--col-blocks``), DCP resharding in tests/dist/dcp_reshard.py, ZeroGefen at 2 and 3 ranks in
tests/dist/zero_check.py and tests/dist/batch_check.py, DeepSpeed ZeRO-2/3 and its checkpoints in
tests/dist/ds_check.py, the Hugging Face Trainer under DeepSpeed in tests/dist/hf_trainer_ds.py, the multi-tensor
batches in tests/test_cpu_batch.py, tests/test_flat_batch.py and tests/test_triton_step.py."""
import copy
import logging
import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from gefen_dist import Gefen, ZeroGefen
from gefen_dist import checkpoint as gckpt
from gefen_dist.core.periods import factored_col_blocks


def _grads(shape, n, seed=0):
    g = torch.Generator().manual_seed(seed)
    # columns of very different scales in each block, rows too: what one profile per row cannot follow
    scale = (10.0 ** torch.randint(-2, 2, (shape[0], 1), generator=g)) * (10.0 ** torch.randint(-2, 2, (1, shape[1]),
                                                                                                 generator=g))
    return [torch.randn(shape, generator=g) * scale for _ in range(n)]


@pytest.mark.parametrize("fused", [False, None])
def test_column_blocks_step_as_separate_tensors(fused):
    """A ``(R, K x C)`` tensor with ``col_blocks=K`` steps bit for bit as its K blocks of columns stepped as
    separate ``(R, C)`` tensors with one row statistic each (their scale blocks lie inside the column
    blocks, the codebook is learned from the same values): the eager reference (``fused=False``) and the
    native CPU kernel (``fused=None``; the blocks then step in the multi-tensor batch)."""
    R, K = 64, 3
    torch.manual_seed(0)
    w0 = torch.randn(R, K * R)
    grads = _grads((R, K * R), 5)
    w = nn.Parameter(w0.clone())
    opt = Gefen([w], lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1, col_blocks="auto", fused=fused)
    parts = [nn.Parameter(w0[:, b * R:(b + 1) * R].clone()) for b in range(K)]
    ref = Gefen(parts, lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1, fused=fused)
    for g in grads:
        w.grad = g.clone()
        opt.step()
        for b, q in enumerate(parts):
            q.grad = g[:, b * R:(b + 1) * R].contiguous()
        ref.step()
    st = opt.state[w]
    assert tuple(st["v_row"].shape) == (R, K) and tuple(st["v_col"].shape) == (K * R,) and st["scale_block"] == R
    assert torch.equal(w.detach(), torch.cat([q.detach() for q in parts], dim=1))
    for b, q in enumerate(parts):
        assert torch.equal(st["v_row"][:, b], ref.state[q]["v_row"].view(-1))
        assert torch.equal(st["idx"][:, b * R:(b + 1) * R], ref.state[q]["idx"])
    assert not torch.equal(w.detach(), w0)


def test_column_blocks_are_exact_on_block_rank_one_squares():
    """On a gradient whose square is rank-1 within each block of columns (``a[i, b(j)] c[j]``) the
    estimate ``v_row[i, b(j)] v_col[j] / mean_{b(j)} v_col`` is that square's EMA; one row statistic per
    row (the default) is off by a factor of up to the blocks' spread."""
    R, K, b2 = 64, 4, 0.95
    torch.manual_seed(1)
    a = torch.rand(R, K) * 10 + 0.05
    c = torch.rand(K * R) + 0.05
    g2 = a.repeat_interleave(R, dim=1) * c
    g = g2.sqrt() * torch.where(torch.rand(R, K * R) < 0.5, -1.0, 1.0)
    err = {}
    for cb in ("auto", 1):
        w = nn.Parameter(torch.randn(R, K * R))
        opt = Gefen([w], lr=1e-3, betas=(0.9, b2), col_blocks=cb, fused=False)
        for _ in range(3):
            w.grad = g.clone()
            opt.step()
        st = opt.state[w]
        k = st["v_row"].shape[1]
        vc = st["v_col"].view(k, -1)
        v = st["v_row"].repeat_interleave(K * R // k, dim=1) * (vc / vc.mean(dim=1, keepdim=True)).view(1, -1)
        err[cb] = float((v / (g2 * (1 - b2 ** 3)) - 1).abs().max())
    assert err["auto"] < 1e-5 and err[1] > 1.0, err


def test_rule_options_and_refusals():
    assert [factored_col_blocks(s, "auto") for s in ((64, 192), (64, 64), (64, 576), (64, 100), (192, 64))] == \
        [3, 1, 1, 1, 1]  # k in 2..8; (64, 576) is k = 9
    assert factored_col_blocks((64, 192), 4) == 4 and factored_col_blocks((64, 192), None) == 1
    # "shape": the same rule as "auto", spelled so that a Hugging Face DeepSpeed JSON keeps it (the Trainer fills in
    # every "auto" itself and refuses one it does not know); trainer_deepspeed_config writes it so
    from gefen_dist.integrations.hf import trainer_deepspeed_config

    assert [factored_col_blocks(s, "shape") for s in ((64, 192), (64, 64), (64, 100))] == [3, 1, 1]
    assert Gefen([nn.Parameter(torch.randn(64, 192))], col_blocks="shape").param_groups[0]["col_blocks"] == "shape"
    params = trainer_deepspeed_config(2, col_blocks="auto", row_blocks="auto", narrow_rows="auto")["optimizer"]["params"]
    assert params["col_blocks"] == params["row_blocks"] == "shape" and "narrow_rows" not in params
    w = nn.Parameter(torch.randn(64, 192))
    for bad in ("yes", 0, True, 2.0):
        with pytest.raises(ValueError, match="col_blocks"):
            Gefen([w], col_blocks=bad)
    with pytest.raises(ValueError, match="col_blocks"):
        Gefen([{"params": [w], "col_blocks": -1}])
    # an int that does not divide the rows is refused at the first step, naming the tensor, before any change
    opt = Gefen([w], col_blocks=5)
    w.grad = torch.randn_like(w)
    before = w.detach().clone()
    with pytest.raises(ValueError, match=r"col_blocks=5 does not divide the rows of 192"):
        opt.step()
    assert torch.equal(w.detach(), before) and not opt.state.get(w)
    # row blocks and column blocks on one tensor: refused with the fix
    sq = nn.Parameter(torch.randn(128, 128))
    opt = Gefen([sq], row_blocks=2, col_blocks=2)
    sq.grad = torch.randn_like(sq)
    with pytest.raises(ValueError, match="row blocks .* column blocks"):
        opt.step()
    # "nibbles" keeps one row statistic per row
    nib = nn.Parameter(torch.randn(64, 192))
    opt = Gefen([nib], second_moment="nibbles", col_blocks="auto")
    nib.grad = torch.randn_like(nib)
    opt.step()
    assert tuple(opt.state[nib]["v_row"].shape) == (64, 1)


@pytest.mark.parametrize("fused", [False, None])
def test_zerogefen_one_rank_is_gefen(fused):
    """ZeroGefen with ``col_blocks="auto"`` (one rank; ``tests/dist/zero_check.py`` at 2 and 3 ranks): bitwise
    Gefen, its column-blocked tensor's update travels compressed (idx, M and sqrt(v_row) per row and block of
    columns; fp32, so the plain factored one's too), the same state dict, and each loads the other's and
    continues bitwise."""
    from gefen_dist.zero.partition import MODE_FACTORED

    torch.manual_seed(0)
    shapes = ((64, 192), (96, 96), (40,))
    a = [nn.Parameter(torch.randn(s) * 0.1) for s in shapes]
    b = [nn.Parameter(p.detach().clone()) for p in a]
    oa, ob = (cls(ps, lr=1e-2, weight_decay=0.1, col_blocks="auto", fused=fused, small_threshold=1024)
              for cls, ps in ((Gefen, a), (ZeroGefen, b)))

    def train(pairs, n, seed):
        g = torch.Generator().manual_seed(seed)
        for _ in range(n):
            grads = [torch.randn(s, generator=g) for s in shapes]
            for ps, o in pairs:
                for p, gr in zip(ps, grads):
                    p.grad = gr.clone()
                o.step()

    train([(a, oa), (b, ob)], 3, 1)
    assert all(torch.equal(p, q) for p, q in zip(a, b))
    assert tuple(ob.state[b[0]]["v_row"].shape) == (64, 3) and tuple(ob.state[b[1]]["v_row"].shape) == (96,)
    assert [ob._wire_mode(p, ob.state[p]) for p in b[:2]] == [MODE_FACTORED, MODE_FACTORED]
    assert ob.last_wire["bytes_per_rank"][0] < 4 * sum(p.numel() for p in b[:2])  # (the 40-element one: exact)
    sa, sb = oa.state_dict(), ob.state_dict()
    assert sa["param_groups"] == sb["param_groups"]
    for k, st in sa["state"].items():
        for kk, v in st.items():
            w = sb["state"][k][kk]
            assert (torch.equal(v, w) and v.shape == w.shape if isinstance(v, torch.Tensor) else v == w), (k, kk)
    c, d = ([nn.Parameter(p.detach().clone()) for p in a] for _ in range(2))
    oc, od = (cls(ps, lr=1e-2, weight_decay=0.1, col_blocks="auto", fused=fused, small_threshold=1024)
              for cls, ps in ((Gefen, c), (ZeroGefen, d)))
    oc.load_state_dict(copy.deepcopy(sb))
    od.load_state_dict(copy.deepcopy(sa))
    train([(a, oa), (b, ob), (c, oc), (d, od)], 2, 2)
    assert all(torch.equal(p, q) and torch.equal(p, r) and torch.equal(p, t) for p, q, r, t in zip(a, b, c, d))


def test_an_implementation_without_column_blocks_falls_back_to_the_eager_reference(caplog):
    """Where the selected kernels do not take column blocks (the Triton ones, on CUDA), such a tensor is
    stepped by the eager reference, announced once (INFO), with the eager reference's results."""
    import dataclasses

    from gefen_dist.kernels import dispatch

    no_cb = dataclasses.replace(dispatch.select(torch.zeros(1), None), name="no-col-blocks", col_blocks=False)
    grads = _grads((64, 192), 4, seed=9)
    out = []
    for impl in (no_cb, None):
        torch.manual_seed(3)
        w = nn.Parameter(torch.randn(64, 192))
        opt = Gefen([w], col_blocks="auto", fused=None if impl is not None else False)
        if impl is not None:
            opt._impl = lambda t, p=None, group=None: no_cb
        with caplog.at_level(logging.INFO, logger="gefen_dist.engine.tensor_step"):
            for g in grads:
                w.grad = g.clone()
                opt.step()
        out.append(w.detach().clone())
    assert sum("no-col-blocks kernels do not take them" in r.getMessage() for r in caplog.records) == 1
    assert torch.equal(out[0], out[1])


def test_state_dict_round_trip_and_mismatch():
    torch.manual_seed(2)
    w = nn.Parameter(torch.randn(64, 256))
    opt = Gefen([w], lr=1e-2, col_blocks="auto")
    for g in _grads((64, 256), 3, seed=3):
        w.grad = g
        opt.step()
    sd = copy.deepcopy(opt.state_dict())
    assert sd["param_groups"][0]["col_blocks"] == "auto" and tuple(sd["state"][0]["v_row"].shape) == (64, 4)
    w2 = nn.Parameter(w.detach().clone())
    opt2 = Gefen([w2], lr=1e-2, col_blocks="auto")
    opt2.load_state_dict(sd)
    g = torch.randn(64, 256)
    w.grad, w2.grad = g.clone(), g.clone()
    opt.step()
    opt2.step()
    assert torch.equal(w, w2)
    # a state saved with one row statistic per row (an older version's: no col_blocks key) into col_blocks="auto":
    # a clear error, nothing loaded
    w3 = nn.Parameter(torch.randn(64, 256))
    old = Gefen([w3], lr=1e-2)
    w3.grad = torch.randn_like(w3)
    old.step()
    sd3 = copy.deepcopy(old.state_dict())
    del sd3["param_groups"][0]["col_blocks"]
    w4 = nn.Parameter(w3.detach().clone())
    new = Gefen([w4], lr=1e-2, col_blocks="auto")
    with pytest.raises(ValueError, match=r"1 column block\(s\) \(D21\).*col_blocks='auto'.*col_blocks=1"):
        new.load_state_dict(sd3)
    assert not new.state


def test_adamw_state_imports_per_column_block():
    """A torch AdamW state dict loaded into Gefen(col_blocks='auto'): v_row per block of columns is the mean
    of the block's exp_avg_sq."""
    torch.manual_seed(4)
    w = nn.Parameter(torch.randn(64, 192))
    adam = torch.optim.AdamW([w], lr=1e-3)
    for g in _grads((64, 192), 3, seed=5):
        w.grad = g
        adam.step()
    sd = adam.state_dict()
    w2 = nn.Parameter(w.detach().clone())
    opt = Gefen([w2], lr=1e-3, col_blocks="auto")
    opt.load_state_dict(sd)
    st = opt.state[w2]
    want = sd["state"][0]["exp_avg_sq"].double().view(64, 3, 64).mean(dim=2).float()
    assert tuple(st["v_row"].shape) == (64, 3) and torch.allclose(st["v_row"], want, rtol=1e-6, atol=0)
    assert st["period"] == st["scale_block"] == 64  # the scale blocks inside the column blocks
    w2.grad = torch.randn_like(w2)
    opt.step()  # and it steps on from there
    assert int(st["step"]) == 4


def test_dcp_round_trip_and_mismatch(tmp_path):
    """Gefen's DCP save/load keeps the column blocks; loading them into col_blocks=1 names the option."""
    def model():
        torch.manual_seed(6)
        return nn.Sequential(nn.Linear(256, 64, bias=False), nn.Linear(64, 300, bias=False))

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
        m = model()
        opt = Gefen(m.parameters(), lr=1e-2, col_blocks="auto")
        for _ in range(3):
            for p in m.parameters():
                p.grad = torch.randn_like(p)
            opt.step()
        msd, osd = get_state_dict(m, opt)
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=str(tmp_path / "ck"))
        m2 = model()
        opt2 = Gefen(m2.parameters(), lr=1e-2, col_blocks="auto")
        msd2, osd2 = get_state_dict(m2, opt2)
        sd = {"model": msd2, "optim": osd2}
        dcp.load(sd, checkpoint_id=str(tmp_path / "ck"))
        set_state_dict(m2, opt2, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
        w, w2 = m[0].weight, m2[0].weight
        assert tuple(opt2.state[w2]["v_row"].shape) == (64, 4)
        for k in ("idx", "scale", "v_row", "v_col"):
            assert torch.equal(opt.state[w][k], opt2.state[w2][k]), k
        m3 = model()
        opt3 = Gefen(m3.parameters(), lr=1e-2)
        with pytest.raises(ValueError, match=r"4 column block\(s\).*col_blocks=4"):
            gckpt.check_compatible(m3, opt3, str(tmp_path / "ck"), key_prefix="optim")


@pytest.mark.parametrize("shape,K,B,dtype", [((40, 192), 3, 64, torch.float32),    # blocks of 64: SIMD without tails
                                             ((9, 3 * 100), 3, 50, torch.bfloat16),  # 50-element scale blocks: tails
                                             ((6, 8 * 24), 8, 24, torch.float32)])
def test_native_kernel_against_the_eager_reference(shape, K, B, dtype):
    """The native CPU kernel's factored step with K column blocks (every table form and the portable C path:
    ``simd`` 1, 2, 3, 0) against ``core.step``'s eager reference over three steps, one gradient NaN in the
    second: the state (indices, scales, ``v_row``, ``v_col``) bit for bit, the parameters to float32 rounding of
    the update (the kernel's update is relaxed: docs/algorithm.md)."""
    from gefen_dist.core.step import bias_corrections, column_sumsq, quantized_step_factored_eager_
    from gefen_dist.kernels import cpu

    if not cpu.available():
        pytest.skip("no native CPU kernel")
    R, S = shape
    cb = torch.sort(torch.cat([torch.linspace(-1, 1, 255), torch.zeros(1)]))[0]
    hp = dict(lr=1e-2, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1, bound=0.5)
    outs = []
    for fn, simd in ((None, None), (cpu.quantized_step_factored_, 1), (cpu.quantized_step_factored_, 2),
                     (cpu.quantized_step_factored_, 3), (cpu.quantized_step_factored_, 0)):
        g0 = torch.Generator().manual_seed(21)
        p = (torch.randn(R, S, generator=g0) * 0.1).to(dtype)
        idx = torch.randint(0, 256, (R, S), generator=g0, dtype=torch.uint8)
        sc = torch.rand(R * S // B, generator=g0)
        v_row = torch.rand(R, K, generator=g0) * 1e-4
        v_col = torch.rand(S, generator=g0) * 1e-4
        for step in range(1, 4):
            grad = (torch.randn(R, S, generator=g0) * 1e-2 * (1 + torch.arange(S) % 7)).to(dtype)
            if step == 2:
                grad[R // 2, S // 3] = float("nan")
            cms = (column_sumsq(grad, S) / R).float()
            bc1, bc2 = bias_corrections(step, hp["beta1"], hp["beta2"])
            kw = dict(hp, bc1=bc1, bc2=bc2, scale_block=B)
            if fn is None:
                quantized_step_factored_eager_(p, grad, idx, sc, v_row, v_col, cb, cms, **kw)
            else:
                fn(p, grad, idx, sc, v_row, v_col, cb, cms, simd=simd, **kw)
        outs.append((p.float(), idx, sc, v_row, v_col))
    ref = outs[0]
    for got in outs[1:]:
        for a, b in zip(got[1:], ref[1:]):
            assert torch.equal(a.nan_to_num(7.0), b.nan_to_num(7.0))
        fin = ref[0].isfinite()
        assert torch.equal(got[0].isfinite(), fin)
        assert torch.allclose(got[0][fin], ref[0][fin], rtol=4e-6 if dtype == torch.float32 else 8e-3, atol=0)
