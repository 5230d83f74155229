"""Where the fused CPU step's time goes: timing-only builds of the kernel with one stage removed.

    python research/kernel_breakdown.py [--threads 1] [--rounds 7]
                                        [--out research/results/kernel_breakdown.json]
                                        [--md research/results/kernel_breakdown_table.md]

The production ``gefen_dist/kernels/csrc/gefen_step.c`` has no timing switches. This script copies
it to a temporary directory, applies ``research/patches/timing_builds.patch`` (which adds the
``GEFEN_ABLATE`` and ``GEFEN_COLACC`` macros, both 0 by default) and compiles the copy with
``-DGEFEN_ABLATE=k``, which skips stages of its
AVX-512 block step (bit 1: the nearest-codeword table, 2: the two candidate codeword lookups,
4: sweep 1's dequantisation lookup, 8: all of sweep 2). Such a build computes wrong numbers; only
its time is of interest. Each build is loaded in this process and ``Gefen.step()`` (the library
default: factored second moment with row blocks, fp32) on the GPT-2-small tensor set of
``benchmarks/step_speed.py`` (124,439,808 parameters) is timed with every build in turn, interleaved over
``--rounds`` rounds, next to torch's fused AdamW on the same tensors. A stage's cost is the median
of the full build's time minus the median of the build without it (process CPU time, steadier
than wall time on a shared machine). Needs a CPU with AVX-512 VBMI (the path these stages live
in) and a C compiler.
"""
from __future__ import annotations

import argparse
import ctypes
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

os.environ.setdefault("GEFEN_DIST_CPU_ISA", "native")  # the timed builds replace the native one (kernels/cpu_build.py)

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]
RESULTS = ROOT / "research" / "results"
PATCH = ROOT / "research" / "patches" / "timing_builds.patch"

from _docs import publish  # noqa: E402
from gefen_dist.kernels import cpu as C  # noqa: E402
from gefen_dist.kernels import native  # noqa: E402
from step_speed import HP, Bench, cpu_name, demo_codebook, time_rounds  # noqa: E402

DEFAULT_OUT = RESULTS / "kernel_breakdown.json"
DEFAULT_MD = RESULTS / "kernel_breakdown_table.md"
SOURCE = native.CSRC / "gefen_step.c"
_PATCH_LOCK = threading.Lock()

# name -> (GEFEN_ABLATE bits, what the build leaves out)
BUILDS = {
    "full": (0, "nothing (the library's kernel)"),
    "no_table": (1, "the nearest-codeword table (two-level lookup in registers)"),
    "no_candidates": (2, "the two candidate lookups C[j], C[j+1] of sweep 2"),
    "no_nearest": (3, "the whole nearest-codeword search (table and candidates)"),
    "no_dequant": (4, "sweep 1's dequantisation lookup C[idx]"),
    "no_sweep2": (8, "all of sweep 2 (quantise, second moment, parameter update)"),
}


def patched_source(outdir: Path) -> Path:
    """A copy of the production ``gefen_step.c`` in ``outdir`` with the timing switches patched in
    (``research/patches/timing_builds.patch``); the headers it includes are copied beside it."""
    src = outdir / "csrc"
    target = src / SOURCE.name
    with _PATCH_LOCK:  # the builds run in threads and share outdir
        if target.exists():
            return target
        work = outdir / "csrc.tmp"
        work.mkdir(exist_ok=True)
        for f in native.CSRC.iterdir():
            if f.suffix in (".c", ".h"):
                shutil.copy2(f, work / f.name)
        r = subprocess.run(["patch", "--quiet", "--forward", str(work / SOURCE.name), str(PATCH)],
                           capture_output=True, text=True)
        if r.returncode != 0:
            raise SystemExit(f"{PATCH.name} does not apply to {SOURCE} (the kernel changed: refresh the patch)\n"
                             f"{r.stdout}{r.stderr}")
        work.rename(src)
    return target


def build_with(define: str, outdir: Path) -> ctypes.CDLL:
    """``gefen_step.c`` with the timing switches patched in, compiled as the loader compiles it, plus
    ``-D<define>`` (a timing-only build)."""
    cc = native._compiler()
    if cc is None:
        raise SystemExit("this benchmark needs a C compiler (set CC)")
    out = outdir / f"gefen_step_{define.replace('=', '_')}.so"
    cmd = [cc, *native._BASE_FLAGS, "-march=native", "-fopenmp", f"-D{define}", "-o", str(out),
           str(patched_source(outdir)), "-lm"]
    subprocess.run(cmd, check=True, capture_output=True, text=True)
    return ctypes.CDLL(str(out))


def build(bits: int, outdir: Path) -> ctypes.CDLL:
    return build_with(f"GEFEN_ABLATE={bits}", outdir)


def use(lib: ctypes.CDLL) -> None:
    """Make ``lib`` the kernel library the optimizer calls (cpu._lib configures it on first use)."""
    native._cache[C._LIB_NAME] = lib
    if C._lib() is not lib:
        raise SystemExit("the timing-only build was not accepted by gefen_dist.kernels.cpu (ABI mismatch?)")


def table_md(out: dict, command: str) -> str:
    m = out["meta"]
    r = out["result"]
    med = r["cpu_ms_median"]
    full = med["full"]
    lines = [f"<!-- generated by `{command}`; do not edit -->", "",
             f"Machine: {m['cpu']}, {m['logical_cpus']} logical CPUs, torch {m['torch']}; {m['threads']} thread(s); "
             f"load average {m['load_start']:.1f} at the start, {m['load_end']:.1f} at the end; {m['rounds']} "
             f"interleaved rounds, medians of process CPU time, {m['seconds']:.0f} s in all. "
             f"`Gefen.step()` (defaults, fp32) on the GPT-2-small tensor set (124,439,808 parameters); "
             f"torch fused AdamW in the same rounds: {med['torch_adamw_fused']:.1f} ms.", "",
             "| build | leaves out | ms per step | stage's cost (full - this) | share of the full step |",
             "|---|---|---|---|---|"]
    for name, (bits, what) in BUILDS.items():
        t = med[name]
        cost = "—" if name == "full" else f"{full - t:.1f} ms"
        share = "—" if name == "full" else f"{(full - t) / full:.0%}"
        lines.append(f"| `{name}` (`GEFEN_ABLATE={bits}`) | {what} | {t:.1f} | {cost} | {share} |")
    lines += ["", f"The column-statistics pass of the factored second moment (one read of every 2-D gradient, "
              f"`column_sumsq`), timed alone in the same rounds: {med['column_pass']:.1f} ms "
              f"({med['column_pass'] / full:.0%} of the full step). The builds other than `full` compute wrong "
              "numbers (timing only); costs of stages that overlap in the out-of-order core do not add up exactly."]
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--out", default=str(DEFAULT_OUT))
    ap.add_argument("--md", default=str(DEFAULT_MD))
    args = ap.parse_args()
    log = lambda s: print(s, flush=True)  # noqa: E731  (a script: progress on stdout)
    if C.simd_isa() != "avx512vbmi":
        raise SystemExit("this CPU has no AVX-512 VBMI: the stages timed here are not the kernel it runs")
    torch.set_num_threads(args.threads)
    t0, load0 = time.perf_counter(), os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="gefen_ablate_") as tmp:
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(max_workers=max(1, os.cpu_count() or 1)) as ex:  # ~16 s of CPU per build
            futs = {name: ex.submit(build, bits, Path(tmp)) for name, (bits, _) in BUILDS.items()}
            libs = {name: f.result() for name, f in futs.items()}
        b = Bench(torch.float32, demo_codebook())
        adam = torch.optim.AdamW(b.params, lr=HP["lr"], betas=(HP["beta1"], HP["beta2"]), eps=HP["eps"],
                                 weight_decay=HP["weight_decay"], fused=True)
        adam.step()
        use(libs["full"])
        from gefen_dist import Gefen

        gef = Gefen(list(zip(b.names, b.params)), lr=HP["lr"], betas=(HP["beta1"], HP["beta2"]), eps=HP["eps"],
                    weight_decay=HP["weight_decay"])
        gef.step()  # periods and codebook (not timed)
        if not C.two_level_table(demo_codebook()):
            log("note: this CPU gathers from the nearest-codeword table (no AVX-512 BITALG)")

        def step_with(name):
            def f():
                use(libs[name])
                gef.step()
            return f

        factored = [p.grad for p in b.params if p.dim() == 2]

        def column_pass():  # what the default's column statistics cost on their own
            for g in factored:
                C.column_sumsq(g, g.shape[-1])

        methods = {"torch_adamw_fused": adam.step, "column_pass": column_pass,
                   **{name: step_with(name) for name in BUILDS}}
        wall, cpu_ms = time_rounds(methods, {}, args.rounds, log)
        use(libs["full"])
        native._cache.pop(C._LIB_NAME, None)
        finite = all(bool(torch.isfinite(p).all()) for p in b.params)
        if not finite:
            log("warning: the ablation builds left non-finite parameters; later timings may be skewed")
    out = dict(meta=dict(cpu=cpu_name(), logical_cpus=os.cpu_count(), torch=torch.__version__, threads=args.threads,
                         rounds=args.rounds, load_start=load0, load_end=os.getloadavg()[0],
                         seconds=time.perf_counter() - t0, params=sum(p.numel() for p in b.params),
                         params_finite_after=finite),
               builds={k: dict(ablate=v[0], leaves_out=v[1]) for k, v in BUILDS.items()},
               result=dict(cpu_ms_median={k: statistics.median(v) for k, v in cpu_ms.items()},
                           wall_ms_median={k: statistics.median(v) for k, v in wall.items()},
                           cpu_ms_samples=cpu_ms, wall_ms_samples=wall))
    command = ("python benchmarks/kernel_breakdown.py " + " ".join(sys.argv[1:])).strip()
    md = table_md(out, command)
    publish(out, args.out, md, args.md, DEFAULT_MD, "kernel_breakdown_table.md", doc=ROOT / "research" / "speed-log.md")


if __name__ == "__main__":
    main()
