"""Universal (world-size independent) DeepSpeed checkpoints for Gefen.

DeepSpeed's rigid checkpoints hold each rank's flat partition, so they load only at the world
size they were saved at. DeepSpeed's *universal* format stores one folder per parameter
(``zero/<name>/{fp32,exp_avg,exp_avg_sq,step}.pt``, the full tensors) and loads at any
data-parallel size. This module makes Gefen speak that format:

* :func:`convert` (``gefen-dist ds-to-universal CKPT_DIR OUT_DIR [--tag TAG]``) turns a rigid
  Gefen ZeRO-1/2/3 (or BF16_Optimizer) checkpoint into a universal one: ``exp_avg`` is the
  dequantized first moment ``codebook[idx] * scale``, ``exp_avg_sq`` the second moment broadcast
  to elements (shared: ``v`` of the element's period block; factored:
  ``v_row[i] * v_col[j] / mean(v_col)``), ``fp32`` the master weights. ``gefen_universal.pt``
  beside ``zero/`` records what the Adam-shaped tensors cannot: the codebook, every tensor's
  period, scale block and learned flag, ``v_row``/``v_col`` of factored tensors, the block state of
  tensors kept per block of rows (D16) and the row codes with their block references of
  ``narrow_rows="rows8"`` tensors (D19; ``exp_avg`` / ``exp_avg_sq`` hold their decoded rows), the
  step. The output is written to a temporary folder and renamed into place.
* :func:`load_into_engine` (reached through
  :func:`gefen_dist.integrations.deepspeed.load_universal` or DeepSpeed's
  ``"checkpoint": {"load_universal": true}`` + ``engine.load_checkpoint``) requantizes the
  Adam-shaped moments into Gefen's state at the *current* layout. With the metadata the round
  trip is exact: the absmax of a dequantized scale block is ``scale * max|codebook| = scale``
  (the element that set the scale is quantized to the pinned codeword +-1), so scales and
  indices come back bitwise, ``v`` is the block mean of identical values (exact in float64) and
  ``v_row``/``v_col`` are taken from the metadata (rows8: the codes and references, and the
  indices requantized against the decoded row scales). A tensor saved in one layout and loaded in
  another (per row in float32 and in codes, say) takes the loading job's layout and settings: its
  moments are read from ``exp_avg`` / ``exp_avg_sq`` (``v`` of a row within one code). Without
  metadata (an AdamW checkpoint converted by DeepSpeed's own ``ds_to_universal``) Gefen is
  *warm-started*: periods are chosen from
  ``exp_avg_sq`` (the paper's score on ``ln(exp_avg_sq)`` instead of ``ln(g^2)`` of the first
  gradient), the codebook from the histogram of ``exp_avg`` normalised by its block absmax,
  ``m`` is quantized, ``v`` is the block mean of ``exp_avg_sq`` (factored: its row and column
  means, which is exactly what factored Gefen accumulates from the same gradients).

Every rank reads the full tensors it holds a piece of (as DeepSpeed's own universal loader
does); the warm start from AdamW reads every quantized tensor on every rank (the codebook is
learned from all of them, identically on every rank, with no collective). Only load checkpoints
you trust: like DeepSpeed's own tools this unpickles DeepSpeed's checkpoint files.
"""
from __future__ import annotations

import glob
import logging
import math
import os
import re
import shutil
from typing import Any, Dict, List, Optional, Tuple

import torch

from ..core import nibbles as _nb
from ..core import periods as _periods
from ..core import rows8 as _rows8
from ..core import span as _span
from ..core.step import column_ratios
from ..engine.state import MODE_FACTORED, NIBBLES, few_rows_shared_in, mode_of_saved
from ..engine.flat import Segment, _slots
from ..engine.flat_span import rows8_rows

logger = logging.getLogger(__name__)

__all__ = ["convert", "read_gefen_checkpoint", "UniversalCheckpointError", "META_FILE", "FORMAT", "VERSION"]

FORMAT = "gefen-dist-universal"
VERSION = 1
META_FILE = "gefen_universal.pt"
_OPTIM_RE = re.compile(r"^(?:bf16_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt$")
_SHARDED = ("base_optimizer_state", "param_slice_mappings", "single_partition_of_fp32_groups", "fp32_flat_groups",
            "optimizer_state_dict")


class UniversalCheckpointError(ValueError):
    """A checkpoint cannot be converted or loaded (the message names the value and the fix)."""


def _load(path: str):
    return torch.load(path, map_location="cpu", weights_only=False)


# ============================================================================ reading a rigid checkpoint
def resolve_tag_dir(ckpt_dir: str, tag: Optional[str] = None) -> str:
    """The folder holding the ``*optim_states.pt`` files: ``ckpt_dir/tag``, ``ckpt_dir/<latest>``,
    or ``ckpt_dir`` itself."""
    if not os.path.isdir(ckpt_dir):
        raise UniversalCheckpointError(f"{ckpt_dir!r} is not a directory (expected a DeepSpeed checkpoint folder)")
    if tag is not None:
        d = os.path.join(ckpt_dir, str(tag))
        if not os.path.isdir(d):
            raise UniversalCheckpointError(f"tag {tag!r} not found: {d!r} is not a directory")
        return d
    if glob.glob(os.path.join(ckpt_dir, "*optim_states.pt")):
        return ckpt_dir
    latest = os.path.join(ckpt_dir, "latest")
    if os.path.isfile(latest):
        with open(latest) as f:
            return resolve_tag_dir(ckpt_dir, f.read().strip())
    raise UniversalCheckpointError(f"{ckpt_dir!r} holds no *optim_states.pt and no 'latest' file: pass the tag "
                                   "folder itself or --tag TAG")


def _optim_files(tag_dir: str) -> List[Tuple[int, str]]:
    out = []
    for f in glob.glob(os.path.join(tag_dir, "*optim_states.pt")):
        m = _OPTIM_RE.match(os.path.basename(f))
        if m is None:
            continue
        if int(m.group(2)) != 0:
            raise UniversalCheckpointError(f"{f!r}: model-parallel rank {int(m.group(2))}: tensor/pipeline parallel "
                                           "Gefen checkpoints are not supported by gefen-dist ds-to-universal")
        out.append((int(m.group(1)), f))
    out.sort()
    if not out:
        raise UniversalCheckpointError(f"{tag_dir!r}: no zero_pp_rank_*_mp_rank_00_optim_states.pt files (is this a "
                                       "DeepSpeed ZeRO checkpoint?)")
    if [r for r, _ in out] != list(range(len(out))):
        raise UniversalCheckpointError(f"{tag_dir!r}: optimizer files of ranks {[r for r, _ in out]} found; expected "
                                       f"0..{len(out) - 1} (missing ranks?)")
    return out


class _Tensor:
    """Full-tensor view of one parameter's Gefen state, assembled from all ranks' pieces."""

    def __init__(self, name: str, shape: Tuple[int, ...], period: int, factored: bool, row_blocks: int = 1,
                 span: bool = False, rows8: bool = False, col_blocks: int = 1):
        self.name, self.shape, self.factored, self.span, self.rows8 = name, shape, factored, span, rows8
        self.row_blocks = int(row_blocks)  # row blocks of the factored v_col (D12)
        self.col_blocks = int(col_blocks)  # column blocks of the factored v_row (D21)
        self.numel = int(math.prod(shape))
        self.exact = period == 0
        self.period = int(period)
        self.slab = _periods.row_slab(shape)
        self.block = 0 if self.exact else (self.period if span else _periods.scale_block_for(self.period, self.slab))
        self.learned = True
        self.span_read = False  # D16: the block state was read from a file (the other ranks' copies are checked)
        self.step = 0
        self.covered = torch.zeros(self.numel, dtype=torch.bool)
        self.fp32 = torch.zeros(self.numel, dtype=torch.float32)
        if self.exact:
            self.exp_avg = torch.zeros(self.numel, dtype=torch.float32)
            self.exp_avg_sq = torch.zeros(self.numel, dtype=torch.float32)
            return
        self.idx = torch.zeros(self.numel, dtype=torch.uint8)
        if span:  # D16: scale and v per block of rows, v_col per column (replicated in the flat buffers)
            nb = _span.span_blocks(shape)
            self.scale = torch.zeros(nb, dtype=torch.float32)
            self.v_blk = torch.zeros(nb, dtype=torch.float32)
            self.v_col = torch.zeros(self.slab, dtype=torch.float32)
            if rows8:  # D19: scale and v per row in one-byte codes against those block references
                self.codes = torch.zeros(self.numel // self.slab, 2, dtype=torch.uint8)
                self.codes_read = torch.zeros(self.numel // self.slab, dtype=torch.bool)
            return
        self.scale = torch.zeros(self.numel // self.block, dtype=torch.float32)
        if factored:
            self.v_row = torch.zeros(self.numel // self.slab * self.col_blocks, dtype=torch.float32)
            self.v_col = torch.zeros(self.row_blocks * self.slab, dtype=torch.float32)
        else:
            self.v = torch.zeros(self.numel // self.period, dtype=torch.float32)

    def dequantized(self, codebook: Optional[torch.Tensor]) -> Tuple[torch.Tensor, torch.Tensor]:
        """``(exp_avg, exp_avg_sq)`` as flat fp32 tensors (Adam-shaped interchange)."""
        if self.exact:
            return self.exp_avg, self.exp_avg_sq
        if not self.learned or codebook is None:
            z = torch.zeros(self.numel, dtype=torch.float32)
            return z, z.clone()
        if self.rows8:  # the rows' decoded scale and v, the column's ratio (D19)
            sp = _span.SpanPiece.of(self.shape)
            M = _rows8.decode_scale(self.codes[:, 0], self.scale, sp)
            v = _rows8.decode_v(self.codes[:, 1], self.v_blk, sp)
            m = (codebook[self.idx.long()].view(-1, self.slab) * M.view(-1, 1)).reshape(-1)
            return m, (v.view(-1, 1) * column_ratios(self.v_col).view(1, -1)).reshape(-1)
        if self.span:  # v = v_blk of the row's block times the column's ratio (D16)
            bid = _span.SpanPiece.of(self.shape).block_ids("cpu")
            m = (codebook[self.idx.long()].view(-1, self.slab) * self.scale[bid].view(-1, 1)).reshape(-1)
            return m, (self.v_blk[bid].view(-1, 1) * column_ratios(self.v_col).view(1, -1)).reshape(-1)
        nib = codebook.numel() == _nb.NIBBLE_CODEWORDS  # both moments in one byte (D20)
        m = (codebook[self.idx.long() >> 4 if nib else self.idx.long()].view(-1, self.block)
             * self.scale.view(-1, 1)).reshape(-1)
        if self.factored and self.col_blocks > 1:  # per block of columns (D21): its row statistic, its ratios
            K = self.col_blocks
            col = column_ratios(self.v_col.view(K, -1)).view(1, K, -1)
            v = (self.v_row.view(-1, K, 1) * col).reshape(-1)  # (not with "nibbles": no column blocks there)
        elif self.factored:
            G = self.row_blocks
            col = column_ratios(self.v_col.view(G, self.slab))  # per row block (D12)
            rows = self.v_row.numel()
            v = (self.v_row.view(G, rows // G, 1) * col.view(G, 1, -1)).reshape(-1)
            if nib:  # the low nibble: v against the factored estimate
                v = _nb.decode_with(self.idx, 1.0, v, codebook)[1]
        else:
            v = self.v.repeat_interleave(self.period)
        return m, v


def _rank_states(f: str, obj) -> Tuple[Dict[str, Any], Any, list, int]:
    """The optimizer file ``f``'s (state dict, base optimizer state, fp32 partitions, ZeRO stage),
    refusing files that are not Gefen's DeepSpeed state with what to do instead."""
    osd = obj.get("optimizer_state_dict") if isinstance(obj, dict) else None
    if not isinstance(osd, dict):
        raise UniversalCheckpointError(f"{f!r} holds no 'optimizer_state_dict': not a DeepSpeed ZeRO optimizer file")
    if "fp32_flat_groups" in osd:  # ZeRO-3
        base, flats, stage = osd["optimizer_state_dict"], osd["fp32_flat_groups"], 3
    elif "single_partition_of_fp32_groups" in osd:  # ZeRO-1/2, BF16_Optimizer
        base, flats = osd["base_optimizer_state"], osd["single_partition_of_fp32_groups"]
        stage = int(osd.get("zero_stage", 1))
    else:
        raise UniversalCheckpointError(f"{f!r}: unknown DeepSpeed optimizer file layout (keys {sorted(osd)[:8]})")
    states = base.get("state", {}) if isinstance(base, dict) else {}
    if not states or not all(isinstance(s, dict) and "segments" in s for s in states.values()):
        keys = sorted({k for s in states.values() if isinstance(s, dict) for k in s})
        if "exp_avg" in keys:
            raise UniversalCheckpointError(
                f"{f!r} is an Adam/AdamW DeepSpeed checkpoint, not Gefen's. Convert it with DeepSpeed's own "
                "converter (python -m deepspeed.checkpoint.ds_to_universal --input_folder CKPT/TAG "
                "--output_folder OUT); gefen_dist.integrations.deepspeed.load_universal(engine, OUT) then "
                "warm-starts Gefen from it.")
        raise UniversalCheckpointError(f"{f!r}: optimizer state without Gefen's DeepSpeed 'segments' (state keys "
                                       f"{keys[:8]}): not saved by gefen_dist.integrations.deepspeed.Gefen")
    if len(states) != len(flats):
        raise UniversalCheckpointError(f"{f!r}: {len(states)} optimizer states but {len(flats)} fp32 partitions")
    return osd, base, flats, stage


def _add_partition(f: str, st: Dict[str, Any], flat: torch.Tensor, tensors: Dict[str, "_Tensor"],
                   order: List[str], keys: Dict[str, Segment]) -> None:
    """Copy one flat partition's segments (fp32 values and Gefen state) into the global tensors; the
    replicated block state of tensors kept per block of rows (D16) is read by :func:`_add_span_state`
    once every file's segments are known (``keys``: key -> a segment of that tensor, any rank's)."""
    factored = mode_of_saved(st) == MODE_FACTORED  # a file's state: no spec, its keys say
    segs = [Segment.from_dict(d) for d in st["segments"]]
    keys.update((s.key, s) for s in segs)
    span_keys = set(st.get("span_keys", []))
    span_shapes = {s.shape for s in segs if s.key in span_keys}  # D16 is decided by shape within a buffer
    r8 = {s.key for s in segs if s.key in span_keys and st.get("narrow_rows") == "rows8"
          and _rows8.rows8_eligible(s.shape)}  # D19: what FlatSegments.is_rows8 decides under that setting
    slots, _, _, _ = _slots(segs, st["periods"], None, factored, st.get("row_blocks", 1),
                            few_rows_shared=few_rows_shared_in(st),  # D15's versions (withdrawn) kept them shared
                            span=(lambda shape: tuple(shape) in span_shapes) if span_shapes else None,
                            col_blocks=st.get("col_blocks", 1) if factored else 1)
    for sp, learned in zip(slots, st["learned"]):
        s = sp.seg
        t = tensors.get(s.name)
        if t is None:
            G = sp.vcol_n // _periods.row_slab(s.shape) if (sp.factored and sp.vcol_n) else 1
            t = tensors[s.name] = _Tensor(s.name, s.shape, 0 if sp.exact else sp.period, sp.factored or sp.span,
                                          row_blocks=G, span=sp.span, rows8=s.key in r8, col_blocks=sp.colb)
            order.append(s.name)
        elif (t.shape != s.shape or t.exact != sp.exact or t.span != sp.span or t.rows8 != (s.key in r8)
              or (not sp.exact and t.period != sp.period) or t.col_blocks != sp.colb):
            raise UniversalCheckpointError(f"{f!r}: ranks disagree on tensor {s.name!r} (shape/period)")
        t.step = int(st["step"])
        if not s.numel:
            continue
        a, n, fo = s.param_offset, s.numel, s.flat_offset
        if fo + n > flat.numel():
            raise UniversalCheckpointError(f"{f!r}: segment of {s.name!r} beyond its fp32 partition")
        t.fp32[a:a + n] = flat[fo:fo + n]
        t.covered[a:a + n] = True
        if sp.exact:
            t.exp_avg[a:a + n] = st["exact_m"][sp.exact_off:sp.exact_off + n].float()
            t.exp_avg_sq[a:a + n] = st["exact_v"][sp.exact_off:sp.exact_off + n].float()
            continue
        t.learned = bool(learned)
        t.idx[a:a + n] = st["idx"][fo:fo + n]
        if sp.span:
            continue
        B = sp.block
        t.scale[a // B:a // B + sp.scale_n] = st["scale"][sp.scale_off:sp.scale_off + sp.scale_n].float()
        if sp.factored:
            S = t.slab
            K = t.col_blocks  # (D21: K entries per row)
            t.v_row[a // S * K:a // S * K + sp.v_n] = st["v_row"][sp.v_off:sp.v_off + sp.v_n].float()
            t.v_col.copy_(st["v_col"][sp.vcol_off:sp.vcol_off + sp.vcol_n].float())
        else:  # shared; in a factored buffer a few-row tensor's v lives in v_row (D15)
            P = sp.period
            t.v[a // P:a // P + sp.v_n] = st["v_row" if factored else "v"][sp.v_off:sp.v_off + sp.v_n].float()
    for key, (ro, r0, r1) in rows8_rows(segs, r8).items():  # D19: the codes of the rows the pieces touch
        t = tensors[keys[key].name]
        codes = st["span_codes"][ro:ro + r1 - r0].cpu()
        seen = t.codes_read[r0:r1]
        if not torch.equal(t.codes[r0:r1][seen], codes[seen]):  # a row cut by a partition edge: both ranks keep it
            raise UniversalCheckpointError(f"{f!r}: ranks disagree on the row codes of {t.name!r}")
        t.codes[r0:r1] = codes
        t.codes_read[r0:r1] = True


def _add_span_state(f: str, sst: Dict[str, Any], tensors: Dict[str, "_Tensor"], keys: Dict[str, Segment]) -> None:
    """The block state of a buffer's tensors kept per block of rows (D16): ``span_scale``, ``span_vblk``
    and ``span_vcol`` hold every such tensor of the buffer's catalog in ``span_keys`` order (the same
    on every rank of its group; each rank's copy is checked against the first one read)."""
    bo = co = 0
    for key in sst["span_keys"]:
        seg = keys.get(key)
        if seg is None:
            raise UniversalCheckpointError(f"{f!r}: tensor key {key!r} of the span state is held by no rank")
        t = tensors[seg.name]
        nb, S = _span.span_blocks(seg.shape), _periods.row_slab(seg.shape)
        if not t.span or sst["span_scale"].numel() < bo + nb or sst["span_vcol"].numel() < co + S:
            raise UniversalCheckpointError(f"{f!r}: the span state of {seg.name!r} does not match its layout")
        got = [sst["span_scale"][bo:bo + nb].float(), sst["span_vblk"][bo:bo + nb].float(),
               sst["span_vcol"][co:co + S].float()]
        if t.span_read:
            if not all(torch.equal(x, y) for x, y in zip(got, (t.scale, t.v_blk, t.v_col))):
                raise UniversalCheckpointError(f"{f!r}: ranks disagree on the block state of {seg.name!r}")
        else:
            t.scale.copy_(got[0])
            t.v_blk.copy_(got[1])
            t.v_col.copy_(got[2])
            t.span_read = True
        bo, co = bo + nb, co + S


def read_gefen_checkpoint(tag_dir: str) -> Dict[str, Any]:
    """Assemble the full per-tensor Gefen state of a rigid DeepSpeed checkpoint (all ranks).

    Returns ``{"tensors": {name: _Tensor}, "codebook", "second_moment", "step", "world_size",
    "zero_stage", "global_state" (rank 0's non-sharded optimizer keys), "param_groups"}``.
    """
    files = _optim_files(tag_dir)
    tensors: Dict[str, _Tensor] = {}
    order: List[str] = []
    cb, steps, modes, stage, nib = None, set(), set(), None, False
    global_state, param_groups = None, None
    keys: Dict[str, Segment] = {}
    span_states = []  # (file, the replicated D16 block state of a buffer)
    for rank, f in files:
        obj = _load(f)
        osd, base, flats, stage = _rank_states(f, obj)
        states = base["state"]
        if rank == 0:
            global_state = {k: v for k, v in osd.items() if k not in _SHARDED}
            param_groups = base.get("param_groups")
        for k, flat in zip(sorted(states), flats):
            st = states[k]
            modes.add(mode_of_saved(st))  # factored or shared (a flat buffer's state always has idx)
            steps.add(int(st["step"]))
            c = st.get("codebook")
            nib |= isinstance(c, torch.Tensor) and c.numel() == _nb.NIBBLE_CODEWORDS  # one byte, two codes (D20)
            if isinstance(c, torch.Tensor) and c.numel() and float(c[0]) == -1.0:
                if cb is not None and not torch.equal(cb, c.float()):
                    raise UniversalCheckpointError(f"{f!r}: two different learned codebooks in one checkpoint")
                cb = c.float().clone()
            _add_partition(f, st, flat.reshape(-1).float(), tensors, order, keys)
            if st.get("span_keys"):
                span_states.append((f, {k: st[k] for k in ("span_keys", "span_scale", "span_vblk", "span_vcol")}))
        del obj
    for f, sst in span_states:
        _add_span_state(f, sst, tensors, keys)
    missing = [n for n in order if not bool(tensors[n].covered.all())]
    if missing:
        raise UniversalCheckpointError(f"{tag_dir!r}: tensors not fully covered by the {len(files)} optimizer files: "
                                       f"{missing[:4]} (missing ranks?)")
    if len(steps) > 1:
        raise UniversalCheckpointError(f"{tag_dir!r}: partitions at different steps {sorted(steps)}")
    if nib and modes == {MODE_FACTORED}:  # the factored layout's tensors, read as two codes per byte
        modes = {NIBBLES}
    if len(modes) > 1 or (nib and modes != {NIBBLES}):
        raise UniversalCheckpointError(f"{tag_dir!r}: several second moments in one checkpoint ({sorted(modes)})")
    return dict(tensors={n: tensors[n] for n in order}, codebook=cb, second_moment=modes.pop(),
                step=steps.pop(), world_size=len(files), zero_stage=stage, global_state=global_state or {},
                param_groups=param_groups or [])


# ============================================================================ convert
def _record(t: "_Tensor") -> Dict[str, Any]:
    """A tensor's entry in the metadata: what its Adam-shaped files cannot say."""
    rec = dict(shape=list(t.shape), kind="exact" if t.exact else "quantized", period=t.period,
               scale_block=t.block, learned=bool(t.learned))
    if not t.exact and t.rows8:  # D19: the codes and their block references (exp_avg's row maxima are
        # not the scales: a row's scale is its maximum rounded up to a code)
        rec.update(span=True, rows8=True, scale=t.scale.clone(), v_blk=t.v_blk.clone(), v_col=t.v_col.clone(),
                   codes=t.codes.clone())
    elif not t.exact and t.span:  # D16: scale is the block absmax of exp_avg; v per block and column
        rec.update(span=True, v_blk=t.v_blk.clone(), v_col=t.v_col.clone())
    elif not t.exact and t.factored:
        rec.update(v_row=t.v_row.clone(), v_col=t.v_col.clone(), col_blocks=t.col_blocks)
    return rec


def convert(ckpt_dir: str, out_dir: str, tag: Optional[str] = None) -> Dict[str, Any]:
    """Write the universal form of a rigid Gefen DeepSpeed checkpoint to ``out_dir`` (must not exist).

    Layout (DeepSpeed's ``ds_to_universal``, plus the Gefen metadata)::

        out_dir/zero/<param name>/{fp32,exp_avg,exp_avg_sq}.pt   {"param": full fp32 tensor}
        out_dir/zero/<param name>/step.pt                        tensor(step) (torch Adam's type)
        out_dir/zero/optimizer_state.pt                          loss scaler, clip, ds_version, param_groups
        out_dir/*model_states.pt                                 copied (lr scheduler, global steps, ...)
        out_dir/gefen_universal.pt                               codebook, periods, v_row/v_col, step
        dirname(out_dir)/latest_universal                        basename(out_dir)

    Written to ``out_dir.tmp-<pid>`` and renamed; returns a summary dict.
    """
    tag_dir = resolve_tag_dir(ckpt_dir, tag)
    out_dir = os.path.abspath(out_dir.rstrip("/"))
    if os.path.exists(out_dir):
        raise UniversalCheckpointError(f"output folder {out_dir!r} already exists; pass a new folder (nothing is "
                                       "overwritten)")
    info = read_gefen_checkpoint(tag_dir)
    model_files = sorted(glob.glob(os.path.join(tag_dir, "*model_states.pt")))
    if not model_files:
        raise UniversalCheckpointError(f"{tag_dir!r}: no *model_states.pt file")
    tmp = f"{out_dir}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    zero = os.path.join(tmp, "zero")
    os.makedirs(zero)
    try:
        cb = info["codebook"]
        meta_t = {}
        for name, t in info["tensors"].items():
            d = os.path.join(zero, name)
            os.makedirs(d, exist_ok=True)
            m, v = t.dequantized(cb)
            torch.save({"param": t.fp32.view(t.shape)}, os.path.join(d, "fp32.pt"))
            torch.save({"param": m.view(t.shape)}, os.path.join(d, "exp_avg.pt"))
            torch.save({"param": v.view(t.shape)}, os.path.join(d, "exp_avg_sq.pt"))
            torch.save(torch.tensor(float(t.step)), os.path.join(d, "step.pt"))
            meta_t[name] = _record(t)
        ms0 = _load(model_files[0])
        gs = dict(info["global_state"])
        gs.setdefault("ds_version", ms0.get("ds_version", "0.0.0") if isinstance(ms0, dict) else "0.0.0")
        gs["param_groups"] = info["param_groups"]
        gs["optimizer_state_dict"] = {"state": {0: {"step": torch.tensor(float(info["step"]))}},
                                      "param_groups": info["param_groups"]}
        torch.save(gs, os.path.join(zero, "optimizer_state.pt"))
        # parameters without optimizer state (frozen): their model values, as DeepSpeed's converter does
        module = ms0.get("module") if isinstance(ms0, dict) and info["zero_stage"] != 3 else None
        for name, val in (module or {}).items():
            d = os.path.join(zero, name)
            if torch.is_tensor(val) and not os.path.isdir(d):
                os.makedirs(d)
                torch.save({"param": val.float()}, os.path.join(d, "fp32.pt"))
        del ms0
        for f in model_files:
            shutil.copy2(f, tmp)
        meta = dict(format=FORMAT, version=VERSION, codebook=cb, second_moment=info["second_moment"],
                    step=int(info["step"]), tensors=meta_t,
                    source=dict(world_size=info["world_size"], zero_stage=info["zero_stage"], tag_dir=tag_dir))
        torch.save(meta, os.path.join(tmp, META_FILE))
        os.rename(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    root, leaf = os.path.split(out_dir)
    tmpl = os.path.join(root, f".latest_universal.tmp-{os.getpid()}")
    with open(tmpl, "w") as f:
        f.write(leaf)
    os.replace(tmpl, os.path.join(root, "latest_universal"))
    n_q = sum(1 for t in info["tensors"].values() if not t.exact)
    logger.info("wrote universal checkpoint %s: %d tensors (%d quantized), step %d, from world size %d (ZeRO-%s)",
                out_dir, len(info["tensors"]), n_q, info["step"], info["world_size"], info["zero_stage"])
    return dict(out_dir=out_dir, tensors=len(info["tensors"]), quantized=n_q, step=info["step"],
                world_size=info["world_size"], zero_stage=info["zero_stage"], second_moment=info["second_moment"])


def __getattr__(name: str):
    """``load_into_engine`` lives in :mod:`gefen_dist.integrations.ds_universal_load` (the load side);
    the name stays importable from here, as before."""
    if name == "load_into_engine":
        from .ds_universal_load import load_into_engine

        return load_into_engine
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
