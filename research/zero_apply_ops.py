"""Host work of ZeroGefen's appliers on the Triton path (CUDA's), measured on CPU without a GPU.

    python research/zero_apply_ops.py [--size small|xl] [--d 64] [--steps 30] [--phases]  # --phases: per phase
    python research/zero_apply_ops.py --second-moment nibbles [--no-batch]  # D20; --no-batch: per tensor

Every rank applies every rank's range of every tensor (``zero/step.py``, ``_apply_all``). Before
2026-12-05 each range of a factored or compressed tensor took a dozen torch operations (on a GPU,
a launch each: ``kernels/triton_state.py``'s ``apply_factored_``); now they go through
``ApplyMany``, one launch per (mode, dtype, tile) for all of them. This script builds GPT-2's
parameter structure (``research/batch_host_time.py``'s ``build``: the same tensors at width ``--d``,
every >= 2-D tensor quantized), steps ``ZeroGefen`` in one process with the Triton implementation
forced and every Triton launch replaced by a counting no-op (so only host work is measured), and
reports per step for ``_apply_all``: torch operations dispatched (and of them those that compute,
a launch each on a GPU; the rest are views), Triton launches and wall time,
for the one-launch appliers and for the per-range path (``_one_buffer`` patched to False, which is
the code every range took before). With W ranks the per-range path's counts are W times these;
the one-launch path's do not grow with W. The last line counts the whole step (the owners' state
updates, the column statistics and factors, the exact tensors, the exchange's packing): since
2026-12-05 (second session) those phases are batched too (``gefen_dist/zero/batch.py``), and the
count of operations on tensors of >= 1 dimension is what launches on a GPU besides the Triton
launches (the rest is the host's 0-dim step counters).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.utils._pytree  # noqa: E402,F401

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "research"), str(ROOT / "benchmarks")]
os.environ.setdefault("TRITON_INTERPRET", "1")  # triton_step.available() without a GPU; no kernel runs

from batch_host_time import _Count, _NoLaunch, setup  # noqa: E402


class _CountCompute(_Count):
    """:class:`_Count`, and apart the operations that compute (not views: ``slice``, ``view``,
    ``detach``, ``reshape`` only make tensor metadata; on a GPU the others are a launch each) and,
    of those, the ones on tensors of at least one dimension (``device``: the 0-dim float32 step
    counts stay on the host, as torch's AdamW keeps them, so their arithmetic launches nothing)."""

    def __init__(self):
        super().__init__()
        self.compute = self.device = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = super().__torch_dispatch__(func, types, args, kwargs)
        if not getattr(func, "is_view", False):
            self.compute += 1
            leaves = torch.utils._pytree.tree_leaves((args, kwargs, out))
            self.device += any(isinstance(t, torch.Tensor) and t.dim() > 0 for t in leaves)
        return out
from gefen_dist import ZeroGefen  # noqa: E402
from gefen_dist.kernels import dispatch, triton_kernels, triton_multi, triton_nibbles, triton_state, triton_step  # noqa: E402
from gefen_dist.zero import step as zero_step  # noqa: E402


def measure(opt, steps: int, per_range: bool) -> dict:
    orig_one = zero_step._one_buffer
    zero_step._one_buffer = (lambda chunks: False) if per_range else orig_one
    orig = zero_step.ZeroStepMixin._apply_all
    rec = {"ops": [], "launches": [], "ms": []}

    def timed(self, *a, **k):
        n0 = _NoLaunch.launches
        t0 = time.perf_counter()
        orig(self, *a, **k)
        rec["ms"].append(1e3 * (time.perf_counter() - t0))
        rec["launches"].append(_NoLaunch.launches - n0)

    zero_step.ZeroStepMixin._apply_all = timed
    try:
        opt.step()  # (re)builds the plan
        for _ in range(steps):
            opt.step()
        counted = []

        def count(self, *a, **k):
            with _CountCompute() as c:
                orig(self, *a, **k)
            counted.append((c.n, c.compute))
        zero_step.ZeroStepMixin._apply_all = count
        for _ in range(3):
            opt.step()
    finally:
        zero_step.ZeroStepMixin._apply_all = orig
        zero_step._one_buffer = orig_one
    return dict(ops=statistics.median(n for n, _ in counted), compute=statistics.median(c for _, c in counted),
                launches=statistics.median(rec["launches"][1:]),
                ms=statistics.median(rec["ms"][1:]))


def phases(opt, steps: int) -> dict:
    """Per phase of ``ZeroGefen.step()`` (its methods wrapped; nested phases count in their callers
    too): the median host milliseconds per step, and the torch operations it dispatches in one more
    step (``(ms, ops)``)."""
    from gefen_dist.zero import batch as zbatch
    from gefen_dist.zero import optimizer as zopt

    times: dict = {}
    ops: dict = {}
    counting = []
    undo = []

    def wrap(owner, name, label):
        orig = owner.__dict__[name]
        fn = orig.__func__ if isinstance(orig, (staticmethod, classmethod)) else orig

        def timed(*a, **k):
            if counting:  # (a mode per phase: nested phases' operations reach their callers' modes too)
                with _CountCompute() as c:
                    out = fn(*a, **k)
                ops[label] = c.n
                return out
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                times.setdefault(label, []).append(1e3 * (time.perf_counter() - t0))
        setattr(owner, name, classmethod(timed) if isinstance(orig, classmethod) else
                staticmethod(timed) if isinstance(orig, staticmethod) else timed)
        undo.append((owner, name, orig))

    for name in ("_wire_items", "_owner_parts", "_owner_exact", "_apply_all"):
        wrap(zero_step.ZeroStepMixin, name, name)
    for name in ("plan", "prepare", "owner_states", "column_factors"):
        wrap(zbatch.ZeroBatch, name, "ZeroBatch." + name)
    wrap(zopt, "exchange_bytes", "exchange_bytes")
    try:
        for _ in range(3):
            opt.step()
        times.clear()
        for _ in range(steps):
            opt.step()
        counting.append(True)
        opt.step()
    finally:
        for owner, name, orig in reversed(undo):
            setattr(owner, name, orig)
    return {k: (statistics.median(v), ops.get(k, 0)) for k, v in times.items()}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", default="small")
    ap.add_argument("--d", type=int, default=64)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--phases", action="store_true", help="also each phase's host time and torch operations per step")
    ap.add_argument("--second-moment", default="factored", choices=["factored", "nibbles"])
    ap.add_argument("--no-batch", action="store_true",
                    help="ZeroGefen's batched phases off (zero/batch.py): every tensor stepped on its own")
    args = ap.parse_args(argv)
    params, groups = setup(args.size, args.d)
    opt = ZeroGefen(groups, lr=1e-3, betas=(0.9, 0.95), small_threshold=0, second_moment=args.second_moment)
    opt.step()  # learns the codebook (native kernels), then the Triton implementation is forced
    opt._impl = lambda t, p=None, group=None: dispatch._triton()
    if args.second_moment == "nibbles":  # its owners' per-tensor kernel is chosen by select_nibbles
        dispatch.native_cpu_usable = lambda t: False
        dispatch.triton_usable = lambda t: t.dtype in (torch.float32, torch.bfloat16)
    if args.no_batch:
        from gefen_dist.zero import batch as zbatch
        zbatch.ZeroBatch.plan = classmethod(lambda cls, opt, entries: None)
    for mod in (triton_kernels, triton_multi, triton_step, triton_state, triton_nibbles):  # every launcher binding
        mod._kernel = lambda name="step": _NoLaunch(name)
    quantized = sum(1 for p in params if "idx" in opt.state[p])
    print(f"ZeroGefen (second_moment={args.second_moment!r}{', batch off' if args.no_batch else ''}), GPT-2 "
          f"{args.size} structure at width {args.d}: {len(params)} tensors, {quantized} quantized; "
          f"one process (W = 1); per step of _apply_all (medians of {args.steps} steps; ops of 3):")
    for name, per_range in (("one launch (ApplyMany)", False), ("per range (before)", True)):
        r = measure(opt, args.steps, per_range)
        print(f"  {name:24s} torch ops {r['ops']:6.0f} (computing {r['compute']:5.0f})   Triton launches "
              f"{r['launches']:4.0f}   host {r['ms']:7.2f} ms")
    with _CountCompute() as c:  # the whole step, for scale
        n0 = _NoLaunch.launches
        opt.step()
    print(f"  the whole ZeroGefen.step(): torch ops {c.n} (computing {c.compute}, of them on tensors of >= 1 "
          f"dimension {c.device}), Triton launches {_NoLaunch.launches - n0}")
    ms = []
    for _ in range(args.steps):
        t0 = time.perf_counter()
        opt.step()
        ms.append(1e3 * (time.perf_counter() - t0))
    print(f"  the whole ZeroGefen.step(): host {statistics.median(ms):.2f} ms (median of {args.steps}; with the torch "
          "operations executed on CPU tensors of this width, the Triton launches stubbed)")
    if args.phases:
        for k, (ms, n) in sorted(phases(opt, args.steps).items(), key=lambda kv: -kv[1][0]):
            print(f"    {k:28s} {ms:7.2f} ms   {n:6d} torch ops")


if __name__ == "__main__":
    main()
