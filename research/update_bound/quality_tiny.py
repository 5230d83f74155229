"""Ordinary training with the bounding mechanisms: benchmarks/quality.py's workloads, paired.

    python research/update_bound/quality_tiny.py --workload lm --steps 300 --seeds 0,1 \
        --variants adamw,gefen_default,a_clampK,... [--out results/quality_tiny.jsonl]

``lm``: quality.py's byte-level GPT, ``tiny`` preset (2 layers, d 64), context 64, batch 16,
warm-up 20 then cosine, lr 2e-3, betas (0.9, 0.95), wd 0.1 on >=2-D. ``digits``: quality.py's
digits MLP, 300 steps, lr 2e-3, betas (0.9, 0.999). A mechanism variant is the library default
(``gefen_default``: factored, row_blocks "auto", fused=False) with ``mech.MECHS[name]`` installed.
Each run appends one JSON line to ``--out``.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
for p in (HERE, ROOT, ROOT / "benchmarks"):
    sys.path.insert(0, str(p))

import torch

import mech
import quality as Q  # benchmarks/quality.py


def _mech_factory(name, second_moment="factored"):
    m, mkw = mech.MECHS[name]

    def make(groups, lr, betas, seed):
        from gefen_dist import Gefen
        mech.use(m, **mkw)
        return Gefen(groups, lr=lr, betas=betas, eps=1e-8, fused=False, row_blocks="auto",
                     second_moment=second_moment)
    return make


mech.MECHS.setdefault("patched_none", ("none", {}))  # the re-implemented step, no mechanism (identity check)
for _n in mech.MECHS:
    Q.VARIANTS[_n] = (f"gefen_default + mechanism {_n}", _mech_factory(_n))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--workload", default="lm", choices=("lm", "digits"))
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--seeds", default="0")
    ap.add_argument("--variants", default="adamw,gefen_default,a_clampK")
    ap.add_argument("--out", default=str(HERE / "results" / "quality_tiny.jsonl"))
    a = ap.parse_args()
    torch.set_num_threads(1)
    if a.workload == "lm":
        cfg = dict(preset="tiny", batch=16, context=64, steps=a.steps, warmup=20, val_batches=5,
                   eval_every=max(1, a.steps // 4), lr=2e-3, betas=(0.9, 0.95), weight_decay=0.1,
                   min_lr_frac=0.1, grad_clip=None)
    else:
        cfg = dict(steps=a.steps, batch=64, lr=2e-3, betas=(0.9, 0.999), weight_decay=0.01, eval_every=50,
                   model="MLP 64-256-256-10 GELU", schedule="constant")
    for s in (int(x) for x in a.seeds.split(",")):
        for v in a.variants.split(","):
            mech.use(None)
            t0 = time.perf_counter()
            r = Q.run_lm(v, s, cfg) if a.workload == "lm" else Q.run_digits(v, s, cfg)
            stats = dict(mech.STATS)
            mech.use(None)
            rec = dict(workload=a.workload, steps=a.steps, variant=v, seed=s, val_loss=r["val_loss"],
                       val_acc=r.get("val_acc"), final_train=r["train_loss"][-1],
                       max_r_before=stats["max_r_before"], max_r_after=stats["max_r_after"],
                       frac_over_K=stats["n_over"] / max(1, stats["n"]),
                       seconds=round(time.perf_counter() - t0, 1))
            print(json.dumps(rec), flush=True)
            with open(a.out, "a") as f:
                f.write(json.dumps(rec) + "\n")


if __name__ == "__main__":
    main()
