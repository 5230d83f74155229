"""The factored second moment's column statistics over pieces (D12): this rank's float64 column
sums of ``g^2`` per tensor, one SUM all-reduce when any tensor is sharded, column means per row
block. Replicas that do not contribute add zeros, so the sums equal a single process's."""
from __future__ import annotations

from typing import Callable, List, Sequence, Tuple

import torch

from ..core.step import block_column_sumsq
from .layout import Piece

__all__ = ["piece_column_sums", "column_means"]


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
