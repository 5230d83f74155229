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

Under DeepSpeed the optimizer must be the DeepSpeed-aware subclass
``gefen_dist.integrations.deepspeed.Gefen`` (ZeRO hands the optimizer flat partitions). When
``args.deepspeed`` is set or Accelerate runs DeepSpeed (``ACCELERATE_USE_DEEPSPEED=true``, set by
``accelerate launch --config_file integrations/accelerate/deepspeed_zero2.yaml``),
:func:`gefen_optimizer_cls_and_kwargs` selects it by itself and the Trainer hands it to DeepSpeed as a
client optimizer (Accelerate sets ``zero_allow_untested_optimizer``). The DeepSpeed config must then
have no ``"optimizer"`` section; the JSON configs in ``integrations/deepspeed/`` carry one (for
``deepspeed.initialize``) and fixed batch sizes and lr, which the Trainer refuses as mismatches:
use the Accelerate YAMLs in ``integrations/accelerate/``, or a JSON with ``"auto"`` values.
FSDP2 (``integrations/accelerate/fsdp2.yaml``): the Trainer creates the optimizer after
``fully_shard``, so Gefen receives DTensor parameters and keeps DTensor state.
"""
from __future__ import annotations

import os
from typing import Any, Dict, Optional, Tuple

import torch

from ..optimizer import Gefen

__all__ = ["GefenFactory", "gefen_optimizer_cls_and_kwargs", "named_param_groups", "make_gefen", "deepspeed_active"]


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
