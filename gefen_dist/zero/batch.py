"""ZeroGefen's step on the Triton path (CUDA) in a fixed number of launches, not a few per tensor.

Stepped tensor by tensor, a ZeroGefen step costs a dozen torch operations (each a launch on a GPU)
per tensor and phase: the column sums of ``g^2``, the non-finite check, the column means, the
owners' state updates and the ``v_col`` EMAs with their column factors (``research/zero_apply_ops.py``
counts them). Where every quantized tensor takes the Triton implementation (its
:class:`~gefen_dist.kernels.dispatch.StepImpl` has ``state_many``), :class:`ZeroBatch` takes those
phases, from the second step on (state learned), with

* one column-sum launch per gradient dtype plus one reduction for every factored tensor
  (:class:`~gefen_dist.kernels.triton_multi.ColumnSums`; every rank from its whole gradient, as
  before, added in the fixed order of single-process Gefen's CUDA batch, so ZeroGefen's statistics
  are that batch's bits);
* the non-finite check from those sums and one foreach norm of the other gradients, decided with the
  column statistics' overflow in one host synchronisation and agreed across ranks by the same
  collectives as the per-tensor path (:meth:`~gefen_dist.engine.nonfinite.NonfiniteChecks._nonfinite_agree`);
* the column means in one division, the ``v_col`` EMAs in two foreach operations per ``beta2``, the
  column factors in one launch (:class:`~gefen_dist.kernels.triton_multi.ColumnFactors`);
* the owners' factored and compressed state updates in one launch per (mode, dtype, tile) and launch
  group (:class:`~gefen_dist.kernels.triton_state.StateMany`: bitwise the per-range state functions);
* with ``second_moment="nibbles"`` (D20), instead of the column factors: the column ratios around every
  rank's ``v_col`` EMAs by shape (:class:`~gefen_dist.engine.column_stats.ColumnRatios`), and the owners'
  dense steps of their rows in one launch per (dtype, tile) and launch group
  (:class:`~gefen_dist.kernels.triton_nibbles.NibbleStep`, in place; the new values travel dense as
  before; bitwise the per-tensor owners' kernel through the interpreter, ``tests/test_triton_step.py``, and
  at 2 ranks with rows cut by the ranges, ``tests/dist/batch_check.py``).

The wire modes, the exchange, the appliers (``ApplyMany``), the exact tensors and the span tensors
(D16) are :mod:`gefen_dist.zero.step`'s, unchanged. A batch is built for a fixed set of tensors and
reused while the partition, the tensors, their storage, their state dicts and their step counts'
offsets stay the same. A gradient of another dtype or layout sends that step to the per-tensor
path (INFO, once per reason); a parameter the batch cannot take (not contiguous, fp16, another
implementation or device) sends every step there (WARNING, once per reason, naming the fix); both
paths enter the same collectives in the same order.
"""
from __future__ import annotations

import logging
from typing import Dict, List, Optional

import torch

from ..core.step import col_blocks_of, ema_foreach_, row_block_args
from ..engine.column_stats import ColumnTable
from ..engine.cuda_batch import quantized_layout_problem
from ..engine.layout import global_shape, is_dtensor
from ..engine.nonfinite import any_overflow, device_flags
from ..engine.state import MODE_EXACT, SPAN_MODES, nibbles_in, step_of, steps_of
from .partition import MODE_COMPRESSED, MODE_FACTORED
from .step import _STATE_HP, _flat_range

logger = logging.getLogger(__name__)

__all__ = ["ZeroBatch"]



def _key(opt, entries) -> Optional[tuple]:
    """What a batch is built for (None when a tensor has no state yet): the partition, the
    ``fused`` setting, each tensor, its storage, its state dict and its step count's offset (the
    batch keeps the partition, the tensors and the state dicts alive, so no id is reused meanwhile)."""
    states = [opt.state.get(p) for _, p in entries]
    if not all(states):
        return None
    steps = steps_of(states)  # (one read of every step count)
    out = tuple((id(p), p.data_ptr(), id(st), step - steps[0]) for (_, p), st, step in zip(entries, states, steps))
    return id(opt._partition), opt.fused, out


class ZeroBatch:
    """The tables of one ZeroGefen's batched phases for a fixed set of entries (module docstring)."""

    def __init__(self, key: tuple, opt, entries, impl, device: torch.device):
        from ..kernels import triton_step as tri

        self.key, self.device, self.entries = key, device, entries
        state = opt.state
        self._alive = (opt._partition, [state[p] for _, p in entries])  # (the ids in the key stay theirs)
        self.fact = [e for e, (_, p) in enumerate(entries) if opt._is_factored(p)]
        fset = set(self.fact)
        self.others = [e for e in range(len(entries)) if e not in fset]
        # the entries whose kernels read the gradient (contiguous, the parameter's dtype)
        self._quantized = [e in fset or opt._mode(p) not in (MODE_EXACT,) + SPAN_MODES for e, (_, p) in enumerate(entries)]
        cols = []
        for e in self.fact:
            p = entries[e][1]
            v_col = state[p]["v_col"]
            S, G, R = v_col.shape[-1], max(1, v_col.numel() // v_col.shape[-1]), global_shape(p)[0]
            rb = row_block_args(v_col, R, 0).get("row_block", 1)
            cols.append((v_col, (p.numel() // S, S, 0, rb, G, p.dtype), R // G, True))
        # second_moment="nibbles" (D20; then every factored tensor of the optimizer is one): no column
        # factors, its owners' dense steps read the column ratios around the v_col EMA (_nibble_groups)
        self.nibbles = nibbles_in(opt.param_groups)
        # (column blocks, D21: their factors normalised per block of columns, as the appliers read them)
        colb = [col_blocks_of(state[entries[e][1]]["v_row"]) for e in self.fact]
        self.cols = ColumnTable(tri, cols, device, factored=[not self.nibbles] * len(cols), col_blocks=colb) if cols else None
        by_beta2: Dict[float, tuple] = {}
        for e, cms in zip(self.fact, self.cols.views if cols else []):
            b = by_beta2.setdefault(entries[e][0]["betas"][1], ([], [], []))
            b[0].append(state[entries[e][1]]["v_col"])
            b[1].append(cms)
            b[2].append(e)
        self._emas = [(beta2, (v, c)) for beta2, (v, c, _) in by_beta2.items()] if not self.nibbles else []
        self._nibs = self._nibble_groups(opt, entries, by_beta2, device) if self.nibbles else []
        self._states = self._state_groups(opt, entries, impl)
        self.codebook_state = next((state[entries[e][1]] for e in self.fact), None) or next(
            (state[p] for _, p in entries if "codebook" in state[p]), None)
        self._prep = None
        logger.debug("gefen_dist: ZeroGefen batch for %d tensors: %d factored, %d state launches", len(entries),
                     len(self.fact), sum(sm.launches for _, sm in self._states))

    @staticmethod
    def _nibble_groups(opt, entries, by_beta2, device) -> List[dict]:
        """``second_moment="nibbles"`` (D20): per ``beta2`` the column ratios around its ``v_col`` EMAs
        (every rank: ``v_col`` is replicated), then per (param group, step count) one multi-tensor step
        (:class:`~gefen_dist.kernels.triton_nibbles.NibbleStep`) of this rank's rows, in place (the batch
        takes contiguous parameters only; the new values travel dense and every rank, this one included,
        copies them there), with the per-tensor owner's arguments (``_owner_nibbles``)."""
        from ..engine.column_stats import ColumnRatios
        from ..kernels import triton_multi, triton_nibbles

        out, steps = [], {}
        for beta2, (vcols, means, es) in by_beta2.items():
            ratios = ColumnRatios(vcols, device)
            out.append(dict(beta2=beta2, ratios=ratios, means=means))
            for j, e in enumerate(es):
                group, p = entries[e]
                st = opt.state[p]
                s, end = opt._mine(p)
                if end == s:
                    continue
                S, G = vcols[j].shape[-1], vcols[j].shape[0] if vcols[j].dim() > 1 else 1
                item = triton_multi.NibbleItem(opt._param_range(p, s, end), st["idx"].view(-1), st["scale"].view(-1),
                                               st["v_row"].view(-1), ratios.old[j], ratios.new[j], S,
                                               int(st["scale_block"]), s // S, global_shape(p)[0] // G,
                                               opt._tensor_index(p))
                steps.setdefault((id(group), step_of(st)), []).append((p, item))
        for members in steps.values():  # (after every ratios entry: owner_states runs them first)
            out.append(dict(params=[p for p, _ in members], ranges=[it.param for _, it in members],
                            step=triton_nibbles.NibbleStep([it for _, it in members], device)))
        return out

    @staticmethod
    def _state_groups(opt, entries, impl) -> List[tuple]:
        """One :class:`StateMany` per (param group, step count) over this rank's owned ranges of the
        tensors whose update travels compressed: ``(member params, StateMany)``."""
        groups: Dict[tuple, list] = {}
        for group, p in entries:
            st = opt.state[p]
            if opt._mode(p) in SPAN_MODES:
                continue
            mode = opt._wire_mode(p, st)
            s, e = opt._mine(p)
            if mode not in (MODE_FACTORED, MODE_COMPRESSED) or e == s or (
                    mode == MODE_FACTORED and col_blocks_of(st["v_row"]) > 1):  # (D21: the per-tensor owner update)
                continue
            fact = mode == MODE_FACTORED
            S = st["v_col"].shape[-1] if fact else int(st["period"])
            v = st["v_row"] if fact else st["v"]
            rng = (p.dtype, st["idx"].view(-1), st["scale"].view(-1), v.view(-1), S,
                   int(st["scale_block"]) if fact else S, 2 if fact else 0)
            groups.setdefault((id(group), step_of(st)), []).append((p, rng))
        return [([p for p, _ in m], impl.state_many([r for _, r in m], m[0][0].device))
                for m in groups.values()]

    # ------------------------------------------------------------------ building
    @classmethod
    def plan(cls, opt, entries) -> Optional["ZeroBatch"]:
        """The batch for this step's ``entries`` (the last one while its key holds), or None when the
        per-tensor path takes the step: ``fused=False``, state still to learn, an implementation
        without ``state_many`` (the native CPU kernel, the eager reference: in O(1)), or
        (:meth:`_survey`, one WARNING per reason) a DTensor, a quantized parameter that is not
        contiguous float32/bfloat16, another implementation, or parameters on several devices."""
        if opt.fused is False or not entries or opt._partition is None:
            return None
        # (the common CPU case first, in O(1): the native kernel has no state_many; on CUDA a tensor
        # without the Triton kernels is named by _survey below)
        q = next((p for _, p in entries if opt.state.get(p) and opt._mode(p) not in (MODE_EXACT,) + SPAN_MODES), None)
        if q is None or (q.device.type == "cpu" and opt._impl(q).state_many is None):
            return None
        key = _key(opt, entries)
        last = opt.__dict__.get("_zero_batch")
        if key is None:
            return None
        if last is not None and last.key == key:
            return last
        if opt.__dict__.get("_zero_plan_refused") == key:
            return None  # (surveyed for these tensors already: a parameter the batch cannot take)
        impl, device, why = cls._survey(opt, entries)
        if impl is None:
            if why:
                opt._zero_plan_refused = key
            if why and why not in opt.__dict__.setdefault("_zero_plan_fallbacks", set()):
                opt._zero_plan_fallbacks.add(why)
                logger.warning("ZeroGefen: the batched step is not used: %s. Every tensor is stepped on its own "
                               "instead (same results, many more launches on a GPU); logged once per reason.", why)
            return None
        opt._zero_batch = cls(key, opt, entries, impl, device)
        return opt._zero_batch

    @staticmethod
    def _survey(opt, entries) -> tuple:
        """``(impl, device, "")``: the implementation with ``state_many`` and the device that every
        quantized tensor shares; else ``(None, None, why)``, ``why`` naming the tensor and the fix, or
        empty where the per-tensor path is the expected one (state still to learn)."""
        def name(p) -> str:  # (looked up only for a message)
            return opt._names().get(id(p), "?")

        impl = device = None
        for _, p in entries:
            st = opt.state.get(p)
            if not st:
                return None, None, ""
            if is_dtensor(p):
                return None, None, f"parameter {name(p)!r} is a DTensor (ZeroGefen partitions plain tensors)"
            if device is not None and p.device != device:
                return None, None, f"parameter {name(p)!r} is on {p.device}, the others on {device} (one device per batch)"
            device = p.device
            mode = opt._mode(p)
            if mode == MODE_EXACT:
                continue
            if not st.get("learned", 1):
                return None, None, ""
            if mode in SPAN_MODES:
                continue
            why = quantized_layout_problem(name(p), p)
            if why:
                return None, None, why
            i = opt._impl(p)
            if i.state_many is None or (impl is not None and i is not impl):
                others = f", the others {impl.name}" if impl is not None else ""
                return None, None, (f"parameter {name(p)!r} takes the {i.name} implementation{others} (the batch needs "
                                    "every quantized tensor on the Triton kernels)")
            impl = i
        return impl, device, ""

    # ------------------------------------------------------------------ stepping
    def prepare(self, opt):
        """The step's checks and column statistics, changing nothing: None when the per-tensor path
        must take the step (a gradient of another dtype or layout; no collective entered), True when
        it is skipped (``nonfinite="skip"``; "raise" raised), else False."""
        grads = []
        for (_, p), quantized in zip(self.entries, self._quantized):
            g = p.grad
            if g is not None and g.device == self.device and (
                    not quantized or (g.dtype == p.dtype and g.is_contiguous())):
                grads.append(g)
                continue
            why = self._cannot_take(opt, p, g, quantized)
            if why:
                if why not in opt.__dict__.setdefault("_zero_batch_fallbacks", set()):
                    opt._zero_batch_fallbacks.add(why)
                    logger.info("ZeroGefen: %s: this step takes the per-tensor path (same results, more launches on a "
                                "GPU); logged once per reason", why)
                return None
            grads.append(g)
        cols = self.cols
        buf = cols.column_sums([grads[e] for e in self.fact]) if cols is not None else None
        cms = cols.column_means(buf) if buf is not None else None
        if opt.nonfinite != "ignore":
            flags = device_flags(buf, [grads[e] for e in self.others if grads[e].numel()])  # (settled below)
            if flags or cms is not None:  # the one synchronisation: the flags and the overflow together
                verdict = torch.stack(flags + ([any_overflow(cms)] if cms is not None else [])).tolist()
            any_flag = any(verdict[:len(flags)]) if flags else False
            if opt._nonfinite_agree(self.entries, float(any_flag), lambda: opt._nonfinite_local(self.entries)):
                return True
            if cms is not None and verdict[-1]:
                opt._raise_column_overflow(self.column_means())
        self._prep = grads
        return False

    def _cannot_take(self, opt, p, g, quantized: bool) -> str:
        """Why this step's gradient ``g`` of ``p`` cannot go through the batch ("" when it can):
        quantized tensors' kernels read contiguous gradients of the parameter's dtype."""
        if g is not None and g.device == self.device and not is_dtensor(g) and (
                not quantized or (g.dtype == p.dtype and g.is_contiguous())):
            return ""
        name = opt._names().get(id(p), "?")
        if g is None:
            return f"the gradient of {name!r} is missing"
        return (f"the gradient of {name!r} is {g.dtype}, {'' if g.is_contiguous() else 'non-'}contiguous, on "
                f"{g.device} (parameter {p.dtype} on {self.device}; the batch needs contiguous gradients of the "
                "parameter's dtype on its device)")

    def column_means(self) -> Dict[torch.Tensor, torch.Tensor]:
        """The float32 column means of ``g^2`` per factored tensor (views of one buffer)."""
        return {self.entries[e][1]: c for e, c in zip(self.fact, self.cols.views if self.cols else [])}

    def owner_states(self, opt, items) -> Dict[int, List[torch.Tensor]]:
        """This rank's state updates of its compressed-travelling ranges, by parameter id: the parts
        it sends (``idx``, ``scale``, ``sqrt(v_row)`` or ``sigma``); with ``second_moment="nibbles"`` every
        rank's ``v_col`` EMAs and this rank's new values of its rows (its one part, dense)."""
        hps = {id(p): hp for p, st, hp, mode in items}
        grads = {id(p): g for (_, p), g in zip(self.entries, self._prep)}
        self._prep = None  # (the batch must not keep the step's gradients alive after it)
        cb = self.codebook_state["codebook"]
        out = {}
        for members, sm in self._states:
            hp = hps[id(members[0])]
            thirds = sm.run([_flat_range(grads[id(p)], *opt._mine(p)) for p in members], cb,
                            **{k: hp[k] for k in _STATE_HP})
            for p, r, third in zip(members, sm.ranges, thirds):
                out[id(p)] = [r[1], r[2], third]
        for nb in self._nibs:  # D20: every rank's v_col EMAs between their ratios, then the owners' rows
            if "ratios" in nb:
                nb["ratios"].run(nb["means"], nb["beta2"])
                continue
            ps = nb["params"]
            hp = hps[id(ps[0])]
            nb["step"].run([_flat_range(grads[id(p)], *opt._mine(p)) for p in ps], cb, step_of(opt.state[ps[0]]), **hp)
            out.update((id(p), [r]) for p, r in zip(ps, nb["ranges"]))  # (updated in place: the values sent)
        return out

    def column_factors(self) -> Dict[int, torch.Tensor]:
        """Every rank: the ``v_col`` EMAs, then the column factors ``sqrt(v_col / mean(v_col))`` in one
        launch, by parameter id (after the owners' state updates, which do not read them)."""
        for beta2, (vcols, cms) in self._emas:  # ("nibbles": its EMAs ran in owner_states; no factors)
            ema_foreach_(vcols, cms, beta2)
        if self.cols is None:
            return {}
        if self.cols.factors is not None:
            self.cols.factors.run()  # (rewrites factor_views in place; None where none is needed)
        return {id(self.entries[e][1]): v for e, v in zip(self.fact, self.cols.factor_views) if v is not None}

