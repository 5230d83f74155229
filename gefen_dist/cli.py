"""``gefen-dist``: command-line tools.

* ``gefen-dist plan``: per-rank memory of AdamW vs Gefen for a model and a parallel strategy
  (logic in :mod:`gefen_dist.plan`).
* ``gefen-dist inspect CHECKPOINT``: what a Gefen checkpoint holds (a ``torch.save``d optimizer
  state dict of ``Gefen``/``ZeroGefen``, a ``torch.distributed.checkpoint`` directory, or a
  DeepSpeed checkpoint directory).
* ``gefen-dist ds-to-universal CKPT_DIR OUT_DIR [--tag TAG]``: a Gefen DeepSpeed checkpoint in
  DeepSpeed's universal format (logic in :mod:`gefen_dist.integrations.ds_universal`).

Run ``gefen-dist --help`` / ``python -m gefen_dist.cli --help``.
"""
from __future__ import annotations

import argparse
import glob
import json
import math
import os
import re
import sys
from typing import Any, Dict, List, Optional, Sequence

from . import plan as _plan

__all__ = ["main", "inspect_checkpoint", "render_inspect", "CheckpointError"]


class CheckpointError(ValueError):
    """The path is not a readable Gefen checkpoint (the message says why and what to do)."""


# ============================================================================ plan
def _col_blocks_arg(text: str):
    """``--col-blocks``: ``"auto"`` or a positive int (D21)."""
    if text == "auto":
        return text
    try:
        k = int(text)
    except ValueError:
        k = 0
    if k < 1:
        raise ValueError(f"--col-blocks {text!r}: give 'auto' or a positive int (1: one row statistic per row)")
    return k


def _cmd_plan(args) -> int:
    kwargs = json.loads(args.model_kwargs) if args.model_kwargs else None
    est = _plan.load_model_estimate(params=args.params, config=args.config, model=args.model, model_kwargs=kwargs,
                                    small_threshold=args.small_threshold, second_moment=args.second_moment,
                                    col_blocks=_col_blocks_arg(args.col_blocks))
    dev = _plan.parse_bytes(args.device_memory) if args.device_memory else None
    act = _plan.parse_bytes(args.activation_bytes_per_sample) if args.activation_bytes_per_sample else None
    if act and dev is None:
        raise ValueError("--activation-bytes-per-sample needs --device-memory")
    p = _plan.plan(est, args.strategy, args.world_size, args.precision, dev, act, _plan.parse_bytes(args.reserve))
    if args.json:
        if args.per_tensor:
            p["per_tensor"] = [dict(t, shape=list(t["shape"])) for t in est.tensors]
        print(json.dumps(p, indent=1))
    else:
        print(_plan.render_plan(p, est, per_tensor=args.per_tensor))
    return 0


# ============================================================================ inspect
class _Stub:
    """Stand-in for DeepSpeed objects pickled into its optimizer files (loss scaler, fragment
    addresses): lets ``torch.load(weights_only=True)`` read them without importing deepspeed."""

    def __init__(self, *a, **k):
        self.args = a

    def __setstate__(self, state):
        self.state = state


def _enum_value(*a):
    return a[0] if a else None


_DS_SAFE = [(_Stub, "deepspeed.runtime.fp16.loss_scaler.LossScaler"),
            (_Stub, "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler"),
            (_enum_value, "deepspeed.runtime.zero.config.ZeroStageEnum"),
            (_Stub, "deepspeed.utils.tensor_fragment.fragment_address")]


def _torch_load(path: str):
    import torch

    from .checkpoint import verify_file

    verify_file(path)  # a damaged gefen_dist checkpoint: CheckpointCorruptError names it and what to do
    try:
        with torch.serialization.safe_globals(_DS_SAFE):
            return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - turned into one clear message
        msg = str(e).strip().splitlines()
        raise CheckpointError(
            f"cannot read {path!r} with torch.load(weights_only=True): {msg[-1] if msg else type(e).__name__}. "
            "gefen-dist inspect never unpickles arbitrary objects; a Gefen state dict holds only tensors, "
            "numbers, strings and lists. Is this a torch.save file of an optimizer state dict?") from None


def _find_optim_sd(obj: Any, depth: int = 0) -> Optional[Dict[str, Any]]:
    """The first dict with "state" and "param_groups" (an optimizer state dict), searched under
    the usual wrapper keys ("optim", "optimizer", "optimizer_state_dict", ...)."""
    if not isinstance(obj, dict) or depth > 3:
        return None
    if "state" in obj and "param_groups" in obj:
        return obj
    for k in ("optim", "optimizer", "optimizer_state_dict", "optim_state_dict", "base_optimizer_state", "opt"):
        if k in obj:
            r = _find_optim_sd(obj[k], depth + 1)
            if r is not None:
                return r
    for v in obj.values():
        if isinstance(v, dict):
            r = _find_optim_sd(v, depth + 1)
            if r is not None:
                return r
    return None


def _quantized_saved(entry) -> Optional[str]:
    """The second moment of a saved entry that is quantized Gefen state, else None (a file carries
    no state spec: :func:`gefen_dist.engine.state.mode_of_saved` reads its keys)."""
    from .engine.state import MODE_EXACT, mode_of_saved

    mode = mode_of_saved(entry)
    return None if mode in (None, MODE_EXACT) else mode


def _is_gefen_sd(sd: Dict[str, Any]) -> bool:
    groups = sd.get("param_groups") or []
    if any(isinstance(g, dict) and "second_moment" in g for g in groups):
        return True
    return any(isinstance(st, dict) and (_quantized_saved(st) or "codebook" in st)
               for st in sd.get("state", {}).values())


def _not_gefen(path: str, sd: Optional[Dict[str, Any]], what: str) -> CheckpointError:
    if sd is None:
        return CheckpointError(f"{path!r} ({what}) holds no optimizer state dict (a dict with 'state' and "
                               "'param_groups'): not a Gefen optimizer checkpoint")
    keys = sorted({k for st in sd.get("state", {}).values() if isinstance(st, dict) for k in st})
    hint = (" (looks like torch.optim.Adam/AdamW; Gefen.load_state_dict and gefen_dist.checkpoint.load warm-start "
            "Gefen from it, docs/checkpoints.md)") if "exp_avg" in keys and "exp_avg_sq" in keys else ""
    return CheckpointError(f"{path!r} ({what}) is an optimizer state dict but not Gefen's{hint}: state keys {keys[:8]}, "
                           "no 'idx'/'codebook' state and no 'second_moment' in its param groups")


def _nbytes(t) -> int:
    return int(t.numel()) * int(t.element_size())


def _codebook_summary(cb) -> Dict[str, Any]:
    import torch

    if cb is None:
        return dict(present=False)
    c = cb.detach().float().reshape(-1)
    learned = bool(c.numel()) and float(c[0]) == -1.0
    out = dict(present=True, learned=learned, size=int(c.numel()), min=float(c.min()) if c.numel() else 0.0,
               max=float(c.max()) if c.numel() else 0.0, first=[round(float(x), 6) for x in c[:4]],
               distinct=int(torch.unique(c).numel()), sorted=bool((c[1:] >= c[:-1]).all()) if c.numel() > 1 else True)
    return out


def _names_of(sd: Dict[str, Any]) -> Dict[Any, str]:
    names = {}
    for gi, g in enumerate(sd.get("param_groups", [])):
        pn = g.get("param_names")
        for i, pid in enumerate(g.get("params", [])):
            names[pid] = pn[i] if pn is not None and i < len(pn) else (pid if isinstance(pid, str) else f"group{gi}.param{i}")
    return names


def _inspect_state_dict(path: str, sd: Dict[str, Any]) -> Dict[str, Any]:
    import torch

    from .engine.state import MODE_EXACT, mode_of_saved

    names = _names_of(sd)
    order = [pid for g in sd.get("param_groups", []) for pid in g.get("params", [])]
    order += [k for k in sd["state"] if k not in set(order)]
    tensors, cb, seen_cb = [], None, set()
    for pid in order:
        st = sd["state"].get(pid)
        if not st:
            continue
        mode = mode_of_saved(st)
        if mode not in (None, MODE_EXACT):
            nb = sum(_nbytes(st[k]) for k in ("idx", "scale", "v", "v_row", "v_blk", "v_col", "scale_code", "v_code")
                     if isinstance(st.get(k), torch.Tensor))
            c = st.get("codebook")
            if isinstance(c, torch.Tensor) and (cb is None or (float(cb[0]) != -1.0 and float(c[0]) == -1.0)):
                cb = c
            if isinstance(c, torch.Tensor):
                seen_cb.add(c.numpy().tobytes() if c.numel() else b"")
            shape = tuple(st["idx"].shape)
            tensors.append(dict(name=names.get(pid, str(pid)), shape=shape, numel=int(math.prod(shape)), kind="quantized",
                                period=int(st.get("period", 0)), scale_block=int(st.get("scale_block", 0)),
                                learned=bool(int(st.get("learned", 1))), step=int(st.get("step", 0)),
                                idx_dtype=str(st["idx"].dtype).replace("torch.", ""),
                                second_moment=mode, bytes=nb))
        elif mode == MODE_EXACT:
            shape = tuple(st["exp_avg"].shape)
            tensors.append(dict(name=names.get(pid, str(pid)), shape=shape, numel=int(math.prod(shape)), kind="exact",
                                period=0, scale_block=0, learned=True, step=int(st.get("step", 0)),
                                bytes=sum(_nbytes(st[k]) for k in ("exp_avg", "exp_avg_sq"))))
    learned_cbs = {b for b in seen_cb if b[:4] == b"\x00\x00\x80\xbf"}  # float32 -1.0
    notes = []
    if len(learned_cbs) > 1:
        notes.append(f"WARNING: {len(learned_cbs)} different learned codebooks (Gefen keeps one per job)")
    bad = [t["name"] for t in tensors if t.get("idx_dtype", "uint8") != "uint8"]
    if bad:
        notes.append(f"WARNING: idx is not uint8 for {bad[:4]} (state cast by torch.optim.Optimizer.load_state_dict?)")
    return dict(tensors=tensors, codebook=_codebook_summary(cb), notes=notes,
                state_bytes=sum(t["bytes"] for t in tensors) + (_nbytes(cb) if cb is not None else 0),
                groups=len(sd.get("param_groups", [])), hparams=_hparams(sd))


def _hparams(sd) -> List[Dict[str, Any]]:
    import torch

    out = []
    for g in sd.get("param_groups", []):
        h = {}
        for k in ("lr", "betas", "eps", "weight_decay", "second_moment", "row_blocks", "col_blocks", "narrow_rows"):
            if k in g:
                v = g[k]
                if isinstance(v, torch.Tensor):
                    v = float(v) if v.numel() == 1 else v.tolist()
                h[k] = list(v) if isinstance(v, tuple) else v
        h["params"] = len(g.get("params", []))
        out.append(h)
    return out


def _inspect_file(path: str) -> Dict[str, Any]:
    obj = _torch_load(path)
    sd = _find_optim_sd(obj)
    if sd is not None and sd.get("state") and all(isinstance(s, dict) and "segments" in s for s in sd["state"].values()):
        return _inspect_deepspeed([path], single_file=True)
    if sd is None or not _is_gefen_sd(sd):
        raise _not_gefen(path, sd, "torch.save file")
    out = _inspect_state_dict(path, sd)
    keyed_by_name = any(isinstance(k, str) for k in sd["state"])
    out.update(format=("torch.save optimizer state dict keyed by parameter FQN (gefen_dist.checkpoint.full_state_dict)"
                       if keyed_by_name else
                       "torch.save optimizer state dict (Gefen, or ZeroGefen consolidated: the same layout)"),
               world_size=None,
               world_note="not recorded: this layout is world-size independent and loads at any world size")
    return out


_DS_STATE_KEYS = ("idx", "scale", "v", "v_row", "v_col", "span_scale", "span_vblk", "span_vcol", "span_codes", "exact_m",
                  "exact_v")


def _inspect_deepspeed(files: Sequence[str], single_file: bool = False) -> Dict[str, Any]:
    import torch

    from .core.periods import row_slab, scale_block_for
    from .engine.state import MODE_FACTORED, mode_of_saved

    per_name: Dict[str, Dict[str, Any]] = {}
    order: List[str] = []
    total, cb, stage, pcount = 0, None, None, None
    ranks = []
    for f in sorted(files, key=_rank_of):
        obj = _torch_load(f)
        sd = _find_optim_sd(obj)
        if sd is None or not sd.get("state") or not all(isinstance(s, dict) and "segments" in s
                                                         for s in sd["state"].values()):
            if sd is not None and _is_gefen_sd(sd):
                raise CheckpointError(f"{f!r}: Gefen state without DeepSpeed segments: was it saved by "
                                      "gefen_dist.Gefen instead of gefen_dist.integrations.deepspeed.Gefen?")
            raise _not_gefen(f, sd, "DeepSpeed optimizer file")
        osd = obj.get("optimizer_state_dict", {}) if isinstance(obj, dict) else {}
        stage = osd.get("zero_stage", stage)
        pc = osd.get("partition_count")
        pcount = (pc[0] if isinstance(pc, (list, tuple)) and pc else pc) if pc is not None else pcount
        ranks.append(_rank_of(f))
        for st in sd["state"].values():
            total += sum(_nbytes(st[k]) for k in _DS_STATE_KEYS if isinstance(st.get(k), torch.Tensor))
            factored, spans = mode_of_saved(st) == MODE_FACTORED, set(st.get("span_keys", []))
            c = st.get("codebook")
            if isinstance(c, torch.Tensor) and (cb is None or (float(cb[0]) != -1.0 and float(c[0]) == -1.0)):
                cb = c
            for seg, per, lrn in zip(st["segments"], st["periods"], st["learned"]):
                name, shape, n = seg["name"], tuple(int(s) for s in seg["shape"]), int(seg["numel"])
                rec = per_name.get(name)
                if rec is None:
                    rec = per_name[name] = dict(name=name, shape=shape, numel=int(math.prod(shape)), covered=0,
                                                kind="exact" if per == 0 else "quantized", period=int(per),
                                                learned=bool(lrn), step=int(st.get("step", 0)), bytes=0, ranks=set())
                    order.append(name)
                rec["covered"] += n
                rec["ranks"].add(_rank_of(f))
                if per == 0:
                    rec["bytes"] += 8 * n
                elif seg.get("key") in spans:  # D16: scale and v per block of rows (replicated, not counted here)
                    rec["bytes"] += n
                else:  # a scale per block, v per period (shared) or per row (factored; v_col not counted here)
                    B = scale_block_for(int(per), row_slab(shape))
                    rec["bytes"] += n + 4 * math.ceil(n / B) + 4 * math.ceil(n / (row_slab(shape) if factored
                                                                                   else int(per)))
    if cb is not None:
        total += _nbytes(cb)
    tensors = []
    for name in order:
        r = per_name[name]
        r["ranks"] = sorted(r["ranks"])
        r["scale_block"] = scale_block_for(r["period"], row_slab(r["shape"])) if r["period"] else 0
        tensors.append(r)
    notes = ["per-tensor bytes are estimated from segment sizes (a block cut by a partition edge is held by each "
             "rank sharing it; column profiles and the block state of narrow_rows='span' tensors, replicated, are "
             "not in them); the total is exact: every state tensor of every rank's file"]
    world = len(files) if not single_file else pcount
    if pcount is not None and not single_file and pcount != len(files):
        notes.append(f"WARNING: partition_count {pcount} but {len(files)} optimizer files were found (missing ranks?)")
    incomplete = [t["name"] for t in tensors if t["covered"] < t["numel"]]
    if incomplete and not single_file:
        notes.append(f"WARNING: tensors not fully covered by the files found: {incomplete[:4]}")
    stg = int(stage) if stage is not None else None
    return dict(format=f"DeepSpeed ZeRO-{stg if stg is not None else '?'} checkpoint"
                       + (" (one rank's optimizer file)" if single_file else ""),
                world_size=world, world_note="data-parallel ranks (optimizer files)" if not single_file
                else "partition_count of this file", tensors=tensors, codebook=_codebook_summary(cb), notes=notes,
                state_bytes=total, groups=None, hparams=[])


def _rank_of(path: str) -> int:
    m = re.search(r"zero_pp_rank_(\d+)_", os.path.basename(path))
    return int(m.group(1)) if m else 0


_DCP_KEY = re.compile(r"^(?P<pre>.*?)state\.(?P<fqn>.+)\.(?P<leaf>idx|scale|v|v_row|v_col|exp_avg|exp_avg_sq|codebook)$")


def _inspect_dcp(path: str) -> Dict[str, Any]:
    try:
        from torch.distributed.checkpoint import FileSystemReader
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata

        md = FileSystemReader(path).read_metadata()
    except Exception as e:  # noqa: BLE001
        raise CheckpointError(f"{path!r}: cannot read the torch.distributed.checkpoint metadata (.metadata): "
                              f"{type(e).__name__}: {e}") from None
    from .core.periods import row_slab
    from .engine.state import MODE_EXACT, MODE_SHARED, mode_of_saved

    found: Dict[str, Dict[str, Any]] = {}
    order: List[str] = []
    prefixes = set()
    for key, meta in md.state_dict_metadata.items():
        m = _DCP_KEY.match(key)
        if not m or not isinstance(meta, TensorStorageMetadata):
            continue
        prefixes.add(m.group("pre"))
        fqn = m.group("fqn")
        if fqn not in found:
            found[fqn] = {}
            order.append(fqn)
        found[fqn][m.group("leaf")] = meta
    if not any(_quantized_saved(d) or "codebook" in d for d in found.values()):
        hint = " (Adam/AdamW state: exp_avg/exp_avg_sq)" if any("exp_avg" in d for d in found.values()) else ""
        raise CheckpointError(f"{path!r} is a torch.distributed.checkpoint directory without Gefen optimizer state"
                              f"{hint}: no '<prefix>state.<fqn>.idx' or '.codebook' keys")
    tensors, cb_meta = [], None

    def nb(meta) -> int:
        import torch

        return int(math.prod(meta.size)) * torch.empty((), dtype=meta.properties.dtype).element_size()

    for fqn in order:
        d = found[fqn]
        if "codebook" in d and cb_meta is None:
            cb_meta = d["codebook"]
        mode = mode_of_saved(d)  # the keys of the entry's leaves (the metadata carries no spec)
        if mode not in (None, MODE_EXACT):
            shape = tuple(d["idx"].size)
            slab = row_slab(shape)
            rec = dict(name=fqn, shape=shape, numel=int(math.prod(shape)), kind="quantized",
                       idx_dtype=str(d["idx"].properties.dtype).replace("torch.", ""),
                       bytes=sum(nb(d[k]) for k in ("idx", "scale", "v", "v_row", "v_blk", "v_col", "scale_code", "v_code")
                                 if k in d))
            rec["scale_block"] = slab // int(d["scale"].size[-1]) if "scale" in d and d["scale"].size[-1] else 0
            v = d.get("v") if mode == MODE_SHARED else None
            # shared: period = slab / v's columns; factored: the saved shapes say only the scale block
            # (the period itself is an int in the checkpoint, not read here)
            rec["period"] = slab // int(v.size[-1]) if v is not None and v.size[-1] else rec["scale_block"]
            rec["second_moment"] = mode
            tensors.append(rec)
        elif mode == MODE_EXACT:
            shape = tuple(d["exp_avg"].size)
            tensors.append(dict(name=fqn, shape=shape, numel=int(math.prod(shape)), kind="exact", period=0,
                                scale_block=0, bytes=sum(nb(d[k]) for k in ("exp_avg", "exp_avg_sq") if k in d)))
    total = sum(t["bytes"] for t in tensors)
    if cb_meta is not None:
        total += nb(cb_meta)
    files = {getattr(v, "relative_path", None) for v in (md.storage_data or {}).values()}
    files.discard(None)
    cb = dict(present=cb_meta is not None, size=int(math.prod(cb_meta.size)) if cb_meta is not None else 0,
              note="values not read (metadata only); load the checkpoint to see them")
    return dict(format="torch.distributed.checkpoint (DCP) directory" + (
                    f", optimizer under '{sorted(prefixes)[0]}state.'" if len(prefixes) == 1 else ""),
                world_size=len(files) or None, world_note="ranks that wrote data files; reshardable to any world size",
                tensors=tensors, codebook=cb, notes=["periods and scale blocks derived from the saved shapes "
                                                     "(row length / v columns); not the 'period' entries"],
                state_bytes=total, groups=None, hparams=[])


def inspect_checkpoint(path: str) -> Dict[str, Any]:
    """Describe a Gefen checkpoint (see the module docstring); raises :class:`CheckpointError`."""
    if not os.path.exists(path):
        raise CheckpointError(f"{path!r} does not exist")
    if os.path.isdir(path):
        if os.path.exists(os.path.join(path, ".metadata")):
            out = _inspect_dcp(path)
        else:
            files = glob.glob(os.path.join(path, "*optim_states.pt"))
            if not files and os.path.exists(os.path.join(path, "latest")):
                with open(os.path.join(path, "latest")) as f:
                    tag = f.read().strip()
                files = glob.glob(os.path.join(path, tag, "*optim_states.pt"))
            if not files:
                inner = sorted(glob.glob(os.path.join(path, "*", "*optim_states.pt")))
                if inner:
                    raise CheckpointError(f"{path!r} holds several DeepSpeed tags and no 'latest' file: pass one tag "
                                          f"directory, e.g. {os.path.dirname(inner[0])!r}")
                hf = [n for n in ("optimizer.pt", "optimizer.bin") if os.path.exists(os.path.join(path, n))]
                if hf:  # a Hugging Face Trainer checkpoint directory
                    out = _inspect_file(os.path.join(path, hf[0]))
                    out["format"] += f" ({hf[0]} of a Hugging Face Trainer checkpoint)"
                    out["path"] = path
                    return out
                raise CheckpointError(
                    f"{path!r} is a directory but neither a torch.distributed.checkpoint (no .metadata), a DeepSpeed "
                    "checkpoint (no *optim_states.pt, no 'latest'), nor a Hugging Face Trainer checkpoint "
                    "(no optimizer.pt)")
            out = _inspect_deepspeed(files)
    else:
        out = _inspect_file(path)
    out["path"] = path
    return out


def render_inspect(r: Dict[str, Any], max_rows: int = 60) -> str:
    L = [f"checkpoint: {r['path']}", f"format: {r['format']}"]
    ws = r.get("world_size")
    L.append(f"world size: {ws if ws is not None else 'n/a'} ({r.get('world_note', '')})")
    for gi, h in enumerate(r.get("hparams") or []):
        L.append(f"param group {gi}: " + ", ".join(f"{k}={v}" for k, v in h.items()))
    L.append("")
    L.append(f"{'name':<44} {'shape':<18} {'kind':<9} {'period':>6} {'block':>6} {'bytes':>12} {'B/param':>8}")
    tensors = r["tensors"]
    for t in tensors[:max_rows]:
        extra = "" if t.get("learned", True) else "  (not learned yet)"
        L.append(f"{t['name'][-44:]:<44} {str(tuple(t['shape'])):<18} {t['kind']:<9} {t['period']:>6} "
                 f"{t['scale_block']:>6} {t['bytes']:>12,} {t['bytes'] / max(1, t['numel']):>8.3f}{extra}")
    if len(tensors) > max_rows:
        L.append(f"... {len(tensors) - max_rows} more tensors (--all to list them)")
    n = sum(t["numel"] for t in tensors)
    q = [t for t in tensors if t["kind"] == "quantized"]
    L.append("")
    L.append(f"total: {len(tensors)} tensors ({len(q)} quantized, {len(tensors) - len(q)} exact), {n:,} parameters, "
             f"{r['state_bytes']:,} state bytes ({r['state_bytes'] / max(1, n):.4f} B/param; AdamW would keep "
             f"{8 * n:,})")
    per: Dict[int, int] = {}
    for t in q:
        per[t["period"]] = per.get(t["period"], 0) + t["numel"]
    if per:
        L.append("params by period: " + ", ".join(f"P={k}: {v:,}" for k, v in sorted(per.items(), key=lambda kv: -kv[1])))
    cb = r["codebook"]
    if not cb.get("present"):
        L.append("codebook: none (no quantized tensors)")
    elif "min" not in cb:
        L.append(f"codebook: {cb['size']} entries; {cb['note']}")
    elif not cb["learned"]:
        L.append(f"codebook: placeholder ({cb['size']} entries, not learned yet: no step with a nonzero gradient)")
    else:
        L.append(f"codebook: {cb['size']} entries, {cb['distinct']} distinct, min {cb['min']:.6g}, max {cb['max']:.6g}, "
                 f"first {cb['first']}{'' if cb['sorted'] else ', NOT sorted'}")
    for note in r.get("notes", []):
        L.append(f"note: {note}")
    return "\n".join(L)


def _cmd_inspect(args) -> int:
    r = inspect_checkpoint(args.checkpoint)
    if args.json:
        r = dict(r, tensors=[dict(t, shape=list(t["shape"])) for t in r["tensors"]])
        print(json.dumps(r, indent=1, default=str))
    else:
        print(render_inspect(r, max_rows=10**9 if args.all else 60))
    return 0


# ============================================================================ ds-to-universal
def _cmd_ds_to_universal(args) -> int:
    from .integrations.ds_universal import convert

    r = convert(args.checkpoint, args.out_dir, tag=args.tag)
    if args.json:
        print(json.dumps(r, indent=1))
    else:
        print(f"wrote {r['out_dir']}: {r['tensors']} tensors ({r['quantized']} quantized, {r['second_moment']} second "
              f"moment), step {r['step']}, from a ZeRO-{r['zero_stage']} checkpoint of world size {r['world_size']}.\n"
              "Load it at any world size with gefen_dist.integrations.deepspeed.load_universal(engine, "
              f"{r['out_dir']!r}).")
    return 0


def _cmd_build_kernels(args) -> int:
    """Compile the native CPU kernels into ``$GEFEN_DIST_CACHE`` now (the step kernel takes ~20 s), so
    that a job's first step does not; one line per library, exit status 1 where one could not be built."""
    import logging

    from .kernels import build_native

    logging.basicConfig(level=logging.INFO, format="%(message)s")
    built = build_native()
    if args.json:
        print(json.dumps(built, indent=1))
    else:
        for name, path in built.items():
            print(f"{name}: {path or 'not built (the eager torch path runs instead; see the log above)'}")
    return 0 if all(built.values()) else 1


# ============================================================================ entry point
def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="gefen-dist", description="gefen_dist tools: memory planning, checkpoint inspection and conversion, kernel builds")
    sub = ap.add_subparsers(dest="cmd", required=True)

    p = sub.add_parser("plan", help="per-rank memory of AdamW vs Gefen for a model and a parallel strategy",
                       description="Per-rank bytes of parameters, gradients, master weights and optimizer state, "
                                   "AdamW vs Gefen. Gefen's periods are estimated from tensor shapes.")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--params", type=float, help="parameter count, e.g. 1.3e9 (transformer-like: GPT-2 small's "
                                                  "measured Gefen bytes/param)")
    src.add_argument("--config", help="a Hugging Face config.json (GPT-2 or Llama-style)")
    src.add_argument("--model", help="pkg.module:factory, instantiated on the meta device")
    p.add_argument("--model-kwargs", help="JSON keyword arguments for --model's factory")
    p.add_argument("--strategy", choices=_plan.STRATEGIES, default="ddp")
    p.add_argument("--world-size", type=int, default=1)
    p.add_argument("--precision", choices=_plan.PRECISIONS, default="fp32")
    p.add_argument("--device-memory", help="memory of one accelerator, e.g. 80GiB")
    p.add_argument("--activation-bytes-per-sample", help="activation bytes of one sample (e.g. 1.5GiB): prints the "
                                                         "largest micro-batch that fits")
    p.add_argument("--reserve", default="0", help="bytes kept free on the device (context, allocator), e.g. 2GiB")
    p.add_argument("--small-threshold", type=int, default=4096, help="Gefen's small_threshold (default 4096)")
    p.add_argument("--second-moment", choices=("factored", "shared", "elementwise", "nibbles"), default="factored",
                   help="Gefen's second_moment (default factored)")
    p.add_argument("--col-blocks", default="1", help="Gefen's col_blocks (D21): 1 (default), auto, or an int")
    p.add_argument("--per-tensor", action="store_true", help="also list every tensor")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(fn=_cmd_plan)

    q = sub.add_parser("inspect", help="describe a Gefen checkpoint (torch.save file, DCP or DeepSpeed directory)")
    q.add_argument("checkpoint")
    q.add_argument("--all", action="store_true", help="list every tensor (default: the first 60)")
    q.add_argument("--json", action="store_true", help="machine-readable output")
    q.set_defaults(fn=_cmd_inspect)

    u = sub.add_parser("ds-to-universal", help="convert a Gefen DeepSpeed checkpoint to DeepSpeed's universal format",
                       description="Convert a rigid Gefen DeepSpeed ZeRO-1/2/3 checkpoint into DeepSpeed's universal "
                                   "format (zero/<param>/{fp32,exp_avg,exp_avg_sq,step}.pt with the dequantized first "
                                   "moment and the element-wise second moment) plus gefen_universal.pt (codebook, "
                                   "periods, factored v_row/v_col), so that it loads at any world size with "
                                   "gefen_dist.integrations.deepspeed.load_universal. Holds the whole model's fp32 "
                                   "weights and indices in host memory (about 6 bytes per parameter).")
    u.add_argument("checkpoint", help="the checkpoint folder (engine.save_checkpoint's save_dir) or a tag folder")
    u.add_argument("out_dir", help="the universal checkpoint folder to create (must not exist)")
    u.add_argument("--tag", help="the tag to convert (default: the 'latest' file, or CHECKPOINT itself)")
    u.add_argument("--json", action="store_true", help="machine-readable summary")
    u.set_defaults(fn=_cmd_ds_to_universal)

    b = sub.add_parser("build-kernels", help="compile the native CPU kernels now (cached; a job's first step "
                                             "otherwise compiles them, ~20 s)")
    b.add_argument("--json", action="store_true", help="machine-readable output")
    b.set_defaults(fn=_cmd_build_kernels)
    return ap


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.fn(args)
    except (ValueError, OSError) as e:
        print(f"gefen-dist {args.cmd}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
