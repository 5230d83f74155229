"""Throughput under a memory budget: AdamW vs Gefen on 2 ranks, FSDP2 and DeepSpeed ZeRO-2.

    python benchmarks/throughput.py                       # writes docs/results/throughput.json
    python benchmarks/throughput.py --quick --out /tmp/t.json   # tiny sizes, ~2 minutes on CPU

Question: with the same per-rank memory budget, how many tokens/s does each optimizer reach?
Gefen's ~1 byte/param of state (instead of AdamW's 8) frees memory for a larger micro-batch.

Method, for each strategy (``fsdp``: ``gefen_dist.integrations.fsdp.shard_model``;
``deepspeed``: ``integrations/deepspeed/gefen_zero2.json``), one 2-rank torchrun launch per
optimizer, through ``launch/train.py``'s strategies (same model, optimizer, clipping and
step as the training job):

1. Model: the training job's byte-level GPT, made wide and shallow with a short context
   (defaults: 4 layers, d_model 512, context 32) so that parameters, hence optimizer state,
   dominate memory relative to activations: the regime where state memory limits the batch.
2. Peak memory per rank of a training step at micro-batch ``b`` (sequences per rank) for each
   ``b`` in ``--fit-batches`` (ascending): on CPU the peak RSS (``VmHWM``, reset before each
   batch size through ``/proc/self/clear_refs``; without it the lifetime ``ru_maxrss``, still
   valid because the sizes are ascending; workers run with ``MALLOC_MMAP_THRESHOLD_=65536`` so
   that freed tensors leave the RSS), on GPU ``torch.cuda.max_memory_allocated`` (reset
   before each size). The first optimizer step (state allocation, Gefen's period/codebook
   learning) runs before the measurements, so the state is in every point. The peak of the
   worst rank is used.
3. A least-squares line ``peak(b) = fixed + per_sample * b`` over those points.
4. The budget: AdamW's measured peak at ``--base-batch`` (or ``--budget-mib``), the same for
   both optimizers. The largest micro-batch that fits is searched the same way for both: the
   measured sizes bound it (the largest that fits, the smallest above it that does not); the
   line's prediction ``floor((budget - fixed) / per_sample)`` is measured when it lies between
   them (the line is only a model: allocator caches, DeepSpeed buckets); with no size known to
   overshoot, sizes are doubled until one does (capped at ``--max-batch``); then the interval is
   bisected (``probes``, at most ``--max-probes`` in all).
5. Tokens/s at that micro-batch: ``world * b * context * steps / wall`` over ``--time-steps``
   timed steps after ``--warmup-steps``; the peak at that batch is measured again
   (``verified_peak_bytes``, ``verified_within_budget``). "Fits" means a peak within 1% of the
   budget on CPU (RSS varies by a few MiB between identical runs), at most the budget on GPU.

Reported: per strategy and optimizer the points, the line, the budget, the batch, tokens/s,
state bytes per rank, and the ratios Gefen/AdamW of batch and of tokens/s. On CPU, tokens/s
grows little with the batch (compute-bound), so the batch ratio is the main number there; on a
GPU a larger batch raises utilisation and the tokens/s ratio is the one to quote.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

DEFAULT_OUT = REPO / "docs" / "results" / "throughput.json"


# ------------------------------------------------------------------------------------- memory
def _reset_peak(device) -> str:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        return "cuda_max_memory_allocated"
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM to the current RSS (Linux >= 4.0)
        return "VmHWM (reset per batch size)"
    except OSError:
        return "ru_maxrss (lifetime, ascending batch sizes)"


def _peak(device) -> int:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)
        return int(torch.cuda.max_memory_allocated(device))
    try:
        with open("/proc/self/status") as f:
            m = re.search(r"VmHWM:\s+(\d+)\s+kB", f.read())
        if m:
            return int(m.group(1)) * 1024
    except OSError:
        pass
    import resource
    r = int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)
    return r if sys.platform == "darwin" else r * 1024


def fit_line(xs, ys) -> tuple[float, float]:
    """Least squares ``y = a + s x``; returns ``(a, s)``."""
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    if sxx == 0:
        return my, 0.0
    s = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx
    return my - s * mx, s


def max_batch(budget: float, a: float, s: float, cap: int) -> int:
    if s <= 0:
        return cap
    return int(max(0, min(cap, math.floor((budget - a) / s))))


# ------------------------------------------------------------------------------------- worker
def worker(a) -> None:
    import torch

    from launch import train
    from launch.corpus import Batches, load_corpus
    from launch.gpt import GPT, GPTConfig

    targs = train.parse_args([
        "--strategy", a.strategy, "--optimizer", a.optimizer, "--batch-size", str(2 * a.base_batch),
        "--lr", "1e-3", "--warmup", "0", "--steps", "1000000", "--device", a.device,
        "--no-progress", "--log-level", "WARNING", "--out", tempfile.mkdtemp(prefix="thr_")])
    strategy = train.make_strategy(a.strategy, targs)
    strategy.setup()
    try:
        ws = strategy.world_size
        targs.batch_size = a.base_batch * ws
        cfg = GPTConfig(n_layer=a.layers, n_head=a.heads, d_model=a.d_model, context=a.context)
        torch.manual_seed(0)
        model = GPT(cfg)
        n_params = model.num_params()
        model, opt, sched = strategy.build(a.optimizer, model, targs)
        dev = strategy.device
        data = load_corpus()[0]
        step_no = [0]

        def steps(b: int, n: int) -> float:
            sampler = Batches(data, b, cfg.context, seed=1, rank=strategy.rank, world_size=ws)
            t0 = time.perf_counter()
            for _ in range(n):
                x, y = sampler.batch(step_no[0])
                step_no[0] += 1
                loss = strategy.train_step(model, opt, sched, x.to(dev), y.to(dev), targs)
                loss.item()
            if dev.type == "cuda":
                torch.cuda.synchronize(dev)
            strategy.barrier()
            return time.perf_counter() - t0

        steps(min(a.fit_batches), 1)  # state allocated, periods/codebook learned
        points, kind = [], None
        for b in sorted(a.fit_batches):
            kind = _reset_peak(dev)
            steps(b, a.measure_steps)
            points.append({"micro_batch": b, "peak_bytes_per_rank": strategy.gather(_peak(dev))})
        xs = [p["micro_batch"] for p in points]
        ys = [max(p["peak_bytes_per_rank"]) for p in points]
        fixed, per_sample = fit_line(xs, ys)
        if a.budget_bytes:
            budget, budget_from = float(a.budget_bytes), "given"
        else:
            base = [max(p["peak_bytes_per_rank"]) for p in points if p["micro_batch"] == a.base_batch]
            budget = float(base[0]) if base else fixed + per_sample * a.base_batch
            budget_from = f"{a.optimizer} peak at micro-batch {a.base_batch}"
        b_fit = max_batch(budget, fixed, per_sample, a.max_batch)

        slack = 1.0 if dev.type == "cuda" else 1.01  # CPU RSS varies by a few MiB run to run

        def peak_at(b: int) -> int:
            _reset_peak(dev)
            steps(b, a.measure_steps)
            return max(strategy.gather(_peak(dev)))

        # Search for the largest micro-batch within the budget, the same way for both optimizers:
        # the measured sizes bound it (lo: largest that fits, hi: smallest above it that does not);
        # the line's prediction is checked when it lies between them; with no size known to
        # overshoot, sizes are doubled until one does (or --max-batch); then lo..hi is bisected.
        fits = lambda pk: pk <= budget * slack  # noqa: E731
        lo = max([x for x, y in zip(xs, ys) if fits(y)], default=0)
        over = [x for x, y in zip(xs, ys) if x > lo and not fits(y)]
        hi = min(over) if over else None
        probes = []

        def probe(b: int) -> bool:
            pk = peak_at(b)
            probes.append({"micro_batch": b, "peak_bytes": pk})
            return fits(pk)

        if lo < b_fit < (hi or a.max_batch + 1):
            if probe(b_fit):
                lo = b_fit
            else:
                hi = b_fit
        while hi is None and lo < a.max_batch and len(probes) < a.max_probes:
            c = min(a.max_batch, max(lo + 1, 2 * lo))
            if probe(c):
                lo = c
            else:
                hi = c
        while hi is not None and hi - lo > 1 and len(probes) < a.max_probes:
            mid = (lo + hi) // 2
            if probe(mid):
                lo = mid
            else:
                hi = mid
        b_max = lo
        tput = verified = None
        if b_max >= 1:
            steps(b_max, a.warmup_steps)
            _reset_peak(dev)
            wall = steps(b_max, a.time_steps)
            verified = max(strategy.gather(_peak(dev)))
            tput = ws * b_max * cfg.context * a.time_steps / wall
        sb = [int(x) for x in strategy.gather(strategy.state_bytes(opt))]
        if strategy.is_main:
            res = {
                "strategy": a.strategy, "optimizer": a.optimizer, "world_size": ws,
                "device": str(dev), "memory_kind": kind, "params": n_params,
                "model": cfg.to_dict(), "state_bytes_per_rank": sb,
                "points": points, "fit": {"fixed_bytes": fixed, "per_sample_bytes": per_sample,
                                          "max_abs_residual_bytes": max(abs(y - fixed - per_sample * x)
                                                                        for x, y in zip(xs, ys))},
                "budget_bytes": budget, "budget_from": budget_from,
                "fit_micro_batch": b_fit, "probes": probes,
                "max_micro_batch": b_max, "capped": b_max == a.max_batch,
                "verified_peak_bytes": verified,
                "verified_within_budget": None if verified is None else verified <= budget * slack,
                "tokens_per_s": tput, "time_steps": a.time_steps,
            }
            Path(a.result).write_text(json.dumps(res, indent=1))
    finally:
        strategy.teardown()


# ------------------------------------------------------------------------------------- driver
def launch(a, strategy: str, optimizer: str, budget: float | None, result: Path) -> dict:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
           str(a.nproc), __file__, "--worker", "--strategy", strategy, "--optimizer", optimizer,
           "--result", str(result)]
    for k in ("layers", "heads", "d_model", "context", "base_batch", "max_batch", "measure_steps", "max_probes",
              "warmup_steps", "time_steps", "device"):
        cmd += [f"--{k.replace('_', '-')}", str(getattr(a, k))]
    cmd += ["--fit-batches", ",".join(map(str, a.fit_batches))]
    if budget is not None:
        cmd += ["--budget-bytes", str(int(budget))]
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // a.nproc)))
    # CPU: large blocks from mmap, returned to the OS when freed, so that RSS follows live memory
    # (otherwise glibc keeps freed heap pages and the peak at a size inherits earlier sizes')
    env.setdefault("MALLOC_MMAP_THRESHOLD_", "65536")
    if strategy == "deepspeed" and a.device != "cuda":
        env.setdefault("DS_ACCELERATOR", "cpu" if a.device == "cpu" or not _cuda() else "cuda")
    t0 = time.time()
    r = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=a.timeout)
    if r.returncode != 0:
        raise SystemExit(f"{strategy}/{optimizer} failed (rc {r.returncode}):\n"
                         f"{(r.stdout + r.stderr)[-4000:]}")
    out = json.loads(result.read_text())
    out["launch_wall_s"] = round(time.time() - t0, 1)
    return out


def _cuda() -> bool:
    import torch
    return torch.cuda.is_available()


def _batches(s: str) -> list[int]:
    return sorted({int(x) for x in s.split(",") if x.strip()})


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--strategies", default="fsdp,deepspeed")
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--d-model", type=int, default=512)
    p.add_argument("--context", type=int, default=32)
    p.add_argument("--fit-batches", type=_batches, default=_batches("2,4,8,12"),
                   help="micro-batches (sequences per rank) whose peak memory is measured")
    p.add_argument("--base-batch", type=int, default=4,
                   help="budget = AdamW's peak at this micro-batch (must be in --fit-batches)")
    p.add_argument("--budget-mib", type=float, default=None, help="explicit per-rank budget")
    p.add_argument("--max-batch", type=int, default=256, help="cap on the micro-batch searched")
    p.add_argument("--measure-steps", type=int, default=2)
    p.add_argument("--max-probes", type=int, default=10,
                   help="peak measurements to check/bisect the extrapolated micro-batch")
    p.add_argument("--warmup-steps", type=int, default=1)
    p.add_argument("--time-steps", type=int, default=5)
    p.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    p.add_argument("--timeout", type=float, default=1800)
    p.add_argument("--quick", action="store_true",
                   help="tiny model and few steps (checks the script, not a result)")
    p.add_argument("--out", default=str(DEFAULT_OUT))
    p.add_argument("--report-only", action="store_true",
                   help="only regenerate the markdown table and the plot from an existing --out JSON")
    # worker mode (internal)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--strategy", help=argparse.SUPPRESS)
    p.add_argument("--optimizer", help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    p.add_argument("--budget-bytes", type=float, default=None, help=argparse.SUPPRESS)
    return p


def main(argv=None) -> dict:
    a = parser().parse_args(argv)
    if a.worker:
        worker(a)
        return {}
    if a.report_only:
        report = json.loads(Path(a.out).read_text())
        write_outputs(report, Path(a.out))
        return report
    if a.quick:
        a.layers, a.heads, a.d_model, a.context = 2, 4, 128, 16
        a.fit_batches, a.base_batch, a.max_batch = [1, 2, 4], 2, 64
        a.measure_steps, a.warmup_steps, a.time_steps = 1, 1, 2
    if a.base_batch not in a.fit_batches and a.budget_mib is None:
        raise SystemExit("--base-batch must be one of --fit-batches (or give --budget-mib)")
    strategies = [s for s in a.strategies.split(",") if s]
    results: dict = {}
    skipped: dict = {}
    with tempfile.TemporaryDirectory() as tmp:
        for s in strategies:
            if s == "deepspeed":
                import importlib.util
                if importlib.util.find_spec("deepspeed") is None:
                    skipped[s] = "deepspeed is not installed"
                    continue
            budget = a.budget_mib * 2**20 if a.budget_mib else None
            adamw = launch(a, s, "adamw", budget, Path(tmp) / f"{s}_adamw.json")
            gefen = launch(a, s, "gefen", adamw["budget_bytes"], Path(tmp) / f"{s}_gefen.json")
            ba, bg = adamw["max_micro_batch"], gefen["max_micro_batch"]
            ta, tg = adamw["tokens_per_s"], gefen["tokens_per_s"]
            results[s] = {
                "adamw": adamw, "gefen": gefen,
                "budget_bytes_per_rank": adamw["budget_bytes"],
                "micro_batch_ratio": (bg / ba) if ba else None,
                "tokens_per_s_ratio": (tg / ta) if ta and tg else None,
            }
    import torch
    report = {
        "benchmark": "throughput under a per-rank memory budget (AdamW vs Gefen)",
        "method": __doc__.split("\n\n", 2)[2].strip(),
        "command": "python benchmarks/throughput.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "quick": a.quick,
        "settings": {k: v for k, v in vars(a).items() if k not in ("worker", "strategy", "optimizer",
                                                                   "result", "budget_bytes", "out")},
        "env": {"torch": torch.__version__, "python": platform.python_version(),
                "machine": platform.machine(), "cpus": os.cpu_count(),
                "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None},
        "results": results,
        "skipped": skipped,
    }
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1))
    write_outputs(report, out)
    for s, r in results.items():
        ad, ge = r["adamw"], r["gefen"]
        sys.stdout.write(
            f"{s}: budget {r['budget_bytes_per_rank'] / 2**20:.1f} MiB/rank; "
            f"AdamW micro-batch {ad['max_micro_batch']} -> {ad['tokens_per_s'] or 0:,.0f} tok/s; "
            f"Gefen micro-batch {ge['max_micro_batch']} -> {ge['tokens_per_s'] or 0:,.0f} tok/s; "
            f"ratio batch {r['micro_batch_ratio'] or float('nan'):.2f}x, "
            f"tok/s {r['tokens_per_s_ratio'] or float('nan'):.2f}x\n")
    for s, why in skipped.items():
        sys.stdout.write(f"{s}: skipped ({why})\n")
    sys.stdout.write(f"wrote {out}\n")
    return report


def write_outputs(report: dict, out: Path) -> None:
    """``<out>_table.md`` (the table docs/benchmarks.md shows) and, with matplotlib, a PNG of
    peak memory per rank against the micro-batch with the budget line (``docs/img/throughput.png``
    for the default ``--out``; next to the JSON otherwise)."""
    res = report["results"]
    lines = [f"<!-- generated by benchmarks/throughput.py from {out.name}; do not edit -->",
             f"Command: `{report['command'].strip()}`; torch {report['env']['torch']}, "
             f"{report['env']['cpus']} CPUs, device {report['env']['cuda'] or 'cpu'}.", "",
             "| strategy | budget per rank | optimizer | state per rank | largest micro-batch | tokens/s | "
             "Gefen / AdamW batch | Gefen / AdamW tokens/s |", "|---|---|---|---|---|---|---|---|"]
    for s, r in res.items():
        for i, o in enumerate(("adamw", "gefen")):
            x = r[o]
            ratio = (f"{r['micro_batch_ratio']:.2f}x", f"{r['tokens_per_s_ratio']:.2f}x") if i else ("", "")
            lines.append(f"| {s if not i else ''} | {r['budget_bytes_per_rank'] / 2**20:.1f} MiB | {o} | "
                         f"{max(x['state_bytes_per_rank']) / 2**20:.1f} MiB | {x['max_micro_batch']} | "
                         f"{x['tokens_per_s'] or 0:,.0f} | {ratio[0]} | {ratio[1]} |")
    md = out.with_name(out.stem + "_table.md")
    md.write_text("\n".join(lines) + "\n")
    sys.stdout.write(f"wrote {md}\n")
    if out.resolve() == DEFAULT_OUT.resolve():
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        from _docs import splice

        if splice(REPO / "docs" / "benchmarks.md", md.name, "\n".join(lines)):
            sys.stdout.write("spliced it into docs/benchmarks.md\n")
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, axes = plt.subplots(1, max(1, len(res)), figsize=(6 * max(1, len(res)), 4.2), squeeze=False)
    for ax, (s, r) in zip(axes[0], res.items()):
        for o, color in (("adamw", "tab:red"), ("gefen", "tab:blue")):
            x = r[o]
            pts = [(q["micro_batch"], max(q["peak_bytes_per_rank"]) / 2**20) for q in x["points"]]
            pts += [(q["micro_batch"], q["peak_bytes"] / 2**20) for q in x.get("probes", [])]
            pts.sort()
            ax.plot([b for b, _ in pts], [m for _, m in pts], marker="o", color=color,
                    label=f"{o}: largest fit {x['max_micro_batch']}")
        ax.axhline(r["budget_bytes_per_rank"] / 2**20, color="k", linestyle="--", label="budget (AdamW at base batch)")
        ax.set_title(f"{s}: peak memory per rank vs micro-batch")
        ax.set_xlabel("micro-batch (sequences per rank)")
        ax.set_ylabel("peak MiB per rank")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    png = (REPO / "docs" / "img" / "throughput.png") if out.resolve() == DEFAULT_OUT.resolve() else out.with_suffix(".png")
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=110)
    plt.close(fig)
    sys.stdout.write(f"wrote {png}\n")


if __name__ == "__main__":
    main()
