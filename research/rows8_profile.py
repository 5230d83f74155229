"""Where a ``narrow_rows="rows8"`` step's time goes (D19), CPU: cProfile of ``Gefen.step()`` on one tensor.

    python research/rows8_profile.py [--shape 50000,22] [--steps 20] [--threads 1]

Prints the process CPU time per step of the whole step (no profiler), then under cProfile the
milliseconds per step of the second phase (``kernels/cpu_span.py``'s
``span_apply_``: the span kernel's update with blocks of one row), the first phase
(``span_statistics``) and the row codes (``core/rows8.py``'s encode and decode functions), from
cProfile's cumulative times (two untimed steps first: the first learns the codebook).
"""
from __future__ import annotations

import argparse
import cProfile
import pstats
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from gefen_dist import Gefen  # noqa: E402


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="50000,22")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    shape = tuple(int(s) for s in args.shape.split(","))
    p = torch.nn.Parameter(torch.randn(shape) * 0.02)
    opt = Gefen([p], lr=1e-3, narrow_rows="rows8")
    p.grad = torch.randn(shape, generator=torch.Generator().manual_seed(0))
    opt.step()
    opt.step()
    assert opt._mode(p) == "rows8", opt._mode(p)
    t0 = time.process_time()
    for _ in range(args.steps):
        opt.step()
    total = (time.process_time() - t0) / args.steps
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(args.steps):
        opt.step()
    pr.disable()
    cum = {}
    for (fname, _, func), (_, _, _, ct, _) in pstats.Stats(pr).stats.items():
        cum[(Path(fname).name, func)] = cum.get((Path(fname).name, func), 0.0) + ct
    ms = lambda s: 1e3 * s / args.steps  # noqa: E731
    codes = sum(cum.get(("rows8.py", f), 0.0) for f in ("rows8_state_", "decode_scale"))
    print(f"{shape}, {args.threads} thread(s), {args.steps} steps: Gefen.step() {1e3 * total:.2f} ms of process "
          f"CPU time (without the profiler); under cProfile: the second phase (span_apply_) "
          f"{ms(cum.get(('cpu_span.py', 'span_apply_'), 0.0)):.2f} ms, the first phase (span_statistics) "
          f"{ms(cum.get(('cpu_span.py', 'span_statistics'), 0.0)):.2f} ms, the row codes (rows8_state_ + "
          f"decode_scale) {ms(codes):.2f} ms")

if __name__ == "__main__":
    main()
