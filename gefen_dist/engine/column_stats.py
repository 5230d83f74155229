"""The factored second moment's column statistics over pieces (D12): this rank's float64 column
sums of ``g^2`` per tensor, one SUM all-reduce when any tensor is sharded, column means per row
block. Replicas that do not contribute add zeros, so the sums equal a single process's."""
from __future__ import annotations

from typing import Callable, List, Optional, Sequence, Tuple

import torch

from ..core.step import block_column_sumsq
from .layout import Piece

__all__ = ["piece_column_sums", "column_means", "ColumnTable"]


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
    :attr:`factors` launches over the others only (None when no tensor needs them)."""

    def __init__(self, kernels, tensors: Sequence[tuple], device: torch.device,
                 factored: Optional[Sequence[bool]] = None):
        if not tensors:
            raise ValueError("ColumnTable needs at least one factored tensor")
        self.vcols = [t[0] for t in tensors]
        self.sums = kernels.ColumnSums([t[1] for t in tensors], device)
        need = [True] * len(self.vcols) if factored is None else [bool(f) for f in factored]
        wanted = [v for v, f in zip(self.vcols, need) if f]
        self.factors = kernels.ColumnFactors(wanted, device) if wanted else None
        it = iter(self.factors.views if self.factors is not None else [])
        self.factor_views = [next(it) if f else None for f in need]
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
