"""Cost of Gefen's first step (period detection + codebook histogram) on the GPT-2-small tensor
set (124,439,808 parameters), CPU, native kernels vs the numpy/torch fallback.

    python benchmarks/first_step.py [--rounds 2] [--steps 4] [--no-fallback] [--no-e2e]

Gradients: synthetic, row-structured (``randn * 1e-3 * row_scale``, a log-normal scale per
row; the same generator as ``benchmarks/step_speed.py``), float32.

Timed, interleaved in one process (round r runs each variant once), minimum over rounds, wall
time and process CPU time (all threads; robust against other load on a shared machine):

* ``periods_native``: :func:`gefen_dist.kernels.dispatch.grad_period_partials` per tensor (``l``
  computed on the fly), combined and selected;
* ``periods_native_via_log_sq``: ``period_partials(log_sq(g))`` with both native (the call the
  optimizer makes today, which materialises ``l``: 8 B/element);
* ``periods_fallback``: ``period_partials_eager(log_sq_eager(g))`` (numpy/torch);
* ``hist_native`` / ``hist_fallback``: :func:`block_histogram` / ``block_histogram_eager`` over
  the quantized tensors with their scale blocks;
* ``Gefen(...).step()``: the first step (learns periods and the codebook) vs the median of the
  next ``--steps`` ordinary steps (fused CPU kernel), with the optimizer's own split
  (``codebook_info``: seconds_periods / seconds_hist / seconds_dp).

Checks: identical periods and bitwise-equal histograms native vs fallback. Writes
``docs/results/first_step.json``.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from _docs import run_meta  # noqa: E402
from _gpt2 import GPT2_PARAMS, gpt2_shapes  # noqa: E402,F401
from gefen_dist.core import periods as P  # noqa: E402
from gefen_dist.core.quant import NUM_BINS, block_histogram_eager  # noqa: E402
from gefen_dist.kernels import dispatch as D  # noqa: E402
from gefen_dist.kernels import first_step as F  # noqa: E402





def make_grads(seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    out = []
    for name, shape in gpt2_shapes():
        rows = shape[0] if len(shape) == 2 else 1
        row_scale = torch.exp(0.5 * torch.randn(rows, 1, generator=gen))
        g = (torch.randn(shape, generator=gen).view(rows, -1) * 1e-3 * row_scale).view(shape)
        out.append((name, g.contiguous()))
    return out


def periods_of(grads, mode: str):
    out = []
    for _, g in grads:
        n = g.numel()
        cands = P.candidate_periods(n)
        if len(cands) < 3:
            out.append(1)
            continue
        flat = g.reshape(-1)
        if mode == "native":
            part = D.grad_period_partials(flat, 0, n, cands)
        elif mode == "native_via_log_sq":
            part = D.period_partials(D.log_sq(flat), 0, n, cands)
        else:
            part = P.period_partials_eager(P.log_sq_eager(flat), 0, n, cands)
        p = P.select_paper_period(cands, P.combine_partials([part], n))
        out.append(P.resolve_period(p, P.row_slab(g.shape)))
    return out


def hist_of(grads, blocks, native: bool):
    counts = torch.zeros(NUM_BINS, dtype=torch.int64)
    fn = D.block_histogram if native else block_histogram_eager
    for (_, g), b in zip(grads, blocks):
        if b:
            fn(g, b, out=counts)
    return counts


def timed(fn):
    c0, w0 = time.process_time(), time.perf_counter()
    res = fn()
    return res, time.perf_counter() - w0, time.process_time() - c0


def e2e(grads, steps: int):
    from gefen_dist import Gefen

    params = []
    for _, g in grads:
        p = torch.nn.Parameter(torch.randn(g.shape) * 0.02)
        p.grad = g.clone()
        params.append(p)
    opt = Gefen(params, lr=6e-4, betas=(0.9, 0.95), weight_decay=0.1)
    _, w_first, c_first = timed(opt.step)
    info = dict(getattr(opt, "codebook_info", None) or {})
    walls, cpus = [], []
    for _ in range(steps):
        _, w, c = timed(opt.step)
        walls.append(w)
        cpus.append(c)
    ordinary = statistics.median(walls)
    return dict(
        first_step_s=w_first, first_step_cpu_s=c_first,
        ordinary_step_s=ordinary, ordinary_step_min_s=min(walls), ordinary_step_cpu_s=statistics.median(cpus),
        first_over_ordinary=w_first / ordinary,
        first_minus_3_ordinary_s=w_first - 3 * ordinary,
        target_met=w_first < 3 * ordinary + 0.5,
        optimizer_split={k: info.get(k) for k in ("seconds_periods", "seconds_hist", "seconds_dp")},
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--steps", type=int, default=4, help="ordinary steps timed after the first")
    ap.add_argument("--no-fallback", action="store_true", help="skip the (slow) fallback timings")
    ap.add_argument("--no-e2e", action="store_true")
    ap.add_argument("--out", default=str(ROOT / "docs" / "results" / "first_step.json"))
    args = ap.parse_args()

    if not F.available():
        sys.exit("native first-step library unavailable (compiler? GEFEN_DIST_NO_NATIVE?)")
    grads = make_grads()
    variants = ["native", "native_via_log_sq"] + ([] if args.no_fallback else ["fallback"])
    per = {}
    times = {f"periods_{v}": [] for v in variants}
    times.update({"hist_native": []} | ({} if args.no_fallback else {"hist_fallback": []}))
    hist = {}
    for r in range(args.rounds):
        for v in variants:
            res, w, c = timed(lambda: periods_of(grads, v))
            per[v] = res
            times[f"periods_{v}"].append((w, c))
        blocks = [P.scale_block_for(p, P.row_slab(g.shape)) if g.dim() >= 2 else 0
                  for (_, g), p in zip(grads, per["native"])]
        for key, nat in (("hist_native", True), ("hist_fallback", False)):
            if key in times:
                res, w, c = timed(lambda: hist_of(grads, blocks, nat))
                hist[key] = res
                times[key].append((w, c))
        print(f"round {r}: " + ", ".join(f"{k} {v[-1][0]:.3f}s" for k, v in times.items()), flush=True)

    same_periods = all(per[v] == per["native"] for v in per)
    same_hist = all(torch.equal(h, hist["hist_native"]) for h in hist.values())
    summary = {k: dict(wall_s=min(w for w, _ in v), cpu_s=min(c for _, c in v)) for k, v in times.items()}
    ratios = {}
    if "periods_fallback" in summary:
        for m in ("wall_s", "cpu_s"):
            ratios[f"periods_fallback_over_native_{m[:-2]}"] = (
                summary["periods_fallback"][m] / summary["periods_native"][m])
            ratios[f"hist_fallback_over_native_{m[:-2]}"] = (
                summary["hist_fallback"][m] / summary["hist_native"][m])
    result = dict(
        tensors=len(grads), values=GPT2_PARAMS, threads=torch.get_num_threads(), loadavg=os.getloadavg(), rounds=args.rounds,
        timings=summary, ratios=ratios, same_periods=same_periods, histograms_bitwise_equal=same_hist,
        periods=sorted(set(per["native"])), **run_meta(),
    )
    print(json.dumps(dict(timings=summary, ratios=ratios, same_periods=same_periods,
                          histograms_bitwise_equal=same_hist), indent=1))
    if not args.no_e2e:
        result["gefen_step"] = e2e(grads, args.steps)
        print(json.dumps(result["gefen_step"], indent=1))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {out}")
    if not (same_periods and same_hist):
        sys.exit("native and fallback disagree")


if __name__ == "__main__":
    main()
