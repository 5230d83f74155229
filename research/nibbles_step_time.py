"""Process CPU time of one optimizer step on GPT-2 small's transformer block 0 (its 12 tensors, 7,087,872
parameters; ``--set small``: the quality runs' `small` LM), synthetic gradients with row structure: torch's fused AdamW, Gefen's default and
Gefen(second_moment="nibbles") (D20) on the native kernel, and the nibbles eager reference, in interleaved
rounds; medians and ratios to AdamW of the same rounds (research/speed-log.md, "The one-byte layout's step").

    python research/nibbles_step_time.py [--rounds 7] [--threads 1] [--no-eager] [--set block0|small|base]

Every optimizer steps its own copy of the same tensors with the same gradients; two untimed steps first
(the first learns the codebook). Process CPU time, so a descheduled thread on a shared machine does not count.
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

D = 768
BLOCK0 = [(3 * D, D), (3 * D,), (D, D), (D,), (4 * D, D), (4 * D,), (D, 4 * D), (D,), (D,), (D,), (D,), (D,)]


def shapes_of(name: str):
    """GPT-2 small's block 0, or the parameter shapes of a launch/gpt.py preset (the quality runs' models)."""
    if name == "block0":
        return BLOCK0
    if name == "gpt2":  # all of GPT-2 small (benchmarks/_gpt2.py)
        sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
        from _gpt2 import gpt2_shapes

        return [shape for _, shape in gpt2_shapes("small")]
    from launch.gpt import GPT, get_config

    return [tuple(p.shape) for p in GPT(get_config(name)).parameters()]


def tensors(seed=0, name="block0"):
    g = torch.Generator().manual_seed(seed)
    ps, gs = [], []
    for shape in shapes_of(name):
        p = torch.nn.Parameter(torch.randn(shape, generator=g) * 0.02)
        rs = 0.1 + 2 * torch.rand(shape[0], *([1] * (len(shape) - 1)), generator=g)
        ps.append(p)
        gs.append(torch.randn(shape, generator=g) * 1e-3 * rs)
    return ps, gs


class _PerTensor:
    """An optimizer whose steps skip the multi-tensor CPU batch (gefen_dist.engine.cuda_batch's switch)."""

    def __init__(self, opt):
        self.opt = opt

    def step(self):
        from gefen_dist.engine import cuda_batch

        cuda_batch._NATIVE_CPU = False
        try:
            self.opt.step()
        finally:
            cuda_batch._NATIVE_CPU = True


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--steps", type=int, default=5, help="timed steps per round and optimizer")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--no-eager", action="store_true", help="leave out the eager reference (slow)")
    ap.add_argument("--set", default="block0", help="'block0' (GPT-2 small's first block) or a launch/gpt.py preset "
                                                   "(tiny, small, base: the quality runs' models)")
    args = ap.parse_args(argv)
    logging.getLogger("gefen_dist").setLevel(logging.ERROR)
    torch.set_num_threads(args.threads)
    makers = {
        "torch_adamw_fused": lambda ps: torch.optim.AdamW(ps, lr=1e-3, fused=True),
        "gefen_default": lambda ps: Gefen(ps, lr=1e-3),
        "gefen_nibbles": lambda ps: Gefen(ps, lr=1e-3, second_moment="nibbles"),
        # the same kernel called tensor by tensor (the CPU's path before the multi-tensor batch took "nibbles")
        "gefen_nibbles_per_tensor": lambda ps: _PerTensor(Gefen(ps, lr=1e-3, second_moment="nibbles")),
    }
    if not args.no_eager:
        makers["gefen_nibbles_eager"] = lambda ps: Gefen(ps, lr=1e-3, second_moment="nibbles", fused=False)
    opts = {}
    for name, make in makers.items():
        ps, gs = tensors(name=args.set)
        for p, g in zip(ps, gs):
            p.grad = g
        opts[name] = make(ps)
        for _ in range(2):
            opts[name].step()
    times = {k: [] for k in opts}
    t_start = time.time()
    for r in range(args.rounds):
        for name, opt in (list(opts.items()) if r % 2 == 0 else list(opts.items())[::-1]):
            t0 = time.process_time()
            for _ in range(args.steps):
                opt.step()
            times[name].append((time.process_time() - t0) / args.steps)
    base = statistics.median(times["torch_adamw_fused"])
    ts = tensors(name=args.set)[0]
    n = sum(p.numel() for p in ts)
    what = {"block0": "GPT-2 small block 0", "gpt2": "GPT-2 small"}.get(args.set, f"the `{args.set}` LM")
    print(f"{what} ({n:,} parameters in {len(ts)} tensors), {args.threads} thread(s), {args.rounds} interleaved rounds of "
          f"{args.steps} steps, process CPU time, torch {torch.__version__}, {time.time() - t_start:.0f} s")
    for name, ts in times.items():
        med = statistics.median(ts)
        ratios = sorted(t / a for t, a in zip(ts, times["torch_adamw_fused"]))
        print(f"  {name:22s} {1e3 * med:8.2f} ms  {med / base:6.2f}x AdamW (per-round ratios {ratios[0]:.2f}-"
              f"{ratios[-1]:.2f})")


if __name__ == "__main__":
    main()
