"""The test launcher's relaunch rule (tests/dist/_launch.py): a launch is run once more only when a
worker died of SIGSEGV or SIGBUS, with a warning that carries the first launch's output; a second crash,
an abort or an exception fails."""
import os
import subprocess
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "dist"))
from _launch import crashed_worker, run_torchrun  # noqa: E402

# what torchrun printed for the crash of CI 2026-12-07 (rank 3), and for the workers it then ended
_CRASH = ("Root Cause (first observed failure):\n[0]:\n  rank      : 3 (local_rank: 3)\n"
          "  exitcode  : -11 (pid: 27425)  (SIGSEGV)\n")
_TERM = "[1]:\n  rank      : 0 (local_rank: 0)\n  exitcode  : -15 (pid: 27422)  (SIGTERM)\n"


def _res(rc, out):
    return subprocess.CompletedProcess([], rc, out, "")


def test_crash_rule():
    assert crashed_worker(_res(1, _TERM + _CRASH)) == "SIGSEGV"
    assert crashed_worker(_res(1, _CRASH.replace("-11", "-7").replace("SIGSEGV", "SIGBUS"))) == "SIGBUS"
    assert crashed_worker(_res(0, _CRASH)) is None  # a launch that passed
    assert crashed_worker(_res(1, _TERM)) is None  # only the SIGTERM torchrun sends after a failure
    abort = _CRASH.replace("-11", "-6").replace("SIGSEGV", "SIGABRT")
    assert crashed_worker(_res(1, abort)) is None  # an abort (a heap error's, gloo's teardown) is a failure
    assert crashed_worker(_res(1, "Traceback ...\nAssertionError: codebook differs\n  exitcode  : 1 (pid: 5)\n")) is None


@pytest.mark.dist
def test_relaunch_once_after_a_crash(tmp_path):
    """One launch: rank 1 dies of SIGSEGV (its Python stack in the output: PYTHONFAULTHANDLER), the
    relaunch passes and the warning carries the first output; with a crash on every launch the test
    fails after one relaunch (an abort is never relaunched: test_crash_rule)."""
    marker = tmp_path / "once"
    with pytest.warns(UserWarning, match="died of SIGSEGV; relaunching once") as rec:
        res = run_torchrun("crash_once.py", 2, str(marker), "SEGV", timeout=120, relaunch_on_crash=True)
    assert "OK rank 0" in res.stdout and "OK rank 1" in res.stdout
    first = str(rec[0].message)
    assert "Fatal Python error: Segmentation fault" in first and "crash_once.py" in first, first[-2000:]
    with pytest.raises(AssertionError, match=r"relaunched after a SIGSEGV\) failed"):
        with pytest.warns(UserWarning):
            run_torchrun("crash_once.py", 2, str(tmp_path / "always"), "SEGV", "always", timeout=120,
                         relaunch_on_crash=True)
