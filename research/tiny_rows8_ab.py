"""The row codes of ``narrow_rows="rows8"`` (D19) on the ``tiny`` byte-level LM, paired by seed.

The ``tiny`` preset (d_model 64) is the one language model here whose weights have rows of 22-79
elements: every weight but the MLP's ``c_proj`` has rows of 64, so ``"rows8"`` keeps almost the whole
model in one-byte row codes. This prints, per seed (3,000 steps, the harness of docs/quality.md), the
final validation loss of AdamW and of each Gefen setting, each setting's gap to AdamW, and the gaps
of the row-code settings to ``"auto"`` (the default: per row in float32) with their mean and 95%
t-interval. The runs:

    python research/quality_variants.py --only gefen_auto,w_auto_rb1,w_rows8 --workloads lm --seeds 0,1,2 \\
        --lm-preset tiny --lm-context 64 --lm-steps 3000 --no-report --no-gpt2-bytes \\
        --runs-file research/results/tiny_rows8_ab/runs.jsonl
    python research/quality_variants.py --only w_rows8_s16,w_rows8_v32 ... \\
        --runs-file research/results/tiny_rows8_ab/runs_format.jsonl
    python research/quality_variants.py --only gefen_auto,adamw --seeds 3,4,5,6,7 ... --runs-file .../runs_a.jsonl
    python research/quality_variants.py --only w_rows8 --seeds 3,4,5,6,7 ... --runs-file .../runs_b.jsonl
    python research/quality_variants.py --only w_rows8_exact_v --seeds 0,1,2 ... --runs-file .../runs_w_rows8_exact_v.jsonl
    (and w_rows8_exact_scale into runs_w_rows8_exact_scale.jsonl; one process each: they patch the step's hooks)

AdamW's runs of seeds 0-2 are docs/results/quality_runs.jsonl's (the same harness); a setting is
shown on the seeds where it has runs.

    python research/tiny_rows8_ab.py [--md]
"""
from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "benchmarks")]

from seed_gaps import load_finals, t95  # noqa: E402

R = ROOT / "research" / "results" / "tiny_rows8_ab"
SETTINGS = [
    ("gefen_auto", "`auto` (the default: rows of 64 per row in float32, D12's row-block profiles)"),
    ("w_auto_rb1", "`auto`, one column profile per tensor (`row_blocks=1`)"),
    ("w_rows8", "`rows8` (one-byte row codes: scale 8 codes per octave, v 16; one column profile)"),
    ("w_rows8_s16", "`rows8`, scale in 16 codes per octave (format experiment)"),
    ("w_rows8_v32", "`rows8`, v in 32 codes per octave (format experiment)"),
    ("w_rows8_exact_v", "`rows8`, each row's v in float32 beside the codes (control: only the scale coded)"),
    ("w_rows8_exact_scale", "`rows8`, each row's scale its maximum in float32 (control: only v coded)"),
]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--md", action="store_true", help="print a markdown table")
    args = ap.parse_args(argv)
    files = [ROOT / "docs/results/quality_runs.jsonl"] + sorted(R.glob("runs*.jsonl"))
    fin = load_finals(files, "tiny", 3000)
    seeds = sorted(s for v, s in fin if v == "gefen_auto" and ("adamw", s) in fin)
    names = [(v, d) for v, d in SETTINGS if any((v, s) in fin for s in seeds)]

    def gap(v, base, s):
        return 100 * (fin[(v, s)]["val"] / fin[(base, s)]["val"] - 1)

    def interval(xs):
        if len(xs) < 2:
            return "n/a"
        h = t95(len(xs)) * statistics.stdev(xs) / len(xs) ** 0.5
        return f"[{statistics.fmean(xs) - h:+.2f}, {statistics.fmean(xs) + h:+.2f}]"

    head = ["setting"] + [f"seed {s}" for s in seeds] + ["vs AdamW, mean [95% interval]", "vs `auto` per seed (points)",
                                                         "vs `auto`, mean [95% interval]"]
    rows = [["AdamW"] + [f"{fin[('adamw', s)]['val']:.4f}" for s in seeds] + ["", "", ""]]
    for v, desc in names:
        mine = [s for s in seeds if (v, s) in fin]
        ga = [gap(v, "adamw", s) for s in mine]
        gd = [gap(v, "gefen_auto", s) for s in mine]
        rows.append([desc] + [f"{fin[(v, s)]['val']:.4f}" if (v, s) in fin else "" for s in seeds]
                    + [f"{statistics.fmean(ga):+.2f}% {interval(ga)}"] + (
            ["", ""] if v == "gefen_auto" else [", ".join(f"{x:+.2f}" for x in gd),
                                                f"{statistics.fmean(gd):+.2f} {interval(gd)} ({len(mine)} seeds)"]))
    if args.md:
        print("| " + " | ".join(head) + " |")
        print("|" + "---|" * len(head))
        for r in rows:
            print("| " + " | ".join(r) + " |")
    else:
        for r in [head] + rows:
            print("  ".join(r))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
