"""Gefen under DeepSpeed ZeRO-1/2/3: one real 2-rank ``deepspeed`` launch on CPU/gloo.

The worker (tests/dist/ds_check.py) checks, against single-process Gefen on the same global
batch: identical codebook and periods, parameters within 1e-6 relative after 10 steps (ZeRO-1,
ZeRO-2 with gradient accumulation + round_robin_gradients + the JSON WarmupLR, ZeRO-2 with
clipping, ZeRO-2 CPU offload, ZeRO-3 with zero.Init and several sub-groups, the client-optimizer
path through ``gefen_dist.integrations.deepspeed.initialize``); the factored second moment
(``second_moment="factored"``) under ZeRO-2 and ZeRO-3 against ``Gefen(second_moment="factored",
fused=False)``, with cut rows' ``v_row`` identical on both ranks; bit-identical resume and
``zero_to_fp32`` for ZeRO-2 and ZeRO-3 (and ZeRO-3 factored); bf16 through ZeRO-2 and the BF16_Optimizer; the
refusals. fp16 loss-scale skips need a GPU (DeepSpeed's CPU accelerator has no fp16).
"""
import os
import shutil
import subprocess
import sys

import pytest

deepspeed = pytest.importorskip("deepspeed", reason="deepspeed is not installed (pip install deepspeed)")

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CASES = "z1,z2,z2clip,z2off,z2client,z3,z2f,z3f,ck2,ck3,ck3f,bf16,bf16opt,refuse,fp16"


@pytest.mark.dist
def test_deepspeed_zero_2ranks(tmp_path):
    launcher = shutil.which("deepspeed", path=os.path.dirname(sys.executable)) or shutil.which("deepspeed")
    if launcher is None:
        pytest.skip("the deepspeed launcher is not on PATH")
    env = dict(os.environ, DS_ACCELERATOR=os.environ.get("DS_ACCELERATOR", "cpu"), OMP_NUM_THREADS="1",
               PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    port = str(29500 + os.getpid() % 1000)
    cmd = [launcher, "--num_gpus", "2", "--master_port", port, os.path.join(REPO, "tests", "dist", "ds_check.py"),
           "--cases", CASES, "--ckpt", str(tmp_path / "ckpt")]
    r = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=420)
    out = r.stdout + r.stderr
    ok = [line for line in out.splitlines() if line.startswith(("OK ", "SKIP "))]
    assert r.returncode == 0 and "ALL OK" in out, out[-6000:]
    assert len(ok) == len(CASES.split(",")), "\n".join(ok)
