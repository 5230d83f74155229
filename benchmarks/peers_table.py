"""Gefen's default and the memory-saving peers against AdamW on the `small` and `base` LMs, one table.

    python benchmarks/peers_table.py                 # print the table
    python benchmarks/peers_table.py --write         # and splice it into docs/quality.md (peers_table markers)
    python benchmarks/peers_table.py --plot docs/img/quality_seed_gaps.png   # and draw every run's gap

Nothing is measured here: it reads the runs files ``benchmarks/quality.py`` wrote (one JSON line per
optimizer and seed, the same harness, model, data order and schedule for every optimizer) and pairs
every optimizer with AdamW seed by seed (``benchmarks/seed_gaps.py``): the gap is
``val_loss / val_loss(AdamW) - 1`` on the same seed. A seed where AdamW stalls on the early plateau
(its final loss more than 2% above its median over the seeds on `small`, the rule of ``seed_gaps.py``;
5% on `base`: ``STALL_FRAC``) is shown
but left out of the mean. State bytes per parameter are the optimizers' own counts on that model
(``result.bytes_per_param``) and on the GPT-2-small tensor set (``docs/results/step_speed_peers_avx2.json``). Which runs files and seeds: ``RUNS`` below; the hosts are in each record.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

from _docs import splice  # noqa: E402
from seed_gaps import load_finals, seed_gaps  # noqa: E402

R, D = ROOT / "research" / "results", ROOT / "docs" / "results"
# per preset: AdamW's runs files, and per optimizer the files its runs are read from (only those: the
# stored files also hold runs of earlier defaults under the same name, gefen_default)
ADAMW = {"small": [D / "quality_runs.jsonl", D / "quality_runs_r15.jsonl", R / "bounded_small" / "runs_adamw_repro.jsonl"],
         "base": [D / "quality_runs.jsonl", R / "default_base" / "runs_adamw.jsonl"]}
ROWS = [("v_default_fused", "Gefen, the default (shipped: D17's codebook fit, native step)", "d17"),
        ("gefen_default", "Gefen, the default before D17 (2026-12-04)", "default"),
        ("v_nibbles", 'Gefen, `second_moment="nibbles"` (D20, its i.i.d. draws)', "nibbles"),
        ("v_nibbles", 'Gefen, `second_moment="nibbles"` with quasi-random draws (2026-12-07, withdrawn)', "nibbles_qr"),
        ("bnb_adamw8bit", "bitsandbytes AdamW8bit 0.50.2", "peers"),
        ("ao_adamw8bit", "torchao AdamW8bit 0.18.0", "peers"),
        ("ao_adamw4bit", "torchao AdamW4bit 0.18.0", "peers"),
        ("adam_mini", "Adam-mini 1.1.1", "peers")]
# a run "stalls" when its final loss is more than this fraction above AdamW's median over the seeds: 2% on
# `small` (seed_gaps.py's rule); 5% on `base`, whose stalled runs end 15-20% above and where with seeds 10 and 11
# AdamW's median fell so that the 2% rule would count AdamW's seed 3 (+2.2%; it left the early plateau, window
# mean 2.394: research/early_stall.py) as a stall
STALL_FRAC = {"small": 0.02, "base": 0.05}
# the same optimizers' state on the GPT-2-small tensor set (benchmarks/step_speed.py's methods)
GPT2_STATE = (D / "step_speed_peers_avx2.json",
              {"v_default_fused": "Gefen_e2e_fused", "gefen_default": "Gefen_e2e_fused", "bnb_adamw8bit": "bnb_adamw8bit", "ao_adamw8bit": "torchao_adamw8bit",
               "ao_adamw4bit": "torchao_adamw4bit", "adam_mini": "adam_mini"})


# the runs of a kind other than ``<kind>_<preset>/runs.jsonl``: the shipped default since D17 (the library's
# defaults on the native step, research/quality_variants.py's v_default_fused) and second_moment="nibbles" (its
# draws i.i.d. per step; from 2026-12-07 to 2026-12-08 quasi-random in time: nibbles_qr; both record v_nibbles)
GLOBS = {"d17": ("d17_{preset}", "runs_v_default_fused*.jsonl"), "nibbles": ("nibbles_{preset}", "runs_v_nibbles_*.jsonl"),
         "nibbles_qr": ("nibbles_qr_{preset}", "runs_v_nibbles_*.jsonl")}


def files_of(preset: str, kind: str) -> list:
    """The runs files of ``kind`` (default, peers, d17, nibbles) on ``preset`` that exist."""
    if kind in GLOBS:
        folder, pattern = GLOBS[kind]
        return sorted((R / folder.format(preset=preset)).glob(pattern))
    return [f for f in (R / f"{kind}_{preset}" / "runs.jsonl",) if f.exists()]


def finals(preset: str, variant: str, kind: str) -> dict:
    """AdamW's runs and ``variant``'s (from its own files only) on ``preset``, for seed_gaps."""
    out = {k: v for k, v in load_finals([f for f in ADAMW[preset] if f.exists()], preset=preset).items()
           if k[0] == "adamw"}
    out.update({k: v for k, v in load_finals(files_of(preset, kind), preset=preset).items() if k[0] == variant})
    return out


MARKER = "peers_table"


def _bytes(preset: str, variant: str, kind: str):
    """The bytes/param a variant's runs record on ``preset`` (they agree across seeds)."""
    for p in files_of(preset, kind):
        for line in p.read_text().splitlines():
            r = json.loads(line) if line.strip() else None
            if r and r["variant"] == variant and r["config"].get("preset") == preset:
                return r["result"]["bytes_per_param"]
    return None


# Gefen layouts the step benchmark did not run: their second_moment, for gefen_dist.plan's count
GPT2_PLANNED = {"v_nibbles": "nibbles"}


def _gpt2_planned(variant: str):
    """The state bytes per parameter on the GPT-2-small tensor set by ``gefen_dist.plan`` (the optimizer's
    own count: tests/test_cli.py) for a layout of ``GPT2_PLANNED``, else None."""
    if variant not in GPT2_PLANNED:
        return None
    from step_speed import gpt2_shapes

    from gefen_dist.plan import TensorSpec, estimate_from_shapes

    specs = [TensorSpec(name, tuple(shape)) for name, shape in gpt2_shapes()]
    return estimate_from_shapes(specs, second_moment=GPT2_PLANNED[variant]).gefen_bytes_per_param


def cell(finals: dict, variant: str, preset: str) -> str:
    try:
        res = seed_gaps(finals, variant, stall_frac=STALL_FRAC[preset])
    except ValueError:
        return "not run"
    per = ", ".join(("%+.2f%%" % r["gap_pct"]) + ("" if r["base_trains_well"] else " (AdamW stalls)")
                    for r in res["seeds"])
    tw = res["trains_well"]
    if tw.get("n", 0) >= 2:
        ci = tw.get("ci95")
        head = f"**{tw['mean']:+.2f}%** mean of {tw['n']}" + (f" [{ci[0]:+.2f}%, {ci[1]:+.2f}%]" if ci else "")
        return (f"{head}; seeds {', '.join(str(r['seed']) for r in res['seeds'])}: {per}{_split(res)}"
                f"{_unconditional(res, _adamw_stalls(finals, preset))}")
    n = len(res["seeds"])
    return f"seed{'s' if n > 1 else ''} {', '.join(str(r['seed']) for r in res['seeds'])}: {per}"


def _adamw_stalls(finals: dict, preset: str) -> list:
    """The seeds of AdamW's stored runs on ``preset`` where it stalls (seed_gaps' rule, over all its seeds)."""
    return seed_gaps(finals, "adamw", stall_frac=STALL_FRAC[preset])["stalled_seeds"]


def _unconditional(res: dict, stalls: list) -> str:
    """Where the runs include seeds on which AdamW stalls: the mean over every paired seed. The headline
    leaves out AdamW's stalls but keeps the other optimizer's, so on a workload whose runs split on a plateau
    it counts against any optimizer whose stalls fall on other seeds than AdamW's; this figure does not,
    where the optimizer ran on every seed on which AdamW stalls (``stalls``; else the missing ones are named)."""
    a, tw = res["all"], res["trains_well"]
    if a.get("n", 0) <= tw.get("n", 0) or a.get("n", 0) < 2:
        return ""
    ci = a.get("ci95")
    missing = sorted(set(stalls) - {r["seed"] for r in res["seeds"]})
    return (f"; over all {a['n']} seeds, AdamW's stalls included, {a['mean']:+.2f}%"
            + (f" [{ci[0]:+.2f}%, {ci[1]:+.2f}%]" if ci else "")
            + (f" (not run on seed{'s' if len(missing) > 1 else ''} {', '.join(map(str, missing))}, where AdamW "
               "stalls too)" if missing else ""))


def _split(res: dict) -> str:
    """Where one of the two stalls alone: the offset on the seeds where both train well, and how the
    stalls split (which seeds stall moves with any systematic change of the optimizer, AdamW's lr x1.1
    included: research/early_stall.py, docs/quality.md)."""
    d, bw = res["discordant"], res["both_train_well"]
    if d["only_base"] and not d["only_variant"]:  # the headline's seeds are those where both train well
        return f"; stalls alone: AdamW {len(d['only_base'])}, this 0 (exact McNemar p = {d['p']:.2f})"
    if not d["only_variant"] or bw.get("n", 0) < 2:  # else "both train well" is the headline's seeds
        return ""
    ci = bw.get("ci95")
    return (f"; where both train well {bw['mean']:+.2f}% (mean of {bw['n']}"
            + (f" [{ci[0]:+.2f}%, {ci[1]:+.2f}%]" if ci else "") + f"); stalls alone: AdamW {len(d['only_base'])}, "
            f"this {len(d['only_variant'])} (exact McNemar p = {d['p']:.2f})")


def table() -> str:
    params, hosts = {}, set()
    for preset in ("small", "base"):
        for _, _, kind in ROWS:
            for f in files_of(preset, kind):
                for line in f.read_text().splitlines():
                    r = json.loads(line) if line.strip() else None
                    if r and r["workload"] == "lm" and r["config"].get("preset") == preset:
                        params[preset] = r["result"]["params"]
                        hosts.add(r.get("host") or "not recorded")
    out = ["<!-- generated by `python benchmarks/peers_table.py --write`; do not edit -->", "",
           f"Validation loss against AdamW with the same recipe, paired by seed (`small`: {params.get('small', 0):,} "
           f"parameters, `base`: {params.get('base', 0):,}; 800 steps; 95% t-intervals over the seeds where AdamW "
           f"trains well). State in bytes per parameter on `small` (fp32 AdamW: 8). Hosts of the runs: "
           + "; ".join(sorted(hosts)) + " (AdamW's runs are stable across hosts to ~3e-4 relative, Gefen's to a few "
           "tenths of a percent: docs/quality.md).", "",
           "| optimizer | state B/param, `small` | state B/param, GPT-2 small | `small` | `base` |",
           "|---|---|---|---|---|"]
    g2 = json.loads(GPT2_STATE[0].read_text())["results"]["fp32"]["methods"]
    for v, name, kind in ROWS:
        b = _bytes("small", v, kind)
        b2 = g2.get(GPT2_STATE[1].get(v), {}).get("state_bytes_per_param") or _gpt2_planned(v)
        out.append(f"| {name} | {'%.3f' % b if b else 'n/a'} | {'%.3f' % b2 if b2 else 'n/a'} | "
                   f"{cell(finals('small', v, kind), v, 'small')} | {cell(finals('base', v, kind), v, 'base')} |")
    return "\n".join(out) + "\n"


# the plot's short names of ROWS, in order
SHORT = ["default (D17)", "default before D17", "nibbles (i.i.d. draws)", "nibbles, quasi draws (withdrawn)",
         "bnb 8-bit", "torchao 8-bit", "torchao 4-bit", "Adam-mini"]
XLIM = (-4.0, 8.0)  # gaps beyond are drawn at the edge, their value written beside them


def plot(path: Path) -> None:
    """Every run's gap to AdamW (one dot per seed; hollow where AdamW stalls) and each row's mean with its
    95% interval over the seeds where AdamW trains well, `small` and `base` side by side."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2), sharey=True)
    ys = list(range(len(ROWS)))[::-1]
    for ax, preset in zip(axes, ("small", "base")):
        for y, (v, _, kind) in zip(ys, ROWS):
            try:
                res = seed_gaps(finals(preset, v, kind), v, stall_frac=STALL_FRAC[preset])
            except ValueError:
                continue
            clipped = {XLIM[0]: [], XLIM[1]: []}
            for r in res["seeds"]:
                g = r["gap_pct"]
                x = min(max(g, XLIM[0]), XLIM[1])
                ax.plot([x], [y], "<" if g < XLIM[0] else (">" if g > XLIM[1] else "o"), ms=5, alpha=0.8,
                        color="C0", mfc="C0" if r["base_trains_well"] else "none")
                if x != g:
                    clipped[x].append(g)
            for x, gs in clipped.items():
                if gs:
                    ax.annotate(", ".join(f"{g:+.0f}%" for g in sorted(gs)), (x, y), xytext=(0, 5),
                                textcoords="offset points", fontsize=7, ha="right" if x > 0 else "left")
            tw = res["trains_well"]
            if tw.get("n", 0) >= 2:
                ci = tw.get("ci95") or (tw["mean"], tw["mean"])
                lo, hi = max(ci[0], XLIM[0]), min(ci[1], XLIM[1])
                ax.plot([lo, hi], [y - 0.28] * 2, "-", color="C3", lw=2)
                if XLIM[0] <= tw["mean"] <= XLIM[1]:
                    ax.plot([tw["mean"]], [y - 0.28], "|", color="C3", ms=10, mew=2)
        ax.axvline(0, color="k", lw=0.8)
        ax.axvline(0.3, color="C2", lw=0.8, ls="--")
        ax.set_xlim(XLIM[0] - 0.3, XLIM[1] + 0.3)
        ax.set_title(f"`{preset}` LM, 800 steps")
        ax.set_xlabel("validation loss vs AdamW, same seed (%)")
        ax.grid(axis="x", alpha=0.3)
    axes[0].set_yticks(ys)
    axes[0].set_yticklabels(SHORT)
    fig.suptitle("Every run against AdamW. Dots: seeds (hollow where AdamW stalls; arrows beyond the axis). Red: mean and\n"
                 "95% interval over the seeds where AdamW trains well (cut at the axis). Green: +0.3%, issue 26's bar",
                 fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--write", action="store_true", help="splice into docs/quality.md")
    ap.add_argument("--plot", type=Path, help="draw every run's gap to AdamW into this PNG")
    args = ap.parse_args(argv)
    md = table()
    print(md)
    if args.write and not splice(ROOT / "docs" / "quality.md", MARKER, md):
        raise SystemExit("docs/quality.md has no peers_table markers")
    if args.plot:
        plot(args.plot)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
