"""Many tensors per call on CPU: the native provider of the optimizer's multi-tensor batch
(:mod:`gefen_dist.engine.cuda_batch`), with the interface of :mod:`gefen_dist.kernels.triton_multi`
(:class:`MultiStep`, :class:`ColumnSums`, :class:`ColumnFactors` over :class:`StepItem` tables).

The per-tensor CPU path calls the native kernel once per tensor from Python (argument checks, a
ctypes argument struct, the column sums per block of rows, the column factors), about 0.2 ms of
host work per tensor next to the kernel's own time, which is most of a small model's step. Here
the tables are built once for a fixed set of tensors and a step is one native call for every
quantized tensor of a launch group (``gefen_multi_step``: the per-tensor entry points in a loop in
C) and one for every gradient's column sums (``gefen_multi_column_sumsq``), so each tensor's result
is its own per-tensor call's, bitwise: the same kernel on the same arguments, the column sums per
block of rows in the same order, the column factors by the per-tensor path's own operations
(:func:`gefen_dist.kernels.cpu._column_factors_cpu`), taken over all ``v_col`` of one shape at once.
``second_moment="nibbles"`` (D20) tensors likewise: one native call for a launch group's tensors
(``gefen_multi_nibble_step``, :class:`NibbleStep`; the column ratios around the ``v_col`` EMAs by shape,
:class:`gefen_dist.engine.column_stats.ColumnRatios`), each tensor's result its own per-tensor call's
(:func:`gefen_dist.kernels.cpu_nibbles.nibble_step_factored_`), bitwise.
"""
from __future__ import annotations

import ctypes
import math
from typing import Optional, Sequence

import torch

from ..core.nibbles import step_key
from . import cpu as _cpu
from . import cpu_build
from .cpu_nibbles import _NO_TABLE
from .triton_multi import NibbleItem, StepItem

__all__ = ["StepItem", "MultiStep", "ColumnSums", "ColumnFactors", "NibbleItem", "NibbleStep", "available"]


class _Item(ctypes.Structure):
    _fields_ = [("param", ctypes.c_void_p), ("grad", ctypes.c_void_p), ("idx", ctypes.c_void_p),
                ("scale", ctypes.c_void_p), ("v", ctypes.c_void_p), ("colf", ctypes.c_void_p),
                ("n", ctypes.c_int64), ("period", ctypes.c_int64), ("block", ctypes.c_int64),
                ("row0", ctypes.c_int64), ("rb", ctypes.c_int64), ("dtype", ctypes.c_int32),
                ("factored", ctypes.c_int32)]


class _NibItem(ctypes.Structure):
    _fields_ = [("param", ctypes.c_void_p), ("grad", ctypes.c_void_p), ("code", ctypes.c_void_p),
                ("scale", ctypes.c_void_p), ("vrow", ctypes.c_void_p), ("ratio_old", ctypes.c_void_p),
                ("ratio_new", ctypes.c_void_p), ("n", ctypes.c_int64), ("period", ctypes.c_int64),
                ("block", ctypes.c_int64), ("row0", ctypes.c_int64), ("rb", ctypes.c_int64),
                ("dtype", ctypes.c_int32), ("key", ctypes.c_uint32)]


class _ColItem(ctypes.Structure):
    _fields_ = [("grad", ctypes.c_void_p), ("out", ctypes.c_void_p), ("rows", ctypes.c_int64),
                ("S", ctypes.c_int64), ("dtype", ctypes.c_int32), ("pad", ctypes.c_int32)]


_sizes_ok = {}  # id(library) -> whether its table structs match these (checked once per library)


def _lib():
    lib = _cpu._lib()
    if lib is None:
        return None
    ok = _sizes_ok.get(id(lib))
    if ok is None:
        ok = _sizes_ok[id(lib)] = (lib.gefen_multi_item_size() == ctypes.sizeof(_Item)
                                   and lib.gefen_colsum_item_size() == ctypes.sizeof(_ColItem))
    return lib if ok else None


def _nibble_lib():
    """The library of the one-byte layout's step (the native build, as the per-tensor path's:
    :mod:`gefen_dist.kernels.cpu_build`), or None where it lacks the multi-tensor entry point's struct."""
    lib = _cpu._lib(cpu_build.NATIVE)
    if lib is None:
        return None
    key = ("nibble", id(lib))
    ok = _sizes_ok.get(key)
    if ok is None:
        ok = _sizes_ok[key] = lib.gefen_nibble_item_size() == ctypes.sizeof(_NibItem)
    return lib if ok else None


def available(device: Optional[torch.device] = None) -> bool:
    """Whether the native library (with its multi-tensor entry points) is built and enabled."""
    return (device is None or torch.device(device).type == "cpu") and _lib() is not None


def _need_lib():
    lib = _lib()
    if lib is None:
        raise RuntimeError("gefen_dist: the native CPU library is not available (GEFEN_DIST_NO_NATIVE set, or no "
                           "C compiler); the multi-tensor CPU batch cannot run")
    return lib


class MultiStep:
    """The Gefen update of many CPU tensors in one native call (:class:`StepItem` as for
    :class:`gefen_dist.kernels.triton_multi.MultiStep`: mode 0/1 shared with ``period`` = ``B`` /
    1, mode 2 factored with ``v_col`` holding this step's column factors, rewritten in place).
    Built once for a fixed set of tensors; :meth:`run` takes this step's gradients."""

    def __init__(self, items, device: torch.device, config=None):
        if config is not None:
            raise ValueError("config (a Triton launch configuration) does not apply to the CPU kernel")
        self.device = torch.device(device)
        self.items = list(items)
        self._table = (_Item * max(1, len(self.items)))()
        for i, it in enumerate(self.items):
            it.check(i)
            n = it.param.numel()
            f = self._table[i]
            f.param, f.idx, f.scale, f.v = (it.param.data_ptr(), it.idx.data_ptr(), it.scale.data_ptr(),
                                            it.v.data_ptr())
            f.n, f.block, f.dtype = n, it.B, 0 if it.param.dtype == torch.float32 else 1
            if it.mode == 2:
                # (factored: its column blocks K >= 1, D21)
                f.colf, f.period, f.factored, f.row0, f.rb = it.v_col.data_ptr(), it.S, it.K, it.row0, it.block_rows
            else:
                f.colf, f.period, f.factored, f.row0, f.rb = None, 1 if it.mode == 1 else it.B, 0, 0, 1
        self._touched = [t for it in self.items for t in (it.param, it.idx, it.scale, it.v)]  # version counters

    @property
    def launches(self) -> int:
        return 1 if self.items else 0

    def run(self, grads, codebook: torch.Tensor, *, lr: float, beta1: float, beta2: float, eps: float,
            weight_decay: float, bc1: float, bc2: float, bound: Optional[float] = None) -> None:
        """One step of every item; ``grads[i]`` (contiguous, the item's dtype and size) for item ``i``."""
        if not self.items:
            return
        lib = _need_lib()
        for f, g in zip(self._table, grads):
            f.grad = g.data_ptr()
        tab = _cpu.codebook_table(codebook)
        first = self.items[0]
        a = _cpu._make_args(first.param, first.param.numel(), first.S, first.B, tab, lr=lr, beta1=beta1,
                            beta2=beta2, eps=eps, weight_decay=weight_decay, bc1=bc1, bc2=bc2, bound=bound, simd=1)
        rc = lib.gefen_multi_step(ctypes.byref(a), ctypes.addressof(self._table), len(self.items),
                                  tab.cb.data_ptr(), tab.lut.data_ptr())
        if rc != 0:
            raise RuntimeError(f"gefen_multi_step failed: item {rc // 100 - 1}, code {-(rc % 100)}")
        torch.autograd.graph.increment_version(self._touched)


class ColumnSums:
    """Per-column sums of ``g^2`` (float32 squares added in float64) of many CPU gradients, per block
    of rows (D12), in one native call: for each (gradient, row block) the native
    ``gefen_column_sumsq`` over the block's rows (zeros for a block without rows here), the values
    of the per-tensor path (:func:`gefen_dist.core.step.block_column_sumsq` with the native sums).
    ``specs[i]`` = (rows, S, row0, row_block, G, dtype) of gradient ``i``; :meth:`run` returns
    ``[sum_i G_i * S_i]`` float64 in that order."""

    def __init__(self, specs, device: torch.device):
        self.device = torch.device(device)
        self.specs = list(specs)
        self._parts = []  # (gradient index, first row, rows, S, output offset)
        out = 0
        for i, (rows, S, row0, row_block, G, dtype) in enumerate(self.specs):
            for b in range(G):
                lo = max(0, min(rows, b * row_block - row0)) if G > 1 else 0
                hi = max(lo, min(rows, (b + 1) * row_block - row0)) if G > 1 else rows
                self._parts.append((i, lo, hi - lo, S, out + b * S))
            out += G * S
        self.total = out
        self._table = (_ColItem * max(1, len(self._parts)))()
        for f, (i, _, nrows, S, _) in zip(self._table, self._parts):
            f.rows, f.S, f.dtype = nrows, S, 0 if self.specs[i][5] == torch.float32 else 1

    @property
    def programs(self) -> int:
        return len(self._parts)

    def run(self, grads) -> torch.Tensor:
        out = torch.empty(self.total, dtype=torch.float64)  # every slot written (empty blocks: zeros)
        if not self._parts:
            return out
        lib = _need_lib()
        base = out.data_ptr()
        for f, (i, lo, _, S, o) in zip(self._table, self._parts):
            g = grads[i]
            f.grad = g.data_ptr() + lo * S * g.element_size()
            f.out = base + 8 * o
        bad = lib.gefen_multi_column_sumsq(ctypes.addressof(self._table), len(self._parts), torch.get_num_threads())
        if bad:
            i, _, nrows, S, _ = self._parts[bad - 1]
            raise MemoryError(f"gefen_column_sumsq: cannot allocate {min(16, nrows) * S * 8} bytes")
        return out


GRAIN = 32768  # at::internal::GRAIN_SIZE: below it torch reduces serially


def shape_groups(tensors) -> list:
    """Indices of ``tensors`` grouped by shape (first appearance order), each tensor of ``GRAIN`` elements
    or more in a group of its own: the groups whose ``stack(...).mean(-1)`` reduces each row in the order
    that row's own mean does on CPU (torch reduces a tensor of one output and at least ``GRAIN`` elements in
    parallel, in another order)."""
    by_shape: dict = {}
    for i, v in enumerate(tensors):
        by_shape.setdefault(tuple(v.shape) if v.numel() < GRAIN else ("alone", i), []).append(i)
    return list(by_shape.values())


class ColumnFactors:
    """The column factors ``sqrt(v_col / mean(v_col))`` of many factored CPU tensors: ``v_cols[i]``
    (``[S]`` or ``[G, S]``, float32, contiguous) gets ``views[i]``, a tensor of its shape in one flat
    buffer that every :meth:`run` rewrites, with the per-tensor path's operations
    (:func:`gefen_dist.kernels.cpu._column_factors_cpu`).

    ``v_col`` tensors of one shape are computed together: one ``stack``, one ``mean``, one ``div``
    and one ``sqrt_`` per shape instead of four operations per tensor (a model's layers repeat a few
    shapes). Each output of the stacked mean reduces its own row in the order a mean of that
    ``v_col`` alone does, as long as the per-tensor mean runs in one thread: torch reduces a tensor of
    one output and at least ``GRAIN`` elements in parallel, in another order, so such ``v_col``
    (one profile of 32,768 columns or more) stay on their own (``tests/test_cpu_batch.py``)."""

    def __init__(self, v_cols, device: torch.device):
        self.device = torch.device(device)
        self.v_cols = list(v_cols)
        for i, v in enumerate(self.v_cols):
            if v.dtype != torch.float32 or not v.is_contiguous() or v.device.type != "cpu":
                raise ValueError(f"v_col {i}: need a contiguous float32 CPU tensor, got {v.dtype} on {v.device}"
                                 f"{'' if v.is_contiguous() else ', non-contiguous'}")
        self.out = torch.empty(sum(v.numel() for v in self.v_cols), dtype=torch.float32)
        self.views = [None] * len(self.v_cols)
        self._groups, o = [], 0  # (v_cols, their outputs as one [K, *shape] block) per shape
        for members in shape_groups(self.v_cols):
            shape, k = tuple(self.v_cols[members[0]].shape), len(members)
            n = self.v_cols[members[0]].numel()
            block = self.out[o:o + k * n].view(k, *shape)
            for j, i in enumerate(members):
                self.views[i] = block[j]
            self._groups.append(([self.v_cols[i] for i in members], block))
            o += k * n

    def run(self):
        for vs, block in self._groups:
            if len(vs) == 1:
                _cpu._column_factors_cpu(vs[0], out=block[0])
                continue
            st = torch.stack(vs)
            mean_c = st.mean(dim=-1, keepdim=True)
            if float(mean_c.min()) > 0:  # (False for a NaN mean) as _column_factors_cpu's fast case
                torch.div(st, mean_c, out=block)
                block.sqrt_()
            else:
                for v, out in zip(vs, block):
                    _cpu._column_factors_cpu(v, out=out)
        return self.views


class NibbleStep:
    """The ``second_moment="nibbles"`` update (D20) of many CPU tensors in one native call
    (``gefen_multi_nibble_step``: :func:`gefen_dist.kernels.cpu_nibbles.nibble_step_factored_`'s kernel
    call per item, the same arguments). Built once for a fixed set of tensors; :meth:`run` takes this
    step's gradients and step number (the items' keys follow from it)."""

    def __init__(self, items: Sequence[NibbleItem], device: torch.device):
        self.device = torch.device(device)
        self.items = list(items)
        self._table = (_NibItem * max(1, len(self.items)))()
        for i, it in enumerate(self.items):
            it.check(i)
            f = self._table[i]
            f.param, f.code, f.scale, f.vrow = (it.param.data_ptr(), it.code.data_ptr(), it.scale.data_ptr(),
                                                it.v_row.data_ptr())
            f.ratio_old, f.ratio_new = it.ratio_old.data_ptr(), it.ratio_new.data_ptr()
            f.n, f.period, f.block, f.row0, f.rb = it.param.numel(), it.S, it.B, it.row0, it.rb
            f.dtype = 0 if it.param.dtype == torch.float32 else 1
        self._touched = [t for it in self.items for t in (it.param, it.code, it.scale, it.v_row)]

    @property
    def launches(self) -> int:
        return 1 if self.items else 0

    def run(self, grads, codebook: torch.Tensor, step: int, *, lr: float, beta1: float, beta2: float,
            eps: float, weight_decay: float, bc1: float, bc2: float, bound: Optional[float] = None,
            update: str = "fp32") -> None:
        """Step ``step`` of every item: ``grads[i]`` (contiguous, the item's dtype and size) for item ``i``,
        its draws keyed by ``step_key(0, step, index)``; ``codebook`` the 16 first-moment codewords."""
        if not self.items:
            return
        lib = _nibble_lib()
        if lib is None:
            raise RuntimeError("gefen_dist: the native CPU library is not available; the multi-tensor CPU step of "
                               "second_moment='nibbles' cannot run")
        for f, g, it in zip(self._table, grads, self.items):
            f.grad, f.key = g.data_ptr(), step_key(0, step, it.index)
        first = self.items[0]
        a = _cpu._make_args(first.param, first.param.numel(), first.S, first.B, _NO_TABLE, lr=lr,
                            beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay, bc1=bc1, bc2=bc2,
                            bound=bound, simd=1)
        cb = codebook.to(torch.float32).contiguous()
        na = _cpu._NibbleArgs(None, None, cb.data_ptr(), 0, 1, math.inf if bound is None else bound, 0,
                              int(update == "decoded"))
        rc = lib.gefen_multi_nibble_step(ctypes.byref(a), ctypes.byref(na), ctypes.addressof(self._table),
                                         len(self.items))
        if rc != 0:
            i, code = rc // 100 - 1, rc % 100
            raise RuntimeError(f"gefen_multi_nibble_step failed: item {i}, code {code}"
                               + (" (out of memory)" if code == 2 else ""))
        torch.autograd.graph.increment_version(self._touched)
