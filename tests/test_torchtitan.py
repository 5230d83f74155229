"""Gefen through torchtitan's checkpointing (``CheckpointManager`` over DCP), FSDP2 on CPU/gloo:
saved at 2 ranks, loaded at 1 rank (tests/dist/titan_ckpt.py).

torchtitan is not in the test extra (0.3.0 pins spmd_types==0.2.3 and pulls datasets, wandb,
tensorboard, torchdata...): ``scripts/setup.sh`` installs it and the modules its checkpoint and
optimizer components import with ``--no-deps`` (torchtitan==0.3.0 spmd_types==0.2.3 tyro
docstring-parser typeguard), so CI runs this test.
"""
import os
import sys

import pytest

pytest.importorskip("torchtitan", reason="torchtitan is not installed (not in the test extra; see this file's docstring)")
pytest.importorskip("torchtitan.components.checkpoint",
                    reason="torchtitan.components.checkpoint does not import (missing dependency: tyro?)")
pytest.importorskip("torchtitan.components.optimizer",
                    reason="torchtitan.components.optimizer does not import (missing dependency: spmd_types?)")

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "dist"))
from _launch import run_torchrun  # noqa: E402


def _ok(res, n):
    assert "ALL OK" in res.stdout, res.stdout[-6000:]
    ok = [line for line in res.stdout.splitlines() if line.startswith("OK ")]
    assert len(ok) == n, "\n".join(ok) + "\n" + res.stdout[-3000:]
    return ok


@pytest.mark.dist
def test_torchtitan_checkpoint_manager_2ranks_to_1rank(tmp_path):
    """torchtitan's OptimizersContainer (a subclass naming "Gefen") and CheckpointManager: save at
    2 ranks, load at 1; Gefen state bitwise equal to the saved one (a 2560-element row with period
    1280 among them), the resumed step bitwise equal to the uninterrupted 2-rank run."""
    ok = _ok(run_torchrun("titan_ckpt.py", 2, "save", tmp_path, timeout=240), 1)
    assert "((64, 2560), 1280)" in ok[0], ok
    ok = _ok(run_torchrun("titan_ckpt.py", 1, "load", tmp_path, timeout=240), 2)
    assert "ws=2 -> ws=1" in ok[0] and "bitwise equal" in ok[1], ok
