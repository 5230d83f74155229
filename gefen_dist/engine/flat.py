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
    periods   list[int]            period per segment (0: exact; before learning the placeholder: the
                                   shape's period when factored, else the row length)
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
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from ..core import periods as _periods
from ..core import span as _span
from ..core.quant import NUM_BINS
from . import learning
from ..kernels import dispatch as _dispatch
from .layout import FEW_ROWS, Piece, few_rows, is_exact
from .state import (DEFAULT_NARROW_ROWS, MODE_FACTORED, NIBBLES, few_rows_shared_in, fixed_period, mode_of_saved,
                    new_step)
from .flat_layout import LayoutError, Segment, _slots, _split, verify_segments  # noqa: F401  (re-exported)
from .flat_span import FlatSpanMixin
from .flat_step import SegmentStepMixin

logger = logging.getLogger(__name__)


class FlatSegments(SegmentStepMixin, FlatSpanMixin):
    """The per-buffer machinery: global catalog (all ranks' pieces), plans, learning, stepping.

    ``comm`` is a :class:`gefen_dist.engine.comm.LocalComm`-like object for the buffer's own process group.
    Every method that communicates is entered by every rank of that group in the same order.
    """

    def __init__(self, segments: Sequence[Segment], comm, small_threshold: int, where: str = "flat buffer"):
        self.segments = list(segments)
        self.comm = comm
        self.small_threshold = small_threshold
        self.where = where
        self.second_moment: Optional[str] = None  # the mode of the group that last stepped it (set by its owner)
        self.narrow_rows = DEFAULT_NARROW_ROWS  # the buffer's param group's (set by its owner before new_state / learn / step)
        self.tensor_index: Optional[Dict[str, int]] = None  # key -> place in the owner's optimizer (keys D20's draws)
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
        return [k for k in sorted(cat) if not is_exact(cat[k]["shape"], self.small_threshold)
                or self.is_span(cat[k]["shape"])]

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
        spans = set(st.get("span_keys", []))
        return {k: _periods.scale_block_for(per, _periods.row_slab(cat[k]["shape"]))
                for k, per, lrn in zip(st["global_keys"], self._global_periods(st), st["global_learned"])
                if lrn and k not in spans}

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
                  row_blocks="auto", col_blocks=1) -> Dict[str, Any]:
        # placeholders: the period the mode fixes (factored, per block of columns with col_blocks, D21;
        # "nibbles", D20: the owner's second_moment, no column blocks), else the row until one is detected
        spanf = self._span_fn(factored)
        nib = self.second_moment == NIBBLES
        col_blocks = 1 if nib else col_blocks
        periods = [_span.span_period(s.shape) if spanf and spanf(s.shape) else
                   0 if is_exact(s.shape, self.small_threshold) else
                   (_periods.nibble_period(s.shape) if nib else
                    _periods.shape_period(s.shape, _periods.factored_col_blocks(s.shape, col_blocks)))
                   if factored else _periods.row_slab(s.shape)
                   for s in self.segments]
        slots, ns, nv, ne = _slots(self.segments, periods, self.small_threshold, factored, row_blocks, span=spanf,
                                   col_blocks=col_blocks)
        dev = flat.device
        qkeys = self.quantized_keys()
        st = {
            "step": new_step(0),
            "idx": torch.zeros(flat.numel(), dtype=torch.uint8, device=dev),
            "scale": torch.zeros(ns, dtype=torch.float32, device=dev),
        }
        if factored:
            st["v_row"] = torch.zeros(nv, dtype=torch.float32, device=dev)
            st["v_col"] = torch.zeros(sum(sp.vcol_n for sp in slots), dtype=torch.float32, device=dev)
            st["row_blocks"] = row_blocks
            st["col_blocks"] = col_blocks  # column blocks (D21; absent: saved before D21, one per row)
            st["few_rows"] = 0  # no tensor of few rows keeps a shared v (64 in the states of D15's versions)
        else:
            st["v"] = torch.zeros(nv, dtype=torch.float32, device=dev)
        st["narrow_rows"] = self.narrow_rows
        st["span_keys"] = self.span_keys(factored)
        lay = self.span_layout(st)
        nbt, nct = sum(v[1] for v in lay.values()), sum(v[3] for v in lay.values())
        for key, n in (("span_scale", nbt), ("span_vblk", nbt), ("span_vcol", nct)):
            st[key] = torch.zeros(n, dtype=torch.float32, device=dev)  # replicated, every span tensor (D16)
        if self.rows8_keys(st):  # D19: two one-byte codes per row the rank's rows8 pieces touch
            st["span_codes"] = torch.zeros(sum(r1 - r0 for _, r0, r1 in self.rows8_layout(st).values()), 2,
                                           dtype=torch.uint8, device=dev)
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

    def _reslot(self, st: Dict[str, Any], new_periods: List[int], factored: bool) -> None:
        """Move ``st`` to ``new_periods``; ``factored``: the buffer's second moment is factored (the
        ``factored`` its state was made with, :meth:`new_state`). A learned segment keeps its scales
        and shared ``v`` where its period is unchanged; a factored segment's ``v_row`` does not depend
        on the period and is always kept (``v_col`` neither, and is not moved)."""
        rb = st.get("row_blocks", 1) if factored else 1
        vkey = "v_row" if factored else "v"
        spanf = self._span_fn(factored)
        cb = st.get("col_blocks", 1) if factored else 1
        old, _, _, _ = _slots(self.segments, st["periods"], self.small_threshold, factored, rb, span=spanf, col_blocks=cb)
        new, ns, nv, _ = _slots(self.segments, new_periods, self.small_threshold, factored, rb, span=spanf, col_blocks=cb)
        scale = torch.zeros(ns, dtype=torch.float32, device=st["scale"].device)
        v = torch.zeros(nv, dtype=torch.float32, device=st[vkey].device)
        for o, n, learned in zip(old, new, st["learned"]):
            if o.exact:
                continue
            keep = learned and o.period == n.period
            if keep:
                scale[n.scale_off:n.scale_off + n.scale_n] = st["scale"][o.scale_off:o.scale_off + o.scale_n]
            if keep or o.factored:
                v[n.v_off:n.v_off + n.v_n] = st[vkey][o.v_off:o.v_off + o.v_n]
        st["scale"], st[vkey], st["periods"] = scale, v, list(new_periods)

    def continue_few_rows(self, st: Dict[str, Any]) -> bool:
        """Mark a loaded factored state with today's few-row layout (``st["few_rows"] = 0``): a state
        saved before D15 (no marker) already has it, and so does one of D15's versions (marker 64,
        withdrawn) whose catalog holds no learned tensor of few rows. One that does holds a shared ``v``
        for it where a ``v_row`` / ``v_col`` are expected: refused with a :class:`LayoutError` that
        names the tensors and the conversion that resumes it, on every rank (the catalog is the same on
        all of them; a rank whose partition holds none of that tensor would otherwise go on into the
        step's collectives alone). Returns True when ``st`` changed."""
        if mode_of_saved(st) != MODE_FACTORED or st.get("few_rows") == 0:
            return False
        if few_rows_shared_in(st):
            # decided on the global catalog (the same on every rank), so every rank raises or none does
            cat, spans = self.global_catalog(), set(st.get("span_keys", []))
            shared = [k for k, learned in zip(st.get("global_keys", []), st.get("global_learned", []))
                      if learned and k not in spans and few_rows(cat[k]["shape"])
                      and not is_exact(cat[k]["shape"], self.small_threshold)]
            if shared:
                raise LayoutError(
                    f"{self.where}: the optimizer state was saved by a gefen_dist version that kept a shared second "
                    f"moment for tensors of fewer than {FEW_ROWS} rows (D15, withdrawn: docs/algorithm.md); this "
                    f"version keeps them factored, so {', '.join(shared[:4])}{'...' if len(shared) > 4 else ''} "
                    "cannot be read in place. Convert the checkpoint (gefen-dist ds-to-universal) and load it with "
                    "gefen_dist.integrations.deepspeed.load_universal, which rebuilds every tensor's state in "
                    "today's layout")
        st["few_rows"] = 0
        return True

    # ------------------------------------------------------------------ learning (D4, D6, D3)
    def needs_learning(self, st: Dict[str, Any]) -> bool:
        return not all(st["global_learned"])

    def learn(self, st: Dict[str, Any], grad: torch.Tensor, codebook_needed: bool, *,
              second_moment: str, check_overflow: bool = False) -> Optional[torch.Tensor]:
        """Learn periods of tensors whose global gradient is nonzero for the first time, and (if
        ``codebook_needed``) return the histogram counts of those tensors (all-reduced), else None.
        ``second_moment``: the flat buffer's param group's (the state was made for it; the same on
        every rank); it fixes the periods it fixes (:func:`gefen_dist.engine.state.fixed_period`),
        the rest are detected. ``check_overflow``: first refuse, on every rank, a gradient whose
        squares the step would refuse (:meth:`step`), before anything is learned from it.
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
        held = {key: self.segments[local[key]] for key in live if key in local}
        spans = set(st.get("span_keys", []))
        if check_overflow:  # nothing learned from a gradient the step refuses (one SUM)
            self._refuse_overflow_before_learning(st, g, live, held, spans, second_moment)
        # 2) periods from decomposed statistics (one all-gather of partials)
        self._note_dense_span(g, [k for k in held if k in spans])
        new_period = learning.learn_periods_by_key(
            self.comm, {key: (cat[key]["shape"], _span.span_period(cat[key]["shape"])
                              if key in spans else fixed_period(cat[key]["shape"], second_moment,
                                                                 _periods.factored_col_blocks(cat[key]["shape"],
                                                                                              st.get("col_blocks", 1))))
                   for key in live},
            {key: Piece(local=None, grad=g[s.flat_offset:s.flat_offset + s.numel], start=s.param_offset,
                        shape=tuple(cat[key]["shape"])) for key, s in held.items()})
        periods = list(st["periods"])
        for i, s in enumerate(self.segments):
            if s.key in new_period:
                periods[i] = new_period[s.key]
        self._reslot(st, periods, second_moment in (MODE_FACTORED, NIBBLES))
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
        rest = [k for k in live if k not in spans]
        return self._histogram(g, rest, {k: _periods.scale_block_for(new_period[k], _periods.row_slab(cat[k]["shape"]))
                                         for k in rest}, [k for k in live if k in spans])

    def _histogram(self, g: torch.Tensor, live: Sequence[str], block_of: Dict[str, int],
                   span_live: Sequence[str] = ()) -> torch.Tensor:
        """The codebook histogram of the tensors ``live`` (all-reduced), cut blocks normalised by
        their global absmax (one all-gather of the cut blocks' partial absmax, one SUM), and of the
        span tensors ``span_live`` (D16: their blocks' absmax reduced first, one MAX)."""
        local = {s.key: i for i, s in enumerate(self.segments)}
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
        if span_live:
            self._span_histogram(g, span_live, counts)
        self.comm.all_reduce_sum_(counts)
        return counts

def counts_to_codebook(counts: torch.Tensor):
    return _dispatch.solve_codebook(counts.numpy())
