"""Host-side tables and choices of the Triton step (:mod:`gefen_dist.kernels.triton_kernels`):
the codebook's device table (the 257-entry codebook and the nearest-codeword lookup table, cached
per codebook tensor and version), the numerics flags torch's kernels use on a device, the launch
configuration of a scale block, the kernels' scalar arguments, argument checks and the int64
tables the multi-tensor launches read."""
from __future__ import annotations

import functools
import math
import threading
import weakref
from collections import OrderedDict
from dataclasses import dataclass
from typing import Optional, Tuple

import numpy as np
import torch

from ..core.step import check_tensor

_TILE_ELEMS = 2048       # elements per program and chunk (ROWS * BLOCK_SIZE)
_MIN_CHUNK = 128         # smallest chunk considered for long blocks
_MAX_CHUNK = 2048
_TABLE_CACHE_SIZE = 64


# --------------------------------------------------------------------------------------
# device tables
# --------------------------------------------------------------------------------------

@dataclass(frozen=True)
class _DeviceTable:
    cb: torch.Tensor    # float32 [257], cb[256] = +inf
    lut: torch.Tensor   # int32 [nb]: lower index (fast) or lower bound of #{C < z} (scan)
    fast: bool
    h: float
    nb: int
    scan_steps: int
    ent: Optional[torch.Tensor] = None  # fast: float32 [nb, 4] per bucket (C[j], C[j+1], flip point, j's bits)

    def kernel_table(self, mode: int) -> torch.Tensor:
        """What the update kernel of ``mode`` reads as ``tab_ptr``: in the two-candidate mode the
        per-bucket entries for the per-element step sizes (modes 1 and 2: elementwise, factored), the
        int32 table for mode 0 (one step size per block: there the entries raised the registers of an
        sm_90 compile from 128-153 to 145-222, costing a CTA per SM, against 0-16 fewer and 4-7% fewer
        instructions in modes 1 and 2; benchmarks/triton_sm90.py); the int32 lower bounds of the scan
        otherwise."""
        return self.ent if self.fast and mode != 0 else self.lut


_tables: "OrderedDict[Tuple[int, str], Tuple[weakref.ref, int, _DeviceTable]]" = OrderedDict()
_by_content: "OrderedDict[Tuple[bytes, str], _DeviceTable]" = OrderedDict()
_tables_lock = threading.Lock()


def _build_device_table(codebook: torch.Tensor, device: torch.device) -> _DeviceTable:
    from gefen_dist.kernels.cpu_tables import codebook_table

    cbf = codebook.detach().to("cpu", torch.float32).contiguous().reshape(-1)
    key = (cbf.numpy().tobytes(), str(device))
    with _tables_lock:
        t = _by_content.get(key)
        if t is not None:
            _by_content.move_to_end(key)
            return t
    tab = codebook_table(cbf)
    nb = tab.nb
    lut = tab.lut[:nb].to(torch.int32).clone()
    steps = 0
    if tab.mode != 1:
        # lut[k+1] = #{C < lower bound of bucket k+1} >= #{C < z} for every z in bucket k
        ext = np.concatenate([lut.numpy().astype(np.int64), [256]])
        steps = int(np.diff(ext).max())
    ent = None
    if tab.mode == 1:
        from gefen_dist.core.quant import bucket_entries

        ent = (tab.ent if tab.ent is not None else bucket_entries(tab.cb, lut)).to(device)
    t = _DeviceTable(tab.cb.to(device), lut.to(device), tab.mode == 1, float(tab.h), nb, steps, ent)
    with _tables_lock:
        _by_content[key] = t
        while len(_by_content) > _TABLE_CACHE_SIZE:
            _by_content.popitem(last=False)
    return t


def _device_table(codebook: torch.Tensor, device: torch.device) -> _DeviceTable:
    """The table for ``codebook`` on ``device``; cached per codebook tensor (object and
    version counter), so a step does not copy the codebook to the host."""
    key = (id(codebook), str(device))
    ver = codebook._version
    with _tables_lock:
        hit = _tables.get(key)
        if hit is not None and hit[0]() is codebook and hit[1] == ver:
            _tables.move_to_end(key)
            return hit[2]
    t = _build_device_table(codebook, device)
    with _tables_lock:
        _tables[key] = (weakref.ref(codebook), ver, t)
        while len(_tables) > _TABLE_CACHE_SIZE:
            _tables.popitem(last=False)
    return t


# --------------------------------------------------------------------------------------
# numerics flags and launch configuration
# --------------------------------------------------------------------------------------

def _fma_flags(device: torch.device, small: bool) -> Tuple[bool, bool]:
    """(fused lerp, fused add(alpha)) as torch's kernels on ``device`` compute them."""
    if device.type == "cpu":
        try:
            from gefen_dist.kernels.cpu import numerics

            num = numerics()
        except Exception:  # pragma: no cover - no native library
            num = None
        if num is not None:
            return (num.fused_lerp_small if small else num.fused_lerp_large), num.fused_axpy
    return True, True


def _next_pow2(x: int) -> int:
    return 1 << max(0, int(x) - 1).bit_length()


@functools.lru_cache(maxsize=1024)
def _config(B: int, nrows: int, block_size: Optional[int] = None) -> Tuple[int, int, int]:
    """(ROWS, BLOCK_SIZE, num_warps). BLOCK_SIZE: the power of two that pads B least (larger
    on ties), between 128 (or next_pow2(B) when smaller) and 2048; ROWS fills 2048 elements."""
    if block_size is None:
        top = min(_next_pow2(B), _MAX_CHUNK)
        bs = top
        best = -(-B // bs) * bs
        c = top // 2
        while c >= _MIN_CHUNK:
            padded = -(-B // c) * c
            if padded < best:
                bs, best = c, padded
            c //= 2
    else:
        bs = int(block_size)
        if bs < 1 or bs & (bs - 1):
            raise ValueError(f"block_size must be a power of two, got {bs}")
    rows = max(1, min(_TILE_ELEMS // bs, _next_pow2(nrows)))
    warps = 4 if rows * bs <= 2048 else 8
    return rows, bs, warps


def _check(name: str, t: torch.Tensor, device: torch.device, dtype, numel: int) -> None:
    if t.device != device:
        raise ValueError(f"{name} is on {t.device}, expected {device}")
    check_tensor(name, t, dtype, numel)


def update_scalars(*, lr, eps, weight_decay, bc1, bc2, bound=None) -> Tuple[float, ...]:
    """The parameter update's scalars as the kernels receive them (Python double -> float32): sqrt(bc2),
    eps, 1 / bc1, lr, 1 - lr wd, the bound (+inf: none); the step launches' and the appliers'
    (:class:`~gefen_dist.kernels.triton_state.ApplyMany`)."""
    return (float(np.float32(np.sqrt(bc2))), float(np.float32(eps)), float(np.float32(1.0 / bc1)),
            float(np.float32(lr)), float(np.float32(1.0 - lr * weight_decay)),
            math.inf if bound is None else float(np.float32(bound)))


def _step_scalars(device, tab, *, lr, beta1, beta2, eps, weight_decay, bc1, bc2, bound=None) -> Tuple[tuple, dict]:
    """The kernels' trailing scalar arguments (as torch converts them: Python double -> float32
    opmath) and the constexprs that depend on the hyperparameters and the codebook table."""
    w = 1.0 - beta1
    small = abs(w) < 0.5
    wf = np.float32(w)
    fused_lerp, fused_axpy = _fma_flags(device, small)
    sqrt_bc2, eps32, inv_bc1, lr32, decay, ubound = update_scalars(lr=lr, eps=eps, weight_decay=weight_decay, bc1=bc1,
                                                                   bc2=bc2, bound=bound)
    args = (float(wf) if small else float(wf - np.float32(1.0)),
            float(np.float32(beta2)), float(np.float32(1.0 - beta2)),
            sqrt_bc2, eps32, inv_bc1, lr32, decay, tab.h, float(tab.nb - 1), ubound)
    consts = dict(LERP_SMALL=small, FUSED_LERP=fused_lerp, FUSED_AXPY=fused_axpy, HAS_WD=(weight_decay != 0.0),
                  LUT_FAST=tab.fast)
    return args, consts


# the device-side scalars of a capturable step, in the order the multi kernel reads them (DEVICE_HP)
DEVICE_HP_FIELDS = ("skip", "sqrt_bc2", "inv_bc1", "lr", "decay", "bound")


def device_step_scalars(out: torch.Tensor, skip: Optional[torch.Tensor], *, lr, beta1, beta2, eps,
                        weight_decay, bc1, bc2, bound=None) -> torch.Tensor:
    """Write the step's varying scalars into ``out`` (float32, :data:`DEVICE_HP_FIELDS`, on the
    device) with tensor operations only: ``lr``, ``bc1``, ``bc2`` and ``bound`` are float64 0-dim
    tensors (:func:`gefen_dist.core.step.device_hyperparameters`), ``skip`` a 0-dim tensor (non-zero:
    nothing is stepped) or None. Each value is computed in double precision and rounded once to
    float32, as :func:`_step_scalars` converts the host's."""
    vals = [skip.to(torch.float64).reshape(()) if skip is not None else torch.zeros_like(bc1),
            torch.sqrt(bc2), 1.0 / bc1, lr, 1.0 - lr * weight_decay,
            torch.full_like(bc1, math.inf) if bound is None else bound]
    return out.copy_(torch.stack(vals))


def _pinned_to(values, device: torch.device) -> torch.Tensor:
    """An int64 table on ``device`` without a host synchronisation (pinned, non-blocking copy)."""
    t = torch.tensor(values, dtype=torch.int64)
    if device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t


class _GradTable:
    """The gradients' addresses on the device, copied again only when they change."""

    def __init__(self, device: torch.device):
        self.device = device
        self._ptrs: Optional[list] = None
        self._table: Optional[torch.Tensor] = None

    def __call__(self, grads) -> torch.Tensor:
        ptrs = [0 if g is None else g.data_ptr() for g in grads]
        if ptrs != self._ptrs:
            self._table = _pinned_to(ptrs, self.device)
            self._ptrs = ptrs
        return self._table
