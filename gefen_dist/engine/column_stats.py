"""The factored second moment's column statistics over pieces (D12): this rank's float64 column
sums of ``g^2`` per tensor, one SUM all-reduce when any tensor is sharded, column means per row
block. Replicas that do not contribute add zeros, so the sums equal a single process's."""
from __future__ import annotations

from typing import Callable, List, Optional, Sequence, Tuple

import torch

from ..core.step import block_column_sumsq, column_ratios, ema_foreach_
from .layout import Piece

__all__ = ["piece_column_sums", "column_means", "ColumnTable", "ColumnRatios"]


def piece_column_sums(pc: Piece, v_col: torch.Tensor, global_rows: int, sumsq: Callable, skip: bool) -> torch.Tensor:
    """``[G * slab]`` float64 column sums of ``g^2`` over the rows of piece ``pc``, per block of
    rows (``v_col`` is ``[slab]`` or ``[G, slab]``); zeros when ``skip`` (a replica that must not
    add a second time) or the piece holds no gradient. ``sumsq`` sums a range of whole rows (the
    implementation's :func:`~gefen_dist.core.step.column_sumsq`)."""
    slab, G = v_col.shape[-1], max(1, v_col.numel() // v_col.shape[-1])
    if skip or pc.grad is None or pc.grad.numel() == 0:
        return torch.zeros(G * slab, dtype=torch.float64, device=v_col.device)
    return block_column_sumsq(pc.grad, slab, pc.start // slab, global_rows // G, G, sumsq)


def column_means(comm, sums: Sequence[torch.Tensor], tensors: Sequence[Tuple[torch.Tensor, int, torch.device]],
                 sharded: bool) -> Tuple[List[torch.Tensor], torch.Tensor]:
    """Column means of ``g^2`` over all global rows of each tensor (``tensors``: its ``v_col``, its
    row count in the global tensor, the device its step runs on), from this rank's ``sums``: concatenated, one
    SUM all-reduce when ``sharded``. Returns the float32 means (shaped like the ``v_col`` blocks,
    flat) and the reduced float64 buffer (for the overflow check)."""
    dev = sums[0].device
    buf = torch.cat([s.to(dev) for s in sums])
    if sharded:
        comm.all_reduce_sum_(buf)
    out, o = [], 0
    for v_col, global_rows, device in tensors:
        n = v_col.numel()
        rows = global_rows // max(1, n // v_col.shape[-1])  # per row block (D12)
        out.append((buf[o:o + n] / rows).to(torch.float32).to(device))
        o += n
    return out, buf


class ColumnTable:
    """A multi-tensor batch's column statistics (the CUDA batch, its capturable step and ZeroGefen's
    batch), built once for its factored tensors: one column-sum launcher over their gradients, the
    float64 row counts per row block that divide the sums, a 0/1 mask where a replica must not count
    a second time (HSDP), one float32 buffer of the column means with a view per tensor (what the
    ``v_col`` EMAs read) and one column-factor launcher (``factors.views[i]`` is tensor ``i``'s
    ``sqrt(v_col / mean(v_col))``, rewritten in place by every run).

    ``kernels`` is the module of the launchers (:mod:`~gefen_dist.kernels.triton_step` or
    :mod:`~gefen_dist.kernels.cpu_multi`); ``tensors[i] = (v_col, spec, rows, contributes)``:
    ``spec`` the gradient's ``(local rows, S, first row, row block, G, dtype)`` for ``ColumnSums``,
    ``rows`` the global rows per row block, ``contributes`` False for a replica whose sums count as
    zeros. ``factored[i]`` False: tensor ``i`` needs no column factors (``second_moment="nibbles"``
    reads the column ratios around the EMA instead); :attr:`factor_views` holds None for it, and
    :attr:`factors` launches over the others only (None when no tensor needs them). ``col_blocks[i]``
    ``K`` > 1 (D21): tensor ``i``'s factors are normalised per block of ``S / K`` columns (its ``v_col``
    read as ``[K, S / K]``, as the per-tensor kernels' wrappers compute them); its factor view is ``[S]``."""

    def __init__(self, kernels, tensors: Sequence[tuple], device: torch.device,
                 factored: Optional[Sequence[bool]] = None, col_blocks: Optional[Sequence[int]] = None):
        if not tensors:
            raise ValueError("ColumnTable needs at least one factored tensor")
        self.vcols = [t[0] for t in tensors]
        self.sums = kernels.ColumnSums([t[1] for t in tensors], device)
        need = [True] * len(self.vcols) if factored is None else [bool(f) for f in factored]
        K = [1] * len(self.vcols) if col_blocks is None else [int(k) for k in col_blocks]
        wanted = [v.view(k, -1) if k > 1 else v for v, f, k in zip(self.vcols, need, K) if f]
        self.factors = kernels.ColumnFactors(wanted, device) if wanted else None
        it = iter(self.factors.views if self.factors is not None else [])
        self.factor_views = [(next(it).view(-1) if k > 1 else next(it)) if f else None for f, k in zip(need, K)]
        self.slices, o = [], 0  # (offset, numel, v_col's shape) of each tensor in the flat buffers
        for v in self.vcols:
            self.slices.append((o, v.numel(), v.shape))
            o += v.numel()
        self.total = o

        def per_column(values):
            return torch.cat([torch.full((v.numel(),), float(x), dtype=torch.float64)
                              for v, x in zip(self.vcols, values)]).to(device)

        self.rows = per_column([t[2] for t in tensors])
        self.mask = None if all(t[3] for t in tensors) else per_column([bool(t[3]) for t in tensors])
        self.means = torch.empty(o, dtype=torch.float32, device=device)
        self.views = self.views_of(self.means)

    def views_of(self, buf: torch.Tensor) -> List[torch.Tensor]:
        """Views of a flat buffer of ``total`` elements shaped like each tensor's ``v_col``."""
        return [buf[o:o + n].view(shape) for o, n, shape in self.slices]

    def column_sums(self, grads: Sequence[torch.Tensor]) -> torch.Tensor:
        """This rank's float64 column sums of ``g^2`` (one per tensor's gradient, in order), masked
        where a replica must not count (``NaN * 0`` stays NaN: its non-finite gradient is still seen)."""
        buf = self.sums.run(grads)
        if self.mask is not None:
            buf.mul_(self.mask)
        return buf

    def column_means(self, buf: torch.Tensor) -> torch.Tensor:
        """The float32 column means from the (reduced) sums: float64 quotients rounded once, into
        :attr:`means` (whose :attr:`views` the EMAs read)."""
        return torch.div(buf, self.rows, out=self.means)


class ColumnRatios:
    """The column ratios ``v_col / mean(v_col)`` (:func:`gefen_dist.core.step.column_ratios`) of a launch
    group's ``second_moment="nibbles"`` tensors before and after this step's ``v_col`` EMA
    (:func:`gefen_dist.core.nibbles.ratios_around_ema_` of each), into ``old[i]`` / ``new[i]``: views of two
    flat buffers that every :meth:`run` rewrites, so the update kernels' tables keep their pointers.

    ``v_col`` tensors of one shape are taken together (one ``stack``, ``mean`` and ``div`` per shape, two
    foreach operations for the EMAs) instead of about six operations per tensor. Each stacked mean reduces
    each output in the order the mean of that ``v_col`` alone does on CPU (bitwise the per-tensor path,
    ``tests/test_cpu_batch.py``) as long as that mean runs serially: a profile of ``GRAIN`` columns or more
    is reduced on its own (:func:`gefen_dist.kernels.cpu_multi.shape_groups`, as its ``ColumnFactors``).
    On CUDA torch may order a reduction of many outputs differently from one of a few, so the ratios can
    differ from the per-tensor path's in a last bit (not run on a GPU yet)."""

    def __init__(self, v_cols, device: torch.device):
        from ..kernels.cpu_multi import shape_groups
        from ..kernels.triton_multi import check_vcols

        self.device = torch.device(device)
        self.v_cols = list(v_cols)
        check_vcols(self.v_cols, self.device)
        total = sum(v.numel() for v in self.v_cols)
        bufs = [torch.empty(total, dtype=torch.float32, device=self.device) for _ in range(2)]
        self.old, self.new = [None] * len(self.v_cols), [None] * len(self.v_cols)
        self._groups, o = [], 0  # (v_cols, their old and new ratios as [K, *shape] blocks) per shape
        for members in shape_groups(self.v_cols):
            shape, k = tuple(self.v_cols[members[0]].shape), len(members)
            n = self.v_cols[members[0]].numel()
            blocks = [b[o:o + k * n].view(k, *shape) for b in bufs]
            for j, i in enumerate(members):
                self.old[i], self.new[i] = blocks[0][j], blocks[1][j]
            self._groups.append(([self.v_cols[i] for i in members], blocks))
            o += k * n

    @staticmethod
    def _ratios(vs, block: torch.Tensor) -> None:
        if len(vs) == 1:
            block[0].copy_(column_ratios(vs[0]))
            return
        st = torch.stack(vs)
        mean_c = st.mean(dim=-1, keepdim=True)
        if st.device.type == "cpu" and float(mean_c.min()) > 0:  # (no host read on a GPU; False for NaN)
            torch.div(st, mean_c, out=block)  # what column_ratios' where selects where every mean is positive
        else:
            torch.where(mean_c > 0, st / mean_c, torch.zeros((), dtype=st.dtype, device=st.device), out=block)

    def run(self, col_means: Sequence[torch.Tensor], beta2: float) -> None:
        """The ratios before, each ``v_col``'s EMA by ``col_means[i]`` (in place, as
        :func:`gefen_dist.core.step.ema_foreach_`), the ratios after."""
        for vs, blocks in self._groups:
            self._ratios(vs, blocks[0])
        ema_foreach_(self.v_cols, [c.view_as(v) for c, v in zip(col_means, self.v_cols)], beta2)
        for vs, blocks in self._groups:
            self._ratios(vs, blocks[1])
