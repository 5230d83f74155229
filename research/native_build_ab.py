"""A/B of native CPU builds: ``gefen_step.c`` at two git revisions (and/or with two flag sets) built into
throwaway libraries, swapped into the library cache in turn, and ``Gefen.step()`` timed on the same
tensors with each, interleaved; process CPU time, one thread, medians and ratios to the first build.

    python research/native_build_ab.py --a HEAD~1 --b HEAD                       # the last commit's kernel
    python research/native_build_ab.py --a HEAD --b HEAD --march haswell \\
        --flags-a="-fno-math-errno" --flags-b="-fno-math-errno -fno-trapping-math"   # an AVX2 build, two flag sets
    python research/native_build_ab.py --second-moment factored,nibbles --set block0 --rounds 9
    python research/native_build_ab.py --a WORK --b WORK --march-b haswell --second-moment factored --set gpt2

``--a`` / ``--b``: a git revision, or ``WORK`` for the working tree's file. ``--march``: ``native`` (the
library's), or e.g. ``haswell`` for an AVX2 build on an AVX-512 host (``--march-a`` / ``--march-b``: per
build). Flags default to the library's
(``gefen_dist.kernels.native._BASE_FLAGS``). Each build is checked against the other on two steps of the
tensor set before timing (``--no-check`` skips it): the builds must give the same parameters and state
bit for bit, else the script says so and stops (a speed-up that changes numbers is not this tool's
business). Tensors: ``research/nibbles_step_time.py``'s (GPT-2 small's block 0 by default; ``--set gpt2``:
all of GPT-2 small).
"""
from __future__ import annotations

import argparse
import os
import ctypes
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("GEFEN_DIST_CPU_ISA", "native")  # the timed builds replace the native one (kernels/cpu_build.py)

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "research")]

import torch  # noqa: E402

from gefen_dist import Gefen  # noqa: E402
from gefen_dist.kernels import cpu, native  # noqa: E402

SRC = "gefen_dist/kernels/csrc/gefen_step.c"


def source(rev: str) -> str:
    if rev == "WORK":
        return (ROOT / SRC).read_text()
    return subprocess.run(["git", "show", f"{rev}:{SRC}"], cwd=ROOT, check=True, capture_output=True,
                          text=True).stdout


def build(rev: str, flags: str, march: str, out: Path) -> ctypes.CDLL:
    src = out.with_suffix(".c")
    src.write_text(source(rev))
    cmd = ["gcc", *shlex.split(flags), "-shared", f"-march={march}", "-fopenmp", "-o", str(out), str(src), "-lm"]
    subprocess.run(cmd, check=True)
    return ctypes.CDLL(str(out))


def use(lib) -> None:
    native._cache[cpu._LIB_NAME] = lib
    if cpu._lib() is not lib:
        raise SystemExit("the build was not taken (ABI differs from this checkout's wrapper?)")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--a", default="HEAD~1")
    ap.add_argument("--b", default="WORK")
    base = " ".join(f for f in native._BASE_FLAGS if f not in ("-shared", "-fPIC")) + " -fPIC"
    ap.add_argument("--flags-a", default=base)
    ap.add_argument("--flags-b", default=base)
    ap.add_argument("--march", default="native")
    ap.add_argument("--march-a", default=None, help="build A's -march (default: --march)")
    ap.add_argument("--march-b", default=None, help="build B's -march (default: --march)")
    ap.add_argument("--second-moment", default="factored,nibbles")
    ap.add_argument("--set", default="block0")
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--no-check", action="store_true")
    a = ap.parse_args(argv)
    torch.set_num_threads(1)
    import nibbles_step_time as nst

    ps, gs = nst.tensors(0, a.set)
    tmp = Path(tempfile.mkdtemp(prefix="gefen_ab_"))
    ma, mb = a.march_a or a.march, a.march_b or a.march
    libs = {"A": build(a.a, a.flags_a, ma, tmp / "a.so"), "B": build(a.b, a.flags_b, mb, tmp / "b.so")}
    modes = a.second_moment.split(",")
    opts = {}
    for name, lib in libs.items():
        use(lib)
        for sm in modes:
            params = [torch.nn.Parameter(p.clone()) for p in ps]
            o = Gefen(params, lr=1e-3, second_moment=sm)
            for _ in range(2):  # the first learns the codebook
                for p, g in zip(params, gs):
                    p.grad = g.clone()
                o.step()
            opts[name, sm] = (o, params)
    if not a.no_check:
        for sm in modes:
            (oa, pa), (ob, pb) = opts["A", sm], opts["B", sm]
            same = all(torch.equal(x, y) for x, y in zip(pa, pb)) and all(
                torch.equal(oa.state[x][k], ob.state[y][k]) for x, y in zip(pa, pb) for k in oa.state[x]
                if isinstance(oa.state[x][k], torch.Tensor))
            if not same:
                print(f"second_moment={sm!r}: the two builds give different results; not timed")
                return 1
    times = {key: [] for key in opts}
    for _ in range(a.rounds):
        for (name, sm), (o, params) in opts.items():
            use(libs[name])
            for p, g in zip(params, gs):
                p.grad = g
            t0 = time.process_time()
            o.step()
            times[name, sm].append(time.process_time() - t0)
    print(f"A = {a.a} [{a.flags_a} -march={ma}], B = {a.b} [{a.flags_b} -march={mb}]; {a.set}, {a.rounds} rounds, "
          "1 thread"
          + ("" if a.no_check else "; results bitwise equal"))
    for sm in modes:
        ma, mb = (statistics.median(times[n, sm]) * 1e3 for n in ("A", "B"))
        print(f"  second_moment={sm!r}: A {ma:.2f} ms, B {mb:.2f} ms, B/A {mb / ma:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
