"""torchrun worker: Gefen under DistributedDataParallel (plain tensors, 2 ranks).

    torchrun --nproc_per_node 2 tests/dist/ddp_check.py [--mismatch] [--adamw-import] [--nibbles] [--col-blocks]
    torchrun --nnodes 2 --node_rank K --nproc_per_node 1 --master_addr 127.0.0.1 --master_port P \
        tests/dist/ddp_check.py                                  (K = 0, 1: two "nodes")

Different data per rank, 5 steps. Checks: replicas bitwise identical (params, idx, scale, v,
exact moments, codebook, ints); equal to single-process Gefen on the global batch (<= 1e-6
relative; the gradients DDP delivers are first checked against the global-batch ones, <= 1e-5,
then fed to the reference, so that reduction-order noise cannot flip a rounding decision).
Rank 0 prints ``DIGEST <sha256>`` of the final params and state: one node with 2 ranks and two
nodes with 1 rank each must print the same digest.
``--mismatch``: afterwards rank 1 builds Gefen (a) over the model plus one extra parameter and
(b) with one parameter of a different shape; each must raise a clear RuntimeError on every rank
within the process group's 30 s timeout.
``--adamw-import``: an AdamW trained under DDP warm-starts Gefen on every rank (identical replicas).
``--nibbles`` / ``--col-blocks``: second_moment="nibbles" (D20) / column blocks (D21) under DDP, bitwise a
single process stepped with the same gradients.
"""
import argparse
import hashlib
import os
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist
from _teardown import leave
from torch import nn

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.dirname(os.path.dirname(HERE))]
from dcp_reshard import (LR, TOL, WD, Reference, full, local_batch, loss_fn, make_opt,  # noqa: E402
                         net, rel, train_step)

from gefen_dist import Gefen  # noqa: E402

STEPS = 5


def log(*a):
    if dist.get_rank() == 0:
        print(*a, flush=True)


def digest(model, opt):
    h = hashlib.sha256()
    for name, p in model.named_parameters():
        h.update(name.encode())
        h.update(full(p.detach()).contiguous().view(torch.uint8).numpy().tobytes())
        st = opt.state[p]
        for k in sorted(st):
            v = st[k]
            h.update(k.encode())
            if isinstance(v, torch.Tensor):
                h.update(str(v.dtype).encode())
                h.update(full(v).contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
            else:
                h.update(repr(v).encode())
    return h.hexdigest()


def run_ddp(rank, ws):
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = DDP(net())
    opt = make_opt(model)
    ref = Reference()
    for s in range(STEPS):
        # different data per rank; clip_grad_norm_ checked against the single-process norm; the
        # reference checks DDP's gradients against the global-batch ones, then steps with them
        train_step(model, opt, s, rank, ws, ref)
    worst = 0.0
    for (name, p), q in zip(model.module.named_parameters(), ref.m.parameters()):
        r = rel(p.detach(), q.detach())
        assert r <= TOL, f"ddp: {name} differs from single-process Gefen by {r:.2e}"
        worst = max(worst, r)
        st, rs = opt.state[p], ref.opt.state[q]
        for k, v in rs.items():
            if isinstance(v, torch.Tensor):
                assert st[k].dtype == v.dtype and torch.equal(st[k], v), f"ddp: state {name}.{k} differs"
            else:
                assert st[k] == v, (name, k, st[k], v)
    assert torch.equal(opt.codebook, ref.opt.codebook) and torch.unique(opt.codebook).numel() == 256
    from gefen_dist.kernels import cpu_multi
    batch = getattr(opt, "_cuda_batch", None)  # the native multi-tensor CPU step takes DDP's replicas too
    assert not cpu_multi.available() or (batch is not None and batch.native_cpu and not batch.sharded), batch
    d = digest(model.module, opt)
    ds = [None] * ws
    dist.all_gather_object(ds, d)
    assert len(set(ds)) == 1, f"ddp replicas differ: {ds}"
    log(f"OK ddp ws={ws}: {STEPS} steps, replicas bitwise identical (params, idx, scale, v, codebook), "
        f"single-process max rel {worst:.2e}; native CPU batch {batch is not None}")
    log(f"DIGEST {d}")


def run_mismatch(rank, ws):
    from torch.nn.parallel import DistributedDataParallel as DDP

    for case in ("extra parameter", "different shape"):
        model = DDP(net())
        params = list(model.parameters())
        if rank == 1:
            if case == "extra parameter":
                extra = nn.Parameter(torch.randn(64, 128))
                extra.grad = torch.randn(64, 128)
                params.append(extra)
            else:
                k = next(i for i, p in enumerate(params) if p.ndim == 2 and p.numel() >= 4096)
                shape = tuple(params[k].shape)
                params[k] = nn.Parameter(torch.randn(shape[::-1]))
        opt = Gefen(params, lr=LR)
        x, y = local_batch(0, rank, ws)
        loss_fn(model, x, y).backward()
        if rank == 1 and case == "different shape":
            params[k].grad = torch.randn_like(params[k])
        t0 = time.time()
        try:
            opt.step()
        except RuntimeError as e:
            msg = str(e)
            assert "gefen_dist" in msg and "ranks disagree" in msg, f"unclear error for {case}: {msg}"
            dt = time.time() - t0
            assert dt < 30, f"{case}: error took {dt:.1f}s"
            print(f"OK mismatch ({case}) rank {rank}: RuntimeError after {dt:.2f}s: {msg[:100]}...", flush=True)
        else:
            raise AssertionError(f"mismatch ({case}) was not detected on rank {rank}")
        dist.barrier()


def run_adamw_import(rank, ws):
    """An AdamW trained under DDP, its state dict loaded into Gefen on every rank (the warm start of
    gefen_dist/optim/adamw_import.py enters no collective for plain tensors): the replicas' states are
    identical, learned, at AdamW's step, and stay identical through two more DDP steps."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = DDP(net())
    opt = make_opt(model)  # (its param groups, for AdamW too)
    adamw = torch.optim.AdamW([{k: g[k] for k in ("params", "lr", "betas", "eps", "weight_decay")}
                               for g in opt.param_groups])
    for s in range(3):
        x, y = local_batch(s, rank, ws)
        adamw.zero_grad()
        loss_fn(model, x, y).backward()
        adamw.step()
    opt.load_state_dict(adamw.state_dict())
    del adamw
    quantized = [st for st in opt.state.values() if "idx" in st]
    assert quantized and all(st["learned"] == 1 and int(st["step"]) == 3 for st in quantized)
    for s in range(3, 5):
        x, y = local_batch(s, rank, ws)
        opt.zero_grad()
        loss_fn(model, x, y).backward()
        opt.step()
    d = digest(model.module, opt)
    ds = [None] * ws
    dist.all_gather_object(ds, d)
    assert len(set(ds)) == 1, f"adamw import: ddp replicas differ: {ds}"
    log(f"OK adamw import ws={ws}: {len(quantized)} quantized tensors warm-started, replicas bitwise identical "
        "after 2 more steps")


def _col_block_groups(m):
    """``tiny`` (3 rows of 2048) in a group of its own with ``col_blocks=4`` (D21), the rest as they are."""
    return [{"params": [m.tiny], "col_blocks": 4}, {"params": [p for p in m.parameters() if p is not m.tiny]}]


def run_nibbles(rank, ws, col_blocks=False):
    """second_moment="nibbles" (D20) under DDP: a single-process Gefen stepped with DDP's (all-reduced)
    gradients ends bitwise where every replica ends (parameters, codes, scales, statistics), the
    codebook has 16 codewords, and the replicas' digests agree. ``col_blocks``: the same for the default
    with ``tiny`` in column blocks (D21), stepped beside the multi-tensor batch."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    from gefen_dist.engine.comm import LocalComm

    model, ref = DDP(net()), net()
    tag, kw = ("col_blocks", {}) if col_blocks else ("nibbles", dict(second_moment="nibbles"))
    opt = Gefen(_col_block_groups(model.module) if col_blocks else model.parameters(), lr=LR, weight_decay=WD, **kw)
    ropt = Gefen(_col_block_groups(ref) if col_blocks else ref.parameters(), lr=LR, weight_decay=WD, **kw)
    ropt._comm = LocalComm()
    for s in range(4):
        x, y = local_batch(s, rank, ws)
        opt.zero_grad()
        loss_fn(model, x, y).backward()
        for p, q in zip(model.module.parameters(), ref.parameters()):
            q.grad = p.grad.clone()
        opt.step()
        ropt.step()
    quantized = 0
    for (name, p), q in zip(model.module.named_parameters(), ref.parameters()):
        assert torch.equal(p.detach(), q.detach()), f"{tag} ddp: {name} differs from single process"
        for k, v in ropt.state[q].items():
            assert torch.equal(opt.state[p][k], v) if isinstance(v, torch.Tensor) else opt.state[p][k] == v, (name, k)
        quantized += "idx" in opt.state[p]
    assert quantized and opt.codebook.numel() == (256 if col_blocks else 16) and torch.equal(opt.codebook, ropt.codebook)
    if col_blocks:
        assert tuple(opt.state[model.module.tiny]["v_row"].shape) == (3, 4)
    ds = [None] * ws
    dist.all_gather_object(ds, digest(model.module, opt))
    assert len(set(ds)) == 1, f"{tag}: ddp replicas differ: {ds}"
    log(f"OK {tag} ddp ws={ws}: 4 steps, {quantized} quantized tensors, replicas and single process bitwise")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--mismatch", action="store_true")
    ap.add_argument("--adamw-import", action="store_true")
    ap.add_argument("--nibbles", action="store_true")
    ap.add_argument("--col-blocks", action="store_true")
    args = ap.parse_args()
    dist.init_process_group("gloo", timeout=timedelta(seconds=30))
    torch.set_num_threads(1)
    rank, ws = dist.get_rank(), dist.get_world_size()
    run_ddp(rank, ws)
    if args.adamw_import:
        run_adamw_import(rank, ws)
    if args.nibbles:
        run_nibbles(rank, ws)
    if args.col_blocks:
        run_nibbles(rank, ws, col_blocks=True)
    if args.mismatch:
        run_mismatch(rank, ws)
    dist.barrier()
    log(f"ALL OK ddp_check ws={ws}")
    leave()  # a plain destroy_process_group() aborted in gloo teardown after ALL OK once in CI


if __name__ == "__main__":
    main()
