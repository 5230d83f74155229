#!/usr/bin/env python
"""Run PyTorch's own ``test/test_optim.py::TestOptimRenewed`` against Gefen (CPU).

PyTorch's file is not part of this repository (nor of the torch wheel): pass the path of
``test/test_optim.py`` from a PyTorch checkout. This script copies it into a temporary directory,
replaces its ``optim_db`` (the list of ``OptimizerInfo`` the tests are parametrized over) with
``[GEFEN_OPTIM_INFO]`` from ``tests/_gefen_optim_info.py``, stubs the ``optim.*`` test modules it
imports for the legacy classes, and runs pytest on ``TestOptimRenewedCPU`` only. The counts
(passed / failed / skipped) are printed at the end, as pytest reports them.

    python scripts/run_upstream_optim_suite.py /path/to/pytorch/test/test_optim.py [-- pytest args]

The runs recorded in docs/api.md ("Conformance") used PyTorch commit
c96bc81bc2d0c9bdacd9aa6cbda691777bd299c0 of test/test_optim.py with torch 2.13 (CPU).
"""
from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

_INJECT = """
# --- injected by gefen_dist scripts/run_upstream_optim_suite.py: Gefen only ---
import sys as _sys
_sys.path[:0] = [{root!r}, {tests!r}]
from _gefen_optim_info import GEFEN_OPTIM_INFO as _GEFEN_OPTIM_INFO
optim_db = [_GEFEN_OPTIM_INFO]
# --- end of injection ---
"""

# The legacy test classes upstream imports next to TestOptimRenewed (test/optim/*.py).
_STUBS = {"test_optim": ("TestOptim", "TestDifferentiableOptimizer"), "test_lrscheduler": ("TestLRScheduler",),
          "test_swa_utils": ("TestSWAUtils",)}


def prepare(upstream: Path, workdir: Path) -> Path:
    src = upstream.read_text()
    lines = src.splitlines(keepends=True)
    # drop `from optim.xxx import ...` (the legacy classes would run torch's optimizers too)
    lines = [ln for ln in lines if not re.match(r"\s*from optim\.", ln)]
    src = "".join(lines)
    # inject right before the first use of optim_db at class level (after every import)
    at = src.find("\n@markDynamoStrictTest")
    if at < 0:
        at = src.find("\nclass TestOptimRenewed")
    if at < 0:
        raise SystemExit(f"{upstream}: no TestOptimRenewed class found; is this PyTorch's test/test_optim.py?")
    src = src[:at] + _INJECT.format(root=str(ROOT), tests=str(ROOT / "tests")) + src[at:]
    out = workdir / "test_optim.py"
    out.write_text(src)
    pkg = workdir / "optim"
    pkg.mkdir(exist_ok=True)
    (pkg / "__init__.py").write_text("")
    for mod, names in _STUBS.items():
        (pkg / f"{mod}.py").write_text("".join(f"{n} = None\n" for n in names))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("upstream", type=Path, help="PyTorch's test/test_optim.py")
    ap.add_argument("--keep", action="store_true", help="keep the temporary directory")
    ap.add_argument("pytest_args", nargs="*", help="extra pytest arguments (after --)")
    a = ap.parse_args(argv)
    if not a.upstream.is_file():
        raise SystemExit(f"{a.upstream}: not a file; pass the path of PyTorch's test/test_optim.py")
    work = Path(tempfile.mkdtemp(prefix="gefen_upstream_optim_"))
    try:
        test = prepare(a.upstream, work)
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(work), str(ROOT), str(ROOT / "tests"),
                                                             os.environ.get("PYTHONPATH", "")]))
        cmd = [sys.executable, "-m", "pytest", str(test), "-p", "no:cacheprovider", "-q", "-rfEs",
               "--rootdir", str(work), "-k", "TestOptimRenewedCPU", *a.pytest_args]
        print("+", " ".join(cmd), flush=True)
        return subprocess.call(cmd, cwd=work, env=env)
    finally:
        if a.keep:
            print(f"kept {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
