"""Gefen in the Hugging Face Trainer (single process, CPU): train a tiny randomly initialised GPT-2,
save a checkpoint, resume from it, and check the Gefen state round-trips (uint8 idx, periods,
codebook) and the resumed run ends exactly where the uninterrupted one does."""
import os
import sys

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="transformers is not installed (pip install transformers)")
pytest.importorskip("accelerate", reason="accelerate is not installed (the Trainer needs it)")

from gefen_dist import Gefen  # noqa: E402
from gefen_dist.cli import inspect_checkpoint  # noqa: E402
from gefen_dist.integrations.hf import GefenFactory, gefen_optimizer_cls_and_kwargs  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "dist"))
from hf_common import Tokens  # noqa: E402  (the tiny GPT-2 and dataset the multi-rank workers use)
from hf_common import tiny_gpt2 as _model  # noqa: E402


def _trainer(out, max_steps, **kw):
    args = transformers.TrainingArguments(
        output_dir=str(out), max_steps=max_steps, per_device_train_batch_size=8, learning_rate=3e-3,
        weight_decay=0.1, adam_beta2=0.95, lr_scheduler_type="linear", warmup_steps=1, save_steps=2,
        save_strategy="steps", logging_steps=1, report_to=[], use_cpu=True, seed=0, data_seed=0,
        dataloader_num_workers=0, disable_tqdm=True, **kw)
    return transformers.Trainer(model=_model(), args=args, train_dataset=Tokens(),
                                optimizer_cls_and_kwargs=gefen_optimizer_cls_and_kwargs(args))


def _state(opt):
    return {n: st for n, st in zip([n for g in opt.param_groups for n in g["param_names"]],
                                   [opt.state[p] for g in opt.param_groups for p in g["params"]])}


def test_cls_and_kwargs_from_training_arguments(tmp_path):
    args = transformers.TrainingArguments(output_dir=str(tmp_path), learning_rate=1e-4, weight_decay=0.05,
                                          adam_beta1=0.8, adam_beta2=0.95, adam_epsilon=1e-7, report_to=[],
                                          use_cpu=True)
    cls, kw = gefen_optimizer_cls_and_kwargs(args, small_threshold=1024)
    assert cls is GefenFactory
    assert kw == dict(lr=1e-4, betas=(0.8, 0.95), eps=1e-7, weight_decay=0.05, small_threshold=1024)
    opt = cls()(_model(), **kw)
    assert isinstance(opt, Gefen) and [g["weight_decay"] for g in opt.param_groups] == [0.05, 0.0]
    assert all(p.ndim >= 2 for p in opt.param_groups[0]["params"])
    assert all(p.ndim < 2 for p in opt.param_groups[1]["params"])
    cls, kw = gefen_optimizer_cls_and_kwargs(args, named=False)
    assert cls is Gefen and kw["lr"] == 1e-4


def test_trainer_trains_saves_and_resumes(tmp_path):
    full = _trainer(tmp_path / "a", 4)
    res = full.train()
    opt = full.optimizer
    inner = getattr(opt, "optimizer", opt)  # accelerate wraps it
    assert isinstance(inner, Gefen)
    losses = [h["loss"] for h in full.state.log_history if "loss" in h]
    assert len(losses) == 4 and losses[-1] < losses[0], losses
    assert res.global_step == 4

    ck = tmp_path / "a" / "checkpoint-2"
    saved = torch.load(ck / "optimizer.pt", weights_only=True)
    q = [st for st in saved["state"].values() if "idx" in st]
    assert q and all(st["idx"].dtype == torch.uint8 for st in q)
    assert all(st["step"] == 2 and st["learned"] == 1 for st in q)
    r = inspect_checkpoint(str(ck))  # gefen-dist inspect on the Trainer's checkpoint directory
    assert "Hugging Face Trainer" in r["format"] and r["codebook"]["learned"]
    assert any(t["name"] == "transformer.h.0.attn.c_attn.weight" for t in r["tensors"])

    resumed = _trainer(tmp_path / "b", 4)
    resumed.train(resume_from_checkpoint=str(ck))
    inner_b = getattr(resumed.optimizer, "optimizer", resumed.optimizer)
    sa, sb = _state(inner), _state(inner_b)
    assert sa.keys() == sb.keys()
    for name in sa:
        a, b = sa[name], sb[name]
        assert a.keys() == b.keys(), name
        for k in a:
            if isinstance(a[k], torch.Tensor):
                assert a[k].dtype == b[k].dtype, (name, k)
                assert torch.equal(a[k], b[k]), (name, k)
            else:
                assert a[k] == b[k], (name, k)
    assert torch.equal(inner.codebook, inner_b.codebook)
    for (n, p), (_, q2) in zip(full.model.named_parameters(), resumed.model.named_parameters()):
        assert torch.equal(p, q2), n


def test_trainer_with_the_plain_class(tmp_path):
    """``optimizer_cls_and_kwargs=(gefen_dist.Gefen, {...})``, no helper: the Trainer builds its own
    decay/no-decay groups and Gefen steps, saves and resumes through the Trainer's checkpoint."""
    kw = {"lr": 3e-3, "betas": (0.9, 0.95), "eps": 1e-8}

    def trainer(out):
        args = transformers.TrainingArguments(
            output_dir=str(out), max_steps=2, per_device_train_batch_size=8, learning_rate=3e-3, weight_decay=0.1,
            save_steps=1, save_strategy="steps", logging_steps=1, report_to=[], use_cpu=True, seed=0, data_seed=0,
            dataloader_num_workers=0, disable_tqdm=True)
        return transformers.Trainer(model=_model(), args=args, train_dataset=Tokens(),
                                    optimizer_cls_and_kwargs=(Gefen, dict(kw)))

    a = trainer(tmp_path / "a")
    a.train()
    opt = getattr(a.optimizer, "optimizer", a.optimizer)
    assert type(opt) is Gefen and [g["weight_decay"] for g in opt.param_groups] == [0.1, 0.0]
    assert tuple(opt.param_groups[0]["betas"]) == (0.9, 0.95)
    assert {int(st["step"]) for st in opt.state.values()} == {2} and opt.codebook is not None
    b = trainer(tmp_path / "b")
    b.train(resume_from_checkpoint=str(tmp_path / "a" / "checkpoint-1"))
    opt_b = getattr(b.optimizer, "optimizer", b.optimizer)
    assert type(opt_b) is Gefen and torch.equal(opt_b.codebook, opt.codebook)
    for (n, p), (_, q) in zip(a.model.named_parameters(), b.model.named_parameters()):
        assert torch.equal(p, q), n


def test_deepspeed_selects_the_zero_aware_subclass(tmp_path, monkeypatch):
    from gefen_dist.integrations import deepspeed as gds

    args = transformers.TrainingArguments(output_dir=str(tmp_path), report_to=[], use_cpu=True)
    monkeypatch.delenv("ACCELERATE_USE_DEEPSPEED", raising=False)
    assert "optimizer_cls" not in gefen_optimizer_cls_and_kwargs(args)[1]
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")  # what `accelerate launch` sets for DeepSpeed
    cls, kw = gefen_optimizer_cls_and_kwargs(args)
    assert kw["optimizer_cls"] is gds.Gefen
    assert isinstance(cls()(_model(), **kw), gds.Gefen)
    assert gefen_optimizer_cls_and_kwargs(args, named=False)[0] is gds.Gefen


def test_accelerate_configs_parse():
    from accelerate.commands.config.config_args import ClusterConfig

    root = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "integrations", "accelerate")
    seen = {}
    for name in sorted(os.listdir(root)):
        if name.endswith(".yaml"):
            seen[name] = ClusterConfig.from_yaml_file(os.path.join(root, name))
    assert {"ddp.yaml", "fsdp2.yaml", "deepspeed_zero1.yaml", "deepspeed_zero2.yaml", "deepspeed_zero3.yaml"} <= set(seen)
    assert seen["fsdp2.yaml"].fsdp_config["fsdp_version"] == 2
    assert [seen[f"deepspeed_zero{s}.yaml"].deepspeed_config["zero_stage"] for s in (1, 2, 3)] == [1, 2, 3]


def test_resuming_an_adamw_run_with_gefen(tmp_path):
    """A Trainer run with its default torch AdamW saves a checkpoint; a Trainer given Gefen resumes from
    it: the Trainer loads AdamW's ``optimizer.pt`` into Gefen, which warm-starts from the moments
    (gefen_dist/optim/adamw_import.py) and goes on from AdamW's step count."""
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path / "a"), max_steps=2, per_device_train_batch_size=8, learning_rate=3e-3,
        weight_decay=0.1, adam_beta2=0.95, save_steps=2, save_strategy="steps", logging_steps=1, report_to=[],
        use_cpu=True, seed=0, data_seed=0, dataloader_num_workers=0, disable_tqdm=True)
    adamw = transformers.Trainer(model=_model(), args=args, train_dataset=Tokens())
    adamw.train()
    assert type(getattr(adamw.optimizer, "optimizer", adamw.optimizer)).__name__ == "AdamW"
    b = _trainer(tmp_path / "b", 4)
    b.train(resume_from_checkpoint=str(tmp_path / "a" / "checkpoint-2"))
    opt = getattr(b.optimizer, "optimizer", b.optimizer)
    q = {n: st for n, st in _state(opt).items() if "idx" in st}
    assert isinstance(opt, Gefen) and q and opt.codebook is not None
    assert all(int(st["step"]) == 4 and st["learned"] == 1 for st in q.values())
    losses = [h["loss"] for h in b.state.log_history if "loss" in h and h["step"] > 2]  # (the history goes on)
    assert len(losses) == 2 and all(torch.isfinite(torch.tensor(losses))), b.state.log_history
