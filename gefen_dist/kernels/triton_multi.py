"""Many tensors per launch (the optimizer's CUDA path, :mod:`gefen_dist.engine.cuda_batch`): the
update of every quantized tensor of a batch (:class:`MultiStep`), the factored tensors' column sums
(:class:`ColumnSums`) and their column factors (:class:`ColumnFactors`), each from a table of
(tensor, rows, column tile) built once, with the kernels of :mod:`gefen_dist.kernels.triton_kernels`."""
from __future__ import annotations

from contextlib import nullcontext as _nullcontext
from dataclasses import dataclass
from typing import Dict, Optional, Tuple

import torch

from .triton_kernels import _kernel
from .triton_tables import _GradTable, _config, _device_table, _pinned_to, _step_scalars

__all__ = ["StepItem", "NibbleItem", "MultiStep", "ColumnSums", "ColumnFactors", "multi_launch_options"]


@dataclass(frozen=True)
class StepItem:
    """One contiguous tensor (or local piece) for :class:`MultiStep`: ``v`` is the per-block or
    per-element v (``mode`` 0 / 1) or ``v_row`` (``mode`` 2, factored, with ``v_col`` ``[G, S]``
    holding this step's column factors ``sqrt(v_col / mean(v_col))``, :class:`ColumnFactors`'
    view, rewritten in place each step; rows of this piece starting at global row ``row0``,
    blocks of ``row_block`` rows; ``K`` > 1: column blocks, D21, ``v`` holding ``K`` entries per row and
    ``v_col`` ``[S]`` the factors normalised per block of ``S / K`` columns)."""

    param: torch.Tensor
    idx: torch.Tensor
    scale: torch.Tensor
    v: torch.Tensor
    v_col: Optional[torch.Tensor]
    S: int
    B: int
    mode: int
    row0: int = 0
    row_block: int = 1
    K: int = 1

    def check(self, i: int) -> None:
        """Refuse an item the multi-tensor step cannot take (``i``: its index, for the message)."""
        n = self.param.numel()
        if self.param.dtype not in (torch.float32, torch.bfloat16):
            raise ValueError(f"param dtype {self.param.dtype} not supported (float32, bfloat16)")
        if n and (self.S % self.B or n % self.S or (self.mode != 2 and self.S != self.B)):
            raise ValueError(f"bad item {i}: S={self.S}, B={self.B}, mode={self.mode}, numel={n}")
        if self.K != 1 and (self.mode != 2 or self.K < 1 or self.S % self.K or (self.S // self.K) % self.B
                            or (self.v_col is not None and self.v_col.numel() != self.S)):
            raise ValueError(f"bad item {i}: K={self.K} column blocks need mode 2, one column profile and the scale "
                             f"block {self.B} dividing a block of S / K columns (S={self.S})")

    @property
    def block_rows(self) -> int:
        """Rows per block of the column factors as the kernels read them (one block: every row of
        the piece in block 0)."""
        one_block = self.v_col is None or self.v_col.numel() == self.S
        return self.row0 + self.param.numel() // self.S + 1 if one_block else self.row_block


@dataclass(frozen=True)
class NibbleItem:
    """One contiguous ``second_moment="nibbles"`` tensor (or local piece of whole rows) for a
    ``NibbleStep`` (:mod:`~gefen_dist.kernels.cpu_multi`, :mod:`~gefen_dist.kernels.triton_nibbles`): its
    flat parameter, codes, scales and ``v_row``, the views of its column ratios before and after this
    step's ``v_col`` EMA (:class:`~gefen_dist.engine.column_stats.ColumnRatios`, rewritten in place each
    step), ``S`` columns, scale blocks of ``B``, its first global row ``row0`` and rows per row block ``rb``
    (one block: ``row0`` + its rows + 1, as the per-tensor call passes), and ``index``, its place in the
    optimizer (the random numbers' key: :func:`gefen_dist.core.nibbles.step_key`)."""

    param: torch.Tensor
    code: torch.Tensor
    scale: torch.Tensor
    v_row: torch.Tensor
    ratio_old: torch.Tensor
    ratio_new: torch.Tensor
    S: int
    B: int
    row0: int
    rb: int
    index: int

    def check(self, i: int) -> None:
        """Refuse an item the multi-tensor step cannot take (``i``: its index, for the message)."""
        n = self.param.numel()
        if self.param.dtype not in (torch.float32, torch.bfloat16):
            raise ValueError(f"param dtype {self.param.dtype} not supported (float32, bfloat16)")
        if n and (self.S < 1 or self.B < 1 or self.S % self.B or n % self.S or self.rb < 1):
            raise ValueError(f"bad item {i}: S={self.S}, B={self.B}, rb={self.rb}, numel={n}")


# ptxas's own choice for the multi kernel spilled a few registers to local memory in its prologue in
# some tile configurations (e.g. 96 registers and 4 spill stores for 4x512, shared mode); the
# register ceiling stated explicitly gives 115-168 registers and no spill in every shipped
# configuration (benchmarks/triton_sm90.py, sm_90, triton 3.9; tests/test_triton_sm90.py).
_MULTI_MAXNREG = 255


def multi_launch_options() -> Dict[str, int]:
    """The compiler options of every multi-kernel launch besides ``num_warps``."""
    return {"maxnreg": _MULTI_MAXNREG}


def _aligned(it) -> bool:
    """Whether item ``it`` of a :class:`MultiStep` meets the multi kernel's ``ALIGNED`` promise for its
    own tensors (16-byte aligned pointers, row length and scale block multiples of 16); the
    gradient is checked at each run."""
    ptrs = [it.param.data_ptr(), it.idx.data_ptr(), (it.v_col if it.v_col is not None else it.v).data_ptr()]
    return it.S % 16 == 0 and it.B % 16 == 0 and all(p % 16 == 0 for p in ptrs)


class MultiStep:
    """The Gefen update of many tensors with one kernel launch per (mode, dtype, chunk config):
    the same per-row work as :func:`quantized_step_` / :func:`quantized_step_factored_`, so each
    tensor's result is bitwise that of its own launch. Built once for a fixed set of tensors
    (their state tensors must stay in place); :meth:`run` takes this step's gradients.

    ``config`` = (ROWS, BLOCK_SIZE, num_warps) forces one launch configuration on every tensor
    instead of :func:`_config`'s choice (benchmarks/gpu_step.py --tune times them); results then
    differ from single-tensor launches in the summation order of mean(g^2)."""

    def __init__(self, items, device: torch.device, config: Optional[Tuple[int, int, int]] = None):
        if config is not None and (len(config) != 3 or any(int(c) < 1 for c in config)):
            raise ValueError(f"config must be (ROWS, BLOCK_SIZE, num_warps) of positive ints, got {config!r}")
        self.device = torch.device(device)
        self.items = list(items)
        buckets: Dict[tuple, list] = {}
        for i, it in enumerate(self.items):
            n = it.param.numel()
            if n == 0:
                continue
            it.check(i)
            rows, bs, warps = tuple(config) if config is not None else _config(it.B, n // it.S)
            buckets.setdefault((it.mode, it.param.dtype == torch.bfloat16, rows, bs, warps, _aligned(it), it.K > 1),
                               []).append(i)
        self._touched = [t for it in self.items for t in (it.param, it.idx, it.scale, it.v)]  # version counters
        self._launches = []
        for (mode, bf16, rows, bs, warps, aligned, colb), members in buckets.items():
            meta, prog = [], []
            for t, i in enumerate(members):
                it = self.items[i]
                nrows = it.param.numel() // it.S
                vc = it.v_col.data_ptr() if it.v_col is not None else it.v.data_ptr()
                meta.append([it.param.data_ptr(), it.idx.data_ptr(), it.scale.data_ptr(), it.v.data_ptr(), vc,
                             nrows, it.S, it.B, it.row0, it.block_rows, it.K])
                prog += [[t, r] for r in range(0, nrows, rows)]
            self._launches.append(dict(
                mode=mode, bf16=bf16, rows=rows, bs=bs, warps=warps, members=members, aligned=aligned, colb=colb,
                meta=_pinned_to(meta, self.device), prog=_pinned_to(prog, self.device), nprog=len(prog),
                grads=_GradTable(self.device)))

    @property
    def launches(self) -> int:
        return len(self._launches)

    def run(self, grads, codebook: torch.Tensor, *, lr, beta1: float, beta2: float, eps: float,
            weight_decay: float, bc1, bc2, bound=None, hp: Optional[torch.Tensor] = None) -> None:
        """One step of every item; ``grads[i]`` (contiguous, the item's dtype and size) for item ``i``;
        ``bound`` as for :func:`quantized_step_`. With ``hp`` (``capturable=True``: float32 on the
        device, :func:`~gefen_dist.kernels.triton_tables.device_step_scalars` filled it) the kernels
        read lr, the bias corrections, the bound and the skip flag from it, and ``lr``, ``bc1``,
        ``bc2`` and ``bound`` (tensors then) are not read on the host."""
        tab = _device_table(codebook, self.device)
        if hp is not None:  # placeholders for the scalars the kernel reads from hp
            lr, bc1, bc2, bound = 0.0, 1.0, 1.0, None
        scalars, consts = _step_scalars(self.device, tab, lr=lr, beta1=beta1, beta2=beta2, eps=eps,
                                        weight_decay=weight_decay, bc1=bc1, bc2=bc2, bound=bound)
        kern = _kernel("multi")
        ctx = torch.cuda.device(self.device) if self.device.type == "cuda" else _nullcontext()
        with ctx:
            for L in self._launches:
                gs = [grads[i] for i in L["members"]]
                # the promise of ALIGNED covers the gradients too, which may move between steps
                aligned = L["aligned"] and all(g.data_ptr() % 16 == 0 for g in gs)
                kern[(L["nprog"],)](
                    L["meta"], L["grads"](gs), L["prog"], tab.cb, tab.kernel_table(L["mode"]), tab.scan_steps,
                    tab.cb if hp is None else hp, *scalars,
                    MODE=L["mode"], IS_BF16=L["bf16"], ROWS=L["rows"], BLOCK_SIZE=L["bs"], ALIGNED=aligned,
                    DEVICE_HP=hp is not None, COLB=L["colb"],
                    num_warps=L["warps"], enable_fp_fusion=False, **multi_launch_options(), **consts,
                )
        torch.autograd.graph.increment_version(self._touched)


_CS_RB = 16        # rows per iteration of the column-sum kernel
_CS_BLOCK_C = 256  # columns per program
_CS_CHUNKS = 32    # chunks (programs along the rows) per block of rows, at most
_CS_CH = 32        # chunks added per iteration of the reduction


class ColumnSums:
    """Per-column sums of ``g^2`` (float32 squares added in float64) of many gradients, per block
    of rows (D12), in two launches per dtype plus one: each (tensor, row block) is cut into at
    most 32 chunks of rows whose partial sums are added in a fixed order, so the result does not
    depend on scheduling. ``specs[i]`` = (rows, S, row0, row_block, G, dtype) of gradient ``i``;
    :meth:`run` returns ``[sum_i G_i * S_i]`` float64 in that order (the layout of the
    optimizer's all-reduced column statistics)."""

    def __init__(self, specs, device: torch.device):
        self.device = torch.device(device)
        self.specs = list(specs)
        chunks: Dict[bool, list] = {}
        red = []
        part = out = 0
        for i, (rows, S, row0, row_block, G, dtype) in enumerate(self.specs):
            bf16 = dtype == torch.bfloat16
            for b in range(G):
                lo = max(0, b * row_block - row0) if G > 1 else 0
                hi = min(rows, (b + 1) * row_block - row0) if G > 1 else rows
                first, n = part, 0
                if hi > lo:
                    step = -(-(hi - lo) // _CS_CHUNKS)
                    step = -(-step // _CS_RB) * _CS_RB
                    for r in range(lo, hi, step):
                        chunks.setdefault(bf16, []).append([i, r, min(hi, r + step), S, part])
                        part += S
                        n += 1
                red.append([first, n, S, out + b * S])
            out += G * S
        self.total = out
        self._part_elems = max(1, part)

        def tiles(table, s_at):  # (entry, column tile) for every tile holding columns of the entry's S
            return [[j, t] for j, row in enumerate(table) for t in range(-(-int(row[s_at]) // _CS_BLOCK_C))]

        self._chunk_tabs = {}
        for bf16, c in chunks.items():  # chunk rows: (tensor, first row, end row, S, offset)
            ct = tiles(c, 3)
            self._chunk_tabs[bf16] = (_pinned_to(c, self.device), _pinned_to(ct, self.device), len(ct))
        self._members = {bf16: {c[0] for c in cs} for bf16, cs in chunks.items()}
        # the chunk table names gradients by their index in specs: one address table per dtype
        self._grads = {bf16: _GradTable(self.device) for bf16 in chunks}
        self._red = _pinned_to(red, self.device)
        self._nred = len(red)
        red_tiles = tiles(red, 2)  # reduction rows: (first chunk's offset, chunks, S, output offset)
        self._red_tiles, self._nred_tiles = _pinned_to(red_tiles, self.device), len(red_tiles)

    @property
    def programs(self) -> int:
        """Programs launched per :meth:`run` (every one has columns to sum)."""
        return sum(n for _, _, n in self._chunk_tabs.values()) + self._nred_tiles

    def run(self, grads) -> torch.Tensor:
        if not self._nred:
            return torch.zeros(self.total, dtype=torch.float64, device=self.device)
        # every element of both is written below (each chunk's S partial sums, each entry's S sums)
        out = torch.empty(self.total, dtype=torch.float64, device=self.device)
        part = torch.empty(self._part_elems, dtype=torch.float64, device=self.device)
        ctx = torch.cuda.device(self.device) if self.device.type == "cuda" else _nullcontext()
        with ctx:
            for bf16, (tab, ttab, n) in self._chunk_tabs.items():
                # addresses indexed by position in specs (gradients of the other dtype: 0, unused)
                mem = self._members[bf16]
                gt = self._grads[bf16]([g if i in mem else None for i, g in enumerate(grads)])
                _kernel("colsum")[(n,)](gt, tab, ttab, part, IS_BF16=bf16, RB=_CS_RB, BLOCK_C=_CS_BLOCK_C, num_warps=4)
            _kernel("reduce")[(self._nred_tiles,)](part, self._red, self._red_tiles, out, CH=_CS_CH,
                                                   BLOCK_C=_CS_BLOCK_C, num_warps=4)
        return out


_CF_CHUNK = 1024  # profile values per iteration of the column-factor kernel


def check_vcols(v_cols, device: torch.device) -> None:
    """Refuse a ``v_col`` a column-statistics table cannot keep a view of: not float32, not contiguous or
    not on ``device`` (naming its index and what it is)."""
    for i, v in enumerate(v_cols):
        if v.dtype != torch.float32 or not v.is_contiguous() or v.device != device:
            raise ValueError(f"v_col {i}: need a contiguous float32 tensor on {device}, got "
                             f"{v.dtype} on {v.device}{'' if v.is_contiguous() else ', non-contiguous'}")


class ColumnFactors:
    """The column factors ``sqrt(v_col / mean(v_col))`` of many factored tensors in one launch:
    ``v_cols[i]`` (``[S]`` or ``[G, S]``, float32, contiguous) gets ``views[i]``, a tensor of its
    shape in one flat buffer that every :meth:`run` rewrites (so update kernels built on it keep
    their pointers). One program per row block's profile."""

    def __init__(self, v_cols, device: torch.device):
        self.device = torch.device(device)
        self.v_cols = list(v_cols)
        check_vcols(self.v_cols, self.device)
        self.out = torch.empty(sum(v.numel() for v in self.v_cols), dtype=torch.float32, device=self.device)
        self.views, tab, o = [], [], 0
        for v in self.v_cols:
            S = v.shape[-1]
            self.views.append(self.out[o:o + v.numel()].view(v.shape))
            for b in range(v.numel() // S if S else 0):
                tab.append([v.data_ptr() + 4 * b * S, self.out.data_ptr() + 4 * (o + b * S), S])
            o += v.numel()
        self._n = len(tab)
        self._tab = _pinned_to(tab, self.device) if tab else None

    def run(self):
        """The factors of the ``v_cols`` as they are now (``views``)."""
        if self._n:
            ctx = torch.cuda.device(self.device) if self.device.type == "cuda" else _nullcontext()
            with ctx:
                _kernel("colfactor")[(self._n,)](self._tab, CHUNK=_CF_CHUNK, num_warps=4)
        return self.views
