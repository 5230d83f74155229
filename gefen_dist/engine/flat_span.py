"""The tensors of a flat buffer kept per block of rows (D16, ``narrow_rows="span"``): a mixin of
:class:`gefen_dist.engine.flat.FlatSegments`. Their block state (``span_scale``, ``span_vblk``,
``span_vcol``) is whole and replicated on every rank of the buffer's group, for every such tensor of
the buffer's catalog; each rank's pieces add their statistics to one SUM and one MAX all-reduce per
step (and one MAX for the codebook histogram), entered by every rank."""
from __future__ import annotations

from typing import Any, Dict, List, Sequence, Tuple

import torch

from ..core import periods as _periods
from ..core import span as _span
from .span_step import DENSE_ROWS, warn_dense
from .state import MODE_FACTORED, span_mode


class FlatSpanMixin:
    """Span tensors of a flat buffer (uses ``segments``, ``comm``, ``small_threshold``,
    ``second_moment``, ``narrow_rows`` and ``global_catalog`` of the buffer)."""

    def is_span(self, shape) -> bool:
        """Whether a tensor of global ``shape`` keeps its state per block of rows here (D16): the
        buffer's group asks ``narrow_rows="span"`` with the factored second moment."""
        return span_mode(shape, self.second_moment or MODE_FACTORED, self.narrow_rows, self.small_threshold)

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
        nbs = [_span.span_blocks(cat[k]["shape"]) for k in keys]
        amax = torch.zeros(sum(nbs), dtype=torch.float32)
        held, o = [], 0
        for k, nb in zip(keys, nbs):
            s = local.get(k)
            if s is not None and s.numel:
                sp = _span.SpanPiece.of(cat[k]["shape"], s.param_offset, s.numel)
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
            if s.key in keys and s.numel:
                sp = _span.SpanPiece.of(cat[s.key]["shape"], s.param_offset, s.numel)
                reached = _span.rows_reached(g[s.flat_offset:s.flat_offset + s.numel], sp)
                if reached >= DENSE_ROWS:
                    found.append((s.key, tuple(cat[s.key]["shape"]), reached))
        warn_dense(found, self.narrow_rows)

    def _span_stats(self, st: Dict[str, Any], hp: Dict[str, Any], items: list, impl=None):
        """The first phase of the tensors kept per block of rows (D16) of this buffer: every learned
        one, held here or not (the reductions are entered by every rank): each held piece's
        statistics, one SUM (column and block sums of ``g^2``) and one MAX (block maxima of ``|m|``)
        all-reduce over the whole catalog. Writes nothing; None when no such tensor is learned.
        ``impl``: the implementation of the two phases (a
        :class:`~gefen_dist.kernels.dispatch.StepImpl`; None: the reference's)."""
        stats = impl.span_statistics if impl is not None else _span.span_statistics
        lay = self.span_layout(st)
        learned = {k for k, lrn in zip(st["global_keys"], st["global_learned"]) if lrn and k in lay}
        if not learned:
            return None
        held = {s.key: (s, p, g) for _, s, p, g in items}
        nbt = sum(v[1] for v in lay.values())
        nct = sum(v[3] for v in lay.values())
        sums = torch.zeros(nct + nbt, dtype=torch.float64)
        maxs = torch.zeros(nbt, dtype=torch.float32)
        cb = st["codebook"]
        work = {}
        for key in learned:
            bo, nb, co, S, shape = lay[key]
            seg, p, g = held.get(key, (None, None, None))
            a, n = (seg.param_offset, seg.numel) if seg is not None else (0, 0)
            sp = _span.SpanPiece.of(shape, a, n)
            if n:
                ix = st["idx"][seg.flat_offset:seg.flat_offset + n]
                m, col, blk, amax = stats(g, ix, st["span_scale"][bo:bo + nb], cb.to(g.device), sp, hp["beta1"])
                sums[co:co + S] += col.cpu()
                sums[nct + bo:nct + bo + nb] += blk.cpu()
                maxs[bo:bo + nb] = amax.cpu()
                work[key] = (sp, p, ix, m)
            else:
                work[key] = (sp, None, None, None)
        if self.comm.world_size > 1:
            self.comm.all_reduce_sum_(sums)
            self.comm.all_reduce_max_(maxs)
        return dict(lay=lay, learned=learned, work=work, sums=sums, maxs=maxs, nct=nct)

    def _span_finish(self, st: Dict[str, Any], hp: Dict[str, Any], res, impl=None) -> None:
        """The second phase (:meth:`_span_stats`' result ``res``): every rank updates every such
        tensor's replicated state and its own pieces."""
        update = impl.span_update_ if impl is not None else _span.span_update_
        lay, work, sums, maxs, nct, cb = res["lay"], res["work"], res["sums"], res["maxs"], res["nct"], st["codebook"]
        for key in sorted(res["learned"]):
            bo, nb, co, S, _ = lay[key]
            sp, p, ix, m = work[key]
            dev = st["span_vblk"].device
            if p is None:  # not held here: the replicated state only
                p = torch.zeros(0, device=dev)
                ix = torch.zeros(0, dtype=torch.uint8, device=dev)
                m = torch.zeros(0, S, device=dev)
            update(p, ix, st["span_scale"][bo:bo + nb], st["span_vblk"][bo:bo + nb], st["span_vcol"][co:co + S], m,
                   sums[co:co + S].to(dev), sums[nct + bo:nct + bo + nb].to(dev), maxs[bo:bo + nb].to(dev), cb.to(dev),
                   sp, **hp)
