"""torchrun worker: ZeroGefen (ZeRO-1) against single-process Gefen on the same global batch.

Run (the ``--ckpt`` folder is shared by the two launches; run ``2`` first):
    torchrun --nproc_per_node 2 tests/dist/zero_check.py --phase 2 --ckpt DIR
    torchrun --nproc_per_node 3 tests/dist/zero_check.py --phase 3 --ckpt DIR

Every rank computes the gradient of the whole global batch (what DDP's all-reduce gives it, without
the reduction-order rounding), and also runs single-process Gefen on it as the oracle. Phase 2:
2-rank comparisons (eager and fused), replicas, state bytes, wire bytes, a consolidated checkpoint
at step 5 (equal to the oracle's state_dict), 2 -> 1 resume (plain Gefen and a 1-rank ZeroGefen),
DDP smoke run, and models where a rank owns nothing. Phase 3: 3-rank comparison, 2 -> 3 resume,
an empty rank at 3.

Every run also has a ``second_moment="factored"`` param group (variant "a": the bf16 matrix, the
late-learned one and a period-64 one; phase 3's comparison uses variant "b": the attention output
matrix, the head and the embedding, with weight decay 0), so the factored path is checked by the same
launches: bitwise equality, replicas, state bytes (``v_col`` replicated), checkpoints, empty ranks.
Each variant also has a ``second_moment="elementwise"`` group (v per element, period 1: the token
embedding in "a", the MLP output matrix in "b").
"""
import argparse
import hashlib
import os
import sys

import torch
import torch.distributed as dist
from _teardown import leave
from torch import nn

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests")]
from _models import TinyLM, lm_loss, markov_batches  # noqa: E402
from gefen_dist.engine.layout import few_rows  # noqa: E402
from gefen_dist import Gefen, ZeroGefen  # noqa: E402
from gefen_dist.engine.comm import LocalComm  # noqa: E402
from gefen_dist.zero.optimizer import unit_cost  # noqa: E402
from gefen_dist.core.periods import shape_period  # noqa: E402

STEPS = 10
CKPT_STEP = 5


class Net(nn.Module):
    """TinyLM plus a bf16 matrix, a matrix whose gradient is zero at step 1 (learned late,
    updated with decay only until then) and one that never gets a gradient."""

    def __init__(self):
        super().__init__()
        self.lm = TinyLM(d=64, heads=2, ff=128, layers=1, ctx=16)
        self.hb = nn.Parameter(torch.randn(16, 512).mul_(0.02).to(torch.bfloat16))
        self.late = nn.Parameter(torch.randn(24, 256) * 0.02)
        self.unused = nn.Parameter(torch.zeros(64))
        # rows of 3 elements with narrow_rows="span" (D16): cut at rows, blocks of 342 rows cut by the ranks
        self.narrow = nn.Parameter(torch.randn(1500, 3) * 0.05)
        # rows of 30 with narrow_rows="rows8" (D19): cut at rows, the row codes' blocks of 35 rows cut by the ranks
        self.narrow8 = nn.Parameter(torch.randn(400, 30) * 0.05)
        g = torch.Generator().manual_seed(7)
        self.register_buffer("R", torch.randn(512, 8, generator=g), persistent=False)
        self.register_buffer("S", torch.randn(256, 4, generator=g), persistent=False)
        self.register_buffer("N", torch.randn(4500, 4, generator=g), persistent=False)
        self.register_buffer("N8", torch.randn(12000, 4, generator=g) / 30, persistent=False)

    def forward(self, x, y, step):
        return self.loss(x, y, step)

    def loss(self, x, y, step):
        out = lm_loss(self.lm, x, y)
        out = out + ((self.hb.float() @ self.R) ** 2).mean() * 0.1
        gate = 0.0 if step == 0 else 1.0
        out = out + ((self.narrow.reshape(1, -1) @ self.N).tanh() ** 2).mean()
        out = out + ((self.narrow8.reshape(1, -1) @ self.N8).tanh() ** 2).mean()
        return out + gate * ((self.late @ self.S).tanh() ** 2).mean()


def net(seed=0):
    torch.manual_seed(seed)
    return Net()


FACTORED = {"a": ("hb", "late", "lm.blocks.0.linear1.weight"),
            "b": ("lm.blocks.0.self_attn.out_proj.weight", "lm.head.weight", "lm.tok.weight")}
# second_moment="elementwise" (v per element: the quantized period-1 tensors of each variant)
ELEMENTWISE = {"a": ("lm.tok.weight",), "b": ("lm.blocks.0.linear2.weight",)}


def groups(m, variant="a"):
    named = list(m.named_parameters())
    fact, elem = FACTORED[variant], ELEMENTWISE[variant]
    out = [
        {"params": [p for n, p in named if p.ndim >= 2 and n not in fact and n not in elem and n not in ("narrow", "narrow8")],
         "weight_decay": 0.1, "second_moment": "shared"},
        {"params": [p for n, p in named if n == "narrow"], "second_moment": "factored", "narrow_rows": "span"},
        {"params": [p for n, p in named if n == "narrow8"], "second_moment": "factored", "narrow_rows": "rows8"},
        {"params": [p for n, p in named if p.ndim < 2], "weight_decay": 0.0, "lr": 2e-3},
        {"params": [p for n, p in named if n in fact], "second_moment": "factored",
         "weight_decay": 0.1 if variant == "a" else 0.0},
    ]
    if elem:
        out.append({"params": [p for n, p in named if n in elem], "second_moment": "elementwise"})
    return out


def batches():
    return markov_batches(STEPS, batch=4, ctx=16, seed=3)


def make(cls, m, fused, variant="a", **kw):
    opt = cls(groups(m, variant), lr=3e-3, weight_decay=0.1, fused=fused, **kw)
    if cls is Gefen and "process_group" not in kw:
        opt._comm = LocalComm()  # single-process oracle on every rank
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 - s / 20.0)
    return opt, sched


def one_step(m, opt, sched, batch, step):
    x, y = batch
    opt.zero_grad()
    m.loss(x, y, step).backward()
    opt.step()
    sched.step()


def digest(m):
    h = hashlib.sha256()
    for p in m.parameters():
        h.update(p.detach().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def max_rel(a, b):
    worst = 0.0
    for p, q in zip(a.parameters(), b.parameters()):
        d = float((p.detach().float() - q.detach().float()).abs().max())
        worst = max(worst, d / max(float(q.detach().float().abs().max()), 1e-30))
    return worst


def bitwise(a, b):
    return all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))


def log(*a):
    if dist.get_rank() == 0:
        print(*a, flush=True)


def check_replicas(m, what):
    ds = [None] * dist.get_world_size()
    dist.all_gather_object(ds, digest(m))
    assert len(set(ds)) == 1, f"{what}: replicas differ across ranks"


def compare_run(fused, ckpt_dir=None, variant="a"):
    """ZeroGefen vs the oracle over STEPS steps; returns the (model, optimizer)."""
    ws, rank = dist.get_world_size(), dist.get_rank()
    ref, zm = net(), net()
    ro, rs = make(Gefen, ref, fused, variant)
    zo, zs = make(ZeroGefen, zm, fused, variant)
    data = batches()
    worst = 0.0
    for step, batch in enumerate(data):
        one_step(ref, ro, rs, batch, step)
        one_step(zm, zo, zs, batch, step)
        worst = max(worst, max_rel(zm, ref))
        assert bitwise(zm, ref) or worst <= 1e-6, f"fused={fused} step {step}: rel diff {worst:.3e}"
        if step == 0 or step == STEPS - 1:
            check_replicas(zm, f"fused={fused} step {step}")
        if ckpt_dir is not None and step + 1 == CKPT_STEP:
            zo.consolidate_state_dict(to=0)
            if rank == 0:
                sd, rsd = zo.state_dict(), ro.state_dict()
                assert sd["param_groups"] == rsd["param_groups"]
                assert sd["state"].keys() == rsd["state"].keys()
                for k, st in rsd["state"].items():
                    assert st.keys() == sd["state"][k].keys(), (k, st.keys(), sd["state"][k].keys())
                    for kk, v in st.items():
                        w = sd["state"][k][kk]
                        if isinstance(v, torch.Tensor):
                            assert v.dtype == w.dtype and v.shape == w.shape and torch.equal(v, w), (k, kk)
                        else:
                            assert v == w, (k, kk, v, w)
                torch.save({"optim": sd, "model": zm.state_dict(), "sched": zs.state_dict()},
                           os.path.join(ckpt_dir, "zero5.pt"))
            else:
                try:
                    zo.state_dict()
                except RuntimeError:
                    pass
                else:
                    raise AssertionError("state_dict() on a rank that was not consolidated to must raise")
    exact = bitwise(zm, ref)
    # periods and codebook
    assert torch.equal(zo.codebook, ro.codebook), "codebook differs"
    rrep, zrep = ro.report(), zo.report()
    assert [r["period"] for r in rrep] == [r["period"] for r in zrep], "periods differ"
    assert [r["kind"] for r in rrep] == [r["kind"] for r in zrep]
    kinds = {(r["kind"], min(r["period"], 2)) for r in zrep}
    assert ("quantized", 1) in kinds and ("quantized", 2) in kinds and ("exact", 0) in kinds, kinds
    fact = {n: zo.state[p] for n, p in zm.named_parameters()
            if "v_col" in zo.state.get(p, {}) and "v_blk" not in zo.state[p]}
    # narrow_rows="span" (D16): partitioned at rows (this rank's idx), the block state replicated,
    # bitwise the oracle's state
    span = {n: p for n, p in zm.named_parameters() if "v_blk" in zo.state.get(p, {})}
    assert sorted(span) == ["narrow", "narrow8"], sorted(span)
    assert zo._mode(span["narrow8"]) == "rows8" and zo._mode(span["narrow"]) == "span"
    for (n, p), (_, q) in zip(zm.named_parameters(), ref.named_parameters()):
        if n in span:
            s, e = zo.owned_range(p)
            assert torch.equal(zo.state[p]["idx"], ro.state[q]["idx"].reshape(-1)[s:e]), f"span {n}: idx differs"
            for k in ("scale", "v_blk", "v_col"):
                assert torch.equal(zo.state[p][k], ro.state[q][k]), f"span {n}: {k} differs from the oracle"
            for k in ("scale_code", "v_code"):  # D19: this rank's rows
                if k in ro.state[q]:
                    S = p.shape[1]
                    assert torch.equal(zo.state[p][k], ro.state[q][k][s // S:e // S]), f"span {n}: {k} differs"
    span_cut = [None] * ws
    dist.all_gather_object(span_cut, [zo.owned_range(p) for p in span.values()])
    shapes = {n: tuple(p.shape) for n, p in zm.named_parameters()}
    few = [n for n in FACTORED[variant] if few_rows(shapes[n])]  # factored like the rest (D15 withdrawn)
    assert sorted(fact) == sorted(FACTORED[variant]), sorted(fact)
    assert few == (["hb", "late"] if variant == "a" else []), few
    assert all(st["learned"] for st in fact.values())
    for n, p in zm.named_parameters():  # D14: a factored tensor's period comes from its shape
        if n in fact:
            assert fact[n]["period"] == shape_period(p.shape), (n, fact[n]["period"], tuple(p.shape))
    for n, p in zm.named_parameters():
        if n in ELEMENTWISE[variant]:
            assert zo.state[p]["period"] == 1 and "v" in zo.state[p], f"elementwise {n}: period {zo.state[p]['period']}"
    # the replicated column factor: on every rank bitwise the oracle's (so identical across ranks)
    for (n, p), (_, q) in zip(zm.named_parameters(), ref.named_parameters()):
        if n in fact:
            assert torch.equal(zo.state[p]["v_col"], ro.state[q]["v_col"]), f"v_col of {n} differs"
    # state bytes: the ranks' local state adds up to the single-process state exactly, except the
    # codebook and the factored tensors' v_col, which every rank holds whole
    cb = zo.codebook.numel() * 4 + sum(4 * st["v_col"].numel() for st in fact.values()) + sum(
        t.numel() * t.element_size() for p in span.values() for k, t in zo.state[p].items()
        if k in ("scale", "v_blk", "v_col"))
    local = zo.state_bytes()
    locs = [None] * ws
    dist.all_gather_object(locs, local)
    total = ro.state_bytes()
    assert sum(x - cb for x in locs) + cb == total, (locs, total)
    # each rank within one unit's bytes of the mean (the partition also reserves room for the
    # unused parameter, which never gets state: 8 bytes per element); factored tensors' unit is a row
    units = []
    for p in zm.parameters():
        st = zo.state.get(p)
        if not st:
            continue
        if "v_blk" in st:  # a row of idx bytes
            units.append(st["v_col"].numel())
        elif "idx" not in st:
            units.append(unit_cost(True, 1, 1)[1])
        else:
            units.append(unit_cost(False, st["period"], st["scale_block"],
                                   row=st["v_col"].shape[-1] if "v_col" in st else None)[1])
    unit = max(units)
    slack = 8 * zm.unused.numel()
    assert abs((local - cb) - (total - cb) / ws) <= unit + slack, (local, total, ws, unit)
    n_owned = [None] * ws
    dist.all_gather_object(n_owned, sum(r["local_numel"] for r in zrep))
    assert sum(n_owned) == sum(r["numel"] for r in zrep), (n_owned,)
    str(zrep)
    wire = zo.last_wire
    elems = wire["elements"]
    log(f"  ws={ws} fused={fused} factored={list(FACTORED[variant])}: params {'bitwise equal' if exact else f'max rel {worst:.2e}'} to single-process "
        f"Gefen, periods+codebook equal, state bytes per rank {locs} (single process {total}); span pieces {span_cut}; "
        f"wire {wire['gathered_bytes']} B gathered for {elems} params "
        f"({4 * elems / wire['gathered_bytes']:.2f}x fewer than fp32)")
    return zm, zo, exact


def resume(cls, ckpt_dir, **kw):
    """Load the step-5 checkpoint into a fresh model/optimizer and run the remaining steps."""
    ck = torch.load(os.path.join(ckpt_dir, "zero5.pt"), weights_only=False)
    m = net(seed=123)
    m.load_state_dict(ck["model"])
    opt, sched = make(cls, m, False, **kw)
    sched.load_state_dict(ck["sched"])
    opt.load_state_dict(ck["optim"])
    for step, batch in enumerate(batches()):
        if step >= CKPT_STEP:
            one_step(m, opt, sched, batch, step)
    final = torch.load(os.path.join(ckpt_dir, "final.pt"), weights_only=False)
    ok = all(torch.equal(p, final[n]) for n, p in m.named_parameters())
    assert ok, f"{cls.__name__} {kw}: resumed run differs from the uninterrupted 2-rank run"
    return m, opt


def empty_rank_cases():
    ws, rank = dist.get_world_size(), dist.get_rank()
    # (a) one 1-element parameter: one rank owns it, the others (the last among them) nothing, ever.
    torch.manual_seed(1)
    w = nn.Parameter(torch.randn(1))
    wr = nn.Parameter(w.detach().clone())
    zo = ZeroGefen([w], lr=1e-2, weight_decay=0.1)
    ro = Gefen([wr], lr=1e-2, weight_decay=0.1)
    ro._comm = LocalComm()
    for i in range(3):
        for p, o in ((w, zo), (wr, ro)):
            o.zero_grad()
            ((p - 0.3 * i) ** 2).sum().backward()
            o.step()
    owned = [None] * ws
    dist.all_gather_object(owned, zo.owned_range(w))
    assert sorted(e - s for s, e in owned) == [0] * (ws - 1) + [1], owned
    assert owned[-1][1] == owned[-1][0], owned  # the last rank owns nothing
    assert torch.equal(w, wr)
    zo.consolidate_state_dict(to=ws - 1)  # onto a rank that owns nothing
    if rank == ws - 1:
        sd = zo.state_dict()
        assert torch.equal(sd["state"][0]["exp_avg"], ro.state[wr]["exp_avg"])
    # (b) one quantized matrix with a single row: while its period is unknown its unit is the row,
    # so one rank learns the period alone (the others enter the collectives with nothing); at
    # the codebook the partition is redone block-aligned.
    torch.manual_seed(2)
    q = nn.Parameter(torch.randn(1, 8192) * 0.02)
    qr = nn.Parameter(q.detach().clone())
    zo = ZeroGefen([q], lr=1e-2, weight_decay=0.0, second_moment="shared")  # (c) below covers factored
    ro = Gefen([qr], lr=1e-2, weight_decay=0.0, second_moment="shared")
    ro._comm = LocalComm()
    tgt = torch.linspace(-1, 1, 8192).view(1, -1).repeat_interleave(1, 0) * torch.arange(8192).remainder(64).float()
    for i in range(4):
        for p, o in ((q, zo), (qr, ro)):
            o.zero_grad()
            ((p * 50 - tgt) ** 2).mean().backward()
            o.step()
    assert torch.equal(q, qr), "single-row model differs"
    assert torch.equal(zo.codebook, ro.codebook)
    sizes = [None] * ws
    dist.all_gather_object(sizes, zo.owned_range(q))
    assert all(e > s for s, e in sizes), sizes  # after learning everyone owns a share
    # (c) the same single-row matrix in a factored group: factored (a v_col per column; D15, which
    # kept a shared v for few rows, is withdrawn). A factored tensor is cut only at rows, so one rank
    # owns the row and the others own nothing of it.
    q2 = nn.Parameter(q.detach().clone())
    qr2 = nn.Parameter(q.detach().clone())
    zo = ZeroGefen([q2], lr=1e-2, weight_decay=0.1, second_moment="factored", fused=False)
    ro = Gefen([qr2], lr=1e-2, weight_decay=0.1, second_moment="factored", fused=False)
    ro._comm = LocalComm()
    for i in range(3):
        for p, o in ((q2, zo), (qr2, ro)):
            o.zero_grad()
            ((p * 50 - tgt) ** 2).mean().backward()
            o.step()
    assert torch.equal(q2, qr2), "single-row model of a factored group differs"
    assert "v_col" in ro.state[qr2] and ro.state[qr2]["period"] == shape_period(q2.shape)
    fown = [None] * ws
    dist.all_gather_object(fown, zo.owned_range(q2))
    assert sorted(e - s for s, e in fown) == [0] * (ws - 1) + [8192], fown
    zo.consolidate_state_dict(to=ws - 1)
    if rank == ws - 1:
        sd, rsd = zo.state_dict()["state"][0], ro.state_dict()["state"][0]
        assert all(torch.equal(sd[k], rsd[k]) for k in ("idx", "scale", "v_row", "v_col")), "1-row state"
    log(f"  ws={ws}: empty-rank models ok (1-element owned by {owned}, 1-row matrix now {sizes}, "
        f"1-row matrix of a factored group {fown})")


def nibbles_case():
    """second_moment="nibbles" (D20): each owner steps its rows of the factored tensors (cut at rows; the
    random numbers keyed by global rows) and their new values travel dense; ZeroGefen ends bitwise where a
    single-process Gefen does (parameters, and the consolidated codes, scales and statistics)."""
    rank, ws = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(5)
    # 132 = 4 x 33 rows: row blocks (D12) whose edges the partition may cut; 7 x 1024: rows of 1024
    ps = [nn.Parameter(torch.randn(132, 33) * 0.1), nn.Parameter(torch.randn(7, 1024) * 0.1),
          nn.Parameter(torch.randn(64, 96) * 0.1), nn.Parameter(torch.randn(96) * 0.1)]
    rs = [nn.Parameter(p.detach().clone()) for p in ps]
    zo = ZeroGefen(ps, lr=1e-2, weight_decay=0.1, second_moment="nibbles")
    ro = Gefen(rs, lr=1e-2, weight_decay=0.1, second_moment="nibbles")
    ro._comm = LocalComm()
    g = torch.Generator().manual_seed(6)
    for _ in range(4):
        grads = [torch.randn(p.shape, generator=g) * torch.rand(p.shape[0], *([1] * (p.dim() - 1)), generator=g)
                 for p in ps]
        for qs, o in ((ps, zo), (rs, ro)):
            for q, gr in zip(qs, grads):
                q.grad = gr.clone()
            o.step()
    for i, (p, r) in enumerate(zip(ps, rs)):
        assert torch.equal(p, r), f"nibbles: parameter {i} differs from a single process"
    assert zo.codebook.numel() == 16 and torch.equal(zo.codebook, ro.codebook)
    cut = [None] * ws
    dist.all_gather_object(cut, [zo.owned_range(p) for p in ps[:3]])
    zo.consolidate_state_dict(to=0)
    if rank == 0:
        sd, rsd = zo.state_dict()["state"], ro.state_dict()["state"]
        for i in range(3):
            for k in ("idx", "scale", "v_row", "v_col"):
                assert torch.equal(sd[i][k], rsd[i][k]), (i, k)
    log(f"  ws={ws}: nibbles ZeroGefen bitwise equal to a single process (rows owned per rank: {cut})")


def col_blocks_case():
    """``col_blocks="auto"`` (D21): each owner updates the state of its rows of the column-blocked tensors (cut at
    rows; ``v_row`` ``[rows, K]``) and their updates travel compressed (``sqrt(v_row)`` per row and block of
    columns) as a plain factored tensor's do;
    ZeroGefen ends bitwise where a single-process Gefen does, its consolidated state dict is the single
    process's, and that state dict loaded into ZeroGefen at this world size continues bitwise."""
    rank, ws = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(7)
    shapes = ((66, 198), (40, 160), (96, 96), (96,))  # K = 3, 4, 1 (the compressed wire), exact
    ps = [nn.Parameter(torch.randn(s) * 0.1) for s in shapes]
    rs = [nn.Parameter(p.detach().clone()) for p in ps]
    zo = ZeroGefen(ps, lr=1e-2, weight_decay=0.1, col_blocks="auto")
    ro = Gefen(rs, lr=1e-2, weight_decay=0.1, col_blocks="auto")
    ro._comm = LocalComm()
    g = torch.Generator().manual_seed(8)

    def steps(pairs, n):
        for _ in range(n):
            grads = [torch.randn(p.shape, generator=g) * torch.rand(p.shape[0], *([1] * (p.dim() - 1)), generator=g)
                     for p in pairs[0][0]]
            for qs, o in pairs:
                for q, gr in zip(qs, grads):
                    q.grad = gr.clone()
                o.step()

    steps([(ps, zo), (rs, ro)], 4)
    for i, (p, r) in enumerate(zip(ps, rs)):
        assert torch.equal(p, r), f"col_blocks: parameter {i} differs from a single process"
    assert [tuple(zo.state[p]["v_row"].shape)[1:] for p in ps[:3]] == [(3,), (4,), ()], "v_row per column block"
    from gefen_dist.zero.partition import MODE_FACTORED

    # their updates travel compressed: idx, M and sqrt(v_row) per row and block of columns
    assert all(zo._wire_mode(p, zo.state[p]) == MODE_FACTORED for p in ps[:3]), "col_blocks: wire"
    cut = [None] * ws
    dist.all_gather_object(cut, [zo.owned_range(p) for p in ps[:2]])
    split = [i for i in range(2) if sum(1 for r in range(ws) if cut[r][i][1] > cut[r][i][0]) > 1]
    assert split, f"no column-blocked tensor is cut between ranks: {cut}"
    zo.consolidate_state_dict(to=0)
    sd = zo.state_dict() if rank == 0 else None
    if rank == 0:
        rsd = ro.state_dict()
        assert sd["param_groups"] == rsd["param_groups"]
        for i in range(3):
            for k in ("idx", "scale", "v_row", "v_col"):
                assert torch.equal(sd["state"][i][k], rsd["state"][i][k]), (i, k)
    box = [sd]
    dist.broadcast_object_list(box, src=0)
    qs = [nn.Parameter(p.detach().clone()) for p in ps]
    qo = ZeroGefen(qs, lr=1e-2, weight_decay=0.1, col_blocks="auto")
    qo.load_state_dict(box[0])
    steps([(ps, zo), (rs, ro), (qs, qo)], 2)
    for i, (p, q, r) in enumerate(zip(ps, qs, rs)):
        assert torch.equal(p, r) and torch.equal(q, r), f"col_blocks: parameter {i} after the resume"
    log(f"  ws={ws}: col_blocks ZeroGefen bitwise equal to a single process, consolidated state the single "
        f"process's, resumed bitwise (column-blocked tensors cut between ranks: {split}; ranges {cut})")


def ddp_smoke():
    """DDP with each rank on its half of the batch: replicas stay bitwise identical."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    rank, ws = dist.get_rank(), dist.get_world_size()
    m = net()
    dm = DDP(m, find_unused_parameters=True)
    opt, sched = make(ZeroGefen, m, None)
    losses = []
    for step, (x, y) in enumerate(batches()[:4]):
        xs, ys = x.chunk(ws)[rank], y.chunk(ws)[rank]
        opt.zero_grad()
        loss = dm(xs, ys, step)
        loss.backward()
        opt.step()
        sched.step()
        losses.append(float(loss.detach()))
    check_replicas(m, "ddp")
    log(f"  ws={ws}: DDP-style run (per-rank half batches, gradient all-reduce) replicas bitwise equal, "
        f"loss {losses[0]:.3f} -> {losses[-1]:.3f}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--phase", type=int, required=True, choices=(2, 3))
    ap.add_argument("--ckpt", required=True)
    args = ap.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    ws, rank = dist.get_world_size(), dist.get_rank()
    assert ws == args.phase, f"phase {args.phase} needs --nproc_per_node {args.phase}"
    sub = dist.new_group([0])  # every rank must take part in creating it
    all_exact = True
    if args.phase == 2:
        zm, zo, ex = compare_run(False, ckpt_dir=args.ckpt)
        all_exact &= ex
        if rank == 0:
            torch.save({n: p.detach().clone() for n, p in zm.named_parameters()}, os.path.join(args.ckpt, "final.pt"))
        dist.barrier()
        _, _, ex = compare_run(None)
        all_exact &= ex
        if rank == 0:
            resume(Gefen, args.ckpt)
            resume(ZeroGefen, args.ckpt, process_group=sub)
            log("  checkpoint 2 -> 1: plain Gefen and 1-rank ZeroGefen resume bitwise equal to the uninterrupted run")
        dist.barrier()
        ddp_smoke()
    else:
        _, _, ex = compare_run(False, variant="b")
        all_exact &= ex
        rm, _ = resume(ZeroGefen, args.ckpt)
        check_replicas(rm, "resumed at 3 ranks")
        log("  checkpoint 2 -> 3: ZeroGefen at 3 ranks resumes bitwise equal to the uninterrupted run")
    empty_rank_cases()
    nibbles_case()
    col_blocks_case()
    log(f"ZERO_CHECK_OK phase={args.phase} bitwise={all_exact}")
    leave()


if __name__ == "__main__":
    main()
