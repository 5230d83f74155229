"""The step of a DeepSpeed flat buffer (D7): a mixin of :class:`gefen_dist.engine.flat.FlatSegments`,
which holds the layout, the catalog of cut blocks and the state."""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Dict, Optional, Tuple

import torch

from ..core import nibbles as _nb
from ..core import periods as _periods
from ..core import span as _span
from ..core.step import (adamw_step_, apply_, block_column_sumsq, column_factors, column_ratios, decay_only_, ema_,
                        first_moment, inv_rms_, quantize)
from ..kernels import dispatch as _dispatch
from .flat_batch import FlatBatch, batch_key, batch_kernels
from .flat_layout import LayoutError, _slots, _split
from .layout import is_exact
from .state import MODE_FACTORED, NIBBLES, quantized_mode


class SegmentStepMixin:
    """The step of a :class:`~gefen_dist.engine.flat.FlatSegments` buffer: whole blocks and rows through
    the implementation of :func:`gefen_dist.kernels.dispatch.select`, blocks and rows cut by the
    partition edges reconciled with one small collective and finished with the reference's phase
    functions (D7)."""

    # ------------------------------------------------------------------ the step
    def step(self, flat: torch.Tensor, grad: torch.Tensor, st: Dict[str, Any], *, second_moment: str,
             hp: Dict[str, Any], impl=None, check_overflow: bool = True, step: Optional[int] = None) -> None:
        """One Gefen step of every segment (``hp`` at the step it takes; the caller counts it when
        this returns). ``second_moment``: the buffer's param group's (the mode of its quantized
        segments; the state was made for it). ``hp``: the step's scalars,
        :func:`gefen_dist.core.step.hyperparameters` of the group (its ``bound`` None: unbounded).
        ``impl``: the implementation that steps whole blocks / whole rows (a
        :class:`gefen_dist.kernels.dispatch.StepImpl`: the native CPU or the Triton kernels; None: the
        eager reference); cut blocks and rows are finished with the reference's phase functions.
        First the statistics that the factored and span tensors reduce over the ranks (they write
        nothing): with ``check_overflow``, a squared gradient that overflows float32 raises there, on
        every rank (the sums are reduced), before anything of the buffer changes. ``second_moment="nibbles"``
        (D20): the factored layout's statistics and reconciliation, the one-byte codes' step; ``step`` (the
        step taken, as ``hp``'s) keys its random numbers with :attr:`tensor_index`."""
        impl = impl or _dispatch.select(flat, fused=False)
        nib = second_moment == NIBBLES
        factored = second_moment == MODE_FACTORED or nib
        rbr = st.get("row_blocks", 1) if factored else 1
        layout, ctx = self._step_layout(st, factored, rbr)
        fv, gv = flat.detach().reshape(-1), grad.detach().reshape(-1)
        batch = self._batch(impl, flat, gv, st, layout, ctx, factored, rbr, nib)
        # (the segments a batch steps whole need nothing of the per-segment phases)
        learned = _learned_segments(layout, st, fv, gv, batch.whole if batch is not None else ())
        fact = self._factored_stats(st, hp, [w for w in learned if w[0].factored], ctx, flat.device,
                                    impl.column_sumsq, batch, gv, nib) if factored else None
        span = self._span_stats(st, hp, [w for w in learned if w[0].span], impl) if st.get("span_keys") else None
        if check_overflow:
            _refuse_overflow(self.where, fact[1] if fact else None, span["sums"] if span else None)
        _step_exact_and_decay(layout, st, fv, gv, hp, batch)
        if fact is not None and nib:
            if batch is not None:
                batch.step_nibbles(fact[1], gv, st["codebook"], hp, step)
            _nibbles_finish(*fact, st["codebook"], hp, impl, self._nibble_keys(step), batch)
        elif fact is not None:
            if batch is not None:
                batch.step_factored(fact[1], gv, st["codebook"], hp)
            self._factored_finish(*fact, st["codebook"], hp, impl.quantized_step_factored_,
                                  batch.fpos if batch is not None else ())
        # the shared second moment: every segment of a shared / elementwise buffer, the few-row
        # tensors of a factored one (D15, their v in st["v_row"])
        if batch is not None:
            batch.step_shared(gv, st["codebook"], hp)
        self._step_shared(st, hp, [w for w in learned if not w[0].factored and not w[0].span], impl,
                          st["v_row"] if factored else st["v"], second_moment,
                          batch.shared_keys if batch is not None else ())
        if span is not None:
            self._span_finish(st, hp, span, impl)

    def _step_layout(self, st: Dict[str, Any], factored: bool, rbr) -> tuple:
        """The buffer's slots (``_slots``) and, for a factored buffer, its :meth:`_factored_catalog`,
        kept while what they are made of stays the same (the periods, which tensors have learned
        here and in the catalog, the span tensors); neither changes after the first steps."""
        gp = st.get("global_periods")
        cbk = st.get("col_blocks", 1) if factored else 1  # column blocks (D21)
        key = (tuple(st["periods"]), self.small_threshold, factored, rbr, cbk, self.narrow_rows,
               tuple(st.get("global_learned", ())), None if gp is None else tuple(gp), tuple(st.get("span_keys", ())))
        hit = self.__dict__.get("_layout_memo")
        if hit is not None and hit[0] == key and gp is not None:
            return hit[1]
        layout = _slots(self.segments, st["periods"], self.small_threshold, factored, rbr, span=self._span_fn(factored),
                        col_blocks=cbk)[0]
        # (without "global_periods", an old state's, the catalog rebuilds it with a collective: not kept)
        out = (layout, self._factored_catalog(st, rbr) if factored else None)
        self._layout_memo = (key, out)
        return out

    def _batch(self, impl, flat, gv, st, layout, ctx, factored, rbr, nib=False) -> Optional[FlatBatch]:
        """The buffer's :class:`~gefen_dist.engine.flat_batch.FlatBatch` (built once and kept while its
        key holds), or None where the per-segment path steps it (the eager reference, a gradient the
        kernels cannot read)."""
        kernels = batch_kernels(impl, flat, gv)
        if kernels is None:
            return None
        key = batch_key(impl, flat, st, factored, rbr, nib)
        last = self.__dict__.get("_flat_batch")
        if last is None or last.key != key:
            if nib and self.tensor_index is None:
                raise RuntimeError(f"{self.where}: second_moment='nibbles' needs the owner's tensor_index "
                                   "(internal error)")
            last = self._flat_batch = FlatBatch(key, kernels, st, layout, ctx, flat,
                                                self.tensor_index if nib else None)
        return last

    def _refuse_overflow_before_learning(self, st, g, live, held, spans, second_moment) -> None:
        """The overflow refusal of :meth:`step` for the tensors about to learn (``live``; ``held``:
        the segments of them here): the sums the step reduces (a factored tensor's column sums per
        block of rows, a span tensor's column and block sums of ``g^2``), for every live key of the
        catalog in order, one SUM all-reduce (entered by every rank), raised on every rank."""
        cat = self.global_catalog()
        keys, sizes = [], []
        for k in live:
            shape = tuple(cat[k]["shape"])
            if k not in spans and is_exact(shape, self.small_threshold):
                continue
            if k in spans:
                keys.append((k, "span"))
                sizes.append(_periods.row_slab(shape) + _span.span_blocks(shape))
            elif second_moment in (MODE_FACTORED, NIBBLES) and quantized_mode(shape, MODE_FACTORED) == MODE_FACTORED:
                keys.append((k, "factored"))
                sizes.append(_periods.row_slab(shape) * _periods.factored_row_blocks(shape, st.get("row_blocks", 1)))
        if not keys:
            return
        buf = torch.zeros(sum(sizes), dtype=torch.float64)
        o = 0
        for (k, kind), n in zip(keys, sizes):
            seg = held.get(k)
            if seg is not None and seg.numel:
                shape = tuple(cat[k]["shape"])
                gs = g[seg.flat_offset:seg.flat_offset + seg.numel].float()
                if kind == "span":  # the first phase's sums (core.span), on this piece
                    buf[o:o + n] += _span.span_square_sums(gs, _span.SpanPiece.of(shape, seg.param_offset,
                                                                                  seg.numel)).cpu()
                else:  # column sums per block of rows, element by element (a segment may cut rows)
                    S = _periods.row_slab(shape)
                    rb = int(shape[0]) // (n // S)
                    e = torch.arange(seg.param_offset, seg.param_offset + seg.numel, device=gs.device)
                    buf[o:o + n] += torch.zeros(n, dtype=torch.float64, device=gs.device).index_add_(
                        0, ((e // S) // rb) * S + e % S, (gs * gs).double()).cpu()
            o += n
        if self.comm.world_size > 1:
            self.comm.all_reduce_sum_(buf)
        _refuse_overflow(self.where, buf, None)

    def _step_shared(self, st: Dict[str, Any], hp: Dict[str, Any], items: list, impl, v_all: torch.Tensor,
                     second_moment: str, batched=()) -> None:
        """The shared second moment's step of the learned segments ``items`` (``(slot, segment, param
        view, grad view)``): whole blocks through ``impl`` (but those of the segments whose keys are in
        ``batched``: a batch stepped them), then the blocks cut by partition edges with the statistics
        of one all-gather (entered by every rank: the catalog is global)."""
        lr, beta1, beta2, eps, weight_decay, bc1, bc2, bound = (
            hp[k] for k in ("lr", "beta1", "beta2", "eps", "weight_decay", "bc1", "bc2", "bound"))
        cb = st["codebook"]
        idx_all, scale_all = st["idx"], st["scale"]
        # Phase 1: whole blocks through the kernels; partial blocks' partial statistics.
        pend = []  # (key, block, p, g, idx, scale slot view, v view, m)
        for sp, s, p, g in items:
            P, B = sp.period, sp.block
            a, e = s.param_offset, s.param_offset + s.numel
            ix = idx_all[s.flat_offset:s.flat_offset + s.numel]
            sc = scale_all[sp.scale_off:sp.scale_off + sp.scale_n]
            vv = v_all[sp.v_off:sp.v_off + sp.v_n]
            lo, hi, parts = _split(a, e, B)
            if hi > lo and s.key not in batched:  # whole blocks [lo, hi)
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
        cat = self.global_catalog()
        cuts = self.cut_blocks({k: B for k, B in self._global_blocks(st).items()
                                if quantized_mode(cat[k]["shape"], second_moment) != MODE_FACTORED})
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
            apply_(p, cb[new.long()] * A, sigma, lr, weight_decay, bound)


    # ------------------------------------------------------------------ factored second moment
    def _factored_stats(self, st: Dict[str, Any], hp: Dict[str, float], items: list, ctx: "_FactoredCatalog",
                        dev: torch.device, sumsq, batch=None, gv=None, nib: bool = False):
        """The first phase of the factored (row x column) second moment (Adafactor's estimator);
        writes nothing. Returns the arguments of :meth:`_factored_finish` but the codebook, the scalars
        and the implementation (None when there is nothing to step).

        Per quantized tensor of ``R`` rows of ``S`` elements: ``v_col`` ([S], identical on every
        rank holding part of the tensor) is the EMA of the column mean of ``g^2`` over all ``R``
        rows; ``v_row`` (one entry per row a segment touches) the EMA of the row mean. Whole rows go
        through ``whole_rows`` (the native CPU or Triton kernel, or
        :func:`gefen_dist.core.step.quantized_step_factored_eager_`); rows and scale blocks cut by
        partition edges are reconciled (eager). One collective per buffer: a float64 SUM all-reduce
        of ``[column sums of every learned tensor | per-rank slots of cut-row partial sum g^2 and
        cut-block partial max |m|]`` (the slots are combined in rank order, so a cut row's ``v_row``
        and a cut block's scale are identical on the ranks that share them). ``ctx``: the buffer's
        :meth:`_factored_catalog`; ``batch``: a :class:`~gefen_dist.engine.flat_batch.FlatBatch`, whose
        one run gives the whole rows' column sums (of gradient ``gv``); ``nib``: the first moment of cut
        rows from the one-byte codes' high nibble (D20).
        """
        # the column sums stay on the buffer's device ``dev`` (no per-tensor copy on CUDA)
        cols = torch.zeros(ctx.nc, dtype=torch.float64, device=dev)
        slots = torch.zeros(ctx.nr + ctx.nb, dtype=torch.float64)
        if batch is not None:
            batch.column_sums_into(cols, gv)
        work = self._factored_local(items, st, ctx, hp, sumsq, cols, slots, nib, batch.fpos if batch is not None else ())
        if not work and ctx.nc == 0:
            return None
        cols, rsum, bmax = self._reconcile_factored(cols, slots, ctx, dev)
        return work, cols, rsum, bmax, ctx


    def _factored_catalog(self, st: Dict[str, Any], rbr) -> "_FactoredCatalog":
        """The global catalog of learned factored tensors (identical on every rank): column-sum
        offsets, row blocks, cut rows and cut scale blocks."""
        cat = self.global_catalog()
        ctx = _FactoredCatalog(cat=cat)
        spans = set(st.get("span_keys", []))
        for k in (k for k, lrn in zip(st["global_keys"], st["global_learned"])
                  if lrn and k not in spans and quantized_mode(cat[k]["shape"], MODE_FACTORED) == MODE_FACTORED):
            ctx.slab_of[k] = _periods.row_slab(cat[k]["shape"])
            ctx.nblk_of[k] = _periods.factored_row_blocks(cat[k]["shape"], rbr)  # row blocks (D12)
            ctx.colb_of[k] = _periods.factored_col_blocks(cat[k]["shape"], st.get("col_blocks", 1))  # (D21)
            ctx.col_off[k] = ctx.nc
            ctx.nc += ctx.slab_of[k] * ctx.nblk_of[k]
        cut_rows = self.cut_blocks(dict(ctx.slab_of))
        cut_blks = self.cut_blocks({k: B for k, B in self._global_blocks(st).items() if k in ctx.slab_of})
        for c in cut_rows:  # a cut row's partial sums of g^2: one slot per column block (D21)
            ctx.row_pos[c] = ctx.nr
            ctx.nr += ctx.colb_of[c[0]]
        ctx.blk_pos = {c: j for j, c in enumerate(cut_blks)}
        ctx.nb = len(cut_blks)
        return ctx


    def _factored_local(self, items, st, ctx: "_FactoredCatalog", hp, sumsq, cols, slots, nib=False,
                        batched=()) -> list:
        """Phase 1: this rank's statistics of the learned factored segments ``items`` (column sums into
        ``cols``, the whole rows' with ``sumsq`` but for the segments in ``batched``: a batch added theirs;
        cut rows' partial sums of ``g^2`` and cut blocks' partial max |m| into ``slots``). Returns their
        work items for phase 2."""
        work = []
        for sp, s, p, g in items:
            S, B, G, K = ctx.slab_of[s.key], sp.block, ctx.nblk_of[s.key], ctx.colb_of[s.key]
            a, e = s.param_offset, s.param_offset + s.numel
            ix = st["idx"][s.flat_offset:s.flat_offset + s.numel]
            sc = st["scale"][sp.scale_off:sp.scale_off + sp.scale_n]
            co, rb = ctx.col_off[s.key], ctx.cat[s.key]["shape"][0] // G
            lo, hi, rparts = _split(a, e, S)
            if hi > lo and s.key not in batched:
                cols[co:co + G * S] += block_column_sumsq(g[lo - a:hi - a], S, lo // S, rb, G, sumsq).to(cols.device)
            pend = [self._cut_row_partials(s.key, r, ps, pe, a, S, B, rb, g, ix, sc, st["codebook"], hp["beta1"],
                                           ctx, cols[co:co + G * S], slots, nib) for r, ps, pe in rparts]
            work.append((sp, p, g, ix, sc, st["v_row"][sp.v_off:sp.v_off + sp.v_n],
                         st["v_col"][sp.vcol_off:sp.vcol_off + sp.vcol_n], co, S, B, a, lo, hi, pend, G, rb, K))
        return work


    @staticmethod
    def _cut_row_partials(key, r, ps, pe, a, S, B, rb, g, ix, sc, cb, beta1, ctx, tcols, slots, nib=False) -> tuple:
        """A row cut by a partition edge: its column sums (into ``tcols``, the tensor's), its partial
        sum of ``g^2`` and its cut blocks' partial max |m| (into ``slots``), and its first moment
        (``nib``: of the one-byte codes, D20)."""
        r0, r1 = ps - a, pe - a
        gp = g[r0:r1].float()
        g2 = gp.double() ** 2
        c0 = ps - r * S + (r // rb) * S  # in the row's block of column sums
        tcols[c0:c0 + (pe - ps)] += (gp * gp).double()  # as column_sumsq
        K, j = ctx.colb_of[key], ctx.row_pos[(key, r)]
        if K == 1:
            slots[j] += float(g2.sum())
        else:  # per block of S / K columns (D21)
            blk = torch.div(torch.arange(c0, c0 + (pe - ps)), S // K, rounding_mode="floor")
            slots[j:j + K] += torch.zeros(K, dtype=torch.float64).index_add_(0, blk, g2.cpu())
        # first moment of the row piece, block by block (scale slots of the segment)
        first = ps // B - a // B
        nblk = (pe - 1) // B - ps // B + 1
        bl = (torch.arange(ps, pe, device=ix.device) // B) - ps // B
        m = (_nb.first_moment if nib else first_moment)(ix[r0:r1], sc[first:first + nblk][bl], gp, cb, beta1)
        lead = ps - (ps // B) * B  # pad to whole blocks with zeros (neutral for max |m|)
        am = torch.nn.functional.pad(m.abs(), (lead, nblk * B - lead - (pe - ps))).view(nblk, B).amax(dim=1)
        _, _, bparts = _split(ps, pe, B)
        for b, _, _ in bparts:  # scale blocks cut by the edge: partial max |m|
            j = ctx.nr + ctx.blk_pos[(key, b)]
            slots[j] = max(float(slots[j]), float(am[b - ps // B]))
        return (r, r0, r1, gp, m, bl, am, first, nblk, [b for b, _, _ in bparts])


    def _reconcile_factored(self, cols, slots, ctx: "_FactoredCatalog", dev):
        """One SUM all-reduce: column sums (zeros for tensors not held here) + per-rank slots; the
        slots are combined in rank order, so every sharing rank gets the same cut rows and blocks."""
        ws, rank = self.comm.world_size, self.comm.rank
        nc, nr, nb = ctx.nc, ctx.nr, ctx.nb
        k = nr + nb
        if not (ws > 1 and nc + k):
            return cols, slots[:nr], slots[nr:]
        buf = torch.zeros(nc + ws * k, dtype=torch.float64, device=dev)
        buf[:nc] = cols
        buf[nc + rank * k:nc + (rank + 1) * k] = slots.to(dev)
        self.comm.all_reduce_sum_(buf)
        allr = buf[nc:].view(ws, k).cpu()  # the few cut-row / cut-block slots: read on the host
        rsum = torch.zeros(nr, dtype=torch.float64)
        for rr in range(ws):  # fixed order: identical on every rank
            rsum += allr[rr, :nr]
        bmax = allr[:, nr:].amax(dim=0) if nb else torch.zeros(0, dtype=torch.float64)
        return buf[:nc], rsum, bmax


    @staticmethod
    def _factored_finish(work, cols, rsum, bmax, ctx: "_FactoredCatalog", cb, hp, whole_rows, batched=()) -> None:
        """Phase 2: ``v_col``, the whole rows through the implementation (segments in ``batched``: a batch
        did both), then the cut rows with the reconciled statistics (the reference's phase functions)."""
        sqrt_bc2 = math.sqrt(hp["bc2"])
        for sp, p, g, ix, sc, vr, vc, co, S, B, a, lo, hi, pend, G, rb, K in work:
            vcb = vc.view(G, S) if G > 1 else vc
            if sp.seg.key in batched:
                if pend:
                    _finish_cut_rows(sp, p, ix, sc, vr, vcb, S, B, a, pend, G, rb, rsum, bmax, ctx, cb, hp, sqrt_bc2)
                continue
            col_mean_sq = (cols[co:co + G * S] / rb).to(torch.float32).to(vc.device)
            so, ro = lo // B - a // B, lo // S - a // S
            nrow = (hi - lo) // S
            # updates v_col (always) and steps the whole rows [lo, hi) (possibly none)
            vrw = vr[ro * K:(ro + nrow) * K].view(nrow, K) if K > 1 else vr[ro:ro + nrow]  # (D21: [rows, K])
            whole_rows(p[lo - a:hi - a], g[lo - a:hi - a], ix[lo - a:hi - a], sc[so:so + nrow * (S // B)],
                       vrw, vcb, cb, col_mean_sq, scale_block=B, row0=lo // S, row_block=rb, **hp)
            if pend:
                _finish_cut_rows(sp, p, ix, sc, vr, vcb, S, B, a, pend, G, rb, rsum, bmax, ctx, cb, hp, sqrt_bc2)


    def _nibble_keys(self, step: Optional[int]):
        """key -> the 32-bit key of that tensor's random numbers at ``step`` (D20): its place in the
        optimizer (:attr:`tensor_index`, set by the owner), as :class:`gefen_dist.Gefen` keys it."""
        index = self.tensor_index
        if step is None or index is None:
            raise RuntimeError(f"{self.where}: second_moment='nibbles' needs the step number and the owner's "
                               "tensor_index (internal error)")
        return lambda key: _nb.step_key(0, step, index[key])


def _nibbles_finish(work, cols, rsum, bmax, ctx: "_FactoredCatalog", cb, hp, impl, key_of, batch=None) -> None:
    """Phase 2 of the one-byte layout (D20): per segment, the whole rows and ``v_col`` through the
    implementation's :func:`~gefen_dist.core.nibbles.nibble_step_factored_eager_` (keyed by the
    tensor, its first global row; ``batch``: a :class:`FlatBatch` did both, its column ratios are the
    cut rows'), then the cut rows with the reconciled statistics."""
    for sp, p, g, ix, sc, vr, vc, co, S, B, a, lo, hi, pend, G, rb, _ in work:  # (no column blocks: K == 1)
        vcb = vc.view(G, S) if G > 1 else vc
        if batch is not None:
            if pend:
                k = batch.fpos[sp.seg.key]
                _finish_cut_rows_nibbles(sp, p, ix, sc, vr, vcb, batch.ratios.old[k], S, a, pend, G, rb, rsum,
                                         bmax, ctx, cb, hp, key_of(sp.seg.key), batch.ratios.new[k])
            continue
        col_mean_sq = (cols[co:co + G * S] / rb).to(torch.float32).to(vc.device)
        ratio_old = column_ratios(vcb).clone() if pend else None  # what the cut rows' codes are against
        so, ro = lo // B - a // B, lo // S - a // S
        nrow = (hi - lo) // S
        key = key_of(sp.seg.key)
        impl.nibble_step_factored_(p[lo - a:hi - a], g[lo - a:hi - a], ix[lo - a:hi - a],
                                   sc[so:so + nrow * (S // B)], vr[ro:ro + nrow], vcb, cb, col_mean_sq,
                                   scale_block=B, key=key, row0=lo // S, row_block=rb, **hp)
        if pend:
            _finish_cut_rows_nibbles(sp, p, ix, sc, vr, vcb, ratio_old, S, a, pend, G, rb, rsum, bmax, ctx, cb,
                                     hp, key)


def _finish_cut_rows_nibbles(sp, p, ix, sc, vr, vcb, ratio_old, S, a, pend, G, rb, rsum, bmax, ctx, cb, hp,
                             key, ratio_new=None) -> None:
    """:func:`_finish_cut_rows` of the one-byte layout (D20): each cut row's ``v`` decoded against the
    estimate before this step (``ratio_old``: the column ratios before ``v_col``'s EMA), advanced,
    coded against the new one (``ratio_new``, the ratios after it: computed here when not given) with the
    row's reconciled ``v_row`` and the blocks' reconciled scales, its random numbers those of the same
    global elements (:func:`gefen_dist.core.nibbles.uniforms`)."""
    ratio_new = column_ratios(vcb) if ratio_new is None else ratio_new
    sqrt_bc2 = math.sqrt(hp["bc2"])
    for r, r0, r1, gp, m, bl, am, first, nblk, cut in pend:
        ps, n = a + r0, r1 - r0
        c0 = ps - r * S
        ro, rn = (ratio_old[r // rb], ratio_new[r // rb]) if G > 1 else (ratio_old, ratio_new)
        v1 = vr[r - a // S:r - a // S + 1]
        _, v = _nb.decode_with(ix[r0:r1], 1.0, v1 * ro[c0:c0 + n], cb)
        v = ema_(v, gp * gp, hp["beta2"])
        tot = torch.tensor([float(rsum[ctx.row_pos[(sp.seg.key, r)]])], dtype=torch.float64).float() / S
        ema_(v1, tot.to(v1.device), hp["beta2"])
        for b in cut:
            am[b - ps // sp.block] = float(bmax[ctx.blk_pos[(sp.seg.key, b)]])
        sc[first:first + nblk].copy_(am)
        u_m, u_v = _nb.uniforms(ps, n, key, device=gp.device)
        new = _nb.encode_with(m, v, v1 * rn[c0:c0 + n], am[bl], cb, u_m, u_v)
        ix[r0:r1].copy_(new)
        _nb.update_(p[r0:r1], m, v, lr=hp["lr"], weight_decay=hp["weight_decay"], eps=hp["eps"], bc1=hp["bc1"],
                    sqrt_bc2=sqrt_bc2, bound=hp["bound"])


def _finish_cut_rows(sp, p, ix, sc, vr, vcb, S, B, a, pend, G, rb, rsum, bmax, ctx, cb, hp, sqrt_bc2) -> None:
    """The rows of a factored segment cut by partition edges, with the reconciled statistics and the
    segment's updated ``v_col`` (the reference's phase functions; column blocks, D21: a row's ``v_row``
    and reconciled sums per block of ``S / K`` columns)."""
    K = ctx.colb_of[sp.seg.key]
    col_fb = column_factors(vcb, K)
    for r, r0, r1, gp, m, bl, am, first, nblk, cut in pend:
        col_f = col_fb[r // rb] if G > 1 else col_fb
        ps = a + r0
        j = ctx.row_pos[(sp.seg.key, r)]
        tot = torch.tensor(rsum[j:j + K].tolist(), dtype=torch.float64).float() / (S // K)
        v1 = vr[(r - a // S) * K:(r - a // S + 1) * K]
        c0 = ps - r * S
        rsq = ema_(v1, tot.to(v1.device), hp["beta2"]).sqrt()
        if K > 1:  # each column its block's row statistic, as quantized_step_factored_eager_
            rsq = rsq[torch.div(torch.arange(c0, c0 + (r1 - r0), device=rsq.device), S // K, rounding_mode="floor")]
        sigma = inv_rms_(rsq * col_f[c0:c0 + (r1 - r0)], hp["eps"], hp["bc1"], sqrt_bc2)
        for b in cut:
            am[b - ps // B] = float(bmax[ctx.blk_pos[(sp.seg.key, b)]])
        sc[first:first + nblk].copy_(am)
        A = am[bl]
        new = quantize(m, A, cb)
        ix[r0:r1].copy_(new)
        apply_(p[r0:r1], cb[new.long()] * A, sigma, hp["lr"], hp["weight_decay"], hp["bound"])


def _learned_segments(layout, st, fv, gv, skip=()) -> list:
    """The learned quantized segments of a flat buffer in order (but those whose keys are in
    ``skip``), as ``(slot, segment, param view, grad view)`` for the caller's step."""
    return [(sp, sp.seg, fv[sp.seg.flat_offset:sp.seg.flat_offset + sp.seg.numel],
             gv[sp.seg.flat_offset:sp.seg.flat_offset + sp.seg.numel])
            for sp, learned in zip(layout, st["learned"])
            if sp.seg.numel and not sp.exact and learned and sp.seg.key not in skip]


def _step_exact_and_decay(layout, st, fv, gv, hp, batch=None) -> None:
    """The exact segments' step (AdamW; ``batch``: in one foreach AdamW); quantized ones whose gradient
    has been globally zero so far only decay."""
    if batch is not None:
        batch.step_exact(gv, hp)
    for sp, learned in zip(layout, st["learned"]):
        s = sp.seg
        if not s.numel or (not sp.exact and learned) or (sp.exact and batch is not None):
            continue
        p = fv[s.flat_offset:s.flat_offset + s.numel]
        if sp.exact:
            adamw_step_(p, gv[s.flat_offset:s.flat_offset + s.numel], st["exact_m"][sp.exact_off:sp.exact_off + s.numel],
                        st["exact_v"][sp.exact_off:sp.exact_off + s.numel], **hp)
        else:
            decay_only_(p, hp["lr"], hp["weight_decay"])


def _refuse_overflow(where: str, cols, span_sums) -> None:
    """Raise when a reduced sum of ``g^2`` (factored column sums, span column and block sums) is
    beyond float32, as :class:`gefen_dist.Gefen` does for its tensors: its second moment would be
    inf and its update NaN. The sums are the same on every rank, so every rank raises."""
    for t in (cols, span_sums):
        if t is not None and t.numel() and bool(torch.isinf(t.to(torch.float32)).any()):
            raise RuntimeError(
                f"Gefen: the squared gradient of a tensor of {where} overflows float32 (|g| above ~1.8e19), so "
                "its second moment would be inf/NaN; nothing of this buffer was updated (param groups DeepSpeed "
                "stepped before it in this step were). Clip the gradients (gradient_clipping) or scale the loss "
                "down, or use second_moment='shared'.")


@dataclass
class _FactoredCatalog:
    """What every rank knows about the learned factored tensors of a flat buffer (one step)."""

    cat: Dict[str, Dict[str, Any]]
    slab_of: Dict[str, int] = field(default_factory=dict)
    nblk_of: Dict[str, int] = field(default_factory=dict)
    colb_of: Dict[str, int] = field(default_factory=dict)  # column blocks (D21)
    col_off: Dict[str, int] = field(default_factory=dict)
    nc: int = 0
    row_pos: Dict[Tuple[str, int], int] = field(default_factory=dict)
    blk_pos: Dict[Tuple[str, int], int] = field(default_factory=dict)
    nr: int = 0
    nb: int = 0
