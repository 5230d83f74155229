"""Host time of the multi-tensor CUDA step (``engine/cuda_batch.py``) per optimizer step, measured on CPU.

    python research/batch_host_time.py [--size small|xl] [--d 64] [--steps 200] [--profile]

On a GPU the step's kernels run asynchronously, so what the host spends in ``Gefen.step()`` is
hidden behind the device's work, except after the step's one host synchronisation (the
non-finite and overflow flags, ``CudaBatch.prepare``): from there until the last launch the GPU
waits for the host. At the issue-27 target (GPT-2 small fp32 at <= 0.7 ms per step on an H200) a
few hundred microseconds of host work after the sync decide the step time, so this script measures
that host work without a GPU:

* the GPT-2 parameter *structure* (``benchmarks/_gpt2.py``: the same 148 tensors for ``small``,
  580 for ``xl``, with the model width scaled to ``--d`` so torch's CPU operations on them cost
  next to nothing; ``small_threshold=0`` so every >= 2-D tensor is quantized as at full width);
* the CUDA batch taken on CPU tensors (``cuda_batch._DEVICE_TYPES`` widened, as the tests do) with
  every Triton launch replaced by a no-op that counts it (``triton_kernels._kernel`` stubbed), so
  the parameters do not change and only host work is timed;
* per step: wall time of ``Gefen.step()`` and its part after the synchronisation (from the end
  of the last ``CudaBatch.prepare``, whose ``tolist`` is the sync); the number of torch operations
  dispatched and the time spent executing them (a ``TorchDispatchMode``, in separate steps; on a
  GPU each operation on the model's tensors is a launch, a few microseconds of host time, while here
  a foreach operation loops over its tensors on the CPU, so "executing" overstates what a GPU host
  pays for them); the step's time outside torch operations (Python: what the library controls); the
  Triton launches.
"""
from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]
os.environ.setdefault("TRITON_INTERPRET", "1")  # triton_step.available() without a GPU; no kernel runs

from _gpt2 import gpt2_shapes  # noqa: E402
from gefen_dist import Gefen  # noqa: E402
from gefen_dist.engine import cuda_batch  # noqa: E402
from gefen_dist.kernels import triton_kernels, triton_multi, triton_step  # noqa: E402


class _Count(TorchDispatchMode):
    """Counts the torch operations dispatched and the time spent executing them."""

    def __init__(self):
        super().__init__()
        self.n, self.seconds = 0, 0.0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.n += 1
        t0 = time.perf_counter()
        out = func(*args, **(kwargs or {}))
        self.seconds += time.perf_counter() - t0
        return out


class _NoLaunch:
    """A kernel whose launches only count; the column-sum reduction's output (``torch.empty``) is
    zeroed outside the counted operations, so the step's checks read finite sums."""
    launches = 0

    def __init__(self, name: str):
        self.name = name

    def __getitem__(self, grid):
        def run(*a, **k):
            _NoLaunch.launches += 1
            if self.name == "reduce":
                with torch.utils._python_dispatch._disable_current_modes():
                    a[3].zero_()
        return run


def build(size: str, d: int):
    full = gpt2_shapes(size)
    wd = full[-1][1][0]
    params = []
    for name, shape in full:
        s = tuple(max(1, (x * d) // wd) if x % wd == 0 else x for x in shape)  # the width's multiples scaled
        if name == "wte":
            s = (1024, d)
        params.append(torch.nn.Parameter(torch.randn(s) * 0.02))
    return params


def setup(size: str, d: int):
    """One thread, the seed, GPT-2's structure at width ``d`` with gradients, and the recipe's two param
    groups (weight decay on >= 2-D tensors)."""
    torch.set_num_threads(1)
    torch.manual_seed(0)
    params = build(size, d)
    for p in params:
        p.grad = torch.randn_like(p) * 1e-3
    return params, [{"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.1},
                    {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", default="small")
    ap.add_argument("--d", type=int, default=64)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--nonfinite", default="raise")
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--capturable", action="store_true",
                    help="Gefen(capturable=True, nonfinite='skip'): no synchronisation at all (the 'after the sync' "
                         "column then times from the end of prepare, which waits for nothing)")
    args = ap.parse_args(argv)
    params, groups = setup(args.size, args.d)
    opt = Gefen(groups, lr=1e-3, betas=(0.9, 0.95), small_threshold=0,
                **(dict(capturable=True, nonfinite="skip") if args.capturable else dict(nonfinite=args.nonfinite)))
    opt.step()  # learns periods and the codebook (per-tensor path, native kernel)
    cuda_batch._DEVICE_TYPES = ("cuda", "cpu")
    for mod in (triton_kernels, triton_multi, triton_step):  # every module that bound the launcher by name
        mod._kernel = lambda name="step": _NoLaunch(name)
    # where the host waits: CudaBatch.prepare returns after the sync; time its part and the rest
    split = {"synced": 0.0}
    orig = cuda_batch.CudaBatch.prepare

    def timed_prepare(self, o):
        r = orig(self, o)
        split["synced"] = time.perf_counter()  # the (last) batch's flags are on the host here
        return r
    cuda_batch.CudaBatch.prepare = timed_prepare
    opt.step()
    assert opt._cuda_batch is not None, "the batch did not take the step"
    for _ in range(5):
        opt.step()
    if args.profile:
        import cProfile
        import pstats
        pr = cProfile.Profile()
        pr.enable()
        for _ in range(50):
            opt.step()
        pr.disable()
        pstats.Stats(pr).sort_stats(os.environ.get("SORT", "cumtime")).print_stats(40)
        return
    tot, after = [], []
    for _ in range(args.steps):
        t0 = time.perf_counter()
        opt.step()
        t1 = time.perf_counter()
        tot.append(t1 - t0)
        after.append(t1 - split["synced"])
    inside = []
    for _ in range(max(5, args.steps // 10)):
        with _Count() as c:
            _NoLaunch.launches = 0
            opt.step()
        inside.append(c.seconds)
    q = sum(1 for g in opt.param_groups for p in g["params"] if opt._mode(p) != "exact")
    med = statistics.median(tot) * 1e3
    meda = statistics.median(after) * 1e3
    print(f"{args.size} structure ({len(params)} tensors, {q} quantized, width {args.d}), 1 thread: "
          f"Gefen.step() host time median {med:.3f} ms (min {min(tot) * 1e3:.3f}), of which after the sync "
          f"{meda:.3f} ms (min {min(after) * 1e3:.3f}); torch ops dispatched per step "
          f"{c.n}, executing them {statistics.median(inside) * 1e3:.3f} ms; outside them "
          f"{med - statistics.median(inside) * 1e3:.3f} ms; Triton launches {_NoLaunch.launches}")


if __name__ == "__main__":
    main()
