"""A/B of Gefen.step()'s gradient statistics on the GPT-2-small tensor set (default, factored).

    python research/column_stats_ab.py [THREADS]     # default 1 thread

"new": the factored tensors' column sums of g^2 in one native pass (kernels/cpu.column_sumsq),
reused as their non-finite check; "old": the eager torch column_sumsq plus a g.sum() per tensor
for the non-finite check (the path before the native pass; reproduced here by patching
Gefen._column_partials). Both are whole steps, interleaved with torch's fused AdamW, medians of 5.
"""
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "research"), str(ROOT / "benchmarks"), str(ROOT)]
import gefen_dist.optim.gefen as O  # noqa: E402
from gefen_dist import Gefen  # noqa: E402
from gefen_dist.core.step import column_sumsq  # noqa: E402
from step_speed import HP, Bench, demo_codebook  # noqa: E402


def main() -> None:
    torch.set_num_threads(int(sys.argv[1]) if len(sys.argv) > 1 else 1)
    b = Bench(torch.float32, demo_codebook())
    gef = Gefen(list(zip(b.names, b.params)), lr=HP["lr"], betas=(HP["beta1"], HP["beta2"]), eps=HP["eps"],
                weight_decay=HP["weight_decay"], fused=True)
    gef.step()
    adam = torch.optim.AdamW(b.params, lr=1e-3, fused=True)
    adam.step()
    new_partials = O.Gefen._column_partials

    def old_partials(self, entries, fact=None):
        if fact is None:  # before the non-finite check: nothing precomputed (it sums every gradient)
            return {}
        return {p: column_sumsq(p.grad, self.state[p]["v_col"].numel()) for p in fact}

    def run(mode: str) -> float:
        O.Gefen._column_partials = old_partials if mode == "old" else new_partials
        t = time.perf_counter()
        gef.step()
        return time.perf_counter() - t

    times = {"new": [], "old": [], "adamw": []}
    for _ in range(5):
        for m in ("new", "old"):
            times[m].append(run(m))
        t = time.perf_counter()
        adam.step()
        times["adamw"].append(time.perf_counter() - t)
    O.Gefen._column_partials = new_partials
    med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    print(f"threads {torch.get_num_threads()}: step ms {({k: round(v, 1) for k, v in med.items()})}; "
          f"old/new {med['old'] / med['new']:.2f}x, new/AdamW {med['new'] / med['adamw']:.2f}x, "
          f"old/AdamW {med['old'] / med['adamw']:.2f}x")


if __name__ == "__main__":
    main()
