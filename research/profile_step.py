"""Where ``Gefen.step()``'s time goes on the GPT-2-small tensor set (the research/speed-log.md entry of
2026-12-03): cProfile over ``--steps`` steps of the default, one thread, synthetic gradients.

    python research/profile_step.py [--steps 3] [--top 18] [--shape 1x1000000]

Builds the tensors with ``benchmarks/_gpt2.py``'s ``gpt2_shapes()`` (124,439,808 parameters, ~1.5 GiB
of parameters, gradients and state), takes one untimed first step (it learns the codebook), times a
few steps, then prints the profile sorted by own time.
"""
from __future__ import annotations

import argparse
import cProfile
import pstats
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]

import gefen_dist  # noqa: E402
from _gpt2 import gpt2_shapes  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--top", type=int, default=18)
    ap.add_argument("--shape", help="one tensor of this shape (e.g. 1x1000000) instead of the GPT-2-small set")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(0)
    shapes = [tuple(int(x) for x in args.shape.split("x"))] if args.shape else [s for _, s in gpt2_shapes()]
    ps = [torch.nn.Parameter(torch.randn(s, generator=gen) * 0.02) for s in shapes]
    opt = gefen_dist.Gefen(ps, lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1)
    for p in ps:
        p.grad = torch.randn(p.shape, generator=gen) * 1e-3
    opt.step()
    ts = []
    for _ in range(args.steps):
        t = time.perf_counter()
        opt.step()
        ts.append(time.perf_counter() - t)
    print("step ms:", [round(1e3 * x, 1) for x in ts])
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(args.steps):
        opt.step()
    pr.disable()
    pstats.Stats(pr).sort_stats("tottime").print_stats(args.top)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
