"""DeepSpeed's flat-buffer step in a fixed number of calls (``gefen_dist.engine.flat_batch``) against
the per-segment path it replaces, bitwise: the native CPU kernels here, the Triton kernels through the
interpreter in ``tests/test_triton_step.py::test_flat_batch_equals_the_per_segment_step_triton``.
The multi-rank DeepSpeed runs (``tests/test_deepspeed.py``) take the batch too."""
from __future__ import annotations

import logging

import pytest
import torch

from gefen_dist.core.step import hyperparameters
from gefen_dist.engine import flat_step, learning
from gefen_dist.engine.comm import LocalComm
from gefen_dist.engine.flat import FlatSegments, Segment, counts_to_codebook
from gefen_dist.kernels import cpu as _cpu
from gefen_dist.kernels import dispatch

# (name, shape, first element held, elements held): whole tensors, row blocks (3 x 64 rows: D12), a
# narrow-row tensor kept per block of rows (D16), a few-row tensor (D15), exact ones
WHOLE = [("a", (96, 64), 0, 96 * 64), ("qkv", (192, 64), 0, 192 * 64), ("c", (64, 200), 0, 64 * 200),
         ("few", (2, 4096), 0, 2 * 4096), ("emb", (2000, 4), 0, 8000), ("bias", (64,), 0, 64), ("ln", (200,), 0, 200)]
# and pieces cut inside rows and scale blocks, as ZeRO's partition edges cut them (the rest of each
# tensor on a second rank, which only the catalog sees: _FirstOfTwo)
CUT = [("a", (96, 64), 37, 96 * 64 - 37), ("qkv", (192, 64), 0, 192 * 64), ("c", (64, 200), 0, 64 * 200 - 77),
       ("bias", (64,), 0, 64)]


# column blocks (D21, col_blocks="auto"): w (48, 192) in four blocks, whole and cut inside a row and a block
COLB = [("w", (48, 192), 0, 48 * 192), ("c", (64, 200), 0, 64 * 200), ("bias", (64,), 0, 64)]
COLB_CUT = [("w", (48, 192), 37, 48 * 192 - 37), ("c", (64, 200), 0, 64 * 200 - 77), ("bias", (64,), 0, 64)]


class _FirstOfTwo(LocalComm):
    """Rank 0 of two, whose partner holds the rest of every cut tensor: the catalog sees both ranks'
    pieces; the sums stay this rank's (both paths enter the same collectives, so they compare)."""

    world_size = 2

    def __init__(self, segments):
        super().__init__()
        self.other = [(name, shape, 0 if start else n, (start or shape[0] * (shape[1] if len(shape) > 1 else 1) - n))
                      for name, shape, start, n in segments if start or n < shape[0] * (shape[1] if len(shape) > 1 else 1)]

    def all_gather_object(self, obj):
        return [obj, self.other]


def flat_run(impl, second_moment: str, batched: bool, steps: int = 4, dtype=torch.float32, segments=WHOLE,
             monkeypatch=None, device="cpu", col_blocks=1):
    """Steps a flat buffer of ``segments`` with ``impl`` (per segment unless ``batched``; ``col_blocks``: the
    buffer's group's, D21); returns the buffer and its state."""
    if not batched:
        monkeypatch.setattr(flat_step, "batch_kernels", lambda *a: None)
    segs, off = [], 0
    for name, shape, start, n in segments:
        segs.append(Segment(name, name, shape, start, off, n))
        off += n
    gen = torch.Generator().manual_seed(0)
    flat = (torch.randn(off, generator=gen) * 0.02).to(dtype=dtype, device=device)
    cut = any(start or len(shape) > 1 and n < shape[0] * shape[1] for _, shape, start, n in segments)
    fs = FlatSegments(segs, _FirstOfTwo(segments) if cut else LocalComm(), 4096)
    if cut:  # the cut blocks' one all-gather (torch.distributed), this rank's values
        fs._exchange = lambda sums, maxes: (sums, maxes)
    fs.narrow_rows = "auto"
    nib = second_moment == "nibbles"  # D20: 16 codewords, draws keyed by the tensors' places
    if nib:
        fs.second_moment, fs.tensor_index = "nibbles", {s.key: i for i, s in enumerate(segs)}
    st = fs.new_state(flat, torch.zeros(16 if nib else 256, device=device), factored=second_moment != "shared",
                      col_blocks=col_blocks)
    g0 = torch.Generator().manual_seed(1)
    group = dict(lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    for step in range(1, steps + 1):
        grad = (torch.randn(off, generator=g0) * torch.rand(off, generator=g0) * 1e-2).to(dtype=dtype, device=device)
        if step == 1:
            counts = fs.learn(st, grad, codebook_needed=True, second_moment=second_moment)
            cb = learning.learn_codebook(counts, True, 16) if nib else counts_to_codebook(counts)
            st["codebook"] = cb.codebook.float().to(device)
        st["step"] = step
        fs.step(flat, grad, st, second_moment=second_moment, impl=impl,
                hp=hyperparameters(group, step, bounded=True), step=step)
    if not batched:
        monkeypatch.undo()
    return flat, st, fs


def assert_same(a, b):
    (fa, sa, _), (fb, sb, _) = a, b
    assert torch.equal(fa, fb)
    for k, v in sa.items():
        if isinstance(v, torch.Tensor):
            assert torch.equal(v, sb[k]), k


@pytest.mark.skipif(not _cpu.available(), reason="needs the native CPU kernel")
@pytest.mark.parametrize("second_moment", ["factored", "shared", "nibbles"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_flat_batch_equals_the_per_segment_step(monkeypatch, second_moment, dtype):
    impl = dispatch._native_cpu()
    batched = flat_run(impl, second_moment, True, dtype=dtype)
    fs = batched[2]
    batch = fs.__dict__.get("_flat_batch")
    assert batch is not None  # the batch took the step
    if second_moment != "shared":
        assert batch.fmulti is not None and batch.exact is not None
        assert (batch.ratios is not None) == (second_moment == "nibbles")
    else:
        assert batch.smulti is not None and batch.shared_keys
    assert_same(batched, flat_run(impl, second_moment, False, dtype=dtype, monkeypatch=monkeypatch))


@pytest.mark.skipif(not _cpu.available(), reason="needs the native CPU kernel")
@pytest.mark.parametrize("second_moment", ["factored", "nibbles"])
def test_flat_batch_with_rows_and_blocks_cut_by_partition_edges(monkeypatch, second_moment):
    """Cut rows finished by the reference's phase functions after the batch (for "nibbles" against the
    batch's column ratios before and after the EMA)."""
    impl = dispatch._native_cpu()
    batched = flat_run(impl, second_moment, True, segments=CUT)
    assert batched[2].__dict__["_flat_batch"].fmulti is not None
    assert_same(batched, flat_run(impl, second_moment, False, segments=CUT, monkeypatch=monkeypatch))


@pytest.mark.skipif(not _cpu.available(), reason="needs the native CPU kernel")
@pytest.mark.parametrize("segments", [COLB, COLB_CUT], ids=["whole", "cut"])
def test_flat_batch_with_column_blocks(monkeypatch, segments):
    """col_blocks="auto" (D21): w's four column blocks in the batch (``K`` entries of ``v_row`` per row; a row cut
    by a partition edge finished per block of columns), bitwise the per-segment step."""
    impl = dispatch._native_cpu()
    batched = flat_run(impl, "factored", True, segments=segments, col_blocks="auto")
    items = batched[2].__dict__["_flat_batch"].fmulti.items
    assert sorted(it.K for it in items) == [1, 4] and batched[1]["col_blocks"] == "auto"
    assert_same(batched, flat_run(impl, "factored", False, segments=segments, monkeypatch=monkeypatch,
                                  col_blocks="auto"))


@pytest.mark.skipif(not _cpu.available(), reason="needs the native CPU kernel")
def test_flat_batch_is_rebuilt_when_a_tensor_learns_late(monkeypatch):
    """A segment whose gradient is zero until step 3 learns then: the batch built before it does not
    cover it and is rebuilt (its key holds the learned flags), with the per-segment path's results."""
    impl = dispatch._native_cpu()
    runs = []
    for batched in (True, False):
        if not batched:
            monkeypatch.setattr(flat_step, "batch_kernels", lambda *a: None)
        segs = [Segment("a", "a", (96, 64), 0, 0, 6144), Segment("b", "b", (128, 64), 0, 6144, 8192),
                Segment("bias", "bias", (64,), 0, 14336, 64)]
        fs = FlatSegments(segs, LocalComm(), 4096)
        flat = torch.randn(14400, generator=torch.Generator().manual_seed(0)) * 0.02
        st = fs.new_state(flat, torch.zeros(256), factored=True)
        gen = torch.Generator().manual_seed(1)
        keys = []
        for step in range(1, 6):
            grad = torch.randn(14400, generator=gen) * 1e-2
            if step < 3:
                grad[6144:14336] = 0.0  # "b" has no gradient yet
            if fs.needs_learning(st):
                counts = fs.learn(st, grad, codebook_needed=step == 1, second_moment="factored")
                if counts is not None:
                    st["codebook"] = counts_to_codebook(counts).codebook.float()
            st["step"] = step
            fs.step(flat, grad, st, second_moment="factored", impl=impl,
                    hp=hyperparameters(dict(lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1), step))
            b = fs.__dict__.get("_flat_batch")
            keys.append(None if b is None else b.key)
        runs.append((flat, st, fs))
        if batched:
            assert keys[0] == keys[1] and keys[2] != keys[1] and keys[2] == keys[4]  # rebuilt once, when "b" learned
    monkeypatch.undo()
    assert_same(*runs)


def test_flat_batch_not_taken_by_the_eager_path_or_another_gradient_dtype(caplog):
    from gefen_dist.engine import flat_batch
    from gefen_dist.engine.flat_batch import batch_kernels

    flat_batch._logged.clear()  # (once per reason and process)
    flat = torch.zeros(64)
    with caplog.at_level(logging.INFO, logger="gefen_dist.engine.flat_batch"):
        assert batch_kernels(dispatch._eager(), flat, flat) is None
        assert not caplog.records  # the eager path is stepped per segment by design: nothing to say
        if _cpu.available():
            assert batch_kernels(dispatch._native_cpu(), flat, flat) is not None
            for _ in range(2):
                assert batch_kernels(dispatch._native_cpu(), flat, flat.to(torch.bfloat16)) is None
            assert batch_kernels(dispatch._native_cpu(), flat, torch.zeros(64, 2)[:, 0]) is None
            msgs = [r.getMessage() for r in caplog.records]
            assert len(msgs) == 2 and "torch.bfloat16" in msgs[0] and "not contiguous" in msgs[1], msgs
