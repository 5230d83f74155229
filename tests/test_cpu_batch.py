"""The multi-tensor step on CPU (gefen_dist.engine.cuda_batch with the native provider,
gefen_dist/kernels/cpu_multi.py): one native call per launch group instead of one per tensor, bitwise
the per-tensor path (the same kernel on the same arguments, the column sums per block of rows in the
same order), with the per-tensor path's behaviour at the edges (non-finite gradients, tensors beside
the batch, mixed step counts, bfloat16)."""
import copy
import logging

import pytest
import torch
from torch import nn

from gefen_dist import Gefen
from gefen_dist.engine import cuda_batch
from gefen_dist.engine.column_stats import ColumnRatios
from gefen_dist.kernels import cpu_multi

pytestmark = pytest.mark.skipif(not cpu_multi.available(), reason="needs the native CPU library")


def _model(dtype=torch.float32):
    torch.manual_seed(0)
    # Linear(96, 192): factored with 2 row blocks; Linear(192, 200): factored, one block; the rest exact
    return nn.Sequential(nn.Linear(32, 96), nn.GELU(), nn.Linear(96, 192), nn.GELU(), nn.Linear(192, 200),
                         nn.GELU(), nn.Linear(200, 8)).to(dtype)


def _pair(monkeypatch, dtype=torch.float32, base=None, **hp):
    """Two copies of ``base`` (default :func:`_model`) with Gefen(**hp): ``oa`` always per tensor, ``ob``
    through the CPU batch."""
    base = _model(dtype) if base is None else base.to(dtype)
    a, b = copy.deepcopy(base), copy.deepcopy(base)
    oa, ob = Gefen(a.named_parameters(), **hp), Gefen(b.named_parameters(), **hp)
    monkeypatch.setattr(cuda_batch.CudaBatch, "plan", classmethod(
        lambda cls, opt, entries, _plan=cuda_batch.CudaBatch.plan.__func__: None if opt is oa else _plan(
            cls, opt, entries)))
    return a, b, oa, ob


def _steps(a, b, oa, ob, n, seed=1, drop=None):
    gen = torch.Generator().manual_seed(seed)
    batches = []
    for step in range(n):
        x, y = torch.randn(16, 32, generator=gen), torch.randn(16, 8, generator=gen)
        oa.zero_grad()
        ((a(x.to(next(a.parameters()).dtype)) - y) ** 2).float().mean().backward()
        if drop is not None and step in drop:
            drop[step](a)
        for p, q in zip(a.parameters(), b.parameters()):
            q.grad = None if p.grad is None else p.grad.clone()
        oa.step()
        ob.step()
        batches.append(ob.__dict__.get("_cuda_batch"))
    return batches, (x, y)


def _same(a, b, oa, ob):
    for (name, p), q in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(p, q), name
        for k, v in oa.state[p].items():
            if isinstance(v, torch.Tensor):
                assert torch.equal(v, ob.state[q][k]), (name, k)


@pytest.mark.parametrize("second_moment", ["factored", "shared", "elementwise", "nibbles"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_batch_equals_the_per_tensor_path(monkeypatch, second_moment, dtype):
    a, b, oa, ob = _pair(monkeypatch, dtype, lr=1e-3, weight_decay=0.1, second_moment=second_moment)
    batches, _ = _steps(a, b, oa, ob, 5)
    assert batches[0] is None and batches[1] is not None and batches[4] is batches[1]  # built once, reused
    launcher = batches[1].groups[0]["nibs"]["step"] if second_moment == "nibbles" else batches[1].groups[0]["multi"]
    assert batches[1].native_cpu and type(launcher).__module__.endswith("cpu_multi")
    assert all(int(oa.state[p]["step"]) == int(ob.state[q]["step"]) == 5 for p, q in zip(a.parameters(), b.parameters()))
    _same(a, b, oa, ob)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_batch_with_column_blocks_equals_the_per_tensor_path(monkeypatch, dtype):
    """col_blocks="auto" (D21): the (48, 192) weight's four column blocks are a member of the native batch
    (its item's ``K``; the factors normalised per block of columns), bitwise the per-tensor path."""
    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(32, 192), nn.GELU(), nn.Linear(192, 48), nn.GELU(), nn.Linear(48, 8))
    a, b, oa, ob = _pair(monkeypatch, dtype, base=base, lr=1e-3, weight_decay=0.1, col_blocks="auto")
    batches, _ = _steps(a, b, oa, ob, 4)
    items = batches[-1].groups[0]["multi"].items
    assert batches[1] is not None and sorted(it.K for it in items) == [1, 4]
    assert tuple(ob.state[b[2].weight]["v_row"].shape) == (48, 4)
    _same(a, b, oa, ob)


@pytest.mark.parametrize("second_moment", ["factored", "nibbles"])
def test_cpu_batch_edges(monkeypatch, caplog, second_moment):
    """A tensor that missed a step (its own launch group, its own bias corrections and, with "nibbles",
    the random numbers of its own step count), a non-contiguous parameter stepped beside the batch (one
    DEBUG line), then a NaN (raises naming the tensor, nothing changed) and with nonfinite="skip" a
    skipped step: all as the per-tensor path."""
    a, b, oa, ob = _pair(monkeypatch, lr=1e-3, weight_decay=0.1, second_moment=second_moment)
    # the last layer's weight misses step 2: its step count falls behind the others'
    _steps(a, b, oa, ob, 4, drop={2: lambda m: setattr(m[6].weight, "grad", None)})
    assert len(ob._cuda_batch.groups) >= 2
    _same(a, b, oa, ob)
    for m, o in ((a, oa), (b, ob)):  # a transposed (non-contiguous) quantized parameter, same values
        w = m[4].weight
        w.data = w.data.t().contiguous().t()
        o.load_state_dict(o.state_dict())
    with caplog.at_level(logging.DEBUG, logger="gefen_dist.engine.cuda_batch"):
        _, batch = _steps(a, b, oa, ob, 2, seed=2)
    said = [r.getMessage() for r in caplog.records if "beside the multi-tensor CPU step" in r.getMessage()]
    assert len(said) == 1 and "'4.weight'" in said[0] and "not contiguous" in said[0], said
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    _same(a, b, oa, ob)
    x, y = batch
    ob.zero_grad()
    ((b(x) - y) ** 2).mean().backward()
    b[2].weight.grad[3, 5] = float("nan")
    before = [q.clone() for q in b.parameters()] + [ob.state[b[2].weight]["v_col"].clone()]
    with pytest.raises(RuntimeError, match=r"non-finite gradient.*'2.weight'"):
        ob.step()
    assert all(torch.equal(u, w) for u, w in zip(before, list(b.parameters()) + [ob.state[b[2].weight]["v_col"]]))
    ob.nonfinite = "skip"
    steps = [int(ob.state[q]["step"]) for q in b.parameters()]
    ob.step()
    assert all(torch.equal(u, w) for u, w in zip(before, list(b.parameters()) + [ob.state[b[2].weight]["v_col"]]))
    assert [int(ob.state[q]["step"]) for q in b.parameters()] == steps


def test_cpu_batch_not_taken_without_the_native_kernel(monkeypatch):
    """fused=False, or the native library switched off: the per-tensor path, no batch, no warning."""
    for kw, env in ((dict(fused=False), None), ({}, "1")):
        if env:
            monkeypatch.setenv("GEFEN_DIST_NO_NATIVE", env)
        m = _model()
        opt = Gefen(m.parameters(), lr=1e-3, **kw)
        for _ in range(3):
            opt.zero_grad()
            m(torch.randn(4, 32)).square().mean().backward()
            opt.step()
        assert opt.__dict__.get("_cuda_batch") is None


def test_cpu_batch_dropped_when_the_native_library_is_switched_off(monkeypatch):
    """GEFEN_DIST_NO_NATIVE=1 set after a batch was built: the next step goes to the per-tensor path (the
    eager one, as the dispatcher then selects), with no error."""
    m = _model()
    opt = Gefen(m.parameters(), lr=1e-3)

    def step():
        opt.zero_grad()
        m(torch.randn(4, 32)).square().mean().backward()
        opt.step()
    for _ in range(2):
        step()
    assert opt._cuda_batch is not None and opt._cuda_batch.native_cpu
    monkeypatch.setenv("GEFEN_DIST_NO_NATIVE", "1")
    step()
    assert opt._cuda_batch is None
    assert all(torch.isfinite(p).all() for p in m.parameters())


def test_cpu_batch_steps_an_eager_tensor_beside_it(caplog):
    """A float16 weight takes the eager path (the native kernel steps float32 and bfloat16): it is
    stepped beside the batch (one DEBUG line, no warning), the rest batched, bitwise the per-tensor
    path; a model whose every quantized tensor is such keeps the per-tensor path without a warning."""
    def build():
        torch.manual_seed(0)
        m = nn.ModuleDict(dict(a=nn.Linear(32, 96), b=nn.Linear(96, 8)))
        m.h = nn.Parameter((torch.randn(96, 96) * 0.05).half())
        return m

    def loss(m, x):
        return (m.b(torch.tanh(m.a(x)) @ m.h.float()) ** 2).mean()

    a, b = build(), build()
    oa, ob = Gefen(a.parameters(), lr=1e-3, weight_decay=0.1), Gefen(b.parameters(), lr=1e-3, weight_decay=0.1)
    gen = torch.Generator().manual_seed(1)
    with caplog.at_level(logging.DEBUG, logger="gefen_dist.engine.cuda_batch"):
        for _ in range(4):
            x = torch.randn(16, 32, generator=gen)
            for m, o, batched in ((a, oa, False), (b, ob, True)):
                o.zero_grad()
                loss(m, x).backward()
                cuda_batch._NATIVE_CPU = batched
                try:
                    o.step()
                finally:
                    cuda_batch._NATIVE_CPU = True
    said = [r.getMessage() for r in caplog.records if "beside the multi-tensor CPU step" in r.getMessage()]
    assert len(said) == 1 and "torch.float16" in said[0] and "eager" in said[0], said
    assert ob._cuda_batch is not None and oa.__dict__.get("_cuda_batch") is None
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    for p, q in zip(a.parameters(), b.parameters()):
        assert torch.equal(p, q)
        for k, v in oa.state[p].items():
            if isinstance(v, torch.Tensor):
                assert torch.equal(v, ob.state[q][k]), k
    m = nn.Linear(64, 96).half()
    opt = Gefen(m.parameters(), lr=1e-3, small_threshold=0)
    caplog.clear()
    with caplog.at_level(logging.DEBUG, logger="gefen_dist.engine.cuda_batch"):
        for _ in range(3):
            opt.zero_grad()
            m(torch.randn(4, 64).half()).float().square().mean().backward()
            opt.step()
    assert opt.__dict__.get("_cuda_batch") is None or not opt._cuda_batch.groups[0]["items"]
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


@pytest.mark.parametrize("threads", [1, 2])
def test_column_factors_by_shape_equal_the_per_tensor_operations(threads):
    """ColumnFactors takes the v_col of one shape together (one stack, mean, div, sqrt per shape): every
    output is bitwise the per-tensor path's (_column_factors_cpu), whatever the thread count, including
    a one-profile v_col too long to reduce serially (kept on its own), a zero profile and a NaN one (the
    general function's cases)."""
    from gefen_dist.kernels import cpu as _cpu

    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        gen = torch.Generator().manual_seed(3)
        shapes = [(768,), (768,), (3, 256), (3, 256), (3, 256), (4, 1024), (768,), (50257,), (50257,), (2, 40000),
                  (2, 40000), (7,), (7,)]
        v_cols = [torch.rand(s, generator=gen).pow_(3) * 10.0 ** float(torch.randint(-9, 2, (1,), generator=gen))
                  for s in shapes]
        v_cols[3][1].zero_()  # a row block whose mean is zero: the general function
        v_cols[12][0] = float("nan")
        cf = cpu_multi.ColumnFactors(v_cols, torch.device("cpu"))
        assert len(cf._groups) < len(shapes)  # shared shapes really were taken together
        for _ in range(2):  # the views are rewritten in place
            views = cf.run()
            for i, (v, out) in enumerate(zip(v_cols, views)):
                ref = _cpu._column_factors_cpu(v)
                assert out.shape == v.shape and torch.equal(out, ref) or (
                    torch.isnan(ref).any() and torch.equal(out.isnan(), ref.isnan())
                    and torch.equal(out.nan_to_num(), ref.nan_to_num())), (i, shapes[i])
            for v in v_cols:
                v.mul_(1.5)
    finally:
        torch.set_num_threads(old)


@pytest.mark.parametrize("threads", [1, 2])
def test_column_ratios_by_shape_equal_the_per_tensor_operations(threads):
    """engine.column_stats.ColumnRatios (second_moment="nibbles"): the ratios before and after each v_col's EMA, the v_col of
    one shape taken together, bitwise core.nibbles.ratios_around_ema_ of each, whatever the thread count,
    with a one-profile v_col too long to reduce serially, a zero profile and a NaN one."""
    from gefen_dist.core import nibbles as _nb

    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        gen = torch.Generator().manual_seed(4)
        shapes = [(768,), (768,), (3, 256), (3, 256), (50257,), (50257,), (2, 40000), (7,), (7,)]
        v_cols = [torch.rand(s, generator=gen).pow_(3) * 10.0 ** float(torch.randint(-9, 2, (1,), generator=gen))
                  for s in shapes]
        v_cols[3][1].zero_()
        v_cols[8][0] = float("nan")
        refs = [v.clone() for v in v_cols]
        cr = ColumnRatios(v_cols, torch.device("cpu"))
        assert len(cr._groups) < len(shapes)
        for step in range(2):  # the views are rewritten in place
            means = [torch.rand(v.shape, generator=gen) * 1e-3 for v in v_cols]
            cr.run(means, 0.95)
            for i, (v, r) in enumerate(zip(v_cols, refs)):
                want_old, want_new = _nb.ratios_around_ema_(r, means[i], 0.95)
                for got, want in ((cr.old[i], want_old), (cr.new[i], want_new), (v, r)):
                    torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True, msg=f"{i} {shapes[i]}")
    finally:
        torch.set_num_threads(old)


def test_cpu_batch_of_repeated_layers_equals_the_per_tensor_path(monkeypatch):
    """A model whose layers repeat their shapes (column factors taken per shape, the multi step's
    tables built once per call) steps bitwise as the per-tensor path."""
    torch.manual_seed(0)
    base = nn.Sequential(*[m for _ in range(3) for m in (nn.Linear(32, 32), nn.GELU(), nn.Linear(32, 96), nn.GELU(),
                                                        nn.Linear(96, 32))])
    a, b = copy.deepcopy(base), copy.deepcopy(base)
    hp = dict(lr=1e-3, weight_decay=0.1, small_threshold=0)
    oa, ob = Gefen(a.named_parameters(), **hp), Gefen(b.named_parameters(), **hp)
    monkeypatch.setattr(cuda_batch.CudaBatch, "plan", classmethod(
        lambda cls, opt, entries, _plan=cuda_batch.CudaBatch.plan.__func__: None if opt is oa else _plan(
            cls, opt, entries)))
    gen = torch.Generator().manual_seed(1)
    for _ in range(4):
        x = torch.randn(16, 32, generator=gen)
        for m, o in ((a, oa), (b, ob)):
            o.zero_grad()
            (m(x) ** 2).mean().backward()
            o.step()
    batch = ob.__dict__.get("_cuda_batch")
    assert batch is not None and batch.native_cpu and len(batch.cols.factors._groups) == 3
    _same(a, b, oa, ob)


def test_column_table_equals_the_per_piece_statistics():
    """engine.column_stats.ColumnTable (the batches' one table) over the native launchers: its sums are
    each piece's block_column_sumsq with the native kernel's sums (pieces that start inside a row block,
    bfloat16, one block and several), a replica that must not count contributes zeros (a NaN stays NaN),
    its means are the sums over the global rows per block rounded once to float32, in views shaped
    like each v_col, and its factors are each v_col's column factors; no tensor is a clear error."""
    from gefen_dist.core.step import block_column_sumsq, column_factors
    from gefen_dist.engine.column_stats import ColumnTable
    from gefen_dist.kernels import cpu as _cpu

    gen = torch.Generator().manual_seed(5)
    # (local rows, S, first row, row block, G, dtype, global rows, contributes)
    specs = [(96, 32, 0, 48, 2, torch.float32, 96, True), (20, 24, 10, 20, 3, torch.float32, 60, True),
             (7, 40, 0, 1, 1, torch.bfloat16, 7, True), (12, 16, 36, 16, 4, torch.float32, 64, False)]
    grads = [torch.randn(r * S, generator=gen).to(dt) for r, S, _, _, _, dt, _, _ in specs]
    vcols = [torch.rand((G, S) if G > 1 else (S,), generator=gen) for _, S, _, _, G, _, _, _ in specs]
    table = ColumnTable(cpu_multi, [(v, (r, S, r0, rb, G, dt), R // G, c)
                                    for v, (r, S, r0, rb, G, dt, R, c) in zip(vcols, specs)], torch.device("cpu"))
    assert table.total == sum(v.numel() for v in vcols) and table.mask is not None
    buf = table.column_sums(grads)
    cms = table.column_means(buf)
    for (o, n, shape), v, g, view, (r, S, r0, rb, G, dt, R, c) in zip(table.slices, vcols, grads, table.views, specs):
        ref = block_column_sumsq(g, S, r0, rb, G, _cpu.column_sumsq) if c else torch.zeros(n, dtype=torch.float64)
        assert torch.equal(buf[o:o + n], ref), shape
        assert view.shape == v.shape and view.data_ptr() == cms[o:o + n].data_ptr()
        assert torch.equal(view.reshape(-1), (ref / (R // G)).to(torch.float32)), shape
    for v, f in zip(vcols, table.factors.run()):
        assert torch.equal(f, column_factors(v))
    grads[3][5] = float("nan")  # the replica's non-finite gradient is still seen
    o, n, _ = table.slices[3]
    assert torch.isnan(table.column_sums(grads)[o:o + n]).any()
    with pytest.raises(ValueError, match="at least one factored tensor"):
        ColumnTable(cpu_multi, [], torch.device("cpu"))


def test_nonfinite_and_overflow_flags(monkeypatch):
    """``engine.nonfinite.device_flags`` reads the column sums through their sum (finite exactly when
    every entry is, for sums of float32 squares: at most ~1.2e77 each) and ``any_overflow`` through the
    means' maximum; through the CPU batch after learning, an inf, a NaN and a finite gradient whose
    square overflows float32 are each refused before anything changes, the last naming the overflow."""
    from gefen_dist.engine.nonfinite import any_overflow, device_flags

    big = torch.full((1000,), 1.2e77, dtype=torch.float64)  # the largest entries a column sum can hold
    for buf, bad in ((big, False), (torch.zeros(5, dtype=torch.float64), False)):
        assert bool(device_flags(buf, [])[0]) is bad
    for v in (float("nan"), float("inf")):
        b = big.clone()
        b[17] = v
        assert bool(device_flags(b, [])[0])
    assert bool(device_flags(None, [torch.ones(3), torch.tensor([1.0, float("inf")])])[0])
    assert not bool(any_overflow(torch.empty(0))) and not bool(any_overflow(torch.full((9,), 3e38)))
    assert bool(any_overflow(torch.tensor([0.0, float("inf"), 1.0])))
    a, b, oa, ob = _pair(monkeypatch, lr=1e-3, weight_decay=0.1)
    _, batch = _steps(a, b, oa, ob, 3)
    assert ob._cuda_batch is not None
    x, y = batch
    for bad, match in ((float("inf"), r"non-finite gradient.*'2.weight'"),
                       (float("nan"), r"non-finite gradient.*'2.weight'"), (1e30, "overflows float32")):
        ob.zero_grad()
        ((b(x) - y) ** 2).mean().backward()
        b[2].weight.grad[3, 5] = bad
        before = [q.clone() for q in b.parameters()] + [ob.state[b[2].weight]["v_col"].clone()]
        with pytest.raises(RuntimeError, match=match):
            ob.step()
        assert all(torch.equal(u, w) for u, w in zip(before, list(b.parameters()) + [ob.state[b[2].weight]["v_col"]]))


def test_nibble_items_the_batch_cannot_take_are_refused_by_index():
    """cpu_multi.NibbleStep (and the Triton one, the same NibbleItem.check) refuses an item whose sizes the
    kernel cannot step, or a float16 parameter, naming the item, before any table is built."""
    from gefen_dist.kernels.triton_multi import NibbleItem

    def item(n=64, S=16, B=16, dtype=torch.float32, rb=5):
        p = torch.zeros(n, dtype=dtype)
        r = torch.ones(S)
        return NibbleItem(p, torch.zeros(n, dtype=torch.uint8), torch.zeros(n // B), torch.zeros(n // S), r, r,
                          S, B, 0, rb, 0)

    cpu_multi.NibbleStep([item()], torch.device("cpu"))  # a good one
    for bad, match in ((item(S=16, B=5), r"bad item 1: S=16, B=5"), (item(n=60), r"bad item 1: .*numel=60"),
                       (item(rb=0), r"bad item 1: .*rb=0"), (item(dtype=torch.float16), "not supported")):
        with pytest.raises(ValueError, match=match):
            cpu_multi.NibbleStep([item(), bad], torch.device("cpu"))
