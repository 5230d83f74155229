"""Loading, copying and pickling :class:`gefen_dist.Gefen`.

``load_state_dict`` (:func:`load`), following ``torch.optim.Optimizer``'s contract:

1. the load-state-dict **pre hooks** run first, on a shallow copy of the dict, and what they
   return (or change) is what is loaded;
2. everything is **validated before anything changes** (param groups and their hyperparameters,
   the ``second_moment`` of each group against this optimizer's, every per-parameter entry: its
   keys for the parameter's kind, shapes, dtypes); an error leaves the optimizer as it was and
   names the parameter, the key and the fix;
3. the state is built **without torch's cast** (the base class casts every floating state tensor
   to the parameter dtype: uint8 indices would become fp32, 4 B/param, and be cast back): each
   tensor is moved to its parameter's device keeping its dtype, so a load on the same device
   allocates nothing, and one to another device allocates the state's own size;
4. the **post hooks** run last, and see (and may change) Gefen's final state.

Param groups of an older state dict that lack a key this version has (``second_moment``,
``row_blocks``) are filled from this optimizer's group, with a warning. A ``torch.optim.AdamW``
state dict loads into tensors Gefen keeps exact (same keys; ``step`` as AdamW keeps it), and its
quantized tensors are warm-started from their moments (:mod:`gefen_dist.optim.adamw_import`: periods
and codebook learned from ``exp_avg_sq`` and ``exp_avg``, the state quantized).

``copy.deepcopy`` and ``pickle`` (:func:`getstate`, :func:`setstate`, :func:`deepcopy`) keep every
attribute (``fused``, ``small_threshold``, ``nonfinite``, the codebook, ``skipped_steps``, ...)
but not the process group: a deep copy shares the original's, an unpickled optimizer re-derives
it (WORLD when ``torch.distributed`` is initialised, else single process).
"""
from __future__ import annotations

import copy
import logging
import math
import numbers
from collections import defaultdict
from typing import Any, Dict

import torch
from torch.optim import Optimizer

from ..core.periods import row_slab
from ..engine.layout import (FEW_ROWS, few_rows, global_shape, is_dtensor, like_param, local_tensor, one_element_rows,
                             piece_of)
from ..engine.state import (MODE_EXACT, MODE_FACTORED, codebook_size_of, MODE_ROWS8, MODE_SHARED, MODE_SPAN, SPAN_MODES, StateSpec, fixed_period, mode_of_saved,
                            narrow_layouts_differ, narrow_rows_of, new_step, threshold_of)
from .adamw_import import import_adamw, is_adamw_entry, is_adamw_state

logger = logging.getLogger(__name__)

__all__ = ["load", "validate_entry", "getstate", "setstate", "deepcopy"]

_INT_KEYS = ("period", "scale_block", "learned")
# keys whose absence in an older checkpoint's param group is filled from this optimizer's group
NEWER_GROUP_KEYS = ("second_moment", "row_blocks", "col_blocks")


def _narrow_rows_matter(opt, group: dict, saved: str) -> bool:
    """Whether the ``narrow_rows`` a group was ``saved`` with and the live ``group``'s keep some
    tensor of the group differently (D16, D18)."""
    return narrow_layouts_differ([global_shape(p) for p in group["params"]], group["second_moment"], saved,
                                 narrow_rows_of(group), threshold_of(group, opt.small_threshold))


def _spec(opt, p: torch.Tensor, group: dict, period=None) -> StateSpec:
    return StateSpec.of(global_shape(p), second_moment=group["second_moment"],
                        small_threshold=threshold_of(group, opt.small_threshold),
                        period=period, row_blocks=group.get("row_blocks", "auto"),
                        narrow_rows=narrow_rows_of(group), col_blocks=group.get("col_blocks", 1))


_FIX = ("load a checkpoint saved by Gefen for the same model with the same small_threshold and "
        "second_moment, or do not load optimizer state for this model (start the optimizer fresh)")


def _check_entry_types(st: dict, keys, name: str) -> None:
    """Every key of a loaded entry holds what it should: ``step`` a number, the int keys ints >= 0,
    the others tensors."""
    for k in keys:
        v = st[k]
        if k == "step":
            if isinstance(v, torch.Tensor):
                if v.numel() != 1:
                    raise ValueError(f"checkpoint state 'step' of parameter {name!r} has shape {tuple(v.shape)}, "
                                     "expected a number")
            elif not (isinstance(v, numbers.Real) and not isinstance(v, bool)):
                raise ValueError(f"checkpoint state 'step' of parameter {name!r} is {v!r}, expected an int")
        elif k in _INT_KEYS:
            if isinstance(v, torch.Tensor):
                v = v.item() if v.numel() == 1 else v
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                raise ValueError(f"checkpoint state {k!r} of parameter {name!r} is {v!r}, expected an int >= 0; "
                                 f"{_FIX}")
        elif not isinstance(v, torch.Tensor):
            raise ValueError(f"checkpoint state {k!r} of parameter {name!r} is a {type(v).__name__}, expected a "
                             f"tensor; {_FIX}")


def _why_missing(st: dict, kind: str, exact: bool, shape, group: dict) -> str:
    """Why a loaded entry lacks keys of the tensor's spec (``kind``): the likeliest cause, named."""
    if not exact and {"exp_avg", "exp_avg_sq"} <= set(st):
        what = ("it holds exact moments (exp_avg, exp_avg_sq) in a checkpoint whose other tensors hold Gefen "
                "state (saved with another small_threshold?), but Gefen keeps this tensor quantized here. Build "
                "Gefen with the small_threshold the checkpoint was saved with. (A whole torch.optim.AdamW state "
                "dict, with no Gefen state in it, loads as a warm start: docs/checkpoints.md)")
    elif exact and one_element_rows(shape) and mode_of_saved(st) not in (None, MODE_EXACT):
        what = ("it holds quantized state, but its rows of one element keep exact AdamW state in this version "
                "of gefen_dist (quantized, each element kept its own fp32 scale and second moment: 9 B/param "
                "against AdamW's 8; docs/algorithm.md, D2), so the checkpoint's first and second moments of "
                "this tensor cannot be used here")
    elif {mode_of_saved(st), kind} & set(SPAN_MODES) and mode_of_saved(st) not in (None, MODE_EXACT):
        lay = {MODE_SPAN: "per block of rows (narrow_rows='span', or 'auto' for rows under 22 elements)",
               MODE_ROWS8: "per row in one-byte codes (narrow_rows='rows8')"}
        what = (f"it was saved {lay.get(mode_of_saved(st), 'per row in float32')} and is kept "
                f"{lay.get(kind, 'per row in float32')} here: build Gefen with the narrow_rows it was saved with "
                "(docs/algorithm.md, D16, D19)")
    else:
        what = (f"it was saved from a different model, optimizer, small_threshold or second_moment (this tensor "
                f"is {'exact' if exact else 'quantized, second_moment=' + repr(group['second_moment'])} here)")
    return what


def validate_entry(opt, p: torch.Tensor, st: dict, name: str, group: dict | None = None) -> None:
    """Raise a ``ValueError`` naming ``name``, the key and the fix when ``st`` is not a valid Gefen
    state for ``p`` (in ``group``, default: ``p``'s current group). ``st`` is not changed."""
    group = opt._group_of(p) if group is None else group
    shape = global_shape(p)
    if not isinstance(st, dict):
        raise ValueError(f"checkpoint state for parameter {name!r} is a {type(st).__name__}, not a dict of "
                         f"state tensors; {_FIX}")
    spec = _spec(opt, p, group)
    kind = spec.mode
    exact = spec.exact
    keys = spec.keys
    missing = [k for k in keys if k not in st]
    if missing:
        raise ValueError(f"checkpoint state for parameter {name!r} (shape {shape}) lacks {missing}: "
                         f"{_why_missing(st, kind, exact, shape, group)}; {_FIX}")
    _check_entry_types(st, keys, name)
    ref = st["exp_avg"] if exact else st["idx"]
    if tuple(ref.shape) != global_shape(p):
        raise ValueError(
            f"checkpoint state for parameter {name!r} has shape {tuple(ref.shape)} but the parameter "
            f"has shape {global_shape(p)}; the model changed since the checkpoint was saved"
        )
    if exact:
        for k in ("exp_avg", "exp_avg_sq"):
            if tuple(st[k].shape) != global_shape(p):
                raise ValueError(f"checkpoint state {k!r} of parameter {name!r} has shape {tuple(st[k].shape)}, "
                                 f"expected {global_shape(p)}; the model changed since the checkpoint was saved")
            if not st[k].is_floating_point():
                raise ValueError(f"checkpoint state {k!r} of parameter {name!r} has dtype {st[k].dtype}, "
                                 "expected a floating dtype (torch.float32)")
        return
    period = int(st["period"])
    if kind in SPAN_MODES and period != spec.geometry.period:
        raise ValueError(f"checkpoint state 'period' of parameter {name!r} is {period}; with narrow_rows="
                         f"{group.get('narrow_rows', 'auto')!r} its blocks hold {spec.geometry.period} elements (D16); "
                         f"{_FIX}")
    if kind not in SPAN_MODES and (period < 1 or int(math.prod(shape[1:])) % period):
        raise ValueError(f"checkpoint state 'period' of parameter {name!r} is {period}, which does not divide "
                         f"its rows of {int(math.prod(shape[1:]))} elements; {_FIX}")
    want = {k: ls for k, (ls, _, _, _) in _spec(opt, p, group, period).tensors(global_shape(p)).items()}
    factored = kind == "factored"
    if factored:
        slab = want["v_col"][-1]
        vc = tuple(st["v_col"].shape)
        if vc in ((slab,), (1, slab)) or (len(vc) == 2 and vc[1] == slab and vc[0] >= 1 and global_shape(p)[0] % vc[0] == 0):
            want["v_col"] = vc  # row blocks (D12): the state's own block count is kept
    for k in ("scale_code", "v_code") if kind == MODE_ROWS8 else ():
        if tuple(st[k].shape) != want[k] or st[k].dtype != torch.uint8:
            raise ValueError(f"checkpoint state {k!r} of parameter {name!r} has shape {tuple(st[k].shape)} and dtype "
                             f"{st[k].dtype}, expected {want[k]} torch.uint8 (D19); {_FIX}")
    vr = tuple(st["v_row"].shape) if factored else ()
    if factored and vr != want["v_row"] and len(vr) == 2 and vr[0] == want["v_row"][0]:
        raise ValueError(f"checkpoint state 'v_row' of parameter {name!r} has shape {vr}: {vr[1]} column block(s) "
                         f"(D21), where this optimizer's param group gives it {want['v_row'][1]} (col_blocks="
                         f"{group.get('col_blocks', 1)!r}). Build Gefen (or its param group) with col_blocks="
                         f"{vr[1] if vr[1] > 1 else 1}, the setting the checkpoint was saved with, or start the "
                         "optimizer fresh")
    for k in ("scale", "v_row", "v_col") if factored else ("scale", "v_blk", "v_col") if kind in SPAN_MODES else ("scale", "v"):
        if tuple(st[k].shape) != want[k]:
            raise ValueError(f"checkpoint state {k!r} of parameter {name!r} has shape "
                             f"{tuple(st[k].shape)}, expected {want[k]} for period {st['period']}")
        if st[k].dtype != torch.float32:
            raise ValueError(f"checkpoint state {k!r} of parameter {name!r} has dtype {st[k].dtype}, expected "
                             "torch.float32 (D5); was it cast on the way (e.g. model.half() on a state dict)?")
    if st["idx"].dtype != torch.uint8:
        raise ValueError(f"checkpoint state 'idx' of {name!r} has dtype {st['idx'].dtype}, expected "
                         "torch.uint8 (was the state dict passed through torch.optim.Optimizer."
                         "load_state_dict, which casts state to the parameter dtype?)")
    cb, k = st["codebook"], codebook_size_of(opt)
    if tuple(cb.shape) != (k,) or not cb.is_floating_point():
        raise ValueError(f"checkpoint state 'codebook' of parameter {name!r} has shape {tuple(cb.shape)} and "
                         f"dtype {cb.dtype}, expected {k} floats (second_moment='nibbles' keeps 16, the others 256); "
                         f"{_FIX}")


def continue_few_rows(opt, p: torch.Tensor, saved: Any, group: dict, name: str) -> Any:
    """D15 withdrawn: a shared entry that one of D15's versions saved for a tensor of few rows in a
    factored group continues as factored state. ``idx`` and ``scale`` carry over (both modes have the
    shape period and its scale block); ``v_row`` of a row is the mean of its v-blocks' ``v`` (every
    v-block lies in one row) and ``v_col`` is flat at the tensor's mean ``v``, so the factored
    estimate starts at each row's shared ``v`` and learns its column profile from the next gradients.
    A new dict (``saved`` is not changed); any other entry is returned as is (:func:`validate_entry`
    judges it). A sharded (DTensor) entry is refused: its replicated ``v_col`` would need the mean of
    every rank's rows."""
    if not isinstance(saved, dict) or mode_of_saved(saved) != MODE_SHARED:
        return saved
    shape = global_shape(p)
    spec = _spec(opt, p, group)
    if spec.exact or spec.mode != MODE_FACTORED or not few_rows(shape) or not isinstance(saved.get("v"), torch.Tensor):
        return saved
    per = saved.get("period")
    per = int(per.item()) if isinstance(per, torch.Tensor) and per.numel() == 1 else per
    S = row_slab(shape)
    if per != fixed_period(shape, MODE_FACTORED) or S % per or saved["v"].numel() != int(shape[0]) * (S // per):
        return saved
    if is_dtensor(saved["v"]):
        raise ValueError(
            f"checkpoint entry of {name!r} (shape {tuple(shape)}, {int(shape[0])} rows) holds a shared second moment "
            f"that a gefen_dist version of D15 (withdrawn) kept for tensors of fewer than {FEW_ROWS} rows; this "
            "version keeps them factored. Load it once from a full (unsharded) optimizer state dict, which "
            "continues the entry as factored state, and save it again")
    v = saved["v"].detach().reshape(int(shape[0]), S // per).float()
    out = {k: val for k, val in saved.items() if k != "v"}
    out["v_row"] = v.mean(dim=1, keepdim=True)
    vc = ((spec.row_blocks,) if spec.row_blocks > 1 else ()) + (S,)
    out["v_col"] = torch.full(vc, float(v.mean()), dtype=torch.float32, device=v.device)
    logger.info("Gefen.load_state_dict: %r (shape %s, %d rows) was saved with a shared second moment, as tensors of "
                "fewer than %d rows were kept from 2026-12-02 to 2026-12-05 (D15, withdrawn); continued as factored "
                "state from each row's mean v", name, tuple(shape), int(shape[0]), FEW_ROWS)
    return out


def _groups(opt, saved_groups, from_adamw: bool = False) -> list:
    """The param groups to install: the saved hyperparameters (deep-copied) with this optimizer's
    parameters; validated; newer keys filled in (``from_adamw``: a ``torch.optim.AdamW`` state dict,
    whose groups take this optimizer's Gefen settings). Raises before anything changes."""
    from .validation import validate_group_keys, validate_hparams

    out = []
    filled = {}
    for i, (sg, g) in enumerate(zip(saved_groups, opt.param_groups)):
        if not isinstance(sg, dict) or "params" not in sg:
            raise ValueError(f"loaded state dict's param group {i} is not a dict with 'params'; pass the dict "
                             "returned by optimizer.state_dict()")
        ng = copy.deepcopy({k: v for k, v in sg.items() if k != "params"})
        for k in ("lr", "betas", "eps", "weight_decay"):
            if k not in ng:
                raise ValueError(f"loaded state dict's param group {i} lacks {k!r}; pass the dict returned by "
                                 "optimizer.state_dict()")
        for k in NEWER_GROUP_KEYS:
            if k not in ng:
                ng[k] = g.get(k, opt.defaults.get(k))
                filled.setdefault(k, []).append(i)
        if ng["second_moment"] != g["second_moment"]:
            raise ValueError(
                f"loaded state dict's param group {i} was saved with second_moment={ng['second_moment']!r}, but "
                f"this optimizer's group {i} uses second_moment={g['second_moment']!r}; the state layouts differ. "
                f"Build Gefen with second_moment={ng['second_moment']!r} for that group to resume this "
                "checkpoint, or start the optimizer fresh to switch modes"
            )
        # a group saved before D16 has no narrow_rows: its tensors of narrow rows were kept per row
        saved_nr, nr = ng.setdefault("narrow_rows", narrow_rows_of(g) if from_adamw else "rows"), narrow_rows_of(g)
        if saved_nr != nr and not _narrow_rows_matter(opt, g, saved_nr):
            ng["narrow_rows"] = nr  # both settings keep every tensor of the group alike: this group's stays
        elif saved_nr != nr:
            raise ValueError(
                f"loaded state dict's param group {i} was saved with narrow_rows={saved_nr!r}, but this optimizer's "
                f"group {i} uses narrow_rows={nr!r}; the state layouts of tensors with narrow rows differ (D16, D18). "
                f"Build Gefen with narrow_rows={saved_nr!r} for that group to resume this checkpoint"
            )
        where = f" in loaded param group {i}"
        validate_hparams(ng["lr"], ng["betas"], ng["eps"], ng["weight_decay"], where)
        rejected = {k: ng[k] for k in ("nonfinite", "process_group") if k in ng}
        if rejected:
            validate_group_keys(rejected, i)
        unsupported = [k for k in ("maximize", "amsgrad", "differentiable", "capturable") if ng.get(k)]
        if unsupported:
            raise ValueError(f"loaded state dict's param group {i} sets {unsupported} (a torch.optim.AdamW/Adam "
                             "checkpoint?), which Gefen does not implement; load a Gefen checkpoint, or start the "
                             "optimizer fresh")
        # `fused` picks an implementation of the running code, not state: the current group's value
        # stays (torch.optim.AdamW stores its own `fused` in every group, often None)
        # the same for a group's small_threshold: the entries are checked against this group's layouts
        for k in ("fused", "small_threshold"):
            ng.pop(k, None)
            if k in g:
                ng[k] = g[k]
        ng["betas"] = tuple(ng["betas"])
        ng["params"] = g["params"]
        if "param_names" in g and "param_names" not in ng:
            ng["param_names"] = g["param_names"]
        out.append(ng)
    for k, idx in (filled.items() if not from_adamw else ()):
        logger.warning("Gefen.load_state_dict: param groups %s of the loaded state dict lack %r (saved by an "
                       "older version); using this optimizer's value(s) %s", idx, k,
                       [out[i][k] for i in idx])
    return out


def _shard_rows(opt, p: torch.Tensor, group: dict):
    """For a DTensor parameter (FSDP2): ``(first row, end row, keys)`` of this rank's rows and the state
    keys that are sharded like the parameter, so that a full (unsharded) entry loads as this rank's
    piece, as ``set_optimizer_state_dict`` would shard it; None for a plain parameter."""
    if not is_dtensor(p):
        return None
    slab = row_slab(global_shape(p))
    pc = piece_of(p, opt._comm.rank, True)
    r0 = pc.start // slab if slab else 0
    spec = _spec(opt, p, group)
    sharded = {k for k, (_, _, _, sh) in spec.tensors(tuple(local_tensor(p).shape)).items() if sh}
    return r0, r0 + int(local_tensor(p).shape[0]) if local_tensor(p).dim() else r0, sharded


def load(opt, state_dict: Dict[str, Any]) -> None:
    """``Gefen.load_state_dict``: pre hooks, validation of everything, the state without a cast,
    then post hooks (module docstring)."""
    from .gefen import saved_param_map

    if not isinstance(state_dict, dict) or "state" not in state_dict or "param_groups" not in state_dict:
        raise ValueError("Gefen.load_state_dict expects the dict returned by optimizer.state_dict() (keys 'state' "
                         f"and 'param_groups'), got {type(state_dict).__name__}"
                         f"{' with keys ' + repr(sorted(map(str, state_dict))) if isinstance(state_dict, dict) else ''}")
    state_dict = state_dict.copy()  # shallow, as torch does: hooks may replace entries
    for pre_hook in opt._optimizer_load_state_dict_pre_hooks.values():
        res = pre_hook(opt, state_dict)
        if res is not None:
            state_dict = res
    id_map = saved_param_map(opt, state_dict)
    from_adamw = is_adamw_state(state_dict["state"])  # a torch.optim.AdamW state dict: a warm start
    groups = _groups(opt, state_dict["param_groups"], from_adamw)
    group_of = {}
    for ng in groups:
        for p in ng["params"]:
            group_of[id(p)] = ng
    names = opt._names()
    new_state: Dict[Any, Any] = defaultdict(dict)
    cb = None
    imports = []  # (param, AdamW entry, group, name) of quantized tensors: adamw_import
    for k, saved in state_dict["state"].items():
        if k not in id_map:
            new_state[k] = saved  # state not assigned to a parameter is kept as is (as torch does)
            continue
        p = id_map[k]
        if from_adamw and is_adamw_entry(saved) and not _spec(opt, p, group_of[id(p)]).exact:
            imports.append((p, saved, group_of[id(p)], names[id(p)]))  # a warm start, below
            continue
        saved = continue_few_rows(opt, p, saved, group_of[id(p)], names[id(p)])
        validate_entry(opt, p, saved, names[id(p)], group_of[id(p)])
        st = {}
        rows = _shard_rows(opt, p, group_of[id(p)])  # a full entry's rows this rank keeps (FSDP2), or None
        for key, val in saved.items():
            if rows is not None and key in rows[2] and isinstance(val, torch.Tensor) and not is_dtensor(val):
                val = like_param(val.detach()[rows[0]:rows[1]].to(local_tensor(p).device), p, tuple(val.shape))
            if isinstance(val, torch.Tensor):
                if key == "step":
                    val = new_step(val.item())  # as AdamW keeps it: 0-dim float32 on the CPU
                elif key in _INT_KEYS and val.numel() == 1:
                    val = int(val.item())
                elif key in ("exp_avg", "exp_avg_sq") and val.dtype != torch.float32:
                    val = val.to(device=local_tensor(p).device, dtype=torch.float32)  # D5: fp32 exact state
                else:
                    val = val.to(device=local_tensor(p).device)  # keeps the dtype: no copy on the same device
            elif key == "step":
                val = new_step(val)  # a number (older checkpoints): the tensor AdamW keeps
            st[key] = val
        if "codebook" in st and cb is None and float(st["codebook"][0]) == -1.0:
            cb = st["codebook"]
        new_state[p] = st
    if imports:
        imported, cb = import_adamw(opt, imports, lambda p, g, per: _spec(opt, p, g, per))
        new_state.update(imported)  # (cb None: no tensor had moments; they learn at their first gradient)
    # ---- everything validated: commit
    opt.codebook = cb.to(torch.float32) if cb is not None else None
    for p, st in new_state.items():
        if isinstance(p, torch.Tensor) and "codebook" in st:
            st["codebook"] = opt._codebook_for(local_tensor(st["idx"]).device)
    Optimizer.__setstate__(opt, {"state": new_state, "param_groups": groups})
    opt._cuda_batch, opt._cuda_batches, opt._cuda_plan = None, [], None
    opt._modes = None
    opt._agreement_checked = False
    for post_hook in opt._optimizer_load_state_dict_post_hooks.values():
        post_hook(opt)


# ------------------------------------------------------------------------ deepcopy / pickle
_HOOKS = ("_optimizer_step_pre_hooks", "_optimizer_step_post_hooks", "_optimizer_state_dict_pre_hooks",
          "_optimizer_state_dict_post_hooks", "_optimizer_load_state_dict_pre_hooks",
          "_optimizer_load_state_dict_post_hooks")
# caches rebuilt when next needed: views of the state (_cuda_batch, _cuda_batches, _cuda_plan), the
# mode table keyed by parameter ids (_modes; a copy has other parameters), the ids of the parameters
# (_own_ids), the groups by parameter id (_groups_by_id)
_TRANSIENT = ("_cuda_batch", "_cuda_batches", "_cuda_plan", "_modes", "_own_ids", "_groups_by_id")


def getstate(opt) -> Dict[str, Any]:
    """Every instance attribute except the comm (a process group cannot be pickled), transient
    caches and the hooks (torch drops hooks in copies too)."""
    from ..engine.comm import ProcessGroupComm

    d = {k: v for k, v in opt.__dict__.items() if k not in _HOOKS and k not in _TRANSIENT and k != "_comm"}
    comm = opt.__dict__.get("_comm")
    if isinstance(comm, ProcessGroupComm):
        import torch.distributed as dist

        d["_comm_kind"] = "world" if comm.group is dist.group.WORLD else "group"
    else:
        d["_comm_kind"] = "local"
    return d


def setstate(opt, state: Dict[str, Any]) -> None:
    """Restore :func:`getstate`'s dict (or torch's partial ``{"state", "param_groups"}`` update)."""
    state = dict(state)
    kind = state.pop("_comm_kind", None)
    Optimizer.__setstate__(opt, state)
    if "_comm" not in opt.__dict__:
        from ..engine.comm import LocalComm, comm_for

        if kind == "group":
            logger.warning("Gefen: unpickled an optimizer built on a custom process group, which cannot be "
                           "pickled; it now agrees its periods and codebook over WORLD (or a single process). "
                           "Build a new Gefen with process_group=... if that is not what you want.")
        opt._comm = LocalComm() if kind in (None, "local") else comm_for(None)
    for k in _TRANSIENT:
        opt.__dict__.setdefault(k, None)


def deepcopy(opt, memo: Dict[int, Any]):
    """A deep copy of every attribute (state, param groups, codebook, settings); the comm (process
    group) is shared with the original."""
    cls = type(opt)
    new = cls.__new__(cls)
    memo[id(opt)] = new
    d = copy.deepcopy(getstate(opt), memo)
    d.pop("_comm_kind", None)
    d["_comm"] = opt.__dict__.get("_comm")
    setstate(new, d)
    return new
