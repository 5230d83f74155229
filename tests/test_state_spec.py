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
