"""The per-tensor costs of the CPU step behind research/speed-log.md's entry "Per-tensor work of the
CPU batch" (2026-12-05), one subcommand each (1 thread, process CPU time, interleaved rounds, medians):

    python research/per_tensor_costs.py step     # Gefen.step() / fused AdamW: many small tensors vs one
    python research/per_tensor_costs.py kernel   # the native multi step alone: per-tensor fixed cost
    python research/per_tensor_costs.py exact    # the exact tensors: foreach AdamW vs torch's _fused_adamw_
    python research/per_tensor_costs.py mean     # stacked v_col means vs per-tensor means, 1 and 2 threads

``kernel`` times ``MultiStep.run`` for 200 x (128, 128) against one (25,600, 128) (and 25 x (128, 1024)
against one (3,200, 1024)): the difference over 200 (25) is the fixed cost per tensor. To compare two
commits, run it with each tree's ``gefen_dist`` first on ``PYTHONPATH``.
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


def _tensors(K, R, C):
    ps = [torch.nn.Parameter(torch.randn(R, C) * 0.02) for _ in range(K)]
    g = torch.Generator().manual_seed(0)
    for p in ps:
        p.grad = torch.randn(p.shape, generator=g) * 1e-3
    return ps


CASES = ((200, 128, 128), (1, 25600, 128), (25, 128, 1024), (1, 3200, 1024))


def step(rounds: int) -> None:
    from gefen_dist import Gefen

    opts = {}
    for K, R, C in CASES:
        ps = _tensors(K, R, C)
        opts[f"{K}x({R},{C})"] = (Gefen(ps, lr=1e-3, betas=(0.9, 0.95)),
                                  torch.optim.AdamW(ps, lr=1e-3, betas=(0.9, 0.95), fused=True))
    ms = {k: ([], []) for k in opts}
    for o in opts.values():
        o[0].step(), o[1].step()
    for _ in range(rounds):
        for k, pair in opts.items():
            for j, o in enumerate(pair):
                t0 = time.process_time()
                o.step()
                ms[k][j].append(1e3 * (time.process_time() - t0))
    for k, (g, a) in ms.items():
        g, a = statistics.median(g), statistics.median(a)
        print(f"{k:16s} Gefen.step() {g:7.2f} ms   fused AdamW {a:6.2f} ms   ratio {g / a:.2f}")


def kernel(rounds: int) -> None:
    from gefen_dist import Gefen
    from gefen_dist.kernels import cpu_multi

    tot, orig = {}, cpu_multi.MultiStep.run

    def timed(self, *a, **k):
        t0 = time.process_time()
        r = orig(self, *a, **k)
        tot.setdefault(getattr(self, "_tag", None), []).append(time.process_time() - t0)
        return r
    cpu_multi.MultiStep.run = timed
    opts = []
    for K, R, C in CASES:
        o = Gefen(_tensors(K, R, C), lr=1e-3, betas=(0.9, 0.95))
        o.step(), o.step()
        for gi in o._cuda_batch.groups:
            if gi["multi"] is not None:
                gi["multi"]._tag = (K, R, C)
        opts.append(o)
    for _ in range(rounds):
        for o in opts:
            o.step()
    med = {k: 1e3 * statistics.median(v) for k, v in tot.items() if k is not None}
    for k, v in med.items():
        print(f"{k[0]}x({k[1]},{k[2]}): {v:.3f} ms")
    for (K, R, C), one in ((CASES[0], CASES[1]), (CASES[2], CASES[3])):
        print(f"fixed cost per tensor of ({R},{C}): {1e3 * (med[(K, R, C)] - med[one]) / K:.2f} us")


def exact(rounds: int) -> None:
    from gefen_dist.core.step import adamw_foreach_, adamw_fused_

    shapes = [(128,)] * 290 + [(384,)] * 48 + [(512,)] * 48  # the `deep` model's 386 vectors

    def mk():
        g = torch.Generator().manual_seed(0)
        return ([torch.randn(s, generator=g) for s in shapes], [torch.randn(s, generator=g) * 1e-3 for s in shapes],
                [torch.zeros(s) for s in shapes], [torch.zeros(s) for s in shapes])
    A, B, steps = mk(), mk(), [torch.zeros(()) for _ in shapes]
    hp = dict(lr=1e-3, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1)
    t = {"foreach": [], "fused": []}
    for i in range(1, rounds + 1):
        c0 = time.process_time()
        adamw_foreach_(*A, **hp, bc1=1 - 0.9 ** i, bc2=1 - 0.95 ** i)
        t["foreach"].append(time.process_time() - c0)
        torch._foreach_add_(steps, 1.0)
        c0 = time.process_time()
        adamw_fused_(*B, steps, lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
        t["fused"].append(time.process_time() - c0)
    for k, v in t.items():
        print(f"{k}: {1e3 * statistics.median(v):.3f} ms per step ({len(shapes)} vectors)")
    print("largest parameter difference:", max(float((a - b).abs().max()) for a, b in zip(A[0], B[0])))


def mean(_rounds: int) -> None:
    sizes = [1, 2, 3, 7, 8, 15, 16, 17, 31, 32, 33, 63, 64, 65, 100, 127, 128, 129, 255, 256, 257, 500, 768, 1000,
             1024, 2048, 3072, 4096, 5000, 8191, 16384, 50257, 65537, 100000]
    for threads in (1, 2):
        torch.set_num_threads(threads)
        g = torch.Generator().manual_seed(0)
        bad, tot, where = 0, 0, set()
        for S in sizes:
            for G in (None, 1, 3, 4):
                for K in (2, 5, 48):
                    shape = (S,) if G is None else (G, S)
                    vs = [torch.rand(shape, generator=g).pow_(3) * 10 ** float(torch.randint(-8, 3, (1,), generator=g))
                          for _ in range(K)]
                    st = torch.stack(vs)
                    out = torch.div(st, st.mean(dim=-1, keepdim=True)).sqrt_()
                    for v, o in zip(vs, out):
                        tot += 1
                        if not torch.equal((v / v.mean(dim=-1, keepdim=True)).sqrt_(), o):
                            bad += 1
                            where.add((S, G))
        print(f"{threads} thread(s): {bad} of {tot} stacked column factors differ from the per-tensor ones"
              + (f" (shapes {sorted(where, key=str)})" if where else ""))


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("what", choices=("step", "kernel", "exact", "mean"))
    ap.add_argument("--rounds", type=int, default=15)
    a = ap.parse_args(argv)
    torch.set_num_threads(1)
    {"step": step, "kernel": kernel, "exact": exact, "mean": mean}[a.what](a.rounds)


if __name__ == "__main__":
    main()
