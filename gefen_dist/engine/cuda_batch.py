"""The optimizer's multi-tensor CUDA step: a few kernel launches per step for the whole model.

Stepping tensor by tensor costs a kernel launch or several, and some Python, per tensor: on a GPU
that overhead, not memory traffic, sets the step time (GPT-2 small on an H200: 27 ms per step
against 1.4 ms for torch's fused AdamW, ``benchmarks/gpu_step.py``). :class:`CudaBatch` steps the
same tensors with the same arithmetic in

* one column-sum launch per gradient dtype plus one reduction (factored tensors' column
  statistics, :class:`~gefen_dist.kernels.triton_step.ColumnSums`);
* ``torch._foreach_norm`` over the other gradients and a single host synchronisation for the
  non-finite and overflow checks (a step that fails them is handed back to the per-tensor path,
  which raises or skips with the tensor's name, exactly as before);
* two foreach operations for the ``v_col`` EMAs, one launch for every factored tensor's column
  factors ``sqrt(v_col / mean(v_col))``
  (:class:`~gefen_dist.kernels.triton_step.ColumnFactors`), one launch per (param group, mode,
  dtype, chunk configuration) for the quantized tensors
  (:class:`~gefen_dist.kernels.triton_step.MultiStep`), and
  :func:`~gefen_dist.core.step.adamw_foreach_` for the exact ones;
* for ``second_moment="nibbles"`` (D20) instead of the column factors and ``MultiStep``: its column
  ratios before and after the ``v_col`` EMAs, taken by shape (:class:`~gefen_dist.engine.column_stats.ColumnRatios`),
  and one launch per (param group, dtype, tile) of its kernel (:class:`~gefen_dist.kernels.triton_nibbles.NibbleStep`;
  on CPU :class:`~gefen_dist.kernels.cpu_multi.NibbleStep`, one native call).

On CPU (one process or several ranks) the same batch steps the tensors that the per-tensor path would give
the native kernel, with that kernel's multi-tensor entry points (:mod:`gefen_dist.kernels.cpu_multi`:
one native call per launch group and one for the column sums, bitwise the per-tensor calls), so a
CPU step does not pay ~0.2 ms of Python per tensor; its fallbacks log at DEBUG only.

A batch is built for a fixed set of CUDA tensors of one device (plain, or FSDP2/HSDP DTensors
sharded by whole rows) whose state exists and is learned, and reused while the parameters, their
storage and their state dicts stay the same; tensors whose step counts differ (one that missed
steps) get their own launches. In a single process, parameters on several GPUs get one batch per
GPU (all checked before any steps), and a quantized tensor the batch cannot take (not contiguous,
neither float32 nor bfloat16, on the CPU, shared with a period other than 1 or its scale block) is
stepped by the per-tensor path beside the batches, logged once (INFO) with the reason
(:meth:`CudaBatch.split`). Otherwise (the first step, a CPU model of several ranks, those cases when several ranks
take part, gradients of another dtype or layout) the per-tensor path takes the whole step, and
where that is not the expected path a WARNING names the tensor and the fix, once per reason. Sharded tensors take the per-tensor path's
collectives in the same order (a fixed-size summary of the non-finite check, the per-tensor flags
only when some rank raised one, one SUM of the column statistics; replicas that must not count
twice contribute zeros), so ranks on either path stay in step. Results equal the per-tensor Triton
path's bitwise except the column sums, which are added in another (fixed) order: float64 sums, so
the float32 column statistics agree except in rare last-bit cases (the tests see none).
"""
from __future__ import annotations

import logging
from typing import Dict, List, Optional, Tuple

import torch

from ..core.step import (adamw_foreach_, adamw_hyperparameters, col_blocks_of, ema_foreach_, hyperparameters,
                         row_block_args)
from .column_stats import ColumnRatios, ColumnTable
from .device_step import DeviceStep
from .layout import global_shape, is_dtensor, local_tensor, piece_of
from .nonfinite import any_overflow, device_flags
from .state import MODE_EXACT, MODE_FACTORED, SPAN_MODES, nibbles_in, step_of

logger = logging.getLogger(__name__)

__all__ = ["CudaBatch"]

# device types a batch is built for (tests add "cpu" to run the batch through the Triton interpreter)
_DEVICE_TYPES = ("cuda",)
# CPU tensors that the native kernel steps are batched too (kernels/cpu_multi.py)
_NATIVE_CPU = True


def _native_cpu() -> bool:
    """Whether CPU tensors get a batch of the native kernels (not when the CPU is one of
    ``_DEVICE_TYPES``: the tests' way of running the Triton batch on CPU tensors). With several
    ranks too (since 2026-12-05): the batch enters the per-tensor path's collectives in the same order
    (tests/test_distributed.py, tests/test_fsdp2.py run DDP and FSDP2 CPU jobs through it)."""
    if not _NATIVE_CPU or "cpu" in _DEVICE_TYPES:
        return False
    from ..kernels import cpu_multi

    return cpu_multi.available()


def _kernels(device: torch.device):
    """The module whose ``StepItem``, ``MultiStep``, ``ColumnSums`` and ``ColumnFactors`` step a
    batch on ``device``: the native CPU kernel's for CPU tensors the native kernel steps, else the
    Triton kernels' (CUDA, or CPU tensors through the interpreter in the tests)."""
    if device.type == "cpu" and "cpu" not in _DEVICE_TYPES:
        from ..kernels import cpu_multi

        return cpu_multi
    from ..kernels import triton_step

    return triton_step


def _key(opt, entries) -> tuple:
    state = opt.state
    return tuple((id(p), local_tensor(p).data_ptr(), id(state.get(p))) for _, p in entries)


def _once(opt, attr: str, why: str) -> bool:
    """True the first time this optimizer meets reason ``why`` under ``attr`` (its set of reasons)."""
    seen = opt.__dict__.setdefault(attr, set())
    if why in seen:
        return False
    seen.add(why)
    return True


def _fallback(opt, why: str, native_cpu: bool = False) -> None:
    """Log, once per optimizer and reason, why the multi-tensor step is not taken (nothing for the
    expected cases: ``why`` empty; DEBUG for a native CPU batch, whose per-tensor path is the
    CPU's usual one)."""
    if why and native_cpu:
        logger.debug("Gefen: the multi-tensor CPU step is not used: %s", why)
    elif why and _once(opt, "_cuda_fallbacks", why):
        logger.warning("Gefen: the multi-tensor CUDA step is not used: %s. Every tensor is stepped on its own "
                       "instead (same results, several times slower on a GPU); logged once per reason.", why)


def quantized_layout_problem(name: str, t: torch.Tensor) -> str:
    """Why a multi-tensor batch (this one, ZeroGefen's) cannot step quantized parameter ``t`` named
    ``name`` (its kernels read contiguous float32 or bfloat16 tensors), naming the fix; "" when it can."""
    if t.dtype not in (torch.float32, torch.bfloat16):
        return (f"parameter {name!r} has dtype {t.dtype}; the batch steps float32 and bfloat16 "
                "parameters (keep fp16 weights in an fp32 master copy, or use bf16)")
    if not t.is_contiguous():
        return (f"parameter {name!r} (shape {tuple(t.shape)}, stride {tuple(t.stride())}) is not "
                "contiguous; make it contiguous (e.g. param.data = param.data.contiguous()) before "
                "building the optimizer")
    return ""


def _cannot_take(opt, group, p, loc, mode, st, types, name) -> str:
    """Why the batch cannot take parameter ``p`` (local tensor ``loc``), or "" when it can (exact
    tensors: any layout and dtype on a batched device)."""
    if mode != MODE_EXACT and loc.device.type == "cpu" and "cpu" in types and "cpu" not in _DEVICE_TYPES:
        impl = opt._impl(loc, p, group).name
        if impl != "cpu":
            return (f"parameter {name(p)!r} ({loc.dtype}) takes the {impl} implementation, not the native CPU "
                    "kernel (float32 or bfloat16 parameters take the kernel)")
    if loc.device.type not in types:
        return f"parameter {name(p)!r} is on {loc.device}, the others on CUDA"
    if mode == MODE_EXACT:
        return ""
    why = quantized_layout_problem(name(p), loc)
    if why:
        return why
    if mode != MODE_FACTORED and int(st["period"]) not in (1, int(st["scale_block"])):
        return (f"parameter {name(p)!r} has period {int(st['period'])} and scale block "
                f"{int(st['scale_block'])} (shared mode): the batch steps shared tensors whose period is "
                "1 or the scale block")
    return ""


class CudaBatch:
    """Tables and launch groups for one optimizer's set of tensors (see the module docstring)."""

    def __init__(self, key: tuple, device: torch.device, entries, opt):
        _tri = _kernels(device)
        self.key, self.device = key, device
        self.native_cpu = _tri.__name__.endswith("cpu_multi")
        self.entries = entries
        comm = opt._comm
        self.sharded = comm.world_size > 1 and any(is_dtensor(p) for _, p in entries)
        # one launch group per (param group, step count): the bias corrections are per step count, and
        # every tensor of a batch advances by one per step, so the partition stays valid (a tensor
        # that missed steps, e.g. an expert without tokens, does not send the model per tensor)
        groups: Dict[tuple, dict] = {}
        self.fact = []  # entry index of each factored tensor, in the column table's order
        pieces = {e: piece_of(p, comm.rank, comm.world_size > 1) for e, (_, p) in enumerate(entries)
                  if opt._mode(p) != MODE_EXACT}
        cols, colb, fpos = [], [], {}  # fpos: a factored entry's (position in the table, row-block arguments)
        for e, pc in pieces.items():
            p = entries[e][1]
            if opt._mode(p) == MODE_FACTORED:
                v_col, rows = opt.state[p]["v_col"], global_shape(p)[0]
                S, G = v_col.shape[-1], max(1, v_col.numel() // v_col.shape[-1])
                rkw = row_block_args(v_col, rows, pc.start)
                # replicas that must not add to global sums a second time (HSDP) contribute zeros
                cols.append((v_col, (pc.local.numel() // S, S, pc.start // S, rkw.get("row_block", 1), G,
                                     pc.local.dtype), rows // G, pc.contributes or not self.sharded))
                colb.append(col_blocks_of(local_tensor(opt.state[p]["v_row"])))  # column blocks (D21)
                fpos[e] = (len(self.fact), rkw)
                self.fact.append(e)
        # the column sums and the column factors sqrt(v_col / mean(v_col)) of every factored tensor (none for
        # "nibbles", D20, whose step reads the column ratios around the EMA: _nibble_group)
        self.nibbles = nibbles_in(opt.param_groups)
        self.cols = ColumnTable(_tri, cols, device, factored=[not self.nibbles] * len(cols),
                                col_blocks=colb) if cols else None
        for e, (group, p) in enumerate(entries):
            st = opt.state[p]
            gi = groups.setdefault((id(group), step_of(st)), dict(group=group, items=[], item_entries=[], exact=[],
                                                                  vcols=[], vcol_parts=[], nib=[]))
            mode = opt._mode(p)
            if mode == MODE_EXACT:
                gi["exact"].append(e)
                continue
            pc = pieces[e]
            param = pc.local
            if mode == MODE_FACTORED and self.nibbles:
                gi["nib"].append((e, pc, fpos[e][0]))
                gi["item_entries"].append(e)
                continue
            if mode == MODE_FACTORED:
                k, rkw = fpos[e]
                v_col = st["v_col"]
                item = _tri.StepItem(param.view(-1), local_tensor(st["idx"]).view(-1),
                                     local_tensor(st["scale"]).view(-1), local_tensor(st["v_row"]).view(-1),
                                     self.cols.factor_views[k], v_col.shape[-1], int(st["scale_block"]), 2,
                                     rkw.get("row0", 0), rkw.get("row_block", 1), colb[k])
                gi["vcols"].append(v_col)
                gi["vcol_parts"].append(self.cols.views[k])
            else:
                P, B = int(st["period"]), int(st["scale_block"])
                item = _tri.StepItem(param.view(-1), local_tensor(st["idx"]).view(-1),
                                     local_tensor(st["scale"]).view(-1), local_tensor(st["v"]).view(-1), None,
                                     B, B, 1 if P == 1 else 0)
            gi["items"].append(item)
            gi["item_entries"].append(e)
        self.groups = list(groups.values())
        for gi in self.groups:
            gi["multi"] = _tri.MultiStep(gi["items"], device) if gi["items"] else None
            gi["nibs"] = self._nibble_group(opt, gi, _tri, device) if gi["nib"] else None
        self.others = [e for e in range(len(entries)) if e not in fpos]
        self._step_tables(opt, entries)
        # capturable=True: a step without host synchronisation (engine/device_step.py); CUDA batches only
        self.dstep = DeviceStep(self, opt) if getattr(opt, "capturable", False) and not self.native_cpu else None
        self.codebook_state = next((opt.state[entries[e][1]] for gi in self.groups for e in gi["item_entries"]), None)
        logger.debug("gefen_dist: CUDA batch for %d tensors: %d quantized launches, %d factored%s", len(entries),
                     sum(gi["multi"].launches for gi in self.groups if gi["multi"]), len(self.fact),
                     ", sharded" if self.sharded else "")

    def _nibble_group(self, opt, gi, kernels, device):
        """A launch group's ``second_moment="nibbles"`` tensors (D20): their column ratios around the
        ``v_col`` EMAs and one multi-tensor step, with the per-tensor path's arguments
        (:meth:`~gefen_dist.engine.tensor_step.TensorStep._step_nibbles`): each piece's first global row,
        rows per row block, its place in the optimizer (the random numbers' key)."""
        vcols = [opt.state[self.entries[e][1]]["v_col"] for e, _, _ in gi["nib"]]
        ratios = ColumnRatios(vcols, device)
        items = []
        for j, (e, pc, k) in enumerate(gi["nib"]):
            p = self.entries[e][1]
            st = opt.state[p]
            S, G = vcols[j].shape[-1], vcols[j].shape[0] if vcols[j].dim() > 1 else 1
            row0, n = pc.start // S, pc.local.numel()
            rb = global_shape(p)[0] // G if G > 1 else row0 + n // S + 1  # one block: every row in block 0
            items.append(kernels.NibbleItem(pc.local.view(-1), local_tensor(st["idx"]).view(-1),
                                            local_tensor(st["scale"]).view(-1), local_tensor(st["v_row"]).view(-1),
                                            ratios.old[j], ratios.new[j], S, int(st["scale_block"]), row0, rb,
                                            opt._tensor_index(p)))
        return dict(ratios=ratios, step=kernels.NibbleStep(items, device),
                    means=[self.cols.views[k] for _, _, k in gi["nib"]], entries=[e for e, _, _ in gi["nib"]])

    def _step_tables(self, opt, entries) -> None:
        """What a step reads after the flags, built once so that the host work there stays a fixed
        number of operations (the column means' views, ``gi["vcol_parts"]``, are the column table's):
        each group's exact tensors and their AdamW state (the grads are the step's), each group's
        members (their step counts). The state dicts are part of the key, so these stay valid while
        the batch does."""
        self._exact_entry = [opt._mode(p) == MODE_EXACT for _, p in entries]
        for gi in self.groups:
            ps = [entries[e][1] for e in gi["exact"]]
            gi["exact_state"] = ([local_tensor(p) for p in ps], [local_tensor(opt.state[p]["exp_avg"]) for p in ps],
                                 [local_tensor(opt.state[p]["exp_avg_sq"]) for p in ps])
            gi["members"] = [entries[e][1] for e in gi["item_entries"] + gi["exact"]]

    # ------------------------------------------------------------------ building
    @staticmethod
    def split(opt, entries) -> Tuple[Optional[List[Tuple[torch.device, list]]], list, str]:
        """How the batch takes ``entries`` (``opt.fused`` not False): ``(groups, beside, "")``, the
        ``(device, entries)`` of each batch and the entries the per-tensor path steps beside them, or
        ``(None, [], reason)`` when the per-tensor path must take the whole step (``reason`` empty
        where that is the expected path: state still to learn, no CUDA tensor; else it names the
        tensor and the fix).

        Beside the batches: tensors kept per block of rows (D16), and in a
        single process the quantized tensors the batch cannot take (a parameter that is not contiguous, not float32 or
        bfloat16, on a device of another type, or shared with a period other than 1 or its scale
        block), each logged once (INFO) with the reason; a single process with CUDA parameters on
        several devices gets one batch per device. Exact (AdamW) tensors are stepped by foreach
        operations whatever their layout and dtype. When several ranks take part (their
        collectives must match) those cases send the whole step to the per-tensor path instead,
        with one WARNING per reason."""
        single = opt._comm.world_size == 1
        names = None

        def name(p):
            nonlocal names
            names = names or opt._names()
            return names.get(id(p), "?")

        types = _DEVICE_TYPES + (("cpu",) if _native_cpu() else ())
        devices = {local_tensor(p).device for _, p in entries if opt._mode(p) not in SPAN_MODES}
        if not any(d.type in types for d in devices):
            return None, [], ""
        native = "cpu" in types and "cpu" not in _DEVICE_TYPES and all(d.type == "cpu" for d in devices)
        by_dev: Dict[torch.device, list] = {}
        beside, reasons, cb = [], [], None
        for group, p in entries:
            mode = opt._mode(p)
            if mode in SPAN_MODES:
                beside.append((group, p))
                continue
            st = opt.state.get(p)
            if not st or st.get("learned", 1) == 0:
                return None, [], ""
            loc = local_tensor(p)
            why = _cannot_take(opt, group, p, loc, mode, st, types, name)
            if not why and mode != MODE_EXACT:
                c = st["codebook"]
                if cb is None:
                    cb = c
                elif c is not cb and not torch.equal(c, cb):
                    return None, [], f"parameter {name(p)!r} holds another codebook than the rest (a partial load?)"
            if why:
                if not single:  # (on CPU the per-tensor path is the usual one: DEBUG, not a warning)
                    if native:
                        logger.debug("Gefen: the multi-tensor CPU step is not used: %s", why)
                    return None, [], "" if native else why
                beside.append((group, p))
                reasons.append(why)
                continue
            by_dev.setdefault(loc.device, []).append((group, p))
        if not by_dev:  # nothing left to batch (on CPU the per-tensor path is the usual one: no warning)
            return None, [], reasons[0] if reasons and not native else ""
        if len(by_dev) > 1 and not single:
            return None, [], (f"parameters on {', '.join(map(str, by_dev))} in a job of several ranks (one batch per "
                              "device in a single process only)")
        for why in reasons:  # (DEBUG on CPU, where stepping on its own is the per-tensor path's usual cost)
            if _once(opt, "_cuda_beside", why):
                logger.log(logging.DEBUG if native else logging.INFO, "Gefen: a tensor is stepped on its own beside "
                           "the multi-tensor %s step: %s (the other tensors stay batched); logged once per reason.",
                           "CPU" if native else "CUDA", why)
        return list(by_dev.items()), beside, ""

    @classmethod
    def plan(cls, opt, entries) -> Optional[Tuple[list, list]]:
        """``(batches, beside)`` for this step's ``entries`` (:meth:`split`; the last plan, and each
        device's batch, reused while the tensors, their storage and their state dicts stay the same, so
        a step does not re-examine every tensor), or None when the per-tensor path must take the step."""
        if opt.fused is False or not entries or any(g.get("fused") is False for g in opt.param_groups):
            return None
        key = _key(opt, entries)
        last = opt.__dict__.get("_cuda_plan")
        if last is not None and last[0] == key and (not last[2] or _native_cpu()):
            return last[1]  # (a native CPU batch only while the library stays enabled: GEFEN_DIST_NO_NATIVE)
        opt._cuda_plan = None
        groups, beside, why = cls.split(opt, entries)
        if groups is None:
            opt._cuda_batch, opt._cuda_batches = None, []
            _fallback(opt, why)
            return None
        cache = {b.key: b for b in opt.__dict__.get("_cuda_batches") or []}
        batches = []
        for dev, es in groups:
            key = _key(opt, es)
            batch = cache.get(key)
            if batch is None:
                if not _kernels(dev).available(dev if dev.type == "cuda" else None):
                    return None
                batch = cls(key, dev, es, opt)
            batches.append(batch)
        opt._cuda_batches = batches
        opt._cuda_batch = batches[0]  # the (first) device's batch: what tests and benchmarks read
        opt._cuda_plan = (key, (batches, beside), any(b.native_cpu for b in batches))
        return batches, beside

    # ------------------------------------------------------------------ stepping
    def prepare(self, opt):
        """A step's checks and statistics, which change nothing: None, with no collective entered,
        when the per-tensor path must take the step (a gradient of another dtype or layout), True
        when it is skipped (``nonfinite="skip"``; "raise" raised), else what :meth:`apply` needs; so
        several batches (one per device) are all checked before any of them changes a tensor.
        Collectives, when the tensors are sharded: the same as the per-tensor path's (a fixed-size
        summary of the non-finite check, the per-tensor flags only when some rank has one, one SUM of
        the column statistics)."""
        grads = []
        for (_, p), exact in zip(self.entries, self._exact_entry):
            g = local_tensor(p.grad)
            if g is not None and exact and g.device == self.device:
                grads.append(g)  # foreach operations: any layout and dtype
                continue
            if g is None or g.dtype != local_tensor(p).dtype or not g.is_contiguous() or g.device != self.device:
                _fallback(opt, f"the gradient of {opt._names().get(id(p), '?')!r} is "
                               + ("missing" if g is None else f"{g.dtype}, {'' if g.is_contiguous() else 'non-'}"
                                  f"contiguous, on {g.device}") + f", its parameter {local_tensor(p).dtype} on "
                               f"{self.device} (the batch needs contiguous gradients of the parameter's dtype)",
                          self.native_cpu)
                return None
            grads.append(g)
        cols = self.cols
        buf = cms = None
        if cols is not None:
            buf = cols.column_sums([grads[e] for e in self.fact])
        # (capturable: the verdict stays on the device, DeviceStep.flag below)
        check = opt.nonfinite != "ignore" and self.dstep is None
        if check:
            flags = device_flags(buf, [grads[e] for e in self.others if grads[e].numel()])  # (settled below)
            any_flag = torch.stack(flags).any() if flags else torch.zeros((), dtype=torch.bool, device=self.device)
            if not self.sharded and buf is not None:
                cms = cols.column_means(buf)
                any_flag, inf = torch.stack([any_flag, any_overflow(cms)]).tolist()  # the one sync
            else:
                inf = None
            if opt._nonfinite_agree(self.entries, any_flag, lambda: opt._nonfinite_local(self.entries)):
                return True  # skipped (nonfinite="skip"); "raise" raised
        if buf is not None and cms is None:
            if self.sharded:
                opt._comm.all_reduce_sum_(buf)
            cms = cols.column_means(buf)
            inf = bool(any_overflow(cms)) if check else False
        if self.dstep is not None:
            self.dstep.flag(opt, buf, cms, [grads[e] for e in self.others if grads[e].numel()])
        elif check and buf is not None and inf:
            opt._raise_column_overflow({self.entries[e][1]: c for e, c in zip(self.fact, cols.views)})
        return grads, cms

    def apply(self, opt, prep) -> None:
        """The updates of a step that :meth:`prepare` passed. Host work here is what a GPU waits for
        after the step's synchronisation, so it is kept to a fixed number of operations: one foreach
        increment of every step count, per launch group one step read, two foreach operations for
        the ``v_col`` EMAs (views built once), the launches, and the exact tensors' foreach AdamW on
        lists built once (``research/batch_host_time.py`` measures it)."""
        grads, cms = prep
        state, ds = opt.state, self.dstep
        # every tensor of a launch group has the group's step count (the partition's key)
        if ds is not None:
            ds.advance(self.groups)
        else:
            torch._foreach_add_([state[p]["step"] for gi in self.groups for p in gi["members"]], 1.0)
        if ds is not None:
            ds.keep_vcols()  # (restored after the EMAs on a skipped step)
        for gi in self.groups:
            if gi["vcols"]:
                ema_foreach_(gi["vcols"], gi["vcol_parts"], gi["group"]["betas"][1])
            if gi["nibs"] is not None:  # D20: v_col's EMA between its column ratios (before and after)
                gi["nibs"]["ratios"].run(gi["nibs"]["means"], gi["group"]["betas"][1])
        if ds is not None:
            ds.restore_vcols_if_skipped()
        if self.cols is not None and self.cols.factors is not None:
            self.cols.factors.run()  # the update kernels read the factors of the new v_col
        for gi in self.groups:
            group = gi["group"]
            step = step_of(state[gi["members"][0]]) if ds is None else None
            if gi["multi"] is not None:
                hp = hyperparameters(group, step, opt.bound_updates) if ds is None else ds.scalars(gi, opt)
                cb = local_tensor(self.codebook_state["codebook"])
                gi["multi"].run([grads[e] for e in gi["item_entries"]], cb, **hp)
            if gi["nibs"] is not None:  # D20 (its ratios and v_col's EMA above)
                nb = gi["nibs"]
                hp = hyperparameters(group, step, opt.bound_updates) if ds is None else ds.scalars(gi, opt)
                nb["step"].run([grads[e] for e in nb["entries"]], local_tensor(self.codebook_state["codebook"]),
                               step if ds is None else gi["steps"][0], **hp)
            if gi["exact"] and ds is not None:
                ds.exact(gi, [grads[e] for e in gi["exact"]])
            elif gi["exact"]:  # as the per-tensor path's _update_exact_batched
                ps, ms, vs = gi["exact_state"]
                adamw_foreach_(ps, [grads[e] for e in gi["exact"]], ms, vs, **adamw_hyperparameters(group, step))
