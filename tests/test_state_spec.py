"""The one state spec (gefen_dist.engine.state.StateSpec): the whole-rows layout (Gefen, FSDP2
shards) and the flat-range layout (ZeroGefen's partitions, DeepSpeed's segments) agree."""
import math

import pytest
import torch

from gefen_dist.engine.state import StateSpec


@pytest.mark.parametrize("mode", ["factored", "shared", "elementwise"])
@pytest.mark.parametrize("shape,period", [((12, 96), 32), ((120, 40), 40), ((8, 2100), 1050), ((3, 5), None)])
def test_range_of_whole_tensor_is_the_whole_rows_layout(mode, shape, period):
    spec = StateSpec.of(shape, second_moment=mode, small_threshold=16,
                        period=1 if mode == "elementwise" else period)
    rows = spec.tensors(shape)
    flat = spec.range_tensors(0, math.prod(shape))
    assert list(rows) == list(flat)
    for k, (ls, _, dtype, sharded) in rows.items():
        assert math.prod(ls) == math.prod(flat[k][0]) and dtype == flat[k][1] and sharded == flat[k][2], k


def test_a_cut_range_keeps_every_block_it_touches():
    spec = StateSpec.of((4, 96), second_moment="shared", small_threshold=0, period=32)  # B = P = 32
    t = spec.range_tensors(40, 130)  # blocks 1..4 of 32: cut at both ends
    assert t["idx"][0] == (90,) and t["scale"][0] == (4,) and t["v"][0] == (4,)
    assert spec.range_tensors(64, 64)["scale"][0] == (0,)
    f = StateSpec.of((70, 96), second_moment="factored", small_threshold=0)
    tf = f.range_tensors(96, 96 * 3)  # rows 1 and 2: whole rows
    assert tf["v_row"][0] == (2,) and tf["v_col"][0] == (96,) and not tf["v_col"][2]
    st = f.allocate_range(96, 96 * 3, torch.device("cpu"), learned=True, step=3, codebook=None)
    assert st["idx"].dtype == torch.uint8 and st["idx"].shape == (192,) and st["step"].item() == 3
    assert list(st) == ["step", "period", "scale_block", "learned", "idx", "scale", "v_row", "v_col", "codebook"]


@pytest.mark.parametrize("mode", ["factored", "shared", "elementwise"])
@pytest.mark.parametrize("shape", [(5000, 1), (4099, 1, 1)])
def test_one_element_rows_keep_adamw_state(mode, shape):
    """A tensor whose rows hold one element would keep a scale and a v per element quantized (9
    B/param, more than AdamW's 8): it is exact in every mode, in the optimizer, in the flat-range
    layout (ZeroGefen, DeepSpeed) and in the memory plan, and it steps bitwise as torch's AdamW."""
    from gefen_dist import Gefen
    from gefen_dist.plan import tensor_state

    spec = StateSpec.of(shape, second_moment=mode, small_threshold=4096)
    assert spec.exact and set(spec.range_tensors(7, 2000)) == {"exp_avg", "exp_avg_sq"}
    assert tensor_state(shape, 4096, mode)["gefen_bytes"] == 8 * math.prod(shape)
    assert not StateSpec.of((shape[0], 2), second_moment=mode, small_threshold=4096).exact  # two per row: quantized
    gen = torch.Generator().manual_seed(0)
    a = torch.nn.Parameter(torch.randn(shape, generator=gen))
    b = torch.nn.Parameter(a.detach().clone())
    oa = torch.optim.AdamW([a], lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1, foreach=False)
    ob = Gefen([b], lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1, second_moment=mode)
    for _ in range(3):
        g = torch.randn(shape, generator=gen)
        a.grad, b.grad = g.clone(), g.clone()
        oa.step()
        ob.step()
    assert torch.equal(a, b)
    assert [r["kind"] for r in ob.report()] == ["exact"] and ob.state_bytes() == 8 * math.prod(shape)


def test_loading_quantized_state_of_a_one_element_row_tensor_names_the_rule():
    """A checkpoint that holds quantized state for an ``(N, 1)`` tensor (saved by a gefen_dist from
    before such tensors were exact) is refused with the reason, and the optimizer is unchanged."""
    from gefen_dist import Gefen

    p = torch.nn.Parameter(torch.randn(5000, 1))
    q = torch.nn.Parameter(torch.randn(5000, 2))
    saver = Gefen([q], lr=1e-3)
    q.grad = torch.randn_like(q)
    saver.step()
    sd = saver.state_dict()
    sd["state"][0]["idx"] = sd["state"][0]["idx"][:, :1].contiguous()  # as a quantized (5000, 1) entry
    opt = Gefen([p], lr=1e-3)
    p.grad = torch.randn_like(p)
    opt.step()
    before = {k: v.clone() for k, v in opt.state[p].items() if torch.is_tensor(v)}
    with pytest.raises(ValueError, match=r"rows of one element .* exact"):
        opt.load_state_dict(sd)
    assert all(torch.equal(before[k], v) for k, v in opt.state[p].items() if torch.is_tensor(v))


@pytest.mark.parametrize("shape", [(1, 8192), (1, 197, 768), (3, 5000), (63, 4096), (1, 4099)])
def test_few_row_tensors_keep_a_shared_v_at_about_one_byte(shape):
    """D15: a factored group's tensor of fewer than 64 rows keeps the shared second moment with the
    shape period (the period the factored mode fixes, D14), not a per-column v_col (4 / rows B/param:
    5.0 B/param for (1, N)). The optimizer, the flat-range layout and the plan agree, it stays at or
    under 1.1 B/param, and 64 rows stay factored. Shared / elementwise groups are unchanged."""
    from gefen_dist import Gefen
    from gefen_dist.core.periods import shape_period
    from gefen_dist.plan import tensor_state

    spec = StateSpec.of(shape, second_moment="factored", small_threshold=4096)
    assert spec.mode == "shared" and spec.geometry.period == shape_period(shape)
    assert set(spec.range_tensors(7, 3000)) == {"idx", "scale", "v"}
    assert StateSpec.of((64,) + tuple(shape[1:]), second_moment="factored", small_threshold=4096).mode == "factored"
    assert StateSpec.of(shape, second_moment="elementwise", small_threshold=4096).mode == "elementwise"
    gen = torch.Generator().manual_seed(0)
    p = torch.nn.Parameter(torch.randn(shape, generator=gen))
    opt = Gefen([p], lr=1e-3)
    for _ in range(2):
        p.grad = torch.randn(shape, generator=gen)
        opt.step()
    n = math.prod(shape)
    assert sorted(k for k, v in opt.state[p].items() if torch.is_tensor(v)) == ["codebook", "idx", "scale", "step", "v"]
    assert opt.state[p]["period"] == shape_period(shape)
    assert opt.state_bytes() == tensor_state(shape)["gefen_bytes"] + 256 * 4  # + the job's codebook
    assert tensor_state(shape)["gefen_bytes"] <= 1.1 * n, tensor_state(shape)["gefen_bytes"] / n


def test_a_factored_state_saved_before_few_rows_were_shared_continues():
    """A checkpoint saved when few-row tensors were factored (v_row / v_col) loads: their v per
    block is the factored estimate's mean over the block, the other tensors' state is as saved, and
    the optimizer steps on from it."""
    from gefen_dist import Gefen
    from gefen_dist.core.step import column_ratios

    gen = torch.Generator().manual_seed(1)
    few = torch.nn.Parameter(torch.randn(3, 5000, generator=gen))
    many = torch.nn.Parameter(torch.randn(256, 192, generator=gen))
    cols = torch.linspace(0.1, 3.0, 5000)
    saver = Gefen([many], lr=1e-3)  # a (3, 5000) factored entry as an older version saved it:
    donor = Gefen([torch.nn.Parameter(torch.randn(64, 5000, generator=gen))], lr=1e-3)  # 64 rows: factored
    for o, p, c in ((saver, many, 1.0), (donor, donor.param_groups[0]["params"][0], cols)):
        for _ in range(3):
            p.grad = torch.randn(p.shape, generator=gen) * c
            o.step()
    sd = saver.state_dict()
    old = {k: (v[:3].clone() if k in ("idx", "scale", "v_row") else v) for k, v in donor.state_dict()["state"][0].items()}
    sd["state"][1] = old
    sd["param_groups"][0]["params"] = [0, 1]
    opt = Gefen([many, few], lr=1e-3)
    opt.load_state_dict(sd)
    st = opt.state[few]
    want = (old["v_row"] * column_ratios(old["v_col"]).view(1, -1)).view(3, -1, old["period"]).mean(-1)
    assert set(k for k, v in st.items() if torch.is_tensor(v)) == {"step", "idx", "scale", "v", "codebook"}
    torch.testing.assert_close(st["v"], want.float(), rtol=1e-6, atol=0)
    assert torch.equal(st["idx"], old["idx"]) and torch.equal(opt.state[many]["v_col"], sd["state"][0]["v_col"])
    few.grad, many.grad = torch.randn(3, 5000, generator=gen), torch.randn(256, 192, generator=gen)
    opt.step()
    assert torch.isfinite(few).all()


def test_a_deepspeed_flat_state_saved_before_few_rows_were_shared_continues():
    """The flat-buffer side of the same: a factored flat state without ``few_rows`` (saved before
    D15) holds a ``v_row`` per row and a ``v_col`` for the few-row segment; its first step after the
    resume moves that segment's ``v`` to the block means of the factored estimate, keeps the factored
    segment's ``v_row`` / ``v_col`` and the scales, and steps on."""
    from gefen_dist.core.step import factored_block_v, hyperparameters
    from gefen_dist.engine.comm import LocalComm
    from gefen_dist.engine.flat import FlatSegments, Segment, _slots, counts_to_codebook

    shapes = [("few", (3, 4000)), ("many", (96, 64)), ("bias", (64,))]
    segs, off = [], 0
    for name, shape in shapes:
        segs.append(Segment(name, name, shape, 0, off, math.prod(shape)))
        off += math.prod(shape)
    gen = torch.Generator().manual_seed(0)
    flat = torch.randn(off, generator=gen) * 0.02
    fs = FlatSegments(segs, LocalComm(), 4096)
    st = fs.new_state(flat, torch.zeros(256), factored=True)
    grad = torch.randn(off, generator=gen) * 1e-2
    st["codebook"] = counts_to_codebook(fs.learn(st, grad, codebook_needed=True, second_moment="factored")).codebook.float()
    hp = hyperparameters(dict(lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1), 1)
    st["step"] += 1
    fs.step(flat, grad, st, second_moment="factored", hp=hp)
    new, _, _, _ = _slots(segs, st["periods"], 4096, True, st["row_blocks"])
    few, many = new[0], new[1]
    assert not few.factored and many.factored and few.v_n == 3 * 4000 // few.period and few.vcol_n == 0
    # the same state as an older version kept it: the few-row tensor factored, v_row per row, v_col [4000]
    old, _, nv_old, _ = _slots(segs, st["periods"], 4096, True, st["row_blocks"], few_rows_shared=False)
    vr_few, vc_few = torch.rand(3, generator=gen) + 0.5, torch.rand(4000, generator=gen) + 0.1
    v_row = torch.zeros(nv_old)
    v_row[old[0].v_off:old[0].v_off + 3] = vr_few
    v_row[old[1].v_off:old[1].v_off + old[1].v_n] = st["v_row"][many.v_off:many.v_off + many.v_n]
    v_col = torch.cat([vc_few, st["v_col"][many.vcol_off:many.vcol_off + many.vcol_n]])
    assert old[0].vcol_off == 0 and old[1].vcol_off == 4000
    saved = dict(st, v_row=v_row, v_col=v_col)
    del saved["few_rows"]
    keep = {k: saved[k].clone() for k in ("scale", "idx")}
    assert fs.upgrade_few_rows(saved) and saved["few_rows"] == 64
    want = factored_block_v(vr_few, vc_few, few.period, 0, 3).reshape(-1)
    torch.testing.assert_close(saved["v_row"][few.v_off:few.v_off + few.v_n], want, rtol=1e-6, atol=0)
    assert torch.equal(saved["v_row"][many.v_off:many.v_off + many.v_n], st["v_row"][many.v_off:many.v_off + many.v_n])
    assert torch.equal(saved["v_col"], st["v_col"]) and all(torch.equal(keep[k], saved[k]) for k in keep)
    assert not fs.upgrade_few_rows(saved)  # once
    saved["step"] += 1
    fs.step(flat, torch.randn(off, generator=gen) * 1e-2, saved, second_moment="factored",
            hp=hyperparameters(dict(lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1), 2))
    assert torch.isfinite(flat).all()
