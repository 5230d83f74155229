"""``Gefen.load_state_dict`` of a ``torch.optim.AdamW`` (or Adam) state dict: a warm start.

A job that trained with AdamW and switches to Gefen to free memory (or a trainer that resumes an
AdamW checkpoint into the optimizer it is now given: the Hugging Face Trainer, Accelerate) hands
Gefen AdamW's entries, ``exp_avg`` and ``exp_avg_sq`` per parameter. Tensors Gefen keeps exact
take them as they are. For the quantized ones Gefen does here what its first step does with the
first gradient, from the moments instead:

* the period of each tensor from ``exp_avg_sq`` (the paper's score on ``ln v`` in place of
  ``ln g^2``; the period a mode or shape fixes stays fixed, D14, D16), exactly as the DeepSpeed
  universal warm start (:mod:`gefen_dist.integrations.ds_universal`) chooses it;
* the codebook from the histogram of ``exp_avg`` normalised by its scale blocks' absmax (a first
  step's is of ``(1 - beta1) g``, the same up to the scale);
* the state: :func:`gefen_dist.core.moments.state_from_moments` (the first moment quantized; the
  second moment's block, row or column means, which are exactly what Gefen accumulates from the
  same gradients).

The step count carries over, so the bias corrections go on from AdamW's. A tensor whose moments are
all zero (AdamW never saw a gradient for it) gets the placeholder state a first step would give it.
No collective is entered: every rank of a DDP job loads the same full state dict and computes the
same state. Entries that are DTensors (FSDP2's sharded state dicts) are refused with the way
around, since the codebook and the column profiles need every rank's rows.
"""
from __future__ import annotations

import logging
import math
from typing import Any, Dict, List, Mapping, Sequence, Tuple

import torch

from ..core import span as _span
from ..core.moments import state_from_moments
from ..core.periods import resolve_period, row_slab
from ..core.quant import NUM_BINS
from ..engine import learning
from ..engine.layout import global_shape, is_dtensor, like_param, local_tensor
from ..engine.state import MODE_SPAN, fixed_period
from ..kernels import dispatch as _dispatch

logger = logging.getLogger(__name__)

__all__ = ["is_adamw_entry", "is_adamw_state", "import_adamw"]


def is_adamw_entry(saved: Any) -> bool:
    """Whether a saved per-parameter entry holds AdamW's moments (and no Gefen state)."""
    return isinstance(saved, dict) and {"exp_avg", "exp_avg_sq"} <= set(saved) and "idx" not in saved


def is_adamw_state(entries: Mapping[Any, Any]) -> bool:
    """Whether a state dict's ``state`` is a ``torch.optim.AdamW`` one: AdamW's moments and no Gefen
    state (its param groups may carry Gefen's keys when the same group dicts built both optimizers)."""
    return (any(is_adamw_entry(e) for e in entries.values())
            and not any(isinstance(e, dict) and ("idx" in e or "period" in e) for e in entries.values()))


def _moments(p: torch.Tensor, saved: dict, name: str) -> Tuple[torch.Tensor, torch.Tensor]:
    """``exp_avg`` and ``exp_avg_sq`` of ``saved`` as float32 tensors of ``p``'s global shape, checked."""
    shape = global_shape(p)
    out = []
    for key in ("exp_avg", "exp_avg_sq"):
        t = saved[key]
        if not isinstance(t, torch.Tensor) or not t.is_floating_point():
            raise ValueError(f"AdamW state {key!r} of parameter {name!r} is not a floating-point tensor "
                             f"({type(t).__name__}); load the dict that torch.optim.AdamW.state_dict() returned")
        if is_dtensor(t) or is_dtensor(p):
            raise ValueError(
                f"AdamW state of parameter {name!r} is sharded (a DTensor: an FSDP2 state dict): Gefen learns its "
                "codebook and column profiles from every rank's rows, so it imports AdamW moments only from a "
                "full state dict. Load the AdamW checkpoint into Gefen in one process over the unsharded model "
                "(or with DDP), save Gefen's state dict, and load that one under FSDP2")
        if tuple(t.shape) != shape:
            raise ValueError(f"AdamW state {key!r} of parameter {name!r} has shape {tuple(t.shape)}, the parameter "
                             f"{shape}; the model changed since the checkpoint was saved")
        t = t.detach().float()
        if not bool(torch.isfinite(t).all()):
            raise ValueError(f"AdamW state {key!r} of parameter {name!r} holds NaN or inf values; Gefen cannot "
                             "import it (the AdamW run had diverged): load an earlier checkpoint, or start Gefen fresh")
        out.append(t)
    if bool((out[1] < 0).any()):
        raise ValueError(f"AdamW state 'exp_avg_sq' of parameter {name!r} has negative values; it is not a second "
                         "moment (a corrupted or foreign checkpoint)")
    return out[0], out[1]


def _period(spec0, shape: Sequence[int], second_moment: str, v: torch.Tensor) -> int:
    """The period a first step would learn, from ``v`` in place of the first gradient's ``g^2``."""
    if spec0.mode == MODE_SPAN:
        return spec0.geometry.period
    fixed = fixed_period(shape, second_moment)
    if fixed is not None:
        return int(fixed)
    return resolve_period(_dispatch.paper_period(v.sqrt()), row_slab(shape))


def import_adamw(opt, items: List[Tuple[torch.Tensor, dict, dict, str]], spec_of) -> Tuple[Dict, torch.Tensor]:
    """Gefen state entries for the quantized parameters of ``items`` (``(param, saved AdamW entry,
    its loaded param group, name)``) and the codebook learned from them. ``spec_of(p, group,
    period)`` gives a tensor's :class:`~gefen_dist.engine.state.StateSpec`. Raises ``ValueError``
    before anything changes; changes nothing itself."""
    todo, counts = [], torch.zeros(NUM_BINS, dtype=torch.int64)
    for p, saved, group, name in items:
        m, v = _moments(p, saved, name)
        shape = global_shape(p)
        spec0 = spec_of(p, group, None)
        learned = bool((m != 0).any()) or bool((v != 0).any())
        spec = spec_of(p, group, _period(spec0, shape, group["second_moment"], v)) if learned else spec0
        if learned:
            if spec.mode == MODE_SPAN:
                sp = _span.SpanPiece.of(shape)
                _span.span_histogram(m, _span.span_grad_absmax(m, sp), sp, counts)
            else:
                _dispatch.block_histogram(m, spec.geometry.scale_block, out=counts)
        todo.append((p, saved, name, m, v, spec, learned))
    if not int(counts.sum()):
        codebook = None
    else:
        fit = learning.learn_codebook(counts, getattr(opt, "symmetric_codebook", True))
        codebook = fit.codebook
        opt_info = dict(fit.info, source="exp_avg (AdamW state dict, load_state_dict)")
    out: Dict[torch.Tensor, dict] = {}
    cb_entry = codebook if codebook is not None else torch.zeros(256, dtype=torch.float32)  # (zeros: not learned)
    for p, saved, name, m, v, spec, learned in todo:
        dev = local_tensor(p).device
        st = spec.allocate(tuple(local_tensor(p).shape), dev, learned=learned, step=_step(saved, name),
                           codebook=cb_entry.to(dev), wrap=lambda t, gs: like_param(t, p, gs))
        if learned:
            geo = spec.geometry
            new = state_from_moments(m, v, mode=spec.mode, shape=geo.global_shape, period=geo.period,
                                     scale_block=geo.scale_block, row_blocks=spec.row_blocks, codebook=codebook,
                                     nearest=_dispatch.nearest)
            for key, t in new.items():
                st[key].copy_(t.view_as(st[key]))
        out[p] = st
    if codebook is not None:
        opt.codebook_info = opt_info
        logger.info("Gefen.load_state_dict: warm start from AdamW state: %d quantized tensors (%d with moments; "
                    "periods from exp_avg_sq, the codebook from exp_avg, %d values), step %s",
                    len(todo), sum(t[-1] for t in todo), int(counts.sum()),
                    sorted({int(st['step']) for st in out.values()})[:4])
    return out, codebook


def _step(saved: dict, name: str) -> int:
    step = saved.get("step", 0)
    step = float(step.item()) if isinstance(step, torch.Tensor) and step.numel() == 1 else step
    if not isinstance(step, (int, float)) or step < 0 or not math.isfinite(step) or step != int(step):
        raise ValueError(f"AdamW state 'step' of parameter {name!r} is {saved.get('step')!r}, not a step count")
    return int(step)
