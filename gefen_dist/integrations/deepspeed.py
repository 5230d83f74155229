"""Gefen under DeepSpeed ZeRO-1/2/3 with exact per-tensor state.

Importing this module registers Gefen with DeepSpeed's config-driven optimizer factory
(``torch.optim.Gefen``), so a JSON config with ``"optimizer": {"type": "Gefen", ...}`` and
``"zero_allow_untested_optimizer": true`` works with DeepSpeed's stock engine::

    import gefen_dist.integrations.deepspeed  # noqa: F401  (registers "Gefen")
    engine, opt, _, sched = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                                 config="gefen_zero2.json")

or explicitly (builds the engine, refuses unsupported configs, attaches the layout at once)::

    from gefen_dist.integrations import deepspeed as gds
    engine, opt, _, sched = gds.initialize(model=model, config="gefen_zero2.json")

ZeRO hands the optimizer flat fp32 partitions that concatenate and cut many tensors. This
optimizer never treats such a buffer as one tensor: it recovers each tensor's segments from
the ZeRO wrapper's own metadata (the buffer's real order, so ``round_robin_gradients`` is
fine), verifies them once (``flat[segment] == parameter[segment]``) and steps them with
:mod:`gefen_dist.engine.flat`, reconciling blocks cut by partition edges with one small
collective on the partition's process group. Without :func:`initialize` the layout is found
lazily at the first ``step()``. See ``docs/deepspeed.md``.
"""
from __future__ import annotations

import json
import logging
import math
import os
import sys
from typing import Any, Dict, List, Optional, Tuple

import torch

from ..core import periods as _periods
from ..engine import learning
from ..optim import gefen as _opt_mod
from ..optim.introspect import referrers_with_optimizer as _referrers_with_optimizer
from ..optim.validation import GROUP_REJECTED_SHARDED, refuse_compile
from ..engine.comm import LocalComm, ProcessGroupComm
from ..core.step import hyperparameters
from ..engine.flat import FlatSegments, LayoutError, Segment, verify_segments
from ..engine.state import MODE_FACTORED, MODE_SHARED, NIBBLES, mode_of_saved, narrow_rows_of, second_moment_of
from ..engine.layout import is_exact
from ..engine.report import Report

logger = logging.getLogger(__name__)

__all__ = ["Gefen", "initialize", "register", "check_config", "load_universal", "LayoutError",
           "CheckpointWorldSizeError", "extension_locks", "warn_stale_extension_locks"]

_WRAPPER_ATTRS = ("single_partition_of_fp32_groups", "fp32_partitioned_groups_flat", "fp32_groups_flat_partition")


def _comm(group) -> LocalComm:
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return LocalComm()
    return ProcessGroupComm(group)


class Gefen(_opt_mod.Gefen):
    """:class:`gefen_dist.Gefen` that understands DeepSpeed ZeRO's flat partitions.

    Outside DeepSpeed it is exactly :class:`gefen_dist.Gefen`. Under ZeRO-1/2/3 (and the bf16
    optimizer) the state of each flat partition is kept per original tensor; see the module
    docstring. Construct it with the model's parameters (DeepSpeed does this for the JSON path).
    """

    _group_rejected = GROUP_REJECTED_SHARDED  # flat buffers cut across groups: one implementation
    _complex_ok = False  # flat buffers
    _nibbles_ok = True  # second_moment="nibbles" (D20): the factored layout's reconciliation, one-byte codes

    def __init__(self, params, *args, **kwargs):
        super().__init__(params, *args, **kwargs)
        self._ds_orig: List[torch.Tensor] = []
        self._ds_names: Dict[int, str] = {}
        for gi, g in enumerate(self.param_groups):
            pn = g.get("param_names")
            for pi, p in enumerate(g["params"]):
                self._ds_names[id(p)] = pn[pi] if pn is not None else f"param{len(self._ds_orig)}"
                self._ds_orig.append(p)
        # each tensor's column blocks (D21) by its group's setting (ZeRO-3 empties the groups between steps)
        self._ds_col_blocks = {id(p): g.get("col_blocks", 1) if second_moment_of(g) == MODE_FACTORED else 1
                               for g in self.param_groups for p in g["params"]}
        self._ds_orig_ids = {id(p) for p in self._ds_orig}
        self._ds_index = {f"p{i}": i for i in range(len(self._ds_orig))}  # _key_of's keys -> place (D20)
        self._ds_flats: Dict[int, FlatSegments] = {}
        self._ds_tensors: Dict[int, torch.Tensor] = {}
        self._ds_wrapper = None
        _install_engine_hook()
        self._ds_stage = None

    def _ds_key_names(self) -> Dict[str, str]:
        """The layout's tensor keys (``p<i>``, :meth:`_key_of`) -> parameter names, for messages."""
        return {f"p{i}": self._ds_names[id(p)] for i, p in enumerate(self._ds_orig)}

    # ------------------------------------------------------------------ layout discovery
    def attach_deepspeed(self, wrapper: Any, module: Optional[torch.nn.Module] = None) -> None:
        """Recover the layout of every flat partition from the ZeRO wrapper (``engine.optimizer``)."""
        if module is not None:
            for name, p in module.named_parameters():
                if id(p) in self._ds_names and self._ds_names[id(p)].startswith("param"):
                    self._ds_names[id(p)] = name
        check_wrapper(wrapper)
        layouts = extract_layout(wrapper, self._key_of, self._ds_names)
        for flat, segs, sources, group, where in layouts:
            verify_segments(flat, segs, sources, where)
            self._ds_flats[id(flat)] = FlatSegments(segs, _comm(group), self.small_threshold, where)
            self._ds_tensors[id(flat)] = flat
            st = self.state.get(flat)
            if st:
                self._ds_flats[id(flat)].check_state(st, flat)
        self._ds_wrapper = wrapper
        logger.info("Gefen attached to %s: %d flat partitions, %d segments", type(wrapper).__name__,
                    len(layouts), sum(len(x[1]) for x in layouts))

    def _key_of(self, p: torch.Tensor) -> str:
        for i, q in enumerate(self._ds_orig):
            if q is p:
                return f"p{i}"
        raise LayoutError(f"a ZeRO partition holds a parameter of shape {tuple(getattr(p, 'ds_shape', p.shape))} "
                          "that was not given to this Gefen instance")

    def _discover(self) -> None:
        """Lazy path: find the ZeRO wrapper that owns this optimizer, or fall back to the
        per-parameter mappings DeepSpeed leaves on the model's parameters."""
        for p in self._ds_orig:
            w = getattr(p, "_z3_optimizer", None)
            if w is not None and getattr(w, "optimizer", None) is self:
                engines = _referrers_with_optimizer(w, ("module",))
                return self.attach_deepspeed(w, engines[0].module if engines else None)
        for w in _referrers_with_optimizer(self, _WRAPPER_ATTRS):
            engines = _referrers_with_optimizer(w, ("module",))  # for parameter names
            return self.attach_deepspeed(w, engines[0].module if engines else None)
        # Last resort (ZeRO-1/2): DeepSpeed's per-parameter fragment mappings.
        by_flat: Dict[int, Tuple[torch.Tensor, List[Segment], List[torch.Tensor]]] = {}
        for p in self._ds_orig:
            m = getattr(p, "_hp_mapping", None)
            if m is None:
                continue
            flat = getattr(m.hp_fragment, "_base", None)
            flat = flat if flat is not None else m.hp_fragment
            seg = Segment(self._key_of(p), self._ds_names[id(p)], tuple(p.shape), int(m.lp_fragment_address.start),
                          int(m.hp_fragment_address.start), int(m.hp_fragment_address.numel))
            ent = by_flat.setdefault(id(flat), (flat, [], []))
            ent[1].append(seg)
            ent[2].append(p)
        if not by_flat:
            raise LayoutError(
                "Gefen is being stepped on tensors it was not constructed with (a DeepSpeed ZeRO flat partition?) "
                "and no DeepSpeed layout could be found. Build the engine with "
                "gefen_dist.integrations.deepspeed.initialize, or call opt.attach_deepspeed(engine.optimizer)."
            )
        from deepspeed.utils import groups as ds_groups

        for flat, segs, srcs in by_flat.values():
            order = sorted(range(len(segs)), key=lambda i: segs[i].flat_offset)
            segs, srcs = [segs[i] for i in order], [srcs[i] for i in order]
            where = f"ZeRO flat partition ({flat.numel()} elements, from parameter mappings)"
            verify_segments(flat, segs, srcs, where)
            self._ds_flats[id(flat)] = FlatSegments(segs, _comm(ds_groups._get_data_parallel_group()),
                                                    self.small_threshold, where)
            self._ds_tensors[id(flat)] = flat

    # ------------------------------------------------------------------ step
    @torch.no_grad()
    def step(self, closure=None):
        entries = [(g, p) for g in self.param_groups for p in g["params"] if p.grad is not None]
        if not self._ds_flats and all(id(p) in self._ds_orig_ids for _, p in entries):
            return super().step(closure)  # not under DeepSpeed: plain Gefen
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        refuse_compile()
        for g, p in entries:
            if id(p) not in self._ds_flats:
                if id(p) in self._ds_orig_ids:
                    raise LayoutError("Gefen sees both original parameters and DeepSpeed flat partitions")
                self._discover()
                if id(p) not in self._ds_flats:
                    raise LayoutError(
                        f"Gefen was handed a tensor of shape {tuple(p.shape)} that is neither one of its parameters "
                        "nor a DeepSpeed flat partition with a known layout; refusing to treat it as one tensor")
            self._step_flat(g, p)
        self._announce()
        return loss

    def _announce(self) -> None:
        # ZeRO-1/2 step one param group per call (the others swapped out): wait for every partition
        if sum(id(k) in self._ds_flats for k in self.state) >= len(self._ds_flats):
            super()._announce()

    def _backend(self) -> str:
        if not self._ds_flats:
            return super()._backend()
        w = type(self._ds_wrapper).__name__ if self._ds_wrapper is not None else "ZeRO (parameter mappings)"
        return f"DeepSpeed {w} ({len(self._ds_flats)} flat partitions, per-tensor state)"

    def _step_flat(self, group: dict, flat: torch.Tensor) -> None:
        fs = self._ds_flats[id(flat)]
        st = self.state.get(flat)
        second_moment = second_moment_of(group)  # the buffer's mode (the constructor's default where unset)
        fs.second_moment = second_moment  # for report(): ZeRO-3 empties the param groups between steps
        fs.narrow_rows = narrow_rows_of(group)  # D16, D18: the buffer's group's
        fs.tensor_index = self._ds_index  # keys the random numbers of second_moment="nibbles" (D20)
        factored = second_moment in (MODE_FACTORED, NIBBLES)
        k = 16 if second_moment == NIBBLES else 256  # the codebook's codewords (D20)
        # state that exists was loaded (or put there by DeepSpeed): checked as a saved entry
        saved = mode_of_saved(st) if st else None
        if st and saved not in (MODE_SHARED, MODE_FACTORED):
            raise LayoutError(
                f"{fs.where}: the optimizer state holds {sorted(st)[:4]} (Adam-shaped state put there by "
                "DeepSpeed's own universal-checkpoint loader?), not Gefen's. Load universal checkpoints into Gefen "
                "with gefen_dist.integrations.deepspeed.load_universal(engine, path), or import "
                "gefen_dist.integrations.deepspeed before deepspeed.initialize so that engine.load_checkpoint with "
                '"load_universal": true goes through Gefen\'s loader.')
        if not st:
            cb = self._codebook_for(flat.device) if self.codebook is not None else torch.zeros(
                k, dtype=torch.float32, device=flat.device)  # (zeros: the placeholder until learned)
            st = self.state[flat] = fs.new_state(flat, cb, factored=factored,
                                                 row_blocks=group.get("row_blocks", "auto"),
                                                 col_blocks=group.get("col_blocks", 1))
        elif (saved == MODE_FACTORED) != factored or st["codebook"].numel() != k:
            held = NIBBLES if saved == MODE_FACTORED and st["codebook"].numel() == 16 else saved
            raise ValueError(
                f"{fs.where}: the optimizer state holds a {held} second "
                f"moment ({st['codebook'].numel()} codewords) but the param group asks for "
                f"second_moment={second_moment!r}; resume with the setting the checkpoint was saved with")
        else:
            _check_narrow_rows(fs, st, factored)
            _check_col_blocks(fs, st, group, second_moment, self._ds_key_names)
            fs.continue_few_rows(st)  # a factored state saved before D15 or by its versions
        grad = flat.grad
        if grad.dtype != torch.float32:
            grad = grad.float()
        if fs.needs_learning(st):
            counts = fs.learn(st, grad, codebook_needed=self.codebook is None, second_moment=second_moment,
                              check_overflow=self.nonfinite != "ignore")
            if counts is not None:
                fit = learning.learn_codebook(counts, self.symmetric_codebook, k)
                self.codebook = fit.codebook.to(device=flat.device)
                for s in self.state.values():
                    if "codebook" in s:
                        s["codebook"] = self.codebook
                self.codebook_info = fit.info
                logger.info("Gefen (DeepSpeed) learned its codebook from %d values in %d active bins",
                            fit.info["values"], fit.info["active_bins"])
        # counted once the step went through (an overflowing squared gradient raises before)
        fs.step(flat, grad, st, second_moment=second_moment, impl=self._impl(flat),
                hp=hyperparameters(group, int(st["step"]) + 1, self.bound_updates),
                check_overflow=self.nonfinite != "ignore", step=int(st["step"]) + 1)
        st["step"] += 1

    # ------------------------------------------------------------------ introspection
    def periods(self) -> Dict[str, int]:
        """name -> period of every quantized tensor segment this rank holds (0: exact)."""
        out = {}
        for flat_id, fs in self._ds_flats.items():
            st = next((s for k, s in self.state.items() if id(k) == flat_id), None)
            if not st:
                continue
            for seg, per, learned in zip(fs.segments, st["periods"], st["learned"]):
                out[seg.name] = per if learned else -1
        return out

    def report(self):
        if not self._ds_flats:
            return super().report()
        rep = Report()
        for k, st in self.state.items():
            fs = self._ds_flats.get(id(k))
            if fs is None:
                continue
            # the mode of the group that last stepped this buffer (ZeRO-3 empties the groups between
            # steps); a buffer loaded but not stepped yet: read off its state, as a saved entry
            second_moment = fs.second_moment or mode_of_saved(st)
            nb = sum(st[x].numel() * st[x].element_size()
                     for x in ("idx", "scale", "v", "v_row", "v_col", "exact_m", "exact_v", "span_scale", "span_vblk",
                               "span_vcol", "span_codes") if x in st)
            for seg, per in zip(fs.segments, st["periods"]):
                mode = "exact" if per == 0 else second_moment
                rep.append(dict(name=seg.name, shape=seg.shape, numel=math.prod(seg.shape), local_numel=seg.numel,
                                dtype="float32", kind="exact" if per == 0 else "quantized", mode=mode, period=per,
                                scale_block=0, state_bytes=int(nb * seg.numel / max(1, k.numel()))))
        rep.backend = self._backend()
        return rep

    # ------------------------------------------------------------------ checkpoints
    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """Load a state saved by this optimizer under DeepSpeed, keeping dtypes (torch's base
        class would cast the uint8 indices to fp32) and the learned codebook/periods."""
        sample = next(iter(state_dict.get("state", {}).values()), None)
        if not (isinstance(sample, dict) and "segments" in sample):
            return super().load_state_dict(state_dict)
        id_map = _opt_mod.saved_param_map(self, state_dict)
        originals = {k: dict(v) for k, v in state_dict["state"].items()}
        torch.optim.Optimizer.load_state_dict(self, state_dict)  # hyperparameters, hooks
        self.state.clear()
        cb = None
        for k, saved in originals.items():
            p = id_map[k]
            st = {}
            for key, val in saved.items():
                if isinstance(val, torch.Tensor):
                    val = val.to(device=p.device)  # no dtype cast
                elif isinstance(val, list):
                    val = list(val)
                st[key] = val
            self.state[p] = st
            if float(st["codebook"][0]) == -1.0 and cb is None:
                cb = st["codebook"].to(torch.float32)
            fs = self._ds_flats.get(id(p))
            if fs is not None:
                fs.check_state(st, p)
        self.codebook = cb
        if cb is not None:  # (else each buffer keeps its saved placeholder: 16 or 256 zeros, D20)
            for st in self.state.values():
                st["codebook"] = self._codebook_for(st["idx"].device)


def _check_narrow_rows(fs, st: Dict[str, Any], factored: bool) -> None:
    """A buffer's state saved under another ``narrow_rows`` (D16, D18) resumes when both settings keep
    the same tensors per block of rows (the state then records the group's); otherwise a ValueError
    before anything changes. The setting is the same string on every rank of a save, so every rank
    enters the catalog's all-gather or none does."""
    saved = st.get("narrow_rows", "rows")  # a state saved before D16 was per row
    if saved == fs.narrow_rows:
        return
    was, now = list(st.get("span_keys", [])), fs.span_keys(factored)
    if was != now:
        differ = sorted(set(was) ^ set(now))
        raise ValueError(
            f"{fs.where}: the optimizer state was saved with narrow_rows={saved!r} but the param group asks for "
            f"narrow_rows={fs.narrow_rows!r}, which keeps {differ[:4]} differently (D16, D18: per block of rows "
            "or per row, different state); resume with the setting the checkpoint was saved with")
    st["narrow_rows"] = fs.narrow_rows


def _check_col_blocks(fs, st: Dict[str, Any], group: dict, second_moment: str, names) -> None:
    """A factored buffer's state saved under another ``col_blocks`` (D21) resumes when both give every
    tensor of the buffer the same column blocks (the state then records the group's); otherwise a
    ValueError before anything changes, naming the setting it was saved with. Decided on the buffer's
    global catalog (the same on every rank: every rank raises, or none); ``names()``: key -> tensor name."""
    if second_moment != MODE_FACTORED:
        return
    saved, now = st.get("col_blocks", 1), group.get("col_blocks", 1)  # (absent: saved before D21, one per row)
    if saved == now:
        return
    spans = set(st.get("span_keys", []))
    differ = [k for k, ent in fs.global_catalog().items()  # (the quantized factored tensors: the rule's own)
              if k not in spans and not is_exact(ent["shape"], fs.small_threshold)
              and _periods.factored_col_blocks(ent["shape"], saved) != _periods.factored_col_blocks(ent["shape"], now)]
    if differ:
        raise ValueError(
            f"{fs.where}: the optimizer state was saved with col_blocks={saved!r} but the param group asks for "
            f"col_blocks={now!r}, which keeps {[names().get(k, k) for k in differ[:4]]} with other column blocks "
            f"(D21: another v_row); resume "
            f"with col_blocks={saved!r}")
    st["col_blocks"] = now


# ---------------------------------------------------------------------------- layout extraction
def extract_layout(wrapper, key_of, names: Dict[int, str]):
    """``[(flat, segments, sources, process_group, where)]`` for a ZeRO-1/2, bf16 or ZeRO-3 wrapper.

    ``sources[i]`` is the tensor that holds segment ``i``'s current values in the parameter's dtype
    (the full parameter for ZeRO-1/2, this rank's ``ds_tensor`` partition for ZeRO-3), for
    :func:`gefen_dist.engine.flat.verify_segments`.
    """
    import torch.distributed as dist

    out = []
    name = type(wrapper).__name__
    if hasattr(wrapper, "fp32_partitioned_groups_flat"):  # ZeRO-3
        for sg, flat in enumerate(wrapper.fp32_partitioned_groups_flat):
            params = wrapper.fp16_groups[sg]
            group = (wrapper._get_sub_group_process_group(sg) if hasattr(wrapper, "sub_group_process_groups")
                     else wrapper.dp_process_group)
            rank = dist.get_rank(group=group)
            segs, srcs, off = [], [], 0
            for p in params:
                P = int(p.ds_tensor.ds_numel)
                lo = rank * P
                n = max(0, min(P, int(p.ds_numel) - lo))
                segs.append(Segment(key_of(p), names.get(id(p), key_of(p)), tuple(int(s) for s in p.ds_shape),
                                    min(lo, int(p.ds_numel)), off, n))
                srcs.append(p.ds_tensor)
                off += P
            if off != flat.numel():
                raise LayoutError(f"{name} sub-group {sg}: partitions sum to {off} elements but the flat buffer has "
                                  f"{flat.numel()}")
            out.append((flat, segs, srcs, group, f"{name} sub-group {sg}"))
        return out
    if hasattr(wrapper, "single_partition_of_fp32_groups"):  # ZeRO-1/2
        for i, flat in enumerate(wrapper.single_partition_of_fp32_groups):
            group = wrapper.real_dp_process_group[i]
            rank = dist.get_rank(group=group)
            ps = int(wrapper.partition_size[i])
            params = wrapper.round_robin_bit16_groups[i]
            offsets = wrapper.round_robin_bit16_offsets[i]
            metas = wrapper.round_robin_bit16_meta[i]
            out.append(_cut(flat, params, offsets, [m.numel() for m in metas], rank, ps, key_of, names, group,
                            f"{name} group {i}"))
        return out
    if hasattr(wrapper, "fp32_groups_flat_partition"):  # BF16_Optimizer
        for i, flat in enumerate(wrapper.fp32_groups_flat_partition):
            group = wrapper.real_dp_process_group[i]
            rank = dist.get_rank(group=group)
            params = wrapper.bf16_groups[i]
            ps = int(wrapper.bf16_groups_flat[i].numel() // dist.get_world_size(group=group))
            offs, o = [], 0
            for p in params:
                offs.append(o)
                o += p.numel()
            out.append(_cut(flat, params, offs, [p.numel() for p in params], rank, ps, key_of, names, group,
                            f"{name} group {i}"))
        return out
    raise LayoutError(f"unsupported DeepSpeed optimizer wrapper {name}: Gefen knows ZeRO-1/2 "
                      "(DeepSpeedZeroOptimizer), BF16_Optimizer and ZeRO-3 (DeepSpeedZeroOptimizer_Stage3)")


def _cut(flat, params, offsets, numels, rank, ps, key_of, names, group, where):
    lo_r, hi_r = rank * ps, (rank + 1) * ps
    segs, srcs = [], []
    for p, o, n in zip(params, offsets, numels):
        lo, hi = max(o, lo_r), min(o + n, hi_r)
        if hi <= lo:
            continue
        segs.append(Segment(key_of(p), names.get(id(p), key_of(p)), tuple(int(s) for s in p.shape), lo - o,
                            lo - lo_r, hi - lo))
        srcs.append(p)
    return flat, segs, srcs, group, where


# ---------------------------------------------------------------------------- config + engine
def _load_config(config) -> Dict[str, Any]:
    if config is None:
        return {}
    if isinstance(config, dict):
        return config
    with open(config) as f:
        return json.load(f)


def check_config(config) -> None:
    """Refuse DeepSpeed settings that would corrupt or bypass Gefen's state (clear errors)."""
    cfg = _load_config(config)
    zero = cfg.get("zero_optimization", {}) or {}
    stage = int(zero.get("stage", 0))
    if zero.get("elastic_checkpoint"):
        raise ValueError("gefen_dist: zero_optimization.elastic_checkpoint is not supported: DeepSpeed's elastic "
                         "save trims and re-pads every optimizer state tensor as if it were per-element, which "
                         "corrupts Gefen's per-block state. Use the default (rigid) checkpoints, and "
                         "`gefen-dist ds-to-universal` + gds.load_universal to change the number of ranks.")
    off = zero.get("offload_optimizer") or {}
    dev = str(off.get("device", "none")).lower()
    if dev == "nvme":
        raise ValueError("gefen_dist: offload_optimizer.device=nvme is not supported (DeepSpeed's NVMe swapper "
                         "assumes per-element state of the parameter's size and dtype); use device=cpu.")
    if stage == 3 and dev == "cpu" and float(off.get("ratio", 1.0)) < 1.0:
        raise ValueError("gefen_dist: ZeRO-3 partial optimizer offload (offload_optimizer.ratio < 1) steps the "
                         "GPU-resident sub-groups with a hidden torch AdamW (and asserts DeepSpeedCPUAdam); "
                         "use ratio 1.0.")
    if stage == 3 and zero.get("bf16_master_weights_and_grads"):
        raise ValueError("gefen_dist: ZeRO-3 bf16_master_weights_and_grads requires DeepSpeedCPUAdam")
    opt = cfg.get("optimizer")
    if (opt and str(opt.get("type", "")).lower() == "gefen" and stage > 0
            and not cfg.get("zero_allow_untested_optimizer")):
        raise ValueError('gefen_dist: set "zero_allow_untested_optimizer": true in the DeepSpeed config to use Gefen '
                         "with ZeRO (DeepSpeed checks optimizers against a fixed list)")


def check_wrapper(wrapper) -> None:
    """The refusals of :func:`check_config`, read from a built ZeRO wrapper (the stock-engine path)."""
    if getattr(wrapper, "elastic_checkpoint", False):
        check_config({"zero_optimization": {"elastic_checkpoint": True}})
    if getattr(wrapper, "swap_optimizer", False):
        check_config({"zero_optimization": {"offload_optimizer": {"device": "nvme"}}})
    ratio = getattr(wrapper, "partial_offload", 1.0)
    if hasattr(wrapper, "fp32_partitioned_groups_flat") and ratio is not None and float(ratio) < 1.0:
        check_config({"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu", "ratio": ratio}}})


def register() -> None:
    """Make ``"optimizer": {"type": "Gefen"}`` resolve to this optimizer (DeepSpeed falls back to
    ``getattr(torch.optim, type)`` for names it does not know; the lookup is case-sensitive)."""
    torch.optim.Gefen = Gefen
    torch.optim.gefen = Gefen
    _install_engine_hook()


# ---------------------------------------------------------------------------- checkpoints across world sizes
class CheckpointWorldSizeError(RuntimeError):
    """A rigid Gefen DeepSpeed checkpoint was loaded at another data-parallel world size."""


def _install_engine_hook() -> None:
    """Route ``DeepSpeedEngine._load_zero_checkpoint`` of engines whose optimizer is Gefen through
    Gefen: universal checkpoints are requantized by :mod:`gefen_dist.integrations.ds_universal`, and
    a rigid checkpoint of another world size raises :class:`CheckpointWorldSizeError` (naming both
    sizes and the converter). Engines with any other optimizer are untouched. Installed only once
    DeepSpeed's engine module is imported (never imports DeepSpeed itself)."""
    mod = sys.modules.get("deepspeed.runtime.engine")
    eng = getattr(mod, "DeepSpeedEngine", None) if mod is not None else None
    if eng is None:
        return
    orig = getattr(eng, "_load_zero_checkpoint", None)
    if orig is None:
        logger.warning("this DeepSpeed has no DeepSpeedEngine._load_zero_checkpoint: Gefen's universal-checkpoint "
                       "loading and world-size check are not installed")
        return
    if getattr(orig, "_gefen_hook", False):
        return

    def _load_zero_checkpoint(self, load_dir, tag, load_optimizer_states=True):
        if not isinstance(getattr(self, "basic_optimizer", None), Gefen):
            return orig(self, load_dir, tag, load_optimizer_states=load_optimizer_states)
        if self.load_universal_checkpoint():
            from .ds_universal_load import load_into_engine

            load_into_engine(self, os.path.join(load_dir, str(tag)), load_optimizer_states=load_optimizer_states)
            return True
        saved = getattr(self, "loaded_checkpoint_dp_world_size", None)
        now = getattr(self, "seq_dp_world_size", None) or getattr(self, "dp_world_size", None)
        if load_optimizer_states and saved is not None and now is not None and int(saved) != int(now):
            raise CheckpointWorldSizeError(
                f"the DeepSpeed checkpoint {os.path.join(str(load_dir), str(tag))!r} was saved at data-parallel world "
                f"size {saved}, but this Gefen job runs at world size {now}. Gefen's state in a DeepSpeed checkpoint "
                "is laid out per rank and loads only at the world size it was saved at. Convert it once with "
                f"`gefen-dist ds-to-universal {load_dir} OUT_DIR --tag {tag}` and load OUT_DIR with "
                "gefen_dist.integrations.deepspeed.load_universal(engine, OUT_DIR) (or set "
                '"checkpoint": {"load_universal": true} and call engine.load_checkpoint on it).')
        return orig(self, load_dir, tag, load_optimizer_states=load_optimizer_states)

    _load_zero_checkpoint._gefen_hook = True  # type: ignore[attr-defined]
    _load_zero_checkpoint.__wrapped__ = orig  # type: ignore[attr-defined]
    eng._load_zero_checkpoint = _load_zero_checkpoint


def load_universal(engine, path: str, tag: Optional[str] = None, load_optimizer_states: bool = True,
                   load_lr_scheduler_states: bool = True):
    """Load a universal checkpoint into a Gefen DeepSpeed engine at its current world size.

    ``path`` is the folder written by ``gefen-dist ds-to-universal`` (or DeepSpeed's
    ``ds_to_universal`` for an AdamW checkpoint: Gefen is then warm-started from ``exp_avg`` and
    ``exp_avg_sq``), or its parent with ``tag`` / a ``latest_universal`` file. Goes through
    ``engine.load_checkpoint`` with DeepSpeed's ``load_universal_checkpoint`` switched on for the
    call, so the lr scheduler, global step and client state are restored by DeepSpeed and the
    weights and optimizer state by Gefen (:func:`gefen_dist.integrations.ds_universal_load.load_into_engine`).
    Call it on every rank. Returns ``engine.load_checkpoint``'s ``(load_path, client_state)``.
    """
    if not isinstance(getattr(engine, "basic_optimizer", None), Gefen):
        raise TypeError(f"load_universal needs an engine whose optimizer is gefen_dist.integrations.deepspeed.Gefen, "
                        f"got {type(getattr(engine, 'basic_optimizer', None)).__name__}")
    _install_engine_hook()
    load_dir = os.path.abspath(path)
    if tag is None and os.path.isdir(os.path.join(load_dir, "zero")):
        load_dir, tag = os.path.split(load_dir)
    if tag is None and not os.path.isfile(os.path.join(load_dir, "latest_universal")):
        raise FileNotFoundError(f"{path!r} is neither a universal checkpoint folder (no zero/ inside) nor a folder "
                                "with a latest_universal file; pass tag=")
    cfg = engine._config
    old = cfg.load_universal_checkpoint
    cfg.load_universal_checkpoint = True
    try:
        return engine.load_checkpoint(load_dir, tag=tag, load_optimizer_states=load_optimizer_states,
                                      load_lr_scheduler_states=load_lr_scheduler_states)
    finally:
        cfg.load_universal_checkpoint = old


def initialize(args=None, model=None, optimizer=None, model_parameters=None, config=None, config_params=None,
               **kwargs):
    """``deepspeed.initialize`` with Gefen: checks the config, builds the engine, attaches the layout.

    ``optimizer`` may be a :class:`Gefen` (or ``gefen_dist.Gefen``, upgraded in place), or None to build
    it from the config's ``"optimizer": {"type": "Gefen", "params": {...}}`` block.
    Returns DeepSpeed's ``(engine, optimizer, dataloader, lr_scheduler)``.
    """
    import deepspeed

    register()
    import deepspeed.runtime.engine  # noqa: F401

    _install_engine_hook()
    if config is None and config_params is not None:
        config = config_params
    if config is None and args is not None and getattr(args, "deepspeed_config", None):
        config = args.deepspeed_config
    check_config(config)
    if isinstance(optimizer, _opt_mod.Gefen) and not isinstance(optimizer, Gefen):
        raise TypeError("pass gefen_dist.integrations.deepspeed.Gefen (the DeepSpeed-aware subclass) rather than "
                        "gefen_dist.Gefen, or omit optimizer= and configure it in the JSON")
    if model_parameters is None and model is not None:
        model_parameters = [p for p in model.parameters() if p.requires_grad]
    engine, opt, loader, sched = deepspeed.initialize(args=args, model=model, optimizer=optimizer,
                                                      model_parameters=model_parameters, config=config, **kwargs)
    basic = getattr(engine, "basic_optimizer", None)
    if isinstance(basic, Gefen):
        wrapper = engine.optimizer
        if wrapper is not basic and any(hasattr(wrapper, a) for a in _WRAPPER_ATTRS):
            basic.attach_deepspeed(wrapper, engine.module)
    return engine, opt, loader, sched


def extension_locks(root: Optional[str] = None) -> List[Tuple[str, float]]:
    """The ``lock`` files of torch's JIT extension builds under ``root`` (default: where torch
    builds, ``$TORCH_EXTENSIONS_DIR`` or ``~/.cache/torch_extensions``), with their age in seconds.

    DeepSpeed builds its ops this way on first use (on CPU, ``deepspeed_shm_comm`` at every
    ``init_distributed``), and torch's ``FileBaton`` waits *forever* for a ``lock`` file that a
    killed build left behind: every later DeepSpeed launch on the machine hangs without a word.
    """
    import glob
    import time

    if root is None:  # torch builds in $TORCH_EXTENSIONS_DIR/<op>, else <default root>/py311_cpu/<op>
        from torch.utils.cpp_extension import get_default_build_root

        root = os.environ.get("TORCH_EXTENSIONS_DIR") or get_default_build_root()
    now, out = time.time(), []
    for path in sorted(glob.glob(os.path.join(root, "*", "lock")) + glob.glob(os.path.join(root, "*", "*", "lock"))):
        try:
            out.append((path, now - os.path.getmtime(path)))
        except OSError:  # released between glob and stat
            pass
    return out


def warn_stale_extension_locks(max_age_s: float = 600.0, root: Optional[str] = None) -> List[str]:
    """Log a warning, with the fix, for each extension-build ``lock`` older than ``max_age_s``
    (a build of DeepSpeed's CPU ops takes well under a minute; such a lock is almost surely
    left by a killed process). Called once when this module is imported; returns the paths."""
    stale = [(p, age) for p, age in extension_locks(root) if age > max_age_s]
    for path, age in stale:
        logger.warning("torch extension build lock %s is %.0f minutes old: DeepSpeed will wait on it forever "
                       "(it builds its ops at init_distributed). If no build is running, a killed one left it: "
                       "remove it with `rm %s`", path, age / 60, path)
    return [p for p, _ in stale]


register()
try:
    warn_stale_extension_locks()
except Exception:  # pragma: no cover - a diagnostic must never break the import
    logger.debug("could not check torch extension locks", exc_info=True)
