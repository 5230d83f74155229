"""How far the first gradient of each narrow-row tensor reaches, on the workloads of
benchmarks/narrow_quality.py: the statistic an automatic choice between the per-row layout and
blocks of rows (D16) would read at learning (research/narrow-rows.md).

    python research/narrow_reach.py [--seeds 0,1,2] [--out research/results/narrow_reach.json]

For every tensor whose rows hold fewer than 80 elements (``core.span.span_eligible``) and that is
quantized (at least 4096 elements), the share of its rows on which the first step's gradient has a
nonzero element (``core.span.rows_reached``); each workload is stopped at its first optimizer step.
Also ``narrow_mlp`` with issue 26's mostly-dead first batch (a dense layer whose first gradient is
1% dense: the case an automatic choice would get wrong).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks"), str(ROOT / "tests")]

import narrow_quality as nq  # noqa: E402
from gefen_dist import Gefen  # noqa: E402
from gefen_dist.core.span import SpanPiece, rows_reached, span_eligible  # noqa: E402


class _FirstStep(Exception):
    pass


def _dead_first_batch(name, seed):
    """narrow_quality's narrow_mlp with issue 26's mostly-dead first batch (1% of its gradient)."""
    from _workloads import dead_first_batch_mlp

    return dead_first_batch_mlp(lambda ps: nq.make_opt(name, list(ps), lr=1e-3, betas=(0.9, 0.999),
                                                       weight_decay=0.0), seed=seed, density=0.01)


WORKLOADS = dict(nq.WORKLOADS, narrow_mlp_dead_first_batch=_dead_first_batch)


def first_reach(workload: str, seed: int) -> list:
    """[(shape, share of rows reached)] at ``workload``'s first step (the per-row default's run)."""
    orig = Gefen.step

    def step(self, *a, **k):
        raise _FirstStep([(list(p.shape), rows_reached(p.grad, SpanPiece.of(p.shape)))
                          for g in self.param_groups for p in g["params"]
                          if p.grad is not None and span_eligible(p.shape) and p.numel() >= 4096])

    Gefen.step = step
    try:
        WORKLOADS[workload]("gefen_rows", seed)
    except _FirstStep as e:
        return e.args[0]
    finally:
        Gefen.step = orig
    raise RuntimeError(f"{workload} took no optimizer step")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--out", default=str(ROOT / "research" / "results" / "narrow_reach.json"))
    a = ap.parse_args(argv)
    res = {w: {s: first_reach(w, int(s)) for s in a.seeds.split(",")} for w in WORKLOADS}
    for w, by_seed in res.items():
        for s, rows in by_seed.items():
            print(w, "seed", s, ", ".join(f"{tuple(sh)}: {r:.1%}" for sh, r in rows))
    Path(a.out).write_text(json.dumps(res, indent=1) + "\n")
    print("wrote", a.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
