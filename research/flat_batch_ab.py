"""DeepSpeed's flat-buffer step on CPU, batched (``engine/flat_batch.py``) against per segment, in one
process: the native kernels on the GPT-2-small tensor set as one flat buffer (``benchmarks/flat_step.py``'s
``build``), the two paths on two copies of the buffer, interleaved in rounds with torch's fused AdamW.

    python research/flat_batch_ab.py [--threads 1] [--rounds 7] [--second-moment factored]

Prints the median ms per step of each (process CPU time, and wall time: with several threads they
differ), the batched / per-segment ratio per round, and both against fused AdamW. The two paths give the same bits (``tests/test_flat_batch.py``).
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]

from flat_step import HP, build  # noqa: E402
from gefen_dist.core.step import hyperparameters  # noqa: E402
from gefen_dist.engine import flat_step as _flat_step  # noqa: E402
from gefen_dist.kernels import dispatch  # noqa: E402


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--second-moment", default="factored", choices=("factored", "shared"))
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    group = dict(lr=HP["lr"], betas=(HP["beta1"], HP["beta2"]), eps=HP["eps"], weight_decay=HP["weight_decay"])
    kernels_of = _flat_step.batch_kernels
    runs = {}
    for name in ("batched", "per_segment"):
        fs, flat, grad, st = build(args.second_moment)

        def step(fs=fs, flat=flat, grad=grad, st=st, batched=name == "batched"):
            _flat_step.batch_kernels = kernels_of if batched else (lambda *a: None)
            st["step"] += 1
            fs.step(flat, grad, st, impl=dispatch.select(flat), second_moment=args.second_moment,
                    hp=hyperparameters(group, int(st["step"]), bounded=True))
        runs[name] = step
    fs, flat, grad, _ = build(args.second_moment)
    params = [torch.nn.Parameter(flat[s.flat_offset:s.flat_offset + s.numel].clone().view(s.shape)) for s in fs.segments]
    for p, s in zip(params, fs.segments):
        p.grad = grad[s.flat_offset:s.flat_offset + s.numel].clone().view(s.shape)
    del fs, flat, grad
    adam = torch.optim.AdamW(params, lr=HP["lr"], betas=(HP["beta1"], HP["beta2"]), eps=HP["eps"],
                             weight_decay=HP["weight_decay"], fused=True)
    runs["torch_adamw_fused"] = adam.step
    for fn in runs.values():
        fn()
    cpu = {k: [] for k in runs}
    wall = {k: [] for k in runs}
    for _ in range(args.rounds):
        for k, fn in runs.items():
            c0, w0 = time.process_time(), time.perf_counter()
            fn()
            cpu[k].append(1e3 * (time.process_time() - c0))
            wall[k].append(1e3 * (time.perf_counter() - w0))
    _flat_step.batch_kernels = kernels_of
    for what, rec in (("process CPU", cpu), ("wall", wall)):
        med = {k: statistics.median(v) for k, v in rec.items()}
        ratios = [b / s for b, s in zip(rec["batched"], rec["per_segment"])]
        print(f"{args.second_moment}, {args.threads} thread(s), {args.rounds} rounds, {what} ms per step (median): "
              + ", ".join(f"{k} {v:.1f}" for k, v in med.items()))
        print("  batched / per segment per round: " + ", ".join(f"{r:.3f}" for r in ratios)
              + f" (median {statistics.median(ratios):.3f}); against fused AdamW: batched "
              f"{med['batched'] / med['torch_adamw_fused']:.2f}x, per segment {med['per_segment'] / med['torch_adamw_fused']:.2f}x")


if __name__ == "__main__":
    main()
