"""Accelerate FSDP2 ``save_state`` at 2 ranks, ``load_state`` at 1 rank (another world size).

    accelerate launch --config_file integrations/accelerate/cpu_fsdp2.yaml tests/dist/accel_resume.py save OUT
    accelerate launch --config_file integrations/accelerate/cpu_fsdp2.yaml --num_processes 1 \
        tests/dist/accel_resume.py load OUT

The model is the tiny GPT-2 of hf_common with ``n_inner=2560``: rows of 64 (wte, c_proj), 192
(c_attn) and 2560 (c_fc) elements; c_fc's row is above 1024, so its factored period is capped to
its smallest divisor above 1024 (1280, shorter than the row; docs/algorithm.md D14).

``save`` (2 ranks): plain Gefen from ``GefenFactory``, prepared with the model; ``SAVE`` steps on
explicit per-rank halves of each global batch, ``accelerator.save_state`` (SHARDED_STATE_DICT: the
optimizer goes to DCP, ``optimizer_0/``), then the next step uninterrupted. Rank 0 writes the full
(``full_tensor``) parameters and Gefen state at the save, the full reduced gradients of the next
step, and the full parameters and state after it.

``load`` (1 rank, FSDP2 on a 1-rank mesh): a fresh model (other seed) and optimizer,
``accelerator.load_state`` (checked to go through ``accelerate.utils.fsdp_utils.load_fsdp_optimizer``
with DCP), then: every Gefen state tensor and parameter equals the saved full one bitwise (dtype
kept), ints equal, one shared codebook; then the next step on the whole global batch. Its gradient
is checked against the 2-rank reduced one (<= 1e-5 relative: reduction order only) and replaced by
it (a ulp of reduction-order noise can flip one uint8 rounding and says nothing about the
optimizer, as in dcp_reshard.py); the parameters and state after the step are compared with the
uninterrupted 2-rank run (bitwise where they are; parameters within 1e-6 relative in any case).
Prints ``OK ...`` lines and ``ALL OK``.
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _teardown import leave  # noqa: E402
from hf_common import Tokens, check, rank0_print, tiny_gpt2  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from accelerate import Accelerator  # noqa: E402
from accelerate.state import PartialState  # noqa: E402
from accelerate.utils import DistributedType, InitProcessGroupKwargs  # noqa: E402

from gefen_dist import Gefen  # noqa: E402
from gefen_dist.integrations.hf import GefenFactory, gefen_optimizer_cls_and_kwargs  # noqa: E402

SAVE, MB = 3, 4  # steps before save_state; micro batch per rank at 2 ranks (global batch 2 * MB)
N_INNER = 2560  # c_fc rows of 2560 elements: period 1280
TOL = 1e-6


def make_accelerator(ws):
    """As tests/dist/accel_train.py::make_accelerator, at world size ``ws`` (1 included: the
    launcher still runs torchrun, and the gloo group is made here so that FSDP2 and DCP have one)."""
    if not dist.is_initialized():
        dist.init_process_group("gloo")
    st = PartialState(backend="gloo")
    check(st.num_processes == ws and st.device.type == "cpu", (st.num_processes, st.device))
    if not torch.cuda.is_available():
        PartialState._shared_state["distributed_type"] = DistributedType.MULTI_GPU
    return Accelerator(kwargs_handlers=[InitProcessGroupKwargs(backend="gloo")])


def full(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


def build(acc, seed):
    model = tiny_gpt2(seed, n_inner=N_INNER)
    factory, kw = gefen_optimizer_cls_and_kwargs(None, lr=3e-3, betas=(0.9, 0.95), weight_decay=0.1)
    check(factory is GefenFactory, factory)
    opt = factory()(model, **kw)
    model, opt = acc.prepare(model, opt)
    check(acc.is_fsdp2 and acc.distributed_type == DistributedType.FSDP, (acc.is_fsdp2, acc.distributed_type))
    from torch.distributed.tensor import DTensor

    check(all(isinstance(p, DTensor) and p.device_mesh.size() == acc.num_processes for p in model.parameters()),
          "the parameters are not FSDP2 DTensors on the world mesh")
    gopt = opt.optimizer
    check(type(gopt) is Gefen, type(gopt))
    return model, opt, gopt


def global_batch(k):
    x = Tokens().x[k * 2 * MB:(k + 1) * 2 * MB]
    return {"input_ids": x, "labels": x}


def local_batch(k, rank, ws):
    b = global_batch(k)
    n = 2 * MB // ws
    return {key: v[rank * n:(rank + 1) * n] for key, v in b.items()}


def names(model):
    return {id(p): n for n, p in model.named_parameters()}


def full_state(model, gopt):
    """``{name: {key: full tensor or value}}`` of Gefen's state, and ``{name: full param}``."""
    nm = names(model)
    st = {}
    for g in gopt.param_groups:
        for p in g["params"]:
            st[nm[id(p)]] = {k: (full(v).clone() if torch.is_tensor(v) else v) for k, v in gopt.state[p].items()}
    check(len(st) == len(gopt.state), "state keyed by tensors not in the param groups")
    params = {n: full(p.detach()).clone() for n, p in model.named_parameters()}
    return params, st


def step(acc, model, opt, k, rank, ws, grads=None):
    """One step; returns the full reduced gradients. With ``grads`` (the 2-rank ones) the computed
    gradients are checked against them and replaced by them before ``opt.step()``."""
    loss = model(**local_batch(k, rank, ws)).loss
    acc.backward(loss)
    nm = names(model)
    out, worst = {}, 0.0
    for p in model.parameters():
        g = full(p.grad).clone()
        out[nm[id(p)]] = g
        if grads is not None:
            r = rel(g, grads[nm[id(p)]])
            check(r <= 1e-5, f"{nm[id(p)]}: 1-rank gradient differs from the 2-rank one by {r:.2e}")
            worst = max(worst, r)
            local = p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad
            check(local.shape == grads[nm[id(p)]].shape, "1-rank grad is not the full tensor")
            local.copy_(grads[nm[id(p)]])
    opt.step()
    opt.zero_grad()
    return out, worst


def mode_save(out):
    acc = make_accelerator(2)
    rank, ws = acc.process_index, acc.num_processes
    model, opt, gopt = build(acc, 0)
    for k in range(SAVE):
        step(acc, model, opt, k, rank, ws)
    ck = os.path.join(out, "state")
    acc.save_state(ck)
    at_save = full_state(model, gopt)
    grads, _ = step(acc, model, opt, SAVE, rank, ws)
    after = full_state(model, gopt)
    step(acc, model, opt, SAVE + 1, rank, ws)
    after2 = full_state(model, gopt)
    check(os.path.isfile(os.path.join(ck, "optimizer_0", ".metadata")), os.listdir(ck))
    st = at_save[1]["transformer.h.0.mlp.c_fc.weight"]
    check(st["period"] == 1280 and "idx" in st and st["idx"].dtype == torch.uint8, {k: v for k, v in st.items()
                                                                                 if not torch.is_tensor(v)})
    if rank == 0:
        torch.save({"at_save": at_save, "grads": grads, "after": after, "after2": after2}, os.path.join(out, "ref.pt"))
    periods = sorted({(tuple(at_save[0][n].shape), s["period"]) for n, s in at_save[1].items() if "period" in s})
    rank0_print(f"OK save ws=2: {SAVE} steps, accelerator.save_state (optimizer_0/ is DCP), then steps {SAVE + 1}-{SAVE + 2} "
                f"uninterrupted; (shape, period): {periods}")
    acc.wait_for_everyone()
    rank0_print("ALL OK")
    leave()


def spied_load_state(acc, ck):
    """``acc.load_state(ck)``, checked to load the optimizer through
    ``accelerate.utils.fsdp_utils.load_fsdp_optimizer`` with DCP (SHARDED_STATE_DICT)."""
    import accelerate.accelerator as acc_mod
    import accelerate.utils.fsdp_utils as fsdp_utils

    real = fsdp_utils.load_fsdp_optimizer
    check(acc_mod.load_fsdp_optimizer is real, "Accelerator.load_state does not call fsdp_utils.load_fsdp_optimizer")
    calls = []

    def spy(*a, **kw):
        calls.append(kw.get("use_dcp", True))
        return real(*a, **kw)

    acc_mod.load_fsdp_optimizer = spy
    try:
        acc.load_state(ck)
    finally:
        acc_mod.load_fsdp_optimizer = real
    check(calls == [True], f"load_fsdp_optimizer calls (use_dcp): {calls}")
    check(acc.state.fsdp_plugin.state_dict_type.name == "SHARDED_STATE_DICT", acc.state.fsdp_plugin.state_dict_type)


def check_loaded(model, gopt, saved, what):
    """The loaded parameters and Gefen state equal ``saved`` (full tensors) bitwise; returns the
    number of uint8 ``idx`` states."""
    params, st = full_state(model, gopt)
    sp, ss = saved
    check(params.keys() == sp.keys() and st.keys() == ss.keys(), (what, sorted(st), sorted(ss)))
    for n in sp:
        check(torch.equal(params[n], sp[n]), f"{what}: param {n} differs")
    nq = 0
    cb = gopt.codebook
    check(cb is not None and cb.numel() == 256, f"{what}: no learned codebook")
    for n, sv in ss.items():
        check(st[n].keys() == sv.keys(), (what, n, sorted(st[n]), sorted(sv)))
        for k, v in sv.items():
            if torch.is_tensor(v):
                check(st[n][k].dtype == v.dtype and st[n][k].shape == v.shape, (what, n, k, st[n][k].dtype, v.dtype))
                check(torch.equal(st[n][k], v), f"{what}: {n}.{k} differs from the saved state")
            else:
                check(st[n][k] == v, f"{what}: {n}.{k}: {st[n][k]!r} vs saved {v!r}")
        if "idx" in sv:
            nq += 1
            check(sv["idx"].dtype == torch.uint8, sv["idx"].dtype)
    p_fc = dict(model.named_parameters())["transformer.h.0.mlp.c_fc.weight"]
    check(gopt.state[p_fc]["period"] == 1280 and tuple(p_fc.shape) == (64, N_INNER), gopt.state[p_fc]["period"])
    shared = {id(gopt.state[p]["codebook"]) for p in gopt.state if "codebook" in gopt.state[p]}
    check(shared == {id(cb)}, f"{what}: {len(shared)} codebook objects")
    return nq


def compare_after(model, gopt, want):
    """Parameters within TOL relative of ``want``'s; returns (how, max rel) with how "bitwise equal"
    or a count of what is not."""
    params, st = full_state(model, gopt)
    ap, ast = want
    pworst, n_pdiff = 0.0, 0
    for n in ap:
        r = rel(params[n], ap[n])
        check(r <= TOL, f"{n}: resumed step differs from the uninterrupted run by {r:.2e}")
        pworst, n_pdiff = max(pworst, r), n_pdiff + (not torch.equal(params[n], ap[n]))
    n_sdiff, n_stensors = 0, 0
    for n, sv in ast.items():
        for k, v in sv.items():
            if torch.is_tensor(v):
                n_stensors += 1
                n_sdiff += not (st[n][k].dtype == v.dtype and torch.equal(st[n][k], v))
            else:
                check(st[n][k] == v, f"{n}.{k}: {st[n][k]!r} vs {v!r} after the resumed step")
    how = "bitwise equal" if n_pdiff == 0 and n_sdiff == 0 else \
        f"{n_pdiff} params / {n_sdiff} of {n_stensors} state tensors not bitwise equal"
    return how, pworst


def mode_load(out):
    """ws=1: load the 2-rank save_state, check, resumed step SAVE+1 (2-rank gradients), save_state."""
    acc = make_accelerator(1)
    rank, ws = acc.process_index, acc.num_processes
    model, opt, gopt = build(acc, 123)  # other init: the load must overwrite everything
    ref = torch.load(os.path.join(out, "ref.pt"), weights_only=False)
    spied_load_state(acc, os.path.join(out, "state"))
    nq = check_loaded(model, gopt, ref["at_save"], "load_state ws=1")
    rank0_print(f"OK fsdp2 save_state ws=2 -> load_state ws=1 (load_fsdp_optimizer, DCP): {len(ref['at_save'][1])} "
                f"Gefen states bitwise equal to the saved full tensors ({nq} uint8 idx, c_fc row 2560 period 1280), "
                f"parameters equal, one shared codebook")

    _, gworst = step(acc, model, opt, SAVE, rank, ws, grads=ref["grads"])
    how, pworst = compare_after(model, gopt, ref["after"])
    rank0_print(f"OK resumed step {SAVE + 1} at ws=1 vs uninterrupted ws=2: {how}; params max rel {pworst:.2e} "
                f"(grads vs 2-rank max rel {gworst:.2e})")
    acc.save_state(os.path.join(out, "state_ws1"))
    torch.save(full_state(model, gopt), os.path.join(out, "ref_ws1.pt"))
    rank0_print("ALL OK")
    leave()


def mode_load2(out):
    """ws=2: load the 1-rank save_state (after step SAVE+1), check, step SAVE+2 vs uninterrupted."""
    acc = make_accelerator(2)
    rank, ws = acc.process_index, acc.num_processes
    model, opt, gopt = build(acc, 321)
    spied_load_state(acc, os.path.join(out, "state_ws1"))
    ref = torch.load(os.path.join(out, "ref.pt"), weights_only=False)
    nq = check_loaded(model, gopt, torch.load(os.path.join(out, "ref_ws1.pt"), weights_only=False),
                      "load_state ws=2 from ws=1")
    from torch.distributed.tensor import DTensor, Shard

    q = [gopt.state[p]["idx"] for p in gopt.state if "idx" in gopt.state[p]]
    check(all(isinstance(t, DTensor) and t.placements == (Shard(0),) for t in q), "idx not Shard(0) DTensors at ws=2")
    step(acc, model, opt, SAVE + 1, rank, ws)
    how, pworst = compare_after(model, gopt, ref["after2"])
    check(how == "bitwise equal", how)  # same world size and bitwise equal inputs: the same reductions
    rank0_print(f"OK fsdp2 save_state ws=1 -> load_state ws=2: {nq} uint8 idx Shard(0), state bitwise equal to "
                f"the saved one; step {SAVE + 2} {how} to the uninterrupted ws=2 run")
    acc.wait_for_everyone()
    rank0_print("ALL OK")
    leave()


if __name__ == "__main__":
    torch.set_num_threads(1)
    {"save": mode_save, "load": mode_load, "load2": mode_load2}[sys.argv[1]](sys.argv[2])
