"""Process CPU time of ``Gefen.step()`` on one narrow-row tensor (the A/B measure of the span update's
builds in research/speed-log.md, 2026-12-06).

    python research/narrow_step_time.py SHAPE NARROW_ROWS [--steps 80] [--threads 1]
    python research/narrow_step_time.py 50000,22 rows8

Two untimed steps first (the first learns the codebook), then ``--steps`` steps each timed alone;
prints the tensor's mode and the median in milliseconds. For an A/B of two builds of the native
kernel, run it alternately from two trees (their libraries are cached under different hashes).
"""
from __future__ import annotations

import argparse
import logging
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from gefen_dist import Gefen  # noqa: E402


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("shape")
    ap.add_argument("narrow_rows", choices=("auto", "rows", "span", "rows8"))
    ap.add_argument("--steps", type=int, default=80)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args(argv)
    logging.getLogger("gefen_dist").setLevel(logging.ERROR)  # the dense-span notice is not the point here
    torch.set_num_threads(args.threads)
    shape = tuple(int(x) for x in args.shape.split(","))
    p = torch.nn.Parameter(torch.randn(shape) * 0.02)
    opt = Gefen([p], lr=1e-3, narrow_rows=args.narrow_rows)
    p.grad = torch.randn(shape, generator=torch.Generator().manual_seed(0))
    opt.step()
    opt.step()
    ts = []
    for _ in range(args.steps):
        t0 = time.process_time()
        opt.step()
        ts.append(time.process_time() - t0)
    print(f"{shape} narrow_rows={args.narrow_rows!r} ({opt._mode(p)}): median {1e3 * statistics.median(ts):.2f} ms "
          f"over {args.steps} steps, {args.threads} thread(s)")


if __name__ == "__main__":
    main()
