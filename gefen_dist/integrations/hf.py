"""Gefen with the Hugging Face ``transformers.Trainer`` (and Accelerate).

The Trainer accepts ``optimizer_cls_and_kwargs=(cls_or_factory, kwargs)``. Two ways::

    from transformers import Trainer, TrainingArguments
    from gefen_dist.integrations.hf import gefen_optimizer_cls_and_kwargs

    args = TrainingArguments(output_dir="out", learning_rate=3e-4, weight_decay=0.1, adam_beta2=0.95)
    trainer = Trainer(model=model, args=args, train_dataset=ds,
                      optimizer_cls_and_kwargs=gefen_optimizer_cls_and_kwargs(args))

``gefen_optimizer_cls_and_kwargs(args)`` returns ``(GefenFactory, kwargs)`` with ``lr``, ``betas``,
``eps`` and ``weight_decay`` taken from the ``TrainingArguments`` (so the Trainer's arguments stay
the single source of truth; keyword overrides and Gefen options such as ``small_threshold`` are
passed through). The factory builds *named* param groups (so ``opt.report()`` shows parameter
names) with weight decay on >= 2-D parameters only, like the Trainer's own grouping for
transformer models (biases and norm weights are 1-D). ``named=False`` returns the plain
``(Gefen, kwargs)``, for which the Trainer builds its usual two unnamed param groups.

Checkpoints: the Trainer saves ``optimizer.pt`` with ``torch.save(optimizer.state_dict())`` and
resumes with ``optimizer.load_state_dict(torch.load(..., weights_only=True))``; Gefen's state dict
holds only tensors, numbers and strings, and ``Gefen.load_state_dict`` keeps ``idx`` uint8 and the
learned periods and codebook (``tests/test_hf.py``). ``gefen-dist inspect out/checkpoint-N``
describes it.

Under DeepSpeed there are two routes (``docs/huggingface.md``; ``tests/test_hf_multirank.py`` runs
the first with the Trainer and the second through Accelerate, on 2 ranks):

* **Gefen named in the DeepSpeed JSON** (``TrainingArguments(deepspeed="ds.json")``): the JSON has
  ``"optimizer": {"type": "Gefen", "params": {"lr": "auto", ...}}`` and
  ``"zero_allow_untested_optimizer": true``; :func:`trainer_deepspeed_config` writes one. The Trainer
  fills the ``"auto"`` values from its arguments and DeepSpeed builds
  ``gefen_dist.integrations.deepspeed.Gefen`` itself (the import of that module, done by
  :func:`trainer_deepspeed_config` or by hand, registers the name in every rank); the ZeRO layout is
  discovered at the first ``step()``. DeepSpeed then gets one param group, so weight decay applies
  to every parameter. Do not pass ``optimizer_cls_and_kwargs`` as well: the JSON's optimizer wins.
* **Gefen as a client optimizer**: no ``"optimizer"`` section, and
  ``Trainer(optimizer_cls_and_kwargs=gefen_optimizer_cls_and_kwargs(args))``. When ``args.deepspeed``
  is set or Accelerate runs DeepSpeed (``ACCELERATE_USE_DEEPSPEED=true``, set by
  ``accelerate launch --config_file integrations/accelerate/deepspeed_zero2.yaml``),
  :func:`gefen_optimizer_cls_and_kwargs` selects the DeepSpeed-aware subclass by itself (ZeRO hands
  the optimizer flat partitions) and the Trainer hands it to DeepSpeed (the Trainer and Accelerate
  set ``zero_allow_untested_optimizer``); names and the decay/no-decay grouping are kept.

The JSON configs in ``integrations/deepspeed/`` (for ``deepspeed.initialize``) carry fixed batch
sizes and lr, which the Trainer refuses as mismatches: use ``"auto"`` values with the Trainer.
FSDP2 (``integrations/accelerate/fsdp2.yaml``): the Trainer creates the optimizer after
``fully_shard``, and Accelerate's ``prepare(model, optimizer)`` swaps the optimizer's parameters for
the sharded ones before any step, so Gefen receives DTensor parameters and keeps DTensor state.
"""
from __future__ import annotations

import os
from typing import Any, Dict, Optional, Tuple

import torch

from ..optim.gefen import Gefen

__all__ = ["GefenFactory", "gefen_optimizer_cls_and_kwargs", "named_param_groups", "make_gefen", "deepspeed_active",
           "trainer_deepspeed_config"]


def named_param_groups(model: torch.nn.Module, weight_decay: float = 0.0):
    """Two param groups of ``(name, parameter)`` pairs: decayed (>= 2-D) and not (0-D/1-D).
    Frozen parameters are left out; empty groups are dropped."""
    decay, no_decay = [], []
    for n, p in model.named_parameters():
        if not p.requires_grad:
            continue
        (decay if p.ndim >= 2 else no_decay).append((n, p))
    groups = []
    if decay:
        groups.append({"params": decay, "weight_decay": weight_decay})
    if no_decay:
        groups.append({"params": no_decay, "weight_decay": 0.0})
    return groups


def make_gefen(model: torch.nn.Module, optimizer_cls=Gefen, weight_decay: float = 0.0, **kwargs) -> Gefen:
    """``optimizer_cls(named_param_groups(model, weight_decay), **kwargs)``."""
    return optimizer_cls(named_param_groups(model, weight_decay), **kwargs)


class GefenFactory:
    """A Trainer optimizer *factory*: the Trainer calls ``GefenFactory()(model, **kwargs)``
    (``transformers.trainer_optimizer.is_optimizer_factory``: anything that is not an Optimizer
    subclass). ``optimizer_cls`` in kwargs selects a Gefen subclass (e.g. ``ZeroGefen``)."""

    def __call__(self, model: torch.nn.Module, optimizer_cls=Gefen, weight_decay: float = 0.0, **kwargs) -> Gefen:
        return make_gefen(model, optimizer_cls=optimizer_cls, weight_decay=weight_decay, **kwargs)


def deepspeed_active(args: Optional[Any] = None) -> bool:
    """True when the Trainer will run DeepSpeed: ``args.deepspeed`` is set, or Accelerate's
    launcher selected DeepSpeed (``ACCELERATE_USE_DEEPSPEED=true``)."""
    if args is not None and getattr(args, "deepspeed", None):
        return True
    return os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() in ("1", "true", "yes")


def gefen_optimizer_cls_and_kwargs(args: Optional[Any] = None, *, named: bool = True,
                                   **overrides) -> Tuple[Any, Dict[str, Any]]:
    """``(cls_or_factory, kwargs)`` for ``Trainer(optimizer_cls_and_kwargs=...)``.

    ``args`` (a ``TrainingArguments``, optional) supplies ``lr`` (``learning_rate``), ``betas``
    (``adam_beta1``, ``adam_beta2``), ``eps`` (``adam_epsilon``) and ``weight_decay``; keyword
    ``overrides`` win, and may hold any other Gefen option (``small_threshold``, ``fused``,
    ``nonfinite``, ``second_moment``, ``optimizer_cls``). Under DeepSpeed
    (:func:`deepspeed_active`) ``optimizer_cls`` defaults to the DeepSpeed-aware subclass.
    """
    kw: Dict[str, Any] = {}
    if args is not None:
        kw.update(lr=args.learning_rate, betas=(args.adam_beta1, args.adam_beta2), eps=args.adam_epsilon,
                  weight_decay=args.weight_decay)
    kw.update(overrides)
    if "optimizer_cls" not in kw and deepspeed_active(args):
        from . import deepspeed as _gds

        kw["optimizer_cls"] = _gds.Gefen
    if named:
        return GefenFactory, kw
    cls = kw.pop("optimizer_cls", Gefen)
    # the Trainer's own groups carry weight_decay per group; a top-level value is only the default
    return cls, kw


_AUTO_PARAMS = ("lr", "betas", "eps", "weight_decay")


def trainer_deepspeed_config(stage: int = 2, **gefen_params) -> Dict[str, Any]:
    """A DeepSpeed config (a dict; ``json.dump`` it or pass it as ``TrainingArguments(deepspeed=...)``)
    in which DeepSpeed builds Gefen for the Trainer: ZeRO ``stage`` (1, 2 or 3),
    ``"optimizer": {"type": "Gefen", "params": ...}``, ``zero_allow_untested_optimizer``, and ``"auto"``
    for what the Trainer fills in (lr, betas, eps, weight_decay, batch sizes, accumulation, clipping).
    ``gefen_params`` are added to, or replace, the optimizer params (e.g. ``second_moment="shared"``,
    ``small_threshold=4096``, or a fixed ``lr``). No scheduler section: the Trainer's schedule drives the
    optimizer. Importing :mod:`gefen_dist.integrations.deepspeed` here registers the name ``"Gefen"``
    with DeepSpeed in this process (each rank runs this). The config passes its ``check_config``.

    The Trainer (Accelerate) treats every ``"auto"`` value of the JSON as its own placeholder and refuses one
    it cannot fill ("``optimizer.params.col_blocks`` not found in kwargs"), so Gefen's own ``"auto"`` rules
    are written here as ``"shape"`` (``row_blocks``, ``col_blocks``: the same rule) or left out
    (``narrow_rows="auto"``, the default).
    """
    from . import deepspeed as _gds  # registers torch.optim.Gefen for DeepSpeed's optimizer factory

    if int(stage) not in (1, 2, 3):
        raise ValueError(f"stage must be 1, 2 or 3, got {stage!r}")
    params: Dict[str, Any] = {k: "auto" for k in _AUTO_PARAMS}
    for k, v in gefen_params.items():  # (Gefen's "auto" rules, which the Trainer would take for its placeholders)
        if v == "auto" and k in ("row_blocks", "col_blocks"):
            v = "shape"
        if not (v == "auto" and k == "narrow_rows"):
            params[k] = v
    zero: Dict[str, Any] = {"stage": int(stage), "contiguous_gradients": True, "overlap_comm": False}
    if int(stage) == 3:
        zero["stage3_gather_16bit_weights_on_model_save"] = True
    cfg = {
        "zero_optimization": zero,
        "optimizer": {"type": "Gefen", "params": params},
        "zero_allow_untested_optimizer": True,
        "train_micro_batch_size_per_gpu": "auto",
        "train_batch_size": "auto",
        "gradient_accumulation_steps": "auto",
        "gradient_clipping": "auto",
        "steps_per_print": 1000000,
    }
    _gds.check_config(cfg)
    return cfg
