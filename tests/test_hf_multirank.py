"""Gefen through the Hugging Face stack on 2 CPU ranks (gloo), with a tiny randomly initialised GPT-2.

Real launches, each checking several things (the workers print ``OK ...`` lines and
``ALL OK``; any failed check raises there):

* ``torchrun`` x2, ``transformers.Trainer`` with a DeepSpeed JSON that names Gefen (ZeRO-2): DeepSpeed
  builds ``gefen_dist.integrations.deepspeed.Gefen`` and the layout is discovered lazily; loss goes
  down, uint8 state, ``gefen-dist inspect`` on the Trainer checkpoint, and a resume from
  ``checkpoint-2`` that ends bitwise equal to the uninterrupted run (``tests/dist/hf_trainer_ds.py``);
* ``accelerate launch`` with the shipped ``integrations/accelerate/ddp.yaml`` (``--num_processes 2
  --mixed_precision no``), ``transformers.Trainer`` with ``optimizer_cls_and_kwargs=(gefen_dist.Gefen,
  {...})``: DDP over gloo, Gefen from the Trainer's own param groups, checkpoint, and a resume that
  ends bitwise equal (``tests/dist/hf_trainer_ddp.py``);
* ``accelerate launch`` with the FSDP2 plugin and with the DeepSpeed ZeRO-2 plugin
  (``integrations/accelerate/cpu_*.yaml``): Gefen from ``gefen_dist.integrations.hf`` steps, the
  loss goes down, compact (uint8, DTensor / ZeRO-partition) state, and ``save_state``/``load_state``
  restores and replays bitwise (``tests/dist/accel_train.py``);
* FSDP2 ``save_state`` at 2 ranks, ``load_state`` at 1 rank and back at 2 (three launches,
  ``tests/dist/accel_resume.py``).

Every launch runs in its own process group and is killed as a whole on timeout
(``tests/dist/_launch.py``).
"""
import os
import subprocess
import sys

import pytest

pytest.importorskip("transformers", reason="transformers is not installed (pip install transformers)")
pytest.importorskip("accelerate", reason="accelerate is not installed (pip install accelerate)")

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "dist"))
from _launch import ROOT, _env, free_port, run_torchrun, wait_torchrun  # noqa: E402

ACC = os.path.join(ROOT, "integrations", "accelerate")
TIMEOUT = 360  # a launch takes 20-40 s on 2 idle cores


def _ok_lines(out):
    return [line for line in out.splitlines() if line.startswith("OK ")]


def _check(res, n_ok):
    out = res.stdout
    assert "ALL OK" in out, out[-6000:]  # rc 0 is checked by wait_torchrun
    ok = _ok_lines(out)
    assert len(ok) == n_ok, "\n".join(ok) + "\n" + out[-3000:]
    return ok


def _hf_env(monkeypatch):
    monkeypatch.setenv("DS_ACCELERATOR", os.environ.get("DS_ACCELERATOR", "cpu"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # the model is built from a config: nothing to download
    monkeypatch.setenv("TOKENIZERS_PARALLELISM", "false")


def _accelerate_launch(config, script, *args, flags=(), timeout=TIMEOUT):
    """``accelerate launch --config_file CONFIG FLAGS SCRIPT ARGS`` in its own session, killed whole on timeout."""
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", config, *flags,
           "--main_process_port", str(free_port()), os.path.join(HERE, "dist", script), *map(str, args)]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    return wait_torchrun(proc, timeout, f"accelerate launch --config_file {os.path.basename(config)} {script}")


@pytest.mark.dist
def test_trainer_deepspeed_json_zero2_2ranks(tmp_path, monkeypatch):
    pytest.importorskip("deepspeed", reason="deepspeed is not installed (pip install deepspeed)")
    _hf_env(monkeypatch)
    res = run_torchrun("hf_trainer_ds.py", 2, tmp_path, timeout=TIMEOUT)
    ok = _check(res, 3)
    assert "lazy layout" in ok[0] and "column blocks [3, 4]" in ok[0] and "bitwise equal" in ok[2], ok


@pytest.mark.dist
def test_accelerate_fsdp2_2ranks(tmp_path, monkeypatch):
    _hf_env(monkeypatch)
    res = _accelerate_launch(os.path.join(ACC, "cpu_fsdp2.yaml"), "accel_train.py", tmp_path)
    ok = _check(res, 2)
    assert ok[0].startswith("OK fsdp2: gefen_dist.optim.gefen.Gefen"), ok
    assert (tmp_path / "state_fsdp2").is_dir()


@pytest.mark.dist
def test_accelerate_fsdp2_save_2ranks_load_1rank(tmp_path, monkeypatch):
    """``save_state`` at 2 ranks, ``load_state`` at 1 rank (FSDP2 on a 1-rank mesh, through
    ``load_fsdp_optimizer``/DCP), then back to 2 ranks, default factored mode, rows of 64, 192 and
    2560 elements (c_fc: period 1280, shorter than its row): state bitwise equal to the saved one
    after each load, the resumed steps bitwise equal to the uninterrupted 2-rank run
    (tests/dist/accel_resume.py)."""
    _hf_env(monkeypatch)
    cfg = os.path.join(ACC, "cpu_fsdp2.yaml")
    ok = _check(_accelerate_launch(cfg, "accel_resume.py", "save", tmp_path), 1)
    assert "((64, 2560), 1280)" in ok[0], ok
    ok = _check(_accelerate_launch(cfg, "accel_resume.py", "load", tmp_path, flags=("--num_processes", "1")), 2)
    assert "ws=2 -> load_state ws=1 (load_fsdp_optimizer, DCP)" in ok[0] and "bitwise equal" in ok[1], ok
    ok = _check(_accelerate_launch(cfg, "accel_resume.py", "load2", tmp_path), 1)
    assert "ws=1 -> load_state ws=2" in ok[0] and "bitwise equal to the uninterrupted" in ok[0], ok


@pytest.mark.dist
@pytest.mark.parametrize("sdt", ["SHARDED_STATE_DICT", "FULL_STATE_DICT"])
def test_trainer_fsdp2_save_2ranks_resume_1rank(tmp_path, monkeypatch, sdt):
    """The Trainer with FSDP2 and ``optimizer_cls_and_kwargs=(Gefen, {...})``, its own save at 2 ranks
    and ``resume_from_checkpoint`` at 1 (tests/dist/hf_trainer_fsdp2.py), with the c_fc rows of
    2560 elements at period 1280: after the resume every parameter and Gefen state tensor equals
    the saved full one bitwise, and the resumed Trainer steps."""
    _hf_env(monkeypatch)
    ok = _check(run_torchrun("hf_trainer_fsdp2.py", 2, "save", sdt, tmp_path, timeout=TIMEOUT), 1)
    assert "Gefen on DTensor shards" in ok[0], ok
    ok = _check(run_torchrun("hf_trainer_fsdp2.py", 1, "load", sdt, tmp_path, timeout=TIMEOUT), 2)
    assert "ws=2 -> resume ws=1" in ok[0] and "period 1280" in ok[0] and "stepped to 4" in ok[1], ok


@pytest.mark.dist
def test_accelerate_deepspeed_zero2_2ranks(tmp_path, monkeypatch):
    pytest.importorskip("deepspeed", reason="deepspeed is not installed (pip install deepspeed)")
    _hf_env(monkeypatch)
    res = _accelerate_launch(os.path.join(ACC, "cpu_deepspeed_zero2.yaml"), "accel_train.py", tmp_path)
    ok = _check(res, 2)
    assert ok[0].startswith("OK deepspeed zero2: gefen_dist.integrations.deepspeed.Gefen"), ok
    assert (tmp_path / "state_ds").is_dir()


@pytest.mark.dist
@pytest.mark.parametrize("config,stage", [("deepspeed_zero1.yaml", 1), ("deepspeed_zero3.yaml", 3)])
def test_accelerate_shipped_deepspeed_configs_2ranks(tmp_path, monkeypatch, config, stage):
    """The shipped ZeRO-1 and ZeRO-3 configs themselves (two launch flags replace their 8 processes
    and bf16): Gefen steps the flat partitions (ZeRO-3: DeepSpeedZeroOptimizer_Stage3, parameters
    partitioned), and save_state/load_state restores and replays bitwise."""
    pytest.importorskip("deepspeed", reason="deepspeed is not installed (pip install deepspeed)")
    _hf_env(monkeypatch)
    res = _accelerate_launch(os.path.join(ACC, config), "accel_train.py", tmp_path,
                             flags=("--num_processes", "2", "--mixed_precision", "no"))
    ok = _check(res, 2)
    assert ok[0].startswith(f"OK deepspeed zero{stage}: gefen_dist.integrations.deepspeed.Gefen stepped 8x"), ok
    assert "replayed steps 5-8 bitwise" in ok[1], ok


@pytest.mark.dist
def test_trainer_ddp_shipped_config_2ranks(tmp_path, monkeypatch):
    """The shipped ddp.yaml itself (two launch flags replace its 8 processes and bf16), the Trainer with
    ``optimizer_cls_and_kwargs=(gefen_dist.Gefen, {...})``: DDP, save, resume bitwise."""
    _hf_env(monkeypatch)
    res = _accelerate_launch(os.path.join(ACC, "ddp.yaml"), "hf_trainer_ddp.py", tmp_path,
                             flags=("--num_processes", "2", "--mixed_precision", "no"))
    ok = _check(res, 4)
    assert "MULTI_CPU, backend gloo, world size 2, mixed precision no" in ok[0], ok
    assert ok[1].startswith("OK trainer+ddp: gefen_dist.optim.gefen.Gefen from optimizer_cls_and_kwargs"), ok
    assert "bitwise equal" in ok[3], ok
    assert (tmp_path / "a" / "checkpoint-2" / "optimizer.pt").is_file()


def test_cpu_configs_match_the_shipped_ones():
    """The CPU variants the launches use differ from the shipped configs only where CPU needs it."""
    from accelerate.commands.config.config_args import ClusterConfig

    def load(name):
        return ClusterConfig.from_yaml_file(os.path.join(ACC, name)).to_dict()

    cpu_only = {"mixed_precision", "num_processes", "use_cpu"}
    for cpu, shipped in (("cpu_fsdp2.yaml", "fsdp2.yaml"), ("cpu_deepspeed_zero2.yaml", "deepspeed_zero2.yaml")):
        a, b = load(cpu), load(shipped)
        assert a["num_processes"] == 2 and a["mixed_precision"] == "no", cpu
        # use_cpu: true would make `accelerate launch` drop FSDP/DeepSpeed and start a single process
        assert a["use_cpu"] is False, cpu
        assert {k: v for k, v in a.items() if k not in cpu_only} == {k: v for k, v in b.items() if k not in cpu_only}, \
            (cpu, shipped)



def test_trainer_deepspeed_config():
    """The JSON the Trainer launch uses: Gefen named, "auto" hyperparameters, refusals kept."""
    pytest.importorskip("deepspeed", reason="deepspeed is not installed (pip install deepspeed)")
    import torch

    from gefen_dist.integrations import deepspeed as gds
    from gefen_dist.integrations.hf import trainer_deepspeed_config

    cfg = trainer_deepspeed_config(3, second_moment="shared", lr=1e-3)
    assert torch.optim.Gefen is gds.Gefen  # registered for DeepSpeed's optimizer factory
    assert cfg["optimizer"] == {"type": "Gefen", "params": {"lr": 1e-3, "betas": "auto", "eps": "auto",
                                                            "weight_decay": "auto", "second_moment": "shared"}}
    assert cfg["zero_optimization"]["stage"] == 3 and cfg["zero_allow_untested_optimizer"] is True
    assert cfg["train_micro_batch_size_per_gpu"] == cfg["gradient_accumulation_steps"] == "auto"
    assert "scheduler" not in cfg
    with pytest.raises(ValueError, match="stage"):
        trainer_deepspeed_config(4)
