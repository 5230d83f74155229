"""Optimizer step time on the GPT-2-small tensor set (124,439,808 parameters), CPU.

    python benchmarks/step_speed.py [--rounds 5] [--eager-rounds 1] [--dtypes fp32,bf16]
                                    [--peers] [--no-e2e]

Tensors: wte 50257x768, wpe 1024x768, 12 blocks of c_attn (2304,768), attn c_proj (768,768),
c_fc (3072,768), mlp c_proj (768,3072), their biases, and the LayerNorm vectors (ln_1, ln_2,
ln_f). Matrices are quantized with period = row length capped the paper's way (a period
> 1024 becomes its smallest divisor > 1024, so 3072 -> 1536), scale block = period; 1-D
tensors take the exact AdamW update (``adamw_step_``). Gradients are synthetic,
``randn * 1e-3 * row_scale`` with a log-normal scale per row, the same tensors for every
method; all methods update the same parameter tensors (each its own state).

Timed per step, interleaved in one process (round r runs every method once, in order), median
over rounds:

* ``gefen_fused``: ``gefen_dist.kernels.cpu.quantized_step_`` over the quantized tensors plus
  ``adamw_step_`` over the 1-D tensors (the whole step);
* ``gefen_eager``: the same with ``quantized_step_eager_`` (only in the first
  ``--eager-rounds`` rounds, default 1: a step takes tens of seconds);
* ``torch_adamw_fused`` / ``torch_adamw_foreach``: ``torch.optim.AdamW(fused=True)`` /
  ``(foreach=True)`` over all tensors;
* ``Gefen_e2e_fused`` / ``Gefen_e2e_eager``: ``gefen_dist.Gefen(...).step()`` end to end
  (one optimizer, ``fused`` toggled between steps; its first step, which learns periods and
  the codebook, is not timed), when ``gefen_dist.Gefen`` is importable;
* peers: the reference ``gefen`` package (CPU path; with ``--peers`` on one transformer
  block only, as it takes ~0.4 us/parameter/step plus a minutes-long first step),
  bitsandbytes and torchao 8-bit AdamW when installed; otherwise listed as skipped.

Reported: the median over rounds (and, as the machine may be shared, the minimum), with
ratios to torch's fused AdamW; plus a load-robust single-thread compute comparison (CPU time
of one 4096x768 tensor step, fused Gefen kernel vs torch fused AdamW). Writes ``docs/results/step_speed.json`` and
``docs/img/step_speed.png``.
"""
from __future__ import annotations

import argparse
import gc
import importlib.util
import json
import logging
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from _gpt2 import GPT2_PARAMS, gpt2_shapes, capped_period  # noqa: E402,F401
from gefen_dist.core.step import adamw_step_, bias_corrections, quantized_step_eager_  # noqa: E402
from gefen_dist.kernels import cpu  # noqa: E402

HP = dict(lr=6e-4, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1)






def demo_codebook() -> torch.Tensor:
    """The optimal codebook of a bell-shaped histogram (what training produces, roughly)."""
    import numpy as np

    from gefen_dist.core.codebook import NUM_BINS, solve_codebook

    c = (np.arange(NUM_BINS) + 0.5) / NUM_BINS * 2 - 1
    counts = np.round(1e6 * np.exp(-0.5 * (c / 0.15) ** 2)).astype(np.int64) + 1
    return solve_codebook(counts).codebook.float()


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


class Bench:
    def __init__(self, dtype: torch.dtype, cb: torch.Tensor, seed: int = 0):
        self.dtype = dtype
        self.cb = cb
        gen = torch.Generator().manual_seed(seed)
        self.names, self.params, self.grads = [], [], []
        for name, shape in gpt2_shapes():
            p = torch.nn.Parameter((torch.randn(shape, generator=gen) * 0.02).to(dtype))
            rows = shape[0] if len(shape) == 2 else 1
            row_scale = torch.exp(0.5 * torch.randn(rows, 1, generator=gen))
            g = (torch.randn(shape, generator=gen).view(rows, -1) * 1e-3 * row_scale).view(shape)
            p.grad = g.to(dtype)
            self.names.append(name)
            self.params.append(p)
        self.quant, self.vec = [], []
        for name, p in zip(self.names, self.params):
            if p.dim() >= 2:
                P = capped_period(p.shape[-1])
                n = p.numel()
                st = dict(idx=torch.full((n,), 127, dtype=torch.uint8), scale=torch.zeros(n // P),
                          v=torch.zeros(n // P), period=P)
                self.quant.append((p, st))
            else:
                self.vec.append((p, torch.zeros(p.shape), torch.zeros(p.shape)))
        self.step_no = 0

    def _hp(self):
        self.step_no += 1
        bc1, bc2 = bias_corrections(self.step_no, HP["beta1"], HP["beta2"])
        return dict(HP, bc1=bc1, bc2=bc2)

    def gefen(self, fused: bool) -> None:
        hp = self._hp()
        fn = cpu.quantized_step_ if fused else quantized_step_eager_
        with torch.no_grad():
            for p, st in self.quant:
                fn(p.view(-1), p.grad.view(-1), st["idx"], st["scale"], st["v"], self.cb,
                   period=st["period"], scale_block=st["period"], **hp)
            for p, m, v in self.vec:
                adamw_step_(p, p.grad, m, v, **hp)


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e3


def peer_status():
    skipped = {}
    for mod, label in (("bitsandbytes", "bitsandbytes AdamW8bit"), ("torchao", "torchao AdamW8bit")):
        if importlib.util.find_spec(mod) is None:
            skipped[label] = "not installed"
    return skipped


def run_dtype(dtype, args, cb, log):
    key = {torch.float32: "fp32", torch.bfloat16: "bf16"}[dtype]
    log(f"\n== {key}: building the GPT-2-small tensor set ==")
    b = Bench(dtype, cb)
    methods = {}
    skipped = {}

    methods["gefen_fused"] = lambda: b.gefen(True)
    if args.eager_rounds > 0:
        methods["gefen_eager"] = lambda: b.gefen(False)
    else:
        skipped["gefen_eager"] = "disabled (--eager-rounds 0)"
    opt_fused = torch.optim.AdamW(b.params, lr=HP["lr"], betas=(HP["beta1"], HP["beta2"]),
                                  eps=HP["eps"], weight_decay=HP["weight_decay"], fused=True)
    opt_foreach = torch.optim.AdamW(b.params, lr=HP["lr"], betas=(HP["beta1"], HP["beta2"]),
                                    eps=HP["eps"], weight_decay=HP["weight_decay"], foreach=True)
    methods["torch_adamw_fused"] = opt_fused.step
    methods["torch_adamw_foreach"] = opt_foreach.step

    gef = None
    if args.e2e:
        try:
            from gefen_dist import Gefen

            named = list(zip(b.names, b.params))
            gef = Gefen(named, lr=HP["lr"], betas=(HP["beta1"], HP["beta2"]), eps=HP["eps"],
                        weight_decay=HP["weight_decay"], fused=True)
            t0 = time.perf_counter()
            gef.step()  # learns periods and the codebook
            log(f"Gefen first step (periods + codebook): {time.perf_counter() - t0:.1f} s")

            def e2e(fused):
                def f():
                    gef.fused = fused
                    gef.step()
                return f

            methods["Gefen_e2e_fused"] = e2e(True)
            if args.eager_rounds > 0:
                methods["Gefen_e2e_eager"] = e2e(False)
        except Exception as e:  # the optimizer is optional here
            skipped["gefen_dist.Gefen end to end"] = f"{type(e).__name__}: {e}"[:200]
    else:
        skipped["gefen_dist.Gefen end to end"] = "disabled (--no-e2e)"

    ref_block = None
    if importlib.util.find_spec("gefen") is None:
        skipped["gefen (reference)"] = "not installed"
    elif not args.peers:
        skipped["gefen (reference)"] = ("installed but not run by default: CPU path ~0.4 us/param/"
                                        "step and a minutes-long first step; use --peers")
    else:
        import contextlib
        import io

        from gefen import Gefen as RefGefen

        blk = [p for n, p in zip(b.names, b.params) if n.startswith("h.0.")]
        ref_params = [torch.nn.Parameter(p.detach().clone()) for p in blk]
        for rp, p in zip(ref_params, blk):
            rp.grad = p.grad.clone()
        with contextlib.redirect_stdout(io.StringIO()):
            ref = RefGefen(ref_params, lr=HP["lr"], betas=(HP["beta1"], HP["beta2"]),
                           eps=HP["eps"], weight_decay=HP["weight_decay"], fused=False)
            t0 = time.perf_counter()
            ref.step()
        log(f"reference gefen first step (block 0 only): {time.perf_counter() - t0:.1f} s")
        ref_block = sum(p.numel() for p in ref_params)

        def ref_step():
            with contextlib.redirect_stdout(io.StringIO()):
                ref.step()
        methods["gefen_reference_block0"] = ref_step
    skipped.update(peer_status())

    eager_like = {"gefen_eager", "Gefen_e2e_eager"}
    # warm-up (not timed): allocations, AdamW state, the codebook table, torch's probes
    for name, fn in methods.items():
        if name not in eager_like:
            fn()
    samples = {k: [] for k in methods}
    for r in range(args.rounds):
        for name, fn in methods.items():
            if name in eager_like and r >= args.eager_rounds:
                continue
            gc.collect()
            samples[name].append(timed(fn))
        log(f"round {r + 1}/{args.rounds}: " + ", ".join(
            f"{k} {v[-1]:.0f}" for k, v in samples.items() if v and len(v) == r + 1) + " ms")
    res = {}
    base = statistics.median(samples["torch_adamw_fused"])
    for name, s in samples.items():
        med = statistics.median(s)
        res[name] = dict(median_ms=med, min_ms=min(s), samples_ms=s,
                         ratio_to_torch_adamw_fused=med / base,
                         min_ratio_to_torch_adamw_fused=min(s) / min(samples["torch_adamw_fused"]))
    if ref_block:
        res["gefen_reference_block0"]["params"] = ref_block
        res["gefen_reference_block0"]["note"] = "transformer block 0 only"
    quant_n = sum(p.numel() for p, _ in b.quant)
    out = dict(params=GPT2_PARAMS, quantized_params=quant_n, methods=res, skipped=skipped)
    del b, opt_fused, opt_foreach, gef, methods
    gc.collect()
    return key, out


def micro(dtype, cb, reps: int = 20):
    """Load-robust compute comparison: one 4096x768 tensor (period 768), one thread, CPU time
    of the calling thread (time.thread_time, so time spent descheduled on a shared machine is
    not counted), minimum over ``reps`` steps. Data mostly in cache: this is the compute cost."""
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        n, P = 4096 * 768, 768
        gen = torch.Generator().manual_seed(1)
        p = torch.nn.Parameter((torch.randn(n, generator=gen) * 0.02).to(dtype))
        p.grad = (torch.randn(n, generator=gen) * 1e-3).to(dtype)
        idx = torch.full((n,), 127, dtype=torch.uint8)
        sc, v = torch.zeros(n // P), torch.zeros(n // P)
        hp = dict(HP, bc1=0.1, bc2=0.05)

        def gef():
            with torch.no_grad():
                cpu.quantized_step_(p, p.grad, idx, sc, v, cb, period=P, scale_block=P, **hp)

        opt = torch.optim.AdamW([p], lr=HP["lr"], weight_decay=HP["weight_decay"], fused=True)
        out = {}
        for name, fn in (("gefen_fused_kernel", gef), ("torch_adamw_fused", opt.step)):
            fn()
            ts = []
            for _ in range(reps):
                t0 = time.thread_time()
                fn()
                ts.append(time.thread_time() - t0)
            out[name] = min(ts) / n * 1e9
        return dict(ns_per_param=out, ratio=out["gefen_fused_kernel"] / out["torch_adamw_fused"],
                    setup="4096x768 tensor, P=B=768, 1 thread, thread CPU time, min of %d" % reps)
    finally:
        torch.set_num_threads(old)


def plot(results, path: Path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = list(results)
    names = [n for n in results[keys[0]]["methods"] if n != "gefen_reference_block0"]
    fig, ax = plt.subplots(figsize=(9, 4.2))
    w = 0.8 / max(1, len(keys))
    for i, k in enumerate(keys):
        ms = [results[k]["methods"].get(n, {}).get("median_ms", float("nan")) for n in names]
        xs = [j + (i - (len(keys) - 1) / 2) * w for j in range(len(names))]
        bars = ax.bar(xs, ms, w, label=k)
        for x, m, n in zip(xs, ms, names):
            rt = results[k]["methods"].get(n, {}).get("ratio_to_torch_adamw_fused")
            if rt is not None:
                ax.text(x, m, f"{rt:.2f}x", ha="center", va="bottom", fontsize=7)
        del bars
    ax.set_yscale("log")
    ax.set_xticks(range(len(names)))
    ax.set_xticklabels(names, rotation=20, ha="right", fontsize=8)
    ax.set_ylabel("ms per step (median, log scale)")
    ax.set_title("Optimizer step, GPT-2 small (124M params), CPU "
                 f"{torch.get_num_threads()} threads; labels: ratio to torch AdamW fused\n"
                 "(medians of wall-clock steps; on a shared machine see the JSON for minima "
                 "and single-thread CPU time)")
    ax.title.set_fontsize(9)
    ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--eager-rounds", type=int, default=1,
                    help="rounds that include the (slow) eager paths")
    ap.add_argument("--dtypes", default="fp32,bf16")
    ap.add_argument("--peers", action="store_true", help="also time the reference gefen (slow)")
    ap.add_argument("--no-e2e", dest="e2e", action="store_false")
    ap.add_argument("--out", default=str(ROOT / "docs" / "results" / "step_speed.json"))
    ap.add_argument("--png", default=str(ROOT / "docs" / "img" / "step_speed.png"))
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING)

    def log(msg):
        print(msg, flush=True)

    t_start = time.perf_counter()
    load_start = os.getloadavg() if hasattr(os, "getloadavg") else None
    if not cpu.available():
        log("native kernel unavailable: gefen_fused falls back to the eager path")
    cb = demo_codebook()
    num = cpu.numerics()
    dts = {"fp32": torch.float32, "bf16": torch.bfloat16}
    results = {}
    for k in args.dtypes.split(","):
        key, res = run_dtype(dts[k.strip()], args, cb, log)
        res["single_thread_compute"] = micro(dts[k.strip()], cb)
        log(f"{key} single-thread compute (CPU time, in cache): "
            + ", ".join(f"{n} {x:.2f} ns/param" for n, x in res["single_thread_compute"]["ns_per_param"].items())
            + f" -> ratio {res['single_thread_compute']['ratio']:.2f}x")
        results[key] = res

    log("\nms per step: median (ratio to torch AdamW fused's median), min (ratio of minima):")
    for key, res in results.items():
        for name, r in res["methods"].items():
            extra = f" [{r['note']}]" if "note" in r else ""
            log(f"  {key} {name:<24} {r['median_ms']:10.1f} ms  {r['ratio_to_torch_adamw_fused']:7.2f}x"
                f"   min {r['min_ms']:8.1f} ms {r['min_ratio_to_torch_adamw_fused']:6.2f}x"
                f"  (n={len(r['samples_ms'])}){extra}")
        for name, why in res["skipped"].items():
            log(f"  {key} skipped: {name}: {why}")
        mc = res["single_thread_compute"]
        log(f"  {key} single-thread compute: fused Gefen kernel / torch AdamW fused = {mc['ratio']:.2f}x "
            f"({mc['ns_per_param']['gefen_fused_kernel']:.2f} vs {mc['ns_per_param']['torch_adamw_fused']:.2f} ns/param)")

    meta = dict(
        cpu=cpu_name(), logical_cpus=os.cpu_count(), threads=torch.get_num_threads(),
        torch=torch.__version__, capability=torch.backends.cpu.get_cpu_capability(),
        python=platform.python_version(), native_kernel=cpu.available(),
        kernel_numerics=(num.__dict__ if num is not None else None),
        rounds=args.rounds, eager_rounds=args.eager_rounds, hyperparameters=HP,
        periods="row length, >1024 -> smallest divisor >1024; scale block = period",
        timing="wall clock per step, methods interleaved per round, median over rounds",
        load_average_start=load_start,
        load_average_end=os.getloadavg() if hasattr(os, "getloadavg") else None,
        simd_path=cpu.simd_compiled(),
        seconds=time.perf_counter() - t_start,
    )
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(dict(meta=meta, results=results), indent=1))
    plot(results, Path(args.png))
    log(f"\nwrote {out} and {args.png} in {meta['seconds']:.0f} s")


if __name__ == "__main__":
    main()
