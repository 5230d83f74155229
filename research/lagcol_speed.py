"""What a one-step lag in the factored column statistics would save on the CPU step (a prototype
measurement; the library does not lag).

    python research/lagcol_speed.py [--threads 1] [--rounds 7]
                                    [--out research/results/lagcol_speed.json]

The default (factored) step reads every 2-D gradient twice: once for the column means of ``g^2``
(all rows are needed before the first row's update) and once in the kernel. If ``v_col`` advanced
with the *previous* step's column means (variant ``x_lagcol`` of ``research/quality_variants.py`` measures
what that costs in loss), the kernel could accumulate this step's column sums while each row is in
cache and the separate pass would go. This script times ``Gefen.step()`` (defaults, fp32, the
GPT-2-small tensor set of ``step_speed.py``) as it is, next to the same step with

* the column pass replaced by the first step's (cached) column sums, and
* the kernel built with ``-DGEFEN_COLACC=1`` (a copy of ``gefen_dist/kernels/csrc/gefen_step.c`` with
  ``research/patches/timing_builds.patch`` applied, see ``kernel_breakdown.py``), which adds
  each row's ``g^2`` to per-thread float64 column sums in the row loop (the work the lag moves
  into the kernel; the sums are discarded, so the result is a timing, not a step),

and torch's fused AdamW, interleaved, medians of process CPU time.
"""
from __future__ import annotations

import argparse
import ctypes
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("GEFEN_DIST_CPU_ISA", "native")  # the timed builds replace the native one (kernels/cpu_build.py)

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks"), str(ROOT / "research")]

from gefen_dist import Gefen  # noqa: E402
from gefen_dist.kernels import cpu as C  # noqa: E402
from gefen_dist.kernels import native  # noqa: E402
from kernel_breakdown import build_with, use  # noqa: E402
from step_speed import HP, Bench, cpu_name, demo_codebook, time_rounds  # noqa: E402

DEFAULT_OUT = ROOT / "research" / "results" / "lagcol_speed.json"


def build_colacc(outdir: Path) -> ctypes.CDLL:
    return build_with("GEFEN_COLACC=1", outdir)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--out", default=str(DEFAULT_OUT))
    args = ap.parse_args()
    log = lambda s: print(s, flush=True)  # noqa: E731  (a script: progress on stdout)
    torch.set_num_threads(args.threads)
    t0, load0 = time.perf_counter(), os.getloadavg()[0]
    lib = C._lib()
    if lib is None:
        raise SystemExit("the native kernel library is unavailable")
    with tempfile.TemporaryDirectory(prefix="gefen_colacc_") as tmp:
        colacc = build_colacc(Path(tmp))
        b = Bench(torch.float32, demo_codebook())
        adam = torch.optim.AdamW(b.params, lr=HP["lr"], betas=(HP["beta1"], HP["beta2"]), eps=HP["eps"],
                                 weight_decay=HP["weight_decay"], fused=True)
        adam.step()
        gef = Gefen(list(zip(b.names, b.params)), lr=HP["lr"], betas=(HP["beta1"], HP["beta2"]), eps=HP["eps"],
                    weight_decay=HP["weight_decay"])
        gef.step()  # periods and codebook (not timed)
        real_partials = Gefen._column_partials
        store = {}

        def cached_partials(self, entries, fact=None):
            key = "all" if fact is None else tuple(id(p) for p in fact)
            if key not in store:
                store[key] = real_partials(self, entries, fact)
            return store[key]

        def step_with(kernel, partials):
            def f():
                native._cache[C._LIB_NAME] = kernel
                Gefen._column_partials = partials
                gef.step()
            return f

        methods = {"torch_adamw_fused": adam.step, "Gefen_step": step_with(lib, real_partials),
                   "no_column_pass": step_with(lib, cached_partials),
                   "no_column_pass_kernel_accumulates": step_with(colacc, cached_partials)}
        try:
            use(colacc)  # checks that the loader accepts the build
            wall, cpu_ms = time_rounds(methods, {}, args.rounds, log)
        finally:
            Gefen._column_partials = real_partials
            native._cache[C._LIB_NAME] = lib
    med = {k: statistics.median(v) for k, v in cpu_ms.items()}
    out = dict(meta=dict(cpu=cpu_name(), logical_cpus=os.cpu_count(), torch=torch.__version__, threads=args.threads,
                         rounds=args.rounds, load_start=load0, load_end=os.getloadavg()[0],
                         seconds=time.perf_counter() - t0, params=sum(p.numel() for p in b.params)),
               cpu_ms_median=med, wall_ms_median={k: statistics.median(v) for k, v in wall.items()},
               ratio_to_adamw={k: v / med["torch_adamw_fused"] for k, v in med.items()},
               cpu_ms_samples=cpu_ms, wall_ms_samples=wall)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    full = med["Gefen_step"]
    log(f"\nprocess CPU ms per step (medians of {args.rounds}), {args.threads} thread(s), {cpu_name()}:")
    for k, v in med.items():
        log(f"  {k:36s} {v:7.1f}  ({v / med['torch_adamw_fused']:.2f}x AdamW, {v / full:.3f}x the step as is)")
    log(f"wrote {args.out}")


if __name__ == "__main__":
    main()
