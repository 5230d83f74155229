"""Host work and launches of DeepSpeed's flat-buffer step (``FlatSegments.step``) on the Triton path,
measured on CPU without a GPU.

    python research/flat_host_ops.py [--size small|xl] [--d 64] [--steps 30] [--second-moment factored]

The DeepSpeed integration steps one flat fp32 buffer per param group (ZeRO-1/2) or sub-group
(ZeRO-3) through ``FlatSegments.step``: the whole rows / blocks of every segment through the
implementation's kernels, the rows and blocks cut by partition edges with the reference's phase
functions (D7). This script builds GPT-2's parameter *structure* as one flat buffer (the same
tensors as ``research/batch_host_time.py``, the model width scaled to ``--d`` so torch's CPU
operations on them cost next to nothing, every >= 2-D tensor quantized as at full width; one
process, so every tensor is whole, as almost all of each rank's elements are under ZeRO), steps it with the Triton implementation forced and
every Triton launch replaced by a counting no-op (``batch_host_time._NoLaunch``), and prints per
step: torch operations dispatched, those that compute (not views) and of them those on tensors of
at least one dimension (a launch each on a GPU), Triton launches, and host milliseconds (medians).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "research"), str(ROOT / "benchmarks")]
os.environ.setdefault("TRITON_INTERPRET", "1")  # triton_step.available() without a GPU; no kernel runs

from batch_host_time import _NoLaunch, build  # noqa: E402
from zero_apply_ops import _CountCompute  # noqa: E402
from _gpt2 import gpt2_shapes  # noqa: E402

from gefen_dist.core.step import hyperparameters  # noqa: E402
from gefen_dist.engine.comm import LocalComm  # noqa: E402
from gefen_dist.engine.flat import FlatSegments, Segment, counts_to_codebook  # noqa: E402
from gefen_dist.kernels import dispatch, triton_kernels, triton_multi, triton_state, triton_step  # noqa: E402


def flat_buffer(size: str, d: int):
    """(segments, flat, grad) of GPT-2's structure at width ``d`` in one flat buffer."""
    params = build(size, d)
    segs, off = [], 0
    for (name, _), p in zip(gpt2_shapes(size), params):
        segs.append(Segment(name, name, tuple(p.shape), 0, off, p.numel()))
        off += p.numel()
    gen = torch.Generator().manual_seed(0)
    return segs, torch.randn(off, generator=gen) * 0.02, torch.randn(off, generator=gen) * 1e-3


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", default="small")
    ap.add_argument("--d", type=int, default=64)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--second-moment", default="factored", choices=("factored", "shared"))
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    segs, flat, grad = flat_buffer(args.size, args.d)
    fs = FlatSegments(segs, LocalComm(), 0, "benchmark buffer")  # small_threshold 0: every >= 2-D tensor quantized
    fac = args.second_moment == "factored"
    st = fs.new_state(flat, torch.zeros(256), factored=fac)
    st["codebook"] = counts_to_codebook(fs.learn(st, grad, codebook_needed=True,
                                                 second_moment=args.second_moment)).codebook.float()
    for mod in (triton_kernels, triton_multi, triton_step, triton_state):  # every module that bound the launcher
        mod._kernel = lambda name="step": _NoLaunch(name)
    impl = dispatch._triton()
    group = dict(lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)

    def step():
        st["step"] += 1
        fs.step(flat, grad, st, second_moment=args.second_moment, impl=impl,
                hp=hyperparameters(group, int(st["step"]), bounded=True))

    for _ in range(3):
        step()
    ms, launches = [], []
    for _ in range(args.steps):
        n0 = _NoLaunch.launches
        t0 = time.perf_counter()
        step()
        ms.append(1e3 * (time.perf_counter() - t0))
        launches.append(_NoLaunch.launches - n0)
    counts = []
    for _ in range(3):
        with _CountCompute() as c:
            step()
        counts.append((c.n, c.compute, c.device))
    med = [statistics.median(x) for x in zip(*counts)]
    print(f"{args.size} structure at width {args.d}, {args.second_moment}, one process: "
          f"{len(segs)} segments, {flat.numel()} elements; per step: torch ops {med[0]:.0f} (computing {med[1]:.0f}, "
          f"on tensors of >= 1 dimension {med[2]:.0f}), Triton launches {statistics.median(launches):.0f}, host "
          f"{statistics.median(ms):.2f} ms (median of {args.steps})")


if __name__ == "__main__":
    main()
