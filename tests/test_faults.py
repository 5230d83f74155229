"""Faults: atomic checkpoints, damaged checkpoints, a rank killed mid-training, finite timeouts.

Single process (fast):

* ``gefen_dist.checkpoint.atomic_save``/``load_file``: a file written atomically carries its
  SHA-256; truncated, emptied or bit-flipped copies raise ``CheckpointCorruptError`` naming the
  file and what to do (plain ``torch.load`` would load a flipped tensor byte silently);
* a writer that fails midway (file or DCP directory) leaves the previous checkpoint loadable and
  no temporary behind; a damaged DCP shard is reported by ``gefen_dist.checkpoint.load``;
* launch/train.py SIGKILLed in the middle of writing a checkpoint (``tests/dist/fault_kill_in_save.py``):
  the previous checkpoint still loads, ``--resume auto`` ignores (and removes) the partial
  temporary, resumes from the previous checkpoint and ends bit-identical to an uninterrupted run;
  a corrupted checkpoint makes ``--resume auto`` fail with the file's name instead of loading it;
* the process group of launch/train.py gets a finite timeout (``--dist-timeout``).

Multi-rank (``dist``; 3 torchrun launches, 2 ranks, gloo, tiny model, 24 steps, checkpoint every 8):
an uninterrupted DDP run, then ``torchrun --max-restarts 1`` runs of DDP and ZeRO-1 (``ZeroGefen``)
in which rank 1 SIGKILLs itself before step 13 (``GEFEN_DIST_FAULT_KILL_AT_STEP``, first incarnation
only); the elastic agent restarts both ranks, ``--resume auto`` loads the step-8 checkpoint, and the
final parameters, optimizer state and per-step losses are bitwise equal to the uninterrupted DDP run
(ZeroGefen over DDP gradients computes exactly what replicated Gefen does). Cross-rank mismatches
raising instead of hanging are covered by ``tests/test_distributed.py`` (``--mismatch``) and
``tests/test_zero.py``.
"""
from __future__ import annotations

import datetime
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from gefen_dist import Gefen
from gefen_dist import checkpoint as gckpt
from launch import train

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE / "dist"))
from _launch import _env, torchrun_cmd, wait_torchrun  # noqa: E402

REPO = HERE.parent
TRAIN = str(REPO / "launch" / "train.py")
TINY = ["--model", "tiny", "--batch-size", "8", "--lr", "3e-3", "--warmup", "2", "--eval-every", "0",
        "--seed", "3", "--no-progress", "--no-plot", "--device", "cpu"]


def _state_equal(a: dict, b: dict) -> None:
    assert a["step"] == b["step"]
    assert a["model"].keys() == b["model"].keys()
    for k in a["model"]:
        assert torch.equal(a["model"][k], b["model"][k]), k
    sa, sb = a["optimizer"]["state"], b["optimizer"]["state"]
    assert sa.keys() == sb.keys()
    for i in sa:
        assert sa[i].keys() == sb[i].keys(), i
        for k, v in sa[i].items():
            if torch.is_tensor(v):
                assert v.dtype == sb[i][k].dtype and torch.equal(v, sb[i][k]), (i, k)
            else:
                assert v == sb[i][k], (i, k)


# --------------------------------------------------------------------------------------------
# files
# --------------------------------------------------------------------------------------------

def test_atomic_file_checksum_and_damage(tmp_path):
    p = tmp_path / "ck.pt"
    obj = {"w": torch.randn(5000), "step": 7, "nested": {"idx": torch.randint(0, 255, (300,), dtype=torch.uint8)}}
    gckpt.atomic_save(obj, p)
    assert os.listdir(tmp_path) == ["ck.pt"]
    assert gckpt.verify_file(p) is True
    plain = torch.load(p, weights_only=True)  # still an ordinary torch.save file
    assert torch.equal(plain["w"], obj["w"]) and plain["step"] == 7
    got = gckpt.load_file(p)
    assert torch.equal(got["nested"]["idx"], obj["nested"]["idx"])

    good = p.read_bytes()
    flip = bytearray(good)
    flip[len(good) // 2] ^= 0x01  # inside the tensor data: torch.load alone would not notice
    assert torch.load(_write(tmp_path / "raw.pt", bytes(flip)), weights_only=True)["step"] == 7
    damaged = {"bit flip": bytes(flip), "empty": b"", "half": good[:len(good) // 2],
               "last byte": good[:-1], "checksum cut": good[:-40], "no end record": good[:-100]}
    for what, data in damaged.items():
        _write(p, data)
        with pytest.raises(gckpt.CheckpointCorruptError) as ei:
            gckpt.load_file(p)
        msg = str(ei.value)
        assert str(p) in msg and "Delete" in msg and "earlier checkpoint" in msg, (what, msg)

    # a file without a checksum (plain torch.save) still loads; unpickling policy errors are not "damage"
    torch.save({"a": torch.ones(3)}, p)
    assert gckpt.verify_file(p) is False and torch.equal(gckpt.load_file(p)["a"], torch.ones(3))


def _write(p: Path, data: bytes) -> Path:
    p.write_bytes(data)
    return p


def test_file_writer_failing_midway_keeps_previous(tmp_path, monkeypatch):
    p = tmp_path / "ck.pt"
    gckpt.atomic_save({"v": torch.zeros(100000), "step": 1}, p)
    real = gckpt._HashingWriter.write

    def failing(self, b):
        if self.n > 50_000:
            raise OSError(28, "No space left on device (simulated)")
        return real(self, b)

    monkeypatch.setattr(gckpt._HashingWriter, "write", failing)
    with pytest.raises((OSError, RuntimeError)):  # torch.save's zip writer may re-raise it as RuntimeError
        gckpt.atomic_save({"v": torch.ones(100000), "step": 2}, p)
    assert os.listdir(tmp_path) == ["ck.pt"]  # the temporary is gone
    got = gckpt.load_file(p)
    assert got["step"] == 1 and torch.equal(got["v"], torch.zeros(100000))


def _gefen_model(seed: int):
    torch.manual_seed(seed)
    m = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.GELU(), torch.nn.Linear(128, 64))
    opt = Gefen(m.parameters(), lr=1e-2)
    for _ in range(2):
        opt.zero_grad()
        m(torch.randn(8, 64)).pow(2).mean().backward()
        opt.step()
    return m, opt


def test_dcp_directory_atomic_and_damage(tmp_path, monkeypatch):
    ck = tmp_path / "ck_dcp"
    m1, o1 = _gefen_model(1)
    gckpt.save(m1, o1, str(ck), files={"meta.pt": {"step": 1}})
    assert (ck / gckpt.MANIFEST).is_file() and (ck / ".metadata").is_file()
    assert gckpt.verify_dir(ck) is True

    # a second save that dies after the shards are written, before the commit
    m2, o2 = _gefen_model(2)
    monkeypatch.setattr(gckpt.files, "_write_manifest", lambda d: (_ for _ in ()).throw(OSError("killed (simulated)")))
    with pytest.raises(RuntimeError, match="previous checkpoint.*unchanged"):
        gckpt.save(m2, o2, str(ck), files={"meta.pt": {"step": 2}})
    monkeypatch.undo()
    assert sorted(os.listdir(tmp_path)) == ["ck_dcp"]
    assert gckpt.load_file(ck / "meta.pt")["step"] == 1
    m3, o3 = _gefen_model(3)
    gckpt.load(m3, o3, str(ck))
    for a, b in zip(m1.parameters(), m3.parameters()):
        assert torch.equal(a, b)

    # a successful overwrite replaces the whole directory
    gckpt.save(m2, o2, str(ck), files={"meta.pt": {"step": 2}})
    assert gckpt.load_file(ck / "meta.pt")["step"] == 2 and sorted(os.listdir(tmp_path)) == ["ck_dcp"]

    shard = next(p for p in ck.iterdir() if p.suffix == ".distcp")
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x10
    shard.write_bytes(bytes(data))
    with pytest.raises(gckpt.CheckpointCorruptError, match=f"{shard.name}.*corrupted.*Delete"):
        gckpt.load(m3, o3, str(ck))
    shard.write_bytes(bytes(data[:100]))
    with pytest.raises(gckpt.CheckpointCorruptError, match=f"{shard.name}.*truncated"):
        gckpt.load(m3, o3, str(ck))
    shard.unlink()
    with pytest.raises(gckpt.CheckpointCorruptError, match=f"{shard.name}.*missing"):
        gckpt.load(m3, o3, str(ck))


# --------------------------------------------------------------------------------------------
# launch/train.py killed during a save
# --------------------------------------------------------------------------------------------

@pytest.fixture
def keep_threads():
    n = torch.get_num_threads()
    yield
    torch.set_num_threads(n)


def test_train_killed_mid_save_resumes_from_previous(tmp_path, keep_threads):
    # one thread everywhere: the killed run is a subprocess (OMP_NUM_THREADS=1), the others run here
    args = TINY + ["--optimizer", "gefen", "--steps", "12", "--checkpoint-every", "4", "--log-level", "WARNING",
                   "--threads", "1"]
    straight = tmp_path / "straight"
    a = train.main(args + ["--out", str(straight)])

    out = tmp_path / "killed"
    # saves happen at steps 4, 8, 12 (+ final): die half-way through writing the step-8 one
    r = subprocess.run([sys.executable, str(HERE / "dist" / "fault_kill_in_save.py"), "2", "60000", "--",
                        *args, "--out", str(out)], cwd=REPO, env=_env(), capture_output=True, text=True,
                       timeout=180)
    assert r.returncode == -9, (r.returncode, r.stderr[-3000:])
    assert "FAULT: SIGKILL during checkpoint save #2" in r.stderr
    ck = train.checkpoint_path(str(out), "gefen")
    temps = gckpt.stale_temporaries(ck)
    assert len(temps) == 1 and os.path.getsize(temps[0]) == 60000  # the partial write, under its own name
    assert train.load_checkpoint_file(ck)["step"] == 4  # the previous checkpoint is intact

    b = train.main(args + ["--out", str(out), "--resume", "auto", "--log-level", "INFO"])
    assert gckpt.stale_temporaries(ck) == []
    assert a["runs"]["gefen"]["train_losses"] == b["runs"]["gefen"]["train_losses"]
    _state_equal(train.load_checkpoint_file(train.checkpoint_path(str(straight), "gefen")),
                 train.load_checkpoint_file(ck))

    # damage the checkpoint: --resume auto names the file instead of loading it (or starting over)
    data = bytearray(ck.read_bytes())
    data[len(data) // 3] ^= 0x04
    ck.write_bytes(bytes(data))
    with pytest.raises(gckpt.CheckpointCorruptError, match=f"{ck.name}.*corrupted"):
        train.main(args + ["--out", str(out), "--resume", "auto"])


def test_process_group_timeout_is_finite(monkeypatch):
    import torch.distributed as dist

    seen = {}
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(dist, "init_process_group", lambda backend, **kw: seen.update(kw, backend=backend))
    for k, v in {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
                 "MASTER_PORT": "1"}.items():
        monkeypatch.setenv(k, v)
    for argv, secs in ((["--strategy", "ddp"], 600.0), (["--strategy", "zero1", "--dist-timeout", "45"], 45.0)):
        seen.clear()
        s = train.make_strategy(train.parse_args(argv + ["--device", "cpu"]).strategy,
                                train.parse_args(argv + ["--device", "cpu"]))
        s.setup()
        assert seen["backend"] == "gloo" and seen["timeout"] == datetime.timedelta(seconds=secs)


# --------------------------------------------------------------------------------------------
# a rank SIGKILLed mid-training under torchrun --max-restarts 1
# --------------------------------------------------------------------------------------------

STEPS, EVERY, KILL = 24, 8, 13
DIST_ARGS = TINY + ["--optimizer", "gefen", "--steps", str(STEPS), "--checkpoint-every", str(EVERY),
                    "--resume", "auto", "--log-level", "INFO", "--dist-timeout", "60"]


def _torchrun(out: Path, strategy: str, kill_at: int | None) -> str:
    cmd = torchrun_cmd(TRAIN, 2, "--strategy", strategy, "--out", str(out), *DIST_ARGS)
    at = cmd.index("torch.distributed.run") + 1
    cmd[at:at] = ["--max-restarts", "1", "--monitor-interval", "0.5"]
    env = _env()
    # torch >= 2.5 shares the agent's TCPStore with the workers across restarts, and a restarted
    # gloo group can read the previous incarnation's addresses ("connectFullMesh failed ...
    # Connection refused"; pytorch/pytorch#135712, seen here with torch 2.13): a store per round.
    env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    env.pop(train.FAULT_KILL_ENV, None)
    if kill_at is not None:
        env[train.FAULT_KILL_ENV] = str(kill_at)
        env[train.FAULT_RANK_ENV] = "1"
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    return wait_torchrun(proc, 300, f"torchrun train.py {strategy} kill_at={kill_at}").stdout


@pytest.fixture(scope="module")
def ddp_uninterrupted(tmp_path_factory):
    out = tmp_path_factory.mktemp("ddp_straight")
    log = _torchrun(out, "ddp", None)
    assert "FAULT" not in log
    return out


@pytest.mark.dist
@pytest.mark.parametrize("strategy", ["ddp", "zero1"])
def test_rank_killed_restarts_from_checkpoint_bit_identical(tmp_path, ddp_uninterrupted, strategy):
    out = tmp_path / strategy
    log = _torchrun(out, strategy, KILL)
    assert f"FAULT: rank 1 killing itself before step {KILL}" in log, log[-4000:]
    # the elastic agent saw a worker fail: rank 1's SIGKILL (exitcode -9), or its peer's abort when rank 0
    # noticed the broken connection first (a loaded 2-core host, 2026-12-06: exitcode -6 of local_rank 0) ...
    assert re.search(r"failed \(exitcode: -?\d+\) local_rank: [01]", log), log[-4000:]
    want = (KILL // EVERY) * EVERY
    assert log.count("resumed from") == 1 and f"at step {want}" in log, log[-4000:]  # ... and restarted once
    assert log.count("FAULT:") == 1

    ref = train.load_checkpoint_file(train.checkpoint_path(str(ddp_uninterrupted), "gefen"))
    got = train.load_checkpoint_file(train.checkpoint_path(str(out), "gefen"))
    assert ref["step"] == got["step"] == STEPS and got["strategy"] == strategy
    _state_equal(ref, got)
    mr = json.loads((ddp_uninterrupted / "metrics.json").read_text())["runs"]["gefen"]
    mg = json.loads((out / "metrics.json").read_text())["runs"]["gefen"]
    assert len(mg["train_losses"]) == STEPS and mg["train_losses"] == mr["train_losses"]
    assert mg["summary"]["finished"] and mg["summary"]["world_size"] == 2
    assert gckpt.stale_temporaries(train.checkpoint_path(str(out), "gefen")) == []
