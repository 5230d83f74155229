"""torchrun worker: a non-finite gradient on one rank only, and what Gefen says it steps (2 ranks, gloo).

    torchrun --nproc_per_node 2 tests/dist/replica_faults.py

Plain replicas: the same model on both ranks, gradients all-reduced by the caller (no DDP), then
one element of one gradient set to NaN on rank 1 only (a rank-local corruption after the
all-reduce). Checks, each within the process group's 30 s timeout:

* ``nonfinite="raise"`` at the first step (before periods and the codebook are learned, where
  the healthy rank would otherwise enter the learning collectives alone) and after learning:
  both ranks raise the same RuntimeError, nothing changes on either, and the next clean step
  runs on both (the collectives stay paired);
* ``nonfinite="skip"``: both ranks skip the same step, and after 6 steps the replicas are
  bitwise identical;
* the same raise under ``ZeroGefen``;
* a DCP checkpoint and a full state dict saved with ``second_moment="shared"`` loaded into the
  factored default: every rank raises ``CheckpointMismatchError``;
* the INFO line logged once at the first completed step names the backend: replicas, FSDP2,
  ZeroGefen.

Rank 0 prints one ``OK <what>`` line per check and ``ALL OK replica_faults`` at the end.
"""
import hashlib
import logging
import os
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist
from _teardown import leave
from torch import nn

sys.path[:0] = [os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))]
from gefen_dist import Gefen, ZeroGefen  # noqa: E402

RANK = WS = 0


def log(*a):
    if RANK == 0:
        print(*a, flush=True)


def net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(96, 64), nn.Tanh(), nn.Linear(64, 80))  # 6144 and 5120: quantized


def grads(model, step, bad_step=None):
    """Same data on every rank; the caller's all-reduce; then NaN on rank 1 at ``bad_step``."""
    g = torch.Generator().manual_seed(100 + step)
    x = torch.randn(8, 96, generator=g)
    model.zero_grad()
    model(x).pow(2).mean().backward()
    for p in model.parameters():
        dist.all_reduce(p.grad)
        p.grad /= WS
    if step == bad_step and RANK == 1:
        model[2].weight.grad[3, 5] = float("nan")


def digest(model, opt, state=True):
    """Of the parameters and (``state``) this rank's optimizer state."""
    h = hashlib.sha256()
    for p in model.parameters():
        h.update(p.detach().contiguous().view(torch.uint8).numpy().tobytes())
        for k, v in sorted(opt.state.get(p, {}).items() if state else ()):
            h.update(k.encode())
            h.update(v.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes() if isinstance(v, torch.Tensor)
                     else repr(v).encode())
    return h.hexdigest()


def same_on_all(x, what):
    xs = [None] * WS
    dist.all_gather_object(xs, x)
    assert len(set(xs)) == 1, f"{what}: ranks differ: {xs}"


def expect_raise(model, opt, what):
    before = digest(model, opt)
    t0 = time.time()
    try:
        opt.step()
    except RuntimeError as e:
        msg = str(e)
    else:
        raise AssertionError(f"{what}: rank {RANK} stepped instead of raising")
    dt = time.time() - t0
    assert "non-finite gradient" in msg and "'2.weight'" in msg and f"of the {WS} ranks" in msg, msg
    assert dt < 30, f"{what}: took {dt:.1f}s"
    assert digest(model, opt) == before, f"{what}: rank {RANK} changed its state"
    same_on_all(msg, f"{what} error message")
    return msg, dt


def case_raise(cls, bad_step, what):
    model = net()
    opt = cls(model.named_parameters(), lr=1e-2, nonfinite="raise")
    for s in range(bad_step):
        grads(model, s)
        opt.step()
    grads(model, bad_step, bad_step)
    msg, dt = expect_raise(model, opt, what)
    grads(model, bad_step + 1)
    opt.step()  # the next clean step: the collectives are still paired
    # ZeroGefen's state is partitioned (differs by design): compare the parameters there
    same_on_all(digest(model, opt, state=cls is Gefen), f"{what}: replicas after the next clean step")
    log(f"OK {what}: every rank raised after {dt:.2f}s, nothing changed, the next step ran: {msg[:90]}...")


def case_skip():
    model = net()
    opt = Gefen(model.named_parameters(), lr=1e-2, nonfinite="skip")
    for s in range(6):
        grads(model, s, bad_step=2)
        opt.step()
    assert opt.skipped_steps == 1, opt.skipped_steps
    same_on_all(digest(model, opt), "skip: replicas")
    log("OK skip: both ranks skipped step 2 (skipped_steps=1) and stayed bitwise identical over 6 steps")


def case_checkpoint_mismatch():
    """A DCP checkpoint and a full state dict saved with second_moment="shared", loaded into the
    default factored Gefen: every rank raises CheckpointMismatchError (no DCP CheckpointException,
    no rank left waiting), and the matching options load."""
    import shutil
    import tempfile

    from gefen_dist import checkpoint as gckpt

    box = [tempfile.mkdtemp(prefix="gefen_rf_") if RANK == 0 else None]
    dist.broadcast_object_list(box)
    path = os.path.join(box[0], "ck")
    model = net()
    opt = Gefen(model.named_parameters(), lr=1e-2, second_moment="shared")
    for s in range(2):
        grads(model, s)
        opt.step()
    gckpt.save(model, opt, path)
    full = gckpt.full_state_dict(model, opt)
    for how in ("load", "load_full_state_dict"):
        m2 = net()
        o2 = Gefen(m2.named_parameters(), lr=1e-2)
        try:
            if how == "load":
                gckpt.load(m2, o2, path)
            else:
                gckpt.load_full_state_dict(m2, o2, full if RANK == 0 else None)
        except gckpt.CheckpointMismatchError as e:
            msg = str(e)
        else:
            raise AssertionError(f"{how}: rank {RANK} loaded a checkpoint saved with second_moment='shared'")
        assert "'optim.state.2.weight.v'" in msg or "'optim.state.0.weight.v'" in msg, msg
        assert "second_moment='shared'" in msg and not o2.state, msg
        same_on_all(msg, f"{how}: the error")
    m2 = net()
    o2 = Gefen(m2.named_parameters(), lr=1e-2, second_moment="shared")
    gckpt.load(m2, o2, path)
    same_on_all(digest(m2, o2), "matching load")
    assert digest(m2, o2) == digest(model, opt)
    dist.barrier()
    if RANK == 0:
        shutil.rmtree(box[0], ignore_errors=True)
    log(f"OK checkpoint mismatch: load and load_full_state_dict raise on every rank: {msg[:100]}...")


class Capture(logging.Handler):
    def __init__(self):
        super().__init__(logging.INFO)
        self.lines = []

    def emit(self, record):
        if "is stepping" in record.getMessage():
            self.lines.append(record.getMessage())


def case_announce():
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    cap = Capture()
    lg = logging.getLogger("gefen_dist.optim.gefen")
    lg.addHandler(cap)
    lg.setLevel(logging.INFO)
    want = {"replicas": "backend: replicas over 2 ranks", "ZeroGefen": "backend: ZeroGefen (ZeRO-1",
            "FSDP2": "backend: FSDP2 (DTensor shards over 2 ranks)"}
    for kind, expected in want.items():
        cap.lines.clear()
        model = net()
        if kind == "FSDP2":
            fully_shard(model, mesh=init_device_mesh("cpu", (WS,)))
        opt = (ZeroGefen if kind == "ZeroGefen" else Gefen)(model.parameters(), lr=1e-2)
        for s in range(2):
            model.zero_grad()
            model(torch.randn(4, 96)).pow(2).mean().backward()
            if kind != "FSDP2":
                for p in model.parameters():
                    dist.all_reduce(p.grad)
            opt.step()
        if RANK == 0:
            assert len(cap.lines) == 1 and expected in cap.lines[0], (kind, cap.lines)
            assert "4 tensors (2 quantized" in cap.lines[0], cap.lines
            log(f"OK announce {kind}: {cap.lines[0]}")
        else:
            assert not cap.lines, cap.lines  # rank 0 of the group only
        dist.barrier()
    lg.removeHandler(cap)


def main():
    global RANK, WS
    dist.init_process_group("gloo", timeout=timedelta(seconds=30))
    torch.set_num_threads(1)
    RANK, WS = dist.get_rank(), dist.get_world_size()
    case_raise(Gefen, 0, "raise at the first step (before learning)")
    case_raise(Gefen, 3, "raise after learning")
    case_raise(ZeroGefen, 2, "ZeroGefen raise")
    case_skip()
    case_checkpoint_mismatch()
    case_announce()
    dist.barrier()
    log(f"ALL OK replica_faults ws={WS}")
    leave()


if __name__ == "__main__":
    main()
