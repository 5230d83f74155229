"""The per-tensor step of :class:`gefen_dist.Gefen` (a mixin of it; the optimizer holds the state,
the learner and the API): what one ``step()`` does to each tensor once its state is learned."""
from __future__ import annotations

import logging
from typing import Dict, List, Optional

import torch

from ..core import rows8 as _rows8
from ..core import span as _span
from .column_stats import column_means, piece_column_sums
from .cuda_batch import CudaBatch
from ..core.step import (adamw_foreach_, adamw_hyperparameters, adamw_step_, col_blocks_of, decay_only_, ema_,
                         hyperparameters, row_block_args)
from .layout import global_shape, is_dtensor, local_tensor, piece_of
from ..core.nibbles import step_key
from ..kernels import dispatch as _dispatch
from .state import MODE_EXACT, MODE_FACTORED, MODE_ROWS8, NIBBLES, SPAN_MODES, step_of

logger = logging.getLogger(__name__)


class GefenStepMixin:
    """Gefen's per-tensor step (the path when no CUDA batch steps the model): column statistics of
    the factored second moment over pieces, exact tensors batched with foreach on CUDA, each
    quantized tensor through the implementation of :func:`gefen_dist.kernels.dispatch.select`.
    A tensor's mode is the optimizer's ``_mode(p)`` (its state spec's), never read off the keys of
    its state."""

    def _foreach_exact(self, p: torch.Tensor, group: Optional[dict] = None) -> bool:
        """Exact (AdamW) tensors are stepped together with foreach operations (bitwise the per-tensor
        :func:`adamw_step_`, tests/test_optimizer.py), unless ``fused=False`` asks for the plain eager
        path: one call per (group, step, device) instead of one per tensor, the step's Python overhead
        on a model of many small tensors."""
        st = self.state.get(p)
        return bool(st) and self._mode(p) == MODE_EXACT and self._fused(p, group) is not False


    def _update_exact_batched(self, batched) -> None:
        """:func:`adamw_foreach_` over the exact tensors of ``batched``, per (group, step, device)."""
        if not batched:
            return
        steps = [self.state[p]["step"] for _, p in batched]
        torch._foreach_add_(steps, 1.0)  # CPU scalars, as AdamW keeps them: one operation, one read
        buckets: Dict[tuple, list] = {}
        for (group, p), step in zip(batched, torch.stack(steps).tolist()):
            key = (id(group), int(step), local_tensor(p).device)
            buckets.setdefault(key, (group, []))[1].append(p)
        for (_, step, _), (group, ps) in buckets.items():
            hp = adamw_hyperparameters(group, step)
            adamw_foreach_([local_tensor(p) for p in ps], [local_tensor(p.grad) for p in ps],
                           [local_tensor(self.state[p]["exp_avg"]) for p in ps],
                           [local_tensor(self.state[p]["exp_avg_sq"]) for p in ps], **hp)


    def _factored(self, entries) -> List[torch.Tensor]:
        """The factored tensors of ``entries`` whose second moment is learned."""
        out = []
        for _, p in entries:
            st = self.state.get(p)
            if st and self._mode(p) == MODE_FACTORED and st["learned"]:
                out.append(p)
        return out


    def _column_partials(self, entries, fact: Optional[List[torch.Tensor]] = None
                         ) -> Dict[torch.Tensor, torch.Tensor]:
        """This rank's float64 column sums of ``g^2`` (``[row]``) for each learned factored tensor:
        the native one-pass kernel on CPU (``fused`` not False), the eager function otherwise.
        Replicas of a sharded tensor that do not contribute give zeros."""
        fact = self._factored(entries) if fact is None else fact
        sharded = self._comm.world_size > 1 and any(is_dtensor(p) for p in fact)
        groups = {id(p): g for g, p in entries}
        out = {}
        for p in fact:
            pc = piece_of(p, self._comm.rank, self._comm.world_size > 1)
            sumsq = self._impl(pc.grad, p, groups.get(id(p))).column_sumsq if pc.grad is not None else None
            out[p] = piece_column_sums(pc, self.state[p]["v_col"], global_shape(p)[0], sumsq,
                                       skip=sharded and not pc.contributes)
        return out


    def _refuse_overflow_before_learning(self, live, sharded: Optional[bool] = None) -> None:
        """The overflow refusal of a step's column statistics (:meth:`_column_stats`, the span
        tensors' first phase) for the tensors about to learn their state (``live``: ``(param,
        piece)``, the same tensors on every rank), before periods, codebook or state exist: a first
        step whose squared gradient overflows float32 leaves nothing learned from it. The same sums
        as the step (factored: column sums per block of rows; span: column and block sums), one SUM
        all-reduce when ``sharded`` (default: any piece is a DTensor's)."""
        if self.nonfinite == "ignore":
            return
        todo = [(p, pc) for p, pc in live if self._mode(p) in (MODE_FACTORED,) + SPAN_MODES]
        if not todo:
            return
        if sharded is None:
            sharded = self._comm.world_size > 1 and any(is_dtensor(p) for p, _ in todo)
        sums = []
        for p, pc in todo:
            shape = global_shape(p)
            if self._mode(p) in SPAN_MODES:
                sp = _span.SpanPiece.of(shape, pc.start, pc.grad.numel() if pc.grad is not None else 0)
                if self._mode(p) == MODE_ROWS8:  # the sums of its step: per row (D19)
                    sp = _rows8.kernel_piece(sp)
                s = (_span.span_square_sums(pc.grad, sp) if pc.grad is not None and pc.grad.numel()
                     else torch.zeros(sp.slab + sp.nb, dtype=torch.float64))
                if sharded and not pc.contributes:
                    s = torch.zeros_like(s)
            else:
                spec = self._spec(p)
                vc = torch.empty((spec.row_blocks, spec.geometry.slab) if spec.row_blocks > 1 else (spec.geometry.slab,))
                sumsq = self._impl(pc.grad, p).column_sumsq if pc.grad is not None else None
                s = piece_column_sums(pc, vc, shape[0], sumsq, skip=sharded and not pc.contributes)
            sums.append(s.cpu())
        buf = torch.cat(sums)
        if sharded:
            self._comm.all_reduce_sum_(buf)
        if bool(torch.isinf(buf.to(torch.float32)).any()):
            out, o = {}, 0
            for (p, _), s in zip(todo, sums):
                out[p] = buf[o:o + s.numel()].to(torch.float32)
                o += s.numel()
            self._raise_column_overflow(out)

    def _column_stats(self, entries, partials: Optional[Dict[torch.Tensor, torch.Tensor]] = None
                      ) -> Dict[torch.Tensor, torch.Tensor]:
        """Column means of g^2 over all global rows for factored tensors (one all-reduce when any
        of them is sharded; replicas contribute zeros so sums equal a single process's).
        ``partials`` (from :meth:`_column_partials`) are reused; tensors learned since then (the
        first step) are computed here."""
        fact = self._factored(entries)
        if not fact:
            return {}
        sharded = self._comm.world_size > 1 and any(is_dtensor(p) for p in fact)
        partials = dict(partials or {})
        missing = [p for p in fact if p not in partials]
        if missing:
            partials.update(self._column_partials(entries, missing))
        means, buf = column_means(self._comm, [partials[p] for p in fact],
                                  [(self.state[p]["v_col"], global_shape(p)[0], local_tensor(p).device) for p in fact],
                                  sharded)
        out = dict(zip(fact, means))
        if self.nonfinite != "ignore" and bool(torch.isinf(buf.to(torch.float32)).any()):
            # one host synchronisation for all tensors (the per-tensor check only on failure)
            self._raise_column_overflow(out)
        return out


    def _batched_step(self, entries) -> bool:
        """The step by the multi-tensor CUDA batches (:class:`~gefen_dist.engine.cuda_batch.CudaBatch`,
        one per device) when they take ``entries``: True when the step is done (or skipped), False
        when the per-tensor path must take it. The tensors the batches leave beside them
        (:meth:`CudaBatch.split`: kept per block of rows, D16; in a single process, quantized tensors
        the batch cannot take) are checked first (a non-finite gradient skips or raises before
        anything changes) and their statistics computed (an overflow raises); then every batch is
        checked, then every batch steps, then the per-tensor path steps the tensors beside them."""
        plan = CudaBatch.plan(self, entries)
        if plan is None:
            return False
        batches, beside = plan
        if beside and self.nonfinite != "ignore" and self._nonfinite(beside):
            return True
        span = [(g, p) for g, p in beside if self._mode(p) in SPAN_MODES]
        other = [(g, p) for g, p in beside if self._mode(p) not in SPAN_MODES]
        # their statistics before the batches change anything: an overflow raises here (they write
        # nothing, so a skipped step discards them)
        work = self._span_statistics(span) if span else {}
        col = self._column_stats(other) if other else {}
        preps = []
        for batch in batches:
            prep = batch.prepare(self)
            if prep is None:
                return False
            if prep is True:
                return True  # skipped (nonfinite="skip"); "raise" raised
            preps.append(prep)
        if self._capturable_mixed(batches, beside):
            return True  # skipped on every device and beside (nonfinite="skip")
        for batch, prep in zip(batches, preps):
            batch.apply(self, prep)
        if span:
            self._prepare(span)
            self._step_span(span, work)  # tensors learned by this step: their statistics now
        if other:
            self._update_all(other, col)
        self._announce()
        return True

    def _capturable_mixed(self, batches, beside) -> bool:
        """``capturable=True`` with tensors stepped beside the batch or batches on several devices: each
        batch's skip flag is its own device's, so the step reads them on the host (one synchronisation,
        a WARNING once) and skips everything when one is set. True when the step is skipped."""
        flags = [b.dstep.skip for b in batches if b.dstep is not None and b.dstep.check]
        if not flags or (len(batches) == 1 and not beside):
            return False
        if not self.__dict__.get("_capturable_warned"):
            self._capturable_warned = True
            logger.warning("Gefen(capturable=True): %s, so each step reads the non-finite verdict on the host (one "
                           "synchronisation per step; such a step cannot be captured in a CUDA graph)",
                           f"{len(beside)} tensor(s) are stepped beside the multi-tensor batch" if beside
                           else f"the parameters are on {len(batches)} devices")
        if any(bool(f) for f in flags):
            self.skipped_steps += 1
            logger.warning("Gefen: non-finite gradient or overflowing column statistic; step skipped on every "
                           "device (%d skipped so far)", self.skipped_steps)
            return True
        return False

    def _update_all(self, entries, col: Dict[torch.Tensor, torch.Tensor]) -> None:
        """Every tensor of ``entries`` (span tensors excepted: :meth:`_step_span`): the exact ones
        batched by foreach operations, the others one by one (``col``: the factored tensors' column
        statistics)."""
        exact = []
        for group, p in entries:
            if self._foreach_exact(p, group):
                exact.append((group, p))
            else:
                self._update(group, p, col.get(p))
        self._update_exact_batched(exact)

    def _update(self, group: dict, p: torch.Tensor, col_mean_sq: Optional[torch.Tensor] = None) -> None:
        st = self.state[p]
        if self._mode(p) in SPAN_MODES:
            return  # stepped by _step_span
        st["step"] += 1
        hp = hyperparameters(group, step_of(st), self.bound_updates)
        lr = hp["lr"]
        param, grad = local_tensor(p), local_tensor(p.grad)
        mode = self._mode(p)
        if mode == MODE_EXACT:
            adamw_step_(param, grad, local_tensor(st["exp_avg"]), local_tensor(st["exp_avg_sq"]), **hp)
            return
        if param.numel() == 0:
            if mode == MODE_FACTORED and st["learned"] and col_mean_sq is not None:
                # an empty piece (an FSDP2 shard of no rows) still advances the replicated column EMA,
                # as every other rank does: v_col means the same on every rank
                ema_(st["v_col"], col_mean_sq.view_as(st["v_col"]), hp["beta2"])
            return
        if not st["learned"]:
            decay_only_(param, lr, hp["weight_decay"])
            return
        contiguous = param.is_contiguous()
        work = param if contiguous else param.contiguous()
        impl = self._impl(work, p, group)
        if not impl.col_blocks and mode == MODE_FACTORED and col_blocks_of(local_tensor(st["v_row"])) > 1:
            impl = self._eager_col_blocks(work, impl)
        g = impl.grad_for(grad.contiguous(), work)
        cb = st["codebook"].to(work.device)
        if mode == MODE_FACTORED and group.get("second_moment") == NIBBLES:
            self._step_nibbles(group, p, work, grad, col_mean_sq, hp)
        elif mode == MODE_FACTORED:
            rkw = {}
            if st["v_col"].dim() > 1:  # row blocks (D12): this piece's first global row, rows per block
                rkw = row_block_args(st["v_col"], global_shape(p)[0],
                                     piece_of(p, self._comm.rank, self._comm.world_size > 1).start)
            impl.quantized_step_factored_(work, g, local_tensor(st["idx"]), local_tensor(st["scale"]),
                                          local_tensor(st["v_row"]), st["v_col"], cb, col_mean_sq,
                                          scale_block=st["scale_block"], **rkw, **hp)
        else:
            impl.quantized_step_(work, g, local_tensor(st["idx"]), local_tensor(st["scale"]), local_tensor(st["v"]),
                                 cb, period=st["period"], scale_block=st["scale_block"], **hp)
        if not contiguous:
            param.copy_(work)

    def _eager_col_blocks(self, work: torch.Tensor, impl):
        """The implementation of a tensor with column blocks (D21) where ``impl`` does not take them (every
        shipped implementation does; ``StepImpl.col_blocks``): the eager reference, announced once."""
        if not self.__dict__.get("_col_blocks_noted"):
            self._col_blocks_noted = True
            logger.info("Gefen: tensors with column blocks (col_blocks, D21) on %s are stepped by the eager reference "
                        "(the %s kernels do not take them yet: torch operations, slower, the same math)",
                        work.device.type, impl.name)
        return _dispatch.select(work, False)

    def _step_nibbles(self, group: dict, p: torch.Tensor, work: torch.Tensor, grad: torch.Tensor,
                      col_mean_sq: torch.Tensor, hp: dict) -> None:
        """One factored tensor of a ``second_moment="nibbles"`` group (D20): the implementation of
        :func:`gefen_dist.kernels.dispatch.select_nibbles` on this piece of whole rows, its random
        numbers keyed by the tensor's place in the optimizer and the piece's first global row."""
        st = self.state[p]
        slab = st["v_col"].shape[-1]
        row0 = piece_of(p, self._comm.rank, self._comm.world_size > 1).start // slab
        G = st["v_col"].shape[0] if st["v_col"].dim() > 1 else 1
        impl = _dispatch.select_nibbles(work, self._fused(p, group))
        impl.nibble_step_factored_(work, impl.grad_for(grad.contiguous(), work), local_tensor(st["idx"]),
                                   local_tensor(st["scale"]), local_tensor(st["v_row"]), st["v_col"],
                                   st["codebook"].to(work.device), col_mean_sq, scale_block=st["scale_block"],
                                   key=step_key(0, step_of(st), self._tensor_index(p)), row0=row0,
                                   row_block=global_shape(p)[0] // G, **hp)

    def _tensor_index(self, p: torch.Tensor) -> int:
        """``p``'s place in the optimizer's parameters (group by group): the same on every rank and
        after a reload, so it keys a tensor's random numbers (D20)."""
        sig = tuple((id(g["params"]), len(g["params"])) for g in self.param_groups)
        table = self.__dict__.get("_tensor_indices")
        if table is None or table[0] != sig:
            table = self._tensor_indices = (sig, {id(q): i for i, q in enumerate(
                q for g in self.param_groups for q in g["params"])})
        return table[1][id(p)]
