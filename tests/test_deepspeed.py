"""Gefen under DeepSpeed ZeRO-1/2/3: real ``deepspeed`` launches on CPU/gloo (2 ranks, then 1 and 3).

The worker (tests/dist/ds_check.py) checks, against single-process Gefen on the same global
batch: identical codebook and periods, parameters within 1e-6 relative after 10 steps (ZeRO-1,
ZeRO-2 with gradient accumulation + round_robin_gradients + the JSON WarmupLR, ZeRO-2 with
clipping, ZeRO-2 CPU offload, ZeRO-3 with zero.Init and several sub-groups, the client-optimizer
path through ``gefen_dist.integrations.deepspeed.initialize``; the base ``gefen_dist.Gefen`` as a client optimizer
refused at its first step under ZeRO-1/2/3); the factored second moment
(``second_moment="factored"``) under ZeRO-1, ZeRO-2, ZeRO-2 CPU offload and ZeRO-3 against
``Gefen(second_moment="factored", fused=False)``, with cut rows' ``v_row`` identical on both ranks;
the per-element second moment (``second_moment="elementwise"``: period 1 everywhere) under ZeRO-2;
bit-identical resume and ``zero_to_fp32`` for ZeRO-2 and ZeRO-3 (and ZeRO-3 factored); the one-byte layout
(``second_moment="nibbles"``, D20) under ZeRO-1, ZeRO-2 (2 and 3 ranks) and ZeRO-3 against single-process
``Gefen(second_moment="nibbles")`` (codes, ``v_row``, ``v_col``, parameters), its bit-identical resume, its
universal checkpoint (state bitwise at 1, 2 and 3 ranks) and its refusal by a factored engine; column blocks
(``col_blocks``, D21) under ZeRO-2 and ZeRO-3 (rows cut by partition edges), their bit-identical resume, their
universal checkpoint (bitwise at 1, 2 and 3 ranks) and the refusal of another ``col_blocks``; bf16 through
ZeRO-2 and the BF16_Optimizer (shared and factored); the refusals. fp16 loss-scale skips are tested
in tests/test_deepspeed_fp16.py (the CPU accelerator's fp16 capability check patched in the worker).

Checkpoints across world sizes (the 2-rank launch saves, the 1- and 3-rank launches load):
``gefen-dist ds-to-universal`` of a ZeRO-2 (round-robin, shared) and a ZeRO-3 (factored, zero.Init)
checkpoint saved at 2 ranks; loaded back at 2 ranks the state is bitwise and the run continues
bit-identically; loaded at 1 and 3 ranks the full per-tensor state (idx, scale, v / v_row, v_col,
exact moments, weights) equals the original bitwise and 3 more steps match the uninterrupted 2-rank
run (1e-6 relative, <= 0.1% codeword flips); a rigid 2-rank checkpoint loaded at 1 or 3 ranks raises
an error naming both world sizes and the converter; an AdamW checkpoint converted by DeepSpeed's own
``ds_to_universal`` warm-starts Gefen (shared and factored; at 1 and 3 ranks).
"""
import os
import shutil
import subprocess
import sys

import pytest

deepspeed = pytest.importorskip("deepspeed", reason="deepspeed is not installed (pip install deepspeed)")

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CASES = ("z1,z2,z2clip,z2off,z2client,z3,z2f,z3f,ck2,ck3,ck3f,bf16,bf16opt,refuse,fp16,"
         "z1f,z2offf,bf16optf,z2e,z2span,z3span,ck2span,z2rows8,z3rows8,ck2rows8,plainclient,ucsave:ucz2,ucsave:ucz3f,ucsave:ucz2span,ucsave:ucz2rows8,adamsave,"
         "nanz3,nanbf16,ovz3,ovz3span,z1nib,z2nib,z3nib,ck2nib,ucsave:ucz2nib,z2cb,z3cb,ck2cb,ucsave:ucz2cb")
CASES_WS1 = ("ucload:ucz2,ucload:ucz3f,ucload:ucz2span,ucload:ucz2rows8,ucx,wserr,adamwarm:shared,adamwarm:factored,"
             "ucload:ucz2nib,ucload:ucz2cb")
# z2rows8 at 3 ranks: a partition edge cuts one of b's rows (D19: both ranks keep its codes, one adds its old v)
CASES_WS3 = ("ucload:ucz2,ucload:ucz3f,ucload:ucz2span,ucload:ucz2rows8,wserr,adamwarm:factored,adamwarm:rows8,z2rows8,"
             "z2nib,ucload:ucz2nib,ucload:ucz2cb")


def _launch(ranks, cases, ckpt, keep):
    launcher = shutil.which("deepspeed", path=os.path.dirname(sys.executable)) or shutil.which("deepspeed")
    if launcher is None:
        pytest.skip("the deepspeed launcher is not on PATH")
    env = dict(os.environ, DS_ACCELERATOR=os.environ.get("DS_ACCELERATOR", "cpu"), OMP_NUM_THREADS="1",
               PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    port = str(29500 + (os.getpid() + 7 * ranks) % 1000)
    cmd = [launcher, "--num_gpus", str(ranks), "--master_port", port,
           os.path.join(REPO, "tests", "dist", "ds_check.py"), "--cases", cases, "--ckpt", str(ckpt)]
    if keep:
        cmd.append("--keep")
    r = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    out = r.stdout + r.stderr
    ok = [line for line in out.splitlines() if line.startswith(("OK ", "SKIP "))]
    return r.returncode, out, ok


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    ckpt = tmp_path_factory.mktemp("ds") / "ckpt"
    return ckpt, _launch(2, CASES, ckpt, keep=False)


@pytest.mark.dist
def test_deepspeed_zero_2ranks(two_ranks):
    _, (rc, out, ok) = two_ranks
    assert rc == 0 and "ALL OK" in out, out[-6000:]
    assert len(ok) == len(CASES.split(",")), "\n".join(ok)


@pytest.mark.dist
@pytest.mark.parametrize("ranks,cases", [(1, CASES_WS1), (3, CASES_WS3)], ids=["ws1", "ws3"])
def test_deepspeed_universal_other_world_size(two_ranks, ranks, cases):
    ckpt, (rc, out2, _) = two_ranks
    if rc != 0:
        pytest.fail("the 2-rank launch that saves the checkpoints failed:\n" + out2[-3000:])
    rc, out, ok = _launch(ranks, cases, ckpt, keep=True)
    assert rc == 0 and "ALL OK" in out, out[-6000:]
    assert len(ok) == len(cases.split(",")), "\n".join(ok)


def test_stale_extension_lock_is_reported(tmp_path, caplog):
    """A ``lock`` left by a killed JIT build makes every later DeepSpeed init wait forever (torch's
    FileBaton); importing the integration names such a lock and the command that removes it."""
    import logging
    import time

    from gefen_dist.integrations import deepspeed as gds

    # <root>/<op>/lock under $TORCH_EXTENSIONS_DIR, <root>/py311_cpu/<op>/lock under the default root
    live, stale = tmp_path / "op_live" / "lock", tmp_path / "py311_cpu" / "op_stale" / "lock"
    for p in (live, stale):
        p.parent.mkdir(parents=True)
        p.touch()
    old = time.time() - 3600
    os.utime(stale, (old, old))
    assert [p for p, _ in gds.extension_locks(str(tmp_path))] == [str(live), str(stale)]
    with caplog.at_level(logging.WARNING, logger=gds.__name__):
        assert gds.warn_stale_extension_locks(root=str(tmp_path)) == [str(stale)]
    assert f"rm {stale}" in caplog.text and "60 minutes old" in caplog.text and str(live) not in caplog.text
    with caplog.at_level(logging.WARNING, logger=gds.__name__):
        assert gds.warn_stale_extension_locks(max_age_s=7200, root=str(tmp_path)) == []


def test_suite_builds_extensions_in_its_own_directory():
    """tests/conftest.py points every launched rank at this checkout's build/torch_extensions, so a
    lock a killed build left in the shared ~/.cache cannot hang the suite (it did, in CI)."""
    root = os.environ["TORCH_EXTENSIONS_DIR"]
    if os.path.realpath(root) != os.path.realpath(os.path.join(REPO, "build", "torch_extensions")):
        pytest.skip(f"TORCH_EXTENSIONS_DIR was set by the caller ({root})")
    assert os.path.isdir(root)
