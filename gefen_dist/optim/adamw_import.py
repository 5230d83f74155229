"""``Gefen.load_state_dict`` of a ``torch.optim.AdamW`` (or Adam) state dict: a warm start.

A job that trained with AdamW and switches to Gefen to free memory (or a trainer that resumes an
AdamW checkpoint into the optimizer it is now given, as the Hugging Face Trainer does) hands
Gefen AdamW's entries, ``exp_avg`` and ``exp_avg_sq`` per parameter. Tensors Gefen keeps exact
take them as they are. For the quantized ones Gefen does here what its first step does with the
first gradient, from the moments instead:

* the period of each tensor from ``exp_avg_sq`` (the first step's period rule, the paper's score
  on ``ln v`` in place of ``ln g^2``; the period a mode or shape fixes stays fixed, D14, D16);
* the codebook from the histogram of ``exp_avg`` normalised by its scale blocks' absmax (a first
  step's is of ``(1 - beta1) g``, the same up to the scale);
* the state: :func:`gefen_dist.core.moments.state_from_moments` (the first moment quantized; the
  second moment's block, row or column means, which are exactly what Gefen accumulates from the
  same gradients).

The step count carries over, so the bias corrections go on from AdamW's. A tensor whose moments are
all zero (AdamW never saw a gradient for it) gets the placeholder state a first step would give it.
Plain (not DTensor) parameters: no collective is entered; every rank of a DDP job loads the same
full state dict and computes the same state. DTensor parameters (FSDP2, HSDP): each rank builds
the state of its rows, from the local tensors of DTensor entries (``adamw.state_dict()`` of an
AdamW over the same sharded model) or its rows of full ones, and the period, codebook and column
statistics are reduced over the optimizer's process group with the first step's collectives, so
every rank must load (as ``set_optimizer_state_dict`` and DCP flows do).
"""
from __future__ import annotations

import logging
import math
from dataclasses import replace
from typing import Any, Dict, List, Mapping, Sequence, Tuple

import torch

from ..core.moments import MomentsLayout, moments_partials, state_from_moments
from ..core.periods import row_slab
from ..engine import learning
from ..engine.comm import LocalComm
from ..engine.layout import global_shape, is_dtensor, like_param, local_tensor, piece_of
from ..engine.state import MODE_EXACT, MODE_FACTORED, SPAN_MODES, fixed_period, mode_of_saved, nibbles_in
from ..kernels import dispatch as _dispatch

logger = logging.getLogger(__name__)

__all__ = ["is_adamw_entry", "is_adamw_state", "import_adamw"]


def is_adamw_entry(saved: Any) -> bool:
    """Whether a saved per-parameter entry holds AdamW's moments (and no Gefen state)."""
    return (isinstance(saved, dict) and mode_of_saved(saved) == MODE_EXACT
            and {"exp_avg", "exp_avg_sq"} <= set(saved))


def is_adamw_state(entries: Mapping[Any, Any]) -> bool:
    """Whether a state dict's ``state`` is a ``torch.optim.AdamW`` one: AdamW's moments and no Gefen
    state (its param groups may carry Gefen's keys when the same group dicts built both optimizers)."""
    return (any(is_adamw_entry(e) for e in entries.values())
            and not any(isinstance(e, dict) and mode_of_saved(e) not in (None, MODE_EXACT) for e in entries.values()))


def _moments(p: torch.Tensor, saved: dict, name: str, pc) -> Tuple[torch.Tensor, torch.Tensor, str]:
    """``exp_avg`` and ``exp_avg_sq`` of ``saved`` for piece ``pc`` of ``p`` (float32, its rows: the
    local tensors of DTensor entries, or this rank's rows of full ones), and what is wrong with their
    values ("" if nothing; a structural problem raises here, the same on every rank)."""
    shape = global_shape(p)
    out = []
    for key in ("exp_avg", "exp_avg_sq"):
        t = saved[key]
        if not isinstance(t, torch.Tensor) or not t.is_floating_point():
            raise ValueError(f"AdamW state {key!r} of parameter {name!r} is not a floating-point tensor "
                             f"({type(t).__name__}); load the dict that torch.optim.AdamW.state_dict() returned")
        if tuple(t.shape) != shape:
            raise ValueError(f"AdamW state {key!r} of parameter {name!r} has shape {tuple(t.shape)}, the parameter "
                             f"{shape}; the model changed since the checkpoint was saved")
        if is_dtensor(t) and not is_dtensor(p):
            raise ValueError(f"AdamW state {key!r} of parameter {name!r} is a DTensor but the parameter is not: "
                             "load it into Gefen over the same FSDP2 model as AdamW, or load a full state dict")
        if is_dtensor(t):
            if tuple(t.placements) != tuple(p.placements):
                raise ValueError(f"AdamW state {key!r} of parameter {name!r} is sharded as {t.placements}, the "
                                 f"parameter as {p.placements}; load it over the same FSDP2 model as AdamW")
            local = t._local_tensor
        else:
            local = t.detach().reshape(-1)[pc.start:pc.start + pc.local.numel()]  # (the whole tensor if not sharded)
        out.append(local.detach().float().reshape(pc.local.shape))
    bad = ""
    if not bool(torch.isfinite(out[0]).all() and torch.isfinite(out[1]).all()):
        bad = "holds NaN or inf values (the AdamW run had diverged): load an earlier checkpoint, or start Gefen fresh"
    elif bool((out[1] < 0).any()):
        bad = "has a negative exp_avg_sq: it is not a second moment (a corrupted or foreign checkpoint)"
    return out[0], out[1], bad


def _refuse_bad_values(comm, names: Sequence[str], bad: Sequence[str]) -> None:
    """Raise on every rank if any rank found bad values in an entry (one MAX all-reduce when sharded,
    so that no rank goes on into the collectives that follow)."""
    flags = torch.tensor([1.0 if b else 0.0 for b in bad], dtype=torch.float64)
    if comm.world_size > 1 and len(flags):
        comm.all_reduce_max_(flags)
    hit = [i for i, f in enumerate(flags.tolist()) if f]
    if hit:
        i = hit[0]
        why = bad[i] or "holds NaN, inf or negative values on another rank's rows"
        raise ValueError(f"AdamW state of parameter {names[i]!r} {why}"
                         + (f" ({len(hit) - 1} more tensor(s) likewise)" if len(hit) > 1 else ""))


def import_adamw(opt, items: List[Tuple[torch.Tensor, dict, dict, str]], spec_of) -> Tuple[Dict, torch.Tensor]:
    """Gefen state entries for the quantized parameters of ``items`` (``(param, saved AdamW entry,
    its loaded param group, name)``) and the codebook learned from them. ``spec_of(p, group,
    period)`` gives a tensor's :class:`~gefen_dist.engine.state.StateSpec`. Raises ``ValueError``
    before anything changes; changes nothing itself. Entries of DTensor parameters (FSDP2) are
    pieces of their tensors: the period, codebook and column statistics are reduced over the
    optimizer's process group, so every rank must load (as ``set_optimizer_state_dict`` does);
    otherwise nothing is communicated."""
    if nibbles_in(opt.param_groups, opt.small_threshold):
        raise ValueError("loading a torch.optim.AdamW state dict into Gefen(second_moment='nibbles') is not supported "
                         "yet (its moments would need the one-byte layout's codes, D20): start that optimizer fresh, or "
                         "warm-start Gefen(second_moment='factored') from it")
    sharded = any(is_dtensor(p) for p, *_ in items)
    comm = opt._comm if sharded else LocalComm()
    todo, bad = [], []
    learning.check_same_tensors(comm, [global_shape(p) for p, *_ in items])
    for p, saved, group, name in items:
        pc = piece_of(p, comm.rank, comm.world_size > 1)
        m, v, why = _moments(p, saved, name, pc)
        bad.append(why)
        # the piece's "gradient" is sqrt(v): the period rule reads g^2 (NaN where v < 0: refused next)
        todo.append((p, saved, group, name, m, v, replace(pc, grad=v.sqrt()), spec_of(p, group, None)))
    _refuse_bad_values(comm, [t[3] for t in todo], bad)
    # learned where AdamW saw a gradient: v > 0 somewhere (m != 0 only where v > 0)
    live = learning.live_pieces(comm, [t[6] for t in todo])
    detect = [(i, t) for i, t in enumerate(todo) if live[i]]
    periods = learning.learn_periods(comm, [t[6] for _, t in detect],
                                     [t[7].geometry.period if t[7].mode in SPAN_MODES + (MODE_FACTORED,)
                                      else fixed_period(t[6].shape, t[2]["second_moment"]) for _, t in detect])
    specs = {i: spec_of(t[0], t[2], per) for (i, t), per in zip(detect, periods)}
    counts = learning.global_histogram(comm, [(replace(t[6], grad=t[4]), specs[i].geometry.scale_block,
                                               specs[i].mode if specs[i].mode in SPAN_MODES else None)
                                              for i, t in detect])
    fit = learning.learn_codebook(counts, getattr(opt, "symmetric_codebook", True)) if int(counts.sum()) else None
    codebook = fit.codebook if fit is not None else None
    layouts = {i: _layout(specs[i], todo[i][6]) for i in specs}
    order = sorted(layouts)
    sums, maxima = _reduce(comm, order, [moments_partials(todo[i][4], todo[i][5], layouts[i]) for i in order],
                           [todo[i][6].contributes for i in order])
    out: Dict[torch.Tensor, dict] = {}
    cb_entry = codebook if codebook is not None else torch.zeros(256, dtype=torch.float32)  # (zeros: not learned)
    for i, (p, saved, group, name, m, v, pc, spec0) in enumerate(todo):
        spec = specs.get(i, spec0)
        dev = local_tensor(p).device
        st = spec.allocate(tuple(local_tensor(p).shape), dev, learned=i in specs, step=_step(saved, name),
                           codebook=cb_entry.to(dev), wrap=lambda t, gs: like_param(t, p, gs))
        if i in specs:
            new = state_from_moments(m, v, layouts[i], codebook, sums[i], maxima[i], nearest=_dispatch.nearest)
            for key, t in new.items():
                local_tensor(st[key]).copy_(t.view_as(local_tensor(st[key])))
        out[p] = st
    if fit is not None:
        opt.codebook_info = dict(fit.info, source="exp_avg (AdamW state dict, load_state_dict)")
        logger.info("Gefen.load_state_dict: warm start from AdamW state: %d quantized tensors (%d with moments; "
                    "periods from exp_avg_sq, the codebook from exp_avg, %d values)%s", len(todo), len(specs),
                    int(counts.sum()), " over the process group's shards" if sharded else "")
    return out, codebook


def _layout(spec, pc) -> MomentsLayout:
    geo = spec.geometry
    slab = row_slab(pc.shape)
    return MomentsLayout(spec.mode, tuple(pc.shape), pc.start // slab, pc.local.numel() // slab, geo.period,
                         geo.scale_block, spec.row_blocks, spec.col_blocks)


def _reduce(comm, order, parts, contributes) -> Tuple[Dict[int, torch.Tensor], Dict[int, torch.Tensor]]:
    """Every tensor's partial sums and maxima (:func:`~gefen_dist.core.moments.moments_partials`; a
    replica's sums count as zeros), reduced over ``comm`` with one SUM and one MAX all-reduce in all
    (entered by every rank, also with nothing to reduce), by tensor number (``order``)."""
    sums = [s if c else torch.zeros_like(s) for (s, _), c in zip(parts, contributes)]
    maxima = [mx for _, mx in parts]
    out = []
    for chunks, reduce_, dt in ((sums, comm.all_reduce_sum_, torch.float64), (maxima, comm.all_reduce_max_,
                                                                            torch.float32)):
        flat = torch.cat([c.reshape(-1).cpu() for c in chunks]) if chunks else torch.zeros(0, dtype=dt)
        reduce_(flat)
        out.append(dict(zip(order, flat.split([c.numel() for c in chunks]))))
    return out[0], out[1]


def _step(saved: dict, name: str) -> int:
    step = saved.get("step", 0)
    step = float(step.item()) if isinstance(step, torch.Tensor) and step.numel() == 1 else step
    if not isinstance(step, (int, float)) or step < 0 or not math.isfinite(step) or step != int(step):
        raise ValueError(f"AdamW state 'step' of parameter {name!r} is {saved.get('step')!r}, not a step count")
    return int(step)
