"""D16: ``narrow_rows="span"``, state per block of whole rows for tensors whose rows are narrow.

Issue 26: "give every tensor at or above small_threshold <= 1.1 B/param, whatever its aspect ratio".
Per row, the factored default spends ``1 + 8 / S`` B/param on rows of ``S`` elements (``(N, 1)`` keeps
exact AdamW state, 8); with ``narrow_rows="span"`` every tensor with rows of fewer than 80 elements
keeps its absmax scale and second moment per block of >= 1024 elements. Checked here: the bytes, the
math against the paper-verified shared-mode eager path (``S = 1``, where the two coincide) and
against a float64 loop written from docs/algorithm.md's D16 formulas, the update bound on adversarial
gradients, checkpoints (state_dict and the plain DCP flow), the refusals, and training. FSDP2/HSDP
shards that cut blocks: tests/test_fsdp2.py (``--narrow-span``, bitwise against one process).
"""
from __future__ import annotations

import bisect
import copy
import math
import warnings

import _span_phases
import pytest
import torch
from torch import nn

from gefen_dist import Gefen
from gefen_dist.core.span import SPAN_BELOW, SpanPiece, span_blocks, span_rows
from gefen_dist.core.step import clamp_bound, quantized_step_eager_
from gefen_dist.engine.state import StateSpec

from test_update_bound import KINDS, _grad

SHAPES = [(5000, 1), (4999, 2), (3001, 10), (1000, 40), (1000, 50), (1000, 79), (700, 3, 3), (10007, 1)]


def _steps(p, opt, n, seed=0, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    for _ in range(n):
        p.grad = torch.randn(p.shape, generator=g) * scale
        opt.step()


@pytest.mark.parametrize("shape", SHAPES)
def test_every_aspect_ratio_at_most_1_1_bytes_per_param(shape):
    """<= 1.1 B/param (measured: <= 1.012) with ``"span"``, and with the default ``"auto"`` (D18) for
    rows of fewer than 22 elements (per row, ``1 + 8 / S``, for 22-79); ``"rows"`` for comparison."""
    S = math.prod(shape[1:])
    per_row = 8.0 if S == 1 else 1 + 8 / S
    for setting, mode, want in (("span", "span", None), ("auto", "span" if S < 22 else "factored", None),
                                ("rows", "exact" if S == 1 else "factored", per_row)):
        p = nn.Parameter(torch.randn(shape) * 0.1)
        opt = Gefen([p], lr=1e-3, **({} if setting == "auto" else {"narrow_rows": setting}))
        _steps(p, opt, 2)
        assert opt._mode(p) == mode, (setting, shape)
        bpp = opt.state_bytes() / p.numel() - (256 * 4 / p.numel() if mode != "exact" else 0)  # one codebook a job
        if mode == "span":
            assert bpp <= 1.1, (setting, shape, bpp)
        else:
            assert bpp == pytest.approx(per_row, abs=0.02), (setting, shape, bpp)
    assert StateSpec.of(shape, second_moment="factored", small_threshold=4096,
                        narrow_rows="span").geometry.state_bytes_per_element() <= 1.01


def test_eligibility_and_geometry():
    assert span_rows((5000, 1)) == 1024 and span_blocks((5000, 1)) == 5  # the last block holds 904 rows
    assert span_rows((100, 3)) == 342 and span_rows((10, 79)) == 13
    for shape, mode in [((5000, 1), "span"), ((1000, 79), "span"), ((1000, SPAN_BELOW), "factored"),
                        ((4095, 1), "exact"), ((5000,), "exact"), ((1, 8192), "factored")]:  # few rows: factored (D15 withdrawn)
        p = nn.Parameter(torch.zeros(shape))
        assert Gefen([p], narrow_rows="span")._mode(p) == mode, shape
    for shape, mode in [((5000, 1), "span"), ((1000, 21), "span"), ((1000, 22), "factored"), ((700, 3, 7), "span"),
                        ((4095, 1), "exact"), ((1, 8192), "factored")]:  # the default "auto" (D18)
        p = nn.Parameter(torch.zeros(shape))
        assert Gefen([p])._mode(p) == mode, shape
    p = nn.Parameter(torch.zeros(5000, 1))
    assert Gefen([p], narrow_rows="rows")._mode(p) == "exact"  # per-row state ((N, 1): exact, D2)
    assert Gefen([p], second_moment="shared", narrow_rows="span")._mode(p) == "exact"  # factored groups only
    sp = SpanPiece.of((5000, 1), 1667, 1667)
    assert (sp.row0, sp.nrows, sp.nb) == (1667, 1667, 5)
    assert sp.block_ids("cpu")[[0, -1]].tolist() == [1, 3]
    assert sp.counts("cpu").tolist() == [1024.0] * 4 + [904.0]
    cut = SpanPiece.of((500, 3), 4, 30)  # a DeepSpeed partition edge cuts rows 1 and 11
    assert (cut.row0, cut.nrows, cut.lead, cut.numel, cut.start, cut.whole_rows) == (1, 11, 1, 30, 4, False)
    assert cut.element_blocks("cpu").tolist() == [0] * 30 and SpanPiece.of((500, 3), 3, 30).whole_rows
    with pytest.raises(ValueError, match="not inside"):
        SpanPiece.of((500, 3), 1490, 30)


def test_one_column_equals_the_shared_eager_path_with_blocks_of_rows():
    """For ``S = 1`` the column factor is 1, so D16's step is the paper's shared scheme with period
    and scale block 1024 over the flattened tensor: indices and scales bitwise, ``v`` and the
    parameters to float32 rounding (``v`` sums float32 squares in float64 there)."""
    N = 4096
    torch.manual_seed(0)
    p = nn.Parameter(torch.randn(N, 1) * 0.1)
    ref = p.detach().clone().view(-1)
    opt = Gefen([p], lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1, narrow_rows="span", bound_updates=False)
    g = torch.Generator().manual_seed(3)
    grads = [torch.randn(N, 1, generator=g) * (torch.rand(N, 1, generator=g) < 0.3) for _ in range(6)]
    p.grad = grads[0]
    opt.step()  # learns the codebook; the reference state starts from the same first step
    st = opt.state[p]
    idx, scale, v = st["idx"].clone().view(-1), st["scale"].clone(), st["v_blk"].clone()
    ref.copy_(p.detach().view(-1))
    for t, gr in enumerate(grads[1:], start=2):
        p.grad = gr
        opt.step()
        bc1, bc2 = 1 - 0.9 ** t, 1 - 0.95 ** t
        quantized_step_eager_(ref, gr.view(-1), idx, scale, v, st["codebook"], lr=1e-2, beta1=0.9, beta2=0.95,
                              eps=1e-8, weight_decay=0.1, bc1=bc1, bc2=bc2, period=1024, scale_block=1024)
        assert torch.equal(st["idx"].view(-1), idx) and torch.equal(st["scale"], scale), t
        torch.testing.assert_close(st["v_blk"], v, rtol=1e-6, atol=0)
        torch.testing.assert_close(p.detach().view(-1), ref, rtol=1e-6, atol=1e-9)


def _native_or_skip():
    from gefen_dist.kernels import cpu

    if not cpu.available():
        pytest.skip("the native CPU library is not built here")


@pytest.mark.parametrize("shape,start,n", _span_phases.PIECES)
@pytest.mark.parametrize("dtype", _span_phases.DTYPES)
@pytest.mark.parametrize("bound,wd", _span_phases.BOUND_WD)
def test_native_phases_equal_the_reference(shape, start, n, dtype, bound, wd):
    """The native span phases (kernels/cpu_span.py) against core/span.py's on one piece
    (tests/_span_phases.py: whole rows and rows cut at either end, float32 and bfloat16 parameters,
    with and without the bound and weight decay): everything bitwise but the float64 sums of
    ``g^2`` (to 1e-13); on whole rows the update alone from the new indices too."""
    _native_or_skip()
    from gefen_dist.kernels import cpu_span as nat

    _span_phases.check_phases_equal_the_reference(nat, shape, start, n, dtype, bound, wd)


@pytest.mark.parametrize("shape,start,n", _span_phases.PIECES_ROWS)
@pytest.mark.parametrize("dtype", _span_phases.DTYPES)
@pytest.mark.parametrize("bound,wd", _span_phases.BOUND_WD[:2])
def test_native_phases_with_blocks_of_one_row_equal_the_reference(shape, start, n, dtype, bound, wd):
    """The same with blocks of one row (D19, ``narrow_rows="rows8"``: a scale and ``v`` per row)."""
    _native_or_skip()
    from gefen_dist.kernels import cpu_span as nat

    _span_phases.check_phases_equal_the_reference(nat, shape, start, n, dtype, bound, wd, rows=True)


def test_native_phases_do_not_depend_on_the_thread_count():
    """The native phases run blocks in parallel; the column sums use fixed segments of blocks, so one
    and two threads give the same bits (a tensor large enough for several threads, a piece cut mid-row)."""
    _native_or_skip()
    from gefen_dist.kernels import cpu_span as nat

    shape = (150_001, 3)
    sp = SpanPiece.of(shape, 7, 150_001 * 3 - 20)
    gen = torch.Generator().manual_seed(5)
    cb = torch.sort(torch.cat([torch.tensor([-1.0, 0.0, 1.0]), torch.rand(253, generator=gen) * 2 - 1]))[0]
    g = torch.randn(sp.numel, generator=gen)
    idx = torch.randint(0, 256, (sp.numel,), dtype=torch.uint8, generator=gen)
    scale = torch.rand(sp.nb, generator=gen) * 1e-2
    p0 = torch.randn(sp.numel, generator=gen) * 0.02
    threads = torch.get_num_threads()
    res = []
    try:
        for nt in (1, 2):
            torch.set_num_threads(nt)
            m, col, blk, amax = nat.span_statistics(g, idx, scale, cb, sp, 0.9)
            st = [p0.clone(), idx.clone(), scale.clone(), torch.full((sp.nb,), 1e-6), torch.full((3,), 1e-6)]
            nat.span_update_(*st, m, col, blk, amax, cb, sp, lr=1e-3, beta2=0.999, eps=1e-8, weight_decay=0.1,
                             bc1=0.19, bc2=0.002, bound=1.5, beta1=0.9)
            res.append([m, col, blk, amax] + st)
    finally:
        torch.set_num_threads(threads)
    for a, b in zip(*res):
        assert torch.equal(a, b)


def test_native_step_agrees_with_the_eager_step():
    """``Gefen.step()`` on span tensors with the native phases (the default on CPU) and with
    ``fused=False`` (the reference), 40 steps of sparse and heavy-tailed gradients: the same
    indices and scales, parameters and statistics to float32 rounding."""
    _native_or_skip()
    torch.manual_seed(0)
    ps = [nn.Parameter(torch.randn(s) * 0.1) for s in ((6000, 1), (2001, 7), (700, 3, 3))]
    qs = [nn.Parameter(p.detach().clone()) for p in ps]
    kw = dict(lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1, narrow_rows="span")
    a, b = Gefen(ps, **kw), Gefen(qs, fused=False, **kw)
    gen = torch.Generator().manual_seed(1)
    for _ in range(40):
        for p, q in zip(ps, qs):
            g = torch.randn(p.shape, generator=gen) * (torch.rand(p.shape, generator=gen) < 0.2)
            p.grad, q.grad = g, g.clone()
        a.step()
        b.step()
    for p, q in zip(ps, qs):
        sa, sb = a.state[p], b.state[q]
        assert torch.equal(sa["idx"], sb["idx"]) and torch.equal(sa["scale"], sb["scale"])
        torch.testing.assert_close(sa["v_blk"], sb["v_blk"], rtol=1e-6, atol=0)
        torch.testing.assert_close(sa["v_col"], sb["v_col"], rtol=1e-6, atol=0)
        torch.testing.assert_close(p.detach(), q.detach(), rtol=1e-6, atol=1e-9)


def _nearest(cb, z):
    """The index of the codeword of the ascending list ``cb`` nearest to ``z`` (ties: the lower index)."""
    i = bisect.bisect_left(cb, z)
    cand = [c for c in (i - 1, i) if 0 <= c < len(cb)]
    return min(cand, key=lambda c: (abs(cb[c] - z), c))


def _loop_reference(p0, grads, codebook, *, lr, b1, b2, eps, wd, k):
    """D16 written out element by element in float64 from docs/algorithm.md (codebook rounding by
    nearest value, ties to the lower index), in Python floats, for a small tensor: returns the
    parameters."""
    N, S = p0.shape
    nb = -(-N // k)
    cb = codebook.double().tolist()
    assert cb == sorted(cb)
    p = p0.double().tolist()
    idx = [[0] * S for _ in range(N)]
    M = [0.0] * nb
    vb = [0.0] * nb
    vc = [0.0] * S
    for t, g in enumerate(grads, start=1):
        g = g.double().tolist()
        vc = [b2 * vc[j] + (1 - b2) * sum(g[i][j] ** 2 for i in range(N)) / N for j in range(S)]
        mean_c = sum(vc) / S
        for b in range(nb):
            rows = range(b * k, min(N, (b + 1) * k))
            vb[b] = b2 * vb[b] + (1 - b2) * sum(g[i][j] ** 2 for i in rows for j in range(S)) / (len(rows) * S)
            m = {(i, j): cb[idx[i][j]] * M[b] + (1 - b1) * (g[i][j] - cb[idx[i][j]] * M[b])
                 for i in rows for j in range(S)}
            M[b] = max(abs(x) for x in m.values())
            for (i, j), mij in m.items():
                idx[i][j] = _nearest(cb, mij / M[b] if M[b] > 0 else 0.0)
                sig = 1.0 / (math.sqrt(vb[b]) * math.sqrt(vc[j] / mean_c) / math.sqrt(1 - b2 ** t) + eps)
                u = cb[idx[i][j]] * M[b] * sig / (1 - b1 ** t)
                p[i][j] = p[i][j] * (1 - lr * wd) - lr * u
    return torch.tensor(p, dtype=torch.float64)


def test_matches_an_elementwise_float64_reading_of_the_formulas():
    N, S, lr = 700, 3, 1e-2  # blocks of 342 rows: 342, 342, 16
    torch.manual_seed(1)
    p = nn.Parameter(torch.randn(N, S) * 0.1)
    p0 = p.detach().clone()
    g = torch.Generator().manual_seed(2)
    colscale = torch.tensor([1.0, 0.1, 3.0])
    grads = [torch.randn(N, S, generator=g) * colscale for _ in range(4)]
    opt = Gefen([p], lr=lr, betas=(0.9, 0.99), weight_decay=0.1, small_threshold=1000, narrow_rows="span",
                bound_updates=False)
    for gr in grads:
        p.grad = gr
        opt.step()
    ref = _loop_reference(p0, grads, opt.state[p]["codebook"], lr=lr, b1=0.9, b2=0.99, eps=1e-8, wd=0.1, k=342)
    # float32 against float64 arithmetic: a codeword chosen differently at a tie moves an element by
    # lr * sigma * (a codebook gap); everything else agrees to float32 rounding
    diff = (p.detach().double() - ref).abs()
    assert float(diff.max()) < 2e-3 * lr * 50 and float((diff > 1e-5).float().mean()) < 0.01, float(diff.max())


@pytest.mark.parametrize("shape", [(5000, 1), (2000, 3), (300, 40)])
@pytest.mark.parametrize("betas", [(0.9, 0.999), (0.9, 0.95)])
def test_every_step_within_the_bound(shape, betas):
    """D13 holds for span tensors: ``|dp| <= 2 (1 + b1^(t-1)) K_t lr`` on adversarial sequences (a
    mostly-zero first gradient, one-hot, sparse, rows and columns of very different scales)."""
    gen = torch.Generator().manual_seed(sum(shape))
    p = nn.Parameter(torch.randn(shape, generator=gen) * 0.02)
    opt = Gefen([p], lr=1e-3, betas=betas, weight_decay=0.0, narrow_rows="span")
    for i, kind in enumerate(["sparse"] + KINDS * 2):
        g = _grad(kind, shape, gen)
        if i == 0:
            g = g * (torch.rand(shape, generator=gen) < 0.001)
        p.grad = g
        before = p.detach().double().clone()
        opt.step()
        t = int(opt.state[p]["step"])
        dp = float((p.detach().double() - before).abs().max())
        K = clamp_bound(2.0, betas[0], betas[1], t)
        assert math.isfinite(dp) and dp <= K * 1e-3 * (1 + 1e-5) + 1e-9, (t, kind, dp / 1e-3, K)


def test_state_dict_resumes_bitwise_and_refuses_the_other_layout():
    torch.manual_seed(0)
    a = nn.Parameter(torch.randn(3000, 2) * 0.1)
    b = nn.Parameter(torch.randn(64, 128) * 0.1)
    opt = Gefen([a, b], lr=1e-2, narrow_rows="span")
    for _ in range(3):
        a.grad, b.grad = torch.randn_like(a), torch.randn_like(b)
        opt.step()
    sd = copy.deepcopy(opt.state_dict())  # as if through torch.save / torch.load
    a2, b2 = nn.Parameter(a.detach().clone()), nn.Parameter(b.detach().clone())
    opt2 = Gefen([a2, b2], lr=1e-2, narrow_rows="span")
    opt2.load_state_dict(sd)
    assert opt2._mode(a2) == "span" and opt2._mode(b2) == "factored"
    g = torch.Generator().manual_seed(9)
    for _ in range(3):
        ga, gb = torch.randn(a.shape, generator=g), torch.randn(b.shape, generator=g)
        a.grad, b.grad, a2.grad, b2.grad = ga, gb, ga.clone(), gb.clone()
        opt.step()
        opt2.step()
    assert torch.equal(a, a2) and torch.equal(b, b2)
    for k in ("idx", "scale", "v_blk", "v_col"):
        assert torch.equal(opt.state[a][k], opt2.state[a2][k]), k
    rows = Gefen([nn.Parameter(a.detach().clone()), nn.Parameter(b.detach().clone())], lr=1e-2, narrow_rows="rows")
    with pytest.raises(ValueError, match="narrow_rows='span'"):
        rows.load_state_dict(opt.state_dict())
    with pytest.raises(ValueError, match="narrow_rows"):
        opt2.load_state_dict(rows.state_dict())
    old = opt.state_dict()  # saved before D16: no narrow_rows in the groups, tensors of narrow rows per row
    del old["param_groups"][0]["narrow_rows"]
    with pytest.raises(ValueError, match="saved with narrow_rows='rows'"):
        opt2.load_state_dict(old)
    # the default "auto" (D18) keeps (3000, 2) per block of rows as "span" does: a "span" checkpoint of these
    # tensors resumes under it bitwise (the group keeps "auto"), one saved per row ("rows", or before D16 and
    # D18) is refused naming the setting
    a3, b3 = nn.Parameter(a.detach().clone()), nn.Parameter(b.detach().clone())
    auto = Gefen([a3, b3], lr=1e-2)
    before = [t.clone() for t in (a3, b3)]
    for saved in (rows.state_dict(), old):
        with pytest.raises(ValueError, match="saved with narrow_rows='rows'.*narrow_rows='auto'"):
            auto.load_state_dict(saved)
        assert not auto.state and all(torch.equal(u, w) for u, w in zip(before, (a3, b3)))
    auto.load_state_dict(copy.deepcopy(opt.state_dict()))  # (torch's loader may share the tensors)
    assert auto.param_groups[0]["narrow_rows"] == "auto" and auto._mode(a3) == "span"
    a3.grad, b3.grad, a.grad, b.grad = ga, gb, ga.clone(), gb.clone()
    opt.step()
    auto.step()
    assert torch.equal(a, a3) and torch.equal(b, b3) and torch.equal(auto.state[a3]["idx"], opt.state[a]["idx"])
    # a group without tensors of narrow rows: the setting does not change its layout, so it loads either
    # way and the group keeps its own setting
    c = nn.Parameter(torch.randn(64, 128) * 0.1)
    wide = Gefen([c], lr=1e-2, narrow_rows="span")
    c.grad = torch.randn_like(c)
    wide.step()
    other = Gefen([nn.Parameter(c.detach().clone())], lr=1e-2)
    other.load_state_dict(wide.state_dict())
    assert other.param_groups[0]["narrow_rows"] == "auto"
    assert torch.equal(other.state[other.param_groups[0]["params"][0]]["idx"], wide.state[c]["idx"])


def _dcp_model(**kw):
    """``Linear(3, 2000) -> Linear(2000, 8)`` (the first weight ``(2000, 3)``, rows of 3) and a Gefen with ``kw``."""
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(3, 2000), nn.Linear(2000, 8))
    return m, Gefen(m.parameters(), lr=1e-2, **kw)


def _train_random(m, opt, n, seed):
    """``n`` steps on seeded random gradients."""
    g = torch.Generator().manual_seed(seed)
    for _ in range(n):
        for p in m.parameters():
            p.grad = torch.randn(p.shape, generator=g)
        opt.step()


def test_plain_dcp_flow_resumes_bitwise(tmp_path):
    """get_state_dict -> dcp.save, then a fresh optimizer's get_state_dict -> dcp.load ->
    set_state_dict (the replicated block state has the shapes of the global shape alone)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    def make():
        return _dcp_model(narrow_rows="span")

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
        m, opt = make()
        _train_random(m, opt, 3, 1)
        assert opt._mode(m[0].weight) == "span"
        msd, osd = get_state_dict(m, opt)
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=str(tmp_path))
        m2, opt2 = make()
        msd, osd = get_state_dict(m2, opt2)
        sd = {"model": msd, "optim": osd}
        dcp.load(sd, checkpoint_id=str(tmp_path))
        set_state_dict(m2, opt2, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
    _train_random(m, opt, 2, 7)
    _train_random(m2, opt2, 2, 7)
    assert all(torch.equal(a, b) for a, b in zip(m.parameters(), m2.parameters()))


def test_zerogefen_partitions_span_tensors_single_process():
    """ZeroGefen cuts span tensors at rows like factored ones (one process: it owns them whole) and
    steps them bitwise as Gefen does, through the same exchange and appliers as every world size;
    its consolidated state dict is Gefen's (tests/dist/zero_check.py checks 2 and 3 ranks bitwise
    against one process, the pieces cutting blocks, with 2 -> 1 and 2 -> 3 resumes; DeepSpeed
    ZeRO-2/3: tests/dist/ds_check.py, z2span / z3span, and universal checkpoints of span state,
    ucz2span, saved at 2 ranks and loaded at 1, 2 and 3)."""
    from gefen_dist import ZeroGefen

    p = nn.Parameter(torch.zeros(5000, 1))
    with pytest.raises(ValueError, match="Invalid narrow_rows"):
        Gefen([p], narrow_rows="blocks")
    for fused in (None, False):
        q = nn.Parameter(torch.randn(3000, 5))
        zo = ZeroGefen([{"params": [q], "narrow_rows": "span"}], lr=1e-2, fused=fused)
        ref_q = nn.Parameter(q.detach().clone())
        ro = Gefen([ref_q], lr=1e-2, narrow_rows="span", fused=fused)
        for t in range(4):
            g = torch.randn(3000, 5, generator=torch.Generator().manual_seed(t))
            g[t::3] = 0.0
            q.grad, ref_q.grad = g, g.clone()
            zo.step()
            ro.step()
        assert zo._mode(q) == "span" and zo.owned_range(q) == (0, 15000) and torch.equal(q, ref_q), fused
        assert zo.last_wire["elements"] == 15000
        sd, rsd = zo.state_dict()["state"][0], ro.state_dict()["state"][0]
        assert sorted(sd) == sorted(rsd) and all(torch.equal(torch.as_tensor(sd[k]), torch.as_tensor(rsd[k]))
                                                 for k in rsd), fused
    spec = StateSpec.of((5000, 1), second_moment="factored", small_threshold=4096, narrow_rows="span")
    assert spec.mode == "span" and spec.range_tensors(0, 100)["scale"][0] == (5,)


def test_universal_conversion_refuses_rank_files_that_disagree():
    """``gefen-dist ds-to-universal`` reads the replicated block state of D16 tensors from every rank's
    file (the round trip itself: tests/dist/ds_check.py ``ucz2span``); files that disagree, or name a
    tensor no rank holds, are refused by name instead of converted."""
    from gefen_dist.engine.flat_layout import Segment
    from gefen_dist.integrations import ds_universal as U

    shape = (134, 67)
    seg = Segment("p1", "b.weight", shape, 0, 0, 134 * 67)
    nb = span_blocks(shape)

    def state(x):
        return {"span_keys": ["p1"], "span_scale": torch.full((nb,), x), "span_vblk": torch.ones(nb),
                "span_vcol": torch.ones(67)}

    tensors = {"b.weight": U._Tensor("b.weight", shape, span_rows(shape) * 67, True, span=True)}
    U._add_span_state("rank0.pt", state(0.5), tensors, {"p1": seg})
    assert torch.equal(tensors["b.weight"].scale, torch.full((nb,), 0.5))
    U._add_span_state("rank1.pt", state(0.5), tensors, {"p1": seg})  # the same copy: accepted
    with pytest.raises(U.UniversalCheckpointError, match="rank2.pt.*disagree on the block state of 'b.weight'"):
        U._add_span_state("rank2.pt", state(0.25), tensors, {"p1": seg})
    with pytest.raises(U.UniversalCheckpointError, match="key 'p1' of the span state is held by no rank"):
        U._add_span_state("rank0.pt", state(0.5), tensors, {})


def test_an_overflowing_square_is_refused_before_anything_changes():
    """A finite gradient whose square overflows float32 (|g| > ~1.8e19) would make the block's ``v``
    inf and the update NaN: the step raises as the factored second moment does, before any state,
    step count or parameter changes (the statistics phase writes nothing)."""
    torch.manual_seed(0)
    a = nn.Parameter(torch.randn(3000, 2) * 0.1)
    b = nn.Parameter(torch.randn(64, 128) * 0.1)
    opt = Gefen([a, b], lr=1e-2, narrow_rows="span")
    a.grad, b.grad = torch.randn_like(a), torch.randn_like(b)
    opt.step()
    before = copy.deepcopy((a.detach(), b.detach(), opt.state_dict()))
    a.grad = torch.randn_like(a)
    a.grad[5, 1] = 3e19
    with pytest.raises(RuntimeError, match="overflows float32"):
        opt.step()
    assert torch.equal(a, before[0]) and torch.equal(b, before[1])
    after = opt.state_dict()["state"]
    for k, st in before[2]["state"].items():
        for name, v in st.items():
            w = after[k][name]
            assert torch.equal(v, w) if torch.is_tensor(v) else v == w, (k, name)
    a.grad[5, 1] = 1.0
    opt.step()  # the same step with a sane gradient goes through
    assert int(opt.state[a]["step"]) == 2 and bool(torch.isfinite(a).all())


@pytest.mark.parametrize("cls", ["Gefen", "ZeroGefen"])
@pytest.mark.parametrize("where", ["span", "factored"])
def test_a_first_step_that_overflows_learns_nothing(cls, where):
    """A first step whose squared gradient overflows float32 is refused before the periods, the
    codebook or any quantized state are learned from it (they were, before: the step raised after
    learning, and the codebook stayed the one of the refused gradient); the run that follows is
    bitwise the run without that step. ZeroGefen too (its step counts no longer advance before the
    refusal either)."""
    import gefen_dist

    opt_cls = getattr(gefen_dist, cls)

    def run(bad_first):
        torch.manual_seed(0)
        a = nn.Parameter(torch.randn(3000, 2) * 0.1)
        b = nn.Parameter(torch.randn(64, 128) * 0.1)
        c = nn.Parameter(torch.randn(32))
        opt = opt_cls([{"params": [a, b, c], "narrow_rows": "span"}], lr=1e-2)
        if bad_first:
            a.grad, b.grad, c.grad = torch.randn_like(a), torch.randn_like(b), torch.randn_like(c)
            (a if where == "span" else b).grad.view(-1)[7] = 3e19
            with pytest.raises(RuntimeError, match="overflows float32"):
                opt.step()
            assert opt.codebook is None and not any(st.get("learned") for st in opt.state.values())
            assert all(int(st["step"]) == 0 for st in opt.state.values())
        g = torch.Generator().manual_seed(1)
        for _ in range(3):
            for p in (a, b, c):
                p.grad = torch.randn(p.shape, generator=g)
            opt.step()
        return a, b, c

    assert all(torch.equal(x, y) for x, y in zip(run(True), run(False)))


def test_the_cuda_batch_leaves_span_tensors_to_the_per_tensor_path(monkeypatch):
    from gefen_dist.engine import cuda_batch
    from gefen_dist.engine.cuda_batch import CudaBatch

    monkeypatch.setattr(cuda_batch, "_DEVICE_TYPES", ("cuda", "cpu"))  # judge CPU tensors as CUDA ones
    p = nn.Parameter(torch.randn(5000, 1))
    opt = Gefen([p], narrow_rows="span")
    _steps(p, opt, 1)
    q = nn.Parameter(torch.randn(64, 128))
    opt2 = Gefen([p, q], narrow_rows="span")
    p.grad, q.grad = torch.randn(5000, 1), torch.randn(64, 128)
    opt2.step()
    entries = [(opt2.param_groups[0], p), (opt2.param_groups[0], q)]
    groups, beside, why = CudaBatch.split(opt2, entries)
    assert groups == [(q.device, [entries[1]])] and beside == [entries[0]] and why == ""
    groups, beside, why = CudaBatch.split(opt, [(opt.param_groups[0], p)])  # span alone: no batch
    assert groups is None and beside == [] and why == ""


def _embedding_bag(make_opt, steps=300, feats=3000, dim=4, batch=64, active=8, seed=0):
    """Zipf-distributed sparse features through an EmbeddingBag(3000, 4) (rows of 4 elements: 3.0
    B/param per row, 1.01 in blocks of 256 rows) and a Linear(4, 8), MSE to a fixed teacher; held-out
    loss. ``seed`` sets the initialisation and the order of the batches (the task is fixed)."""
    g = torch.Generator().manual_seed(1000)
    zipf = 1.0 / torch.arange(1, feats + 1, dtype=torch.float64) ** 1.1
    zipf = (zipf / zipf.sum()).float()
    teacher = torch.randn(feats, 8, generator=g)

    def batch_at(t):
        gg = torch.Generator().manual_seed(10_000 + t + 7919 * seed)
        ids = torch.multinomial(zipf.expand(batch, feats), active, replacement=False, generator=gg)
        return ids, teacher[ids].sum(1)

    torch.manual_seed(seed)
    emb, head = nn.EmbeddingBag(feats, dim, mode="sum"), nn.Linear(dim, 8)
    opt = make_opt([emb.weight, head.weight, head.bias])
    for t in range(steps):
        ids, y = batch_at(t)
        opt.zero_grad(set_to_none=True)
        nn.functional.mse_loss(head(emb(ids)), y).backward()
        opt.step()
    with torch.no_grad():
        ids, y = zip(*(batch_at(100_000 + i - 7919 * seed) for i in range(8)))
        return float(nn.functional.mse_loss(head(emb(torch.cat(ids))), torch.cat(y)))


def test_sparse_embedding_bag_trains_like_adamw():
    """A sparse narrow embedding, whose rare rows share their block's second moment with frequent
    ones: held-out loss within 5% of AdamW's (measured: from 10.38, AdamW 4.62, per-row Gefen 4.53,
    span 4.44; docs/algorithm.md, D16)."""
    kw = dict(lr=1e-2, betas=(0.9, 0.999), weight_decay=0.0)
    adamw = _embedding_bag(lambda ps: torch.optim.AdamW(ps, **kw))
    span = _embedding_bag(lambda ps: Gefen(ps, narrow_rows="span", **kw))
    start = _embedding_bag(lambda ps: torch.optim.SGD(ps, lr=0.0))
    assert span < 0.6 * start and span <= 1.05 * adamw, (start, adamw, span)


@pytest.mark.parametrize("density", [0.01, 1.0])
def test_dead_first_batch_mlp_trains_like_adamw(density):
    """Issue 26's mostly-dead first batch (and a whole one) on an MLP whose first weight, (256, 32),
    is a span tensor: within 5% of AdamW (measured 1.005x and 0.999x)."""
    from _workloads import dead_first_batch_mlp

    kw = dict(lr=1e-3, betas=(0.9, 0.999), weight_decay=0.0)
    adamw = dead_first_batch_mlp(lambda ps: torch.optim.AdamW(ps, **kw), density=density)[1]
    seen = {}

    def make(ps):
        seen["opt"] = Gefen(ps, narrow_rows="span", **kw)
        return seen["opt"]

    _, span, model = dead_first_batch_mlp(make, density=density)
    assert seen["opt"]._mode(model[0].weight) == "span"
    assert span <= 1.05 * adamw, (adamw, span)


def test_inspect_names_the_layout(tmp_path):
    """``gefen-dist inspect`` of a checkpoint with span tensors: their bytes and the group's
    ``narrow_rows``."""
    from gefen_dist.cli import inspect_checkpoint, render_inspect

    p = nn.Parameter(torch.randn(5000, 2))
    opt = Gefen([p], narrow_rows="span")
    _steps(p, opt, 2)
    torch.save({"optimizer": opt.state_dict()}, tmp_path / "ck.pt")
    text = render_inspect(inspect_checkpoint(str(tmp_path / "ck.pt")))
    assert "narrow_rows=span" in text and "(5000, 2)" in text and "1.009" in text, text


def test_a_dense_span_tensor_is_named_once_at_learning(caplog):
    """Span tensors whose first gradient reaches most rows (a dense layer, where one second moment
    per block of rows measured worse than per row: the digits classifier, docs/algorithm.md D16) are
    named in one WARNING when they learn their state; a sparse embedding is not, and no step after
    the first warns again."""
    dense, emb = nn.Parameter(torch.randn(256, 64)), nn.Parameter(torch.randn(3000, 4))
    opt = Gefen([("enc.weight", dense), ("emb.weight", emb)], narrow_rows="span")
    logger = "gefen_dist.engine.span_step"
    for t in range(3):
        dense.grad = torch.randn(256, 64)
        emb.grad = torch.zeros(3000, 4)
        emb.grad[torch.arange(t, 3000, 97)] = 1.0  # 31 of 3000 rows
        with caplog.at_level("WARNING", logger=logger):
            opt.step()
        msgs = [r.getMessage() for r in caplog.records if r.name == logger]
        if t == 0:
            assert len(msgs) == 1 and "'enc.weight' (256, 64): 100% of rows" in msgs[0], msgs
            assert "emb.weight" not in msgs[0] and "narrow_rows='rows'" in msgs[0]
        else:
            assert not msgs, msgs
        caplog.clear()
    assert opt._mode(dense) == opt._mode(emb) == "span"


def test_the_default_names_a_dense_layer_it_keeps_per_block_at_info(caplog):
    """Under the default ``narrow_rows="auto"`` (D18) a dense layer of rows narrower than 22 elements is
    kept per block of rows and named in one INFO line (no WARNING: measured 0.05-1.2% against per-row
    state there); a sparse embedding of such rows is not named; a dense layer of rows of 64 stays per
    row; a group that asked for ``"span"`` still gets D16's WARNING."""
    narrow, emb, wide = (nn.Parameter(torch.randn(1024, 8)), nn.Parameter(torch.randn(3000, 4)),
                         nn.Parameter(torch.randn(256, 64)))
    spanned = nn.Parameter(torch.randn(256, 40))
    opt = Gefen([{"params": [("enc.weight", narrow), ("emb.weight", emb), ("wide.weight", wide)]},
                 {"params": [("other.weight", spanned)], "narrow_rows": "span"}])
    logger = "gefen_dist.engine.span_step"
    for t in range(2):
        for p in (narrow, wide, spanned):
            p.grad = torch.randn(p.shape)
        emb.grad = torch.zeros(3000, 4)
        emb.grad[torch.arange(t, 3000, 97)] = 1.0
        with caplog.at_level("INFO", logger=logger):
            opt.step()
        recs = [r for r in caplog.records if r.name == logger]
        if t == 0:
            info = [r.getMessage() for r in recs if r.levelname == "INFO"]
            warn = [r.getMessage() for r in recs if r.levelname == "WARNING"]
            assert len(info) == 1 and "'enc.weight' (1024, 8): 100% of rows" in info[0], info
            assert "emb.weight" not in info[0] and "narrow_rows='rows'" in info[0] and "auto" in info[0]
            assert len(warn) == 1 and "'other.weight' (256, 40)" in warn[0] and "enc.weight" not in warn[0], warn
        else:
            assert not recs, [r.getMessage() for r in recs]
        caplog.clear()
    assert [opt._mode(p) for p in (narrow, emb, wide, spanned)] == ["span", "span", "factored", "span"]


def test_plain_dcp_flow_under_the_default(tmp_path):
    """The plain DCP flow with the default ``"auto"`` (D18): a ``"span"`` checkpoint of rows narrower
    than 22 elements loads (the same layout) and resumes bitwise; one saved per row (``"rows"``) is
    refused by ``dcp.load`` (DCP's size mismatch) before the optimizer changes, and
    ``gefen_dist.checkpoint.check_compatible`` names ``narrow_rows='rows'``."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    from gefen_dist.checkpoint import CheckpointMismatchError, check_compatible

    make = _dcp_model

    def load(m, opt, path):
        msd, osd = get_state_dict(m, opt)
        sd = {"model": msd, "optim": osd}
        dcp.load(sd, checkpoint_id=str(path))
        set_state_dict(m, opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
        for nr in ("span", "rows"):
            m, opt = make(narrow_rows=nr)
            _train_random(m, opt, 3, 1)
            msd, osd = get_state_dict(m, opt)
            dcp.save({"model": msd, "optim": osd}, checkpoint_id=str(tmp_path / nr))
            if nr == "span":
                ref = (m, opt)
        m2, opt2 = make()
        _train_random(m2, opt2, 1, 5)
        before = {k: v.clone() for k, v in opt2.state[m2[0].weight].items() if torch.is_tensor(v)}
        with pytest.raises(CheckpointMismatchError, match=r"\(2000, 3\).*per row.*per block of rows.*narrow_rows='rows'"):
            check_compatible(m2, opt2, str(tmp_path / "rows"))
        with pytest.raises(BaseException, match="Size mismatch"):  # DCP's CheckpointException
            load(m2, opt2, tmp_path / "rows")
        assert all(torch.equal(before[k], v) for k, v in opt2.state[m2[0].weight].items() if torch.is_tensor(v))
        m3, opt3 = make()
        load(m3, opt3, tmp_path / "span")
    assert opt3._mode(m3[0].weight) == "span" and opt3.param_groups[0]["narrow_rows"] == "auto"
    _train_random(ref[0], ref[1], 2, 7)
    _train_random(m3, opt3, 2, 7)
    assert all(torch.equal(a, b) for a, b in zip(ref[0].parameters(), m3.parameters()))


def test_a_deepspeed_buffer_resumes_under_another_setting_only_with_the_same_layout():
    """A DeepSpeed flat buffer's state saved under one ``narrow_rows`` resumes under another when both
    keep the same tensors per block of rows (the state then records the group's setting), and is
    refused naming the tensors otherwise, the state unchanged (``integrations.deepspeed._check_narrow_rows``,
    single process)."""
    from gefen_dist.engine.comm import LocalComm
    from gefen_dist.engine.flat import FlatSegments, Segment
    from gefen_dist.integrations.deepspeed import _check_narrow_rows

    def buffer(shapes, nr):
        segs, off = [], 0
        for name, shape in shapes:
            segs.append(Segment(name, name, shape, 0, off, math.prod(shape)))
            off += math.prod(shape)
        fs = FlatSegments(segs, LocalComm(), 4096)
        fs.second_moment, fs.narrow_rows = "factored", nr
        return fs, fs.new_state(torch.zeros(off), torch.zeros(256), factored=True)

    shapes = [("emb", (3000, 4)), ("mid", (200, 40)), ("w", (96, 128)), ("bias", (64,))]
    for saved, live, ok in (("span", "auto", False), ("rows", "auto", False), ("auto", "span", False),
                            ("auto", "rows", False)):
        _, st = buffer(shapes, saved)
        fs, _ = buffer(shapes, live)
        keep = dict(st)
        with pytest.raises(ValueError, match=rf"saved with narrow_rows='{saved}'.*narrow_rows='{live}'"):
            _check_narrow_rows(fs, st, True)
        assert st == keep
    _, st = buffer([("emb", (3000, 4)), ("w", (96, 128))], "span")  # rows of 4 (span either way) and of 128
    fs, _ = buffer([("emb", (3000, 4)), ("w", (96, 128))], "auto")
    _check_narrow_rows(fs, st, True)
    assert st["narrow_rows"] == "auto" and st["span_keys"] == ["emb"]
    _, st = buffer([("w", (96, 128))], "rows")  # no narrow rows: alike under every setting
    fs, _ = buffer([("w", (96, 128))], "span")
    _check_narrow_rows(fs, st, True)
    assert st["narrow_rows"] == "span"
