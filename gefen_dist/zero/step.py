"""ZeroGefen's step (D8): wire modes, owners, one all-gather, appliers. A mixin of
:class:`gefen_dist.zero.optimizer.ZeroGefen`, which holds the partition part and the state."""
from __future__ import annotations

from typing import List, Optional, Tuple

import torch

from ..engine.comm import pad_bytes, take_bytes
from ..core.apply import update_v_col
from ..core.step import (ADAMW_KEYS, adamw_foreach_, col_blocks_of, decay_only_, hyperparameters, per_column_block,
                         row_block_args)
from ..kernels import dispatch as _dispatch
from ..engine.layout import Ranges, global_shape
from ..core.span import SpanPiece
from ..engine.state import MODE_EXACT, NIBBLES, step_of, steps_of
from ..core.nibbles import step_key
from ..core import rows8 as _rows8
from ..engine.state import MODE_ROWS8 as _STATE_ROWS8
from ..engine.state import SPAN_MODES as _STATE_SPAN_MODES
from .partition import (MODE_COMPRESSED, MODE_DENSE, MODE_FACTORED, MODE_LOCAL, MODE_SPAN, factored_wire_compressed,
                        step_wire_bytes)

_STATE_HP = ("beta1", "beta2", "eps", "bc1", "bc2")  # what a state-only update needs of the hyperparameters


def _row_blocks_kw(p: torch.Tensor, st: dict, s: int) -> dict:
    return row_block_args(st["v_col"], global_shape(p)[0], s)


def _rate_unit(st: dict) -> int:
    """Elements per ``sqrt(v_row)`` a factored tensor's compressed update carries: its row, or with column
    blocks (D21) a block of ``S / K`` columns."""
    return st["v_col"].shape[-1] // col_blocks_of(st["v_row"])


def _owner_nibbles(opt, p, st, hp, s, work, g, col_mean_sq) -> None:
    """A ``second_moment="nibbles"`` (D20) owner's step of its rows of ``p`` (flat elements from ``s``, whole
    rows: the global rows key the random numbers) into ``work``, with a copy of the old ``v_col`` (every
    rank advances its own afterwards, as for the factored default's dense path)."""
    impl = _dispatch.select_nibbles(work, opt._fused(p))
    slab = st["v_col"].shape[-1]
    G = st["v_col"].shape[0] if st["v_col"].dim() > 1 else 1
    impl.nibble_step_factored_(work, impl.grad_for(g, work), st["idx"], st["scale"], st["v_row"], st["v_col"].clone(),
                               st["codebook"], col_mean_sq, scale_block=st["scale_block"],
                               key=step_key(0, step_of(st), opt._tensor_index(p)), row0=s // slab,
                               row_block=global_shape(p)[0] // G, **hp)


def _flat_range(t: torch.Tensor, s: int, e: int) -> torch.Tensor:
    """Elements ``[s, e)`` of contiguous ``t`` flattened, with no torch call where there is nothing to
    cut (a whole 1-D tensor): a step takes such a range of every exact tensor."""
    if t.dim() != 1:
        t = t.reshape(-1)
    return t if s == 0 and e == t.numel() else t[s:e]


def _dense_sources(chunks, parts: dict, dst: list) -> list:
    """The owners' new values of the dense ranges as bytes (they travel in the parameter's dtype; the
    destinations are byte views of the ranges), by destination index: ``parts[r]`` lists ``(byte
    offset, bytes, index)`` in chunk ``r`` by increasing offset (the layout's order)."""
    out = [None] * len(dst)
    for r, ps in parts.items():
        ch = chunks[r]
        for (_, _, k), b in zip(ps, Ranges([(off, off + nb) for off, nb, _ in ps], ch.numel()).of(ch)):
            out[k] = b.to(dst[k].device)
    return out


def _one_buffer(chunks) -> bool:
    """Whether the exchanged chunks are consecutive rows of one buffer (what an all-gather returns)."""
    return bool(chunks) and all(c.data_ptr() == chunks[0].data_ptr() + r * chunks[0].numel()
                                for r, c in enumerate(chunks))


class ZeroStepMixin:
    """ZeroGefen's step (module docstring of :mod:`gefen_dist.zero.optimizer`): wire modes, the owners' state
    updates through the implementation of :func:`gefen_dist.kernels.dispatch.select` (with state-only
    functions), one all-gather of the compressed updates, the same implementation's appliers.
    A tensor's state mode is the optimizer's (``_mode``, ``_is_factored``), not read off its keys; the
    wire modes (``MODE_*`` of :mod:`gefen_dist.zero.partition`) are another thing."""

    def _impl(self, t: torch.Tensor, p: Optional[torch.Tensor] = None,
              group: Optional[dict] = None) -> _dispatch.StepImpl:
        """Owners and appliers use one implementation, its state-only functions and appliers (the
        native CPU kernel, the Triton kernels or the eager reference; see
        :func:`gefen_dist.kernels.dispatch.select`)."""
        return _dispatch.select(t, self.fused)


    # A tensor kept per block of rows is cut at rows like a factored one; its block state (scale,
    # v_blk, v_col) is replicated. The owners' pieces take Gefen's two phases with one SUM and one
    # MAX all-reduce (blocks cut by the partition), updating their own rows of the parameter; their
    # new indices travel and every other rank applies those rows with the second phase's operations
    # (the implementation's span_apply_indices_: the native kernel or the reference, bitwise the same).
    def _keep_rows8(self, p: torch.Tensor, scale: torch.Tensor, v: torch.Tensor) -> None:
        """Every row's decoded scale and ``v`` of rows8 tensor ``p`` (D19), for :meth:`_apply_all` in the
        same step (dropped at the step's end: they are O(rows) floats)."""
        self.__dict__.setdefault("_rows8_rows", {})[id(p)] = (scale, v)

    def _span_sharded(self, todo) -> bool:
        return self._world > 1

    def _span_local(self, p: torch.Tensor):
        """This rank's rows of ``p``: a view of the parameter, or (a non-contiguous one) a scratch
        copy whose rows the appliers then write (:meth:`_apply_all`, :meth:`_span_applied_here`)."""
        s, e = self._mine(p)
        grad = p.grad.reshape(-1)[s:e] if p.grad is not None else None
        return s, (p.detach().view(-1)[s:e] if p.is_contiguous() else p.detach().reshape(-1)[s:e].clone()), grad, True

    @staticmethod
    def _span_target(param: torch.Tensor) -> Tuple[torch.Tensor, bool]:
        return param, False

    def _span_applied_here(self, p: torch.Tensor, r: int) -> bool:
        """Whether rank ``r``'s rows of span tensor ``p`` still need the applier on this rank (all
        but this rank's own rows of a contiguous parameter, which its phase updated in place)."""
        return r != self._rank or not p.is_contiguous()

    def _param_range(self, p: torch.Tensor, s: int, e: int, raw: bool = False) -> torch.Tensor:
        """Elements ``[s, e)`` of parameter ``p`` flattened (``raw``: as bytes): for a contiguous ``p``
        a view, kept while its storage, shape and the range stay (every step writes the same ranges);
        for another, a copy made now (written back by the caller)."""
        if not p.is_contiguous():
            t = p.detach().reshape(-1)[s:e]
            return t.view(torch.uint8) if raw else t
        views = self.__dict__.setdefault("_range_views", {})
        key = (p.data_ptr(), tuple(p.shape), s, e, raw)
        hit = views.get((id(p), raw))
        if hit is None or hit[0] != key:
            t = _flat_range(p.detach(), s, e)
            hit = views[(id(p), raw)] = (key, t.view(torch.uint8) if raw else t)
        return hit[1]


    def _zero_update(self, entries, partials=None, batch=None) -> None:
        """One ZeRO-1 step: every rank updates the state it owns and packs the update in its
        compressed form, one all-gather, every rank applies every range identically. Learned tensors
        kept per block of rows (D16) first take Gefen's two phases on the owners' pieces (one SUM and
        one MAX all-reduce), then travel as their new indices (``MODE_SPAN``). ``batch`` (a
        :class:`~gefen_dist.zero.batch.ZeroBatch` whose ``prepare`` passed) takes the column
        statistics, the owners' compressed state updates and the column factors."""
        span = [(g, p) for g, p in entries if self._mode(p) in _STATE_SPAN_MODES and self.state[p]["learned"]]
        span_work = self._span_statistics(span)  # may refuse an overflow: before anything changes
        ids = {id(p) for _, p in span}
        entries = [(g, p) for g, p in entries if id(p) not in ids]
        # Factored tensors: the column means of g^2 over all rows, computed by every rank from its
        # full (DDP) gradient with Gefen's own code, so bitwise the single-process values. It may
        # refuse an overflow too: before the step counts and decays below change anything.
        col = batch.column_means() if batch is not None else self._column_stats(entries, partials)
        items = self._wire_items(entries)  # a span tensor not learned yet: MODE_LOCAL (decay only)
        items += [(p, self.state[p], span_work[p][0], MODE_SPAN) for _, p in span]
        # (factored: one sqrt(v_row) per row, or per block of S / K columns with column blocks, D21)
        wire = [(mode, st["scale_block"], p.element_size(), self._partition.of(p), _rate_unit(st))
                if mode == MODE_FACTORED else (mode, st.get("period", 1), p.element_size(), self._partition.of(p))
                for p, st, hp, mode in items]
        sizes = step_wire_bytes(wire, self._world)
        self._span_update(span, span_work)  # the checks passed: block state, steps, the owners' indices
        parts = self._owner_parts(items, col, batch.owner_states(self, items) if batch is not None else {})
        # every rank: the replicated column factor (v_col <- EMA, then sqrt(v_col / mean(v_col))),
        # after the owners' dense steps, which update a copy of the old v_col themselves
        col_f = batch.column_factors() if batch is not None else {
            id(p): update_v_col(st, col[p], hp, per_column_block(self._impl(p).column_factors, col_blocks_of(st["v_row"])))
            for p, st, hp, mode in items if self._is_factored(p) and mode != MODE_LOCAL}
        dev = items[0][0].device if items else torch.device("cpu")
        self._apply_all(items, self._exchange(parts, sizes, None, dev), col_f)
        self.__dict__.pop("_rows8_rows", None)
        width = max(sizes) if sizes else 0
        self.last_wire = dict(world_size=self._world, bytes_per_rank=sizes, padded_bytes_per_rank=width,
                              gathered_bytes=self._world * width,
                              elements=sum(p.numel() for p, _, _, m in items if m != MODE_LOCAL))


    def _wire_items(self, entries) -> List[tuple]:
        """``(p, state, hyperparameters, wire mode)`` per entry, after advancing its step (tensors
        still unlearned only decay, on every rank)."""
        items, hps = [], {}
        states = [self.state[p] for _, p in entries]
        if entries:  # (the 0-dim step tensors, engine.state.new_step: one call, not one per tensor)
            torch._foreach_add_([st["step"] for st in states], 1.0)
        for (group, p), st, step in zip(entries, states, steps_of(states)):
            key = (id(group), step)  # the scalars of a group at a step count, computed once
            hp = hps.get(key)
            if hp is None:
                hp = hps[key] = hyperparameters(group, step, self.bound_updates)
            mode = self._wire_mode(p, st)
            if mode == MODE_LOCAL:
                decay_only_(p, hp["lr"], hp["weight_decay"])  # on every rank
            items.append((p, st, hp, mode))
        return items

    def _wire_mode(self, p: torch.Tensor, st: dict) -> int:
        """How ``p``'s update travels (span tensors aside): its new values (exact tensors, ``P == 1``,
        a factored tensor whose compressed form is not smaller), nothing (still unlearned: decay
        only), or compressed: (idx, M, sqrt(v_row)) for a factored tensor (the implementation's
        applier does the parameter update of its own full step, ``StepImpl.apply_factored_``), (idx,
        M, sigma) for a shared one."""
        if self._mode(p) == MODE_EXACT:
            return MODE_DENSE
        if not st["learned"]:
            return MODE_LOCAL
        if self._is_factored(p):  # D20 ("nibbles"): dense, its update is of float32 moments only the owner holds
            return (MODE_FACTORED if factored_wire_compressed(st["scale_block"], _rate_unit(st), p.element_size())
                    and self._group_of(p).get("second_moment") != NIBBLES else MODE_DENSE)
        return MODE_COMPRESSED if st["period"] > 1 else MODE_DENSE


    def _owner_parts(self, items, col, done: Optional[dict] = None) -> List[torch.Tensor]:
        """This rank's state update of the ranges it owns, as the parts it sends (``done``: the parts
        of those already updated, by parameter id)."""
        parts: List[torch.Tensor] = []
        exact = self._owner_exact(items)
        for p, st, hp, mode in items:
            s, e = self._mine(p)
            if mode == MODE_LOCAL or e == s:
                continue
            if done and id(p) in done:
                parts.extend(done[id(p)])
            elif mode == MODE_SPAN:  # updated by _span_update
                parts.append(st["idx"])
            elif mode == MODE_COMPRESSED:
                parts.extend(self._owner_compressed(p, st, hp, s, e))
            elif mode == MODE_FACTORED:
                parts.extend(self._owner_factored(p, st, hp, s, e))
            else:
                parts.append(exact[id(p)] if id(p) in exact else self._owner_dense(p, st, hp, s, e, col.get(p)))
        return parts


    def _owner_exact(self, items) -> dict:
        """This rank's new values of its ranges of the exact (AdamW) tensors, by id: foreach operations
        per set of hyperparameters (:func:`adamw_foreach_`, bitwise the per-tensor ``adamw_step_``), a
        few operations in all instead of a dozen per tensor. A contiguous parameter's range is updated
        in place (the values every rank then copies there, this rank's own included, are these), a
        non-contiguous one's in a copy."""
        buckets: dict = {}
        for p, st, hp, mode in items:
            if mode != MODE_DENSE or self._mode(p) != MODE_EXACT:
                continue
            s, e = self._mine(p)
            if e == s:
                continue
            # (the items of a param group at a step count share one hyperparameter dict, _wire_items)
            b = buckets.setdefault(id(hp), (hp, []))[1]
            b.append((p, self._param_range(p, s, e), _flat_range(p.grad, s, e), st))
        out = {}
        for hp, members in buckets.values():
            adamw_foreach_([w for _, w, _, _ in members], [g for _, _, g, _ in members],
                           [st["exp_avg"] for *_, st in members], [st["exp_avg_sq"] for *_, st in members],
                           **{k: hp[k] for k in ADAMW_KEYS})
            out.update((id(p), w) for p, w, _, _ in members)
        return out


    def _apply_layout(self, items) -> List[tuple]:
        """Where every rank's range of every item sits in the exchanged chunks, in the order the
        owners packed them (:meth:`_owner_parts`): ``(r, item index, s, e, offs)`` per range that
        travels, ``offs`` the byte offsets of its parts in chunk ``r`` (:func:`take_bytes`'s)."""
        out = []
        for r in range(self._world):
            off = 0
            for i, (p, st, hp, mode) in enumerate(items):
                s, e = self._partition.of(p)[r]
                n = e - s
                if mode == MODE_LOCAL or n == 0:
                    continue
                if mode == MODE_COMPRESSED:
                    sizes = (n, 4 * (n // st["period"]), 4 * (n // st["period"]))
                elif mode == MODE_FACTORED:
                    sizes = (n, 4 * (n // st["scale_block"]), 4 * (n // _rate_unit(st)))
                else:  # MODE_SPAN: the indices; MODE_DENSE: the values
                    sizes = (n if mode == MODE_SPAN else n * p.element_size(),)
                offs = []
                for nb in sizes:
                    offs.append(off)
                    off += pad_bytes(nb)
                out.append((r, i, s, e, tuple(offs)))
        return out


    def _apply_all(self, items, chunks, col_f) -> None:
        """Every rank applies every rank's range of every tensor, identically (the appliers of the
        owners' implementation, :meth:`_impl`, or the owner's dense values). Where the implementation
        applies many ranges at once (the Triton kernels, :class:`~gefen_dist.kernels.triton_state.ApplyMany`),
        the factored and compressed ranges of contiguous parameters go through it."""
        layout, many, rest = self._apply_plan(items, chunks)
        if many is not None and _one_buffer(chunks):
            self._apply_many(items, chunks, col_f, many)
        else:  # (an exchange gives its chunks as rows of one buffer; if not, each range on its own)
            rest = layout
        works, dense, dense_src = {}, [], {}
        for r, i, s, e, offs in rest:
            p, st, hp, mode = items[i]
            n, ch = e - s, chunks[r]
            if mode == MODE_DENSE and p.is_contiguous():  # (a cached byte view of the range, no torch call)
                dense.append(self._param_range(p, s, e, raw=True))
                dense_src.setdefault(r, []).append((offs[0], n * p.element_size(), len(dense) - 1))
                continue
            if id(p) not in works:
                works[id(p)] = p if p.is_contiguous() else p.detach().contiguous()
            flat, impl = works[id(p)].view(-1), self._impl(p)
            if mode == MODE_COMPRESSED:
                P = st["period"]
                idx, M, sigma = (take_bytes(ch, o, c, dt)[0].to(p.device) for o, c, dt in
                                 zip(offs, (n, n // P, n // P), (torch.uint8, torch.float32, torch.float32)))
                impl.apply_compressed_(flat[s:e], idx, M, sigma, st["codebook"], P, hp)
            elif mode == MODE_FACTORED:
                B, slab, K = st["scale_block"], st["v_col"].shape[-1], col_blocks_of(st["v_row"])
                idx, M, rf = (take_bytes(ch, o, c, dt)[0].to(p.device) for o, c, dt in
                              zip(offs, (n, n // B, n // slab * K), (torch.uint8, torch.float32, torch.float32)))
                impl.apply_factored_(flat[s:e], idx, M, rf, col_f[id(p)], st["codebook"], B, slab, hp,
                                     **_row_blocks_kw(p, st, s), col_blocks=K)
            elif mode == MODE_SPAN:
                if self._span_applied_here(p, r):
                    sp, scale, v = SpanPiece.of(global_shape(p), s, n), st["scale"], st["v_blk"]
                    if self._mode(p) == _STATE_ROWS8:  # D19: the rows' decoded codes, blocks of one row
                        scale, v = self._rows8_rows[id(p)]  # every row's, decoded by this step's _span_update
                        sp = _rows8.kernel_piece(sp)
                    impl.span_apply_indices_(flat[s:e], take_bytes(ch, offs[0], n, torch.uint8)[0].to(p.device),
                                             scale, v, st["v_col"], st["codebook"], sp, **hp)
            else:  # the owner's new values: copied below, all in one foreach copy
                dense.append(flat[s:e].view(torch.uint8))
                dense_src.setdefault(r, []).append((offs[0], n * p.element_size(), len(dense) - 1))
        if dense:
            torch._foreach_copy_(dense, _dense_sources(chunks, dense_src, dense))
        for p, st, hp, mode in items:
            w = works.get(id(p))
            if w is not None and w is not p:
                p.copy_(w)


    def _apply_plan(self, items, chunks):
        """:meth:`_apply_layout`, the multi-range applier of the ranges it can take (or None) and the
        other ranges, kept while the partition, the exchange's width, the implementation and the items'
        tensors, modes and blocks stay the same."""
        width = chunks[0].numel() if chunks else 0
        impl = next((self._impl(p) for p, st, hp, mode in items if mode in (MODE_FACTORED, MODE_COMPRESSED)), None)
        key = (width, impl, tuple((id(p), p.data_ptr(), mode, st.get("period"), st.get("scale_block"))
                                  for p, st, hp, mode in items))
        hit = self.__dict__.get("_apply_cache")
        if hit is not None and hit[0] is self._partition and hit[1] == key:
            return hit[2:]
        layout = self._apply_layout(items)
        pick = [k for k, (r, i, s, e, offs) in enumerate(layout)
                if impl is not None and impl.apply_many is not None and items[i][3] in (MODE_FACTORED, MODE_COMPRESSED)
                and items[i][0].is_contiguous() and self._impl(items[i][0]) is impl
                and (items[i][3] != MODE_FACTORED or col_blocks_of(items[i][1]["v_row"]) == 1)  # (D21: per range)
                and chunks[r].device == items[i][0].device]
        many = None
        if pick and _one_buffer(chunks):
            ranges = []
            for k in pick:
                r, i, s, e, offs = layout[k]
                p, st, hp, mode = items[i]
                fact = mode == MODE_FACTORED
                S = st["v_col"].shape[-1] if fact else st["period"]
                kw = _row_blocks_kw(p, st, s) if fact else {}
                # (tensor, first element, rows, mode, row length, scale block, row0, row block, offsets, item)
                ranges.append((p, s, (e - s) // S, 2 if fact else 0, S, st["scale_block"] if fact else S,
                               kw.get("row0", 0), kw.get("row_block", 0), tuple(o + r * width for o in offs), i))
            many = impl.apply_many(ranges, items[layout[pick[0]][1]][0].device)
        taken = set(pick) if many is not None else set()
        rest = [x for k, x in enumerate(layout) if k not in taken]
        self._apply_cache = (self._partition, key, layout, many, rest)
        return layout, many, rest


    @staticmethod
    def _apply_many(items, chunks, col_f, applier) -> None:
        """The multi-range applier's one call: each item's scalars and column factors (by item index)."""
        cb = next(st["codebook"] for p, st, hp, mode in items if mode in (MODE_FACTORED, MODE_COMPRESSED))
        scal: dict = {}  # per hyperparameter dict (the items of a group at a step count share one)
        for p, st, hp, mode in items:
            if id(hp) not in scal:
                scal[id(hp)] = applier.scalars(hp)
        applier.run(chunks[0].data_ptr(), cb, [scal[id(hp)] for p, st, hp, mode in items],
                    [col_f.get(id(p)) for p, st, hp, mode in items])


    def _owner_compressed(self, p, st, hp, s, e) -> List[torch.Tensor]:
        """Update this rank's (v, m, idx, scale) of ``p[s:e]``; return (idx, M, sigma)."""
        P = st["period"]
        assert st["scale_block"] == P
        g = p.grad.reshape(-1)[s:e].contiguous()
        idx, scale, v, cb = st["idx"], st["scale"], st["v"], st["codebook"]
        impl = self._impl(p)
        sigma = impl.quantized_state_(impl.grad_for(g, p), idx, scale, v, cb, **{k: hp[k] for k in _STATE_HP}, period=P, scale_block=P)
        return [idx, scale, sigma]


    def _owner_dense(self, p, st, hp, s, e, col_mean_sq=None) -> torch.Tensor:
        """This rank's new values of ``p[s:e]`` of a quantized tensor that travels dense (the full step
        when P == 1 or a factored tensor's compressed form is not smaller; exact tensors:
        :meth:`_owner_exact`)."""
        work = p.detach().reshape(-1)[s:e].clone()
        g = p.grad.reshape(-1)[s:e].contiguous()
        impl = self._impl(work)
        gk = impl.grad_for(g, work)
        if self._group_of(p).get("second_moment") == NIBBLES:
            _owner_nibbles(self, p, st, hp, s, work, g, col_mean_sq)
        elif self._is_factored(p):
            # Gefen's factored step on this rank's rows; it updates a copy of the (old) v_col,
            # every rank updates its own v_col afterwards (update_v_col).
            impl.quantized_step_factored_(work, gk, st["idx"], st["scale"], st["v_row"], st["v_col"].clone(),
                                          st["codebook"], col_mean_sq, scale_block=st["scale_block"],
                                          **_row_blocks_kw(p, st, s), **hp)
        else:
            impl.quantized_step_(work, gk, st["idx"], st["scale"], st["v"], st["codebook"], period=st["period"],
                                 scale_block=st["scale_block"], **hp)
        return work


    def _owner_factored(self, p, st, hp, s, e) -> List[torch.Tensor]:
        """Update this rank's rows of ``p`` (v_row, m, idx, scale); return (idx, M, sqrt(v_row)) (column
        blocks, D21: ``sqrt(v_row)`` per row and block of columns).

        The operations of :func:`quantized_step_factored_eager_`, in its order, minus the
        column factor and the parameter update (the appliers do those)."""
        B, slab = st["scale_block"], st["v_col"].shape[-1]
        g = p.grad.reshape(-1)[s:e].contiguous()
        idx, scale, v_row, cb = st["idx"], st["scale"], st["v_row"], st["codebook"]
        impl = self._impl(p)
        rsq = impl.factored_state_(impl.grad_for(g, p), idx, scale, v_row, cb, slab=slab, **{k: hp[k] for k in _STATE_HP}, scale_block=B)
        return [idx, scale, rsq]
