"""torchrun worker: Gefen through torchtitan's CheckpointManager (torchtitan 0.3.0), FSDP2 on gloo.

    torchrun --nproc_per_node 2 tests/dist/titan_ckpt.py save DIR
    torchrun --nproc_per_node 1 tests/dist/titan_ckpt.py load DIR

Gefen goes into torchtitan the way its ``OptimizersContainer`` docstring says a user adds an
optimizer: a subclass that resolves the name ``"Gefen"`` (and adds no ``fused``/``foreach`` to the
param groups: Gefen's ``fused`` is optimizer-wide). torchtitan saves and loads the optimizer with
its own flat, FQN-keyed state dict (``Gefen.state_dict()`` flattened, ``init_optim_state``'s
zero-grad, zero-lr step on a fresh optimizer, then ``Gefen.load_state_dict``) through DCP.

``save`` (2 ranks): ``SAVE`` steps of a 3-layer MLP (weight rows of 2560, 64 and 192 elements;
the 2560 row has factored period 1280), ``CheckpointManager.save(SAVE)``, then the next step.
Rank 0 writes the full parameters and Gefen state at the save, the next step's full reduced
gradients, and the state after it.

``load`` (1 rank): fresh model (other seed), container and manager on the same folder;
``CheckpointManager.load()`` finds ``step-SAVE``; parameters and every Gefen state tensor equal
the saved full ones bitwise (dtype kept), ints equal, one shared codebook; then the next step,
with the 2-rank reduced gradients (checked against the computed ones, <= 1e-5 relative), is
compared with the uninterrupted 2-rank run. Prints ``OK ...`` and ``ALL OK``.
"""
import os
import sys

import torch
import torch.distributed as dist
from _teardown import leave
from torch import nn

sys.path[:0] = [os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))]
from gefen_dist import Gefen  # noqa: E402
from gefen_dist.integrations.fsdp import shard_model  # noqa: E402

from torchtitan.components.checkpoint import CheckpointManager  # noqa: E402
from torchtitan.components.optimizer import OptimizersContainer  # noqa: E402
from torchtitan.components.optimizer.lr_scheduler import LRSchedulersContainer  # noqa: E402
from torchtitan.components.optimizer.optimizer import ParamGroupConfig  # noqa: E402

G, SAVE, D_IN, TOL = 8, 3, 2560, 1e-6


class GefenOptimizers(OptimizersContainer):
    @staticmethod
    def _resolve_optimizer_factory(name):
        return Gefen if name == "Gefen" else OptimizersContainer._resolve_optimizer_factory(name)

    @staticmethod
    def _build_impl_kwargs(config):
        return {}


def net(seed):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(D_IN, 64), nn.ReLU(), nn.Linear(64, 192), nn.ReLU(), nn.Linear(192, 10))


def batch(k, rank, ws):
    g = torch.Generator().manual_seed(100 + k)
    x, y = torch.randn(G, D_IN, generator=g), torch.randint(0, 10, (G,), generator=g)
    n = G // ws
    return x[rank * n:(rank + 1) * n], y[rank * n:(rank + 1) * n]


def full(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


def setup(out, seed):
    from torch.distributed.device_mesh import init_device_mesh

    ws = dist.get_world_size()
    m = shard_model(net(seed), mesh=init_device_mesh("cpu", (ws,)), block_types=[nn.Linear])
    cfg = OptimizersContainer.Config(param_groups=[ParamGroupConfig(
        pattern=r".*", optimizer_name="Gefen", optimizer_kwargs={"lr": 3e-3, "weight_decay": 0.1})])
    opts = GefenOptimizers(cfg, model_parts=[m])
    assert len(opts.optimizers) == 1 and type(opts.optimizers[0]) is Gefen, opts.optimizers
    sched = LRSchedulersContainer(opts, lambda s: 1.0)
    ck = CheckpointManager(CheckpointManager.Config(enable=True, folder="ckpt", interval=SAVE, keep_latest_k=0),
                           dataloader=None, model_parts=[m], optimizers=opts, lr_schedulers=sched, states={},
                           sd_adapter=None, base_folder=out)
    return m, opts, ck


def names(m):
    return {id(p): n for n, p in m.named_parameters()}


def snapshot(m, gopt):
    nm = names(m)
    st = {nm[id(p)]: {k: (full(v).clone() if torch.is_tensor(v) else v) for k, v in gopt.state[p].items()}
          for g in gopt.param_groups for p in g["params"]}
    return {n: full(p.detach()).clone() for n, p in m.named_parameters()}, st


def step(m, opts, k, grads=None):
    rank, ws = dist.get_rank(), dist.get_world_size()
    x, y = batch(k, rank, ws)
    opts.zero_grad()
    nn.functional.cross_entropy(m(x), y).backward()
    nm, out, worst = names(m), {}, 0.0
    for p in m.parameters():
        g = full(p.grad).clone()
        out[nm[id(p)]] = g
        if grads is not None:
            r = rel(g, grads[nm[id(p)]])
            assert r <= 1e-5, f"{nm[id(p)]}: 1-rank gradient differs from the 2-rank one by {r:.2e}"
            worst = max(worst, r)
            p.grad.to_local().copy_(grads[nm[id(p)]])
    opts.step()
    return out, worst


def log(*a):
    if dist.get_rank() == 0:
        print(*a, flush=True)


def mode_save(out):
    m, opts, ck = setup(out, 0)
    gopt = opts.optimizers[0]
    for k in range(SAVE):
        step(m, opts, k)
    assert ck.save(SAVE), "CheckpointManager.save did not save"
    at_save = snapshot(m, gopt)
    grads, _ = step(m, opts, SAVE)
    after = snapshot(m, gopt)
    st = at_save[1]["0.weight"]
    assert st["period"] == 1280 and st["idx"].dtype == torch.uint8, {k: v for k, v in st.items() if not torch.is_tensor(v)}
    assert os.path.isfile(os.path.join(out, "ckpt", f"step-{SAVE}", ".metadata"))
    if dist.get_rank() == 0:
        torch.save({"at_save": at_save, "grads": grads, "after": after}, os.path.join(out, "ref.pt"))
    per = sorted((tuple(at_save[0][n].shape), s["period"]) for n, s in at_save[1].items() if "period" in s)
    log(f"OK torchtitan save ws=2: CheckpointManager.save({SAVE}) (DCP step-{SAVE}/); (shape, period): {per}")
    dist.barrier()
    log("ALL OK")
    ck.close() if hasattr(ck, "close") else None
    leave()


def mode_load(out):
    m, opts, ck = setup(out, 123)
    gopt = opts.optimizers[0]
    ref = torch.load(os.path.join(out, "ref.pt"), weights_only=False)
    assert ck.load(), "CheckpointManager.load found no checkpoint"
    params, st = snapshot(m, gopt)
    sp, ss = ref["at_save"]
    assert params.keys() == sp.keys() and st.keys() == ss.keys(), (sorted(st), sorted(ss))
    for n in sp:
        assert torch.equal(params[n], sp[n]), f"param {n} differs after CheckpointManager.load"
    cb, nq = gopt.codebook, 0
    assert cb is not None and cb.numel() == 256, "no learned codebook after load"
    for n, sv in ss.items():
        assert st[n].keys() == sv.keys(), (n, sorted(st[n]), sorted(sv))
        for k, v in sv.items():
            if torch.is_tensor(v):
                assert st[n][k].dtype == v.dtype and st[n][k].shape == v.shape, (n, k, st[n][k].dtype, v.dtype)
                assert torch.equal(st[n][k], v), f"{n}.{k} differs from the saved state"
            else:
                assert st[n][k] == v, f"{n}.{k}: {st[n][k]!r} vs saved {v!r}"
        nq += "idx" in sv
    shared = {id(s["codebook"]) for s in gopt.state.values() if "codebook" in s}
    assert shared == {id(cb)}, f"{len(shared)} codebook objects after load"
    log(f"OK torchtitan CheckpointManager ws=2 -> ws=1: {len(ss)} Gefen states bitwise equal to the saved full "
        f"tensors ({nq} uint8 idx, 2560-element rows period 1280), parameters equal, one shared codebook")

    _, gworst = step(m, opts, SAVE, grads=ref["grads"])
    params, st = snapshot(m, gopt)
    ap, ast = ref["after"]
    pworst, ndiff = 0.0, 0
    for n in ap:
        r = rel(params[n], ap[n])
        assert r <= TOL, f"{n}: resumed step differs from the uninterrupted run by {r:.2e}"
        pworst, ndiff = max(pworst, r), ndiff + (not torch.equal(params[n], ap[n]))
    for n, sv in ast.items():
        for k, v in sv.items():
            if torch.is_tensor(v):
                ndiff += not (st[n][k].dtype == v.dtype and torch.equal(st[n][k], v))
            else:
                assert st[n][k] == v, (n, k, st[n][k], v)
    how = "bitwise equal" if ndiff == 0 else f"{ndiff} tensors not bitwise equal"
    log(f"OK torchtitan resumed step {SAVE + 1} at ws=1 vs uninterrupted ws=2: {how}; params max rel {pworst:.2e} "
        f"(grads vs 2-rank max rel {gworst:.2e})")
    log("ALL OK")
    leave()


if __name__ == "__main__":
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    {"save": mode_save, "load": mode_load}[sys.argv[1]](sys.argv[2])
