"""Tables for NOTES.md from the committed results (no training).

    python research/update_bound/summarize.py
"""
from __future__ import annotations

import json
import statistics
from pathlib import Path

R = Path(__file__).resolve().parent / "results"


def workloads():
    rows = []
    for f in sorted(R.glob("workloads_*.json")):
        rows += json.loads(f.read_text())
    by = {}
    for r in rows:
        by.setdefault(r["opt"], {}).setdefault(r["workload"], []).append(r)
    ws = ["posemb", "valuehead", "elementwise", "bag", "dead"]
    print("| optimizer | posemb max|dp|/lr | value head | elementwise | bag max|dp|/lr | bag loss (vs AdamW) | bag max|W| "
          "| dead max|dp|/lr | dead loss (vs AdamW) |")
    print("|---|---|---|---|---|---|---|---|---|")
    ref = {w: statistics.mean(r["loss"] for r in by["adamw"][w]) for w in ("bag", "dead") if w in by.get("adamw", {})}
    for o, d in by.items():
        cells = []
        for w in ws:
            rs = d.get(w, [])
            if not rs:
                cells += ["", "", ""] if w == "bag" else (["", ""] if w == "dead" else [""])
                continue
            cells.append(f"{max(r['max_step'] for r in rs):,.2f}")
            if w in ("bag", "dead"):
                loss = statistics.mean(r["loss"] for r in rs)
                cells.append(f"{rs[0]['loss0']:.2f} -> {loss:.4f} ({100 * (loss / ref[w] - 1):+.1f}%)")
            if w == "bag":
                cells.append(f"{max(r['max_w'] for r in rs):.2f}")
        seeds = sorted({r["seed"] for w in d for r in d[w]})
        print(f"| {o} (seeds {','.join(map(str, seeds))}) | " + " | ".join(cells) + " |")


def quality(name):
    f = R / f"quality_tiny_{name}.jsonl"
    if not f.exists():
        return
    recs = {}
    for line in f.read_text().splitlines():
        r = json.loads(line)
        recs[(r["variant"], r["seed"])] = r  # newest wins
    seeds = sorted({s for _, s in recs})
    variants = list(dict.fromkeys(v for v, _ in recs))
    print(f"\n{name}: validation loss per seed; mean gap vs gefen_default and vs AdamW (paired, seeds with both)")
    print("| variant | " + " | ".join(f"seed {s}" for s in seeds) + " | vs default | vs AdamW | share of elements over K_t |")
    print("|---|" + "---|" * (len(seeds) + 3))
    for v in variants:
        vals = [recs.get((v, s)) for s in seeds]
        cells = [f"{r['val_loss']:.4f}" if r else "" for r in vals]

        def gap(refv):
            g = [100 * (recs[(v, s)]["val_loss"] / recs[(refv, s)]["val_loss"] - 1)
                 for s in seeds if (v, s) in recs and (refv, s) in recs]
            return f"{statistics.mean(g):+.2f}% (n={len(g)})" if g else ""
        fr = [r.get("frac_over_K") for r in vals if r and r.get("frac_over_K") is not None]
        print(f"| {v} | " + " | ".join(cells) + f" | {gap('gefen_default')} | {gap('adamw')} | "
              f"{(f'{100 * statistics.mean(fr):.2f}%' if fr else '')} |")


if __name__ == "__main__":
    workloads()
    quality("lm")
    quality("digits")
