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
   scale block ``M_b`` and per row ``sqrt(v_row_i)`` (float32), or its new values when that is not
   smaller (:func:`factored_wire_compressed`);
2. one ``all_gather`` of the byte buffers (padded to the largest rank's size; ranks that own
   nothing still take part);
3. every rank applies every range with the same code: for element ``i`` of block ``b``
   ``p_i <- p_i * (1 - lr*wd) - ((C[idx_i] * M_b) * sigma_b) * lr`` in float32, in the eager step's
   exact operation order (decay skipped when ``wd == 0``), or copies the dense values. Factored:
   every rank first updates its replicated ``v_col`` from the column means of ``g^2``, which it
   computes itself from its whole (DDP) gradient with Gefen's own code (float64 sums, so bitwise
   the single-process values; no collective), then applies
   ``sigma_ij = (1 / ((sqrt(v_row_i) * sqrt(v_col_j / mean(v_col))) / sqrt(bc2) + eps)) * (1/bc1)``
   and ``p_ij <- p_ij * (1 - lr*wd) - ((C[idx_ij] * M_b) * sigma_ij) * lr`` in
   :func:`~gefen_dist.core.step.quantized_step_factored_eager_`'s order.

So replicas stay bitwise identical, and equal single-process :class:`~gefen_dist.Gefen` with the
same ``fused`` setting bitwise: with ``fused=False`` the owner replays the eager step's
operations; with the native kernel (``fused=None`` on CPU) the owner updates its state with the
kernel (on a scratch copy of its parameter slice) and computes ``sigma`` with the kernel's float32
operations and a correctly rounded sqrt, so the applied update is the kernel's (the same holds
for the factored second moment). The appliers live in :mod:`gefen_dist.core.apply`.

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

Checkpoints (:mod:`gefen_dist.zero_checkpoint`): :meth:`ZeroGefen.consolidate_state_dict` gathers the compressed state (never a
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

from .core import periods as _periods
from .core.apply import apply_compressed, apply_factored, update_v_col
from .core.step import adamw_step_, bias_corrections, decay_only_, row_block_args
from .kernels import dispatch as _dispatch
from .layout import Geometry, Piece, global_shape, is_dtensor, is_exact
from .optimizer import Gefen, Report, _scalar
from .zero_checkpoint import ZeroCheckpointMixin
from .zero_plan import (MODE_COMPRESSED, MODE_DENSE, MODE_FACTORED, MODE_LOCAL, _Plan, _pad,  # noqa: F401
                        factored_wire_compressed, partition, step_wire_bytes, unit_cost)

logger = logging.getLogger(__name__)

__all__ = ["ZeroGefen", "partition", "unit_cost", "step_wire_bytes", "factored_wire_compressed", "MODE_LOCAL",
           "MODE_COMPRESSED", "MODE_DENSE", "MODE_FACTORED"]


_STATE_HP = ("beta1", "beta2", "eps", "bc1", "bc2")  # what a state-only update needs of the hyperparameters


def _row_blocks_kw(p: torch.Tensor, st: dict, s: int) -> dict:
    return row_block_args(st["v_col"], global_shape(p)[0], s)


class ZeroGefen(ZeroCheckpointMixin, Gefen):
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

    def __init__(self, params: Iterable, lr: float | torch.Tensor = 1e-3, betas: Tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 0.0, *, process_group: Optional[Any] = None,
                 **gefen_kwargs):
        self._plan: Optional[_Plan] = None
        self._fact_ids: Optional[Set[int]] = None
        self._consolidated: Optional[Dict[int, dict]] = None
        self.last_wire: Dict[str, Any] = {}
        super().__init__(params, lr, betas, eps, weight_decay, process_group=process_group, **gefen_kwargs)

    def add_param_group(self, param_group: Dict[str, Any]) -> None:
        super().add_param_group(param_group)
        g = self.param_groups[-1]
        self._fact_ids = None
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

    def _coll_device(self, fallback: torch.device) -> torch.device:
        return getattr(self._comm, "_device", fallback) if self._world > 1 else fallback

    def _exchange(self, parts: Sequence[torch.Tensor], sizes: Sequence[int], to: Optional[int],
                  device: torch.device) -> Optional[List[torch.Tensor]]:
        """Gather every rank's parts (any dtypes; each padded to 8 bytes) as raw bytes.

        ``sizes[r]`` is rank ``r``'s padded byte count (every rank knows all of them). With
        ``to=None`` an all-gather (every rank gets every chunk); else a gather onto group rank
        ``to`` (others get None). Returns one uint8 chunk per rank. Every rank must call this,
        even with nothing to send; it is skipped only when every rank sends nothing.
        """
        W = self._world
        width = max(sizes) if sizes else 0
        if width == 0:
            return [torch.empty(0, dtype=torch.uint8, device=device) for _ in range(W)]
        dev = self._coll_device(device)
        buf = torch.empty(width, dtype=torch.uint8, device=dev)
        off = 0
        for t in parts:
            b = t.detach().contiguous().reshape(-1).view(torch.uint8)
            buf[off:off + b.numel()].copy_(b)
            buf[off + b.numel():off + _pad(b.numel())].zero_()  # padding is zeros, not garbage
            off += _pad(b.numel())
        assert off == sizes[self._rank], (off, sizes[self._rank])
        buf[off:].zero_()
        if W == 1:
            return [buf]
        import torch.distributed as dist

        group = self._comm.group
        if to is None:
            out = torch.empty(W * width, dtype=torch.uint8, device=dev)
            gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
            gather_single(out, buf, group=group)
            return list(out.view(W, width).unbind(0))
        dst = dist.get_global_rank(group, to) if group is not None and group != dist.group.WORLD else to
        if self._rank == to:
            outs = [torch.empty(width, dtype=torch.uint8, device=dev) for _ in range(W)]
            dist.gather(buf, outs, dst=dst, group=group)
            return outs
        dist.gather(buf, None, dst=dst, group=group)
        return None

    @staticmethod
    def _take(chunk: torch.Tensor, off: int, n: int, dtype: torch.dtype) -> Tuple[torch.Tensor, int]:
        nb = n * dtype.itemsize
        return chunk[off:off + nb].view(dtype), off + _pad(nb)

    # ------------------------------------------------------------------ the plan
    def _trainable(self) -> List[torch.Tensor]:
        return [p for g in self.param_groups for p in g["params"]
                if p.requires_grad or p.grad is not None or self.state.get(p)]

    def _unit(self, p: torch.Tensor, pending: Optional[dict] = None) -> Tuple[int, int]:
        """(unit, cost) of ``p`` for the partition; a quantized tensor whose period is not known
        yet is cut only at rows (whole blocks for every period it can get)."""
        shape = global_shape(p)
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
        """Whether ``p``'s group has ``second_moment="factored"`` (cached per param-group set)."""
        if self._fact_ids is None:
            self._fact_ids = {id(q) for g in self.param_groups if g.get("second_moment") == "factored"
                              for q in g["params"]}
        return id(p) in self._fact_ids

    def _make_plan(self, pending: Optional[dict] = None) -> _Plan:
        params = self._trainable()
        units = [self._unit(p, pending) for p in params]
        specs = [(int(math.prod(global_shape(p))), u, c) for p, (u, c) in zip(params, units)]
        return _Plan(params, [u for u, _ in units], partition(specs, self._world))

    def _mine(self, p: torch.Tensor) -> Tuple[int, int]:
        return self._plan.of(p)[self._rank]

    def _replan(self, pending: Optional[dict] = None, zero_ok: Set[int] = frozenset()) -> None:
        """Recompute the partition and move existing state to it. States in ``zero_ok`` (ids) and
        quantized states not learned yet are all zeros and are reallocated; others travel in
        compressed form (an all-gather; only at the first learning, when at most exact tensors
        have nonzero state, or after the set of trainable parameters changed)."""
        new = self._make_plan(pending)
        old = self._plan
        if old is not None and old.key == new.key and old.ranges == new.ranges:
            return
        self._check_plan_agreement(new)
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
        self._plan = new
        for p in moving:
            if id(p) in realloc:
                st = (pending or {}).get(p) or self.state[p]
                self._zalloc(p, st.get("period"), learned=bool(st.get("learned", 1)), step=self.state[p]["step"])
            else:
                self._set_from_full(p, full[id(p)])
        if moving:
            logger.debug("ZeroGefen: repartitioned %d tensors (%d moved in compressed form)", len(moving), len(travel))

    def _check_plan_agreement(self, plan: _Plan) -> None:
        """Raise on every rank if ranks computed different partitions (different models or param
        groups): a fixed-size collective, so it cannot itself mismatch (the step's all-gather would
        abort gloo or hang NCCL instead)."""
        if self._world == 1:
            return
        desc = repr([(tuple(global_shape(p)), u, rs) for p, u, rs in zip(plan.params, plan.units, plan.ranges)])
        h = int.from_bytes(hashlib.sha256(desc.encode()).digest()[:6], "little")
        t = torch.tensor([h, -h], dtype=torch.int64)
        self._comm.all_reduce_max_(t)
        if int(t[0]) != -int(t[1]):
            raise RuntimeError(
                "ZeroGefen: ranks disagree about the state partition (their parameters, param groups, "
                "periods or trainable sets differ). Every rank must build ZeroGefen over the same "
                "parameters in the same order, with the same requires_grad flags."
            )

    def _ensure_plan(self) -> None:
        trainable = self._trainable()
        if self._plan is None or self._plan.key != tuple(id(p) for p in trainable):
            self._replan()

    # ------------------------------------------------------------------ state slices
    def _zalloc(self, p: torch.Tensor, period: Optional[int], *, learned: bool, step: int = 0) -> None:
        """Zero state for this rank's range of ``p`` (flat slices of the single-process state)."""
        s, e = self._mine(p)
        n = e - s
        dev = p.device
        shape = global_shape(p)
        if is_exact(shape, self.small_threshold):
            self.state[p] = {"step": step,
                             "exp_avg": torch.zeros(n, dtype=torch.float32, device=dev),
                             "exp_avg_sq": torch.zeros(n, dtype=torch.float32, device=dev)}
            return
        geo = Geometry.quantized(shape, int(period) if period else _periods.row_slab(shape))
        st = {
            "step": step,
            "period": geo.period,
            "scale_block": geo.scale_block,
            "learned": int(learned),
            "idx": torch.zeros(n, dtype=torch.uint8, device=dev),
            "scale": torch.zeros(n // geo.scale_block, dtype=torch.float32, device=dev),
        }
        if self._is_factored(p):
            st["v_row"] = torch.zeros(n // geo.slab, dtype=torch.float32, device=dev)
            G = _periods.factored_row_blocks(shape, self._group_of(p).get("row_blocks", "auto"))
            # replicated; [G, slab] with G row blocks (D12)
            st["v_col"] = torch.zeros(*((G,) if G > 1 else ()), geo.slab, dtype=torch.float32, device=dev)
        else:
            st["v"] = torch.zeros(n // geo.period, dtype=torch.float32, device=dev)
        st["codebook"] = self._codebook_for(dev)
        self.state[p] = st

    @staticmethod
    def _divisors(st: dict) -> Dict[str, int]:
        """The sliced state tensors and elements per entry (``v_col`` is replicated, never sliced)."""
        if "v_col" in st:
            return {"idx": 1, "scale": int(st["scale_block"]), "v_row": int(st["v_col"].shape[-1])}
        if "idx" in st:
            return {"idx": 1, "scale": int(st["scale_block"]), "v": int(st["period"])}
        return {"exp_avg": 1, "exp_avg_sq": 1}

    def _set_from_full(self, p: torch.Tensor, full: Dict[str, torch.Tensor]) -> None:
        """Replace ``p``'s state tensors by this rank's slices of the global (flat) ones."""
        st = self.state[p]
        s, e = self._mine(p)
        for k, d in self._divisors(st).items():
            st[k] = full[k].reshape(-1)[s // d:e // d].to(device=p.device).clone()

    def _gather_state(self, params: Sequence[torch.Tensor], plan: _Plan, to: Optional[int]) -> Dict[int, Dict[str, torch.Tensor]]:
        """Global flat state tensors of ``params`` (compressed form), on every rank (``to=None``)
        or on group rank ``to`` only (empty dict elsewhere)."""
        W = self._world
        keys = []  # (p, key, divisor, dtype)
        for p in params:
            st = self.state[p]
            for k, d in self._divisors(st).items():
                keys.append((p, k, d, st[k].dtype))
        sizes = [0] * W
        for p, k, d, dt in keys:
            isz = dt.itemsize
            for r, (s, e) in enumerate(plan.of(p)):
                sizes[r] += _pad((e - s) // d * isz)
        dev = params[0].device if params else torch.device("cpu")
        chunks = self._exchange([self.state[p][k] for p, k, _, _ in keys], sizes, to, dev)
        if chunks is None:
            return {}
        out: Dict[int, Dict[str, torch.Tensor]] = {}
        for p in params:
            n = int(math.prod(global_shape(p)))
            out[id(p)] = {k: torch.empty(n // d, dtype=self.state[p][k].dtype, device=p.device)
                          for k, d in self._divisors(self.state[p]).items()}
        for r in range(W):
            off = 0
            for p, k, d, dt in keys:
                s, e = plan.of(p)[r]
                seg, off = self._take(chunks[r], off, (e - s) // d, dt)
                out[id(p)][k][s // d:e // d].copy_(seg)
        return out

    def _piece(self, p: torch.Tensor) -> Piece:
        s, e = self._mine(p)
        grad = p.grad.reshape(-1)[s:e] if p.grad is not None else None
        return Piece(local=p.detach().reshape(-1)[s:e], grad=grad, start=s, shape=global_shape(p), contributes=True)

    # ------------------------------------------------------------------ learning
    def _prepare(self, entries) -> None:
        """As :meth:`Gefen._prepare`, on this rank's ranges: statistics of owned elements only."""
        self._ensure_plan()
        for _, p in entries:
            if not self.state.get(p):
                self._zalloc(p, None, learned=is_exact(global_shape(p), self.small_threshold))
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
        t0 = time.perf_counter()
        periods = self._learn_periods([(p, self._piece(p)) for p in live])
        t_periods = time.perf_counter() - t0
        first = self.codebook is None
        if first:
            # Periods are known now: decide the block-aligned partition (moving only the exact
            # tensors' state, the only state that can be nonzero before the first learning).
            pending = {}
            for p, per in zip(live, periods):
                geo = Geometry.quantized(global_shape(p), per)
                pending[p] = {"learned": 1, "period": geo.period, "scale_block": geo.scale_block}
            zero_ok = {id(p) for p in live}
            self._replan(pending, zero_ok)
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
                shape = global_shape(p)
                if is_exact(shape, self.small_threshold):
                    pending[p] = None
                    continue
                per = periods.get(p, periods.get(names[id(p)]))
                if per is None:
                    pending[p] = {"learned": 0, "period": _periods.row_slab(shape)}
                else:
                    geo = Geometry.quantized(shape, int(per))
                    pending[p] = {"learned": 1, "period": geo.period, "scale_block": geo.scale_block}
        if self._plan is None or self.codebook is None or self._plan.key != tuple(id(p) for p in self._trainable()):
            self._replan({p: v for p, v in pending.items() if v}, {id(p) for p in pending})
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
        partials = self._column_partials(entries)
        if self.nonfinite != "ignore" and self._nonfinite(entries, partials):
            return loss
        self._consolidated = None
        self._prepare(entries)
        self._zero_update(entries, partials)
        return loss

    def _impl(self, t: torch.Tensor) -> _dispatch.StepImpl:
        """Owners and appliers use one implementation with state-only functions (the native CPU
        kernel or the eager reference; see :func:`gefen_dist.kernels.dispatch.select`)."""
        return _dispatch.select(t, self.fused, need_state=True)

    def _hparams(self, group: dict, st: dict) -> dict:
        beta1, beta2 = group["betas"]
        bc1, bc2 = bias_corrections(st["step"], beta1, beta2)
        return dict(lr=_scalar(group["lr"]), beta1=beta1, beta2=beta2, eps=group["eps"],
                    weight_decay=group["weight_decay"], bc1=bc1, bc2=bc2)

    def _zero_update(self, entries, partials=None) -> None:
        W = self._world
        items = []  # (p, st, hp, mode)
        for group, p in entries:
            st = self.state[p]
            st["step"] += 1
            hp = self._hparams(group, st)
            if "exp_avg" in st:
                mode = MODE_DENSE
            elif not st["learned"]:
                mode = MODE_LOCAL
                decay_only_(p, hp["lr"], hp["weight_decay"])  # on every rank
            elif "v_col" in st:
                # Compressed (idx, M, sqrt(v_row)); the appliers replay the eager step's or, with the
                # native kernel, the kernel's arithmetic (apply_factored(kernel_order=...)).
                mode = (MODE_FACTORED if factored_wire_compressed(
                    st["scale_block"], st["v_col"].shape[-1], p.element_size()) else MODE_DENSE)
            elif st["period"] > 1:
                mode = MODE_COMPRESSED
            else:
                mode = MODE_DENSE
            items.append((p, st, hp, mode))
        wire = [(mode, st["scale_block"], p.element_size(), self._plan.of(p), st["v_col"].shape[-1])
                if mode == MODE_FACTORED else (mode, st.get("period", 1), p.element_size(), self._plan.of(p))
                for p, st, hp, mode in items]
        sizes = step_wire_bytes(wire, W)
        # Factored tensors: the column means of g^2 over all rows, computed by every rank from its
        # full (DDP) gradient with Gefen's own code, so bitwise the single-process values.
        col = self._column_stats(entries, partials)
        # 1. this rank's state update, in compressed form
        parts: List[torch.Tensor] = []
        for p, st, hp, mode in items:
            s, e = self._mine(p)
            if mode == MODE_LOCAL or e == s:
                continue
            if mode == MODE_COMPRESSED:
                parts.extend(self._owner_compressed(p, st, hp, s, e))
            elif mode == MODE_FACTORED:
                parts.extend(self._owner_factored(p, st, hp, s, e))
            else:
                parts.append(self._owner_dense(p, st, hp, s, e, col.get(p)))
        # every rank: the replicated column factor (v_col <- EMA, then sqrt(v_col / mean(v_col))),
        # after the owners' dense steps, which update a copy of the old v_col themselves
        col_f = {}
        for p, st, hp, mode in items:
            if "v_col" in st and mode != MODE_LOCAL:
                col_f[id(p)] = update_v_col(st, col[p], hp)
        dev = items[0][0].device if items else torch.device("cpu")
        chunks = self._exchange(parts, sizes, None, dev)
        # 2. every rank applies every range, identically
        works = {}
        for r in range(W):
            off = 0
            for p, st, hp, mode in items:
                s, e = self._plan.of(p)[r]
                n = e - s
                if mode == MODE_LOCAL or n == 0:
                    continue
                if id(p) not in works:
                    works[id(p)] = p if p.is_contiguous() else p.detach().contiguous()
                flat = works[id(p)].view(-1)
                if mode == MODE_COMPRESSED:
                    P = st["period"]
                    idx, off = self._take(chunks[r], off, n, torch.uint8)
                    M, off = self._take(chunks[r], off, n // P, torch.float32)
                    sigma, off = self._take(chunks[r], off, n // P, torch.float32)
                    apply_compressed(flat[s:e], idx.to(p.device), M.to(p.device), sigma.to(p.device),
                                           st["codebook"], P, hp, kernel_order=self._impl(p).kernel_order)
                elif mode == MODE_FACTORED:
                    B, slab = st["scale_block"], st["v_col"].shape[-1]
                    idx, off = self._take(chunks[r], off, n, torch.uint8)
                    M, off = self._take(chunks[r], off, n // B, torch.float32)
                    rf, off = self._take(chunks[r], off, n // slab, torch.float32)
                    apply_factored(flat[s:e], idx.to(p.device), M.to(p.device), rf.to(p.device),
                                         col_f[id(p)], st["codebook"], B, slab, hp,
                                         kernel_order=self._impl(p).kernel_order, **_row_blocks_kw(p, st, s))
                else:
                    vals, off = self._take(chunks[r], off, n, p.dtype)
                    flat[s:e].copy_(vals.to(p.device))
        for p, st, hp, mode in items:
            w = works.get(id(p))
            if w is not None and w is not p:
                p.copy_(w)
        width = max(sizes) if sizes else 0
        self.last_wire = dict(world_size=W, bytes_per_rank=sizes, padded_bytes_per_rank=width,
                              gathered_bytes=W * width, elements=sum(p.numel() for p, _, _, m in items if m != MODE_LOCAL))

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
        """This rank's new values of ``p[s:e]`` (exact AdamW, or the full step when P == 1 or a
        factored tensor's compressed form is not smaller)."""
        work = p.detach().reshape(-1)[s:e].clone()
        g = p.grad.reshape(-1)[s:e].contiguous()
        if "exp_avg" in st:
            adamw_step_(work, g, st["exp_avg"], st["exp_avg_sq"], **hp)
            return work
        impl = self._impl(work)
        gk = impl.grad_for(g, work)
        if "v_col" in st:
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
        """Update this rank's rows of ``p`` (v_row, m, idx, scale); return (idx, M, sqrt(v_row)).

        The operations of :func:`quantized_step_factored_eager_`, in its order, minus the
        column factor and the parameter update (the appliers do those)."""
        B, slab = st["scale_block"], st["v_col"].shape[-1]
        g = p.grad.reshape(-1)[s:e].contiguous()
        idx, scale, v_row, cb = st["idx"], st["scale"], st["v_row"], st["codebook"]
        impl = self._impl(p)
        rsq = impl.factored_state_(impl.grad_for(g, p), idx, scale, v_row, cb, slab=slab, **{k: hp[k] for k in _STATE_HP}, scale_block=B)
        return [idx, scale, rsq]

    # ------------------------------------------------------------------ introspection
    def owned_range(self, p: torch.Tensor) -> Tuple[int, int]:
        """The flat range ``[start, end)`` of ``p`` whose state this rank keeps."""
        if self._plan is None or id(p) not in self._plan.index:
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
