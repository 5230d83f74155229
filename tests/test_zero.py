"""ZeroGefen (ZeRO-1): partition properties and 1-process equivalence in-process; the 2- and
3-rank checks (tests/dist/zero_check.py) through torchrun."""
import os
import random
import subprocess
import sys

import pytest
import torch
from torch import nn

from gefen_dist import Gefen, ZeroGefen
from gefen_dist.core.step import column_sumsq
from gefen_dist.zero.optimizer import (MODE_COMPRESSED, MODE_DENSE, MODE_FACTORED, factored_wire_compressed, partition,
                             step_wire_bytes, unit_cost)
from gefen_dist.zero.partition import MODE_SPAN

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CHECK = os.path.join(ROOT, "tests", "dist", "zero_check.py")


def _run_torchrun(script, nproc, *args, timeout):
    """tests/dist/_launch.run_torchrun when present, else torchrun --standalone here."""
    sys.path.insert(0, os.path.join(ROOT, "tests", "dist"))
    try:
        from _launch import run_torchrun  # noqa: F401
    except ImportError:
        run_torchrun = None
    finally:
        sys.path.pop(0)
    if run_torchrun is not None:
        out = run_torchrun(script, nproc, *args, timeout=timeout)
        return out if isinstance(out, str) else (getattr(out, "stdout", "") or "") + (getattr(out, "stderr", "") or "")
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc), script,
           *map(str, args)]
    try:
        r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"torchrun timed out after {timeout}s (a collective hung?):\n{(e.stdout or '')[-3000:]}")
    text = r.stdout + r.stderr
    assert r.returncode == 0, f"torchrun {os.path.basename(script)} failed (rc {r.returncode}):\n{text[-6000:]}"
    return text


# --------------------------------------------------------------------------- partition

def _check_partition(specs, W):
    ranges = partition(specs, W)
    cost = [0] * W
    for (n, u, c), rs in zip(specs, ranges):
        pos = 0
        for r, (s, e) in enumerate(rs):
            assert s % u == 0 and e % u == 0 and s <= e
            if e > s:
                assert s == pos, (rs, specs)
                pos = e
            cost[r] += (e - s) // u * c
        assert pos == n or n == 0, (rs, n)
    # each rank's cost within one unit cost of the mean
    mean = sum(cost) / W
    umax = max((c for _, _, c in specs), default=0)
    assert all(abs(x - mean) <= umax + 1e-9 for x in cost), (cost, mean, umax)
    # ranks own consecutive pieces of the global space
    flat = []
    for r in range(W):
        for rs in ranges:
            if rs[r][1] > rs[r][0]:
                flat.append(r)
    assert flat == sorted(flat)
    return ranges


def test_partition_balanced_block_aligned():
    rng = random.Random(0)
    for _ in range(300):
        specs = []
        for _ in range(rng.randint(1, 6)):
            if rng.random() < 0.3:
                specs.append((rng.randint(0, 50), *unit_cost(True, 1, 1)))
            elif rng.random() < 0.3:  # factored: cut at rows only
                row = rng.choice([32, 64, 96])
                specs.append((row * rng.randint(1, 12), *unit_cost(False, 1, 32, row=row)))
            else:
                P = rng.choice([1, 4, 16, 64])
                B = P if P > 1 else 32
                specs.append((B * rng.randint(1, 40), *unit_cost(False, P, B)))
        _check_partition(specs, rng.randint(1, 5))


def test_partition_edge_cases():
    assert partition([(1, 1, 8)], 2) == [[(0, 1), (1, 1)]]  # rank 1 owns nothing
    assert partition([(1, 1, 8)], 3) == [[(0, 0), (0, 1), (1, 1)]]
    assert partition([(0, 1, 8), (8, 4, 12)], 2) == [[(0, 0), (0, 0)], [(0, 4), (4, 8)]]
    r = partition([(4 * 64, 64, 72)], 3)[0]  # 4 blocks over 3 ranks: 1/2/1
    assert [(e - s) // 64 for s, e in r] == [1, 2, 1]
    with pytest.raises(ValueError):
        partition([(10, 4, 1)], 2)


def test_step_wire_bytes():
    # compressed: n idx bytes + 2 * n/P fp32 (padded to 8); dense bf16: 2 bytes each
    sizes = step_wire_bytes([(MODE_COMPRESSED, 64, 4, [(0, 128), (128, 256)]),
                             (MODE_DENSE, 1, 2, [(0, 3), (3, 3)])], 2)
    assert sizes == [128 + 8 + 8 + 8, 128 + 8 + 8]
    # factored: n idx bytes + n/B fp32 M + n/row fp32 sqrt(v_row), each padded to 8
    sizes = step_wire_bytes([(MODE_FACTORED, 64, 4, [(0, 3 * 256), (3 * 256, 4 * 256)], 256)], 2)
    assert sizes == [768 + 4 * 12 + 16, 256 + 16 + 8]
    # span (D16): n idx bytes only (the block state is replicated), padded to 8; a rank owning nothing adds 0
    sizes = step_wire_bytes([(MODE_SPAN, 1, 4, [(0, 1542), (1542, 4500), (4500, 4500)])], 3)
    assert sizes == [1544, 2960, 0]
    assert unit_cost(False, 1, 64, row=256) == (256, 256 + 16 + 4)
    # compressed when 1 + 4/B + 4/row bytes per element < itemsize
    assert factored_wire_compressed(768, 768, 4) and factored_wire_compressed(512, 512, 2)
    assert not factored_wire_compressed(8, 8, 2) and not factored_wire_compressed(1, 7, 4)


# --------------------------------------------------------------------------- one process

def _model(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 96), nn.GELU(), nn.Linear(96, 16))


def _train(m, opt, n, seed=1):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(64, 16, generator=g)
    for _ in range(n):
        x = torch.randn(32, 64, generator=g)
        opt.zero_grad()
        ((m(x) - torch.tanh(x @ w)) ** 2).mean().backward()
        opt.step()


@pytest.mark.parametrize("fused", [False, None])
def test_single_process_equals_gefen_and_checkpoints(fused):
    a, b = _model(), _model()
    oa = Gefen(a.parameters(), lr=1e-2, weight_decay=0.1, fused=fused)
    ob = ZeroGefen(b.parameters(), lr=1e-2, weight_decay=0.1, fused=fused)
    _train(a, oa, 4)
    _train(b, ob, 4)
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))
    assert torch.equal(oa.codebook, ob.codebook)
    assert oa.state_bytes() == ob.state_bytes()
    sa, sb = oa.state_dict(), ob.state_dict()
    assert sa["param_groups"] == sb["param_groups"]
    for k, st in sa["state"].items():
        assert st.keys() == sb["state"][k].keys()
        for kk, v in st.items():
            w = sb["state"][k][kk]
            assert (torch.equal(v, w) and v.dtype == w.dtype) if isinstance(v, torch.Tensor) else v == w, (k, kk)
    # ZeroGefen's dict loads into plain Gefen and vice versa; all continue identically
    c, d = _model(5), _model(6)
    c.load_state_dict(a.state_dict())
    d.load_state_dict(a.state_dict())
    oc = Gefen(c.parameters(), lr=1e-2, weight_decay=0.1, fused=fused)
    od = ZeroGefen(d.parameters(), lr=1e-2, weight_decay=0.1, fused=fused)
    oc.load_state_dict(sb)
    od.load_state_dict(sa)
    for m, o in ((a, oa), (b, ob), (c, oc), (d, od)):
        _train(m, o, 3, seed=9)
    for m in (b, c, d):
        assert all(torch.equal(p, q) for p, q in zip(a.parameters(), m.parameters()))
    rep = ob.report()
    assert sum(r["local_numel"] for r in rep) == sum(p.numel() for p in b.parameters())
    assert "total:" in str(rep)


class _Mixed(nn.Module):
    """Two fp32 matrices and a bf16 one with 8-element rows (factored: its compressed form,
    1 + 4/8 + 4/8 bytes per element, is not smaller than bf16, so it travels dense)."""

    def __init__(self, seed=0):
        super().__init__()
        torch.manual_seed(seed)
        self.a = nn.Linear(64, 128)
        self.b = nn.Linear(128, 96)
        self.c = nn.Parameter((torch.randn(512, 8) * 0.05).to(torch.bfloat16))
        self.d = nn.Linear(8, 16)
        self.e = nn.Linear(96, 16)

    def forward(self, x):
        h = torch.tanh(self.a(x))
        return self.e(torch.tanh(self.b(h))) + self.d(h.repeat(1, 4) @ self.c.float())


def _mixed_groups(m, narrow_rows="rows"):
    """(``c``'s rows of 8 elements: per row under ``"rows"``, per block of rows under the default
    ``"auto"``, D18)"""
    return [{"params": [m.a.weight, m.c], "second_moment": "factored", "narrow_rows": narrow_rows},
            {"params": [m.b.weight], "weight_decay": 0.0, "second_moment": "shared"},
            {"params": [m.a.bias, m.b.bias, m.d.weight, m.d.bias, m.e.weight, m.e.bias]}]


@pytest.mark.parametrize("fused,narrow_rows", [(False, "rows"), (None, "rows"), (None, "auto"), (None, "rows8")])
def test_single_process_factored_equals_gefen(fused, narrow_rows):
    """second_moment="factored" (with a shared group beside it): bitwise Gefen, same state dict,
    cross-loading both ways continues bitwise; the bf16 ``(512, 8)`` tensor per row or (the default,
    D18) per block of rows; under ``"rows8"`` (D19) ``a.weight``'s rows of 64 in one-byte codes."""
    def make(cls, m):
        return cls(_mixed_groups(m, narrow_rows), lr=1e-2, weight_decay=0.1, fused=fused)

    a, b = _Mixed(), _Mixed()
    oa, ob = make(Gefen, a), make(ZeroGefen, b)
    _train(a, oa, 3)
    _train(b, ob, 3)
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))
    assert "v_col" in ob.state[b.a.weight] and "v_col" in ob.state[b.c] and "v" in ob.state[b.b.weight]
    assert ob._mode(b.c) == ("factored" if narrow_rows == "rows" else "span")
    assert ob._mode(b.a.weight) == ("rows8" if narrow_rows == "rows8" else "factored")
    if narrow_rows == "rows":
        assert not factored_wire_compressed(ob.state[b.c]["scale_block"], 8, 2)  # c travels dense
    assert oa.state_bytes() == ob.state_bytes()
    sa, sb = oa.state_dict(), ob.state_dict()
    assert sa["param_groups"] == sb["param_groups"]
    for k, st in sa["state"].items():
        assert list(st.keys()) == list(sb["state"][k].keys())
        for kk, v in st.items():
            w = sb["state"][k][kk]
            assert (torch.equal(v, w) and v.dtype == w.dtype and v.shape == w.shape
                    if isinstance(v, torch.Tensor) else v == w), (k, kk)
    c, d = _Mixed(5), _Mixed(6)
    c.load_state_dict(a.state_dict())
    d.load_state_dict(a.state_dict())
    oc, od = make(Gefen, c), make(ZeroGefen, d)
    oc.load_state_dict(sb)
    od.load_state_dict(sa)
    for m, o in ((a, oa), (b, ob), (c, oc), (d, od)):
        _train(m, o, 2, seed=9)
    for m in (b, c, d):
        assert all(torch.equal(p, q) for p, q in zip(a.parameters(), m.parameters()))


@pytest.mark.parametrize("fused", [False, None])
def test_appliers_are_the_selected_implementations(fused, monkeypatch):
    """ZeroGefen applies compressed and factored ranges with the appliers of the implementation
    that stepped them: the native kernel's apply-only entry points with fused=None on CPU (when
    they build), the reference appliers of core.apply with fused=False."""
    import dataclasses

    from gefen_dist.core import apply as ref_apply
    from gefen_dist.kernels import cpu, dispatch

    native = fused is None and cpu.available()
    real = dispatch._native_cpu() if native else dispatch._eager()
    calls = []

    def spy(name):
        def call(*a, **k):
            calls.append(name)
            return getattr(real, name)(*a, **k)
        return call

    spied = dataclasses.replace(real, apply_compressed_=spy("apply_compressed_"), apply_factored_=spy("apply_factored_"))
    monkeypatch.setattr(dispatch, "_native_cpu" if native else "_eager", lambda: spied)
    want = (cpu.apply_compressed_, cpu.apply_factored_) if native else (ref_apply.apply_compressed,
                                                                        ref_apply.apply_factored)
    assert (real.apply_compressed_, real.apply_factored_) == want
    m = _Mixed()
    _train(m, ZeroGefen(_mixed_groups(m), lr=1e-2, weight_decay=0.1, fused=fused), 3)
    assert {"apply_compressed_", "apply_factored_"} <= set(calls), calls


def test_factored_column_stats_are_gefens():
    """ZeroGefen's column statistics are single-process Gefen's: every rank sums g^2 over all rows
    of its whole (DDP) gradient with Gefen's float64 code (column_sumsq, same row chunks), divides by
    the rows and rounds to fp32 once. Owners' float64 partial sums all-reduced would reassociate the
    sum, which can change the fp32 rounding; that design is not used."""
    m = _Mixed()
    o = ZeroGefen(_mixed_groups(m), lr=1e-2)
    _train(m, o, 1)
    ent = [(o.param_groups[0], m.a.weight), (o.param_groups[0], m.c)]
    col = o._column_stats(ent)
    # a.weight is [128, 64]: two row blocks of 64 rows (D12), each with its own column means
    ga = m.a.weight.grad
    want = torch.cat([column_sumsq(ga[:64], 64), column_sumsq(ga[64:], 64)]) / 64
    assert o.state[m.a.weight]["v_col"].shape == (2, 64)
    assert torch.equal(col[m.a.weight], want.to(torch.float32))
    assert torch.equal(col[m.c], (column_sumsq(m.c.grad, 8) / 512).to(torch.float32))


@pytest.mark.parametrize("kw", [dict(), dict(second_moment="shared"), dict(fused=False)])
def test_wire_is_compressed_single_process(kw):
    m = _model()
    o = ZeroGefen(m.parameters(), lr=1e-2, **kw)
    _train(m, o, 2)
    w = o.last_wire
    assert w["world_size"] == 1 and w["elements"] == sum(p.numel() for p in m.parameters())
    assert w["gathered_bytes"] < 4 * w["elements"]


def test_rejects_non_float_params():
    with pytest.raises(TypeError):
        ZeroGefen([torch.zeros(3, dtype=torch.int64)])


def test_prestep_checks_as_gefen():
    """ZeroGefen refuses what Gefen refuses before any state is touched: a parameter whose shape
    changed, meta parameters and a compiled step, each with a message that says what to do."""
    w = torch.nn.Parameter(torch.randn(64, 256))
    opt = ZeroGefen([w], lr=1e-3)
    w.grad = torch.randn_like(w)
    opt.step()
    before = {k: v.clone() for k, v in opt.state[w].items() if torch.is_tensor(v)}
    w.data, w.grad = torch.randn(32, 256), torch.randn(32, 256)
    with pytest.raises(RuntimeError, match=r"ZeroGefen: parameter .* has shape \(32, 256\).*created for shape "
                                           r"\(64, 256\).*Re-create the optimizer"):
        opt.step()
    assert all(torch.equal(before[k], opt.state[w][k]) for k in before)

    with torch.device("meta"):
        m = nn.Linear(256, 64)
    opt = ZeroGefen(m.parameters(), lr=1e-3)
    for p in m.parameters():
        p.grad = torch.zeros_like(p)
    with pytest.raises(RuntimeError, match="ZeroGefen: parameter .* is on the meta device.*to_empty"):
        opt.step()

    w = torch.nn.Parameter(torch.randn(64, 256))
    opt = ZeroGefen([w], lr=1e-3)
    w.grad = torch.randn_like(w)
    with pytest.raises(Exception, match="cannot be compiled with torch.compile"):
        torch.compile(opt.step)()
    assert not opt.state


# --------------------------------------------------------------------------- torchrun

def test_zero_distributed(tmp_path):
    out2 = _run_torchrun(CHECK, 2, "--phase", 2, "--ckpt", tmp_path, timeout=150)
    assert "ZERO_CHECK_OK phase=2" in out2, out2[-4000:]
    assert "ws=2: nibbles ZeroGefen bitwise equal to a single process" in out2, out2[-4000:]
    out3 = _run_torchrun(CHECK, 3, "--phase", 3, "--ckpt", tmp_path, timeout=150)
    assert "ZERO_CHECK_OK phase=3" in out3, out3[-4000:]
    assert "ws=3: nibbles ZeroGefen bitwise equal to a single process" in out3, out3[-4000:]
    for out, ws in ((out2, 2), (out3, 3)):
        assert f"ws={ws}: col_blocks ZeroGefen bitwise equal to a single process" in out, out[-4000:]



def test_owner_state_in_small_chunks_equals_gefen(monkeypatch):
    """The owners' state-only updates run the native kernel chunk by chunk of whole blocks or rows
    (kernels/state_only.py; the scratch parameter no longer spans the owner's range): with chunks of a
    few rows the run is still bitwise single-process Gefen (factored and shared groups)."""
    from gefen_dist.kernels import cpu

    if not cpu.available():
        pytest.skip("the native CPU library is not built here")
    monkeypatch.setattr(cpu, "_SCRATCH_ELEMS", 200)  # rows of 64: 3 rows a chunk; blocks of P: one a chunk
    a, b = _Mixed(), _Mixed()
    oa = Gefen(_mixed_groups(a), lr=1e-2, weight_decay=0.1)
    ob = ZeroGefen(_mixed_groups(b), lr=1e-2, weight_decay=0.1)
    _train(a, oa, 3)
    _train(b, ob, 3)
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))
