"""ZeroGefen's partition plan and wire format: pure functions (no ``torch.distributed``).

The partition cuts the global parameter space into per-rank contiguous ranges aligned to each
tensor's unit (scale block, row, or element) and balanced by state bytes; the wire helpers size
the per-step all-gather. Used by :mod:`gefen_dist.zero.optimizer` and its benchmark.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

import torch

from ..engine.comm import pad_bytes as _pad

MODE_LOCAL = 0       # nothing travels (a quantized tensor whose gradient was always zero: decay only)
MODE_COMPRESSED = 1  # idx bytes + per-block fp32 (M, sigma): period > 1
MODE_DENSE = 2       # new values in the parameter's dtype: exact tensors and period == 1
MODE_FACTORED = 3    # second_moment="factored": idx bytes + per-block fp32 M + per-row fp32 sqrt(v_row)
MODE_SPAN = 4        # narrow_rows="span" (D16): idx bytes (the block state is replicated, reduced over the ranks)

# ---------------------------------------------------------------------------------------------
# partition of the global parameter space
# ---------------------------------------------------------------------------------------------

def partition(specs: Sequence[Tuple[int, int, int]], world_size: int) -> List[List[Tuple[int, int]]]:
    """Split tensors concatenated in order into ``world_size`` contiguous, balanced ranges.

    ``specs[i] = (numel, unit, cost)``: tensor ``i`` may only be cut at multiples of ``unit``
    elements (its scale block; ``numel`` must be a multiple of it), and one unit costs ``cost``
    (its state bytes). Cut ``k`` is the allowed cut point whose cumulative cost is nearest to
    ``k / world_size`` of the total (ties to the later one), so every rank's cost differs from
    the mean by at most one unit's cost of the tensors it is cut in. Returns
    ``ranges[i][r] = (start, end)``: the flat elements of tensor ``i`` owned by rank ``r``
    (``start == end`` when it owns none). Integer arithmetic: every rank computes the same.
    """
    W = int(world_size)
    offs, coffs = [], []
    total = ctotal = 0
    for n, u, c in specs:
        if u < 1 or n % u or c < 0:
            raise ValueError(f"partition: numel {n} is not a multiple of its unit {u} (cost {c})")
        offs.append(total)
        coffs.append(ctotal)
        total += n
        ctotal += (n // u) * c
    cuts = [0]
    i = 0
    for k in range(1, W):
        # the tensor holding the target cost k*C/W (skipping zero-cost tensors at the boundary)
        while i < len(specs) and (coffs[i] + (specs[i][0] // specs[i][1]) * specs[i][2]) * W <= k * ctotal:
            i += 1
        if i >= len(specs):
            c = total
        else:
            n, u, cu = specs[i]
            X = k * ctotal - coffs[i] * W  # (target - cost offset) * W, >= 0
            units = (2 * X + cu * W) // (2 * cu * W)  # nearest whole unit, ties up
            c = offs[i] + min(n, units * u)
        cuts.append(max(c, cuts[-1]))
    cuts.append(total)
    out = []
    for (n, _, _), off in zip(specs, offs):
        rs = []
        for r in range(W):
            s = min(max(cuts[r] - off, 0), n)
            e = min(max(cuts[r + 1] - off, 0), n)
            rs.append((s, max(s, e)))
        out.append(rs)
    return out


def unit_cost(exact: bool, period: int, scale_block: int, row: Optional[int] = None) -> Tuple[int, int]:
    """``(unit, cost)`` of a tensor for :func:`partition`: exact tensors are cut anywhere and
    cost 8 bytes (fp32 m and v) per element; quantized ones only at scale blocks ``B``, which
    cost ``B`` idx bytes + one fp32 scale + ``B/P`` fp32 second moments. ``row`` given: a
    factored (``second_moment="factored"``) tensor with rows of ``row`` elements, cut only at
    rows, a row costing ``row`` idx bytes + ``row/B`` fp32 scales + one fp32 ``v_row`` (its
    replicated ``v_col`` is the same on every rank and does not enter the balance)."""
    if exact:
        return 1, 8
    if row is not None:
        row = int(row)
        return row, row + 4 * (row // int(scale_block)) + 4
    B = max(int(period), int(scale_block))
    return B, B + 4 + 4 * (B // int(period))


@dataclass
class Partition:
    """The partition in force: ``ranges[j][r]`` for parameter ``params[j]``."""

    params: List[torch.Tensor]
    units: List[int]
    ranges: List[List[Tuple[int, int]]]

    def __post_init__(self):
        self.index = {id(p): j for j, p in enumerate(self.params)}
        self.shapes = [tuple(p.shape) for p in self.params]  # what the state was cut for
        self.key = tuple(id(p) for p in self.params)

    def of(self, p: torch.Tensor) -> List[Tuple[int, int]]:
        return self.ranges[self.index[id(p)]]


def step_wire_bytes(items: Sequence[tuple], world_size: int) -> List[int]:
    """Bytes each rank puts in the step's all-gather (before padding to the largest).

    ``items``: per updated parameter ``(mode, period, itemsize, ranges)`` with ``ranges[r]`` the
    flat range rank ``r`` owns; for ``MODE_FACTORED`` ``(mode, scale_block, itemsize, ranges, row)``.
    Compressed: ``n`` idx bytes + ``2 * n / P`` float32 (M, sigma); factored: ``n`` idx bytes +
    ``n / B`` float32 M + ``n / row`` float32 ``sqrt(v_row)``; span: ``n`` idx bytes; dense: ``n * itemsize`` bytes; each
    segment padded to 8 bytes. This is the function the optimizer sizes its buffers with (and the
    benchmark counts with).
    """
    sizes = [0] * world_size
    for mode, period, itemsize, ranges, *rest in items:
        for r, (s, e) in enumerate(ranges):
            n = e - s
            if n == 0 or mode == MODE_LOCAL:
                continue
            if mode == MODE_COMPRESSED:
                sizes[r] += _pad(n) + _pad(4 * (n // period)) * 2
            elif mode == MODE_FACTORED:
                sizes[r] += _pad(n) + _pad(4 * (n // period)) + _pad(4 * (n // int(rest[0])))
            elif mode == MODE_SPAN:
                sizes[r] += _pad(n)
            else:
                sizes[r] += _pad(n * itemsize)
    return sizes


def factored_wire_compressed(scale_block: int, row: int, itemsize: int) -> bool:
    """Whether a factored tensor's update travels compressed (``MODE_FACTORED``): when
    ``1 + 4/B + 4/row`` bytes per element (idx + M + sqrt(v_row)) are fewer than the parameter's
    ``itemsize``; otherwise its new values travel (``MODE_DENSE``). Integer arithmetic."""
    B, row = int(scale_block), int(row)
    return B * row + 4 * row + 4 * B < int(itemsize) * B * row


# ---------------------------------------------------------------------------------------------
# the optimizer
# ---------------------------------------------------------------------------------------------
