"""``gefen_dist.Gefen``: the paper's optimizer as a torch drop-in for AdamW.

Citation: Benedek, Koren, Fried, "Gefen: Optimized Stochastic Optimizer", arXiv 2606.13894
(2026). Implemented from the specification in ``shared/spec``; deviations (D1-D9) are listed in
``docs/algorithm.md``.
"""
from __future__ import annotations

import logging
import time
from collections import Counter
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Tuple

import torch
from torch.optim import Optimizer

from ..engine import learning
from . import state_dict_io as _sdio
from . import validation as _validation
from .introspect import Introspection
from ..engine.comm import LocalComm, comm_for
from ..engine.tensor_step import GefenStepMixin
from ..engine.span_step import SpanStepMixin
from ..core.step import DEFAULT_BOUND_UPDATES, bound_factor
from ..kernels import dispatch as _dispatch
from ..engine.layout import Piece, check_supported, global_shape, like_param, local_tensor, piece_of
from ..engine.nonfinite import NonfiniteChecks
from ..engine.report import Report
from ..engine.state import (MODE_EXACT, MODE_FACTORED, SPAN_MODES, StateSpec, codebook_size_of, fixed_period, mode_of,
                            narrow_rows_of, second_moment_of, threshold_of)

logger = logging.getLogger(__name__)

NONFINITE = _validation.NONFINITE

__all__ = ["Gefen", "Report", "saved_param_map", "NONFINITE"]


def saved_param_map(opt: Optimizer, state_dict: Dict[str, Any]) -> Dict[Any, torch.Tensor]:
    """Map a saved state dict's parameter ids to ``opt``'s parameters, group by group (as
    ``torch.optim.Optimizer.load_state_dict`` does), raising a clear error when the groups differ."""
    saved_groups = state_dict["param_groups"]
    if len(saved_groups) != len(opt.param_groups):
        raise ValueError(f"loaded state dict has {len(saved_groups)} parameter groups, "
                         f"this optimizer has {len(opt.param_groups)}")
    id_map = {}
    for sg, g in zip(saved_groups, opt.param_groups):
        if len(sg["params"]) != len(g["params"]):
            raise ValueError("loaded state dict contains a parameter group that doesn't match "
                             f"the size of optimizer's group ({len(sg['params'])} vs {len(g['params'])})")
        id_map.update(zip(sg["params"], g["params"]))
    return id_map


class Gefen(GefenStepMixin, SpanStepMixin, NonfiniteChecks, Introspection, Optimizer):
    r"""AdamW with ~1 byte per parameter of state (Gefen, Benedek, Koren, Fried 2026).

    Large tensors keep the first moment as uint8 indices into one learned 256-entry codebook times a
    per-block absmax scale, and a low-memory second moment; small and 1-D tensors exact AdamW state.
    Semantics follow ``torch.optim.AdamW`` (decoupled weight decay, bias correction).

    Args:
        params: parameters, ``(name, parameter)`` pairs (``model.named_parameters()``) or param
            groups, exactly as for ``torch.optim.AdamW``.
        lr, betas, eps, weight_decay: as in ``torch.optim.AdamW``, with its defaults (``lr`` may be a
            1-element tensor; ``weight_decay`` defaults to 0.01 as AdamW's does). Also per param group.
        small_threshold: tensors with fewer global elements (and all 0-D/1-D tensors) keep exact
            fp32 AdamW state (D2). Default 4096.
        second_moment: how quantized tensors keep the second moment (also per param group):
            ``"factored"`` (default): fp32 per row and per column (Adafactor's estimator; ~1.02
            B/param on GPT-2 small); ``"shared"``: the paper's, one fp32 value per period of each
            row; ``"elementwise"``: one fp32 value per element (~5 B/param), the first moment 8-bit;
            ``"nibbles"`` (D20): the factored state with both moments in 4 bits each of the byte.
        row_blocks: factored tensors of ``k x C`` rows of ``C`` elements keep one column profile per
            block of ``C`` rows (``"auto"``, default; D12); an int asks for that many blocks, ``1`` is
            Adafactor's single profile. Also per param group.
        col_blocks: D12 transposed (D21; also per param group): ``"auto"`` gives factored tensors of ``R``
            rows of ``k x R`` elements (``Conv1D`` weights) a row statistic per block of ``R`` columns.
        narrow_rows: where a factored tensor whose rows hold few elements keeps its scales and second
            moment (also per param group): ``"auto"`` (default; per block of rows, ~1.01 B/param, for
            rows of fewer than 22 elements, ``(N, 1)`` included; per row, ``1 + 8 / S`` B/param, for
            rows of 22-79; D18), ``"rows"`` (per row below 80, ``(N, 1)`` exact), ``"span"`` (per
            block of rows below 80; D16) or ``"rows8"`` (as ``"auto"``, with rows of 22-79 per row in
            one-byte codes, ``1 + 2 / S`` B/param; D19).
        bound_updates: a factor ``c >= 1`` (default ``2.0``) clamps every quantized element's
            normalised update to ``c (1 + beta1^(t-1))`` times AdamW's own bound ``K_t``
            (:func:`gefen_dist.core.step.clamp_bound`; D13): no gradient sequence moves a weight by
            more than that times ``lr`` beyond its decay. ``True`` is ``c = 1``, ``False`` the
            paper's unbounded update. docs/api.md describes every option with its measurements.
        symmetric_codebook: ``True`` (default) fits the codebook to the first step's histogram and
            its mirror image, so both signs of the first moment are resolved alike (D17); ``False``
            fits the histogram itself (the paper's codebook), which a first gradient of mostly one
            sign skews to that sign.
        fused: ``None`` (default) uses the fused native kernel when it is available for the
            parameter's device, ``True`` requires it, ``False`` forces the eager torch path.
        capturable: ``True``: the CUDA step without host synchronisation, capturable in a CUDA graph
            after the first step (``engine/device_step.py``); needs ``nonfinite="skip"`` or ``"ignore"``.
            Per-group options are ``lr``, ``betas``, ``eps``, ``weight_decay``, ``second_moment``,
            ``row_blocks``, ``narrow_rows`` and (as AdamW's ``fused``) ``fused`` and ``small_threshold``; ``nonfinite``,
            ``bound_updates``, ``symmetric_codebook`` and ``process_group`` are optimizer-wide, and a param group that sets one
            is rejected with a ``ValueError``. Complex parameters are stepped as their real view.
        process_group: the group over which periods and the codebook are agreed (default: WORLD
            when ``torch.distributed`` is initialised, otherwise single process). Plain tensors on
            several ranks are treated as replicas (DDP).
    """

    # param-group keys refused (optimizer-wide options); complex parameters stepped as real views
    _group_rejected = _validation.GROUP_REJECTED + ("capturable",)
    _complex_ok = _nibbles_ok = True  # complex: as real views; second_moment='nibbles' stepped (D20)

    def __init__(
        self,
        params: Iterable,
        lr: float | torch.Tensor = 1e-3,
        betas: Tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        *,
        small_threshold: int = 4096,
        second_moment: str = "factored",
        row_blocks: Any = "auto",
        col_blocks: Any = 1,
        narrow_rows: str = "auto",
        nonfinite: str = "raise",
        bound_updates=DEFAULT_BOUND_UPDATES,
        symmetric_codebook: bool = True,
        fused: Optional[bool] = None,
        capturable: bool = False,
        process_group: Optional[Any] = None,
    ):
        _validation.validate_hparams(lr, betas, eps, weight_decay)
        _validation.validate_options(second_moment=second_moment, small_threshold=small_threshold,
                                     nonfinite=nonfinite, fused=fused, symmetric_codebook=symmetric_codebook,
                                     capturable=capturable, row_blocks=row_blocks, narrow_rows=narrow_rows,
                                     col_blocks=col_blocks)
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay, second_moment=second_moment,
                        row_blocks=row_blocks, narrow_rows=narrow_rows, col_blocks=col_blocks)
        bound_factor(bound_updates)  # True, False or a factor >= 1 on AdamW's bound; else a ValueError
        self.small_threshold, self.bound_updates, self.nonfinite = small_threshold, bound_updates, nonfinite
        self.symmetric_codebook, self.capturable, self.fused = bool(symmetric_codebook), capturable, fused
        self.skipped_steps, self._agreement_checked = 0, False
        self.device_skipped_steps: Optional[torch.Tensor] = None  # capturable: a 0-dim tensor on the device
        self._comm: LocalComm = comm_for(process_group)
        self.codebook: Optional[torch.Tensor] = None
        self.codebook_info: Dict[str, Any] = {}
        super().__init__(params, defaults)
        _validation.warn_meta(self)
        if fused is True:
            _validation.require_fused_kernels(self)

    # ------------------------------------------------------------------ param groups
    def add_param_group(self, param_group: Dict[str, Any]) -> None:
        """As ``torch.optim.Optimizer.add_param_group``, validated first: a bad value raises (naming
        it and the fix) and the optimizer is left as it was."""
        _validation.validate_param_group(self, param_group)
        super().add_param_group(param_group)
        self._modes = None  # the table of modes (_mode) is rebuilt for the new set of groups
        g = self.param_groups[-1]
        try:
            pn = g.get("param_names")
            for i, p in enumerate(g["params"]):
                check_supported(p, pn[i] if pn is not None else f"group{len(self.param_groups) - 1}.param{i}")
            if g.get("fused") is True:
                _validation.require_fused_kernels(self, [g])
        except Exception:
            self.param_groups.pop()  # leave the optimizer as it was
            raise
        own = self.__dict__.setdefault("_own_ids", set())
        if own is not None:  # None after a copy: rebuilt from the param groups at the next step
            own.update(id(p) for p in g["params"])

    # ------------------------------------------------------------------ state creation
    def _group_of(self, p: torch.Tensor) -> dict:
        """The param group holding ``p``, in O(1) (a scan of the groups made a step quadratic in the
        number of tensors): a table by id, rebuilt when the groups or their ``params`` lists change."""
        sig = tuple((id(g), id(g["params"]), len(g["params"])) for g in self.param_groups)
        table = self.__dict__.get("_groups_by_id")
        if table is None or table[0] != sig:
            table = self._groups_by_id = (sig, {id(q): g for g in self.param_groups for q in g["params"]})
        g = table[1].get(id(p))  # every parameter in the table is alive (its group holds it): ids are unique
        if g is None:
            raise KeyError("parameter not in any param group")
        return g

    def _mode(self, p: torch.Tensor) -> str:
        """The mode of ``p``'s state (:func:`gefen_dist.engine.state.mode_of`: exact for small /
        1-D tensors, else its group's ``second_moment``; the ``mode`` of :meth:`_spec`, which does
        not depend on the period). Live code asks this, never the keys of the state dict. One table
        per set of param groups (rebuilt after ``add_param_group`` and ``load_state_dict``)."""
        modes = self.__dict__.get("_modes")
        if modes is None:
            modes = self._modes = {id(q): mode_of(global_shape(q), g, self.small_threshold)
                                   for g in self.param_groups for q in g["params"]}
        return modes[id(p)]

    def _spec(self, p: torch.Tensor, period: Optional[int] = None) -> StateSpec:
        """The state spec of ``p`` (its group's mode; ``period`` None: the placeholder period)."""
        g = self._group_of(p)
        try:
            return StateSpec.of(global_shape(p), second_moment=g["second_moment"],
                                small_threshold=threshold_of(g, self.small_threshold),
                                period=period, row_blocks=g.get("row_blocks", "auto"),
                                narrow_rows=narrow_rows_of(g), col_blocks=g.get("col_blocks", 1))
        except ValueError as e:
            raise ValueError(f"Gefen: parameter {self._names().get(id(p), '?')!r}: {e}") from None

    def _alloc(self, p: torch.Tensor, piece: Piece, period: Optional[int] = None, *, learned: bool,
               step: int = 0) -> None:
        """Zero state for ``p``'s piece (exact tensors ignore ``period``)."""
        dev = piece.local.device
        self.state[p] = self._spec(p, period).allocate(
            tuple(piece.local.shape), dev, learned=learned, step=step, codebook=self._codebook_for(dev),
            wrap=lambda t, gs: like_param(t, p, gs))

    def init_state(self, periods: Optional[Dict[Any, int]] = None) -> None:
        """Allocate (zero) state for every trainable parameter now, without a step.

        ``periods`` maps parameters (or their names) to the period to use; those tensors are
        marked learned, as after loading a checkpoint (so the state's shapes match a saved one and
        ``torch.distributed.checkpoint`` can load into it in place). Quantized tensors without an
        entry get a placeholder (the period their mode fixes, D14, else the row) that is re-learned
        at their first nonzero gradient. Existing state is kept. No collectives.
        """
        names = self._names()
        periods = periods or {}
        for g in self.param_groups:
            for p in g["params"]:
                if not p.requires_grad or self.state.get(p):
                    continue
                pc = piece_of(p, self._comm.rank, self._comm.world_size > 1)
                exact = self._mode(p) == MODE_EXACT
                per = None if exact else periods.get(p, periods.get(names[id(p)]))
                self._alloc(p, pc, None if per is None else int(per), learned=per is not None or exact)

    def _codebook_for(self, device: torch.device) -> torch.Tensor:
        if self.codebook is None:
            # Placeholder until learned: zeros (never a valid codebook, whose first entry is -1).
            if not hasattr(self, "_placeholder_cb"):
                self._placeholder_cb = torch.zeros(codebook_size_of(self), dtype=torch.float32, device=device)
            return self._placeholder_cb
        if self.codebook.device != device:
            return self.codebook.to(device)
        return self.codebook

    def _pieces(self, entries) -> List[Piece]:
        replicated = self._comm.world_size > 1
        return [piece_of(p, self._comm.rank, replicated) for _, p in entries]

    def _prepare(self, entries) -> None:
        """Create state for parameters that lack it; learn periods and the codebook (D4).

        Every rank reaches the same decisions from all-reduced statistics, so the collectives
        below are entered by all ranks in the same order.
        """
        todo = []  # (p, piece) needing state or a period
        for (g, p), piece in zip(entries, self._pieces(entries)):
            st = self.state.get(p)
            if not st or (("learned" in st) and not st["learned"]):
                todo.append((p, piece))
        if not todo:
            return
        quant = [(p, pc) for p, pc in todo if self._mode(p) != MODE_EXACT]
        for p, pc in todo:
            if self._mode(p) == MODE_EXACT and not self.state.get(p):
                self._alloc(p, pc, learned=True)
        # Fixed-size cross-rank check before the variable-size collectives below (added with the
        # checkpoint/DDP tests): ranks about to learn different tensors (an extra parameter on one
        # rank) would otherwise make gloo abort the process or NCCL hang instead of a clear error.
        self._check_same_tensors([pc.shape for _, pc in quant])
        if not quant:
            return
        nonzero = learning.live_pieces(self._comm, [pc for _, pc in quant])
        live = [(p, pc) for (p, pc), nz in zip(quant, nonzero) if nz]
        for (p, pc), nz in zip(quant, nonzero):
            if not nz and not self.state.get(p):
                # Zero gradient (e.g. DCP's init step): placeholder with the row as period.
                self._alloc(p, pc, learned=False)
        if not live:
            return
        self._refuse_overflow_before_learning(live)  # nothing learned from a gradient the step refuses
        self._note_dense_span(live)
        t0 = time.perf_counter()
        periods = self._learn_periods(live)
        t_periods = time.perf_counter() - t0
        for (p, pc), per in zip(live, periods):
            step = self.state[p]["step"] if self.state.get(p) else 0
            self._alloc(p, pc, per, learned=True, step=step)
        if self.codebook is None:
            self._learn_codebook(live, t_periods)

    def _learn_periods(self, live: Sequence[Tuple[torch.Tensor, Piece]]) -> List[int]:
        return learning.learn_periods(self._comm, [pc for _, pc in live],
                                      [self._spec(p).geometry.period if self._mode(p) in SPAN_MODES + (MODE_FACTORED,)
                                       else fixed_period(pc.shape, second_moment_of(self._group_of(p))) for p, pc in live])

    def _global_histogram(self, live: Sequence[Tuple[torch.Tensor, Piece]]) -> torch.Tensor:
        return learning.global_histogram(self._comm, [(pc, self.state[p]["scale_block"],
                                                       self._mode(p) if self._mode(p) in SPAN_MODES else None)
                                                      for p, pc in live])

    def _learn_codebook(self, live: Sequence[Tuple[torch.Tensor, Piece]], t_periods: float) -> None:
        t0 = time.perf_counter()
        counts = self._global_histogram(live)
        t_hist = time.perf_counter() - t0
        fit = learning.learn_codebook(counts, self.symmetric_codebook, codebook_size_of(self))  # 16: D20
        self.codebook = fit.codebook.to(device=live[0][1].local.device)
        for st in self.state.values():
            if "codebook" in st:
                st["codebook"] = self._codebook_for(local_tensor(st["idx"]).device)
        self.codebook_info = dict(fit.info, seconds_hist=t_hist, seconds_periods=t_periods)
        self._check_agreement()
        per = Counter(self.state[p]["period"] for p, _ in live)
        top = ", ".join(f"P={k}: {v}" for k, v in sorted(per.items(), key=lambda kv: -kv[1])[:6])
        logger.info(
            "Gefen learned its %scodebook: %d tensors quantized (%s), %d values in %d active bins, "
            "RMS quantization error %.2e (normalised units), periods %.2fs, histogram %.2fs, DP %.2fs (%s)",
            "symmetric " if fit.info["symmetric"] else "", len(live), top, fit.info["values"],
            fit.info["active_bins"], fit.info["rms_error"], t_periods, t_hist, fit.info["seconds_dp"], fit.info["method"],
        )

    def _check_same_tensors(self, shapes) -> None:
        learning.check_same_tensors(self._comm, shapes)

    def _check_agreement(self) -> None:
        records = [(st.get("period"), st.get("learned")) if st else None
                   for g in self.param_groups for st in (self.state.get(p) for p in g["params"])]
        learning.check_agreement(self._comm, self.codebook, records)

    # ------------------------------------------------------------------ step
    def _entries(self) -> List[Tuple[dict, torch.Tensor]]:
        names = None
        out = []
        for g in self.param_groups:
            for p in g["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    names = names or self._names()
                    raise RuntimeError(f"Gefen does not support sparse gradients (parameter {names[id(p)]!r}); "
                                       "use torch.optim.SparseAdam for sparse embeddings")
                out.append((g, p))
        self._check_own(out)
        return out

    def _fused(self, p: torch.Tensor, group: Optional[dict] = None) -> Optional[bool]:
        """``fused`` for parameter ``p``: its param group's (``group`` if given), else the constructor's."""
        g = self._group_of(p) if group is None else group
        return g["fused"] if "fused" in g else self.fused

    def _impl(self, t: torch.Tensor, p: Optional[torch.Tensor] = None,
              group: Optional[dict] = None) -> _dispatch.StepImpl:
        """The implementation that steps tensor ``t`` (:func:`gefen_dist.kernels.dispatch.select`) with
        the ``fused`` of parameter ``p``'s group (``group`` if given; ``p`` None: the constructor's)."""
        return _dispatch.select(t, self.fused if p is None else self._fused(p, group))

    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], float]] = None):
        """Perform one optimization step. The closure (if any) is evaluated first (D4)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        entries = self._entries()
        _validation.prestep(self, entries)  # compile, meta, changed shapes, zero-size, nonfinite learning
        if self._batched_step(entries):  # the multi-tensor CUDA step took it (or skipped it)
            return loss
        partials = self._column_partials(entries)
        if self.nonfinite != "ignore" and self._nonfinite(entries, partials):
            return loss
        self._prepare(entries)
        col = self._column_stats(entries, partials)
        self._step_span(entries)  # narrow_rows="span" tensors (D16): every rank, one SUM and one MAX
        self._update_all(entries, col)
        self._announce()
        return loss

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> Dict[str, Any]:
        """As ``torch.optim.Optimizer.state_dict`` (warns when a shared-mode placeholder state is
        about to meet the generic DCP flow, :meth:`_warn_unsized_shared`)."""
        self._warn_unsized_shared()
        return super().state_dict()

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """Load state as ``torch.optim.Optimizer`` does (pre hooks first, post hooks after Gefen's
        own load), but atomically (everything is validated before anything changes; errors name
        the parameter, the key and the fix) and without torch's cast of the state to the parameter
        dtype (uint8 indices stay uint8, no fp32 copy: D9). Periods and the codebook are restored,
        never re-learned. See :mod:`gefen_dist.optim.state_dict_io`."""
        _sdio.load(self, state_dict)

    def _validate_loaded(self, p: torch.Tensor, st: dict, name: str) -> None:
        _sdio.validate_entry(self, p, st, name)

    # ------------------------------------------------------------------ copy / pickle
    def __getstate__(self) -> Dict[str, Any]:
        return _sdio.getstate(self)

    def __setstate__(self, state: Dict[str, Any]) -> None:
        _sdio.setstate(self, state)

    def __deepcopy__(self, memo):
        return _sdio.deepcopy(self, memo)
