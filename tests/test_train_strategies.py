"""launch/train.py under every strategy: 2-rank torchrun launches on CPU/gloo, tiny preset, 6 steps.

Each strategy (ddp, zero1, fsdp, deepspeed) must finish, write metrics.json (rank 0) and train
like the ``single`` strategy on the same global batch: ``Batches`` gives rank r rows
[r*b, (r+1)*b) of the single-process batch, and validation uses the same global batches split
the same way, so the per-step training losses and the validation losses must agree.

Why a tolerance and not bitwise equality: the distributed gradient is the mean of per-rank means
reduced by a collective (gloo ring / DeepSpeed's bucketed reduce), the single-process gradient is
one mean over the whole batch; the two differ by float rounding (~1e-7 relative). Gefen rounds
its first moment to the nearest codeword, so a rounding-level difference can occasionally move
an element to the neighbouring codeword; over 6 steps the observed loss difference is < 4e-6
(deepspeed), < 1e-6 (ddp, zero1, fsdp). The test allows 1e-3 absolute per logged loss: loose
enough for other BLAS/thread counts, tight enough to catch a wrong batch split, a missing
gradient average (2x), wrong clipping or a wrong LR schedule (all >= 1e-2 here).

Checkpoint/resume: ddp and fsdp stop at step 3 (``--stop-after``) and resume; the resumed run
must be bit-identical to the uninterrupted one (ddp: losses, model, optimizer state; fsdp, from
its sharded DCP checkpoint: every training and validation loss).

About 2-3 minutes on 2 CPU cores (8 launches of 10-30 s each).
"""
from __future__ import annotations

import importlib.util
import json
import math
import sys
from pathlib import Path

import pytest
import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE / "dist"))
from _launch import run_torchrun  # noqa: E402

from launch import train  # noqa: E402

REPO = HERE.parent
TRAIN = str(REPO / "launch" / "train.py")
STEPS = 6
TINY = ["--model", "tiny", "--batch-size", "8", "--lr", "3e-3", "--warmup", "2",
        "--eval-every", "3", "--eval-batches", "2", "--seed", "3", "--steps", str(STEPS),
        "--no-progress", "--device", "cpu", "--log-level", "WARNING"]
TOL = 1e-3
TIMEOUT = 240

pytestmark = pytest.mark.dist

try:
    from gefen_dist import Gefen  # noqa: F401
except ImportError as e:  # pragma: no cover
    pytest.skip(f"gefen_dist.Gefen not importable: {e}", allow_module_level=True)


def _metrics(out: Path) -> dict:
    return json.loads((out / "metrics.json").read_text())


def _launch(out: Path, strategy: str, *extra: str, opt: str = "both") -> dict:
    run_torchrun(TRAIN, 2, "--strategy", strategy, "--optimizer", opt, "--out", str(out),
                 *TINY, *extra, timeout=TIMEOUT)
    return _metrics(out)


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    out = tmp_path_factory.mktemp("single")
    train.main(TINY + ["--strategy", "single", "--optimizer", "both", "--no-plot",
                       "--out", str(out)])
    return _metrics(out)


def _check_like_single(m: dict, ref: dict, strategy: str) -> None:
    assert set(m["runs"]) == {"adamw", "gefen"}
    for opt in ("adamw", "gefen"):
        run, want = m["runs"][opt], ref["runs"][opt]
        s = run["summary"]
        assert s["strategy"] == strategy and s["world_size"] == 2 and s["finished"]
        assert s["steps"] == STEPS and len(run["train_losses"]) == STEPS
        assert all(math.isfinite(v) for v in run["train_losses"])
        for a, b in zip(run["train_losses"], want["train_losses"]):
            assert abs(a - b) <= TOL, (strategy, opt, run["train_losses"], want["train_losses"])
        assert [e["step"] for e in run["evals"]] == [e["step"] for e in want["evals"]] == [0, 3, 6]
        for a, b in zip(run["evals"], want["evals"]):
            assert abs(a["val_loss"] - b["val_loss"]) <= TOL, (strategy, opt, a, b)
            assert a["lr"] == pytest.approx(b["lr"], rel=1e-12)
        # memory accounting: per rank and total
        assert len(s["state_bytes_per_rank"]) == 2 and min(s["state_bytes_per_rank"]) > 0
        assert s["state_bytes_sum_over_ranks"] == sum(s["state_bytes_per_rank"])
        assert len(s["peak_memory_bytes_per_rank"]) == 2 and s["peak_memory_kind"] == "peak_rss"
        assert min(s["peak_memory_bytes_per_rank"]) > 10 * 2**20
        if strategy != "ddp":  # sharded state: each rank holds about half
            assert max(s["state_bytes_per_rank"]) < 0.7 * s["state_bytes_sum_over_ranks"]
    a, g = m["summary"]["adamw"], m["summary"]["gefen"]
    assert 7.99 <= a["state_bytes_per_param"] < 8.01
    assert g["state_bytes_per_param"] < 1.5
    assert m["config"]["strategy"] == strategy


def test_ddp_like_single_and_resume_bit_identical(tmp_path, single):
    straight = tmp_path / "straight"
    m = _launch(straight, "ddp", "--checkpoint-every", "3")
    _check_like_single(m, single, "ddp")
    assert (straight / "loss.png").stat().st_size > 1000
    assert m["summary"]["gefen"]["state_bytes_per_rank"][0] == m["summary"]["gefen"]["state_bytes_per_rank"][1]

    split = tmp_path / "split"
    _launch(split, "ddp", "--checkpoint-every", "3", "--stop-after", "3", "--no-plot", opt="gefen")
    ck = train.checkpoint_path(str(split), "gefen")
    assert torch.load(ck, weights_only=False)["step"] == 3
    b = _launch(split, "ddp", "--checkpoint-every", "3", "--no-plot", "--resume", "auto", opt="gefen")
    ra, rb = m["runs"]["gefen"], b["runs"]["gefen"]
    assert ra["train_losses"] == rb["train_losses"]
    assert [e["val_loss"] for e in ra["evals"]] == [e["val_loss"] for e in rb["evals"]]
    ca = torch.load(train.checkpoint_path(str(straight), "gefen"), weights_only=False)
    cb = torch.load(ck, weights_only=False)
    assert ca["step"] == cb["step"] == STEPS and ca["strategy"] == "ddp"
    for k in ca["model"]:  # plain (unwrapped) names: loads into the single strategy too
        assert not k.startswith("module.")
        assert torch.equal(ca["model"][k], cb["model"][k]), k
    sa, sb = ca["optimizer"]["state"], cb["optimizer"]["state"]
    assert sa.keys() == sb.keys()
    for i in sa:
        for k, v in sa[i].items():
            if torch.is_tensor(v):
                assert torch.equal(v, sb[i][k]), (i, k)


def test_zero1_like_single(tmp_path, single):
    out = tmp_path / "zero1"
    m = _launch(out, "zero1", "--checkpoint-every", "6", "--no-plot")
    _check_like_single(m, single, "zero1")
    # consolidated on rank 0: single-process Gefen's layout, loadable by plain Gefen
    ck = torch.load(train.checkpoint_path(str(out), "gefen"), weights_only=False)
    assert ck["step"] == STEPS and ck["strategy"] == "zero1"
    assert any(st.get("idx") is not None and st["idx"].dtype == torch.uint8
               for st in ck["optimizer"]["state"].values())
    assert (out / "checkpoint_adamw.pt").is_file()


def test_fsdp_like_single_and_resume(tmp_path, single):
    straight = tmp_path / "straight"
    m = _launch(straight, "fsdp", "--no-plot")
    _check_like_single(m, single, "fsdp")

    split = tmp_path / "split"
    _launch(split, "fsdp", "--checkpoint-every", "3", "--stop-after", "3", "--no-plot", opt="gefen")
    ck = split / "checkpoint_gefen_dcp"
    assert (ck / ".metadata").is_file() and (ck / "meta.pt").is_file()
    assert torch.load(ck / "meta.pt", weights_only=False)["step"] == 3
    b = _launch(split, "fsdp", "--checkpoint-every", "3", "--no-plot", "--resume", str(ck), opt="gefen")
    ra, rb = m["runs"]["gefen"]["train_losses"], b["runs"]["gefen"]["train_losses"]
    assert len(rb) == STEPS and rb == ra, (ra, rb)  # bit-identical continuation
    assert ([e["val_loss"] for e in m["runs"]["gefen"]["evals"]]
            == [e["val_loss"] for e in b["runs"]["gefen"]["evals"]])
    assert torch.load(ck / "meta.pt", weights_only=False)["step"] == STEPS


def test_deepspeed_like_single(tmp_path, single, monkeypatch):
    if importlib.util.find_spec("deepspeed") is None:
        pytest.skip("deepspeed is not importable (pip install deepspeed)")
    if not torch.cuda.is_available():
        monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    out = tmp_path / "ds"
    m = _launch(out, "deepspeed", "--deepspeed_config",
                str(REPO / "integrations" / "deepspeed" / "gefen_zero2.json"),
                "--checkpoint-every", "6", "--no-plot")
    _check_like_single(m, single, "deepspeed")
    assert m["summary"]["adamw"]["optimizer_class"].endswith("AdamW")
    assert m["summary"]["gefen"]["optimizer_class"].endswith("Gefen")
    ck = out / "checkpoint_gefen_ds"
    assert (ck / "latest").read_text().strip() == f"step{STEPS}"
    assert torch.load(ck / "meta.pt", weights_only=False)["step"] == STEPS


def test_distributed_strategy_needs_torchrun(tmp_path, monkeypatch):
    for k in train.DIST_ENV:
        monkeypatch.delenv(k, raising=False)
    with pytest.raises(SystemExit, match="torchrun"):
        train.main(TINY + ["--strategy", "ddp", "--optimizer", "adamw", "--out", str(tmp_path)])
    with pytest.raises(SystemExit, match="deepspeed"):
        train.parse_args(["--strategy", "ddp", "--deepspeed_config", "x.json"])
    a = train.parse_args(["--deepspeed_config", "x.json", "--local_rank=1"])
    assert a.strategy == "deepspeed" and a.local_rank == 1
    assert train.parse_args(["--strategy", "deepspeed"]).deepspeed_config.endswith("gefen_zero2.json")
