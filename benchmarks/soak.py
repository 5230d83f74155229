"""Soak test: a long single-process run of Gefen (and AdamW as the reference band) that records, every
``--every`` steps, the training loss, non-finite losses/gradients/parameters, the optimizer-state bytes
and the process RSS, to show that nothing drifts, leaks or blows up over many steps.

    nice -n 10 python benchmarks/soak.py                      # 20,000 steps each; writes the docs
    python benchmarks/soak.py --steps 200 --out /tmp/soak     # short check, writes under /tmp/soak
    nice -n 10 python benchmarks/soak.py --run gefen          # Gefen again; AdamW from its records
    mkdir -p /tmp/soak_nib/results && cp docs/results/soak.json /tmp/soak_nib/results/ && \
    nice -n 10 python benchmarks/soak.py --run gefen --gefen-second-moment nibbles --out /tmp/soak_nib \
        --records /tmp/soak_nib/records                      # second_moment="nibbles" against the same AdamW run

Workload: the byte-level GPT of the training job (``launch.gpt``, ``--model tiny`` by default: 2 layers,
d_model 64, context 64, 120,576 parameters) on the Python stdlib sources (``launch.corpus``), batch 16,
lr 2e-3 with a linear warm-up then a cosine to 10% at the last step, betas (0.9, 0.95), weight decay
0.1 on >=2-D tensors, global-norm clipping at 1.0, one thread. Gefen runs with ``nonfinite="skip"``
so that a non-finite gradient would be counted (``skipped_steps``) instead of ending the run.

Each optimizer runs in a fresh subprocess (``--worker``), one after the other, so that each process's
RSS belongs to one optimizer only. AdamW runs the same number of steps on the same batches (same seed,
init, schedule): it is the band Gefen's loss is compared with. Every worker appends one JSON record per
``--every`` steps to ``runs/soak/soak_<optimizer>.jsonl`` (``--records``) as it goes (progress can be
followed there); the records are also copied into ``soak.json`` (``series``).

Outputs (default ``--out docs``): ``results/soak.json``, ``img/soak.png`` and the generated section of
``reliability.md`` between ``<!-- soak:begin -->`` and ``<!-- soak:end -->`` (with ``--out`` other
than ``docs``, the section is written to ``<out>/reliability.md``).

Checks (reported, generated from the records; the script exits 1 if one fails):
* no non-finite loss, no skipped step, all parameters finite at every record;
* optimizer-state bytes identical at every record (after step 1, when Gefen learned its layout);
* RSS after warm-up (the first record at or after ``--rss-warmup`` of the steps): its growth to the
  largest later value stays under ``--rss-tolerance-mib``. A leak of 1 KiB per step would grow RSS by
  about 18 MiB over the 18,000 post-warm-up steps of the default run.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

MARK_BEGIN = "<!-- soak:begin -->"
MARK_END = "<!-- soak:end -->"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--steps", type=int, default=20000)
    p.add_argument("--every", type=int, default=None, help="record every K steps (default: steps/200)")
    p.add_argument("--optimizers", default="gefen,adamw")
    p.add_argument("--gefen-second-moment", default="factored",
                   help="Gefen's second_moment (e.g. nibbles, D20; with --out elsewhere than docs, AdamW restored "
                        "from a copy of docs/results/soak.json there)")
    p.add_argument("--model", default="tiny")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--warmup", type=int, default=None, help="LR warm-up steps (default: 1%% of --steps)")
    p.add_argument("--eval-every", type=int, default=None, help="validation every N steps (default: steps/20)")
    p.add_argument("--eval-batches", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--rss-warmup", type=float, default=0.1,
                   help="fraction of the steps after which RSS must no longer grow")
    p.add_argument("--rss-tolerance-mib", type=float, default=4.0)
    p.add_argument("--out", default=str(ROOT / "docs"),
                   help="results/soak.json, img/soak.png (and records) go under this folder")
    p.add_argument("--records", default=str(ROOT / "runs" / "soak"),
                   help="folder of the per-optimizer progress records soak_<optimizer>.jsonl")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    p.add_argument("--report-only", action="store_true", help="aggregate existing records only")
    p.add_argument("--run", default=None,
                   help="run only these of --optimizers (comma-separated; default all); the others are reported "
                        "from their existing records (e.g. --run gefen after a change that leaves AdamW's run as it was)")
    return p


def _defaults(args) -> None:
    if args.every is None:
        args.every = max(1, args.steps // 200)
    if args.warmup is None:
        args.warmup = max(1, args.steps // 100)
    if args.eval_every is None:
        args.eval_every = max(args.every, args.steps // 20)


def rss_bytes() -> int:
    """Current resident set size of this process (``/proc/self/statm``; peak RSS elsewhere)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:  # pragma: no cover - not Linux
        import resource
        r = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return int(r if sys.platform == "darwin" else r * 1024)


# --------------------------------------------------------------------------------------------
# worker: one optimizer, one process
# --------------------------------------------------------------------------------------------

def run_worker(args) -> None:
    import torch

    from launch import train
    from launch.corpus import Batches, load_corpus, val_batches
    from launch.gpt import GPT, get_config

    torch.set_num_threads(args.threads)
    name = args.worker
    cfg = get_config(args.model)
    data, vdata, info = load_corpus()
    torch.manual_seed(args.seed)
    model = GPT(cfg)
    groups = train.param_groups(model, 0.1)
    kw = dict(lr=args.lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    if name == "gefen":
        from gefen_dist import Gefen
        opt = Gefen(groups, nonfinite="skip", second_moment=args.gefen_second_moment, **kw)
    elif name == "adamw":
        opt = torch.optim.AdamW(groups, **kw)
    else:
        raise SystemExit(f"unknown optimizer {name!r}")
    sched = torch.optim.lr_scheduler.LambdaLR(opt, train.lr_lambda_factory(args.steps, args.warmup, 0.1))
    sampler = Batches(data, args.batch_size, cfg.context, args.seed)
    vb = val_batches(args.eval_batches, args.batch_size, cfg.context, data=vdata)
    params = [p for g in opt.param_groups for p in g["params"]]
    rec_path = Path(args.records) / f"soak_{name}.jsonl"
    rec_path.parent.mkdir(parents=True, exist_ok=True)
    f = open(rec_path, "w", buffering=1)
    f.write(json.dumps({"kind": "header", "optimizer": name, "params": model.num_params(),
                        "model_config": cfg.to_dict(), "corpus_sha256": info["sha256"],
                        "pid": os.getpid(), "date": time.strftime("%Y-%m-%d"),
                        "torch": torch.__version__}) + "\n")
    window, n_window, nonfinite_losses, t_window = [], 0, 0, 0.0
    t_start = time.perf_counter()
    model.train()
    for step in range(args.steps):
        t0 = time.perf_counter()
        x, y = sampler.batch(step)
        _, loss = model(x, y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        lv = float(loss.item())
        t_window += time.perf_counter() - t0
        n_window += 1
        if math.isfinite(lv):
            window.append(lv)
        else:
            nonfinite_losses += 1
        done = step + 1
        if done % args.every == 0 or done == args.steps:
            rec = {
                "kind": "record", "step": done,
                "loss_mean": sum(window) / len(window) if window else None,
                "loss_min": min(window) if window else None,
                "loss_max": max(window) if window else None,
                "nonfinite_losses": nonfinite_losses,  # cumulative
                "skipped_steps": int(getattr(opt, "skipped_steps", 0)),  # cumulative (Gefen)
                "params_finite": all(bool(torch.isfinite(p).all()) for p in params),
                "state_bytes": train.optimizer_state_bytes(opt),
                "rss_bytes": rss_bytes(),
                "ms_per_step": 1000.0 * t_window / n_window,
                "lr": sched.get_last_lr()[0],
                "elapsed_s": time.perf_counter() - t_start,
            }
            if done % args.eval_every == 0 or done == args.steps:
                rec["val_loss"] = train.evaluate(model, vb)
            f.write(json.dumps(rec) + "\n")
            window, n_window, t_window = [], 0, 0.0
    f.write(json.dumps({"kind": "end", "steps": args.steps, "wall_s": time.perf_counter() - t_start}) + "\n")
    f.close()


# --------------------------------------------------------------------------------------------
# driver, aggregation, report
# --------------------------------------------------------------------------------------------

def _read(path: Path) -> tuple[dict, list[dict], dict | None]:
    header, recs, end = {}, [], None
    for line in path.read_text().splitlines():
        r = json.loads(line)
        if r["kind"] == "header":
            header = r
        elif r["kind"] == "record":
            recs.append(r)
        else:
            end = r
    return header, recs, end


def _restore_records(name: str, json_path: Path, rec_path: Path) -> None:
    """Write ``rec_path`` from the records of ``name`` kept in an earlier report (``soak.json``'s
    ``series``), with its run's date and torch, so that one optimizer can be re-run alone."""
    if not json_path.exists():
        return
    res = json.loads(json_path.read_text())
    run, recs = res.get("runs", {}).get(name), res.get("series", {}).get(name)
    if not run or not recs:
        return
    rec_path.parent.mkdir(parents=True, exist_ok=True)
    header = {"kind": "header", "optimizer": name, "params": run["params"], "restored_from": str(json_path),
              "date": run.get("recorded") or res.get("date"), "torch": run.get("torch") or res.get("torch")}
    lines = [header] + recs + [{"kind": "end", "steps": run["steps"], "wall_s": run["wall_s"]}]
    rec_path.write_text("".join(json.dumps(r) + "\n" for r in lines))
    print(f"[soak] {name}: records restored from {json_path} (run on {header['date']})", flush=True)


def analyse(name: str, header: dict, recs: list[dict], end: dict | None, args) -> dict:
    if not recs:
        raise SystemExit(f"{name}: no records")
    warm_step = max(args.every, int(args.rss_warmup * args.steps))
    warm = next(r for r in recs if r["step"] >= warm_step)
    after = [r for r in recs if r["step"] >= warm["step"]]
    rss0 = warm["rss_bytes"]
    growth_max = max(r["rss_bytes"] for r in after) - rss0
    growth_end = recs[-1]["rss_bytes"] - rss0
    # least-squares slope of RSS over steps after warm-up (bytes per 1000 steps)
    xs = [r["step"] for r in after]
    ys = [r["rss_bytes"] for r in after]
    if len(xs) > 1:
        mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
        den = sum((x - mx) ** 2 for x in xs)
        slope = 1000.0 * sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / den if den else 0.0
    else:
        slope = 0.0
    state = sorted({r["state_bytes"] for r in recs})
    vals = [(r["step"], r["val_loss"]) for r in recs if "val_loss" in r]
    ms = sorted(r["ms_per_step"] for r in recs)
    checks = {
        "no_nonfinite_loss": recs[-1]["nonfinite_losses"] == 0,
        "no_skipped_step": recs[-1]["skipped_steps"] == 0,
        "params_finite_at_every_record": all(r["params_finite"] for r in recs),
        "state_bytes_constant": len(state) == 1,
        "rss_no_growth_after_warmup": growth_max <= args.rss_tolerance_mib * 2**20,
        "completed": end is not None and end["steps"] == args.steps and recs[-1]["step"] == args.steps,
    }
    return {
        "optimizer": name,
        "params": header.get("params"),
        "recorded": header.get("date"),  # the day the worker ran (records restored from a soak.json: that day)
        "torch": header.get("torch"),
        "steps": recs[-1]["step"],
        "wall_s": end["wall_s"] if end else recs[-1]["elapsed_s"],
        "ms_per_step_median": ms[len(ms) // 2],
        "first_loss_window": recs[0]["loss_mean"],
        "final_loss_window": recs[-1]["loss_mean"],
        "final_val_loss": vals[-1][1] if vals else None,
        "val_loss": vals,
        "nonfinite_losses": recs[-1]["nonfinite_losses"],
        "skipped_steps": recs[-1]["skipped_steps"],
        "state_bytes_values": state,
        "state_bytes_per_param": state[-1] / header["params"] if header.get("params") else None,
        "rss_warmup_step": warm["step"],
        "rss_at_warmup_bytes": rss0,
        "rss_growth_max_bytes": growth_max,
        "rss_growth_end_bytes": growth_end,
        "rss_slope_bytes_per_1000_steps": slope,
        "checks": checks,
        "ok": all(checks.values()),
    }


def band(gefen: list[dict], adamw: list[dict]) -> dict | None:
    """Gefen's windowed mean loss against AdamW's window range [min, max] at the same steps."""
    by = {r["step"]: r for r in adamw}
    pairs = [(r, by[r["step"]]) for r in gefen if r["step"] in by and r["loss_mean"] is not None
             and by[r["step"]]["loss_mean"] is not None]
    if not pairs:
        return None
    inside = sum(1 for g, a in pairs if a["loss_min"] <= g["loss_mean"] <= a["loss_max"])
    rel = [100.0 * (g["loss_mean"] - a["loss_mean"]) / a["loss_mean"] for g, a in pairs]
    tail = rel[len(rel) // 2:]  # second half of the run
    return {
        "windows": len(pairs),
        "gefen_mean_inside_adamw_window_range": inside,
        "fraction_inside": inside / len(pairs),
        "rel_diff_pct_last_window": rel[-1],
        "rel_diff_pct_mean_second_half": sum(tail) / len(tail),
        "rel_diff_pct_max_abs_second_half": max(abs(v) for v in tail),
    }


def plot(series: dict[str, list[dict]], path: Path, title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = {"adamw": "tab:blue", "gefen": "tab:red"}
    fig, axs = plt.subplots(2, 2, figsize=(11, 7.5))
    ax = axs[0, 0]
    for name, recs in series.items():
        s = [r["step"] for r in recs if r["loss_mean"] is not None]
        m = [r["loss_mean"] for r in recs if r["loss_mean"] is not None]
        if name == "adamw":
            ax.fill_between(s, [r["loss_min"] for r in recs if r["loss_mean"] is not None],
                            [r["loss_max"] for r in recs if r["loss_mean"] is not None],
                            color=colors[name], alpha=0.15, label="adamw window min-max")
        ax.plot(s, m, color=colors.get(name), lw=1.2, label=f"{name} window mean")
        ev = [(r["step"], r["val_loss"]) for r in recs if "val_loss" in r]
        if ev:
            ax.plot(*zip(*ev), "o--", ms=3, color=colors.get(name), lw=0.8, label=f"{name} val")
    ax.set_ylabel("loss (nats/byte)")
    ax.set_title("training loss")
    ax.legend(fontsize=8)
    ax = axs[0, 1]
    for name, recs in series.items():
        ax.plot([r["step"] for r in recs], [r["state_bytes"] / 1024 for r in recs], color=colors.get(name),
                label=name)
    ax.set_yscale("log")
    ax.set_ylabel("optimizer state (KiB)")
    ax.set_title("optimizer state bytes")
    ax.legend(fontsize=8)
    ax = axs[1, 0]
    for name, recs in series.items():
        ax.plot([r["step"] for r in recs], [r["rss_bytes"] / 2**20 for r in recs], color=colors.get(name),
                label=name)
    ax.set_ylabel("RSS (MiB)")
    ax.set_title("process RSS")
    ax.legend(fontsize=8)
    ax = axs[1, 1]
    for name, recs in series.items():
        ax.plot([r["step"] for r in recs], [r["ms_per_step"] for r in recs], color=colors.get(name), lw=0.8,
                label=name)
    ax.set_ylabel("ms / step (window mean)")
    ax.set_title("step time (shared, loaded machine)")
    ax.legend(fontsize=8)
    for a in axs.flat:
        a.set_xlabel("step")
        a.grid(alpha=0.3)
    fig.suptitle(title)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}.png")
    fig.savefig(tmp, dpi=100)
    plt.close(fig)
    os.replace(tmp, path)


def _mib(b: float) -> str:
    return f"{b / 2**20:+.2f} MiB" if b else "0.00 MiB"


def render_section(res: dict) -> str:
    a = res["config"]
    L = [MARK_BEGIN, "", "_Generated by `benchmarks/soak.py`; do not edit by hand._", "",
         f"Command: `{res['command']}` ({res['wall_s'] / 60:.1f} min wall in total on {res['machine']}, "
         f"{res['date']}).", "",
         f"Model: `launch/gpt.py` preset `{a['model']}` ({res['runs'][next(iter(res['runs']))]['params']:,} "
         f"parameters), batch {a['batch_size']}, {a['steps']:,} steps per optimizer, lr {a['lr']} "
         f"(warm-up {a['warmup']}, cosine to 10%), clip 1.0, {a['threads']} thread; a record every "
         f"{a['every']} steps, validation every {a['eval_every']} steps.", "",
         "| | " + " | ".join(res["runs"]) + " |",
         "|---|" + "---|" * len(res["runs"])]

    def row(label, fn):
        L.append(f"| {label} | " + " | ".join(fn(r) for r in res["runs"].values()) + " |")

    row("run on (torch)", lambda r: f"{r.get('recorded') or 'n/a'} ({r.get('torch') or 'n/a'})")
    row("steps completed", lambda r: f"{r['steps']:,}")
    row("wall time", lambda r: f"{r['wall_s'] / 60:.1f} min ({r['ms_per_step_median']:.1f} ms/step median)")
    row("loss, first window -> last window", lambda r: f"{r['first_loss_window']:.4f} -> {r['final_loss_window']:.4f}")
    row("final validation loss", lambda r: "n/a" if r["final_val_loss"] is None else f"{r['final_val_loss']:.4f}")
    row("non-finite losses / skipped steps", lambda r: f"{r['nonfinite_losses']} / {r['skipped_steps']}")
    row("parameters finite at every record", lambda r: "yes" if r["checks"]["params_finite_at_every_record"] else "**no**")
    row("optimizer state bytes (distinct values seen)",
        lambda r: ", ".join(f"{v:,}" for v in r["state_bytes_values"])
        + (f" ({r['state_bytes_per_param']:.3f} B/param)" if r["state_bytes_per_param"] else ""))
    row("RSS at warm-up record", lambda r: f"{r['rss_at_warmup_bytes'] / 2**20:.1f} MiB (step {r['rss_warmup_step']:,})")
    row("RSS growth after warm-up: max / at end", lambda r: f"{_mib(r['rss_growth_max_bytes'])} / {_mib(r['rss_growth_end_bytes'])}")
    row("RSS trend after warm-up (least squares)", lambda r: f"{r['rss_slope_bytes_per_1000_steps'] / 1024:+.1f} KiB per 1,000 steps")
    row("all checks", lambda r: "pass" if r["ok"] else "**FAIL**: " + ", ".join(k for k, v in r["checks"].items() if not v))
    L.append("")
    runs = res["runs"]
    if {"gefen", "adamw"} <= runs.keys() and runs["gefen"]["final_val_loss"] and runs["adamw"]["final_val_loss"]:
        L.append(f"Quality: Gefen's final validation loss is "
                 f"{100 * (runs['gefen']['final_val_loss'] / runs['adamw']['final_val_loss'] - 1):+.2f}% against "
                 f"AdamW's (one seed).")
    b = res.get("band")
    if b:
        widths = [100.0 * (r["loss_max"] - r["loss_min"]) / r["loss_mean"]
                  for r in res.get("series", {}).get("adamw", []) if r.get("loss_mean")]
        width = f" (median width {statistics.median(widths):.0f}% of its mean)" if widths else ""
        L.append(f"Training loss, windowed means: Gefen vs AdamW {b['rel_diff_pct_last_window']:+.2f}% in the last "
                 f"window, {b['rel_diff_pct_mean_second_half']:+.2f}% on average over the second half (largest "
                 f"|difference| there {b['rel_diff_pct_max_abs_second_half']:.2f}%). Gefen's windowed mean lies "
                 f"inside AdamW's min-max range of batch losses{width} in {b['gefen_mean_inside_adamw_window_range']} "
                 f"of {b['windows']} windows: that range is batch-to-batch noise, so this is a check that nothing "
                 f"diverged, not a measure of quality.")
    L.append("")
    L.append(f"RSS criterion: growth from the warm-up record to the largest later value at most "
             f"{a['rss_tolerance_mib']} MiB. Summary and every record: `{res['json']}`.")
    L.append("")
    L.append(f"![soak]({res['png_rel']})")
    L.append("")
    L.append(MARK_END)
    return "\n".join(L)


def write_section(doc: Path, section: str) -> None:
    text = doc.read_text() if doc.exists() else "# Reliability\n\n## Soak\n\n"
    if MARK_BEGIN in text and MARK_END in text:
        pre, rest = text.split(MARK_BEGIN, 1)
        post = rest.split(MARK_END, 1)[1]
        text = pre + section + post
    else:
        text = text.rstrip("\n") + "\n\n" + section + "\n"
    tmp = doc.with_name(f".{doc.name}.tmp-{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, doc)


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    _defaults(args)
    if args.worker:
        run_worker(args)
        return 0
    out = Path(args.out).resolve()
    rec_dir = Path(args.records).resolve()
    names = [n.strip() for n in args.optimizers.split(",") if n.strip()]
    for n in names:  # records of an optimizer not run now: restored from the last report when absent
        if (args.report_only or (args.run is not None and n not in args.run.split(","))) \
                and not (rec_dir / f"soak_{n}.jsonl").exists():
            _restore_records(n, out / "results" / "soak.json", rec_dir / f"soak_{n}.jsonl")
    ran = [] if args.report_only else (names if args.run is None else [n.strip() for n in args.run.split(",") if n.strip()])
    missing = [n for n in names if n not in ran and not (rec_dir / f"soak_{n}.jsonl").exists()]
    if set(ran) - set(names) or missing:
        raise SystemExit(f"--run {args.run!r} must name some of --optimizers {args.optimizers!r}, and the others need "
                         f"records in {rec_dir}: missing {missing}" if missing else
                         f"--run {args.run!r} names optimizers outside --optimizers {args.optimizers!r}")
    t0 = time.time()
    if ran:
        for name in ran:
            cmd = [sys.executable, os.path.abspath(__file__), "--worker", name, "--records", str(rec_dir)]
            for k in ("steps", "every", "model", "batch_size", "lr", "warmup", "eval_every", "eval_batches",
                      "seed", "threads", "gefen_second_moment"):
                cmd += [f"--{k.replace('_', '-')}", str(getattr(args, k))]
            print(f"[soak] {name}: {args.steps} steps, records in {rec_dir / f'soak_{name}.jsonl'}", flush=True)
            r = subprocess.run(cmd, cwd=ROOT)
            if r.returncode:
                print(f"[soak] {name} worker failed (rc {r.returncode})", flush=True)
                return r.returncode
    series, runs = {}, {}
    for name in names:
        header, recs, end = _read(rec_dir / f"soak_{name}.jsonl")
        series[name] = recs
        runs[name] = analyse(name, header, recs, end, args)
    is_docs = out == (ROOT / "docs").resolve()
    json_path = out / "results" / "soak.json"
    png = out / "img" / "soak.png"
    doc = out / "reliability.md"
    cmd_line = "nice -n 10 python benchmarks/soak.py" + ("" if argv is None and len(sys.argv) == 1 else
                                                          " " + " ".join(sys.argv[1:] if argv is None else argv))
    res = {
        "command": cmd_line.strip(),
        "config": {k: v for k, v in vars(args).items() if k not in ("worker", "report_only")},
        "machine": f"{platform.machine()} CPU, {os.cpu_count()} cores (shared with other jobs)",
        "date": time.strftime("%Y-%m-%d"),
        "wall_s": sum(r["wall_s"] for r in runs.values()) if args.report_only or set(names) != set(ran)
        else time.time() - t0,
        "torch": __import__("torch").__version__,
        "runs": runs,
        "band": band(series["gefen"], series["adamw"]) if {"gefen", "adamw"} <= series.keys() else None,
        "records": os.path.relpath(rec_dir, ROOT) + "/soak_<optimizer>.jsonl",
        "series": series,
        "json": os.path.relpath(json_path, ROOT),
        "png_rel": os.path.relpath(png, doc.parent),
        "ok": all(r["ok"] for r in runs.values()),
    }
    json_path.parent.mkdir(parents=True, exist_ok=True)
    tmp = json_path.with_name(f".{json_path.name}.tmp-{os.getpid()}")
    tmp.write_text(json.dumps(res, indent=1))
    os.replace(tmp, json_path)
    plot(series, png, f"soak: {args.model} GPT, batch {args.batch_size}, {args.steps:,} steps")
    write_section(doc, render_section(res))
    print(render_section(res), flush=True)
    print(f"[soak] wrote {json_path}, {png}, {doc}" + ("" if is_docs else " (not the docs)"), flush=True)
    return 0 if res["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
