"""FSDP2 / HSDP Gefen against single-process Gefen (real torchrun launches on CPU/gloo).

With the single-process gradient fed to the sharded optimizer, parameters and every state tensor
must be bitwise identical (the optimizer is rank-invariant); with real FSDP gradients (which
differ at rounding level because of the reduce-scatter order) they must stay close.
"""
import importlib.util
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "dist"))
from _launch import run_torchrun  # noqa: E402


# The configurations of one world size share a launch (``--then``: a launch costs seconds of start-up
# per rank). ``--cuda-batch`` sets TRITON_INTERPRET in the ranks, which only the Triton kernels read:
# the other configurations of that launch step on the C kernel as in a launch of their own.
@pytest.mark.dist
@pytest.mark.parametrize("nproc,configs", [
    (2, [["--same-grads", "--refusals"],
         ["--same-grads", "--second-moment", "elementwise"]]),
    (3, [["--same-grads", "--second-moment", "factored", "--nonfinite", "--col-blocks"],
         # narrow_rows="span" (D16): blocks of 1024 / 342 / 32 rows cut by the shards, replicated block state
         ["--same-grads", "--second-moment", "factored", "--nonfinite", "--narrow-span", "--adamw-import"],
         # narrow_rows="rows8" (D19): b.weight's row codes replicated, its reference blocks cut by the shards
         ["--same-grads", "--second-moment", "factored", "--narrow-rows8", "--adamw-import", "--steps", "6"],
         # second_moment="nibbles" (D20): b's row blocks cut by the shards, the draws keyed by global rows
         ["--same-grads", "--second-moment", "nibbles", "--nonfinite", "--steps", "6"],
         # the multi-tensor CUDA batch (gefen_dist.engine.cuda_batch) on DTensor shards, through the
         # Triton interpreter: pieces that cut row blocks, the non-finite protocol
         ["--same-grads", "--second-moment", "factored", "--nonfinite", "--cuda-batch", "--steps", "5"],
         # capturable=True on DTensor shards: the sharded batch with its verdict on the device
         ["--same-grads", "--second-moment", "factored", "--cuda-batch", "--capturable", "--steps", "4"]]),
    (4, [["--same-grads", "--hsdp", "--second-moment", "factored", "--adamw-import"],
         # the per-tensor path at 4 ranks, where tiny's shard on rank 3 is empty: its replicated v_col still
         # advances there; then column blocks (D21) on it
         ["--same-grads", "--second-moment", "factored", "--per-tensor", "--steps", "4"],
         ["--same-grads", "--second-moment", "factored", "--col-blocks", "--steps", "4"],
         ["--hsdp"],
         ["--same-grads", "--hsdp", "--second-moment", "factored", "--narrow-span"],
         ["--same-grads", "--hsdp", "--second-moment", "factored", "--narrow-rows8", "--steps", "4"],
         ["--same-grads", "--hsdp", "--second-moment", "nibbles", "--steps", "4"],
         # the batch under HSDP: the replica mask
         ["--same-grads", "--hsdp", "--second-moment", "factored", "--cuda-batch", "--steps", "4"]]),
], ids=["ws2", "ws3", "ws4_hsdp"])
def test_fsdp2_matches_single_process(nproc, configs):
    if importlib.util.find_spec("triton") is None:  # the CUDA plan's kernels run through its interpreter
        configs = [args for args in configs if "--cuda-batch" not in args]
    argv = [a for i, args in enumerate(configs) for a in ((["--then"] if i else []) + args)]
    out = run_torchrun("fsdp_vs_single.py", nproc, *argv, timeout=180 * len(configs), relaunch_on_crash=True).stdout
    parts = out.split("CONFIG ")[1:]
    assert len(parts) == len(configs), out[-4000:]
    for i, (args, part) in enumerate(zip(configs, parts)):
        assert part.startswith(f"{i}: {' '.join(args)}\n"), part[:200]
        _check_config(args, part)


def _check_config(args, out):
    assert "OK fsdp" in out, out[-4000:]
    if "--refusals" in args:
        assert "OK refusals" in out
    if "--nonfinite" in args:
        assert "OK nonfinite" in out
    if "--cuda-batch" in args:
        assert "OK cuda batch: sharded=True" in out
    if "--capturable" in args:
        assert "OK capturable ws=" in out
    if "--adamw-import" in args:
        assert "OK adamw import ws=" in out
    if "--col-blocks" in args:
        assert "OK col blocks: v_row (3, 4)" in out and " col_blocks same_grads=" in out
    if "--same-grads" in args and "--capturable" in args:  # exact tensors by torch's fused AdamW (see the script)
        assert "; quantized tensors bitwise" in out
    elif "--same-grads" in args:
        assert "max relative param diff 0.000e+00" in out
