"""The step of the tensors kept per block of rows (D16, ``narrow_rows="span"``) in
:class:`gefen_dist.Gefen` (a mixin of it), in two phases so that a refusal comes before anything
changes: :meth:`SpanStepMixin._span_statistics` (every piece's statistics, the reductions over the
ranks, the overflow check: no state or parameter is written) and :meth:`SpanStepMixin._span_update`
(step counts, state, indices, parameters)."""
from __future__ import annotations

import logging
from typing import Dict, Optional, Tuple

import torch

from ..core import rows8 as _rows8
from ..core.quant import nearest_codeword
from ..core.span import SPAN_AUTO_BELOW, SpanPiece, rows_reached
from ..core.step import decay_only_, hyperparameters
from ..kernels import dispatch as _dispatch
from .layout import global_shape, is_dtensor, local_tensor, piece_of
from .state import MODE_ROWS8, MODE_SPAN, SPAN_MODES, narrow_rows_of, step_of

logger = logging.getLogger(__name__)

# a span tensor whose first gradient reaches at least this share of its rows is a dense layer
DENSE_ROWS = 0.5


def warn_dense(found, setting: str = "span") -> None:
    """One log line naming the span tensors ``found`` (``(name, shape, share of rows reached)``) whose
    first gradient reaches at least :data:`DENSE_ROWS` of their rows: dense layers, where one second
    moment per block of rows measured worse than per-row state. A WARNING for a group that asked
    ``narrow_rows="span"`` (docs/algorithm.md D16: +9.6% on the digits classifier's ``(256, 64)``
    input layer); an INFO line for the default ``"auto"`` (and ``"rows8"``), which keeps only rows of fewer than 22
    elements per block (D18: +0.05% to +1.2% on dense layers of rows of 4-16). Rank-local (each rank
    judges its pieces), no collective; the decision stays the user's."""
    if not found:
        return
    dense = [f"{name!r} {tuple(shape)}: {reached:.0%} of rows" for name, shape, reached in found]
    if setting in ("auto", "rows8"):
        logger.info(
            "Gefen: narrow_rows=%r keeps %d dense layer(s) of rows narrower than %d elements per "
            "block of rows (~1.01 B/param instead of 1 + 8 / S): %s. On dense layers of rows of 4-16 elements that "
            "measured 0.05-1.2%% worse than per-row state (docs/algorithm.md D18); narrow_rows='rows' for their param "
            "group keeps them per row.", setting, len(dense), SPAN_AUTO_BELOW,
            "; ".join(dense[:8]) + ("; ..." if len(dense) > 8 else ""))
        return
    logger.warning(
        "Gefen: narrow_rows='span' keeps one second moment per block of rows, but the first gradient of %d such "
        "tensor(s) reaches most of their rows (dense layers: %s). On a dense layer of narrow rows that measured "
        "worse than per-row state (docs/algorithm.md D16); span measured better on sparse embeddings. "
        "Consider narrow_rows='rows' for their param group.",
        len(dense), "; ".join(dense[:8]) + ("; ..." if len(dense) > 8 else ""))


def _rows8_decoded(st, sp: SpanPiece):
    """A rows8 tensor's (D19) decoded scales of every row (float32 ``[rows]``, this piece's rows filled,
    zeros elsewhere: the span kernels with blocks of one row index them by row) and its rows' old
    ``v`` in the same layout (float64, summed over the ranks with the statistics: every rank gets
    every row's)."""
    return _rows8.decode_piece(local_tensor(st["scale_code"]), local_tensor(st["v_code"]), st["scale"], st["v_blk"],
                               SpanPiece(sp.rows, sp.slab, sp.k, sp.row0, sp.nrows), sp.row0)


def _rows8_update_(st, shape, sp: SpanPiece, v_old, col, row_sum, row_amax, beta2: float, step: int):
    """The state update of a rows8 tensor (D19) from the reduced statistics (every rank the same; this
    piece ``sp`` keeps the codes of its rows); returns every row's decoded ``(M_i, v_i)``."""
    sc, vc, scale, v = _rows8.rows8_state_(v_old, st["scale"], st["v_blk"], st["v_col"], col, row_sum, row_amax,
                                           SpanPiece.of(shape), beta2, step, shape)
    if sp.nrows:
        local_tensor(st["scale_code"]).copy_(sc[sp.row0:sp.row0 + sp.nrows])
        local_tensor(st["v_code"]).copy_(vc[sp.row0:sp.row0 + sp.nrows])
    return scale, v


class SpanStepMixin:
    """D16's step (uses the optimizer's ``state``, ``_mode``, ``_impl``, ``_fused``, ``_comm``,
    ``nonfinite``, ``bound_updates`` and ``_raise_column_overflow``)."""

    def _keep_rows8(self, p: torch.Tensor, scale: torch.Tensor, v: torch.Tensor) -> None:
        """Every row's decoded ``(M_i, v_i)`` of rows8 tensor ``p`` in this step (D19): nothing to keep
        here; ZeroGefen keeps them for its appliers until the end of the step."""

    def _span_entries(self, entries):
        return [(g, p) for g, p in entries if self.state.get(p) and self._mode(p) in SPAN_MODES]

    def _note_dense_span(self, live) -> None:
        """:func:`warn_dense` for the span tensors among ``live`` (``(param, piece)`` pairs learning
        their state), from this rank's pieces of their first gradient."""
        names = None
        found: Dict[str, list] = {}
        for p, pc in live:
            if self._mode(p) != MODE_SPAN or pc.grad is None:
                continue
            reached = rows_reached(pc.grad, SpanPiece.of(pc.shape, pc.start, pc.grad.numel()))
            if reached >= DENSE_ROWS:
                names = names or self._names()
                found.setdefault(narrow_rows_of(self._group_of(p)), []).append((names.get(id(p), "?"), pc.shape,
                                                                                 reached))
        for setting, tensors in found.items():
            warn_dense(tensors, setting)

    def _span_sharded(self, todo) -> bool:
        """Whether the ranks hold different pieces of the span tensors ``todo`` (FSDP2/HSDP shards),
        so that their statistics are reduced over the ranks."""
        return self._comm.world_size > 1 and any(is_dtensor(p) for _, p in todo)

    def _span_local(self, p: torch.Tensor):
        """``(start, parameter piece, gradient piece, contributes)`` of this rank's piece of span
        tensor ``p``: its first flat element, the piece the step updates, its gradient, and whether
        its statistics count (False on replicas that must not count twice)."""
        pc = piece_of(p, self._comm.rank, self._comm.world_size > 1)
        return pc.start, local_tensor(p), local_tensor(p.grad), pc.contributes

    @staticmethod
    def _span_target(param: torch.Tensor) -> Tuple[torch.Tensor, bool]:
        """The tensor the second phase writes for ``param``, and whether it is copied back into it."""
        return (param, False) if param.is_contiguous() else (param.contiguous(), True)

    def _span_statistics(self, entries) -> Dict[torch.Tensor, tuple]:
        """The first phase for the learned span tensors of ``entries``, on every rank: each piece's
        statistics (:func:`gefen_dist.core.span.span_statistics`, natively on CPU), one SUM (column and
        block sums of ``g^2``; replicas that must not count twice add zeros) and one MAX (block maxima
        of ``|m|``) all-reduce when any of them is sharded. Raises (on every rank: the sums are
        reduced) when a squared gradient overflows float32, as the factored second moment does, unless
        ``nonfinite="ignore"``. Writes nothing. Returns ``{param: work}`` for :meth:`_span_update`."""
        todo = [(g, p) for g, p in self._span_entries(entries) if self.state[p]["learned"]]
        sharded = self._span_sharded(todo)
        work = []
        for group, p in todo:
            st = self.state[p]
            hp = hyperparameters(group, step_of(st) + 1, self.bound_updates)  # this step's
            start, param, grad, contributes = self._span_local(p)
            sp = SpanPiece.of(global_shape(p), start, param.numel())
            scale, v_old = st["scale"], torch.zeros(0, dtype=torch.float64)
            if self._mode(p) == MODE_ROWS8:  # D19: the kernels step blocks of one row, scales decoded
                scale, v_old = _rows8_decoded(st, sp)
                sp = _rows8.kernel_piece(sp)
            cb = st["codebook"].to(param.device)
            impl = self._impl(param, p, group)
            m, col, blk, amax = impl.span_statistics(grad, local_tensor(st["idx"]), scale, cb, sp, hp["beta1"])
            if sharded and not contributes:
                col.zero_()
                blk.zero_()
                v_old.zero_()
            work.append((p, hp, sp, cb, m, col, blk, amax, impl, v_old))
        if not work:
            return {}
        dev = work[0][4].device  # one buffer per reduction (tensors on several devices: on the first one's)
        sums = torch.cat([t.to(dev) for w in work for t in (w[5], w[6], w[9])])
        maxs = torch.cat([w[7].to(dev) for w in work])
        if sharded:
            self._comm.all_reduce_sum_(sums)
            self._comm.all_reduce_max_(maxs)
        out, so, mo = {}, 0, 0
        for p, hp, sp, cb, m, _, _, _, impl, vo in work:
            c, b = sums[so:so + sp.slab].to(m.device), sums[so + sp.slab:so + sp.slab + sp.nb].to(m.device)
            so += sp.slab + sp.nb
            vo, so = sums[so:so + vo.numel()].to(m.device), so + vo.numel()  # rows8: every row's old v (D19)
            a = maxs[mo:mo + sp.nb].to(m.device)
            mo += sp.nb
            out[p] = (hp, sp, cb, m, c, b, a, impl, vo)
        if self.nonfinite != "ignore" and bool(torch.isinf(sums.to(torch.float32)).any()):
            # g*g above float32's range (a finite gradient): v would be inf and the update NaN
            self._raise_column_overflow({p: torch.cat([w[4], w[5]]).to(torch.float32) for p, w in out.items()})
        return out

    def _span_update(self, entries, work: Dict[torch.Tensor, tuple]) -> None:
        """The second phase for the span tensors of ``entries``: every one counts the step; the
        learned ones in ``work`` (from :meth:`_span_statistics`) take the same state update on every
        rank (:func:`~gefen_dist.core.span.span_update_`) and their piece's indices and parameter;
        one whose gradient has been globally zero so far (D4) only decays."""
        for group, p in self._span_entries(entries):
            st = self.state[p]
            st["step"] += 1
            if p not in work:
                if not st["learned"]:
                    hp = hyperparameters(group, step_of(st), self.bound_updates)
                    decay_only_(local_tensor(p), hp["lr"], hp["weight_decay"])
                continue
            hp, sp, cb, m, c, b, a, impl, vo = work[p]
            param = self._span_local(p)[1]
            target, write_back = self._span_target(param)
            nearest = _dispatch.nearest if self._fused(p) is not False else nearest_codeword
            if self._mode(p) == MODE_ROWS8:  # D19: the codes from the reduced statistics, then the update
                scale, v = _rows8_update_(st, global_shape(p), sp, vo, c, b, a, hp["beta2"], step_of(st))
                self._keep_rows8(p, scale, v)
                impl.span_apply_(target, local_tensor(st["idx"]), scale, v, st["v_col"], m, cb, sp, nearest=nearest,
                                 **hp)
            else:
                impl.span_update_(target, local_tensor(st["idx"]), st["scale"], st["v_blk"], st["v_col"], m, c, b, a,
                                  cb, sp, nearest=nearest, **hp)
            if write_back:
                param.copy_(target)
            for t in (local_tensor(p), st["scale"], st["v_blk"], st["v_col"]) + tuple(
                    local_tensor(st[k]) for k in ("scale_code", "v_code") if k in st):
                torch.autograd.graph.increment_version(t)

    def _step_span(self, entries, work: Optional[Dict[torch.Tensor, tuple]] = None) -> None:
        """One step of the span tensors of ``entries`` (both phases; ``work``: statistics already
        computed for some of them, the others' are computed here). :meth:`_update` leaves these
        tensors alone."""
        work = dict(work or {})
        missing = [(g, p) for g, p in entries if p not in work]
        work.update(self._span_statistics(missing))
        self._span_update(entries, work)
