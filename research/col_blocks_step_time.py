"""Process CPU time of one ``Gefen.step()`` on GPT-2 small's transformer block 0 in Hugging Face's ``Conv1D``
layout (the weights ``(in, out)``: ``c_attn`` ``(768, 2304)``, ``c_proj`` ``(768, 768)``, ``c_fc``
``(768, 3072)``, ``mlp.c_proj`` ``(3072, 768)``; 7,087,872 parameters), synthetic gradients: the default
(``col_blocks=1``, every tensor in the native multi-tensor batch) against ``col_blocks="auto"`` (D21: ``c_attn`` and
``c_fc``, 58% of the block's parameters, in column blocks: members of the same batch since 2026-12-07, stepped one by
one beside it before), and torch's fused AdamW, in interleaved rounds; medians and ratios to AdamW of the same rounds.

    python research/col_blocks_step_time.py [--rounds 5] [--threads 1]

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
CONV1D_BLOCK0 = [(D, 3 * D), (3 * D,), (D, D), (D,), (D, 4 * D), (4 * D,), (4 * D, D), (D,), (D,), (D,), (D,), (D,)]


def tensors(seed=0):
    g = torch.Generator().manual_seed(seed)
    ps, gs = [], []
    for shape in CONV1D_BLOCK0:
        ps.append(torch.nn.Parameter(torch.randn(shape, generator=g) * 0.02))
        gs.append(torch.randn(shape, generator=g) * 1e-3)
    return ps, gs


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    logging.basicConfig(level=logging.WARNING)
    opts = {}
    for name in ("adamw_fused", "gefen_default", "gefen_col_blocks"):
        ps, gs = tensors()
        if name == "adamw_fused":
            opt = torch.optim.AdamW(ps, lr=1e-3, fused=True)
        else:
            opt = Gefen(ps, lr=1e-3, col_blocks="auto" if name == "gefen_col_blocks" else 1)
        for _ in range(2):
            for p, g in zip(ps, gs):
                p.grad = g.clone()
            opt.step()
        opts[name] = (opt, ps, gs)
    blocked = sum(p.numel() for p in opts["gefen_col_blocks"][1]
                  if opts["gefen_col_blocks"][0].state[p].get("v_row") is not None
                  and opts["gefen_col_blocks"][0].state[p]["v_row"].shape[-1] > 1)
    times = {k: [] for k in opts}
    for r in range(a.rounds):
        for name, (opt, ps, gs) in (list(opts.items()) if r % 2 == 0 else list(reversed(list(opts.items())))):
            for p, g in zip(ps, gs):
                p.grad = g.clone()
            t0 = time.process_time()
            opt.step()
            times[name].append(1000 * (time.process_time() - t0))
    base = statistics.median(times["adamw_fused"])
    print(f"GPT-2 small block 0, Conv1D layout, {sum(p.numel() for p in opts['adamw_fused'][1]):,} parameters "
          f"({blocked:,} in column blocks); torch {torch.__version__}, {a.threads} thread(s), {a.rounds} rounds, "
          "process CPU time")
    print("| optimizer | ms per step (median) | ratio to fused AdamW |")
    print("|---|---|---|")
    for name, ts in times.items():
        m = statistics.median(ts)
        print(f"| {name} | {m:.1f} | {m / base:.2f}x |")


if __name__ == "__main__":
    main()
