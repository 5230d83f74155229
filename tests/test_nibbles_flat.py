"""``second_moment="nibbles"`` (D20) on DeepSpeed's flat buffers (``gefen_dist.engine.flat``): a buffer of
whole tensors steps as :class:`gefen_dist.Gefen` does, bit for bit (the same codebook of 16, the same keys
of the random numbers, the same codes, scales, ``v_row``, ``v_col`` and parameters). Rows and scale blocks
cut by partition edges are reconciled over real ranks in ``tests/dist/ds_check.py`` (cases ``z2nib``,
``z3nib``, ``ck2nib``; ``tests/test_deepspeed.py``)."""
from __future__ import annotations

import pytest
import torch

from gefen_dist import Gefen
from gefen_dist.core.step import hyperparameters
from gefen_dist.engine import learning
from gefen_dist.engine.comm import LocalComm
from gefen_dist.engine.flat import FlatSegments, Segment
from gefen_dist.engine.flat_layout import _slots
from gefen_dist.kernels import dispatch

# quantized (one row block; four row blocks of 3 x 40 rows: D12), a few-row tensor, exact ones
SHAPES = [(40, 300), (1,), (120, 40), (3, 2048), (64,), (20, 20)]


def _grads(steps, seed=1):
    g = torch.Generator().manual_seed(seed)
    out = []
    for t in range(steps):
        gs = []
        for s in SHAPES:
            x = torch.randn(s, generator=g) * torch.rand(s, generator=g) * 1e-2
            if t == 0 and len(s) > 1:
                x[0] = 0.0  # a zero row at the first step
            gs.append(x)
        out.append(gs)
    return out


@pytest.mark.parametrize("fused", [False, None])
def test_flat_buffer_steps_nibbles_as_gefen_does(fused):
    steps, group = 5, dict(lr=3e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    gen = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(s, generator=gen) * 0.02) for s in SHAPES]
    opt = Gefen(params, second_moment="nibbles", fused=fused, **group)
    segs, off = [], 0
    for i, p in enumerate(params):
        segs.append(Segment(f"p{i}", f"t{i}", tuple(p.shape), 0, off, p.numel()))
        off += p.numel()
    flat = torch.cat([p.detach().reshape(-1) for p in params]).clone()
    fs = FlatSegments(segs, LocalComm(), opt.small_threshold)
    fs.second_moment, fs.narrow_rows, fs.tensor_index = "nibbles", "auto", {s.key: i for i, s in enumerate(segs)}
    st = fs.new_state(flat, torch.zeros(16), factored=True)
    impl = dispatch.select(flat, fused=fused)
    for t, gs in enumerate(_grads(steps), start=1):
        for p, g in zip(params, gs):
            p.grad = g.clone()
        opt.step()
        grad = torch.cat([g.reshape(-1) for g in gs])
        if fs.needs_learning(st):
            counts = fs.learn(st, grad, codebook_needed=True, second_moment="nibbles")
            st["codebook"] = learning.learn_codebook(counts, True, 16).codebook.float()
        fs.step(flat, grad, st, second_moment="nibbles", impl=impl,
                hp=hyperparameters(opt.param_groups[0], t, opt.bound_updates), step=t)
        st["step"] = t
    assert torch.equal(st["codebook"], opt.codebook) and opt.codebook.numel() == 16
    plan = _slots(fs.segments, st["periods"], fs.small_threshold, True, st.get("row_blocks", 1))[0]
    for sp, p in zip(plan, params):
        s = sp.seg
        assert torch.equal(flat[s.flat_offset:s.flat_offset + s.numel], p.detach().reshape(-1)), s.name
        ref = opt.state[p]
        if sp.exact:
            assert "exp_avg" in ref
            continue
        assert sp.period == ref["scale_block"], (s.name, sp.period, ref["scale_block"])
        assert torch.equal(st["idx"][s.flat_offset:s.flat_offset + s.numel], ref["idx"].reshape(-1)), s.name
        assert torch.equal(st["scale"][sp.scale_off:sp.scale_off + sp.scale_n], ref["scale"].reshape(-1)), s.name
        assert torch.equal(st["v_row"][sp.v_off:sp.v_off + sp.v_n], ref["v_row"].reshape(-1)), s.name
        assert torch.equal(st["v_col"][sp.vcol_off:sp.vcol_off + sp.vcol_n], ref["v_col"].reshape(-1)), s.name


def test_universal_checkpoints_load_only_into_the_same_codebook_size():
    """A universal checkpoint of ``"nibbles"`` (16 codewords) loads only into a ``"nibbles"`` job, and a
    256-codeword one (or AdamW's, which has no Gefen metadata) not into it: checked by
    ``load_into_engine`` before anything changes (the round trips themselves: ``ucz2nib`` in
    tests/dist/ds_check.py)."""
    from gefen_dist.integrations.ds_universal import UniversalCheckpointError
    from gefen_dist.integrations.ds_universal_load import _check_nibbles

    class Opt:
        def __init__(self, *modes):
            self.param_groups = [{"second_moment": m} for m in modes]

    nib, fac = Opt("nibbles", "nibbles"), Opt("factored", "shared")
    _check_nibbles(nib, {"second_moment": "nibbles"})
    _check_nibbles(fac, {"second_moment": "factored"})
    _check_nibbles(fac, None)  # AdamW's: the warm start of the 256-codeword settings
    with pytest.raises(UniversalCheckpointError, match="no warm start from Adam-shaped state"):
        _check_nibbles(nib, None)
    with pytest.raises(UniversalCheckpointError, match="holds second_moment='factored'.*'nibbles'"):
        _check_nibbles(nib, {"second_moment": "factored"})
    with pytest.raises(UniversalCheckpointError, match="holds second_moment='nibbles'.*'factored'"):
        _check_nibbles(fac, {"second_moment": "nibbles"})
