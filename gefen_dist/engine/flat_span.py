"""The tensors of a flat buffer kept per block of rows (D16, ``narrow_rows="span"``) or per row in
one-byte codes (D19, ``"rows8"``): a mixin of :class:`gefen_dist.engine.flat.FlatSegments`. Their
block state (``span_scale``, ``span_vblk``, ``span_vcol``) is whole and replicated on every rank of the
buffer's group, for every such tensor of the buffer's catalog; a rows8 tensor's row codes
(``span_codes``) are kept by the ranks whose pieces touch the rows. Each rank's pieces add their
statistics (per block, or per row for rows8, with the rows' old ``v``) to one SUM and one MAX
all-reduce per step (and one MAX for the codebook histogram), entered by every rank."""
from __future__ import annotations

from typing import Any, Dict, List, Sequence, Tuple

import torch

from ..core import periods as _periods
from ..core import rows8 as _rows8
from ..core import span as _span
from .span_step import DENSE_ROWS, warn_dense
from .state import MODE_FACTORED, narrow_layout, rows8_mode


def rows8_rows(segments: Sequence[Any], rows8_keys) -> Dict[str, Tuple[int, int, int]]:
    """key -> (first row in ``span_codes``, first row, end row) for the pieces among ``segments`` (a
    buffer's, in order) of the tensors ``rows8_keys``: the rows each piece touches, in segment order
    (what a rank's ``span_codes`` holds, D19)."""
    out, ro = {}, 0
    for s in segments:
        if s.key in rows8_keys and s.numel:
            S = _periods.row_slab(s.shape)
            r0, r1 = s.param_offset // S, -(-(s.param_offset + s.numel) // S)
            out[s.key] = (ro, r0, r1)
            ro += r1 - r0
    return out


class FlatSpanMixin:
    """Span tensors of a flat buffer (uses ``segments``, ``comm``, ``small_threshold``,
    ``second_moment``, ``narrow_rows`` and ``global_catalog`` of the buffer)."""

    def is_span(self, shape) -> bool:
        """Whether a tensor of global ``shape`` keeps its state in the buffer's span arrays: per block
        of rows (D16) or per row in one-byte codes (D19), under the buffer's group's ``narrow_rows``
        with the factored second moment."""
        return narrow_layout(shape, self.second_moment or MODE_FACTORED, self.narrow_rows,
                             self.small_threshold) is not None

    def is_rows8(self, shape) -> bool:
        """Whether a tensor of global ``shape`` keeps its rows' scale and ``v`` in one-byte codes (D19)."""
        return rows8_mode(shape, self.second_moment or MODE_FACTORED, self.narrow_rows, self.small_threshold)

    def _stat_piece(self, shape, start: int = 0, numel: int = -1) -> "_span.SpanPiece":
        """The piece the span kernels step and whose statistics are reduced: blocks of rows (D16), or
        rows (D19)."""
        sp = _span.SpanPiece.of(shape, start, numel)
        return _rows8.kernel_piece(sp) if self.is_rows8(shape) else sp

    def rows8_keys(self, st: Dict[str, Any]) -> Dict[str, int]:
        """key -> rows of every rows8 tensor of the buffer's catalog (D19; all ranks', in
        ``st["span_keys"]`` order)."""
        cat = self.global_catalog()
        return {k: int(cat[k]["shape"][0]) for k in st.get("span_keys", []) if self.is_rows8(tuple(cat[k]["shape"]))}

    def rows8_layout(self, st: Dict[str, Any]) -> Dict[str, Tuple[int, int, int]]:
        """key -> (first row in ``span_codes``, first row, end row) of the rows8 tensors whose pieces
        this rank holds (D19): ``span_codes`` keeps the codes of the rows those pieces touch (a row a
        partition edge cuts is kept by both ranks, with the same codes)."""
        return rows8_rows(self.segments, self.rows8_keys(st))

    def _span_fn(self, factored: bool):
        return self.is_span if factored and self.narrow_rows != "rows" else None

    def span_keys(self, factored: bool) -> List[str]:
        """The keys of the buffer's tensors kept per block of rows under its group's setting (all
        ranks'; the global catalog, an all-gather the first time)."""
        spanf, cat = self._span_fn(factored), self.global_catalog()
        return [k for k in self.quantized_keys() if spanf and spanf(cat[k]["shape"])]

    def span_layout(self, st: Dict[str, Any]) -> Dict[str, Tuple[int, int, int, int, Tuple[int, ...]]]:
        """key -> (offset in ``span_scale``/``span_vblk``, blocks, offset in ``span_vcol``, columns,
        shape) of every span tensor of the buffer (all ranks', in ``st["span_keys"]`` order)."""
        cat = self.global_catalog()
        out, bo, co = {}, 0, 0
        for k in st.get("span_keys", []):
            shape = tuple(cat[k]["shape"])
            nb, S = _span.span_blocks(shape), _periods.row_slab(shape)
            out[k] = (bo, nb, co, S, shape)
            bo, co = bo + nb, co + S
        return out

    def _span_histogram(self, g: torch.Tensor, keys: Sequence[str], counts: torch.Tensor) -> None:
        """Add the span tensors ``keys``' pieces held here to ``counts``, normalised by the absmax of
        their whole blocks (one MAX all-reduce over every key's blocks, entered by every rank)."""
        cat = self.global_catalog()
        local = {s.key: s for s in self.segments}
        nbs = [self._stat_piece(cat[k]["shape"]).nb for k in keys]
        amax = torch.zeros(sum(nbs), dtype=torch.float32)
        held, o = [], 0
        for k, nb in zip(keys, nbs):
            s = local.get(k)
            if s is not None and s.numel:
                sp = self._stat_piece(cat[k]["shape"], s.param_offset, s.numel)
                gs = g[s.flat_offset:s.flat_offset + s.numel]
                amax[o:o + nb] = _span.span_grad_absmax(gs, sp).cpu()
                held.append((gs, sp, o, nb))
            o += nb
        if self.comm.world_size > 1:
            self.comm.all_reduce_max_(amax)
        for gs, sp, o, nb in held:
            _span.span_histogram(gs, amax[o:o + nb], sp, counts)

    def _note_dense_span(self, g: torch.Tensor, keys: Sequence[str]) -> None:
        """:func:`~gefen_dist.engine.span_step.warn_dense` for the span tensors ``keys`` learning
        their state, from the pieces of their first gradient held here (``g``: the buffer's)."""
        cat = self.global_catalog()
        found = []
        for s in self.segments:
            if s.key in keys and s.numel and not self.is_rows8(cat[s.key]["shape"]):  # rows8: per row (D19)
                sp = _span.SpanPiece.of(cat[s.key]["shape"], s.param_offset, s.numel)
                reached = _span.rows_reached(g[s.flat_offset:s.flat_offset + s.numel], sp)
                if reached >= DENSE_ROWS:
                    found.append((s.key, tuple(cat[s.key]["shape"]), reached))
        warn_dense(found, self.narrow_rows)

    def _span_stats(self, st: Dict[str, Any], hp: Dict[str, Any], items: list, impl=None):
        """The first phase of the tensors kept per block of rows (D16) or in row codes (D19) of this
        buffer: every learned one, held here or not (the reductions are entered by every rank): each
        held piece's statistics, one SUM (column sums of ``g^2`` and its sums per block, or per row)
        and one MAX (maxima of ``|m|`` per block, or per row) all-reduce over the whole catalog. Writes
        nothing; None when no such tensor is learned. ``impl``: the implementation of the two phases (a
        :class:`~gefen_dist.kernels.dispatch.StepImpl`; None: the reference's)."""
        stats = impl.span_statistics if impl is not None else _span.span_statistics
        lay, r8, mine = self.span_layout(st), self.rows8_keys(st), self.rows8_layout(st)
        learned = {k for k, lrn in zip(st["global_keys"], st["global_learned"]) if lrn and k in lay}
        if not learned:
            return None
        held = {s.key: (s, p, g) for _, s, p, g in items}
        nks = {k: (v[1] if k not in r8 else r8[k]) for k, v in lay.items()}  # statistic blocks per key
        sbo, o = {}, 0
        for k in lay:
            sbo[k], o = o, o + nks[k]
        vbo, ov = {}, 0  # D19: every row's old v, added by the rank whose piece holds the row's start
        for k, rows in r8.items():
            vbo[k], ov = ov, ov + rows
        nct = sum(v[3] for v in lay.values())
        sums = torch.zeros(nct + o + ov, dtype=torch.float64)
        maxs = torch.zeros(o, dtype=torch.float32)
        cb = st["codebook"]
        work = {}
        for key in learned:
            bo, nb, co, S, shape = lay[key]
            so, nk = sbo[key], nks[key]
            seg, p, g = held.get(key, (None, None, None))
            a, n = (seg.param_offset, seg.numel) if seg is not None else (0, 0)
            sp = self._stat_piece(shape, a, n)
            if n:
                ix = st["idx"][seg.flat_offset:seg.flat_offset + n]
                scale = st["span_scale"][bo:bo + nb]
                if key in r8:  # D19: the rows' decoded scales; the old v of the rows that start here
                    scale, vo = self._rows8_decoded(st, key, shape, seg, mine[key], bo, nb)
                    sums[nct + o + vbo[key]:nct + o + vbo[key] + r8[key]] += vo.cpu()
                m, col, blk, amax = stats(g, ix, scale, cb.to(g.device), sp, hp["beta1"])
                sums[co:co + S] += col.cpu()
                sums[nct + so:nct + so + nk] += blk.cpu()
                maxs[so:so + nk] = amax.cpu()
                work[key] = (sp, p, ix, m)
            else:
                work[key] = (sp, None, None, None)
        if self.comm.world_size > 1:
            self.comm.all_reduce_sum_(sums)
            self.comm.all_reduce_max_(maxs)
        return dict(lay=lay, r8=r8, mine=mine, sbo=sbo, nks=nks, vbo=vbo, no=o, learned=learned, work=work, sums=sums,
                    maxs=maxs, nct=nct)

    def _rows8_decoded(self, st, key, shape, seg, mine, bo: int, nb: int):
        """The decoded scales of the rows of a held rows8 piece (float32 ``[rows]``, zeros elsewhere:
        the kernels index them by row) and the old ``v`` of the rows that start in it (float64
        ``[rows]``): each row's counted once over the ranks."""
        ro, r0, r1 = mine
        S = _periods.row_slab(shape)
        codes = st["span_codes"][ro:ro + r1 - r0]
        return _rows8.decode_piece(codes[:, 0], codes[:, 1], st["span_scale"][bo:bo + nb], st["span_vblk"][bo:bo + nb],
                                   _span.SpanPiece(int(shape[0]), S, _span.span_rows(shape), r0, r1 - r0),
                                   -(-seg.param_offset // S))  # v from the first row that starts in this piece

    def _span_finish(self, st: Dict[str, Any], hp: Dict[str, Any], res, impl=None) -> None:
        """The second phase (:meth:`_span_stats`' result ``res``): every rank updates every such
        tensor's replicated state (D19: and its row codes) and its own pieces."""
        update = impl.span_update_ if impl is not None else _span.span_update_
        apply = impl.span_apply_ if impl is not None else _span.span_apply_
        lay, work, sums, maxs, nct, cb = res["lay"], res["work"], res["sums"], res["maxs"], res["nct"], st["codebook"]
        for key in sorted(res["learned"]):
            bo, nb, co, S, shape = lay[key]
            so, nk = res["sbo"][key], res["nks"][key]
            sp, p, ix, m = work[key]
            dev = st["span_vblk"].device
            if p is None:  # not held here: the replicated state only
                p = torch.zeros(0, device=dev)
                ix = torch.zeros(0, dtype=torch.uint8, device=dev)
                m = torch.zeros(0, S, device=dev)
            col, blk, amax = sums[co:co + S].to(dev), sums[nct + so:nct + so + nk].to(dev), maxs[so:so + nk].to(dev)
            if key in res["r8"]:  # D19: every row's codes from the reduced statistics, this rank's kept
                vo = res["nct"] + res["no"] + res["vbo"][key]
                sc, vc, scale, v = _rows8.rows8_state_(sums[vo:vo + res["r8"][key]].to(dev), st["span_scale"][bo:bo + nb],
                                                       st["span_vblk"][bo:bo + nb], st["span_vcol"][co:co + S], col,
                                                       blk, amax, _span.SpanPiece.of(shape), hp["beta2"],
                                                       int(st["step"]) + 1, shape)  # this step's
                if key in res["mine"]:
                    ro, r0, r1 = res["mine"][key]
                    st["span_codes"][ro:ro + r1 - r0, 0].copy_(sc[r0:r1])
                    st["span_codes"][ro:ro + r1 - r0, 1].copy_(vc[r0:r1])
                if p.numel():
                    apply(p, ix, scale, v, st["span_vcol"][co:co + S], m, cb.to(dev), sp, **hp)
                continue
            update(p, ix, st["span_scale"][bo:bo + nb], st["span_vblk"][bo:bo + nb], st["span_vcol"][co:co + S], m,
                   col, blk, amax, cb.to(dev), sp, **hp)
