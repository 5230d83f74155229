"""DeepSpeed worker: Gefen under ZeRO-2 + fp16 dynamic loss scaling, overflow steps skipped (CPU, 2 ranks).

Run: DS_ACCELERATOR=cpu deepspeed --num_gpus 2 tests/dist/ds_fp16.py [--cases shared,factored]

DeepSpeed's CPU accelerator reports fp16 as supported only when oneDNN has a native fp16 path
(``torch.ops.mkldnn._is_mkldnn_fp16_supported()``: AVX512-FP16 / AMX-FP16 CPUs); elsewhere
``DeepSpeedEngine._do_sanity_check`` refuses ``"fp16": {"enabled": true}`` with "Type fp16 is not
supported on your device." That is a speed gate, not a correctness one: torch computes fp16
Linear/tanh forward and backward on any CPU. This worker therefore patches
``CPU_Accelerator.is_fp16_supported`` to return True in its own process (nothing else is patched;
DeepSpeed's fp16 ZeRO-2 path, loss scaler and overflow check run unmodified) and then checks, per
case (shared / factored second moment):

1. an overflow at the very first step (the loss times 1e30 on every rank: fp16 gradients are inf)
   is skipped before Gefen has stepped: no state, no codebook, ``Gefen.step`` not called;
2. normal steps learn Gefen's state (uint8 ``idx``, periods, codebook);
3. an overflow on one rank only (inf put into one gradient element on rank 1, in a tensor that
   rank 0 holds; later NaN on rank 0 in a tensor that rank 1 holds) is skipped on both ranks:
   ``engine.skipped_steps`` +1, the loss scale halves (hysteresis 1), ``Gefen.step`` is not
   called, and Gefen's state (idx, scale, v or v_row/v_col, step count, codebook), the fp32
   master partition, the fp16 weights and the lr are bitwise unchanged on every rank; the next
   normal step proceeds (step count +1, weights move);
4. the same run without the overflow steps (same batches for the real steps) ends with bitwise
   identical fp32 master weights, fp16 weights and Gefen state, although its loss scale stayed at
   2^15 while this run's fell to 2^12. Why bitwise and not only close: the scales are powers of
   two, and multiplying by / dividing out a power of two commutes with every fp16/fp32 rounding
   on the way (fp16 backward, DeepSpeed's fp16 pre-division by the world size and reduction, the
   fp32 norm and clip factor) as long as values stay in the normal range, so Gefen receives the
   same fp32 gradients. A few fp16 gradient elements are subnormal (the smallest nonzero one is
   printed) where this argument does not hold; here they change no bit. The scale must not grow
   during the run (WINDOW below): DeepSpeed 0.19.8 unscales a growth step's gradients with the
   already doubled scale, which makes two runs with different growth steps genuinely differ.

Prints "OK fp16-<case> ..." per case on rank 0 and "ALL OK" at the end; any failure raises.
"""
import argparse
import copy
import os
import sys

import torch
import torch.distributed as dist

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(os.path.dirname(HERE)), HERE]
import deepspeed  # noqa: E402
from deepspeed.accelerator import get_accelerator  # noqa: E402

import gefen_dist.integrations.deepspeed as gds  # noqa: E402  (registers "Gefen")
from _teardown import leave  # noqa: E402
from ds_check import MB, Net, data, groups, load_cfg  # noqa: E402

INIT_POW = 15      # initial loss scale 2^15; three halvings bring this run to 2^12
# No growth of the scale within the run: in DeepSpeed 0.19.8 ZeRO-1/2 (stage_1_and_2.py, step()) call
# _update_scale() before unscale_and_clip_grads(), so on a step where the dynamic scale doubles the gradients
# are divided by the doubled scale (halved, unless clipping binds): the run without overflows, whose scale
# would grow at other steps than this one's, would then legitimately differ. See docs/deepspeed.md.
WINDOW = 1000
# Steps of the run with overflows. ("real", k): a normal step on batch k; ("scale", _): loss * 1e30 on
# every rank; ("inf", r, name) / ("nan", r, name): one element of name's gradient set to inf / NaN on rank r.
PLAN = [("scale",), ("real", 0), ("real", 1), ("real", 2), ("inf", 1, "d.weight"), ("real", 3),
        ("nan", 0, "c.bias"), ("real", 4), ("real", 5)]
REAL = [s[1] for s in PLAN if s[0] == "real"]


def log(*a):
    if dist.get_rank() == 0:
        print(*a, flush=True)


def enable_cpu_fp16():
    """Let DeepSpeed's CPU accelerator accept fp16 (see the module docstring). Returns what it said before."""
    acc = get_accelerator()
    assert type(acc).__name__ == "CPU_Accelerator", f"this worker is for DS_ACCELERATOR=cpu, got {type(acc).__name__}"
    native = bool(acc.is_fp16_supported())
    type(acc).is_fp16_supported = lambda self: True
    assert torch.float16 in acc.supported_dtypes()
    return native


def make_engine(second_moment):
    cfg = load_cfg("gefen_zero2.json", fp16={"enabled": True, "initial_scale_power": INIT_POW,
                                              "loss_scale_window": WINDOW, "hysteresis": 1, "min_loss_scale": 1},
                   **{"optimizer.params.second_moment": second_moment})
    cfg.pop("bf16", None)
    torch.manual_seed(0)
    m = Net()
    engine, *_ = deepspeed.initialize(model=m, model_parameters=groups(m), config=cfg)
    assert engine.fp16_enabled() and next(engine.module.parameters()).dtype == torch.float16
    opt = engine.basic_optimizer
    assert isinstance(opt, gds.Gefen), type(opt)
    calls = [0]
    inner = opt.step

    def counted(*a, **k):
        calls[0] += 1
        return inner(*a, **k)

    opt.step = counted  # DeepSpeed's ZeRO-2 wrapper calls basic_optimizer.step() once per param group
    return engine, calls


def run_step(engine, step, min_abs):
    rank, ws = dist.get_rank(), dist.get_world_size()
    k = step[1] if step[0] == "real" else 900
    x, y = data(k, MB * ws)
    x, y = x[rank * MB:(rank + 1) * MB].half(), y[rank * MB:(rank + 1) * MB].half()
    handles = []
    params = dict(engine.module.named_parameters())
    if step[0] in ("inf", "nan") and rank == step[1]:
        bad = float(step[0])

        def poison(g, bad=bad):
            g = g.clone()
            g.view(-1)[-1] = bad
            return g

        handles.append(params[step[2]].register_hook(poison))
    if step[0] == "real":  # smallest nonzero |fp16 gradient| reaching DeepSpeed (subnormals break exactness)
        for p in params.values():
            handles.append(p.register_hook(lambda g: min_abs.append(float(g[g != 0].abs().min()))))
    loss = ((engine(x) - y).float() ** 2).mean()
    if step[0] == "scale":
        loss = loss * 1e30  # finite in fp32, inf once the scaled gradient reaches the fp16 output
    engine.backward(loss)
    for h in handles:
        h.remove()
    engine.step()
    return float(loss.detach())


def masters(engine):
    return [t.detach().clone() for t in engine.optimizer.single_partition_of_fp32_groups]


def weights(engine):
    return {n: p.detach().clone() for n, p in engine.module.named_parameters()}


def gefen_state(opt):
    out = []
    for st in opt.state.values():
        out.append({k: (v.detach().clone() if torch.is_tensor(v) else copy.deepcopy(v)) for k, v in st.items()
                    if k != "segments"})
    return out


def same(what, a, b):
    """Bitwise equality of nested lists/dicts of tensors (dtype included) and plain values."""
    if torch.is_tensor(a):
        assert torch.is_tensor(b) and a.dtype == b.dtype and a.shape == b.shape, what
        assert torch.equal(a, b), (what, float((a.double() - b.double()).abs().max()))
    elif isinstance(a, dict):
        assert set(a) == set(b), (what, sorted(set(a) ^ set(b)))
        for k in a:
            same(f"{what}.{k}", a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), (what, len(a), len(b))
        for i, (x, y) in enumerate(zip(a, b)):
            same(f"{what}[{i}]", x, y)
    else:
        assert a == b, (what, a, b)


def snapshot(engine):
    opt = engine.basic_optimizer
    return dict(state=gefen_state(opt), masters=masters(engine), weights=weights(engine),
                lr=[g["lr"] for g in opt.param_groups],
                codebook=None if opt.codebook is None else opt.codebook.clone())


def case(second_moment):
    rank = dist.get_rank()
    factored = second_moment == "factored"
    name = f"fp16-{second_moment}"
    engine, calls = make_engine(second_moment)
    opt = engine.basic_optimizer
    min_abs, skips, scales, moved = [], [], [], 0
    for i, step in enumerate(PLAN):
        before = snapshot(engine)
        scale0, skipped0, calls0 = engine.optimizer.loss_scale, engine.skipped_steps, calls[0]
        run_step(engine, step, min_abs)
        scales.append(engine.optimizer.loss_scale)
        if step[0] != "real":  # the overflow step: skipped everywhere, nothing of Gefen's touched
            assert engine.skipped_steps == skipped0 + 1, (name, i, step, engine.skipped_steps)
            assert engine.optimizer.loss_scale == scale0 / 2, (name, i, scale0, engine.optimizer.loss_scale)
            assert calls[0] == calls0, (name, i, "Gefen.step was called on an overflow step")
            if step[0] in ("inf", "nan"):  # the bad element lands in the other rank's partition only
                holder = 1 - step[1]
                held = step[2] in opt.periods()
                assert held == (rank == holder), (name, step, rank, sorted(opt.periods()))
            after = snapshot(engine)
            same(f"{name} step {i} {step[0]}", before, after)
            if i == 0:
                assert not opt.state and opt.codebook is None, (name, "state created by a skipped first step")
            skips.append(f"{step[0]}@{i}")
        else:
            assert engine.skipped_steps == skipped0, (name, i, "a normal step was skipped", scale0)
            assert calls[0] == calls0 + len(opt.param_groups), (name, i, calls[0], calls0)
            steps = {int(st["step"]) for st in opt.state.values()}
            assert steps == {REAL.index(step[1]) + 1}, (name, i, steps)
            if max(before["lr"]) > 0:  # (WarmupLR starts at lr 0)
                moved += 1
                assert not any(torch.equal(a, b) for a, b in zip(masters(engine), before["masters"])), \
                    (name, i, "the fp32 master weights did not move")
            if step[1] == 0:  # the first real step learns the state
                assert opt.codebook is not None and opt.codebook.numel() == 256
                per = opt.periods()
                assert per and any(v > 0 for v in per.values()), (name, per)
                for st in opt.state.values():
                    assert st["idx"].dtype == torch.uint8, st["idx"].dtype
                    assert ("v_col" in st) == factored and ("v" in st) == (not factored), (name, sorted(st))
    # every rank did the checks above; collect what each saw
    seen = [None] * dist.get_world_size()
    dist.all_gather_object(seen, (sorted(opt.periods().items()), engine.skipped_steps, len(opt.state)))
    assert all(s[1] == 3 for s in seen), seen
    assert moved >= len(REAL) - 2, moved  # WarmupLR: lr 0 for the first two steps
    got = snapshot(engine)
    final_scale = engine.optimizer.loss_scale
    del engine, opt

    # the reference: the same real steps (same batches), no overflow at all
    ref, _ = make_engine(second_moment)
    for k in REAL:
        run_step(ref, ("real", k), min_abs)
    assert ref.skipped_steps == 0, ref.skipped_steps
    ref_scale = ref.optimizer.loss_scale
    assert ref_scale != final_scale, (ref_scale, final_scale)
    same(f"{name} vs the run without overflows", got, snapshot(ref))
    pers = sorted({v for s in seen for _, v in s[0]})
    log(f"OK {name}: overflows {', '.join(skips)} skipped on both ranks (skipped_steps 3, loss scale "
        f"{2 ** INIT_POW} -> {' -> '.join(str(int(s)) for s in scales)}), Gefen.step never called for them, "
        f"state/fp32 masters/fp16 weights/lr bitwise unchanged on every rank; uint8 idx, periods {pers}, "
        f"{'v_row/v_col' if factored else 'v'}; {len(REAL)} real steps bitwise equal to the run without overflows "
        f"(its scale ended at {int(ref_scale)}, this one at {int(final_scale)}; smallest nonzero |fp16 param grad| "
        f"{min(min_abs):.1e}, fp16 normal >= {torch.finfo(torch.float16).tiny:.1e})")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", default="shared,factored")
    ap.add_argument("--local_rank", type=int, default=0)
    args = ap.parse_args()
    deepspeed.init_distributed(dist_backend="gloo")
    torch.set_num_threads(1)
    native = enable_cpu_fp16()
    log(f"CPU accelerator reported fp16 support: {native} (oneDNN native fp16); patched to True for this test")
    for c in args.cases.split(","):
        if c not in ("shared", "factored"):
            raise SystemExit(f"unknown case {c}")
        case(c)
    dist.barrier()
    log("ALL OK")
    leave()  # gloo's teardown race (tests/dist/_teardown.py)


if __name__ == "__main__":
    main()
