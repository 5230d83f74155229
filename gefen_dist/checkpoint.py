"""Checkpoints of Gefen state with ``torch.distributed.checkpoint`` (DCP).

Gefen's state is made of ordinary tensors laid out like the parameter (``idx`` uint8 shaped like
the parameter; ``scale`` and ``v`` fp32 shaped ``(rows, slab // block)``; a shared ``(256,)``
codebook; ints ``step``, ``period``, ``scale_block``, ``learned``). Under FSDP2 the per-row
tensors are DTensors with the parameter's mesh and placements, so DCP saves them as chunks
with global offsets and reshards them on load at any world size, and a DDP checkpoint (plain
tensors) loads into FSDP2 and back.

Two things need help, and this module provides it:

* The shapes of ``scale`` and ``v`` depend on the learned *period*; DCP loads in place, so the
  state must exist with the saved shapes before :func:`torch.distributed.checkpoint.load`.
  :func:`prepare_for_load` reads the periods from the checkpoint metadata and allocates the
  state (this also keeps DCP from running its zero-gradient "init step").
* A full (consolidated) state dict loaded with ``broadcast_from_rank0`` needs the same, with the
  periods taken from rank 0's dict (:func:`load_full_state_dict`).

Typical use::

    from gefen_dist import checkpoint as gckpt
    gckpt.save(model, opt, "ckpt/step100", extra={"step": 100})
    ...
    extra = gckpt.load(model, opt, "ckpt/step100")     # any world size / parallelism

See ``docs/checkpoints.md``.
"""
from __future__ import annotations

import contextlib
import logging
import os
import warnings
from typing import Any, Dict, Iterable, List, Optional

import torch

from .core.periods import row_slab
from .layout import global_shape, is_exact, local_tensor

logger = logging.getLogger(__name__)

MODEL_KEY = "model"
OPTIM_KEY = "optim"
EXTRA_KEY = "extra"

__all__ = [
    "prepare_for_load",
    "saved_periods",
    "save",
    "load",
    "full_state_dict",
    "load_full_state_dict",
    "param_fqns",
]


# ----------------------------------------------------------------------------- names
def param_fqns(model: torch.nn.Module) -> Dict[int, str]:
    """``id(param) -> FQN`` as ``torch.distributed.checkpoint.state_dict`` names parameters
    (without DDP's ``module.``, ``torch.compile``'s ``_orig_mod.`` or activation-checkpoint
    wrapper prefixes)."""
    try:
        from torch.distributed.checkpoint.state_dict import _get_fqns
    except ImportError:  # pragma: no cover - older/newer torch without the private helper
        _get_fqns = None
    out: Dict[int, str] = {}
    for name, p in model.named_parameters():
        if id(p) in out:
            continue
        fqn = None
        if _get_fqns is not None:
            try:
                fqns = _get_fqns(model, name)
                if len(fqns) == 1:
                    fqn = next(iter(fqns))
            except Exception:  # noqa: BLE001 - fall back to plain prefix stripping
                fqn = None
        if fqn is None:
            parts = [s for s in name.split(".") if s not in ("module", "_orig_mod", "_checkpoint_wrapped_module",
                                                            "_fsdp_wrapped_module")]
            fqn = ".".join(parts)
        out[id(p)] = fqn
    return out


def _optimizer_params(optimizer: torch.optim.Optimizer) -> List[torch.Tensor]:
    return [p for g in optimizer.param_groups for p in g["params"]]


def _small_threshold(optimizer) -> int:
    return int(getattr(optimizer, "small_threshold", 4096))


def _is_gefen(optimizer) -> bool:
    _refuse_zero(optimizer)
    return hasattr(optimizer, "init_state") and hasattr(optimizer, "small_threshold")


def _refuse_zero(optimizer) -> None:
    if hasattr(optimizer, "consolidate_state_dict"):
        raise TypeError(
            f"{type(optimizer).__name__} partitions optimizer state across ranks as flat slices, which "
            "torch.distributed.checkpoint cannot reshard: call optimizer.consolidate_state_dict(to=0) on "
            "every rank, torch.save(optimizer.state_dict()) on rank 0, and load_state_dict() at any world size"
        )


# ----------------------------------------------------------------------------- metadata
def _reader(checkpoint_id):
    from torch.distributed.checkpoint import FileSystemReader, StorageReader

    if isinstance(checkpoint_id, StorageReader):
        return checkpoint_id
    return FileSystemReader(os.fspath(checkpoint_id))


def _find_key(keys: Iterable[str], fqn: str, leaf: str, prefix: Optional[str]) -> Optional[str]:
    """The metadata key of optimizer state ``leaf`` of parameter ``fqn``.

    DCP flattens nested state dicts with dots: ``{"optim": {"state": {fqn: {"v": t}}}}`` is stored
    as ``optim.state.<fqn>.v``; a bare optimizer state dict as ``state.<fqn>.v``. FQNs contain dots
    themselves, so match the whole suffix, preferring the expected prefix.
    """
    keys = list(keys)
    want = f"state.{fqn}.{leaf}"
    if prefix:
        exact = f"{prefix}.{want}"
        if exact in keys:
            return exact
    if want in keys:
        return want
    hits = [k for k in keys if k.endswith("." + want)]
    if len(hits) == 1:
        return hits[0]
    if len(hits) > 1:
        raise ValueError(
            f"checkpoint holds several optimizer states for parameter {fqn!r}: {sorted(hits)}; "
            "pass key_prefix= to choose one"
        )
    return None


def saved_periods(model: torch.nn.Module, optimizer: torch.optim.Optimizer, checkpoint_id: Any,
                  *, key_prefix: Optional[str] = OPTIM_KEY) -> Dict[str, int]:
    """Periods of the quantized parameters as saved in a DCP checkpoint, ``{fqn: period}``.

    ``period = slab // saved_v.size[-1]`` with ``slab = prod(shape[1:])``. Parameters whose state is
    not in the checkpoint, or is exact AdamW state there, are left out.
    """
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    md = _reader(checkpoint_id).read_metadata()
    sdm = md.state_dict_metadata
    fqns = param_fqns(model)
    thr = _small_threshold(optimizer)
    out: Dict[str, int] = {}
    for p in _optimizer_params(optimizer):
        if not p.requires_grad:
            continue
        shape = global_shape(p)
        if is_exact(shape, thr):
            continue
        fqn = fqns.get(id(p))
        if fqn is None:
            raise ValueError(f"an optimizer parameter of shape {shape} is not a parameter of the model passed "
                             "to prepare_for_load (pass the model the optimizer was built over)")
        key = _find_key(sdm.keys(), fqn, "v", key_prefix)
        if key is None:
            # No shared second moment (e.g. second_moment="factored"): the state's shapes depend only
            # on the scale block, and period = scale block gives that block; the saved period
            # itself (an int in the checkpoint) is restored by the load.
            key = _find_key(sdm.keys(), fqn, "scale", key_prefix)
        if key is None:
            if _find_key(sdm.keys(), fqn, "exp_avg", key_prefix) is not None:
                logger.warning("checkpoint holds exact AdamW state for %r, which is quantized here "
                               "(different small_threshold?); loading it will fail", fqn)
            else:
                logger.warning("checkpoint holds no optimizer state for %r", fqn)
            continue
        meta = sdm[key]
        if not isinstance(meta, TensorStorageMetadata):
            raise ValueError(f"checkpoint entry {key!r} is not a tensor ({type(meta).__name__})")
        saved = tuple(int(s) for s in meta.size)
        slab = row_slab(shape)
        cols = saved[-1] if saved else 0
        if len(saved) != 2 or saved[0] != shape[0] or cols <= 0 or slab % cols:
            raise ValueError(
                f"checkpoint entry {key!r} has shape {saved}, which does not fit parameter {fqn!r} of "
                f"shape {shape} (expected ({shape[0]}, k) with k dividing {slab}); the model changed "
                "since the checkpoint was saved"
            )
        out[fqn] = slab // cols
    return out


def _allocate(model: torch.nn.Module, optimizer, periods: Dict[str, int]) -> None:
    """Drop state whose period differs from ``periods`` and allocate the rest (no collectives)."""
    if not _is_gefen(optimizer):
        return
    fqns = param_fqns(model)
    by_param: Dict[Any, int] = {}
    for p in _optimizer_params(optimizer):
        fqn = fqns.get(id(p))
        if fqn is None or fqn not in periods:
            continue
        per = int(periods[fqn])
        by_param[p] = per
        st = optimizer.state.get(p)
        if st and (st.get("period") != per or "idx" not in st):
            del optimizer.state[p]
    optimizer.init_state(by_param)


def prepare_for_load(model: torch.nn.Module, optimizer: torch.optim.Optimizer, checkpoint_id: Any,
                     *, key_prefix: Optional[str] = OPTIM_KEY) -> Dict[str, int]:
    """Allocate Gefen state with the shapes saved in DCP checkpoint ``checkpoint_id``.

    Call it on every rank before ``get_optimizer_state_dict``/``get_state_dict`` and ``dcp.load``
    (:func:`load` does). Reads only the checkpoint metadata; no collectives. State of a parameter
    whose period differs from the saved one is dropped and re-allocated; the values themselves
    come from ``dcp.load``. Because the state then exists, DCP does not run its zero-gradient
    init ``step()``. Returns the periods found, ``{fqn: period}``.
    """
    if not _is_gefen(optimizer):
        raise TypeError(f"prepare_for_load expects a gefen_dist.Gefen optimizer, got {type(optimizer).__name__}")
    periods = saved_periods(model, optimizer, checkpoint_id, key_prefix=key_prefix)
    _allocate(model, optimizer, periods)
    return periods


def _ensure_state(optimizer) -> None:
    """Allocate placeholder state instead of letting DCP call ``step()`` on zero gradients."""
    if _is_gefen(optimizer) and not optimizer.state:
        optimizer.init_state()


def _param_names(optimizer) -> List[Any]:
    return [g.get("param_names") for g in optimizer.param_groups]


def _finish_load(optimizer, names: Optional[List[Any]] = None) -> None:
    """Every param state references the optimizer's one codebook; ranks agree on it; the
    optimizer keeps its own ``param_names`` (``Optimizer.load_state_dict`` would take the saved
    ones, e.g. DDP's ``module.``-prefixed names in an FSDP2 run)."""
    if names is not None:
        for g, n in zip(optimizer.param_groups, names):
            if n is not None:
                g["param_names"] = n
    if not _is_gefen(optimizer):
        return
    cb = getattr(optimizer, "codebook", None)
    for st in optimizer.state.values():
        if "codebook" in st and cb is not None and st["codebook"] is not cb:
            dev = local_tensor(st["idx"]).device
            st["codebook"] = cb if cb.device == dev else cb.to(dev)
    comm = getattr(optimizer, "_comm", None)
    if cb is not None and comm is not None and comm.world_size > 1 and hasattr(optimizer, "_check_agreement"):
        optimizer._check_agreement()


@contextlib.contextmanager
def _single_process_quiet():
    """DCP warns on every call without a process group; single process is a supported use here."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r".*torch\.distributed is (disabled|unavailable).*")
        yield


# ----------------------------------------------------------------------------- sharded (DCP)
def save(model: torch.nn.Module, optimizer: torch.optim.Optimizer, checkpoint_id: Any,
         extra: Optional[Dict[str, Any]] = None, *, options=None, process_group=None) -> None:
    """Save model and optimizer (sharded, one file per rank) with DCP, on every rank.

    The checkpoint holds ``{"model": ..., "optim": ..., "extra": extra}``. ``extra`` may hold
    tensors and picklable Python values (step counters, RNG states, ...). Before the first step
    Gefen's state is allocated as placeholders (``learned=0``), so DCP's zero-grad ``step()`` is
    not run and no degenerate codebook is saved.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    _ensure_state(optimizer)
    msd, osd = get_state_dict(model, optimizer, options=options)
    sd: Dict[str, Any] = {MODEL_KEY: msd, OPTIM_KEY: osd}
    if extra is not None:
        sd[EXTRA_KEY] = extra
    with _single_process_quiet():
        dcp.save(sd, checkpoint_id=checkpoint_id, process_group=process_group)


def load(model: torch.nn.Module, optimizer: torch.optim.Optimizer, checkpoint_id: Any,
         extra: Optional[Dict[str, Any]] = None, *, options=None, process_group=None) -> Optional[Dict[str, Any]]:
    """Load a checkpoint written by :func:`save` (or any DCP checkpoint with ``model``/``optim``
    keys) into ``model`` and ``optimizer`` at any world size and parallelism (FSDP2, HSDP, DDP,
    single process), on every rank.

    ``extra``: a dict to fill in place (its keys select what to read); when ``None`` and the
    checkpoint has an ``extra`` entry, it is read whole on every rank. Returns the extra dict
    (or ``None``).
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    names = _param_names(optimizer)
    if _is_gefen(optimizer):
        prepare_for_load(model, optimizer, checkpoint_id)
    msd, osd = get_state_dict(model, optimizer, options=options)
    sd: Dict[str, Any] = {MODEL_KEY: msd, OPTIM_KEY: osd}
    if extra is not None:
        sd[EXTRA_KEY] = extra
    kept = _drop_unsaved_group_keys(osd, checkpoint_id)
    with _single_process_quiet():
        dcp.load(sd, checkpoint_id=checkpoint_id, process_group=process_group)
    for g, missing in zip(osd.get("param_groups", []), kept):
        g.update(missing)
    set_state_dict(model, optimizer, model_state_dict=sd[MODEL_KEY], optim_state_dict=sd[OPTIM_KEY],
                   options=options)
    _finish_load(optimizer, names)
    if extra is not None:
        return sd[EXTRA_KEY]
    return _read_extra(checkpoint_id, process_group)


def _drop_unsaved_group_keys(osd: Dict[str, Any], checkpoint_id) -> List[Dict[str, Any]]:
    """Param-group entries (hyperparameters) that the checkpoint lacks, e.g. an option added to
    Gefen after it was saved: take them out of the DCP template (DCP refuses missing keys) and
    return them, so that they keep this optimizer's values. Missing *state* still fails the load."""
    groups = osd.get("param_groups", []) if isinstance(osd, dict) else []
    if not groups:
        return []
    saved = _reader(checkpoint_id).read_metadata().state_dict_metadata
    kept = []
    for i, g in enumerate(groups):
        missing = {k: v for k, v in g.items() if k != "params" and f"{OPTIM_KEY}.param_groups.{i}.{k}" not in saved}
        if missing and not any(k.startswith(f"{OPTIM_KEY}.param_groups.{i}.") for k in saved):
            missing = {}  # the checkpoint uses another layout: let DCP report it
        for k in missing:
            del g[k]
        if missing:
            logger.warning("checkpoint %s has no %s for param group %d: keeping this optimizer's values %s",
                           checkpoint_id, sorted(missing), i, missing)
        kept.append(missing)
    return kept


def _read_extra(checkpoint_id, process_group) -> Optional[Dict[str, Any]]:
    md = _reader(checkpoint_id).read_metadata()
    if not any(k == EXTRA_KEY or k.startswith(EXTRA_KEY + ".") for k in md.state_dict_metadata):
        return None
    try:
        from torch.distributed.checkpoint.state_dict_loader import _load_state_dict_from_keys
    except ImportError:  # pragma: no cover
        logger.warning("this torch cannot read 'extra' without a template; pass extra={...} to load()")
        return None
    with _single_process_quiet():
        out = _load_state_dict_from_keys({EXTRA_KEY}, storage_reader=_reader(checkpoint_id),
                                         process_group=process_group)
    return out.get(EXTRA_KEY)


# ----------------------------------------------------------------------------- full (consolidated)
def full_state_dict(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> Dict[str, Any]:
    """The consolidated ``{"model": ..., "optim": ...}`` state dict on rank 0 (CPU, plain tensors,
    ``idx`` kept uint8), ``{}`` on other ranks. Every rank must call it (it gathers).

    ``torch.save`` it on rank 0 for a single-file checkpoint, and load it with
    :func:`load_full_state_dict` at any world size.
    """
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    _ensure_state(optimizer)
    opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
    msd, osd = get_state_dict(model, optimizer, options=opts)
    if not msd and not osd:
        return {}
    return {MODEL_KEY: msd, OPTIM_KEY: osd}


def _periods_from_full(model, optimizer, osd: Dict[str, Any]) -> Dict[str, int]:
    thr = _small_threshold(optimizer)
    fqns = param_fqns(model)
    state = osd.get("state", {})
    out = {}
    for p in _optimizer_params(optimizer):
        fqn = fqns.get(id(p))
        shape = global_shape(p)
        if fqn is None or is_exact(shape, thr) or fqn not in state:
            continue
        leaf = "v" if "v" in state[fqn] else "scale"  # see saved_periods
        if leaf not in state[fqn]:
            continue
        cols = int(state[fqn][leaf].shape[-1])
        slab = row_slab(shape)
        if cols <= 0 or slab % cols:
            raise ValueError(f"state {leaf!r} of {fqn!r} has shape {tuple(state[fqn][leaf].shape)}, which does not "
                             f"fit parameter shape {shape}")
        out[fqn] = slab // cols
    return out


def _copy_structure(obj):
    """Copy nested dicts/lists, sharing the leaves (tensors are not copied)."""
    if isinstance(obj, dict):
        return {k: _copy_structure(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_copy_structure(v) for v in obj]
    return obj


def load_full_state_dict(model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                         state_dict: Optional[Dict[str, Any]], *, broadcast_from_rank0: bool = True) -> None:
    """Load a consolidated state dict from :func:`full_state_dict`, on every rank.

    With ``broadcast_from_rank0`` (default) only rank 0 needs ``state_dict`` (others may pass
    ``{}``/``None``); it is broadcast and resharded to this run's layout. Otherwise every rank
    passes the full dict.
    """
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, set_model_state_dict,
                                                         set_optimizer_state_dict)

    state_dict = state_dict or {}
    distributed = dist.is_available() and dist.is_initialized()
    rank = dist.get_rank() if distributed else 0
    periods = None
    if rank == 0 or not broadcast_from_rank0:
        periods = _periods_from_full(model, optimizer, state_dict.get(OPTIM_KEY, {}))
    if distributed and broadcast_from_rank0:
        box = [periods]
        dist.broadcast_object_list(box, src=0)
        periods = box[0]
    names = _param_names(optimizer)
    _allocate(model, optimizer, periods or {})
    opts = StateDictOptions(full_state_dict=True, broadcast_from_rank0=broadcast_from_rank0 and distributed)
    # Separately: set_state_dict skips the model when its dict is empty (as on ranks > 0 with
    # broadcast_from_rank0), and rank 0 would then wait for them in the model broadcast.
    # torch replaces entries of the dicts it is given (rank 0's tensors become DTensors): pass copies.
    set_model_state_dict(model, _copy_structure(state_dict.get(MODEL_KEY, {})), options=opts)
    osd = _copy_structure(state_dict.get(OPTIM_KEY, {}))
    for g, mine in zip(osd.get("param_groups", []), optimizer.param_groups):
        for k, v in mine.items():  # hyperparameters the saved dict lacks (options added since) keep ours
            if k not in ("params", "param_names") and k not in g:
                g[k] = v
    set_optimizer_state_dict(model, optimizer, osd, options=opts)
    _finish_load(optimizer, names)
