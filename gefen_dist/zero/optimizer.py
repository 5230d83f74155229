"""``gefen_dist.ZeroGefen``: ZeRO-1 Gefen for DDP / torchrun users (D8).

Parameters are plain tensors replicated on every rank and their gradients are identical on every
rank (DDP has all-reduced them). The optimizer state is partitioned: all trainable parameters are
flattened and concatenated in param-group order into one *global parameter space*, and each rank
owns one contiguous, block-aligned range of it (:func:`partition`). A rank keeps Gefen's state
(``idx``/``scale``/``v``, ``idx``/``scale``/``v_row`` for ``second_moment="factored"``, or
``exp_avg``/``exp_avg_sq`` for exact tensors) only for the elements it owns, as flat slices of the
single-process state; a factored tensor's column factor ``v_col`` (``[row]``) is replicated.

A step:

1. every rank runs the state update of its own ranges (second moment, first moment, new scale,
   new indices), exactly as :func:`gefen_dist.core.step.quantized_step_eager_` does, and writes the
   update in its compressed form into one byte buffer: for a quantized range with period
   ``P > 1`` the new ``idx`` bytes plus, per block, the new absmax scale ``M_b`` and the step size
   ``sigma_b`` (float32); for exact tensors and ``P == 1`` tensors (whose step size is per element,
   so the compressed form would be larger than the values) the new parameter values, bitwise, in
   the parameter's dtype; for a factored tensor (always cut at rows) the new ``idx`` bytes, per
   scale block ``M_b`` and per row ``sqrt(v_row_i)`` (float32; with column blocks, D21, one per row and
   block of columns), or its new values when that is not smaller (:func:`factored_wire_compressed`); for a tensor kept per block of rows (D16,
   ``narrow_rows="span"``, cut at rows, its block state replicated and updated by every rank from
   the owners' statistics, one SUM and one MAX all-reduce) the new ``idx`` bytes only;
2. one ``all_gather`` of the byte buffers (padded to the largest rank's size; ranks that own
   nothing still take part);
3. every rank applies every range with the same code: for element ``i`` of block ``b``
   ``p_i <- p_i * (1 - lr*wd) - ((C[idx_i] * M_b) * sigma_b) * lr`` in float32, in the eager step's
   exact operation order (decay skipped when ``wd == 0``), or copies the dense values. Factored:
   every rank first updates its replicated ``v_col`` from the column means of ``g^2``, which it
   computes itself from its whole (DDP) gradient with Gefen's own code (float64 sums, so bitwise
   the single-process values; no collective; on the Triton path in the order of single-process
   Gefen's CUDA batch, :mod:`gefen_dist.zero.batch`), then applies
   ``sigma_ij = (1 / ((sqrt(v_row_i) * sqrt(v_col_j / mean(v_col))) / sqrt(bc2) + eps)) * (1/bc1)``
   and ``p_ij <- p_ij * (1 - lr*wd) - ((C[idx_ij] * M_b) * sigma_ij) * lr`` in
   :func:`~gefen_dist.core.step.quantized_step_factored_eager_`'s order. Span tensors:
   the implementation's ``span_apply_indices_`` (the second phase's update from the received indices:
   :func:`~gefen_dist.core.span.span_apply_indices_`, the native kernel's or the Triton kernel's,
   bitwise the same).

So replicas stay bitwise identical, and equal single-process :class:`~gefen_dist.Gefen` with the
same ``fused`` setting bitwise: with ``fused=False`` the owner replays the eager step's
operations; with the native kernel (``fused=None`` on CPU) the owner updates its state with the
kernel (on a scratch copy of its parameter slice) and computes ``sigma`` with the kernel's float32
operations and a correctly rounded sqrt, so the applied update is the kernel's (the same holds
for the factored second moment); on CUDA the Triton step's (:mod:`gefen_dist.kernels.triton_state`)
likewise. The reference appliers live in :mod:`gefen_dist.core.apply`, each implementation's in
its :class:`~gefen_dist.kernels.dispatch.StepImpl`.

The partition balances the ranks' *state bytes* and cuts a tensor only at its blocks: a quantized
tensor's unit is its scale block ``B`` (``P``, or the row-aligned absmax block when ``P == 1``;
costing ``B`` idx bytes + one fp32 scale + ``B/P`` fp32 second moments), an exact tensor's unit is
one element (8 bytes), a factored tensor's unit is always its row (``row`` idx bytes + ``row/B``
fp32 scales + one fp32 ``v_row``). Each rank's state is within one unit's bytes of the mean. Periods are only
known after learning, so the partition is decided when state is first created (first step,
:meth:`ZeroGefen.init_state`, :meth:`ZeroGefen.load_state_dict`), with a quantized tensor whose
period is unknown cut only at its rows (every row is a whole number of blocks for every period it
can get, so the range stays valid when its period is learned later), and decided again, once, when
the codebook is learned and the periods are known. Only exact tensors can hold nonzero state before
that, and only their ranges travel. Learning is split across ranks: each rank computes period
statistics and histogram counts only for what it owns, and the base class's collectives combine
them (the same ones, in the same order, on every rank).

Checkpoints (:mod:`gefen_dist.zero.checkpoint`): :meth:`ZeroGefen.consolidate_state_dict` gathers the compressed state (never a
dequantized fp32 copy of m or v) onto one rank, whose :meth:`state_dict` then has exactly
single-process Gefen's layout, independent of the world size; :meth:`load_state_dict` at any
world size takes this rank's slice. Plain :class:`Gefen` loads the same dict.
"""
from __future__ import annotations

import hashlib
import logging
import math
import time
from typing import Any, Dict, Iterable, List, Optional, Sequence, Set, Tuple

import torch

from ..engine.comm import exchange_bytes, take_bytes
from ..core import periods as _periods
from ..engine.layout import Geometry, Piece, global_shape, is_dtensor, is_exact
from ..core.step import col_blocks_of
from ..engine import state as _state
from ..optim.gefen import Gefen, Report
from ..optim.validation import GROUP_REJECTED_SHARDED, prestep_zero
from .checkpoint import ZeroCheckpointMixin
from .batch import ZeroBatch
from .step import ZeroStepMixin
from .partition import (MODE_COMPRESSED, MODE_DENSE, MODE_FACTORED, MODE_LOCAL, Partition, _pad,  # noqa: F401
                        factored_wire_compressed, partition, step_wire_bytes, unit_cost)

logger = logging.getLogger(__name__)

__all__ = ["ZeroGefen", "partition", "unit_cost", "step_wire_bytes", "factored_wire_compressed", "MODE_LOCAL",
           "MODE_COMPRESSED", "MODE_DENSE", "MODE_FACTORED"]


class ZeroGefen(ZeroStepMixin, ZeroCheckpointMixin, Gefen):
    r"""Gefen with ZeRO-1 state partitioning for DDP (replicated parameters, identical gradients).

    Each rank keeps Gefen's state only for its block-aligned share of the parameters (about
    ``1/world_size`` of it) and, after updating it, all-gathers the update in its compressed form
    (1-byte indices plus two float32 per block, or for a factored second moment one float32 per
    block and one per row: about 1 byte per parameter on the wire instead of 4 for an fp32
    parameter all-gather). Results are bitwise identical on every rank and equal to
    single-process :class:`Gefen` (see the module docstring for the exact statement).

    Args:
        params, lr, betas, eps, weight_decay: as for :class:`Gefen` / ``torch.optim.AdamW``.
        process_group: the group the state is partitioned over (default: WORLD; a single process
            when ``torch.distributed`` is not initialised).
        **gefen_kwargs: other :class:`Gefen` options (``small_threshold``, ``fused``,
            ``second_moment``: ``"factored"``, ``"shared"`` or ``"elementwise"``, also per param group).

    Checkpointing: call ``consolidate_state_dict(to=r)`` on every rank, then ``state_dict()`` on
    rank ``r``. The result has single-process Gefen's layout; load it with ``load_state_dict`` at
    any world size (or into plain :class:`Gefen`).
    """

    _group_rejected = GROUP_REJECTED_SHARDED  # one implementation steps the partition of all groups
    _complex_ok = False  # flat partitions (second_moment="nibbles", D20: its new values travel dense)


    def __init__(self, params: Iterable, lr: float | torch.Tensor = 1e-3, betas: Tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 1e-2, *, process_group: Optional[Any] = None,
                 **gefen_kwargs):
        self._partition: Optional[Partition] = None
        self._consolidated: Optional[Dict[int, dict]] = None
        self.last_wire: Dict[str, Any] = {}
        super().__init__(params, lr, betas, eps, weight_decay, process_group=process_group, **gefen_kwargs)

    def add_param_group(self, param_group: Dict[str, Any]) -> None:
        super().add_param_group(param_group)
        g = self.param_groups[-1]
        for p in g["params"]:
            if is_dtensor(p):
                raise TypeError("ZeroGefen takes plain replicated parameters (DDP); for DTensor/FSDP2 "
                                "parameters use gefen_dist.Gefen, which shards with them")

    # ------------------------------------------------------------------ collectives
    @property
    def _world(self) -> int:
        return self._comm.world_size

    @property
    def _rank(self) -> int:
        return self._comm.rank

    def _exchange(self, parts: Sequence[torch.Tensor], sizes: Sequence[int], to: Optional[int],
                  device: torch.device) -> Optional[List[torch.Tensor]]:
        return exchange_bytes(self._comm, parts, sizes, to, device)

    # ------------------------------------------------------------------ the part
    def _trainable(self) -> List[torch.Tensor]:
        """The partitioned tensors: every trainable one."""
        return [p for g in self.param_groups for p in g["params"]
                if p.requires_grad or p.grad is not None or self.state.get(p)]

    def _unit(self, p: torch.Tensor, pending: Optional[dict] = None) -> Tuple[int, int]:
        """(unit, cost) of ``p`` for the partition; a quantized tensor whose period is not known
        yet is cut only at rows (whole blocks for every period it can get)."""
        shape = global_shape(p)
        if self._mode(p) in _state.SPAN_MODES:  # whole rows of idx bytes; the block state (D19: row codes) is replicated
            return _periods.row_slab(shape), _periods.row_slab(shape)
        if is_exact(shape, self.small_threshold):
            return unit_cost(True, 1, 1)
        st = (pending or {}).get(p) or self.state.get(p)
        slab = max(1, _periods.row_slab(shape))
        if self._is_factored(p):
            # always cut at rows: the owner of a row computes its v_row from the whole row
            B = int(st["scale_block"]) if st and st.get("learned") else Geometry.quantized(shape, slab).scale_block
            return unit_cost(False, slab, B, row=slab)
        if st and st.get("learned"):
            return unit_cost(False, int(st["period"]), int(st["scale_block"]))
        return unit_cost(False, slab, slab)

    def _is_factored(self, p: torch.Tensor) -> bool:
        """Whether ``p``'s state has the factored second moment (its mode, :meth:`Gefen._mode`)."""
        return self._mode(p) == _state.MODE_FACTORED

    def _make_partition(self, pending: Optional[dict] = None) -> Partition:
        params = self._trainable()
        units = [self._unit(p, pending) for p in params]
        specs = [(int(math.prod(global_shape(p))), u, c) for p, (u, c) in zip(params, units)]
        return Partition(params, [u for u, _ in units], partition(specs, self._world))

    def _mine(self, p: torch.Tensor) -> Tuple[int, int]:
        return self._partition.of(p)[self._rank]

    def _repartition(self, pending: Optional[dict] = None, zero_ok: Set[int] = frozenset()) -> None:
        """Recompute the partition and move existing state to it. States in ``zero_ok`` (ids) and
        quantized states not learned yet are all zeros and are reallocated; others travel in
        compressed form (an all-gather; only at the first learning, when at most exact tensors
        have nonzero state, or after the set of trainable parameters changed)."""
        new = self._make_partition(pending)
        old = self._partition
        if old is not None and old.key == new.key and old.ranges == new.ranges:
            return
        self._check_partition_agreement(new)
        moving = []
        for p in new.params:
            st = self.state.get(p)
            if not st:
                continue
            if old is not None and id(p) in old.index and old.of(p) == new.of(p):
                continue
            moving.append(p)
        realloc = {id(p) for p in moving
                   if id(p) in zero_ok or ("learned" in self.state[p] and not self.state[p]["learned"])}
        travel = [p for p in moving if id(p) not in realloc]
        full = {}
        if travel:
            if old is None or any(id(p) not in old.index for p in travel):
                raise RuntimeError("ZeroGefen: state exists for a parameter outside the partition")
            full = self._gather_state(travel, old, to=None)
        self._partition = new
        for p in moving:
            if id(p) in realloc:
                st = (pending or {}).get(p) or self.state[p]
                self._zalloc(p, st.get("period"), learned=bool(st.get("learned", 1)), step=self.state[p]["step"])
            else:
                self._set_from_full(p, full[id(p)])
        if moving:
            logger.debug("ZeroGefen: repartitioned %d tensors (%d moved in compressed form)", len(moving), len(travel))

    def _check_partition_agreement(self, part: Partition) -> None:
        """Raise on every rank if ranks computed different partitions (different models or param
        groups): a fixed-size collective, so it cannot itself mismatch (the step's all-gather would
        abort gloo or hang NCCL instead)."""
        if self._world == 1:
            return
        desc = repr([(tuple(global_shape(p)), u, rs) for p, u, rs in zip(part.params, part.units, part.ranges)])
        h = int.from_bytes(hashlib.sha256(desc.encode()).digest()[:6], "little")
        t = torch.tensor([h, -h], dtype=torch.int64)
        self._comm.all_reduce_max_(t)
        if int(t[0]) != -int(t[1]):
            raise RuntimeError(
                "ZeroGefen: ranks disagree about the state partition (their parameters, param groups, "
                "periods or trainable sets differ). Every rank must build ZeroGefen over the same "
                "parameters in the same order, with the same requires_grad flags."
            )

    def _ensure_partition(self) -> None:
        trainable = self._trainable()
        if self._partition is None or self._partition.key != tuple(id(p) for p in trainable):
            self._repartition()

    # ------------------------------------------------------------------ state slices
    def _zalloc(self, p: torch.Tensor, period: Optional[int], *, learned: bool, step: int = 0) -> None:
        """Zero state for this rank's range of ``p`` (flat slices of the single-process state)."""
        spec = self._spec(p, int(period) if period else None)  # the one state spec (engine.state)
        s, e = self._mine(p)
        self.state[p] = spec.allocate_range(s, e, p.device, learned=learned, step=step,
                                            codebook=self._codebook_for(p.device))

    def _placeholder_period(self, p: torch.Tensor) -> int:
        """The period of ``p``'s state before it learns one (the mode's fixed period, else the row)."""
        return self._spec(p).geometry.period

    def _divisors(self, p: torch.Tensor) -> Dict[str, int]:
        """The sliced state tensors of ``p`` and elements per entry (``v_col`` is replicated, never
        sliced)."""
        st = self.state[p]
        mode = self._mode(p)
        if mode in _state.SPAN_MODES:  # scale, v_blk, v_col: replicated; D19's codes: one byte each per row
            slab = _periods.row_slab(global_shape(p))
            return {"idx": 1, **({"scale_code": slab, "v_code": slab} if mode == _state.MODE_ROWS8 else {})}
        if mode == _state.MODE_FACTORED:  # (D21: v_row holds K entries per row, one per block of columns)
            return {"idx": 1, "scale": int(st["scale_block"]),
                    "v_row": int(st["v_col"].shape[-1]) // col_blocks_of(st["v_row"])}
        if mode != _state.MODE_EXACT:
            return {"idx": 1, "scale": int(st["scale_block"]), "v": int(st["period"])}
        return {"exp_avg": 1, "exp_avg_sq": 1}

    def _set_from_full(self, p: torch.Tensor, full: Dict[str, torch.Tensor]) -> None:
        """Replace ``p``'s state tensors by this rank's slices of the global (flat) ones."""
        st = self.state[p]
        s, e = self._mine(p)
        K = col_blocks_of(st["v_row"]) if self._is_factored(p) else 1  # (D21: v_row [rows, K])
        for k, d in self._divisors(p).items():
            st[k] = full[k].reshape(-1)[s // d:e // d].to(device=p.device).clone()
            if k == "v_row" and K > 1:
                st[k] = st[k].view(-1, K)

    def _gather_state(self, params: Sequence[torch.Tensor], part: Partition, to: Optional[int]) -> Dict[int, Dict[str, torch.Tensor]]:
        """Global flat state tensors of ``params`` (compressed form), on every rank (``to=None``)
        or on group rank ``to`` only (empty dict elsewhere)."""
        W = self._world
        keys = []  # (p, key, divisor, dtype)
        for p in params:
            st = self.state[p]
            for k, d in self._divisors(p).items():
                keys.append((p, k, d, st[k].dtype))
        sizes = [0] * W
        for p, k, d, dt in keys:
            isz = dt.itemsize
            for r, (s, e) in enumerate(part.of(p)):
                sizes[r] += _pad((e - s) // d * isz)
        dev = params[0].device if params else torch.device("cpu")
        chunks = self._exchange([self.state[p][k] for p, k, _, _ in keys], sizes, to, dev)
        if chunks is None:
            return {}
        out: Dict[int, Dict[str, torch.Tensor]] = {}
        for p in params:
            n = int(math.prod(global_shape(p)))
            out[id(p)] = {k: torch.empty(n // d, dtype=self.state[p][k].dtype, device=p.device)
                          for k, d in self._divisors(p).items()}
        for r in range(W):
            off = 0
            for p, k, d, dt in keys:
                s, e = part.of(p)[r]
                seg, off = take_bytes(chunks[r], off, (e - s) // d, dt)
                out[id(p)][k][s // d:e // d].copy_(seg)
        return out

    def _piece(self, p: torch.Tensor) -> Piece:
        s, e = self._mine(p)
        grad = p.grad.reshape(-1)[s:e] if p.grad is not None else None
        return Piece(local=p.detach().reshape(-1)[s:e], grad=grad, start=s, shape=global_shape(p), contributes=True)

    # ------------------------------------------------------------------ learning
    def _prepare(self, entries) -> None:
        """As :meth:`Gefen._prepare`, on this rank's ranges: statistics of owned elements only."""
        self._ensure_partition()
        for _, p in entries:
            if not self.state.get(p):
                self._zalloc(p, None, learned=self._mode(p) == _state.MODE_EXACT)
        quant = [p for _, p in entries if "learned" in self.state[p] and not self.state[p]["learned"]]
        if not quant:
            return
        amax = []
        for p in quant:
            pc = self._piece(p)
            amax.append(float(pc.grad.abs().max()) if pc.grad is not None and pc.grad.numel() else 0.0)
        amax_t = torch.tensor(amax, dtype=torch.float64)
        self._comm.all_reduce_max_(amax_t)
        live = [p for p, a in zip(quant, amax_t.tolist()) if a > 0 or math.isnan(a)]
        if not live:
            return
        # every rank holds the whole (DDP) gradient: the refusal's sums from it, no collective
        self._refuse_overflow_before_learning([(p, Piece(local=p.detach(), grad=p.grad, start=0, shape=global_shape(p)))
                                               for p in live], sharded=False)
        self._note_dense_span([(p, self._piece(p)) for p in live])
        t0 = time.perf_counter()
        periods = self._learn_periods([(p, self._piece(p)) for p in live])
        t_periods = time.perf_counter() - t0
        first = self.codebook is None
        if first:
            # Periods are known now: decide the block-aligned partition (moving only the exact
            # tensors' state, the only state that can be nonzero before the first learning).
            pending = {}
            for p, per in zip(live, periods):
                geo = self._spec(p, per).geometry
                pending[p] = {"learned": 1, "period": geo.period, "scale_block": geo.scale_block}
            zero_ok = {id(p) for p in live}
            self._repartition(pending, zero_ok)
        for p, per in zip(live, periods):
            self._zalloc(p, per, learned=True, step=self.state[p]["step"])
        if first:
            self._learn_codebook([(p, self._piece(p)) for p in live], t_periods)

    def init_state(self, periods: Optional[Dict[Any, int]] = None) -> None:
        """As :meth:`Gefen.init_state`: allocate (zero) state for this rank's ranges now; tensors
        given a period are marked learned. Decides the partition if none is in force (or the
        codebook is not learned yet); then it is collective (every rank must call it)."""
        names = self._names()
        periods = periods or {}
        pending = {}
        for g in self.param_groups:
            for p in g["params"]:
                if not p.requires_grad or self.state.get(p):
                    continue
                if self._mode(p) == _state.MODE_EXACT:
                    pending[p] = None
                    continue
                per = periods.get(p, periods.get(names[id(p)]))
                if per is None:
                    pending[p] = {"learned": 0, "period": self._placeholder_period(p)}
                else:
                    geo = self._spec(p, int(per)).geometry
                    pending[p] = {"learned": 1, "period": geo.period, "scale_block": geo.scale_block}
        if self._partition is None or self.codebook is None or self._partition.key != tuple(id(p) for p in self._trainable()):
            self._repartition({p: v for p, v in pending.items() if v}, {id(p) for p in pending})
        for p, v in pending.items():
            self._zalloc(p, v["period"] if v else None, learned=bool(v["learned"]) if v else True)

    # ------------------------------------------------------------------ step
    @torch.no_grad()
    def step(self, closure=None):
        """One optimization step (collective: every rank of the group must call it)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        entries = self._entries()
        prestep_zero(self, entries, self._partitioned_shape)  # compile, meta, changed shapes
        batch = ZeroBatch.plan(self, entries)  # the Triton path's batched phases (zero/batch.py)
        ready = batch.prepare(self) if batch is not None else None
        if ready is True:
            return loss  # skipped (nonfinite="skip"); "raise" raised
        partials = None
        if ready is None:
            batch = None
            partials = self._column_partials(entries)
            if self.nonfinite != "ignore" and self._nonfinite(entries, partials):
                return loss
        self._consolidated = None
        self._prepare(entries)
        self._zero_update(entries, partials, batch)
        self._announce()
        return loss

    def _partitioned_shape(self, p: torch.Tensor) -> Optional[Tuple[int, ...]]:
        """The shape ``p`` had when the partition in force was cut (None while it has no state)."""
        part = self._partition
        if part is None or id(p) not in part.index or not self.state.get(p):
            return None
        return part.shapes[part.index[id(p)]]

    def _backend(self) -> str:
        return f"ZeroGefen (ZeRO-1: state partitioned over {self._comm.world_size} ranks)"

    # ------------------------------------------------------------------ introspection
    def owned_range(self, p: torch.Tensor) -> Tuple[int, int]:
        """The flat range ``[start, end)`` of ``p`` whose state this rank keeps."""
        if self._partition is None or id(p) not in self._partition.index:
            return (0, 0)
        return self._mine(p)

    def report(self) -> Report:
        """As :meth:`Gefen.report`; ``local_numel`` is the number of elements this rank owns and
        ``state_bytes`` this rank's state (``owned`` gives the flat range)."""
        rep = super().report()
        order = [p for g in self.param_groups for p in g["params"] if p.requires_grad]
        for rec, p in zip(rep, order):
            s, e = self.owned_range(p)
            rec["local_numel"] = e - s
            rec["owned"] = (s, e)
        return rep
