"""How often each optimizer stays on the `base` LM's early plateau: AdamW against the Gefen default
(and any variant of `research/quality_variants.py`, e.g. ``v_nibbles``).

    python research/early_stall.py --seeds 6-13 [--steps 150] [--jobs 2]     # ~9 min per run, 1 thread
    python research/early_stall.py --variants v_nibbles --seeds 2,4-8,10,11  # one more variant
    python research/early_stall.py --means gefen_default,x_adamw_jitter10,x_adamw_lr1.1,x_adamw_lr0.9,v_all_v8_fused \
        --plot docs/img/early_plateau.png                                      # window means beside AdamW's

On the quality benchmark's `base` byte-level GPT (4.84M parameters; `benchmarks/quality.py`'s
recipe: batch 32 x 128, lr 2e-3, 50 warm-up steps then a cosine over 800 steps to 10%, betas
(0.9, 0.95), weight decay 0.1 on >= 2-D tensors) the 800-step runs split in two: most reach a
validation loss of ~1.47-1.53, some stay on a plateau the others leave in the first ~75 steps and
end at ~1.75-1.80 (`docs/quality.md`). The split is visible in the training loss long before the
end. This script trains ``--steps`` steps of the same 800-step schedule (the learning rate of every
step is the full run's) with AdamW and with the library default, from the same initialisation on
the same batches, and records the training losses. A run "stays on the plateau" when its mean
training loss over steps 101-150 is above ``--threshold`` (2.48 by default: midway between the
highest window mean of a stored run that left the plateau, 2.394, and the lowest of one that stayed, 2.570).

The threshold is checked against every stored 800-step `base` run of the two optimizers
(`--check`, also printed before each study): each run's window mean against its final validation
loss. Results are appended to ``research/results/early_stall/runs.jsonl`` (one line per run);
``--report`` prints the stall counts per optimizer, the 95% (Wilson) interval of each rate and the
paired table by seed, from that file plus the stored 800-step runs.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
for _p in (ROOT / "benchmarks", ROOT):
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))

OUT = ROOT / "research" / "results" / "early_stall" / "runs.jsonl"
FULL = {  # the stored 800-step base runs of each optimizer (seed -> record), newest file last
    "adamw": [ROOT / "docs/results/quality_runs.jsonl", ROOT / "research/results/default_base/runs_adamw.jsonl"],
    "gefen_default": [ROOT / "research/results/default_base/runs.jsonl"],  # docs/results' are an earlier default
    "v_nibbles": sorted((ROOT / "research/results/nibbles_base").glob("runs_v_nibbles_*.jsonl")),
}
WINDOW = (100, 150)  # steps 101..150 (0-based indices 100..149 of train_loss)
FULL_STALL_VAL = 1.65  # an 800-step base run ending above this stayed on the plateau (stored runs: <= 1.53 or >= 1.74, except AdamW seed 5 at 1.614, which leaves the plateau late)
VARIANTS = ("adamw", "gefen_default")  # the study's default pair; --variants may add any registered name
NAMES = {"adamw": "AdamW", "gefen_default": "Gefen default", "v_nibbles": 'second_moment="nibbles"',
         "x_adamw_fused": "AdamW, fused=True", "x_adamw_jitter1": "AdamW, updates x(1 +- 1%)",
         "x_adamw_jitter10": "AdamW, updates x(1 +- 10%)", "x_adamw_lr1.1": "AdamW, lr x1.1", "x_adamw_lr0.9": "AdamW, lr x0.9",
         "v_all_v8_fused": "8-bit m, one-byte v per element",
         "x_adamw_arnoise": "AdamW, updates x exp(0.18 a), a AR(0.95)", "x_adamw_iidnoise": "AdamW, updates x exp(0.18 z)",
         "x_adamw_iidnoise_half": "AdamW, updates x exp(0.09 z)", "v_all_m4s_fused": "4-bit stochastic m, fp32 v per element"}


def window_mean(train_loss):
    a, b = WINDOW
    xs = train_loss[a:b]
    return sum(xs) / len(xs) if len(xs) == b - a else float("nan")


def full_runs() -> dict:
    """(variant, seed) -> the stored 800-step base record of each variant of :data:`FULL`."""
    out = {}
    for v, files in FULL.items():
        for f in files:
            if not f.exists():
                continue
            for line in f.open():
                r = json.loads(line)
                c = r.get("config", {})
                if r.get("variant") == v and c.get("preset") == "base" and c.get("steps") == 800 \
                        and r.get("workload") == "lm":
                    out[(v, r["seed"])] = r
    return out


def check(threshold: float) -> bool:
    """Does the window mean separate the stored 800-step runs that ended on the plateau?"""
    ok = True
    for (v, s), r in sorted(full_runs().items()):
        wm = window_mean(r["result"]["train_loss"])
        final = r["result"]["val_loss"]
        agree = (wm > threshold) == (final > FULL_STALL_VAL)
        ok &= agree
        print(f"  stored 800-step run {v:14s} seed {s}: window mean {wm:.3f}, final val {final:.4f}"
              f"{'' if agree else '   <-- the threshold misclassifies this run'}")
    print(f"threshold {threshold}: {'separates' if ok else 'does NOT separate'} the stored runs "
          f"(plateau = final val > {FULL_STALL_VAL})")
    return ok


def train(variant: str, seed: int, steps: int) -> dict:
    """The first ``steps`` steps of `benchmarks/quality.py`'s 800-step `base` run (its ``run_lm``)."""
    import torch

    import quality

    if variant not in quality.VARIANTS:
        sys.path.insert(0, str(ROOT / "research"))
        import quality_variants  # noqa: F401  (registers the research variants)
    cfg = quality.lm_config(argparse.Namespace(quick=False, lm_preset="base", lm_batch=None, lm_context=None,
                                               lm_steps=None))
    r = quality.run_lm(variant, seed, cfg, stop_at=steps)
    losses = r["train_loss"]
    return dict(variant=variant, seed=seed, steps=steps, schedule_steps=cfg["steps"],
                config={k: cfg[k] for k in ("preset", "batch", "context", "steps", "warmup", "lr", "betas",
                                           "weight_decay", "min_lr_frac")},
                train_loss=losses, window_mean=window_mean(losses), seconds=round(r["seconds"], 1),
                corpus_sha256=r["corpus_sha256"], torch=torch.__version__)


def wilson(k: int, n: int, z: float = 1.96):
    if n == 0:
        return float("nan"), float("nan")
    p = k / n
    d = 1 + z * z / n
    c = (p + z * z / (2 * n)) / d
    h = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / d
    return max(0.0, c - h), min(1.0, c + h)


def report(threshold: float) -> str:
    """Stall per (variant, seed): from the 800-step runs where stored, else from this study's runs;
    each variant's rate beside AdamW's on the seeds both have."""
    stall, src = {}, {}
    for (v, s), r in full_runs().items():
        stall[(v, s)] = r["result"]["val_loss"] > FULL_STALL_VAL
        src[(v, s)] = "800"
    if OUT.exists():
        for line in OUT.open():
            r = json.loads(line)
            key = (r["variant"], r["seed"])
            if key not in stall:
                stall[key] = r["window_mean"] > threshold
                src[key] = str(r["steps"])
    seeds = sorted({s for _, s in stall})
    names = list(VARIANTS) + sorted({v for v, _ in stall} - set(VARIANTS))
    lines = ["| seed | " + " | ".join(NAMES.get(v, v) for v in names) + " |", "|---" * (len(names) + 1) + "|"]
    for s in seeds:
        cell = ["—" if (v, s) not in stall else ("**plateau**" if stall[(v, s)] else "leaves it") + f" ({src[(v, s)]} steps)"
                for v in names]
        lines.append(f"| {s} | " + " | ".join(cell) + " |")
    lines.append("")
    for v in names[1:]:
        both = [s for s in seeds if ("adamw", s) in stall and (v, s) in stall]
        for w in ("adamw", v):
            k = sum(stall[(w, s)] for s in both)
            lo, hi = wilson(k, len(both))
            lines.append(f"* {NAMES.get(w, w)}: stays on the plateau on {k} of {len(both)} seeds "
                         f"({100 * k / max(1, len(both)):.0f}%, 95% Wilson interval {100 * lo:.0f}%-{100 * hi:.0f}%)")
        only_a = [s for s in both if stall[("adamw", s)] and not stall[(v, s)]]
        only_v = [s for s in both if stall[(v, s)] and not stall[("adamw", s)]]
        lines.append(f"* seeds where only AdamW stays: {only_a}; only {NAMES.get(v, v)}: {only_v}; "
                     f"both: {[s for s in both if stall[('adamw', s)] and stall[(v, s)]]}")
    return "\n".join(lines)


def window_means() -> dict:
    """(variant, seed) -> the window mean, from the 800-step run where stored, else this study's run."""
    out = {k: window_mean(r["result"]["train_loss"]) for k, r in full_runs().items()}
    if OUT.exists():
        for line in OUT.open():
            r = json.loads(line)
            out.setdefault((r["variant"], r["seed"]), r["window_mean"])
    return out


def means_report(variants, threshold: float) -> str:
    """Each variant's window means beside AdamW's, seed by seed: how many seeds change side of the
    threshold (``flips``), and the mean paired difference with its 95% t-interval."""
    from statistics import mean, stdev

    from seed_gaps import t95

    wm = window_means()
    lines = []
    for v in variants:
        seeds = sorted(s for (w, s) in wm if w == v and ("adamw", s) in wm)
        if not seeds:
            continue
        d = [wm[(v, s)] - wm[("adamw", s)] for s in seeds]
        flips = [s for s in seeds if (wm[(v, s)] > threshold) != (wm[("adamw", s)] > threshold)]
        half = t95(len(d)) * stdev(d) / math.sqrt(len(d)) if len(d) > 1 else float("nan")
        per = ", ".join(f"{s}: {wm[('adamw', s)]:.3f} -> {wm[(v, s)]:.3f}" for s in seeds)
        lines.append(f"* {NAMES.get(v, v)} against AdamW on {len(seeds)} seeds: changes side on {len(flips)} "
                     f"{flips}; window mean {mean(d):+.3f} (+-{half:.3f}); {per}")
    return "\n".join(lines)


def plot(variants, threshold: float, path: str) -> None:
    """Window mean per seed for each variant (one marker per run), the threshold as a line."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    wm = window_means()
    fig, ax = plt.subplots(figsize=(7.5, 3.6))
    marks = "os^Dvx*P"
    for i, v in enumerate(variants):
        pts = sorted((s, x) for (w, s), x in wm.items() if w == v)
        if pts:
            ax.scatter([s + (i - len(variants) / 2) * 0.08 for s, _ in pts], [x for _, x in pts], marker=marks[i % 8],
                       label=NAMES.get(v, v), s=28, alpha=0.85)
    ax.axhline(threshold, color="grey", lw=0.8, ls="--")
    ax.text(ax.get_xlim()[0], threshold + 0.005, f" plateau line {threshold}", fontsize=7, color="grey")
    ax.set_xlabel("seed (same init and batches for every optimizer)")
    ax.set_ylabel("mean train loss, steps 101-150")
    ax.set_title("`base` LM: who leaves the early plateau (research/early_stall.py)", fontsize=9)
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=130)


def parse_seeds(text: str):
    out = []
    for part in text.split(","):
        a, _, b = part.partition("-")
        out.extend(range(int(a), int(b) + 1) if b else [int(a)])
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", default="6-13")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--steps", type=int, default=WINDOW[1])
    ap.add_argument("--threshold", type=float, default=2.48)
    ap.add_argument("--jobs", type=int, default=1, help="runs in parallel, one thread each")
    ap.add_argument("--check", action="store_true", help="only check the threshold on the stored 800-step runs")
    ap.add_argument("--report", action="store_true", help="only print the table from the stored runs")
    ap.add_argument("--means", default=None, help="print window means of these variants (comma-separated) "
                    "beside AdamW's: flips of side and the paired difference")
    ap.add_argument("--plot", default=None, help="with --means: also draw them into this PNG")
    ap.add_argument("--one", default=None, help=argparse.SUPPRESS)  # internal: "variant:seed" in a child
    a = ap.parse_args(argv)
    if a.steps < WINDOW[1]:
        ap.error(f"--steps {a.steps}: the plateau test reads steps {WINDOW[0] + 1}-{WINDOW[1]}; use --steps >= {WINDOW[1]}")
    if a.one:
        import torch
        torch.set_num_threads(1)
        v, s = a.one.split(":")
        print(json.dumps(train(v, int(s), a.steps)))
        return 0
    if a.check:
        return 0 if check(a.threshold) else 1
    if a.report:
        print(report(a.threshold))
        return 0
    if a.means:
        vs = a.means.split(",")
        print(means_report(vs, a.threshold))
        if a.plot:
            plot(["adamw"] + [v for v in vs if v != "adamw"], a.threshold, a.plot)
        return 0
    if not check(a.threshold):
        return 1
    todo = [(v, s) for s in parse_seeds(a.seeds) for v in a.variants.split(",")]
    OUT.parent.mkdir(parents=True, exist_ok=True)
    running = []
    env = dict(os.environ, OMP_NUM_THREADS="1")
    while todo or running:
        while todo and len(running) < a.jobs:
            v, s = todo.pop(0)
            p = subprocess.Popen([sys.executable, __file__, "--one", f"{v}:{s}", "--steps", str(a.steps)],
                                 stdout=subprocess.PIPE, text=True, env=env)
            running.append((v, s, p))
        time.sleep(2)
        for item in list(running):
            v, s, p = item
            if p.poll() is None:
                continue
            running.remove(item)
            out = p.stdout.read().strip().splitlines()
            if p.returncode != 0 or not out:
                print(f"{v} seed {s}: failed (exit {p.returncode})", file=sys.stderr)
                continue
            rec = json.loads(out[-1])
            with OUT.open("a") as f:
                f.write(json.dumps(rec) + "\n")
            print(f"{v:14s} seed {s}: window mean {rec['window_mean']:.3f} "
                  f"({'plateau' if rec['window_mean'] > a.threshold else 'leaves it'}), {rec['seconds']:.0f} s", flush=True)
    print(report(a.threshold))
    return 0


if __name__ == "__main__":
    sys.exit(main())
