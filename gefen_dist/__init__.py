"""gefen_dist: distributed-first Gefen, an AdamW drop-in with ~1 byte/parameter of state.

Gefen is the optimizer of Benedek, Koren and Fried, "Gefen: Optimized Stochastic Optimizer"
(arXiv 2606.13894, 2026); credit for the algorithm goes to "Gefen" and its author. gefen_dist
re-implements it from its specification so that its state is identical in meaning at every
world size (see docs/algorithm.md for the deliberate deviations).
"""
from .optim.gefen import Gefen, Report
from .zero.optimizer import ZeroGefen  # noqa: F401  (ZeRO-1 for DDP, gefen_dist/zero/optimizer.py)

__all__ = ["Gefen", "Report", "ZeroGefen"]
__version__ = "0.1.0"
