"""research/tests: tests of the research scripts and variants. CI does not collect them (pytest's
testpaths is ["tests"]); run ``python -m pytest research/tests`` from the repository root."""
import os
import sys
from pathlib import Path

os.environ.setdefault("GEFEN_DIST_CPU_ISA", "native")  # the timed builds replace the native one (kernels/cpu_build.py)

ROOT = Path(__file__).resolve().parents[2]
for p in (ROOT / "research", ROOT / "benchmarks", ROOT / "tests", ROOT):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))
