"""Loading a universal checkpoint into a Gefen DeepSpeed engine (:func:`load_into_engine`): the
load side of :mod:`gefen_dist.integrations.ds_universal`, which reads rigid checkpoints and writes
the universal form (its module docstring describes the format and what a load restores)."""
from __future__ import annotations

import logging
import math
import os
from typing import Any, Dict, List, Optional, Tuple

import torch

from ..core import nibbles as _nb
from ..core import periods as _periods
from ..core import rows8 as _rows8
from ..core import span as _span
from ..core.moments import block_means, factored_means, span_means
from ..core.quant import NUM_BINS, nearest_codeword
from ..core.step import column_ratios, quantize
from ..engine import learning
from ..engine.flat import _slots
from ..engine.layout import is_exact
from ..engine.state import MODE_FACTORED, NIBBLES, fixed_period, narrow_rows_of, new_step, second_moment_of
from ..kernels import dispatch as _dispatch
from .ds_universal import FORMAT, META_FILE, VERSION, UniversalCheckpointError, _load

logger = logging.getLogger(__name__)

__all__ = ["load_into_engine"]

_ADAM_KEYS = ("lr", "betas", "eps", "weight_decay", "initial_lr")
# the settings the state was laid out with at load: the loading job's, never the checkpoint's
_LAYOUT_KEYS = ("params", "param_names", "second_moment", "narrow_rows", "row_blocks", "small_threshold")


def _read_param(zero: str, name: str, key: str) -> torch.Tensor:
    path = os.path.join(zero, name, f"{key}.pt")
    if not os.path.isfile(path):
        raise UniversalCheckpointError(f"universal checkpoint lacks {path!r} (parameter {name!r}): was it saved from "
                                       "the same model (parameter names)?")
    obj = _load(path)
    t = obj["param"] if isinstance(obj, dict) else obj
    return t.reshape(-1).float()


def _read_step(zero: str, names: List[str], optim_sd: Dict[str, Any]) -> int:
    for name in names:
        p = os.path.join(zero, name, "step.pt")
        if os.path.isfile(p):
            return int(float(_load(p)))
    try:  # ZeRO-3 universal checkpoints keep the step in the optimizer state only
        return int(float(optim_sd["optimizer_state_dict"]["state"][0]["step"]))
    except (KeyError, TypeError, IndexError):
        raise UniversalCheckpointError(f"{zero!r}: no step.pt and no step in optimizer_state.pt") from None


class _Learned:
    __slots__ = ("period", "learned", "meta")

    def __init__(self, period: int, learned: bool, meta: Optional[Dict[str, Any]] = None):
        self.period, self.learned, self.meta = period, learned, meta


def _flat_entries(opt, wrapper) -> List[Tuple[torch.Tensor, Any, dict]]:
    """(flat tensor, FlatSegments, param group) for every flat partition of this rank, in layout order."""
    out = []
    for fid, fs in opt._ds_flats.items():
        flat = opt._ds_tensors[fid]
        group = next((g for g in opt.param_groups if any(p is flat for p in g["params"])), None)
        if group is None and hasattr(wrapper, "fp32_partitioned_groups_flat"):  # ZeRO-3: groups are empty between steps
            sg = next(i for i, f in enumerate(wrapper.fp32_partitioned_groups_flat) if f is flat)
            group = opt.param_groups[wrapper.sub_group_to_group_id[sg]]
        if group is None:
            raise UniversalCheckpointError(f"{fs.where}: cannot find the param group of this flat partition")
        out.append((flat, fs, group))
    return out


def load_into_engine(engine, folder: str, load_optimizer_states: bool = True) -> None:
    """Load the universal checkpoint ``folder`` (``folder/zero/...``) into a Gefen DeepSpeed engine at
    its current world size: fp32 master weights into the flat partitions (and, for ZeRO-3, the
    parameter partitions; ZeRO-1/2 copy them to the parameters in DeepSpeed's ``update_lp_params``),
    Gefen's state requantized from ``exp_avg``/``exp_avg_sq``, hyperparameters and DeepSpeed's global
    optimizer state. Every rank of the data-parallel group calls it (the layout catalog is collective)."""
    opt, wrapper = engine.basic_optimizer, engine.optimizer
    zero = os.path.join(folder, "zero")
    if not os.path.isdir(zero):
        raise UniversalCheckpointError(
            f"{folder!r} is not a universal checkpoint (no zero/ folder). Convert a Gefen DeepSpeed checkpoint with "
            "`gefen-dist ds-to-universal CKPT_DIR OUT_DIR`, an AdamW one with DeepSpeed's ds_to_universal.")
    if not opt._ds_flats:
        opt.attach_deepspeed(wrapper, engine.module)
    meta = None
    mpath = os.path.join(folder, META_FILE)
    if os.path.isfile(mpath):
        meta = _load(mpath)
        if not isinstance(meta, dict) or meta.get("format") != FORMAT:
            raise UniversalCheckpointError(f"{mpath!r} is not a gefen-dist universal metadata file")
        if int(meta.get("version", 0)) > VERSION:
            raise UniversalCheckpointError(f"{mpath!r} has format version {meta['version']}; this gefen_dist reads up "
                                           f"to {VERSION}: upgrade gefen_dist")
    if load_optimizer_states:
        _check_nibbles(opt, meta)
    optim_sd = _load(os.path.join(zero, "optimizer_state.pt"))
    if hasattr(wrapper, "_load_global_state_stage3"):
        wrapper._load_global_state_stage3(optim_sd)
    elif hasattr(wrapper, "_load_global_state"):
        wrapper._load_global_state(optim_sd)

    # every parameter Gefen optimizes: name, key, global shape (identical on every rank)
    params = []
    for i, p in enumerate(opt._ds_orig):
        params.append((opt._ds_names[id(p)], f"p{i}", tuple(int(s) for s in getattr(p, "ds_shape", p.shape))))
    colb = {opt._ds_names[id(p)]: _periods.factored_col_blocks(shape, opt._ds_col_blocks.get(id(p), 1))
            for p, (_, _, shape) in zip(opt._ds_orig, params)
            if not is_exact(shape, opt.small_threshold)}  # column blocks (D21) per quantized tensor
    names = [n for n, _, _ in params]
    missing = [n for n in names if not os.path.isfile(os.path.join(zero, n, "fp32.pt"))]
    if missing:
        have = sorted(os.listdir(zero))[:6]
        raise UniversalCheckpointError(f"{zero!r} has no folder for parameters {missing[:4]} (it has {have}...): "
                                       "the checkpoint was saved from another model or with other parameter names")
    entries = _flat_entries(opt, wrapper)
    if load_optimizer_states:
        _load_state(opt, entries, params, zero, meta, optim_sd, colb)
    # fp32 master weights into this rank's flat partitions (the layout Gefen verified)
    for flat, fs, _ in entries:
        for s in fs.segments:
            if s.numel:
                w = _read_param(zero, s.name, "fp32")
                flat.detach().reshape(-1)[s.flat_offset:s.flat_offset + s.numel].copy_(
                    w[s.param_offset:s.param_offset + s.numel].to(flat.device))
    if hasattr(wrapper, "fp32_partitioned_groups_flat"):  # ZeRO-3: parameter partitions, as DeepSpeed's UC load
        for sg, f32 in enumerate(wrapper.fp32_partitioned_groups_flat):
            lp = wrapper.fp16_partitioned_groups_flat[sg]
            if lp is not None and f32.numel():
                lp.data.copy_(f32.data)
                for part, q in zip(wrapper.fp16_partitioned_groups[sg],
                                   wrapper.unflatten(lp, wrapper.fp16_partitioned_groups[sg])):
                    part.data = q.data
    logger.info("Gefen loaded universal checkpoint %s (%s) at data-parallel size %d", folder,
                "Gefen metadata: exact" if meta is not None else "no Gefen metadata: warm start from Adam state",
                fs.comm.world_size if entries else 1)


def _load_state(opt, entries, params, zero: str, meta: Optional[Dict[str, Any]], optim_sd: Dict[str, Any],
                colb: Dict[str, int]) -> None:
    names = [n for n, _, _ in params]
    step = int(meta["step"]) if meta is not None else _read_step(zero, names, optim_sd)
    _check_col_blocks(meta, colb)
    info = _learned_info(opt, params, zero, meta, colb)
    key_name = {k: n for n, k, _ in params}
    opt.state.clear()
    for flat, fs, group in entries:
        st = _flat_state(opt, flat, fs, group, info, key_name, zero, meta, step)
        st["step"] = new_step(step)
        opt.state[flat] = st
    _set_hparams(opt, optim_sd, meta is not None)


def _check_col_blocks(meta: Optional[Dict[str, Any]], colb: Dict[str, int]) -> None:
    """A factored tensor saved with other column blocks (D21) than its param group gives it now: an error
    on every rank (the metadata and the groups are the same on every rank) before anything changes."""
    if meta is None or meta.get("second_moment") != MODE_FACTORED:
        return
    bad = [(n, rec.get("col_blocks", 1), colb.get(n, 1)) for n, rec in meta.get("tensors", {}).items()
           if rec.get("kind") == "quantized" and rec.get("v_row") is not None and rec.get("col_blocks", 1) != colb.get(n, 1)]
    if bad:
        n, was, now = bad[0]
        raise UniversalCheckpointError(
            f"the universal checkpoint keeps {n!r} with {was} column block(s) (D21) and this engine's param group gives "
            f"it {now} (col_blocks); {len(bad)} tensor(s) differ: load it with the col_blocks it was saved with")


def _learned_info(opt, params, zero: str, meta: Optional[Dict[str, Any]],
                  colb: Dict[str, int]) -> Dict[str, "_Learned"]:
    """Period and learned flag of every quantized tensor (all of them: the cut catalog needs them),
    from Gefen's metadata, or warm-started from AdamW state (periods from ``exp_avg_sq``, the
    codebook from ``exp_avg``; ``colb``: each tensor's column blocks, D21); sets ``opt.codebook``
    (and its info)."""
    mt = meta.get("tensors", {}) if meta is not None else {}
    info: Dict[str, _Learned] = {}
    generic = []
    for name, _, shape in params:
        if is_exact(shape, opt.small_threshold):
            continue
        rec = mt.get(name)
        if rec is not None and rec["kind"] == "quantized" and tuple(rec["shape"]) == shape:
            # a D16 record's period is its blocks of rows: a layout without them takes the mode's
            per = int(rec["period"]) if not rec.get("span") else fixed_period(shape, MODE_FACTORED)
            info[name] = _Learned(per, bool(rec["learned"]), rec)
        else:
            generic.append((name, shape))
    if generic and any(second_moment_of(g) == NIBBLES for g in opt.param_groups):
        raise UniversalCheckpointError(
            f"second_moment='nibbles' has no warm start from Adam-shaped state, and {generic[0][0]!r} has no Gefen record "
            "in the checkpoint's metadata; load it with second_moment='factored', or start the nibbles run afresh")
    counts = torch.zeros(NUM_BINS, dtype=torch.int64)
    modes = {second_moment_of(g) for g in opt.param_groups}
    mode = modes.pop() if len(modes) == 1 else None  # the period a mode fixes (D14), when one mode holds
    for name, shape in generic:  # warm start (AdamW)
        v = _read_param(zero, name, "exp_avg_sq")
        m = _read_param(zero, name, "exp_avg")
        fixed = fixed_period(shape, mode, colb.get(name, 1)) if mode else None
        if not bool((v != 0).any()) and not bool((m != 0).any()):
            info[name] = _Learned(fixed or _periods.row_slab(shape), False)
            continue
        per = fixed or _periods.resolve_period(_dispatch.paper_period(v.clamp(min=0).sqrt()), _periods.row_slab(shape))
        info[name] = _Learned(per, True)
        _dispatch.block_histogram(m, _periods.scale_block_for(per, _periods.row_slab(shape)), out=counts)
    if meta is not None and meta.get("codebook") is not None:
        opt.codebook = meta["codebook"].float().clone()
    elif int(counts.sum()) > 0:
        fit = learning.learn_codebook(counts, getattr(opt, "symmetric_codebook", True))
        opt.codebook = fit.codebook
        opt.codebook_info = dict(fit.info, source="exp_avg (universal warm start)")
    else:
        opt.codebook = None
    if generic:
        logger.info("Gefen warm start from Adam state: periods and codebook learned for %d tensors (%s)",
                    len(generic), ", ".join(n for n, _ in generic[:4]) + ("..." if len(generic) > 4 else ""))
    return info


def _check_nibbles(opt, meta: Optional[Dict[str, Any]]) -> None:
    """A universal checkpoint of ``second_moment="nibbles"`` (D20: a 16-entry codebook) loads into an
    engine whose param groups use it, and only there: the codebook is one per optimizer, of 16 or 256
    codewords; nor is there a warm start of it from Adam-shaped state (no Gefen metadata). Raised
    before anything changes, naming both settings."""
    want = any(second_moment_of(g) == NIBBLES for g in opt.param_groups)
    saved = meta is not None and meta.get("second_moment") == NIBBLES
    if want and meta is None:
        raise UniversalCheckpointError(
            "second_moment='nibbles' has no warm start from Adam-shaped state (its 16-codeword codebook and codes "
            "are not learned from exp_avg); load it with second_moment='factored', or start the nibbles run afresh")
    if meta is not None and want != saved:
        raise UniversalCheckpointError(
            f"the universal checkpoint holds second_moment={meta.get('second_moment')!r} and the engine's param groups "
            f"ask for {sorted({second_moment_of(g) for g in opt.param_groups})}: 'nibbles' keeps a 16-codeword "
            "codebook and both moments in each byte, the other settings 256 codewords; load it with the setting it "
            "was saved with")


def _flat_state(opt, flat, fs, group, info, key_name, zero: str, meta, step: int) -> Dict[str, Any]:
    """The Gefen state of one flat buffer of the new layout, filled from the universal files."""
    small = opt.small_threshold
    factored = second_moment_of(group) in (MODE_FACTORED, NIBBLES)
    fs.second_moment = second_moment_of(group)  # the buffer's group's, as the step sets them
    fs.narrow_rows = narrow_rows_of(group)  # D16, D18
    st = fs.new_state(flat, opt._codebook_for(flat.device), factored=factored, row_blocks=group.get("row_blocks", "auto"),
                      col_blocks=group.get("col_blocks", 1))
    spanf = fs._span_fn(factored)  # D16: these segments' period is their blocks of rows, as new_state's
    periods, learned = [], []
    for s in fs.segments:
        if is_exact(s.shape, small):
            periods.append(0)
            learned.append(1)
        else:
            li = info[s.name]
            periods.append(_span.span_period(s.shape) if spanf and spanf(s.shape) else
                           li.period if li.learned else _periods.row_slab(s.shape))
            learned.append(int(li.learned))
    fs._reslot(st, periods, factored)
    st["learned"] = learned
    spans = set(st.get("span_keys", []))
    for j, key in enumerate(st["global_keys"]):
        li = info[key_name[key]]
        st["global_learned"][j] = int(li.learned)
        per = _span.span_period(fs.global_catalog()[key]["shape"]) if key in spans else li.period
        st["global_periods"][j] = per if li.learned else 0
    slots, _, _, _ = _slots(fs.segments, st["periods"], small, factored, st.get("row_blocks", 1), span=spanf,
                            col_blocks=st.get("col_blocks", 1))
    if spans:
        _fill_span(st, fs, info, key_name, zero, opt.codebook)
        _fill_rows8(st, fs, info, key_name, zero, opt.codebook, step)
    for sp, lrn in zip(slots, learned):
        s = sp.seg
        if not s.numel:
            continue
        a, e = s.param_offset, s.param_offset + s.numel
        if sp.exact:
            st["exact_m"][sp.exact_off:sp.exact_off + s.numel] = _read_param(zero, s.name, "exp_avg")[a:e]
            st["exact_v"][sp.exact_off:sp.exact_off + s.numel] = _read_param(zero, s.name, "exp_avg_sq")[a:e]
            continue
        if lrn and not sp.span:
            _fill_quantized(st, sp, zero, info[s.name], opt.codebook, factored, meta)
    return st


def _fill_span(st, fs, info, key_name, zero: str, codebook) -> None:
    """The block state of every tensor the buffer keeps per block of rows (D16), held here or not
    (it is replicated), and the indices of the pieces held here: the scales are the block absmax of
    ``exp_avg`` (bitwise the saved ones, as for the other modes), ``v_blk`` / ``v_col`` Gefen's from the
    metadata, else the block and column means of ``exp_avg_sq`` (a warm start)."""
    local = {s.key: s for s in fs.segments if s.numel}
    dev = st["idx"].device
    r8 = fs.rows8_keys(st)
    for key, (bo, nb, co, S, shape) in fs.span_layout(st).items():
        name = key_name[key]
        li = info[name]
        if not li.learned or key in r8:
            continue
        sp = _span.SpanPiece.of(shape)
        m = _read_param(zero, name, "exp_avg")
        A = _span.span_grad_absmax(m, sp)  # the block absmax (of m here)
        st["span_scale"][bo:bo + nb] = A.to(dev)
        rec = li.meta
        if (rec is not None and rec.get("span") and not rec.get("rows8") and rec["v_blk"].numel() == nb
                and rec["v_col"].numel() == S):
            vb, vc = rec["v_blk"].float(), rec["v_col"].float()
        else:
            vb, vc = span_means(_read_param(zero, name, "exp_avg_sq"), sp)
        st["span_vblk"][bo:bo + nb] = vb.to(dev)
        st["span_vcol"][co:co + S] = vc.to(dev)
        seg = local.get(key)
        if seg is not None:
            a, n = seg.param_offset, seg.numel
            # element by element: a partition edge may cut a row
            Ar = A.index_select(0, _span.SpanPiece.of(shape, a, n).element_blocks("cpu"))
            st["idx"][seg.flat_offset:seg.flat_offset + n] = quantize(m[a:a + n], Ar, codebook.cpu()).to(dev)


def _fill_rows8(st, fs, info, key_name, zero: str, codebook, step: int) -> None:
    """The state of every tensor the buffer keeps per row in one-byte codes (D19): its block
    references and column profile (replicated), the codes of the rows this rank's pieces touch and
    their indices. From Gefen's rows8 metadata bitwise; otherwise (Adam state, or Gefen state of
    another layout) the rows' maxima of ``exp_avg`` and the row / column means of ``exp_avg_sq`` (or a
    per-row record's ``v_row`` / ``v_col``) coded as a step does (the ``v`` codes drawn at ``step``)."""
    local = {s.key: s for s in fs.segments if s.numel}
    mine, r8 = fs.rows8_layout(st), fs.rows8_keys(st)
    dev = st["idx"].device
    for key, (bo, nb, co, S, shape) in fs.span_layout(st).items():
        name = key_name[key]
        if key not in r8 or not info[name].learned:
            continue
        rec, sp = info[name].meta, _span.SpanPiece.of(shape)
        m = _read_param(zero, name, "exp_avg")
        if rec is not None and rec.get("rows8") and rec["codes"].shape[0] == sp.rows and rec["v_col"].numel() == S:
            codes, sref, vref, vc = rec["codes"], rec["scale"].float(), rec["v_blk"].float(), rec["v_col"].float()
        else:
            if rec is not None and rec.get("v_row") is not None and rec["v_col"].numel() == S:
                vr, vc = rec["v_row"].float(), rec["v_col"].float()  # Gefen's per-row float32 state (D10)
            else:
                vr, vc = factored_means(_read_param(zero, name, "exp_avg_sq"), S)
            sc, sref, _ = _rows8.encode_scale(m.view(sp.rows, S).abs().amax(dim=1), sp)
            vcode, vref, _ = _rows8.encode_v(vr, sp, step, shape)
            codes = torch.stack([sc, vcode], dim=1)
        st["span_scale"][bo:bo + nb] = sref.to(dev)
        st["span_vblk"][bo:bo + nb] = vref.to(dev)
        st["span_vcol"][co:co + S] = vc.to(dev)
        seg = local.get(key)
        if seg is not None:
            ro, r0, r1 = mine[key]
            st["span_codes"][ro:ro + r1 - r0] = codes[r0:r1].to(dev)
            a, n = seg.param_offset, seg.numel
            M = _rows8.decode_scale(codes[:, 0], sref, sp)
            Me = M.index_select(0, torch.div(torch.arange(a, a + n), S, rounding_mode="floor"))
            st["idx"][seg.flat_offset:seg.flat_offset + n] = quantize(m[a:a + n], Me, codebook.cpu()).to(dev)


def _fill_quantized(st, sp, zero: str, li: _Learned, codebook: torch.Tensor, factored: bool, meta) -> None:
    s = sp.seg
    a, e, n = s.param_offset, s.param_offset + s.numel, s.numel
    B = sp.block
    m = _read_param(zero, s.name, "exp_avg")
    # scale blocks touched by the piece, whole (absmax over the full block, also when it is cut)
    b0, b1 = a // B, (e - 1) // B + 1
    mb = m[b0 * B:b1 * B].view(-1, B)
    A = mb.abs().amax(dim=1)
    z = torch.where(A.view(-1, 1) > 0, mb / torch.where(A > 0, A, torch.ones_like(A)).view(-1, 1),
                    torch.zeros_like(mb)).reshape(-1)
    dev = st["idx"].device
    nib = codebook.numel() == _nb.NIBBLE_CODEWORDS  # both moments in one byte (D20)
    z = z[a - b0 * B:e - b0 * B]
    # (D20: the codes decoded exactly onto their levels, so the nearest level gives each code back)
    codes = _nb.round_stochastic(z, codebook.cpu(), torch.full_like(z, 0.5)) if nib else nearest_codeword(
        z, codebook.cpu())
    st["scale"][sp.scale_off:sp.scale_off + sp.scale_n] = A.to(dev)
    S = _periods.row_slab(s.shape)
    rec = li.meta
    if sp.factored:
        r0, r1 = a // S, (e - 1) // S + 1
        G, K = sp.vcol_n // S, sp.colb  # row blocks (D12), column blocks (D21)
        # the metadata of a factored checkpoint holds each quantized tensor's v_row / v_col
        if (rec is not None and meta.get("second_moment") in (MODE_FACTORED, NIBBLES) and rec.get("v_row") is not None
                and rec["v_col"].numel() == sp.vcol_n and rec["v_row"].numel() == math.prod(s.shape) // S * K):
            vr, vc = rec["v_row"].float().reshape(-1), rec["v_col"].float().reshape(-1)
        else:  # from the element-wise second moment: row (per column block) and per-block column means (float64)
            vr, vc = factored_means(_read_param(zero, s.name, "exp_avg_sq"), S, G, K)
            vc = vc.reshape(-1)
        st["v_row"][sp.v_off:sp.v_off + sp.v_n] = vr[r0 * K:r1 * K].to(dev)
        st["v_col"][sp.vcol_off:sp.vcol_off + sp.vcol_n] = vc.to(dev)
        if nib:  # the low nibble: v's level against the estimate from those statistics, as the writer's
            fac = (vr.view(G, -1, 1) * column_ratios(vc.view(G, S)).view(G, 1, S)).reshape(-1)[a:e]
            v = _read_param(zero, s.name, "exp_avg_sq").reshape(-1)[a:e].float()
            lv = torch.tensor(_nb.V_LEVELS, dtype=torch.float32)
            r = torch.where(fac > 0, v / fac, torch.zeros(()))
            codes = codes << 4 | _nb.round_stochastic(r, lv, torch.full_like(r, 0.5))
    else:
        P = sp.period
        v = _read_param(zero, s.name, "exp_avg_sq")
        k0, k1 = a // P, (e - 1) // P + 1
        # a few-row tensor of a factored buffer keeps its shared v in v_row (D15)
        st["v_row" if factored else "v"][sp.v_off:sp.v_off + sp.v_n] = block_means(v[k0 * P:k1 * P], P).to(dev)
    st["idx"][s.flat_offset:s.flat_offset + n] = codes.to(torch.uint8).to(dev)


def _set_hparams(opt, optim_sd: Dict[str, Any], from_gefen: bool) -> None:
    saved = optim_sd.get("param_groups")
    if not saved:
        return
    if len(saved) != len(opt.param_groups):
        raise UniversalCheckpointError(f"the universal checkpoint has {len(saved)} param groups, this optimizer "
                                       f"{len(opt.param_groups)}: build the optimizer with the same param groups")
    for sg, g in zip(saved, opt.param_groups):
        for k, v in sg.items():
            if k in _LAYOUT_KEYS:
                continue
            if (from_gefen and k in g) or k in _ADAM_KEYS:
                g[k] = tuple(v) if k == "betas" else v
