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
    f = StateSpec.of((6, 96), second_moment="factored", small_threshold=0)
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
