"""torchrun worker: Gefen checkpoints with torch.distributed.checkpoint, resharded.

    torchrun --nproc_per_node 2 tests/dist/dcp_reshard.py save DIR
    torchrun --nproc_per_node N tests/dist/dcp_reshard.py load DIR      (N = 1, 3, 4)

``save`` (2 ranks): FSDP2 and DDP runs of 3 steps (with clip_grad_norm_, checked against the
single-process norm and params against single-process Gefen), each saved sharded with
gefen_dist.checkpoint.save plus a consolidated full_state_dict (torch.save on rank 0); and an
FSDP2 checkpoint written with raw DCP before any step (DCP's zero-grad init step).

``load`` (N ranks), per world size:
  * all N: the FSDP2 checkpoint into FSDP2 (uneven and, at N=4, empty shards);
  * N=1: the FSDP2 checkpoint into DDP;
  * N=3: the DDP checkpoint into FSDP2, the full state dict via broadcast_from_rank0, and the
    pre-step checkpoint (a real step afterwards must learn a 256-value codebook);
  * N=4: the FSDP2 checkpoint into HSDP (2x2), and clip_grad_norm_ under HSDP;
  * all N: the FSDP2 checkpoint through the plain get_state_dict -> dcp.load -> set_state_dict
    flow (no gefen_dist.checkpoint helper) into FSDP2.
Each load checks every state tensor (full_tensor) equals the saved one bit for bit with its
dtype, ints (step, period, scale_block, learned) equal, one shared codebook equal to the saved
one, then takes step 4 and compares with an uninterrupted single-process Gefen run on the global
batch (computed in the same launch) within 1e-6 relative.
Rank 0 prints one ``OK <what>`` line per check and ``ALL OK`` at the end.
"""
import os
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist
from _teardown import leave
from torch import nn

sys.path[:0] = [os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))]
from gefen_dist import checkpoint as gckpt  # noqa: E402
from gefen_dist.engine.comm import LocalComm  # noqa: E402
from gefen_dist.integrations.fsdp import build_optimizer, clip_grad_norm_, shard_model  # noqa: E402

G = 12  # global batch: divisible by every world size used (1..4)
LR, WD, CLIP, TOL = 3e-3, 0.1, 0.5, 1e-6
SAVE_STEPS = 3


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(128, 33)               # 33 rows: uneven shards at 2, 3, 4 ranks
        self.b = nn.Linear(33, 512)               # row length 33
        self.c = nn.Linear(512, 10, bias=False)   # 10 rows: (3,3,3,1) at 4 ranks
        self.tiny = nn.Parameter(torch.randn(3, 2048) * 0.02)   # quantized; empty shard on rank 3 of 4
        self.small = nn.Parameter(torch.randn(3, 5) * 0.1)      # exact AdamW state (15 < 4096)
        # 120 = 3 x 40 rows: three row blocks of the factored column profile (D12), cut by the
        # shards at 2 and 4 ranks
        self.qkv = nn.Parameter(torch.randn(120, 40) * 0.05)
        # rows of 2 elements in its own param group with narrow_rows="span" (D16): 5 blocks of 512
        # rows (the last 452), cut by the shards at 2, 3 and 4 ranks; replicated block state
        self.narrow = nn.Parameter(torch.randn(2500, 2) * 0.05)
        # 33 rows of 4 x 33: four column blocks (col_blocks="auto", D21: v_row [33, 4]) in a group of its own;
        # its rows cut unevenly by the shards
        self.colb = nn.Parameter(torch.randn(33, 132) * 0.05)
        self.register_buffer("proj", torch.randn(128, 5000, generator=torch.Generator().manual_seed(3)) / 120)

    def forward(self, x):
        h = torch.relu(self.a(x))
        h = torch.relu(self.b(h)) + self.tiny.sum(0)[:512] * 0.1
        q = (x[:, :40] @ self.qkv.t()).view(x.shape[0], 3, 40)
        return self.c(h) + self.small.sum(0).repeat(2) + 0.1 * (q[:, 0] * q[:, 1] + q[:, 2]).mean(-1, keepdim=True) \
            + (torch.tanh(x @ self.proj.to(x.dtype)) * self.narrow.reshape(1, -1)).sum(1, keepdim=True) \
            + 0.1 * torch.tanh(x[:, :33] @ self.colb).mean(-1, keepdim=True)


def make_opt(m):
    """gefen_dist.integrations.fsdp.build_optimizer's groups, with ``narrow`` in a third group that
    keeps its state per block of rows (narrow_rows="span") and ``b.weight`` (rows of 33) in a fourth
    with its scale and second moment per row in one-byte codes (narrow_rows="rows8", D19: replicated
    codes against blocks of 32 rows, cut by the shards), and ``colb`` in a fifth with ``col_blocks="auto"`` (D21)."""
    opt = build_optimizer(m, lr=LR, weight_decay=WD)
    g0 = opt.param_groups[0]
    for leaf, setting, mode in (("narrow", {"narrow_rows": "span"}, "span"), ("b.weight", {"narrow_rows": "rows8"}, "rows8"),
                                ("colb", {"col_blocks": "auto"}, "factored")):
        i = next(j for j, n in enumerate(g0["param_names"]) if n.endswith(leaf))
        p = g0["params"].pop(i)
        name = g0["param_names"].pop(i)
        opt.add_param_group({"params": [p], "param_names": [name], "weight_decay": WD, **setting})
        assert opt._mode(p) == mode, (name, opt._mode(p))
    return opt


def net(seed=0):
    torch.manual_seed(seed)
    return Net()


def batch(step):
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randn(G, 128, generator=g), torch.randn(G, 10, generator=g)


def local_batch(step, rank, ws):
    x, y = batch(step)
    n = G // ws
    return x[rank * n:(rank + 1) * n], y[rank * n:(rank + 1) * n]


def loss_fn(m, x, y):
    return ((m(x) - y) ** 2).mean()


def log(*a):
    if dist.get_rank() == 0:
        print(*a, flush=True)


def rel(a, b):
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


def full(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t


class Reference:
    """Single-process Gefen on the global batch (LocalComm: no collectives).

    Each step computes the global-batch gradient and the single-process clip norm; when the
    distributed run's (reduced, clipped, gathered) gradients are passed, they are checked against
    the global-batch ones (<= 1e-5 relative: reduction order only) and then used for the step.
    Without that, a ulp of reduction-order noise can flip a rounding decision of one uint8 index
    and move one weight by ~lr/100, which says nothing about the optimizer.
    """

    def __init__(self):
        self.m = net()
        self.opt = make_opt(self.m)
        self.opt._comm = LocalComm()

    def step(self, s, grads=None):
        x, y = batch(s)
        self.opt.zero_grad()
        loss_fn(self.m, x, y).backward()
        norm = float(torch.nn.utils.clip_grad_norm_(self.m.parameters(), CLIP))
        if grads is not None:
            for (name, q), g in zip(self.m.named_parameters(), grads):
                r = rel(g, q.grad)
                assert r <= 1e-5, f"step {s}: distributed gradient of {name} differs from the global-batch one ({r:.2e}) "
                q.grad = g.clone()
        self.opt.step()
        return norm


def replayed_reference(grads_file, n):
    ref = Reference()
    grads = torch.load(grads_file)
    for s in range(n):
        ref.step(s, grads[s])
    return ref


def train_step(m, opt, step, rank, ws, ref=None):
    """One distributed step (with clip_grad_norm_); returns the clipped gradients, gathered."""
    x, y = local_batch(step, rank, ws)
    opt.zero_grad()
    loss_fn(m, x, y).backward()
    norm = clip_grad_norm_(m, CLIP)
    assert isinstance(norm, torch.Tensor) and not hasattr(norm, "placements"), type(norm)
    grads = [full(p.grad).clone() for p in m.parameters()]
    if ref is not None:
        rnorm = ref.step(step, grads)
        r = rel(norm, torch.tensor(rnorm))
        assert r <= 1e-5, f"clip_grad_norm_ {float(norm)} vs single process {rnorm} (rel {r:.2e})"
    opt.step()
    return grads


def compare_params(m, ref, what):
    worst = 0.0
    for (name, p), q in zip(m.named_parameters(), ref.m.parameters()):
        r = rel(full(p.detach()), q.detach())
        assert r <= TOL, f"{what}: {name} differs from the uninterrupted single-process run by {r:.2e}"
        worst = max(worst, r)
    return worst


def fsdp_model(mesh, seed=0):
    return shard_model(net(seed), mesh=mesh, block_types=[nn.Linear])


def ddp_model(seed=0):
    from torch.nn.parallel import DistributedDataParallel as DDP

    return DDP(net(seed))


def check_loaded(m, opt, saved, what):
    """Every state tensor equals the saved consolidated one, bitwise, dtype kept."""
    fqns = gckpt.param_fqns(m)
    sstate = saved["optim"]["state"]
    smodel = saved["model"]
    cb = opt.codebook
    assert cb is not None and float(cb[0]) == -1.0, f"{what}: no learned codebook after load"
    n_q = 0
    for g in opt.param_groups:
        for p in g["params"]:
            fqn = fqns[id(p)]
            st, sv = opt.state[p], sstate[fqn]
            assert set(st) == set(sv), (what, fqn, sorted(st), sorted(sv))
            assert torch.equal(full(p.detach()), smodel[fqn]), f"{what}: model param {fqn} differs"
            for k, v in sv.items():
                if isinstance(v, torch.Tensor):
                    got = full(st[k])
                    assert got.dtype == v.dtype, f"{what}: {fqn}.{k} dtype {got.dtype} != saved {v.dtype}"
                    assert got.shape == v.shape, f"{what}: {fqn}.{k} shape {tuple(got.shape)} != {tuple(v.shape)}"
                    assert torch.equal(got, v), f"{what}: {fqn}.{k} differs from the saved state"
                    replicated = ("codebook", "v_col", "step") + (("scale", "v_blk") if "v_blk" in st else ())
                    if k not in replicated and hasattr(p, "placements"):  # plain, replicated
                        assert st[k].placements == p.placements, (what, fqn, k, st[k].placements)
                else:
                    assert st[k] == v, f"{what}: {fqn}.{k} = {st[k]!r}, saved {v!r}"
            if "idx" in st:
                n_q += 1
                assert st["idx"].dtype == torch.uint8
                assert st["codebook"] is cb, f"{what}: {fqn} does not reference the shared codebook"
                assert st["learned"] == 1 and st["step"] == SAVE_STEPS, (what, fqn, st["learned"], st["step"])
    assert n_q == 7, f"{what}: expected 7 quantized tensors, found {n_q}"
    qkv = [p for g in opt.param_groups for p in g["params"] if fqns[id(p)].endswith("qkv")]
    if qkv and "v_col" in opt.state[qkv[0]]:  # its three row blocks (D12) survive the reshard
        assert tuple(opt.state[qkv[0]]["v_col"].shape) == (3, 40), (what, opt.state[qkv[0]]["v_col"].shape)
    colb = [p for g in opt.param_groups for p in g["params"] if fqns[id(p)].endswith("colb")]
    if colb:  # its four column blocks (D21) survive the reshard: v_row [33, 4] in all, sharded by rows
        vr = opt.state[colb[0]]["v_row"]
        assert tuple(getattr(vr, "shape")) == (33, 4), (what, tuple(vr.shape))
    assert opt.state_bytes() > 0


def resume_and_compare(m, opt, rank, ws, what, saved, grads_file):
    check_loaded(m, opt, saved, what)
    ref = replayed_reference(grads_file, SAVE_STEPS)  # the saving run's first steps, uninterrupted
    train_step(m, opt, SAVE_STEPS, rank, ws, ref)
    worst = compare_params(m, ref, what)
    log(f"OK {what}: state equal to saved (uint8 idx, shared codebook), resumed step vs uninterrupted "
        f"max rel {worst:.2e}")


# ----------------------------------------------------------------------------- modes
def train_and_save(m, opt, out, name, rank, ws, extra=None):
    ref = Reference()
    grads = [train_step(m, opt, s, rank, ws, ref) for s in range(SAVE_STEPS)]
    w = compare_params(m, ref, f"{name} train")
    gckpt.save(m, opt, os.path.join(out, name), extra=extra)
    fsd = gckpt.full_state_dict(m, opt)
    if rank == 0:
        st = fsd["optim"]["state"]["a.weight"]
        assert st["idx"].dtype == torch.uint8 and st["idx"].shape == (33, 128), (st["idx"].dtype, st["idx"].shape)
        assert not hasattr(st["scale"], "placements") and "a.weight" in fsd["model"], sorted(fsd["model"])
        torch.save(fsd, os.path.join(out, f"{name}_full.pt"))
        torch.save(grads, os.path.join(out, f"{name}_grads.pt"))
    else:
        assert fsd == {}, "full_state_dict: non-zero ranks should get {}"
    log(f"OK save {name} ws={ws}: clip norms and params match single process (rel {w:.2e}); sharded + full saved")


def mode_save(out, rank, ws):
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (ws,))
    m = fsdp_model(mesh)
    train_and_save(m, make_opt(m), out, "fsdp", rank, ws,
                   extra={"step": SAVE_STEPS, "tag": "fsdp"})
    dm = ddp_model()
    train_and_save(dm, make_opt(dm), out, "ddp", rank, ws)

    # before the first step, with raw DCP: get_optimizer_state_dict runs DCP's zero-grad init step
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    pm = fsdp_model(mesh)
    popt = make_opt(pm)
    osd = get_optimizer_state_dict(pm, popt)
    st = osd["state"]["a.weight"]
    assert st["learned"] == 0 and float(st["codebook"][0]) != -1.0, "zero-grad init step learned a codebook"
    assert popt.codebook is None
    dcp.save({"model": get_model_state_dict(pm), "optim": osd}, checkpoint_id=os.path.join(out, "prestep"))
    log("OK save pre-step (DCP zero-grad init): placeholders, learned=0, no codebook")


def load_fsdp(out, mesh, rank, ws, saved, what, src="fsdp"):
    m = fsdp_model(mesh, seed=123)  # different init: the load must overwrite everything
    opt = make_opt(m)
    extra = gckpt.load(m, opt, os.path.join(out, src))
    if src == "fsdp":
        assert extra == {"step": SAVE_STEPS, "tag": "fsdp"}, extra
    names = opt.param_groups[0]["param_names"]
    assert "a.weight" in names and not any(n.startswith("module.") for n in names), names
    resume_and_compare(m, opt, rank, ws, what, saved, os.path.join(out, f"{src}_grads.pt"))


def load_plain(out, mesh, rank, ws, saved, grads_file):
    """The generic flow of torchtitan / Accelerate / Lightning, nothing from gefen_dist.checkpoint:
    a fresh optimizer's get_state_dict (DCP's zero-grad init step allocates placeholders), dcp.load
    in place, set_state_dict. Works because the factored state's shapes depend on the global shape
    only (D14): ``tiny`` (3 x 2048) detected period 1024 before D14, and this load then failed."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    m = fsdp_model(mesh, seed=123)
    opt = make_opt(m)
    msd, osd = get_state_dict(m, opt)
    sd = {"model": msd, "optim": osd}
    dcp.load(sd, checkpoint_id=os.path.join(out, "fsdp"))
    set_state_dict(m, opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
    assert opt.state[m.tiny]["period"] == 2048, opt.state[m.tiny]["period"]
    resume_and_compare(m, opt, rank, ws, f"plain get_state_dict/dcp.load/set_state_dict ws=2 -> fsdp2 ws={ws}",
                       saved, grads_file)


def mode_load(out, rank, ws):
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (ws,))
    fsdp_saved = torch.load(os.path.join(out, "fsdp_full.pt"), weights_only=False)
    fsdp_grads = os.path.join(out, "fsdp_grads.pt")

    load_fsdp(out, mesh, rank, ws, fsdp_saved, f"fsdp2 ws=2 -> fsdp2 ws={ws}")
    load_plain(out, mesh, rank, ws, fsdp_saved, fsdp_grads)

    if ws == 1:
        dm = ddp_model(seed=123)
        dopt = make_opt(dm)
        gckpt.load(dm, dopt, os.path.join(out, "fsdp"))
        assert not hasattr(dopt.state[dm.module.a.weight]["idx"], "placements")
        resume_and_compare(dm, dopt, rank, ws, f"fsdp2 ws=2 -> ddp ws={ws}", fsdp_saved, fsdp_grads)

    if ws == 3:
        ddp_saved = torch.load(os.path.join(out, "ddp_full.pt"), weights_only=False)
        load_fsdp(out, mesh, rank, ws, ddp_saved, f"ddp ws=2 -> fsdp2 ws={ws}", src="ddp")

        m = fsdp_model(mesh, seed=123)
        opt = make_opt(m)
        gckpt.load_full_state_dict(m, opt, fsdp_saved if rank == 0 else None)
        resume_and_compare(m, opt, rank, ws, f"full state dict (rank 0, broadcast) -> fsdp2 ws={ws}",
                           fsdp_saved, fsdp_grads)

        m = fsdp_model(mesh, seed=123)
        opt = make_opt(m)
        gckpt.load(m, opt, os.path.join(out, "prestep"))
        for p, st in opt.state.items():
            if "idx" in st:
                assert st["learned"] == 0, "pre-step checkpoint should load placeholders"
        assert opt.codebook is None
        fresh = Reference()
        train_step(m, opt, 0, rank, ws, fresh)
        cb = opt.codebook
        assert cb is not None and cb.numel() == 256 and torch.unique(cb).numel() == 256, cb
        assert float(cb[0]) == -1.0 and float(cb[-1]) == 1.0
        for p, st in opt.state.items():
            if "idx" in st:
                assert st["learned"] == 1 and st["codebook"] is cb
        assert torch.equal(cb, fresh.opt.codebook), "codebook after a pre-step load differs from a fresh run's"
        log(f"OK pre-step checkpoint -> fsdp2 ws={ws}: first real step learned a 256-value codebook "
            "(same as a fresh run)")

        # shard_model with bf16 mixed precision: sharded params, grads and Gefen state stay fp32
        m = shard_model(net(), mesh=mesh, block_types=[nn.Linear], mp_policy="bf16")
        opt = make_opt(m)
        for s in range(2):
            train_step(m, opt, s, rank, ws)
        for p in m.parameters():
            assert p.dtype == torch.float32 and p.grad.dtype == torch.float32 and torch.isfinite(full(p)).all()
        st = opt.state[m.a.weight]
        assert st["idx"].dtype == torch.uint8 and st["scale"].dtype == torch.float32 and st["learned"] == 1
        assert torch.unique(opt.codebook).numel() == 256
        log(f"OK shard_model mp_policy=bf16 ws={ws}: 2 steps, fp32 params/grads/state, codebook learned")

    if ws == 4:
        hmesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
        load_fsdp(out, hmesh, rank, ws, fsdp_saved, "fsdp2 ws=2 -> hsdp 2x2")
        # clip_grad_norm_ under HSDP (replicas not double-counted), also the inf norm
        m = fsdp_model(hmesh)
        r = net()
        x, y = batch(0)
        n = G // ws
        loss_fn(m, x[rank * n:(rank + 1) * n], y[rank * n:(rank + 1) * n]).backward()
        loss_fn(r, x, y).backward()
        ninf = clip_grad_norm_(m, 1e9, norm_type=float("inf"))
        rinf = torch.nn.utils.clip_grad_norm_(r.parameters(), 1e9, norm_type=float("inf"))
        assert rel(ninf, rinf) <= 1e-6, (float(ninf), float(rinf))
        n2 = clip_grad_norm_(m, 0.1)
        r2 = torch.nn.utils.clip_grad_norm_(r.parameters(), 0.1)
        assert rel(n2, r2) <= 1e-5, (float(n2), float(r2))
        for p, q in zip(m.parameters(), r.parameters()):
            assert rel(full(p.grad), q.grad) <= 1e-5, "clipped grads differ"
        log(f"OK clip_grad_norm_ hsdp 2x2: norm {float(n2):.6f} vs single process {float(r2):.6f}, inf norm ok")


def main():
    mode, out = sys.argv[1], sys.argv[2]
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    torch.set_num_threads(1)
    rank, ws = dist.get_rank(), dist.get_world_size()
    t0 = time.time()
    {"save": mode_save, "load": mode_load}[mode](out, rank, ws)
    dist.barrier()
    log(f"ALL OK {mode} ws={ws} ({time.time() - t0:.1f}s)")
    leave()


if __name__ == "__main__":
    main()
