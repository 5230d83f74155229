"""Gefen under DeepSpeed ZeRO-2 with fp16 dynamic loss scaling: overflow steps are skipped and leave
Gefen untouched (one real 2-rank ``deepspeed`` launch on CPU/gloo, about 25 s).

DeepSpeed's CPU accelerator accepts fp16 only on CPUs with a native oneDNN fp16 path; the worker
(tests/dist/ds_fp16.py) patches ``CPU_Accelerator.is_fp16_supported`` to True in its own processes
(torch runs fp16 Linear/tanh forward and backward on any CPU) and leaves DeepSpeed's fp16 ZeRO-2
path, loss scaler and overflow check unmodified. Per second-moment layout (shared, factored) it
checks that an overflow at the first step (before Gefen has any state), an inf on one rank and a
NaN on the other are skipped on both ranks (``skipped_steps`` +1, loss scale halved,
``Gefen.step`` not called, Gefen's state / fp32 masters / fp16 weights / lr bitwise unchanged),
that normal steps learn and advance the state (uint8 idx, periods, step count), and that the run
ends bitwise equal to the same run without the overflow steps.
"""
import os
import shutil
import subprocess
import sys

import pytest

pytest.importorskip("deepspeed", reason="deepspeed is not installed (pip install deepspeed)")

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "dist"))
from _launch import ROOT, _env, free_port, wait_torchrun  # noqa: E402

sys.path.pop(0)

CASES = ("shared", "factored")


@pytest.mark.dist
def test_deepspeed_fp16_overflow_skips():
    launcher = shutil.which("deepspeed", path=os.path.dirname(sys.executable)) or shutil.which("deepspeed")
    if launcher is None:
        pytest.skip("the deepspeed launcher is not on PATH")
    env = _env()
    env["DS_ACCELERATOR"] = os.environ.get("DS_ACCELERATOR", "cpu")
    if env["DS_ACCELERATOR"] != "cpu":
        pytest.skip("this launch patches DeepSpeed's CPU accelerator (DS_ACCELERATOR=cpu)")
    cmd = [launcher, "--num_gpus", "2", "--master_port", str(free_port()),
           os.path.join(HERE, "dist", "ds_fp16.py"), "--cases", ",".join(CASES)]
    # own session: on a timeout wait_torchrun kills the launcher, its launch.py and the workers
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    out = wait_torchrun(proc, 600, "deepspeed --num_gpus 2 ds_fp16.py").stdout
    assert "ALL OK" in out, out[-6000:]
    ok = [line for line in out.splitlines() if line.startswith("OK ")]
    assert [line.split(":")[0] for line in ok] == [f"OK fp16-{c}" for c in CASES], "\n".join(ok)
    for line in ok:
        assert "skipped_steps 3" in line and "bitwise equal to the run without overflows" in line, line
