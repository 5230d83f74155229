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

    nr = {"narrow_rows": "rows"}  # the default "auto" keeps a factored one (D18) per block of rows: test_span.py
    spec = StateSpec.of(shape, second_moment=mode, small_threshold=4096, **nr)
    assert spec.exact and set(spec.range_tensors(7, 2000)) == {"exp_avg", "exp_avg_sq"}
    assert tensor_state(shape, 4096, mode, **nr)["gefen_bytes"] == 8 * math.prod(shape)
    assert not StateSpec.of((shape[0], 2), second_moment=mode, small_threshold=4096, **nr).exact  # two per row
    auto = StateSpec.of(shape, second_moment=mode, small_threshold=4096)
    assert (auto.mode == "span") == (mode == "factored") and auto.exact == (mode != "factored")
    gen = torch.Generator().manual_seed(0)
    a = torch.nn.Parameter(torch.randn(shape, generator=gen))
    b = torch.nn.Parameter(a.detach().clone())
    oa = torch.optim.AdamW([a], lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1, foreach=False)
    ob = Gefen([b], lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1, second_moment=mode, **nr)
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
    saver = Gefen([q], lr=1e-3, narrow_rows="rows")  # per row (the default keeps such tensors per block, D18)
    q.grad = torch.randn_like(q)
    saver.step()
    sd = saver.state_dict()
    sd["state"][0]["idx"] = sd["state"][0]["idx"][:, :1].contiguous()  # as a quantized (5000, 1) entry
    opt = Gefen([p], lr=1e-3, narrow_rows="rows")
    p.grad = torch.randn_like(p)
    opt.step()
    before = {k: v.clone() for k, v in opt.state[p].items() if torch.is_tensor(v)}
    with pytest.raises(ValueError, match=r"rows of one element .* exact"):
        opt.load_state_dict(sd)
    assert all(torch.equal(before[k], v) for k, v in opt.state[p].items() if torch.is_tensor(v))


@pytest.mark.parametrize("shape", [(1, 8192), (1, 197, 768), (3, 5000), (63, 4096), (1, 4099)])
def test_few_row_tensors_are_factored(shape):
    """A factored group's tensor of fewer than 64 rows is factored like any other (D15, which kept a
    shared v for them, is withdrawn: a dense one-row head trained 14x worse than with AdamW,
    research/head_regression.py): ``v_row`` per row and a ``v_col`` per column, ``4 / rows`` B/param
    (5.0 in all for ``(1, N)``), and the optimizer, the flat-range layout and the plan agree."""
    from gefen_dist import Gefen
    from gefen_dist.core.periods import shape_period
    from gefen_dist.plan import tensor_state

    spec = StateSpec.of(shape, second_moment="factored", small_threshold=4096)
    assert spec.mode == "factored" and spec.geometry.period == shape_period(shape)
    assert set(spec.range_tensors(7, 3000)) == {"idx", "scale", "v_row", "v_col"}
    assert StateSpec.of(shape, second_moment="shared", small_threshold=4096).mode == "shared"
    gen = torch.Generator().manual_seed(0)
    p = torch.nn.Parameter(torch.randn(shape, generator=gen))
    opt = Gefen([p], lr=1e-3)
    for _ in range(2):
        p.grad = torch.randn(shape, generator=gen)
        opt.step()
    n, rows = math.prod(shape), shape[0]
    assert sorted(k for k, v in opt.state[p].items() if torch.is_tensor(v)) == [
        "codebook", "idx", "scale", "step", "v_col", "v_row"]
    assert opt.state_bytes() == tensor_state(shape)["gefen_bytes"] + 256 * 4  # + the job's codebook
    want = n + 4 * (n // shape_period(shape)) + 4 * rows + 4 * (n // rows)
    assert tensor_state(shape)["gefen_bytes"] == want, (tensor_state(shape)["gefen_bytes"], want)


def _d15_entry(shape, gen):
    """A state entry as a version of D15 saved it for a factored group's tensor of few rows: the
    factored step's ``idx`` / ``scale`` (the same shape period and scale block) with a shared ``v``
    per v-block instead of ``v_row`` / ``v_col``."""
    from gefen_dist import Gefen

    p = torch.nn.Parameter(torch.randn(shape, generator=gen))
    opt = Gefen([p], lr=1e-3)
    for _ in range(3):
        p.grad = torch.randn(shape, generator=gen)
        opt.step()
    sd = opt.state_dict()
    ent = {k: v for k, v in sd["state"][0].items() if k not in ("v_row", "v_col")}
    per = ent["period"]
    ent["v"] = torch.rand(shape[0], math.prod(shape[1:]) // per, generator=gen) + 0.5
    return sd, ent


def test_a_shared_state_saved_by_d15_versions_continues_as_factored():
    """A checkpoint of D15's versions (a shared ``v`` for a few-row tensor of a factored group) loads:
    ``v_row`` is each row's mean ``v``, ``v_col`` flat at the tensor's mean ``v`` (the estimate starts
    at the row's shared ``v``), ``idx`` / ``scale`` / ``step`` as saved; the optimizer steps on."""
    from gefen_dist import Gefen
    from gefen_dist.core.step import column_ratios

    gen = torch.Generator().manual_seed(1)
    sd, ent = _d15_entry((3, 5000), gen)
    sd["state"][0] = ent
    few = torch.nn.Parameter(torch.randn(3, 5000, generator=gen))
    opt = Gefen([few], lr=1e-3)
    opt.load_state_dict(sd)
    st = opt.state[few]
    assert set(k for k, v in st.items() if torch.is_tensor(v)) == {"step", "idx", "scale", "v_row", "v_col", "codebook"}
    torch.testing.assert_close(st["v_row"], ent["v"].mean(dim=1, keepdim=True), rtol=0, atol=0)
    assert st["v_col"].shape == (5000,)
    torch.testing.assert_close(column_ratios(st["v_col"]), torch.ones(5000), rtol=1e-6, atol=0)
    assert float(st["v_col"][0]) == pytest.approx(float(ent["v"].mean()), rel=1e-6)
    assert torch.equal(st["idx"], ent["idx"]) and torch.equal(st["scale"], ent["scale"]) and int(st["step"]) == 3
    few.grad = torch.randn(3, 5000, generator=gen)
    opt.step()
    assert torch.isfinite(few).all() and int(opt.state[few]["step"]) == 4


def test_a_deepspeed_flat_state_of_d15_versions_is_refused_or_continues():
    """A flat buffer's factored state: one saved before D15 (no ``few_rows`` marker) has today's
    layout and continues as saved; one of D15's versions (marker 64) whose catalog has a learned
    tensor of few rows is refused before anything changes, naming it and the universal-checkpoint
    conversion (its shared ``v`` cannot be read as ``v_row`` / ``v_col``); without such a tensor it
    continues (same layout)."""
    from gefen_dist.core.step import hyperparameters
    from gefen_dist.engine.comm import LocalComm
    from gefen_dist.engine.flat import FlatSegments, LayoutError, Segment, counts_to_codebook

    def buffer(shapes):
        segs, off = [], 0
        for name, shape in shapes:
            segs.append(Segment(name, name, shape, 0, off, math.prod(shape)))
            off += math.prod(shape)
        gen = torch.Generator().manual_seed(0)
        flat = torch.randn(off, generator=gen) * 0.02
        fs = FlatSegments(segs, LocalComm(), 4096)
        st = fs.new_state(flat, torch.zeros(256), factored=True)
        grad = torch.randn(off, generator=gen) * 1e-2
        st["codebook"] = counts_to_codebook(fs.learn(st, grad, codebook_needed=True,
                                                     second_moment="factored")).codebook.float()
        st["step"] += 1
        fs.step(flat, grad, st, second_moment="factored",
                hp=hyperparameters(dict(lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1), 1))
        return fs, st, flat, grad

    fs, st, flat, grad = buffer([("few", (3, 4000)), ("many", (96, 64)), ("bias", (64,))])
    assert st["few_rows"] == 0 and st["v_col"].numel() == 4000 + 64  # the few-row tensor is factored
    assert not fs.continue_few_rows(st)  # today's state: nothing to do
    old = {k: (v.clone() if torch.is_tensor(v) else v) for k, v in st.items()}
    del old["few_rows"]  # saved before D15: the same layout
    assert fs.continue_few_rows(old) and old["few_rows"] == 0
    assert all(torch.equal(old[k], st[k]) for k in ("idx", "scale", "v_row", "v_col"))
    d15 = dict(st, few_rows=64)
    with pytest.raises(LayoutError, match=r"few.*ds-to-universal"):
        fs.continue_few_rows(d15)
    assert d15["few_rows"] == 64  # unchanged
    fs2, st2, _, _ = buffer([("many", (96, 64)), ("bias", (64,))])
    d15 = dict(st2, few_rows=64)
    assert fs2.continue_few_rows(d15) and d15["few_rows"] == 0
