"""ZeRO-1's halves of the Triton step (ZeroGefen on CUDA): the owners' state updates and every rank's
appliers, with the contracts of :class:`gefen_dist.kernels.dispatch.StepImpl` (``quantized_state_``,
``factored_state_``, ``apply_compressed_``, ``apply_factored_``, ``column_factors``).

An owner runs the Triton step itself on a scratch parameter with ``lr = wd = 0`` (the state, ``idx``,
``scale``, ``v``/``v_row``, never depends on the parameter, the learning rate or the column
profile), and hands on what the kernel's parameter update reads: ``sigma`` per block (computed here
with the kernel's float32 operations) or a correctly rounded ``sqrt(v_row)``. The appliers replay the
kernel's update with torch operations in its order (``u = (C[idx] M) sigma``, the bound, ``* lr``,
``p decay - u``; per element for the factored mode ``sigma = (1/bc1) / ((sqrt(v_row) (1/sqrt(bc2)))
col_f + eps)``). Every division is a tensor by a tensor (torch's CUDA division by a scalar multiplies
by its reciprocal, and ``scalar / tensor`` is ``reciprocal * scalar``), so the results are the
kernel's bits: ZeroGefen's replicas equal single-process ``Gefen`` on the Triton path bitwise
(``tests/test_triton_step.py``, through the interpreter). The column factors come from the kernels'
own launch (:class:`~gefen_dist.kernels.triton_multi.ColumnFactors`), whose mean is summed in its
order.

Those torch operations are a dozen launches per range and rank on a GPU. :class:`ApplyMany` applies
every factored and compressed range of a step in one launch per (mode, dtype, tile) instead
(``_apply_multi_kernel``: the step kernel's own update, so the same bits as the torch appliers,
``tests/test_triton_step.py``); ZeroGefen takes it where the exchanged chunks are one buffer and the
parameter is contiguous, and the torch appliers for the rest. :class:`StateMany` likewise runs the
owners' state updates of many ranges in one launch per (mode, dtype, tile) (the multi-tensor step,
:class:`~gefen_dist.kernels.triton_multi.MultiStep`, on scratch parameters), bitwise
:func:`quantized_state_` / :func:`factored_state_` range by range.
"""
from __future__ import annotations

import math
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch

from ..core.apply import apply_compressed as _apply_compressed_eager
from ..core.step import _EAGER_CHUNK_ELEMS, apply_, row_factors
from .triton_kernels import _kernel
from .triton_multi import ColumnFactors, MultiStep, StepItem, multi_launch_options
from .triton_tables import _config, _device_table, _pinned_to, update_scalars
from .state_only import factored_state_only_, state_only_
from .triton_step import quantized_step_, quantized_step_factored_

__all__ = ["quantized_state_", "factored_state_", "apply_compressed_", "apply_factored_", "column_factors",
           "ApplyRange", "ApplyMany", "StateMany"]

_SCRATCH_ELEMS = 1 << 24  # parameter scratch of a state-only call (chunks of whole blocks)


def _f32(x: float) -> float:
    return float(np.float32(x))


def _sqrt_rn(t: torch.Tensor) -> torch.Tensor:
    """The correctly rounded float32 square root (the kernel's ``sqrt_rn``): through float64, whose
    sqrt rounded once more to float32 is exact (torch's float32 sqrt on CPU can be an ulp off)."""
    return t.double().sqrt().float()


def _div(a: float, t: torch.Tensor) -> torch.Tensor:
    """``a / t`` correctly rounded per element (a tensor division, not ``reciprocal(t) * a``)."""
    return torch.full_like(t, a) / t


def _sigma(v: torch.Tensor, eps: float, bc1: float, bc2: float) -> torch.Tensor:
    """``sigma`` per block from the new ``v``, in the kernel's float32 operations."""
    sb = _sqrt_rn(v) / torch.full_like(v, _f32(math.sqrt(bc2))) + _f32(eps)
    return _div(1.0, sb) * _f32(1.0 / bc1)


def quantized_state_(grad, idx, scale, v, codebook, *, beta1, beta2, eps, bc1, bc2, period,
                     scale_block) -> torch.Tensor:
    """The Triton step's state update (``v``, ``idx``, ``scale`` in place, bitwise the full step's)
    without the parameter update, ``period == scale_block``; returns ``sigma`` per block as the kernel
    computes it: ``(1 / (sqrt(v) / sqrt(bc2) + eps)) * (1 / bc1)`` in float32."""
    state_only_(quantized_step_, grad, idx, scale, v, codebook, period=period, scale_block=scale_block,
                hp=dict(beta1=beta1, beta2=beta2, eps=eps, bc1=bc1, bc2=bc2), max_elems=_SCRATCH_ELEMS)
    return _sigma(v, eps, bc1, bc2)


def factored_state_(grad, idx, scale, v_row, codebook, *, slab, beta1, beta2, eps, bc1, bc2,
                    scale_block) -> torch.Tensor:
    """The Triton factored step's row-local state update (``v_row``, ``idx``, ``scale`` in place)
    without the column factor and the parameter update; returns ``sqrt(v_row)`` correctly rounded
    (the kernel's ``sqrt_rn``). Run against a zero column profile with ``lr = wd = 0``, chunk by chunk
    of rows (:mod:`.state_only`)."""
    factored_state_only_(quantized_step_factored_, grad, idx, scale, v_row, codebook, slab=slab,
                         scale_block=scale_block, hp=dict(beta1=beta1, beta2=beta2, eps=eps, bc1=bc1, bc2=bc2),
                         max_elems=_SCRATCH_ELEMS)
    return _sqrt_rn(v_row.reshape(-1))


# The parameter update of the Triton step (``period == scale_block == P``) from its results: the
# kernel's order is the eager step's (``u = (C[idx] M) sigma``, bound, ``* lr``, ``p decay - u``), so
# the reference applier with :func:`quantized_state_`'s ``sigma`` is the kernel's update, bitwise.
apply_compressed_ = _apply_compressed_eager


def apply_factored_(pf, idx, M, rsq, col_f, cb, B: int, slab: int, hp: dict, row0: int = 0,
                    row_block: int = 0, col_blocks: int = 1) -> None:
    """The parameter update of the Triton factored step from its results (the new ``idx`` and scales
    ``M`` per ``B`` elements, ``rsq = sqrt(v_row)`` per row of ``slab`` elements, the column factors
    ``col_f`` of :func:`column_factors`), in the kernel's float32 operations and order. ``col_blocks`` ``K``
    (D21): ``rsq`` per row and block of ``slab / K`` columns, ``col_f`` normalised per block."""
    K = int(col_blocks)
    n = pf.numel()
    lr, wd = hp["lr"], hp["weight_decay"]
    sqrt_bc2 = _f32(math.sqrt(hp["bc2"]))
    isb = float(np.float32(1.0) / np.float32(sqrt_bc2))  # the kernel's div_rn(1, sqrt(bc2))
    eps, inv_bc1 = _f32(hp["eps"]), _f32(1.0 / hp["bc1"])
    rows = n // slab
    rows_per = max(1, _EAGER_CHUNK_ELEMS // slab)
    for r0 in range(0, rows, rows_per):
        r1 = min(rows, r0 + rows_per)
        q = cb.index_select(0, idx[r0 * slab:r1 * slab].int()).view(-1, B)
        a = M[r0 * slab // B:r1 * slab // B].view(-1, 1)
        cf = row_factors(col_f, row0, r0, r1, row_block)
        xr = (rsq[r0 * K:r1 * K].view(r1 - r0, K).repeat_interleave(slab // K, dim=1) if K > 1
              else rsq[r0:r1].unsqueeze(1)) * isb
        sigma = _div(inv_bc1, xr * (col_f.view(1, -1) if K > 1 else cf) + eps)
        apply_(pf[r0 * slab:r1 * slab].view(r1 - r0, slab), (q * a).view(r1 - r0, slab), sigma, lr, wd,
               hp.get("bound"))


def column_factors(v_col: torch.Tensor) -> torch.Tensor:
    """``sqrt(v_col / mean(v_col))`` per row block, by the launch the Triton step uses
    (:class:`~gefen_dist.kernels.triton_multi.ColumnFactors`), so an applier reads the step's bits."""
    return ColumnFactors([v_col], v_col.device).run()[0].view_as(v_col)


# 8 warps on _config's 2048-element tiles (8 elements a thread), with the multi kernel's register ceiling
# stated (ptxas's own choice spilled at 4x512 bfloat16): no spill and at most 188 registers in every
# shipped tile offline for sm_90, where 4 warps take 244-255 registers and spill at 16x128
# (python benchmarks/triton_sm90.py --apply [--apply-warps 4 | --apply-no-ceiling]; tests/test_triton_sm90.py)
_APPLY_WARPS = 8


@dataclass(frozen=True)
class ApplyRange:
    """One range of an :class:`ApplyMany`: elements ``start .. start + nrows * S`` of ``param``
    (contiguous), whose owner's results sit at byte offsets ``offs`` = (indices, scales ``M``,
    ``sqrt(v_row)`` per row or ``sigma`` per block) of the exchanged buffer; ``mode`` 2 (factored:
    rows of ``S`` elements, scale blocks of ``B``, the first row global row ``row0``, row blocks of
    ``row_block`` rows; 0: one column profile) or 0 (compressed: ``S == B`` = the period); ``h``: its
    tensor's index in the per-step tables of :meth:`ApplyMany.run`."""

    param: torch.Tensor
    start: int
    nrows: int
    mode: int
    S: int
    B: int
    row0: int
    row_block: int
    offs: Tuple[int, int, int]
    h: int


class ApplyMany:
    """ZeroGefen's factored and compressed appliers of a step in one launch per (mode, dtype, launch
    configuration) instead of a dozen torch operations per range and rank
    (``_apply_multi_kernel``: the step kernel's parameter update, so each range gets the bits that
    :func:`apply_factored_` / :func:`apply_compressed_` give it). Built once for a fixed layout of the
    exchanged buffer (the ranges' parameters must stay in place); :meth:`run` takes the buffer's
    address, the codebook and each tensor's column factors and hyperparameters."""

    def __init__(self, ranges: Sequence, device: torch.device):
        self.device = torch.device(device)
        self.ranges = [r if isinstance(r, ApplyRange) else ApplyRange(*r) for r in ranges]
        buckets: Dict[tuple, list] = {}
        for r in self.ranges:
            if r.nrows == 0:
                continue
            if r.mode not in (0, 2) or r.S % r.B or (r.mode == 0 and r.S != r.B) or not r.param.is_contiguous():
                raise ValueError(f"ApplyMany: bad range (mode {r.mode}, S {r.S}, B {r.B}, "
                                 f"contiguous {r.param.is_contiguous()})")
            rows, bs, _ = _config(r.B, r.nrows)
            warps = _APPLY_WARPS
            buckets.setdefault((r.mode, r.param.dtype == torch.bfloat16, rows, bs, warps), []).append(r)
        self._launches = []
        for (mode, bf16, rows, bs, warps), members in buckets.items():
            meta, prog = [], []
            for t, r in enumerate(members):
                rb = r.row_block if r.row_block > 0 else r.row0 + r.nrows + 1  # none: every row in block 0
                meta.append([r.param.data_ptr() + r.start * r.param.element_size(), *r.offs, r.nrows, r.S, r.B,
                             r.row0, rb, r.h])
                prog += [[t, i] for i in range(0, r.nrows, rows)]
            self._launches.append(dict(mode=mode, bf16=bf16, rows=rows, bs=bs, warps=warps, nprog=len(prog),
                                       meta=_pinned_to(meta, self.device), prog=_pinned_to(prog, self.device)))
        self._touched = list({id(r.param): r.param for r in self.ranges}.values())

    @property
    def launches(self) -> int:
        return len(self._launches)

    @staticmethod
    def scalars(hp: dict) -> Tuple[float, ...]:
        """A tensor's six scalars for the kernel: the step launch's own (:func:`update_scalars`), with
        sqrt(bc2) replaced by 1 / sqrt(bc2) correctly rounded (what the step kernel's ``div_rn`` gives;
        on the host, since the division costs the applier registers)."""
        sqrt_bc2, *rest = update_scalars(**{k: hp.get(k) for k in ("lr", "eps", "weight_decay", "bc1", "bc2", "bound")})
        return (float(np.float32(1.0) / np.float32(sqrt_bc2)), *rest)

    def run(self, base: int, codebook: torch.Tensor, scalars: Sequence[Sequence[float]],
            col_factors: Sequence[Optional[torch.Tensor]]) -> None:
        """Apply every range: ``base`` is the exchanged buffer's address on the device, ``scalars[h]``
        (:meth:`scalars`) and ``col_factors[h]`` (contiguous float32 ``[S]`` or ``[G, S]``, or None for
        a compressed tensor) those of tensor ``h``."""
        if not self._launches:
            return
        hp = _pinned_float(scalars, self.device)
        cf = _pinned_to([0 if c is None else c.data_ptr() for c in col_factors], self.device)
        cb = _device_table(codebook, self.device).cb
        kern = _kernel("apply")
        ctx = torch.cuda.device(self.device) if self.device.type == "cuda" else nullcontext()
        with ctx:
            for L in self._launches:
                kern[(L["nprog"],)](L["meta"], L["prog"], hp, cf, cb, int(base), MODE=L["mode"], IS_BF16=L["bf16"],
                                    ROWS=L["rows"], BLOCK_SIZE=L["bs"], num_warps=L["warps"], enable_fp_fusion=False,
                                    **multi_launch_options())
        torch.autograd.graph.increment_version(self._touched)


def _pinned_float(rows: Sequence[Sequence[float]], device: torch.device) -> torch.Tensor:
    """A float32 table on ``device`` without a host synchronisation (pinned, non-blocking copy)."""
    t = torch.tensor([x for r in rows for x in r] or [0.0], dtype=torch.float32)
    if device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t


class StateMany:
    """ZeroGefen's owners' state updates of many ranges (:func:`factored_state_` for ``mode`` 2,
    :func:`quantized_state_` for ``mode`` 0) with one launch per (mode, dtype, tile): a
    :class:`~gefen_dist.kernels.triton_multi.MultiStep` whose items are the ranges cut into the
    state-only functions' chunks (:mod:`.state_only`: whole rows or blocks, at most
    ``_SCRATCH_ELEMS`` elements), each on a scratch parameter that every item of its dtype shares
    (run with ``lr = weight_decay = 0``, the kernel writes back the zeros it reads) against a zero
    column profile, so each range's ``idx``, ``scale`` and ``v`` / ``v_row`` are bitwise its own
    launches'. ``ranges[i]`` = (gradient dtype, ``idx``, ``scale``, ``v``, S, B, mode), the state
    being flat views that stay in place; all of one set of hyperparameters (:meth:`run`)."""

    def __init__(self, ranges: Sequence[tuple], device: torch.device):
        self.device = torch.device(device)
        self.ranges = list(ranges)
        self._cuts: List[List[Tuple[int, int]]] = []
        sizes: Dict[torch.dtype, int] = {}
        for dtype, idx, scale, v, S, B, mode in self.ranges:
            if mode not in (0, 2) or S % B or (mode == 0 and S != B) or idx.numel() % S:
                raise ValueError(f"StateMany: bad range (mode {mode}, S {S}, B {B}, numel {idx.numel()})")
            n, chunk = idx.numel(), max(S, (_SCRATCH_ELEMS // S) * S)
            self._cuts.append([(c0, min(n, c0 + chunk)) for c0 in range(0, n, chunk)])
            sizes[dtype] = max(sizes.get(dtype, 1), min(n, chunk))
        scratch = {dt: torch.zeros(n, dtype=dt, device=self.device) for dt, n in sizes.items()}
        zeros = torch.zeros(max([S for *_, S, B, m in self.ranges if m == 2] or [1]), dtype=torch.float32,
                            device=self.device)
        items = [StepItem(scratch[dtype][:c1 - c0], idx[c0:c1], scale[c0 // B:c1 // B], v[c0 // S:c1 // S],
                          zeros[:S] if mode == 2 else None, S, B, mode)
                 for (dtype, idx, scale, v, S, B, mode), cuts in zip(self.ranges, self._cuts) for c0, c1 in cuts]
        self.multi = MultiStep(items, self.device)

    @property
    def launches(self) -> int:
        return self.multi.launches

    def run(self, grads: Sequence[torch.Tensor], codebook: torch.Tensor, *, beta1: float, beta2: float,
            eps: float, bc1: float, bc2: float) -> List[torch.Tensor]:
        """Every range's state update from ``grads[i]`` (flat, contiguous, in the range's dtype);
        returns per range what its applier reads besides ``idx`` and ``scale``: ``sqrt(v_row)``
        (factored) or ``sigma`` per block (compressed), as views of one buffer per mode."""
        gs = [g[c0:c1] for g, cuts in zip(grads, self._cuts) for c0, c1 in cuts]
        self.multi.run(gs, codebook, lr=0.0, beta1=beta1, beta2=beta2, eps=eps, weight_decay=0.0, bc1=bc1, bc2=bc2)
        out: List[Optional[torch.Tensor]] = [None] * len(self.ranges)
        for mode in (0, 2):
            at = [i for i, r in enumerate(self.ranges) if r[6] == mode]
            if not at:
                continue
            v = torch.cat([self.ranges[i][3].reshape(-1) for i in at])
            res = _sqrt_rn(v) if mode == 2 else _sigma(v, eps, bc1, bc2)
            for i, part in zip(at, res.split([self.ranges[i][3].numel() for i in at])):
                out[i] = part
        return out
