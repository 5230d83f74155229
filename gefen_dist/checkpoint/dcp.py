"""DCP checkpoints of Gefen state: save / load (sharded, any world size), the plain-flow checks
(:func:`check_compatible`, :func:`prepare_for_load`) and full (consolidated) state dicts. The
package docstring (:mod:`gefen_dist.checkpoint`) says what needs help and why."""
from __future__ import annotations

import contextlib
import logging
import os
import shutil
import warnings
from typing import Any, Dict, Iterable, List, Optional

import torch

from ..core.periods import row_slab
from ..core.span import span_by_default
from ..engine.layout import FEW_ROWS, few_rows, global_shape, is_exact, local_tensor
from ..engine.state import MODE_EXACT, MODE_SHARED, mode_of_saved

from . import files as _files
from .files import (CheckpointCorruptError, recover_interrupted, temporary_path,  # noqa: F401
                    verify_dir)

logger = logging.getLogger(__name__)

MODEL_KEY = "model"
OPTIM_KEY = "optim"
EXTRA_KEY = "extra"

__all__ = [
    "prepare_for_load",
    "check_compatible",
    "CheckpointMismatchError",
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
        span = _span_period(optimizer, p)
        if is_exact(shape, thr) and not span:
            continue
        fqn = fqns.get(id(p))
        if span and fqn is not None:  # D16: the period is the block of rows, fixed by the shape
            if _find_key(sdm.keys(), fqn, "v_blk", key_prefix) is not None:
                out[fqn] = span
            continue
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


class CheckpointMismatchError(ValueError):
    """A DCP checkpoint's optimizer state does not fit this optimizer (saved with another
    ``second_moment``, ``small_threshold`` or ``row_blocks``, or for another model); the message
    names the checkpoint key, the option and the fix. Raised before anything is loaded."""


_LEAVES = ("idx", "scale", "v", "v_row", "v_blk", "v_col", "scale_code", "v_code", "exp_avg", "exp_avg_sq")


def _state_index(keys: Iterable[str], prefix: Optional[str]) -> Dict[str, Dict[str, str]]:
    """``{fqn: {leaf: key}}`` of the optimizer state tensors in checkpoint ``keys`` (under
    ``<prefix>.state.``, else under a bare ``state.``)."""
    keys = list(keys)
    for pre in ([f"{prefix}.state."] if prefix else []) + ["state."]:
        out: Dict[str, Dict[str, str]] = {}
        for k in keys:
            if k.startswith(pre) and "." in k[len(pre):]:
                fqn, leaf = k[len(pre):].rsplit(".", 1)
                if leaf in _LEAVES:
                    out.setdefault(fqn, {})[leaf] = k
        if out:
            return out
    return {}


def _saved_mode(leaves) -> str:
    """The mode a checkpoint's leaves were saved in (engine.state.mode_of_saved: a file has no spec;
    elementwise state is saved as shared state with period 1)."""
    return mode_of_saved(leaves) or "shared"


def _span_mismatch(fqn: str, gi: int, shape, key: str, was: str, mode: str) -> str:
    """The message of a tensor saved per block of rows and kept otherwise here, or the reverse (D16, D18)."""
    how = {"span": "per block of rows", "exact": "as exact AdamW state", "rows8": "per row in one-byte codes"}
    if was == "span":
        nr = "'auto' (the default) or 'span'" if span_by_default(shape) else "'span'"
    elif was == "rows8":
        nr = "'rows8'"
    else:
        nr = "'rows'"
    if "exact" in (was, mode):
        nr += " (or the small_threshold it was saved with)"
    return (f"checkpoint entry {key!r} holds the state of parameter {fqn!r} (shape {shape}) {how.get(was, 'per row')}, "
            f"but param group {gi} of this optimizer keeps it {how.get(mode, 'per row')}: the narrow_rows settings "
            f"differ (D16, D18, D19). Build Gefen (or that param group) with narrow_rows={nr}, the setting the checkpoint "
            "was saved with")


def _mismatch(fqn: str, gi: int, p, spec, thr: int, saved: Dict[str, str], size_of) -> Optional[str]:
    """Why the saved state ``saved`` (``{leaf: key}``, ``size_of(key)`` its shape) of ``fqn`` cannot
    load into ``spec``, or None."""
    mode = spec.mode if spec.mode != "elementwise" else "shared"
    was = _saved_mode(saved)
    shape, numel = global_shape(p), int(torch.Size(global_shape(p)).numel())
    key = next((saved[k] for k in ("v", "v_row", "v_col", "exp_avg", "idx") if k in saved), next(iter(saved.values())))
    if was == mode == "exact":
        got = size_of(key)
        return None if got == shape else (f"checkpoint entry {key!r} has shape {got}, parameter "
                                          f"{fqn!r} has shape {shape}: the model changed since the checkpoint was saved")
    if was != mode and {"span", "rows8"} & {was, mode}:
        return _span_mismatch(fqn, gi, shape, key, was, mode)
    if "exact" in (was, mode):
        held = "exact AdamW state" if was == "exact" else "quantized Gefen state"
        want = (f"small_threshold > {numel}" if was == "exact" else f"small_threshold <= {numel}")
        return (f"checkpoint entry {key!r} holds {held} for parameter {fqn!r} ({numel} elements, shape {shape}), "
                f"which this optimizer keeps {'quantized' if was == 'exact' else 'exact'} (small_threshold={thr}). "
                f"Build Gefen with the small_threshold the checkpoint was saved with ({want})")
    if was == "shared" and mode == "factored" and few_rows(shape):
        return (f"checkpoint entry {key!r} holds a shared second moment for parameter {fqn!r} (shape {shape}), "
                f"which has fewer than {FEW_ROWS} rows: it was saved by a version that kept a shared v for such "
                "tensors (D15, withdrawn: docs/algorithm.md); this version keeps them factored, so the plain DCP "
                "flow cannot load it. Load the checkpoint once through Gefen.load_state_dict (a full state dict: "
                "it continues the entry as factored state) and save it again")

    if was != mode:
        return (f"checkpoint entry {key!r} holds a {was} second moment for parameter {fqn!r}, but param group {gi} "
                f"of this optimizer has second_moment={spec.mode!r}. Build Gefen (or that param group) with "
                f"second_moment={was!r}, the setting the checkpoint was saved with")
    # (row blocks, D12: v_col [G, slab]; column blocks, D21: v_row [rows, K])
    for key, dim, have, option, what in (("v_col", 0, spec.row_blocks, "row_blocks", "column profile(s)"),
                                         ("v_row", 1, spec.col_blocks, "col_blocks", "column block(s)")):
        if mode == "factored" and saved.get(key) is not None:
            got = size_of(saved[key])
            blocks = got[dim] if len(got) == 2 else 1
            if blocks != have:
                return (f"checkpoint entry {saved[key]!r} (shape {got}) keeps {blocks} {what} for parameter {fqn!r}, "
                        f"this optimizer {have} ({option}). Build Gefen (or its param group {gi}) with "
                        f"{option}={blocks}, or the {option} the checkpoint was saved with")
    return None


def check_compatible(model: torch.nn.Module, optimizer: torch.optim.Optimizer, checkpoint_id: Any,
                     *, key_prefix: Optional[str] = OPTIM_KEY) -> None:
    """Raise :class:`CheckpointMismatchError` (a ``ValueError``) when the Gefen state in DCP
    checkpoint ``checkpoint_id`` cannot load into ``optimizer``: a tensor saved with another
    ``second_moment``, ``small_threshold``, ``row_blocks`` or ``col_blocks``, or missing from the checkpoint.
    The message names the checkpoint key, the option and the fix. Reads only the metadata; no
    collectives; changes nothing. :func:`prepare_for_load` and :func:`load` call it; call it (or
    :func:`prepare_for_load`) before a hand-written ``dcp.load``, which otherwise reports such a
    mismatch as DCP's ``CheckpointException`` (a ``BaseException``: ``except Exception`` misses it)."""
    if not _is_gefen(optimizer):
        raise TypeError(f"check_compatible expects a gefen_dist.Gefen optimizer, got {type(optimizer).__name__}")
    sdm = _reader(checkpoint_id).read_metadata().state_dict_metadata
    index = _state_index(sdm.keys(), key_prefix)
    fqns, thr = param_fqns(model), _small_threshold(optimizer)
    if not index:
        raise CheckpointMismatchError(
            f"checkpoint {checkpoint_id!r} holds no optimizer state under {key_prefix!r} (keys "
            f"'{key_prefix}.state.<fqn>.<leaf>'; it has {sorted(sdm)[:4]} ...). Pass key_prefix= with the key the "
            "optimizer state dict was saved under, or load a checkpoint that has optimizer state")
    for gi, g in enumerate(optimizer.param_groups):
        for p in g["params"]:
            fqn = fqns.get(id(p))
            if not p.requires_grad or fqn is None:
                continue
            if fqn not in index:
                raise CheckpointMismatchError(
                    f"checkpoint {checkpoint_id!r} holds no optimizer state for parameter {fqn!r} (no "
                    f"'{key_prefix}.state.{fqn}.*' entry): the model or its parameter names changed since it was "
                    "saved. Load it into the model it was saved from")
            why = _mismatch(fqn, gi, p, optimizer._spec(p), thr, index[fqn],
                            lambda k: tuple(int(s) for s in sdm[k].size))
            if why:
                raise CheckpointMismatchError(why + f" (checkpoint {checkpoint_id!r}). Nothing was loaded.")


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
        if st and st.get("period") != per:  # exact state has no period: dropped as well
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
    check_compatible(model, optimizer, checkpoint_id, key_prefix=key_prefix)
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
         extra: Optional[Dict[str, Any]] = None, *, options=None, process_group=None,
         files: Optional[Dict[str, Any]] = None) -> None:
    """Save model and optimizer (sharded, one file per rank) with DCP, on every rank.

    The checkpoint holds ``{"model": ..., "optim": ..., "extra": extra}``. ``extra`` may hold
    tensors and picklable Python values (step counters, RNG states, ...). Before the first step
    Gefen's state is allocated as placeholders (``learned=0``), so DCP's zero-grad ``step()`` is
    not run and no degenerate codebook is saved.

    When ``checkpoint_id`` is a path the save is atomic: every rank writes into
    ``.<name>.tmp-<pid of rank 0>`` next to it, rank 0 adds ``files`` (``{name: object}``,
    ``torch.save``d into the directory) and a manifest of sizes and SHA-256s
    (``gefen_manifest.json``, checked by :func:`load`), fsyncs, and puts the directory in place of
    ``checkpoint_id`` (the whole directory is replaced). A process killed mid-save leaves the
    previous checkpoint intact. Needs a file system shared by all ranks, as DCP does. A
    ``StorageWriter`` ``checkpoint_id`` is passed to DCP as is (no atomicity, no ``files``).
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    _ensure_state(optimizer)
    msd, osd = get_state_dict(model, optimizer, options=options)
    sd: Dict[str, Any] = {MODEL_KEY: msd, OPTIM_KEY: osd}
    if extra is not None:
        sd[EXTRA_KEY] = extra
    if not isinstance(checkpoint_id, (str, os.PathLike)):
        if files:
            raise ValueError("save(files=...) needs a directory path as checkpoint_id")
        with _single_process_quiet():
            dcp.save(sd, checkpoint_id=checkpoint_id, process_group=process_group)
        return
    path = os.path.abspath(os.fspath(checkpoint_id)).rstrip(os.sep)
    rank = _group_rank(process_group)
    tmp = _bcast_obj(temporary_path(path) if rank == 0 else None, process_group)
    if rank == 0:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        recover_interrupted(path)
        shutil.rmtree(tmp, ignore_errors=True)
    _barrier(process_group)
    with _single_process_quiet():
        dcp.save(sd, checkpoint_id=tmp, process_group=process_group)
    err = None
    if rank == 0:
        try:
            for name, obj in (files or {}).items():
                _files.atomic_save(obj, os.path.join(tmp, name))
            _files._write_manifest(tmp)
            _files._commit_dir(tmp, path)
        except Exception as e:  # noqa: BLE001 - every rank raises it below
            shutil.rmtree(tmp, ignore_errors=True)
            err = f"{type(e).__name__}: {e}"
    err = _bcast_obj(err, process_group)  # also the barrier: the checkpoint is in place after it
    if err is not None:
        raise RuntimeError(f"saving checkpoint {path!r} failed on rank 0 ({err}); the previous checkpoint, if "
                           "any, is unchanged")


def _verify_all_ranks(checkpoint_id, process_group) -> None:
    """Rank 0 checks the manifest (one read of the checkpoint); every rank raises on damage."""
    rank = _group_rank(process_group)
    err = None
    if rank == 0:
        try:
            recover_interrupted(os.fspath(checkpoint_id))
            if not os.path.isdir(checkpoint_id):
                raise FileNotFoundError(f"no checkpoint directory {os.fspath(checkpoint_id)!r}")
            verify_dir(checkpoint_id)
        except (CheckpointCorruptError, FileNotFoundError) as e:
            err = (type(e).__name__, str(e))
    err = _bcast_obj(err, process_group)
    if err is not None:
        raise (FileNotFoundError if err[0] == "FileNotFoundError" else CheckpointCorruptError)(err[1])


def load(model: torch.nn.Module, optimizer: torch.optim.Optimizer, checkpoint_id: Any,
         extra: Optional[Dict[str, Any]] = None, *, options=None, process_group=None,
         verify: bool = True) -> Optional[Dict[str, Any]]:
    """Load a checkpoint written by :func:`save` (or any DCP checkpoint with ``model``/``optim``
    keys) into ``model`` and ``optimizer`` at any world size and parallelism (FSDP2, HSDP, DDP,
    single process), on every rank.

    ``extra``: a dict to fill in place (its keys select what to read); when ``None`` and the
    checkpoint has an ``extra`` entry, it is read whole on every rank. Returns the extra dict
    (or ``None``).

    A path ``checkpoint_id`` with a manifest (written by :func:`save`) is checked first (``verify``):
    a missing, truncated or corrupted file raises :class:`CheckpointCorruptError` naming it.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict, set_state_dict

    if verify and isinstance(checkpoint_id, (str, os.PathLike)):
        _verify_all_ranks(checkpoint_id, process_group)

    names = _param_names(optimizer)
    from_adamw = _is_gefen(optimizer) and _holds_adamw_state(model, optimizer, checkpoint_id)
    if from_adamw:
        osd = _adamw_template(model, optimizer)  # a warm start from AdamW's moments (optim/adamw_import.py)
        msd = get_model_state_dict(model, options=options)
    else:
        if _is_gefen(optimizer):
            prepare_for_load(model, optimizer, checkpoint_id)
        msd, osd = get_state_dict(model, optimizer, options=options)
    sd: Dict[str, Any] = {MODEL_KEY: msd, OPTIM_KEY: osd}
    if extra is not None:
        sd[EXTRA_KEY] = extra
    kept = _drop_unsaved_group_keys(osd, checkpoint_id, expected=from_adamw)
    with _single_process_quiet(), _dcp_errors(checkpoint_id):
        dcp.load(sd, checkpoint_id=checkpoint_id, process_group=process_group)
    for g, missing in zip(osd.get("param_groups", []), kept):
        g.update(missing)
    set_state_dict(model, optimizer, model_state_dict=sd[MODEL_KEY], optim_state_dict=sd[OPTIM_KEY],
                   options=options)
    _finish_load(optimizer, names)
    if extra is not None:
        return sd[EXTRA_KEY]
    return _read_extra(checkpoint_id, process_group)


def _holds_adamw_state(model, optimizer, checkpoint_id, key_prefix: str = OPTIM_KEY) -> bool:
    """Whether the checkpoint's optimizer state is a ``torch.optim.AdamW`` one (AdamW's moments, no
    Gefen state) with moments for some tensor Gefen quantizes here. Refuses amsgrad's third moment."""
    keys = list(_reader(checkpoint_id).read_metadata().state_dict_metadata)
    index = _state_index(keys, key_prefix)
    if not index or any(mode_of_saved(leaves) not in (None, MODE_EXACT) for leaves in index.values()):
        return False
    if any(k.endswith(".max_exp_avg_sq") for k in keys):
        raise CheckpointMismatchError(f"checkpoint {checkpoint_id!r} holds AdamW state with amsgrad (max_exp_avg_sq), "
                                      "which Gefen does not implement; nothing was loaded")
    fqns = param_fqns(model)
    return any(not optimizer._spec(p).exact and fqns.get(id(p)) in index for p in _optimizer_params(optimizer))


def _adamw_template(model, optimizer) -> Dict[str, Any]:
    """A ``get_optimizer_state_dict``-style template (keyed by FQN) of AdamW's state for every trainable
    parameter of ``optimizer``, like the parameters (DTensors under FSDP2): what ``dcp.load`` fills from an
    AdamW checkpoint before ``set_state_dict`` hands it to ``Gefen.load_state_dict``."""
    fqns = param_fqns(model)
    state, groups = {}, []
    for g in optimizer.param_groups:
        names = []
        for p in g["params"]:
            fqn = fqns[id(p)]
            names.append(fqn)
            if p.requires_grad:
                state[fqn] = {"step": torch.tensor(0.0), "exp_avg": torch.zeros_like(p.detach()),
                              "exp_avg_sq": torch.zeros_like(p.detach())}
        groups.append({**{k: v for k, v in g.items() if k not in ("params", "param_names")}, "params": names})
    return {"state": state, "param_groups": groups}


@contextlib.contextmanager
def _dcp_errors(checkpoint_id):
    """DCP's ``CheckpointException`` (a ``BaseException``, raised on every rank) as a
    :class:`CheckpointMismatchError` naming what each rank reported."""
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        yield
    except CheckpointException as e:
        seen: List[str] = []
        for exc, _ in e.failures.values():
            msg = f"{type(exc).__name__}: {str(exc).strip()[:300]}"
            if msg not in seen:
                seen.append(msg)
        raise CheckpointMismatchError(
            f"torch.distributed.checkpoint.load of {checkpoint_id!r} failed on rank(s) {sorted(e.failures)}: "
            f"{'; '.join(seen[:3])}. The checkpoint does not fit this model and optimizer (parameter names or "
            "shapes, or Gefen options: gefen_dist.checkpoint.check_compatible names the option). Load it with the "
            "model and optimizer options it was saved with") from e


def _drop_unsaved_group_keys(osd: Dict[str, Any], checkpoint_id, expected: bool = False) -> List[Dict[str, Any]]:
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
        if missing:  # (expected: an AdamW checkpoint, which has no Gefen settings to keep)
            logger.log(logging.INFO if expected else logging.WARNING, "checkpoint %s has no %s for param group %d: "
                       "keeping this optimizer's values %s", checkpoint_id, sorted(missing), i, missing)
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


def _span_period(optimizer, p) -> int:
    """The period (block of rows) of ``p`` when ``optimizer`` keeps its state per block of rows
    (D16, ``narrow_rows="span"``) or in row codes against blocks of rows (D19, ``"rows8"``), else 0."""
    mode = getattr(optimizer, "_mode", None)
    if mode is None or mode(p) not in ("span", "rows8"):
        return 0
    return int(optimizer._spec(p).geometry.period)


def _periods_from_full(model, optimizer, osd: Dict[str, Any]) -> Dict[str, int]:
    thr = _small_threshold(optimizer)
    fqns = param_fqns(model)
    state = osd.get("state", {})
    out = {}
    for p in _optimizer_params(optimizer):
        fqn = fqns.get(id(p))
        shape = global_shape(p)
        span = _span_period(optimizer, p)
        if span and fqn in state and "v_blk" in state[fqn]:
            out[fqn] = span
            continue
        if fqn is None or is_exact(shape, thr) or fqn not in state:
            continue
        leaf = "v" if mode_of_saved(state[fqn]) == MODE_SHARED else "scale"  # see saved_periods
        if leaf not in state[fqn]:
            continue
        cols = int(state[fqn][leaf].shape[-1])
        slab = row_slab(shape)
        if cols <= 0 or slab % cols:
            raise ValueError(f"state {leaf!r} of {fqn!r} has shape {tuple(state[fqn][leaf].shape)}, which does not "
                             f"fit parameter shape {shape}")
        out[fqn] = slab // cols
    return out


def _check_full(model, optimizer, osd: Dict[str, Any]) -> Optional[str]:
    """:func:`check_compatible` for a consolidated optimizer state dict: the message, or None."""
    if not _is_gefen(optimizer) or not osd:
        return None
    state, fqns, thr = osd.get("state", {}), param_fqns(model), _small_threshold(optimizer)
    for gi, g in enumerate(optimizer.param_groups):
        for p in g["params"]:
            fqn = fqns.get(id(p))
            if not p.requires_grad or fqn is None:
                continue
            st = state.get(fqn)
            if not isinstance(st, dict):
                return (f"the full state dict holds no optimizer state for parameter {fqn!r} (no state[{fqn!r}]): the "
                        "model or its parameter names changed since it was saved. Load it into the model it was "
                        "saved from. Nothing was loaded.")
            saved = {leaf: f"{OPTIM_KEY}.state.{fqn}.{leaf}" for leaf in _LEAVES if leaf in st}
            why = saved and _mismatch(fqn, gi, p, optimizer._spec(p), thr, saved,
                                      lambda k: tuple(int(s) for s in st[k.rsplit(".", 1)[1]].shape))
            if why:
                return why + " (full state dict). Nothing was loaded."
    return None


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
    passes the full dict. A dict saved with other Gefen options (``second_moment``,
    ``small_threshold``, ``row_blocks``) raises :class:`CheckpointMismatchError` on every rank, as
    :func:`check_compatible` does, before anything changes.
    """
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, set_model_state_dict,
                                                         set_optimizer_state_dict)

    state_dict = state_dict or {}
    distributed = dist.is_available() and dist.is_initialized()
    rank = dist.get_rank() if distributed else 0
    periods = why = None
    if rank == 0 or not broadcast_from_rank0:
        why = _check_full(model, optimizer, state_dict.get(OPTIM_KEY, {}))
        periods = None if why else _periods_from_full(model, optimizer, state_dict.get(OPTIM_KEY, {}))
    if distributed and broadcast_from_rank0:
        box = [(periods, why)]
        dist.broadcast_object_list(box, src=0)
        periods, why = box[0]
    if why:  # on every rank: rank 0's check travels with the periods
        raise CheckpointMismatchError(why)
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


def _bcast_obj(obj, process_group):
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return obj
    box = [obj]
    src = dist.get_global_rank(process_group, 0) if process_group is not None else 0
    dist.broadcast_object_list(box, src=src, group=process_group)
    return box[0]


def _group_rank(process_group) -> int:
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return 0
    return dist.get_rank(process_group)


def _barrier(process_group) -> None:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier(group=process_group)
