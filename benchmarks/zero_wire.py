"""Bytes on the wire per optimizer step: ZeroGefen's compressed all-gather vs an fp32 / bf16
parameter all-gather vs torch's ZeroRedundancyOptimizer(AdamW) (which broadcasts every updated
fp32 parameter from its owner).

    python benchmarks/zero_wire.py [--worlds 2 4 8] [--no-measure] [--out docs/results/zero_wire.json]

1. Analytic, GPT-2-small shapes (124M parameters, tied head): ZeroGefen's bytes are counted with
   the functions the optimizer sizes its buffers with (``gefen_dist.zero.optimizer.partition`` and
   ``step_wire_bytes``: idx bytes + fp32 (M, sigma) per block for quantized tensors with P > 1,
   fp32 values for exact and P == 1 tensors, every segment padded to 8 bytes, every rank's
   chunk padded to the largest). Periods are not learned on this machine for 124M parameters;
   the assumption is stated in the output: every matrix gets its row as period (capped as the
   paper caps, then D1's gcd with the row). Part 2 shows the periods actually learned on a
   smaller model.
2. Measured: one real 2-rank (gloo, CPU) run on a smaller GPT-like model: ZeroGefen's actual
   buffer sizes (``opt.last_wire``, checked against the analytic function), step times of
   ZeroGefen, single-process-style Gefen (every rank the full step) and torch's
   ZeroRedundancyOptimizer(AdamW), and the raw fp32 / bf16 parameter all-gathers.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from torch import nn  # noqa: E402

from _docs import run_meta  # noqa: E402
from gefen_dist.core.periods import PERIOD_CAP, divisors, resolve_period, row_slab, scale_block_for  # noqa: E402
from gefen_dist.engine.layout import is_exact  # noqa: E402
from gefen_dist.zero.optimizer import (MODE_COMPRESSED, MODE_DENSE, partition, step_wire_bytes,  # noqa: E402
                             unit_cost)


def gpt2_small_shapes(vocab=50257, ctx=1024, d=768, layers=12):
    shapes = [("wte", (vocab, d)), ("wpe", (ctx, d))]
    for i in range(layers):
        shapes += [(f"h{i}.ln_1.w", (d,)), (f"h{i}.ln_1.b", (d,)),
                   (f"h{i}.attn.c_attn.w", (3 * d, d)), (f"h{i}.attn.c_attn.b", (3 * d,)),
                   (f"h{i}.attn.c_proj.w", (d, d)), (f"h{i}.attn.c_proj.b", (d,)),
                   (f"h{i}.ln_2.w", (d,)), (f"h{i}.ln_2.b", (d,)),
                   (f"h{i}.mlp.c_fc.w", (4 * d, d)), (f"h{i}.mlp.c_fc.b", (4 * d,)),
                   (f"h{i}.mlp.c_proj.w", (d, 4 * d)), (f"h{i}.mlp.c_proj.b", (d,))]
    return shapes + [("ln_f.w", (d,)), ("ln_f.b", (d,))]


def assumed_period(shape):
    """The row as P_paper, capped like the paper (above 1024: smallest divisor > 1024), then D1."""
    slab = row_slab(shape)
    p = slab if slab <= PERIOD_CAP else next(x for x in divisors(slab) if x > PERIOD_CAP)
    return resolve_period(p, slab)


def zero_layout(shapes_periods, W, itemsize=4, small_threshold=4096):
    """Partition and per-rank step bytes exactly as ZeroGefen computes them."""
    specs, items = [], []
    for shape, P in shapes_periods:
        n = math.prod(shape)
        exact = is_exact(shape, small_threshold)
        B = 1 if exact else scale_block_for(P, row_slab(shape))
        u, c = unit_cost(exact, P if not exact else 1, B)
        specs.append((n, u, c))
    ranges = partition(specs, W)
    for (shape, P), rs in zip(shapes_periods, ranges):
        exact = is_exact(shape, small_threshold)
        mode = MODE_DENSE if exact or P == 1 else MODE_COMPRESSED
        items.append((mode, P, itemsize, rs))
    sizes = step_wire_bytes(items, W)
    state = [0] * W
    for (n, u, c), rs in zip(specs, ranges):
        for r, (s, e) in enumerate(rs):
            state[r] += (e - s) // u * c
    return sizes, state


def torch_zero_partition(numels, W):
    """torch ZeroRedundancyOptimizer: whole tensors, largest first, to the least-loaded rank."""
    sizes = [0] * W
    for n in sorted(numels, reverse=True):
        r = min(range(W), key=lambda i: sizes[i])
        sizes[r] += n
    return sizes


def analytic(shapes, W):
    sp = [(s, assumed_period(s) if not is_exact(s, 4096) else 1) for _, s in shapes]
    N = sum(math.prod(s) for _, s in shapes)
    sizes, state = zero_layout(sp, W)
    chunk = max(sizes)
    zero = {"per_rank_sent": chunk, "gathered": W * chunk, "per_rank_received": (W - 1) * chunk}
    per = -(-N // W)
    fp32 = {"per_rank_sent": 4 * per, "gathered": 4 * per * W, "per_rank_received": 4 * per * (W - 1)}
    bf16 = {"per_rank_sent": 2 * per, "gathered": 2 * per * W, "per_rank_received": 2 * per * (W - 1)}
    tz = torch_zero_partition([math.prod(s) for _, s in shapes], W)
    tzero = {"per_rank_sent": 4 * max(tz), "gathered": 4 * N, "per_rank_received": 4 * (N - min(tz))}
    gstate = [b for b in state]
    return dict(
        world_size=W, params=N,
        assumption="period = row (capped at the paper's cap, gcd with the row): "
                   + ", ".join(sorted({f"{s}->P={p}" for s, p in sp if math.prod(s) >= 4096 and len(s) >= 2})),
        zerogefen=zero, fp32_allgather=fp32, bf16_allgather=bf16, torch_zero_adamw=tzero,
        ratio_fp32_over_zero=fp32["gathered"] / zero["gathered"],
        ratio_bf16_over_zero=bf16["gathered"] / zero["gathered"],
        ratio_torch_zero_over_zero=tzero["gathered"] / zero["gathered"],
        zerogefen_state_bytes_per_rank=gstate,
        torch_zero_adamw_state_bytes_per_rank=[8 * x for x in tz],
    )


# ---------------------------------------------------------------------------------------------
# measured 2-rank run
# ---------------------------------------------------------------------------------------------

class SmallGPT(nn.Module):
    def __init__(self, vocab=4096, d=256, layers=4, ctx=128):
        super().__init__()
        self.wte = nn.Embedding(vocab, d)
        self.wpe = nn.Embedding(ctx, d)
        self.blocks = nn.ModuleList(nn.TransformerEncoderLayer(d, 4, 4 * d, dropout=0.0, batch_first=True,
                                                               norm_first=True) for _ in range(layers))
        self.ln_f = nn.LayerNorm(d)
        self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(ctx), persistent=False)

    def forward(self, x):
        h = self.wte(x) + self.wpe(torch.arange(x.shape[1]))
        for b in self.blocks:
            h = b(h, src_mask=self.mask[: x.shape[1], : x.shape[1]], is_causal=True)
        return self.ln_f(h) @ self.wte.weight.T


def _median_time(fn, n):
    ts = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def _worker(rank, world, init_file, out_file, steps):
    import torch.distributed as dist
    from torch.distributed.optim import ZeroRedundancyOptimizer

    from gefen_dist import Gefen, ZeroGefen
    from gefen_dist.engine.comm import LocalComm

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    torch.manual_seed(0)
    m = SmallGPT()
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, 4096, (4, 128), generator=g)
    y = torch.roll(x, -1, 1)
    nn.functional.cross_entropy(m(x).reshape(-1, 4096), y.reshape(-1)).backward()
    params = [p for p in m.parameters()]
    grads = [p.grad.clone() for p in params]
    snapshot = [p.detach().clone() for p in params]

    def reset():
        with torch.no_grad():
            for p, s, gr in zip(params, snapshot, grads):
                p.copy_(s)
                p.grad = gr.clone()

    res = {}
    reset()
    zo = ZeroGefen(params, lr=1e-4, weight_decay=0.1)
    t0 = time.perf_counter()
    zo.step()  # learns periods + codebook
    res["zerogefen_first_step_s"] = time.perf_counter() - t0
    zo.step()
    dist.barrier()
    res["zerogefen_step_s"] = _median_time(zo.step, steps)
    res["zerogefen_wire"] = dict(zo.last_wire)
    # check the analytic function against the buffers the optimizer sent
    rep = zo.report()
    sp = [(tuple(r["shape"]), r["period"] if r["kind"] == "quantized" else 1) for r in rep]
    sizes, _ = zero_layout(sp, world)
    res["analytic_matches_sent"] = sizes == zo.last_wire["bytes_per_rank"]
    res["periods_learned"] = {str(tuple(r["shape"])): r["period"] for r in rep if r["kind"] == "quantized"}
    res["state_bytes_per_rank"] = zo.state_bytes()
    n_p1 = sum(r["numel"] for r in rep if r["kind"] == "quantized" and r["period"] == 1)
    res["params"] = sum(r["numel"] for r in rep)
    res["quantized_params_with_P1"] = n_p1
    del zo

    reset()
    go = Gefen(params, lr=1e-4, weight_decay=0.1)
    go._comm = LocalComm()
    go.step()
    res["gefen_full_step_s"] = _median_time(go.step, steps)
    del go

    reset()
    tz = ZeroRedundancyOptimizer(params, optimizer_class=torch.optim.AdamW, lr=1e-4, weight_decay=0.1)
    tz.step()
    dist.barrier()
    res["torch_zero_adamw_step_s"] = _median_time(tz.step, steps)
    del tz

    flat = torch.cat([p.detach().reshape(-1) for p in params])
    per = -(-flat.numel() // world)
    for name, dt in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        buf = torch.zeros(per, dtype=dt)
        out = torch.empty(per * world, dtype=dt)
        ag = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        ag(out, buf)
        res[f"{name}_allgather_s"] = _median_time(lambda: ag(out, buf), steps)
        res[f"{name}_allgather_gathered_bytes"] = out.numel() * out.element_size()
    objs = [None] * world
    dist.all_gather_object(objs, res)
    if rank == 0:
        with open(out_file, "w") as f:
            json.dump(objs, f)
    dist.barrier()
    dist.destroy_process_group()


def measured(steps=5):
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as d:
        init, out = os.path.join(d, "init"), os.path.join(d, "out.json")
        mp.spawn(_worker, args=(2, init, out, steps), nprocs=2, join=True)
        with open(out) as f:
            ranks = json.load(f)
    r0 = ranks[0]
    w = r0["zerogefen_wire"]
    keys = ("zerogefen_step_s", "gefen_full_step_s", "torch_zero_adamw_step_s", "fp32_allgather_s",
            "bf16_allgather_s", "zerogefen_first_step_s")
    return dict(
        model="SmallGPT(vocab 4096, d 256, 4 layers, ctx 128, tied head), gloo on CPU, 1 thread per rank",
        world_size=2, params=r0["params"],
        zerogefen_gathered_bytes=w["gathered_bytes"], zerogefen_bytes_per_rank=w["bytes_per_rank"],
        fp32_allgather_gathered_bytes=r0["fp32_allgather_gathered_bytes"],
        bf16_allgather_gathered_bytes=r0["bf16_allgather_gathered_bytes"],
        torch_zero_adamw_broadcast_bytes=4 * r0["params"],
        ratio_fp32_over_zero=r0["fp32_allgather_gathered_bytes"] / w["gathered_bytes"],
        ratio_bf16_over_zero=r0["bf16_allgather_gathered_bytes"] / w["gathered_bytes"],
        analytic_matches_sent=all(r["analytic_matches_sent"] for r in ranks),
        quantized_params_with_P1=r0["quantized_params_with_P1"],
        periods_learned=r0["periods_learned"],
        state_bytes_per_rank=[r["state_bytes_per_rank"] for r in ranks],
        seconds={k: max(r[k] for r in ranks) for k in keys},
    )


def _fmt(n):
    return f"{n / 2**20:9.2f} MiB"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--worlds", type=int, nargs="+", default=[2, 4, 8])
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--no-measure", action="store_true")
    ap.add_argument("--out", default=str(ROOT / "docs" / "results" / "zero_wire.json"))
    args = ap.parse_args()
    shapes = gpt2_small_shapes()
    out = {"command": "python benchmarks/zero_wire.py " + " ".join(sys.argv[1:]), **run_meta(),
           "analytic_gpt2_small": []}
    print("GPT-2-small shapes (124M params), bytes gathered per step (= what every rank holds after the "
          "collective; each rank receives (W-1)/W of it)")
    for W in args.worlds:
        a = analytic(shapes, W)
        out["analytic_gpt2_small"].append(a)
        print(f"  W={W}: ZeroGefen {_fmt(a['zerogefen']['gathered'])} | fp32 all-gather "
              f"{_fmt(a['fp32_allgather']['gathered'])} ({a['ratio_fp32_over_zero']:.2f}x) | bf16 all-gather "
              f"{_fmt(a['bf16_allgather']['gathered'])} ({a['ratio_bf16_over_zero']:.2f}x) | torch ZeRO(AdamW) "
              f"broadcasts {_fmt(a['torch_zero_adamw']['gathered'])} ({a['ratio_torch_zero_over_zero']:.2f}x); "
              f"state/rank ZeroGefen {min(a['zerogefen_state_bytes_per_rank']) / 2**20:.1f}-"
              f"{max(a['zerogefen_state_bytes_per_rank']) / 2**20:.1f} MiB, torch ZeRO(AdamW) "
              f"{min(a['torch_zero_adamw_state_bytes_per_rank']) / 2**20:.1f}-"
              f"{max(a['torch_zero_adamw_state_bytes_per_rank']) / 2**20:.1f} MiB")
    print(f"  assumption: {out['analytic_gpt2_small'][0]['assumption']}")
    if not args.no_measure:
        meas = measured(args.steps)
        out["measured_2rank"] = meas
        s = meas["seconds"]
        print(f"measured, {meas['model']}, {meas['params']:,} params:")
        print(f"  ZeroGefen gathered {meas['zerogefen_gathered_bytes']:,} B vs fp32 {meas['fp32_allgather_gathered_bytes']:,} B "
              f"({meas['ratio_fp32_over_zero']:.2f}x) vs bf16 {meas['bf16_allgather_gathered_bytes']:,} B "
              f"({meas['ratio_bf16_over_zero']:.2f}x) vs torch ZeRO(AdamW) {meas['torch_zero_adamw_broadcast_bytes']:,} B; "
              f"analytic count == sent: {meas['analytic_matches_sent']}; quantized params with P=1: "
              f"{meas['quantized_params_with_P1']:,}")
        print(f"  step time: ZeroGefen {s['zerogefen_step_s'] * 1e3:.1f} ms (first step incl. learning "
              f"{s['zerogefen_first_step_s']:.2f} s), Gefen full step per rank {s['gefen_full_step_s'] * 1e3:.1f} ms, "
              f"torch ZeRO(AdamW) {s['torch_zero_adamw_step_s'] * 1e3:.1f} ms; raw all-gather fp32 "
              f"{s['fp32_allgather_s'] * 1e3:.1f} ms, bf16 {s['bf16_allgather_s'] * 1e3:.1f} ms")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
