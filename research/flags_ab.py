"""A/B of the native step kernel's compiler flags (or of one source edit) on ``Gefen.step()`` (GPT-2-small
tensor set, 1 thread).

    python research/flags_ab.py [--rounds 7] [--extra "-mno-avx256-split-unaligned-store"]
    python research/flags_ab.py --extra= --replace "_mm256_div_ps(ibc1, d)" "_mm256_mul_ps(ibc1, d)"

Builds the step library twice in private caches: A with the library's first flag set minus ``--extra``
(without it, where the shipped set has it), B with the first set plus ``--extra`` (the shipped set where it
has it); ``--replace OLD NEW`` edits B's copy of ``gefen_step.c`` (one occurrence of ``OLD``; a
timing-only build: it may compute other numbers, and its state then drifts from A's). Both are loaded in one process and swapped into the kernel cache per round (A first in even
rounds, B first in odd ones), so the same tensors and state are stepped by either build and the ratio
is measured on one host at one time. The builds' float operations are the same (the flag changes how
stores are issued), so the states stay equal; ``tests/test_fused_cpu.py`` checks the shipped build
bitwise against the eager reference. Prints the process CPU time per step of each build and the
per-round ratios B / A (research/speed-log.md, 2026-12-06).
"""
from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("GEFEN_DIST_CPU_ISA", "native")  # the timed builds replace the native one (kernels/cpu_build.py)

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]

import gefen_dist  # noqa: E402
from _gpt2 import gpt2_shapes  # noqa: E402
from gefen_dist.kernels import cpu, native  # noqa: E402


def _build(first_flags, cache: str, replace=None):
    """The step library built with ``first_flags`` as its first flag set, in ``cache``; ``replace``
    (old, new): from a copy of the sources with that edit."""
    shipped, csrc = native.flag_variants, native.CSRC
    native.flag_variants = lambda: [first_flags] + shipped()[1:]
    os.environ["GEFEN_DIST_CACHE"] = cache
    native._cache.pop(cpu._LIB_NAME, None)
    if replace is not None:
        src = Path(cache) / "csrc"
        shutil.copytree(csrc, src)
        text = (src / "gefen_step.c").read_text()
        if text.count(replace[0]) != 1:
            raise SystemExit(f"--replace: {replace[0]!r} occurs {text.count(replace[0])} times in gefen_step.c, not once")
        (src / "gefen_step.c").write_text(text.replace(replace[0], replace[1]))
        native.CSRC = src
    try:
        lib = cpu._lib()
    finally:
        native.flag_variants, native.CSRC = shipped, csrc
    if lib is None:
        raise SystemExit(f"the build with {first_flags} failed")
    return lib


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--extra", default=" ".join(native._X86_STORE_FLAGS))
    ap.add_argument("--replace", nargs=2, metavar=("OLD", "NEW"), help="edit B's gefen_step.c (timing only)")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    extra = args.extra.split()
    first = native.flag_variants()[0]
    base = [f for f in first if f not in extra]
    with tempfile.TemporaryDirectory() as tmp:
        lib_a = _build(base, os.path.join(tmp, "a"))
        lib_b = _build(base + extra, os.path.join(tmp, "b"), args.replace)
        gen = torch.Generator().manual_seed(0)
        ps = [torch.nn.Parameter(torch.randn(s, generator=gen) * 0.02) for _, s in gpt2_shapes()]
        opt = gefen_dist.Gefen(ps, lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1)
        for p in ps:
            p.grad = torch.randn(p.shape, generator=gen) * 1e-3
        opt.step()
        res = {"A": [], "B": []}
        for r in range(args.rounds):
            for k, lib in ((("A", lib_a), ("B", lib_b)) if r % 2 == 0 else (("B", lib_b), ("A", lib_a))):
                native._cache[cpu._LIB_NAME] = lib
                t0 = time.process_time()
                opt.step()
                res[k].append(time.process_time() - t0)
    print(f"A: {' '.join(base)}\nB: A + {' '.join(extra)}"
          + (f", gefen_step.c with {args.replace[0]!r} -> {args.replace[1]!r}" if args.replace else ""))
    for k, v in res.items():
        print(f"{k}: median {1e3 * statistics.median(v):.1f} ms per step; rounds {[round(1e3 * x) for x in v]}")
    ratios = [b / a for a, b in zip(res["A"], res["B"])]
    print(f"B / A per round: {[round(x, 3) for x in ratios]}; median {statistics.median(ratios):.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
