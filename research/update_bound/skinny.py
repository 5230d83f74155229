"""State bytes per parameter of skinny tensors: the library today and the proposal in NOTES.md.

    python research/update_bound/skinny.py

Today: measured with ``Gefen.report()`` after one step on a Gaussian gradient (fused default).
Proposal (analytic, fp32 state, uint8 idx):
* short-row / few-row tensors (factored v_col would cost 4 * G * slab / n > 0.05 B/param, i.e. fewer
  than 80 rows): second moment shared per scale block instead of factored;
* where today's scale block is below 64 elements (e.g. the largest divisor <= 256 of a prime row
  is 1), blocks of 256 with a ragged tail per row (ceil(slab / 256) scales per row);
* rows shorter than 256 (slab < 256): "row groups" of R = ceil(256 / slab) consecutive rows share
  one scale and one v (ragged last group), cut blocks under Shard(0) reconciled as D7 does.
"""
from __future__ import annotations

import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch

from gefen_dist import Gefen

SHAPES = [(1_000_000, 1), (1, 1_000_000), (4096, 1), (1, 4096), (1, 4099), (1, 197, 768), (100_000, 3),
          (3, 100_000), (50_000, 20), (20, 50_000), (1024, 1024), (4099, 64)]


def measured(shape, mode):
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.zeros(shape))
    opt = Gefen([p], lr=1e-3, second_moment=mode)
    p.grad = torch.randn(shape)
    opt.step()
    r = opt.report()[0]
    return r["state_bytes"] / r["numel"], r["period"], r["scale_block"]


def proposal(shape, cur_block):
    """``cur_block``: today's scale block (the period, or the largest divisor of the row <= 256),
    kept when it is at least 64; else blocks of 256 with a ragged tail."""
    rows, slab = shape[0], math.prod(shape[1:])
    n = rows * slab
    if slab >= 256:
        scales = rows * (slab // cur_block if cur_block >= 64 else math.ceil(slab / 256))
        factored_v = 4 * (rows + slab)  # one column profile
        if factored_v / n <= 0.05:
            return (n + 4 * scales + factored_v) / n, ("factored, today's blocks" if cur_block >= 64
                                                       else "factored, ragged 256-blocks")
        return (n + 8 * scales) / n, "few rows: v shared per scale block" + (
            "" if cur_block >= 64 else " (ragged 256-blocks)")
    R = math.ceil(256 / slab)
    groups = math.ceil(rows / R)
    return (n + 8 * groups) / n, f"row groups of {R} rows: one scale + one v per group"


def main():
    torch.set_num_threads(1)
    print(f"{'shape':>18} | {'factored B/param (P, B)':>26} | {'shared B/param (P, B)':>24} | proposal")
    for s in SHAPES:
        f = measured(s, "factored")
        sh = measured(s, "shared")
        pb, how = proposal(s, f[2])
        print(f"{str(s):>18} | {f[0]:8.4f} ({f[1]:>6}, {f[2]:>4})      | {sh[0]:8.4f} ({sh[1]:>6}, {sh[2]:>4})    | "
              f"{pb:.4f} ({how})", flush=True)


if __name__ == "__main__":
    main()
