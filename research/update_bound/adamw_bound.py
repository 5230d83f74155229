"""AdamW's per-element bound |m_hat_t| / sqrt(v_hat_t) <= K_t(beta1, beta2), checked numerically.

    python research/update_bound/adamw_bound.py

1. K_t from the closed form (mech.update_bound) against the ratio of the Cauchy-Schwarz equality
   sequence g_k = (beta1/beta2)^(t-k) (float64), and against torch.optim.AdamW's actual step on
   that sequence (|dp|/lr; eps = 1e-8 makes it slightly smaller).
2. A search for the worst sequence: gradient ascent on the ratio from 64 random starts per t
   (Gaussian, Cauchy, sparse), and random sequences; the best found must not exceed K_t.
3. The limits t -> inf for common betas.
"""
from __future__ import annotations

import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch

from mech import update_bound


def ratio(g: torch.Tensor, b1: float, b2: float) -> torch.Tensor:
    """|m_hat_t| / sqrt(v_hat_t) of AdamW (eps = 0) after the sequence g[..., :t] (last dim)."""
    t = g.shape[-1]
    k = torch.arange(t, dtype=g.dtype)
    w1 = (1 - b1) * b1 ** (t - 1 - k)
    w2 = (1 - b2) * b2 ** (t - 1 - k)
    m = (g * w1).sum(-1) / (1 - b1 ** t)
    v = (g * g * w2).sum(-1) / (1 - b2 ** t)
    return m.abs() / v.sqrt()


def torch_adamw_step(g: torch.Tensor, b1: float, b2: float, lr=1e-3) -> float:
    """The largest |dp|/lr of torch.optim.AdamW over the sequence (one scalar parameter)."""
    p = torch.nn.Parameter(torch.zeros(1, dtype=torch.float64))
    opt = torch.optim.AdamW([p], lr=lr, betas=(b1, b2), eps=1e-8, weight_decay=0.0)
    best = 0.0
    for x in g.tolist():
        p.grad = torch.tensor([x], dtype=torch.float64)
        before = float(p)
        opt.step()
        best = max(best, abs(float(p) - before) / lr)
    return best


def search(t: int, b1: float, b2: float, starts=64, iters=300, seed=0) -> float:
    gen = torch.Generator().manual_seed(seed)
    inits = [torch.randn(starts, t, generator=gen, dtype=torch.float64),
             torch.distributions.Cauchy(0.0, 1.0).sample((starts, t)).double(),
             torch.randn(starts, t, generator=gen, dtype=torch.float64)
             * (torch.rand(starts, t, generator=gen, dtype=torch.float64) < 0.2)]
    best = 0.0
    for g0 in inits:
        g0 = g0.clone()
        g0[:, -1] += 1e-3  # avoid an all-zero start
        best = max(best, float(ratio(g0, b1, b2).max()))
        g = g0.clone().requires_grad_(True)
        opt = torch.optim.Adam([g], lr=0.05)
        for _ in range(iters):
            opt.zero_grad()
            (-ratio(g, b1, b2).clamp_min(1e-300).log().sum()).backward()
            opt.step()
        with torch.no_grad():
            best = max(best, float(ratio(g, b1, b2).nan_to_num(0.0).max()))
    return best


def main():
    torch.set_num_threads(1)
    print("t, betas, K_t (closed form), ratio of the equality sequence, torch AdamW |dp|/lr on it, best found by search")
    worst_excess = 0.0
    for b1, b2 in ((0.9, 0.999), (0.9, 0.95), (0.95, 0.99), (0.5, 0.9)):
        for t in (1, 2, 3, 5, 10, 30, 100):
            K = update_bound(b1, b2, t)
            eq = (b1 / b2) ** torch.arange(t - 1, -1, -1, dtype=torch.float64)
            r_eq = float(ratio(eq, b1, b2))
            r_torch = torch_adamw_step(eq, b1, b2)
            found = search(t, b1, b2, starts=32, iters=150 if t <= 30 else 80)
            worst_excess = max(worst_excess, found / K - 1.0)
            print(f"t={t:4d} betas=({b1}, {b2})  K_t={K:.6f}  equality={r_eq:.6f}  torch={r_torch:.6f}  "
                  f"search={found:.6f}  search/K={found / K:.6f}", flush=True)
    print(f"largest (search / K_t - 1): {worst_excess:.2e} (<= 0 up to float64 rounding: the bound holds)")
    print("limits t -> inf:")
    for b1, b2 in ((0.9, 0.999), (0.9, 0.99), (0.9, 0.95), (0.95, 0.999), (0.8, 0.999)):
        lim = (1 - b1) / math.sqrt(1 - b2) / math.sqrt(1 - b1 * b1 / b2)
        print(f"  betas=({b1}, {b2})  K_inf={lim:.4f}  K_1e6={update_bound(b1, b2, 10**6):.4f}")
    print("t where K_t reaches 90% / 99% of K_inf for (0.9, 0.999):",
          [next(t for t in range(1, 100000) if update_bound(0.9, 0.999, t) >= f * update_bound(0.9, 0.999, 10**7))
           for f in (0.9, 0.99)])


if __name__ == "__main__":
    main()
