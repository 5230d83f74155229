"""Gefen on a flat buffer made of *segments* of many tensors (backend-neutral).

DeepSpeed ZeRO (and any framework of the same shape) hands the optimizer one 1-D fp32 buffer
per param group (ZeRO-1/2) or sub-group (ZeRO-3): the concatenation of contiguous pieces of
many parameters, cut at fixed offsets that ignore tensor and block boundaries. This module
steps such a buffer with exact per-tensor Gefen:

* each :class:`Segment` is one rank-local contiguous piece ``[param_offset, param_offset+numel)``
  of a global tensor (identified across ranks by a rank-independent ``key``), stored at
  ``flat[flat_offset : flat_offset+numel]``;
* whole blocks are stepped by the ordinary kernels (:mod:`gefen_dist.core.step`, the fused
  CPU kernel when available);
* blocks cut by the partition edges (D7) are *reconciled*: every rank holding a part computes
  its partial ``sum g^2`` (shared second moment) and partial ``max |m|`` (absmax scale), one
  small all-gather on the buffer's own process group combines them identically on every rank,
  and each rank finishes its part with the global values. The state of a cut block (its ``v``
  and scale) is duplicated on the ranks that share it and stays identical;
* at the first step with a nonzero gradient, periods come from decomposed statistics
  (:func:`gefen_dist.kernels.dispatch.grad_period_partials`, all-gathered and combined) and the codebook
  from an all-reduced histogram in which cut blocks are normalised by their global absmax, so
  periods and codebook equal single-process Gefen's.

State of one flat buffer (plain tensors, ints, lists and dicts only: checkpoints and DeepSpeed
tooling must not need to import gefen_dist)::

    step      int
    idx       uint8 [flat numel]   codebook indices (entries of exact segments/padding unused)
    scale     fp32  [slots]        absmax scales of the scale blocks each quantized segment touches
    v         fp32  [slots]        shared second moments of the v-blocks each segment touches
    exact_m   fp32  [n exact]      AdamW first moment of small / 1-D tensors (D2)
    exact_v   fp32  [n exact]      AdamW second moment of small / 1-D tensors
    codebook  fp32  [256]          the job's codebook (zeros until learned)
    periods   list[int]            period per segment (0: exact; row length: not yet learned)
    segments  list[dict]           the layout (key, name, shape, param_offset, flat_offset, numel)
    global_keys / global_learned   every tensor of this buffer on any rank, and whether its
                                   period is learned (identical on all ranks: they decide
                                   together when collectives are entered)
    global_periods                 the period of every tensor of ``global_keys`` (0: not learned),
                                   so every rank builds the same catalog of cut blocks

With the factored second moment (``second_moment="factored"``), ``v`` is replaced by::

    v_row     fp32  [rows]         EMA of the row mean of g^2, per row each segment touches (a row
                                   cut by a partition edge is held, identical, by each sharing rank)
    v_col     fp32  [sum of slabs] EMA of the column mean of g^2 over all rows: a full [slab] per
                                   non-empty quantized segment (identical on every holding rank)
"""
from __future__ import annotations

import logging
import math
from dataclasses import asdict, dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from .core import periods as _periods
from .core.quant import NUM_BINS
from .core.step import (adamw_step_, apply_, bias_corrections, block_column_sumsq, column_factors, decay_only_, ema_,
                        first_moment, inv_rms_, quantize)
from .kernels import dispatch as _dispatch
from .layout import is_exact

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Segment:
    """One rank-local contiguous piece of a global tensor inside a flat buffer."""

    key: str  # identical on every rank for the same tensor, unique within the buffer
    name: str
    shape: Tuple[int, ...]  # global shape
    param_offset: int  # start inside the flattened global tensor
    flat_offset: int  # start inside the flat buffer
    numel: int

    def as_dict(self) -> Dict[str, Any]:
        d = asdict(self)
        d["shape"] = list(self.shape)
        return d

    @classmethod
    def from_dict(cls, d: Dict[str, Any]) -> "Segment":
        return cls(d["key"], d["name"], tuple(int(s) for s in d["shape"]), int(d["param_offset"]),
                   int(d["flat_offset"]), int(d["numel"]))


class LayoutError(RuntimeError):
    """The flat buffer's layout could not be recovered or does not match the parameters."""


def verify_segments(flat: torch.Tensor, segments: Sequence[Segment], sources: Sequence[torch.Tensor],
                    where: str) -> None:
    """Check once that ``flat[segment] == source[segment]`` (the flat master copy of each piece
    equals the parameter's data, in the parameter's dtype); raise :class:`LayoutError` if not."""
    covered = 0
    flat_v = flat.detach().reshape(-1)
    for seg, src in zip(segments, sources):
        if seg.flat_offset < 0 or seg.flat_offset + seg.numel > flat_v.numel():
            raise LayoutError(f"{where}: segment of {seg.name!r} [{seg.flat_offset}, +{seg.numel}) lies outside "
                              f"the flat buffer of {flat_v.numel()} elements")
        covered += seg.numel
        if src is None or src.numel() == 0 or seg.numel == 0:
            continue
        a = flat_v[seg.flat_offset:seg.flat_offset + seg.numel]
        b = src.detach().reshape(-1)
        if b.numel() < seg.numel:
            continue  # data not resident here (swapped out): cannot compare
        b = b[:seg.numel] if b.numel() != math.prod(seg.shape) else b[seg.param_offset:seg.param_offset + seg.numel]
        if not torch.equal(a.to(device=b.device, dtype=b.dtype), b):
            raise LayoutError(
                f"{where}: the flat optimizer buffer does not hold parameter {seg.name!r} (shape {seg.shape}) "
                f"elements [{seg.param_offset}, {seg.param_offset + seg.numel}) at offset {seg.flat_offset}. "
                "The recovered layout is wrong (for DeepSpeed ZeRO-1/2 with round_robin_gradients this is a known "
                "DeepSpeed mapping bug: build the engine with gefen_dist.integrations.deepspeed.initialize, or "
                "disable round_robin_gradients). Refusing to treat the buffer as one tensor."
            )
    if covered > flat_v.numel():
        raise LayoutError(f"{where}: segments cover {covered} elements, more than the buffer's {flat_v.numel()}")


# --------------------------------------------------------------------------- plans
@dataclass
class _SegPlan:
    seg: Segment
    exact: bool
    period: int = 0
    block: int = 0  # scale block B (a multiple of the period)
    scale_off: int = 0
    scale_n: int = 0
    v_off: int = 0
    v_n: int = 0
    exact_off: int = 0
    vcol_off: int = 0  # factored: this segment's full v_col ([slab]) in st["v_col"]
    vcol_n: int = 0


def _plan(segments: Sequence[Segment], periods: Sequence[int], small_threshold: Optional[int],
          factored: bool = False, row_blocks=1) -> Tuple[List[_SegPlan], int, int, int]:
    """Offsets of every segment's state. Shared second moment: ``v`` per touched v-block (period).
    Factored (``factored=True``): ``v`` is ``v_row``, one entry per touched row (independent of the
    period), and ``vcol_off``/``vcol_n`` place a full ``v_col`` per non-empty quantized segment:
    ``G x slab`` floats with ``G = factored_row_blocks(shape, row_blocks)`` row blocks (D12; the
    state records its rule as ``st["row_blocks"]``, 1 for states saved before D12).
    ``small_threshold=None`` reads a *saved* state without knowing the optimizer's threshold: a
    segment is exact iff its period is 0 (quantized segments always have a period >= 1)."""
    out, so, vo, eo, co = [], 0, 0, 0, 0
    for seg, per in zip(segments, periods):
        if (int(per) == 0) if small_threshold is None else is_exact(seg.shape, small_threshold):
            out.append(_SegPlan(seg, True, exact_off=eo))
            eo += seg.numel
            continue
        slab = _periods.row_slab(seg.shape)
        B = _periods.scale_block_for(per, slab)
        a, e = seg.param_offset, seg.param_offset + seg.numel
        vu = slab if factored else per
        sn = ((e - 1) // B - a // B + 1) if seg.numel else 0
        vn = ((e - 1) // vu - a // vu + 1) if seg.numel else 0
        cn = slab * _periods.factored_row_blocks(seg.shape, row_blocks) if (factored and seg.numel) else 0
        out.append(_SegPlan(seg, False, per, B, so, sn, vo, vn, vcol_off=co, vcol_n=cn))
        so += sn
        vo += vn
        co += cn
    return out, so, vo, eo


def _split(a: int, e: int, B: int) -> Tuple[int, int, List[Tuple[int, int, int]]]:
    """Split ``[a, e)`` into whole blocks of ``B`` (``[lo, hi)``) and the blocks it covers only
    partly: ``(lo, hi, [(block index, start, end), ...])``."""
    if e <= a:
        return a, a, []
    A = -(-a // B) * B
    E = (e // B) * B
    if A > E:  # inside one block, aligned on neither side
        return a, a, [(a // B, a, e)]
    parts = []
    if a < A:
        parts.append((a // B, a, A))
    if E < e:
        parts.append((E // B, E, e))
    return A, E, parts


class FlatSegments:
    """The per-buffer machinery: global catalog (all ranks' pieces), plans, learning, stepping.

    ``comm`` is a :class:`gefen_dist.comm.LocalComm`-like object for the buffer's own process group.
    Every method that communicates is entered by every rank of that group in the same order.
    """

    def __init__(self, segments: Sequence[Segment], comm, small_threshold: int, where: str = "flat buffer"):
        self.segments = list(segments)
        self.comm = comm
        self.small_threshold = small_threshold
        self.where = where
        keys = [s.key for s in self.segments]
        if len(set(keys)) != len(keys):
            raise LayoutError(f"{where}: a tensor appears twice in one flat buffer ({keys})")
        self._global: Optional[Dict[str, Dict[str, Any]]] = None

    # ------------------------------------------------------------------ catalog
    def global_catalog(self) -> Dict[str, Dict[str, Any]]:
        """key -> {shape, pieces: [(start, numel)]} over all ranks (one all-gather, cached)."""
        if self._global is None:
            mine = [(s.key, s.shape, s.param_offset, s.numel) for s in self.segments]
            allr = self.comm.all_gather_object(mine)
            cat: Dict[str, Dict[str, Any]] = {}
            for r in allr:
                for key, shape, start, n in r:
                    ent = cat.setdefault(key, {"shape": tuple(shape), "pieces": []})
                    if n:
                        ent["pieces"].append((int(start), int(n)))
            for key, ent in cat.items():
                ent["pieces"] = sorted(set(ent["pieces"]))
                pos = 0
                for st, n in ent["pieces"]:
                    if st != pos:
                        raise LayoutError(f"{self.where}: the pieces of tensor {key!r} on all ranks do not tile it "
                                          f"(gap or overlap at element {pos})")
                    pos = st + n
                if pos != math.prod(ent["shape"]):
                    raise LayoutError(f"{self.where}: the pieces of tensor {key!r} cover {pos} of "
                                      f"{math.prod(ent['shape'])} elements")
            self._global = cat
        return self._global

    def global_keys(self) -> List[str]:
        return sorted(self.global_catalog())

    def quantized_keys(self) -> List[str]:
        cat = self.global_catalog()
        return [k for k in sorted(cat) if not is_exact(cat[k]["shape"], self.small_threshold)]

    def cut_blocks(self, block_of: Dict[str, int]) -> List[Tuple[str, int]]:
        """(key, block) of every scale block shared by several pieces, identical on all ranks."""
        cat = self.global_catalog()
        out = set()
        for key, B in block_of.items():
            for st, _ in cat[key]["pieces"]:
                if st % B:
                    out.add((key, st // B))
        return sorted(out)

    def _global_periods(self, st: Dict[str, Any]) -> List[int]:
        """Period of every tensor of ``st["global_keys"]`` (0: not learned), identical on every rank.
        States saved before this list existed rebuild it with one all-gather (every rank enters)."""
        gp = st.get("global_periods")
        if gp is None:
            mine = {s.key: int(per) for s, per, lrn in zip(self.segments, st["periods"], st["learned"])
                    if lrn and per}
            allp: Dict[str, int] = {}
            for d in self.comm.all_gather_object(mine):
                allp.update(d)
            gp = st["global_periods"] = [allp.get(k, 0) if lrn else 0
                                         for k, lrn in zip(st["global_keys"], st["global_learned"])]
        return gp

    def _global_blocks(self, st: Dict[str, Any]) -> Dict[str, int]:
        """key -> scale block of every learned quantized tensor of the buffer, held here or not
        (the cut catalog must be identical on every rank, including ranks that hold none of a
        tensor cut between two others)."""
        cat = self.global_catalog()
        return {k: _periods.scale_block_for(per, _periods.row_slab(cat[k]["shape"]))
                for k, per, lrn in zip(st["global_keys"], self._global_periods(st), st["global_learned"]) if lrn}

    def _exchange(self, sums: torch.Tensor, maxes: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """One all-gather of ``[sums | maxes]`` (float64); SUM and MAX combined in rank order."""
        k = sums.numel()
        if k == 0 or self.comm.world_size == 1:
            return sums, maxes
        import torch.distributed as dist

        dev = getattr(self.comm, "_device", torch.device("cpu"))
        buf = torch.cat([sums, maxes]).to(dev)
        out = [torch.empty_like(buf) for _ in range(self.comm.world_size)]
        dist.all_gather(out, buf, group=self.comm.group)
        allr = torch.stack(out).cpu()
        s = torch.zeros(k, dtype=torch.float64)
        for r in range(allr.shape[0]):  # fixed order: identical on every rank
            s += allr[r, :k]
        return s, allr[:, k:].amax(dim=0)

    # ------------------------------------------------------------------ state
    def new_state(self, flat: torch.Tensor, codebook: torch.Tensor, factored: bool = False,
                  row_blocks="auto") -> Dict[str, Any]:
        periods = [0 if is_exact(s.shape, self.small_threshold) else _periods.row_slab(s.shape)
                   for s in self.segments]
        plan, ns, nv, ne = _plan(self.segments, periods, self.small_threshold, factored, row_blocks)
        dev = flat.device
        qkeys = self.quantized_keys()
        st = {
            "step": 0,
            "idx": torch.zeros(flat.numel(), dtype=torch.uint8, device=dev),
            "scale": torch.zeros(ns, dtype=torch.float32, device=dev),
        }
        if factored:
            st["v_row"] = torch.zeros(nv, dtype=torch.float32, device=dev)
            st["v_col"] = torch.zeros(sum(sp.vcol_n for sp in plan), dtype=torch.float32, device=dev)
            st["row_blocks"] = row_blocks
        else:
            st["v"] = torch.zeros(nv, dtype=torch.float32, device=dev)
        st.update({
            "exact_m": torch.zeros(ne, dtype=torch.float32, device=dev),
            "exact_v": torch.zeros(ne, dtype=torch.float32, device=dev),
            "codebook": codebook,
            "periods": periods,
            "learned": [int(p == 0) for p in periods],
            "segments": [s.as_dict() for s in self.segments],
            "global_keys": qkeys,
            "global_learned": [0] * len(qkeys),
            "global_periods": [0] * len(qkeys),
        })
        return st

    def check_state(self, st: Dict[str, Any], flat: torch.Tensor) -> None:
        """Raise if a loaded state was saved with a different layout."""
        saved = [Segment.from_dict(d) for d in st.get("segments", [])]
        if saved != self.segments:
            diff = next(((a, b) for a, b in zip(saved, self.segments) if a != b), None)
            raise LayoutError(
                f"{self.where}: the optimizer state was saved with a different layout ({len(saved)} segments vs "
                f"{len(self.segments)} now; first difference {diff}). Resume with the same world size, ZeRO stage "
                "and param groups, or convert the checkpoint (gefen-dist ds-to-universal) and load it with "
                "gefen_dist.integrations.deepspeed.load_universal."
            )
        if st["idx"].numel() != flat.numel() or st["idx"].dtype != torch.uint8:
            raise LayoutError(f"{self.where}: saved idx has {st['idx'].numel()} elements of {st['idx'].dtype}, "
                              f"expected {flat.numel()} uint8")

    def _replan(self, st: Dict[str, Any], new_periods: List[int]) -> None:
        if "v_col" in st:  # factored: v_row / v_col do not depend on the period, only scale does
            rb = st.get("row_blocks", 1)
            old, _, _, _ = _plan(self.segments, st["periods"], self.small_threshold, True, rb)
            new, ns, _, _ = _plan(self.segments, new_periods, self.small_threshold, True, rb)
            scale = torch.zeros(ns, dtype=torch.float32, device=st["scale"].device)
            for o, n, learned in zip(old, new, st["learned"]):
                if not o.exact and learned and o.period == n.period:
                    scale[n.scale_off:n.scale_off + n.scale_n] = st["scale"][o.scale_off:o.scale_off + o.scale_n]
            st["scale"], st["periods"] = scale, list(new_periods)
            return
        old, _, _, _ = _plan(self.segments, st["periods"], self.small_threshold)
        new, ns, nv, _ = _plan(self.segments, new_periods, self.small_threshold)
        scale = torch.zeros(ns, dtype=torch.float32, device=st["scale"].device)
        v = torch.zeros(nv, dtype=torch.float32, device=st["v"].device)
        for o, n, learned in zip(old, new, st["learned"]):
            if not o.exact and learned and o.period == n.period:
                scale[n.scale_off:n.scale_off + n.scale_n] = st["scale"][o.scale_off:o.scale_off + o.scale_n]
                v[n.v_off:n.v_off + n.v_n] = st["v"][o.v_off:o.v_off + o.v_n]
        st["scale"], st["v"], st["periods"] = scale, v, list(new_periods)

    # ------------------------------------------------------------------ learning (D4, D6, D3)
    def needs_learning(self, st: Dict[str, Any]) -> bool:
        return not all(st["global_learned"])

    def learn(self, st: Dict[str, Any], grad: torch.Tensor, codebook_needed: bool,
              elementwise: bool = False) -> Optional[torch.Tensor]:
        """Learn periods of tensors whose global gradient is nonzero for the first time, and (if
        ``codebook_needed``) return the histogram counts of those tensors (all-reduced), else None.
        ``elementwise`` (the flat buffer's param group has ``second_moment="elementwise"``): every
        period is 1, nothing is detected; the same collectives are entered (the group, hence the
        flag, is the same on every rank).
        """
        gkeys = st["global_keys"]
        local = {s.key: i for i, s in enumerate(self.segments)}
        g = grad.detach().reshape(-1)
        # 1) which unlearned tensors have a nonzero global gradient (one MAX)
        amax = torch.full((len(gkeys),), -2.0, dtype=torch.float64)
        for j, key in enumerate(gkeys):
            i = local.get(key)
            if i is None:
                continue
            s = self.segments[i]
            if st["learned"][i]:
                amax[j] = -1.0
            elif s.numel:
                amax[j] = float(g[s.flat_offset:s.flat_offset + s.numel].abs().max())
            else:
                amax[j] = 0.0
        self.comm.all_reduce_max_(amax)
        live = [k for j, k in enumerate(gkeys) if not st["global_learned"][j]
                and (float(amax[j]) > 0 or math.isnan(float(amax[j])))]
        if not live:
            return None
        cat = self.global_catalog()
        # 2) periods from decomposed statistics (one all-gather of partials)
        payload = {}
        cands = {}
        for key in live:
            n = math.prod(cat[key]["shape"])
            cands[key] = [] if elementwise else _periods.candidate_periods(n)
            i = local.get(key)
            if i is None or len(cands[key]) < 3:
                continue
            s = self.segments[i]
            part = _dispatch.grad_period_partials(g[s.flat_offset:s.flat_offset + s.numel],
                                                 s.param_offset, n, cands[key])
            payload[key] = part.to_payload()
        gathered = self.comm.all_gather_object(payload)
        new_period = {}
        for key in live:
            shape = cat[key]["shape"]
            n = math.prod(shape)
            if len(cands[key]) < 3:
                p_paper = 1
            else:
                parts = [_periods.PeriodPartials.from_payload(r[key]) for r in gathered if key in r]
                p_paper = _periods.select_paper_period(cands[key], _periods.combine_partials(parts, n))
            new_period[key] = _periods.resolve_period(p_paper, _periods.row_slab(shape))
        periods = list(st["periods"])
        for i, s in enumerate(self.segments):
            if s.key in new_period:
                periods[i] = new_period[s.key]
        self._replan(st, periods)
        for i, s in enumerate(self.segments):
            if s.key in new_period:
                st["learned"][i] = 1
        gper = self._global_periods(st)
        for j, key in enumerate(gkeys):
            if key in new_period:
                st["global_learned"][j] = 1
                gper[j] = new_period[key]
        if not codebook_needed:
            return None
        # 3) histogram, cut blocks normalised by their global absmax (one all-gather + one SUM)
        block_of = {k: _periods.scale_block_for(new_period[k], _periods.row_slab(cat[k]["shape"])) for k in live}
        cuts = self.cut_blocks(block_of)
        cut_pos = {c: j for j, c in enumerate(cuts)}
        pmax = torch.zeros(len(cuts), dtype=torch.float64)
        todo = []
        for key in live:
            i = local.get(key)
            if i is None or not self.segments[i].numel:
                continue
            s, B = self.segments[i], block_of[key]
            gs = g[s.flat_offset:s.flat_offset + s.numel]
            a, e = s.param_offset, s.param_offset + s.numel
            lo, hi, parts = _split(a, e, B)
            for b, ps, pe in parts:
                pmax[cut_pos[(key, b)]] = float(gs[ps - a:pe - a].float().abs().max())
            todo.append((gs, a, lo, hi, B, parts, key))
        _, gmax = self._exchange(torch.zeros(len(cuts), dtype=torch.float64), pmax)
        counts = torch.zeros(NUM_BINS, dtype=torch.int64)
        for gs, a, lo, hi, B, parts, key in todo:
            if hi > lo:
                _dispatch.block_histogram(gs[lo - a:hi - a], B, out=counts)
            for b, ps, pe in parts:
                x = gs[ps - a:pe - a].float()
                am = torch.tensor(float(gmax[cut_pos[(key, b)]]), dtype=torch.float32)
                z = x / am if float(am) > 0 else torch.zeros_like(x)
                bins = torch.floor((z + 1.0) * 2048.0).clamp_(0, NUM_BINS - 1).to(torch.int64)
                counts += torch.bincount(bins, minlength=NUM_BINS)
        self.comm.all_reduce_sum_(counts)
        return counts

    # ------------------------------------------------------------------ the step
    def step(self, flat: torch.Tensor, grad: torch.Tensor, st: Dict[str, Any], *, lr: float, beta1: float,
             beta2: float, eps: float, weight_decay: float, impl=None) -> None:
        """One Gefen step of every segment (``st['step']`` already incremented). ``impl``: the
        implementation that steps whole blocks / whole rows (a
        :class:`gefen_dist.kernels.dispatch.StepImpl`: the native CPU or the Triton kernels; None: the
        eager reference); cut blocks and rows are finished with the reference's phase functions."""
        impl = impl or _dispatch.select(flat, fused=False)
        bc1, bc2 = bias_corrections(st["step"], beta1, beta2)
        hp = dict(lr=lr, beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay, bc1=bc1, bc2=bc2)
        if "v_col" in st:
            return self._step_factored(flat, grad, st, hp, impl.quantized_step_factored_, impl.column_sumsq)
        plan, _, _, _ = _plan(self.segments, st["periods"], self.small_threshold)
        cb = st["codebook"]
        fv, gv = flat.detach().reshape(-1), grad.detach().reshape(-1)
        idx_all, scale_all, v_all = st["idx"], st["scale"], st["v"]
        # Phase 1: whole blocks through the kernels; partial blocks' partial statistics.
        pend = []  # (key, block, p, g, idx, scale slot view, v view, m)
        for sp, learned in zip(plan, st["learned"]):
            s = sp.seg
            if not s.numel:
                continue
            p = fv[s.flat_offset:s.flat_offset + s.numel]
            g = gv[s.flat_offset:s.flat_offset + s.numel]
            if sp.exact:
                adamw_step_(p, g, st["exact_m"][sp.exact_off:sp.exact_off + s.numel],
                            st["exact_v"][sp.exact_off:sp.exact_off + s.numel], **hp)
                continue
            if not learned:
                decay_only_(p, lr, weight_decay)
                continue
            P, B = sp.period, sp.block
            a, e = s.param_offset, s.param_offset + s.numel
            ix = idx_all[s.flat_offset:s.flat_offset + s.numel]
            sc = scale_all[sp.scale_off:sp.scale_off + sp.scale_n]
            vv = v_all[sp.v_off:sp.v_off + sp.v_n]
            lo, hi, parts = _split(a, e, B)
            if hi > lo:  # whole blocks [lo, hi)
                so, vo = lo // B - a // B, lo // P - a // P
                impl.quantized_step_(p[lo - a:hi - a], g[lo - a:hi - a], ix[lo - a:hi - a], sc[so:so + (hi - lo) // B],
                                     vv[vo:vo + (hi - lo) // P], cb, period=P, scale_block=B, **hp)
            for b, ps, pe in parts:
                r0, r1 = ps - a, pe - a
                gp = g[r0:r1].float()
                slot = b - a // B
                m = first_moment(ix[r0:r1], sc[slot], gp, cb, beta1)
                vs = vv[ps // P - a // P:(pe - 1) // P - a // P + 1]
                pend.append((s.key, b, P, p[r0:r1], gp, ix[r0:r1], sc[slot:slot + 1], vs, m,
                             float((gp.double() ** 2).sum()) if P > 1 else 0.0, float(m.abs().max())))
        # Exchange partial statistics of cut blocks (identical catalog on every rank).
        cuts = self.cut_blocks(self._global_blocks(st))
        if not cuts:
            if pend:
                raise LayoutError(f"{self.where}: internal error: partial blocks but no cut catalog")
            return
        pos = {c: j for j, c in enumerate(cuts)}
        sums = torch.zeros(len(cuts), dtype=torch.float64)
        maxes = torch.zeros(len(cuts), dtype=torch.float64)
        for key, b, P, *_rest, ssum, smax in pend:
            j = pos[(key, b)]
            sums[j] += ssum
            maxes[j] = max(float(maxes[j]), smax)
        tsum, tmax = self._exchange(sums, maxes)
        # Phase 2: finish partial blocks with the global statistics.
        sqrt_bc2 = math.sqrt(bc2)
        for key, b, P, p, gp, ix, sc, vs, m, _, _ in pend:
            j = pos[(key, b)]
            # the block's mean g^2 from the reconciled sum (P > 1), or the element's own (P == 1)
            ms = torch.tensor([float(tsum[j])], dtype=torch.float64).float() / P if P > 1 else gp * gp
            sigma = inv_rms_(ema_(vs, ms, beta2).sqrt(), eps, bc1, sqrt_bc2)
            A = torch.tensor([float(tmax[j])], dtype=torch.float32, device=m.device)
            sc.copy_(A)
            new = quantize(m, A, cb)
            ix.copy_(new)
            apply_(p, cb[new.long()] * A, sigma, lr, weight_decay)

    # ------------------------------------------------------------------ factored second moment
    def _step_factored(self, flat: torch.Tensor, grad: torch.Tensor, st: Dict[str, Any], hp: Dict[str, float],
                       whole_rows, sumsq) -> None:
        """One step with the factored (row x column) second moment (Adafactor's estimator).

        Per quantized tensor of ``R`` rows of ``S`` elements: ``v_col`` ([S], identical on every
        rank holding part of the tensor) is the EMA of the column mean of ``g^2`` over all ``R``
        rows; ``v_row`` (one entry per row a segment touches) the EMA of the row mean. Whole rows go
        through ``whole_rows`` (the native CPU or Triton kernel, or
        :func:`gefen_dist.core.step.quantized_step_factored_eager_`); rows and scale blocks cut by
        partition edges are reconciled (eager). One collective per buffer: a float64 SUM all-reduce
        of ``[column sums of every learned tensor | per-rank slots of cut-row partial sum g^2 and
        cut-block partial max |m|]`` (the slots are combined in rank order, so a cut row's ``v_row``
        and a cut block's scale are identical on the ranks that share them).
        """
        rbr = st.get("row_blocks", 1)
        plan, _, _, _ = _plan(self.segments, st["periods"], self.small_threshold, True, rbr)
        cat = self.global_catalog()
        cb = st["codebook"]
        lr, beta1, beta2, eps = hp["lr"], hp["beta1"], hp["beta2"], hp["eps"]
        bc1, bc2, weight_decay = hp["bc1"], hp["bc2"], hp["weight_decay"]
        fv, gv = flat.detach().reshape(-1), grad.detach().reshape(-1)
        idx_all, scale_all, vrow_all, vcol_all = st["idx"], st["scale"], st["v_row"], st["v_col"]
        # Global catalog of learned tensors (identical on every rank): column-sum offsets, cuts.
        fkeys = [k for k, lrn in zip(st["global_keys"], st["global_learned"]) if lrn]
        slab_of, col_off, nblk_of, nc = {}, {}, {}, 0
        for k in fkeys:
            slab_of[k] = _periods.row_slab(cat[k]["shape"])
            nblk_of[k] = _periods.factored_row_blocks(cat[k]["shape"], rbr)  # row blocks (D12)
            col_off[k] = nc
            nc += slab_of[k] * nblk_of[k]
        block_of = self._global_blocks(st)
        cut_rows = self.cut_blocks({k: slab_of[k] for k in fkeys})
        cut_blks = self.cut_blocks(block_of)
        row_pos = {c: j for j, c in enumerate(cut_rows)}
        blk_pos = {c: j for j, c in enumerate(cut_blks)}
        nr, nb = len(cut_rows), len(cut_blks)
        dev = flat.device  # the column sums stay on the buffer's device (no per-tensor copy on CUDA)
        cols = torch.zeros(nc, dtype=torch.float64, device=dev)
        slots = torch.zeros(nr + nb, dtype=torch.float64)
        # Phase 1: exact tensors, decay of unlearned ones, local statistics of learned ones.
        work = []
        for sp, learned in zip(plan, st["learned"]):
            s = sp.seg
            if not s.numel:
                continue
            p = fv[s.flat_offset:s.flat_offset + s.numel]
            g = gv[s.flat_offset:s.flat_offset + s.numel]
            if sp.exact:
                adamw_step_(p, g, st["exact_m"][sp.exact_off:sp.exact_off + s.numel],
                            st["exact_v"][sp.exact_off:sp.exact_off + s.numel], **hp)
                continue
            if not learned:
                decay_only_(p, lr, weight_decay)
                continue
            S, B = slab_of[s.key], sp.block
            a, e = s.param_offset, s.param_offset + s.numel
            ix = idx_all[s.flat_offset:s.flat_offset + s.numel]
            sc = scale_all[sp.scale_off:sp.scale_off + sp.scale_n]
            vr = vrow_all[sp.v_off:sp.v_off + sp.v_n]
            vc = vcol_all[sp.vcol_off:sp.vcol_off + sp.vcol_n]
            co = col_off[s.key]
            G = nblk_of[s.key]
            rb = cat[s.key]["shape"][0] // G
            lo, hi, rparts = _split(a, e, S)
            if hi > lo:
                cols[co:co + G * S] += block_column_sumsq(g[lo - a:hi - a], S, lo // S, rb, G, sumsq).to(dev)
            pend = []
            for r, ps, pe in rparts:  # rows cut by a partition edge
                r0, r1 = ps - a, pe - a
                gp = g[r0:r1].float()
                g2 = gp.double() ** 2
                c0 = ps - r * S + (r // rb) * S  # in the row's block of column sums
                cols[co + c0:co + c0 + (pe - ps)] += (gp * gp).double()  # as column_sumsq
                slots[row_pos[(s.key, r)]] += float(g2.sum())
                # first moment of the row piece, block by block (scale slots of the segment)
                first = ps // B - a // B
                nblk = (pe - 1) // B - ps // B + 1
                bl = (torch.arange(ps, pe, device=ix.device) // B) - ps // B
                m = first_moment(ix[r0:r1], sc[first:first + nblk][bl], gp, cb, beta1)
                lead = ps - (ps // B) * B  # pad to whole blocks with zeros (neutral for max |m|)
                am = torch.nn.functional.pad(m.abs(), (lead, nblk * B - lead - (pe - ps))).view(nblk, B).amax(dim=1)
                _, _, bparts = _split(ps, pe, B)
                for b, _, _ in bparts:  # scale blocks cut by the edge: partial max |m|
                    j = nr + blk_pos[(s.key, b)]
                    slots[j] = max(float(slots[j]), float(am[b - ps // B]))
                pend.append((r, r0, r1, gp, m, bl, am, first, nblk, [b for b, _, _ in bparts]))
            work.append((sp, p, g, ix, sc, vr, vc, co, S, B, a, lo, hi, pend, G, rb))
        if not work and nc == 0:
            return
        # One SUM all-reduce: column sums (zeros for tensors not held here) + per-rank slots.
        ws, rank = self.comm.world_size, self.comm.rank
        k = nr + nb
        if ws > 1 and nc + k:
            buf = torch.zeros(nc + ws * k, dtype=torch.float64, device=dev)
            buf[:nc] = cols
            buf[nc + rank * k:nc + (rank + 1) * k] = slots.to(dev)
            self.comm.all_reduce_sum_(buf)
            cols = buf[:nc]
            allr = buf[nc:].view(ws, k).cpu()  # the few cut-row / cut-block slots: read on the host
            rsum = torch.zeros(nr, dtype=torch.float64)
            for rr in range(ws):  # fixed order: identical on every rank
                rsum += allr[rr, :nr]
            bmax = allr[:, nr:].amax(dim=0) if nb else torch.zeros(0, dtype=torch.float64)
        else:
            rsum, bmax = slots[:nr], slots[nr:]
        # Phase 2: v_col, whole rows through the kernel, then the cut rows.
        sqrt_bc2 = math.sqrt(bc2)
        for sp, p, g, ix, sc, vr, vc, co, S, B, a, lo, hi, pend, G, rb in work:
            col_mean_sq = (cols[co:co + G * S] / rb).to(torch.float32).to(vc.device)
            so, ro = lo // B - a // B, lo // S - a // S
            nrow = (hi - lo) // S
            vcb = vc.view(G, S) if G > 1 else vc
            # updates v_col (always) and steps the whole rows [lo, hi) (possibly none)
            whole_rows(p[lo - a:hi - a], g[lo - a:hi - a], ix[lo - a:hi - a], sc[so:so + nrow * (S // B)],
                       vr[ro:ro + nrow], vcb, cb, col_mean_sq, scale_block=B, row0=lo // S, row_block=rb, **hp)
            if not pend:
                continue
            col_fb = column_factors(vcb)
            for r, r0, r1, gp, m, bl, am, first, nblk, cut in pend:
                col_f = col_fb[r // rb] if G > 1 else col_fb
                ps = a + r0
                tot = torch.tensor([float(rsum[row_pos[(sp.seg.key, r)]])], dtype=torch.float64).float() / S
                v1 = vr[r - a // S:r - a // S + 1]
                c0 = ps - r * S
                sigma = inv_rms_(ema_(v1, tot.to(v1.device), beta2).sqrt() * col_f[c0:c0 + (r1 - r0)], eps, bc1,
                                 sqrt_bc2)
                for b in cut:
                    am[b - ps // B] = float(bmax[blk_pos[(sp.seg.key, b)]])
                sblk = sc[first:first + nblk]
                sblk.copy_(am)
                A = am[bl]
                new = quantize(m, A, cb)
                ix[r0:r1].copy_(new)
                apply_(p[r0:r1], cb[new.long()] * A, sigma, lr, weight_decay)


def counts_to_codebook(counts: torch.Tensor):
    return _dispatch.solve_codebook(counts.numpy())
