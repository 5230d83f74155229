"""How far a ``narrow_rows="rows8"`` row's coded ``v`` (D19) wanders from the exact EMA it stands for.

Each step the library advances ``v`` from its *decoded* value and codes the result again, rounding
stochastically between two codes ``2^(1/V_STEPS)`` apart (unbiased, so a slow EMA still moves). The
rounding errors do not cancel: each one stays in the EMA and decays only by ``beta2`` a step, so the
coded ``v`` takes a random walk around the exact one. This simulates rows of 64 elements with
Gaussian gradients (rows of different scales, a block reference per 16 rows, the library's own
``rows8.encode_v``) for 4,000 steps and prints the standard deviation of ``ln(v_coded / v_exact)``
over the last 1,000, next to the exact EMA's own spread around the true second moment (the sampling
noise AdamW's ``v`` has: ``ln(v_exact / E[g^2])``).

    python research/rows8_v_noise.py
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gefen_dist.core import rows8 as R  # noqa: E402
from gefen_dist.core.span import SpanPiece  # noqa: E402


def walk(beta2: float, v_steps: int, rows: int = 4096, slab: int = 64, steps: int = 4000, seed: int = 0):
    """``(std of ln(coded / exact), std of ln(exact / E[g^2]))`` over the last quarter of the steps."""
    saved = R.V_STEPS
    R.V_STEPS = v_steps
    try:
        g = torch.Generator().manual_seed(seed)
        shape, sp = (rows, slab), SpanPiece.of((rows, slab))
        scale = torch.exp(torch.randn(rows, generator=g) * 0.5)
        exact, coded = torch.zeros(rows), torch.zeros(rows)
        errs, moves = [], []
        for t in range(1, steps + 1):
            r = ((torch.randn(rows, slab, generator=g) * scale[:, None]) ** 2).mean(dim=1)
            exact = beta2 * exact + (1 - beta2) * r
            _, _, coded = R.encode_v(beta2 * coded + (1 - beta2) * r, sp, t, shape)
            if t > steps * 3 // 4:
                errs.append(torch.log(coded / exact))
                moves.append(torch.log(exact / scale ** 2))
        return float(torch.stack(errs).std()), float(torch.stack(moves).std())
    finally:
        R.V_STEPS = saved


def main() -> int:
    print("| beta2 | codes per octave | std of ln(coded v / exact v) | std of ln(exact v / E[g^2]) |")
    print("|---|---|---|---|")
    for beta2 in (0.95, 0.999):
        for v_steps in (16, 32):
            err, move = walk(beta2, v_steps)
            print(f"| {beta2} | {v_steps}{' (the library)' if v_steps == R.V_STEPS else ''} | {err:.3f} | {move:.3f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
