"""Period detection (paper §2) made decomposable over pieces of a tensor (D1, D6).

The paper picks, for each tensor, the block length ``P`` over which the second moment is
shared.  With ``l_i = ln(f32(g_i)^2 + 1e-12)`` (float64) and ``mu_b`` the mean of ``l`` over
block ``b`` of ``p`` consecutive elements, the score of a candidate ``p`` is
``mean_b |mu_{b+1} - mu_b|``.  The candidates are the divisors of ``numel`` with at least four
blocks; the chosen period is the strict local maximum (p > 8) with the largest score, capped.

That score is a sum over adjacent block pairs, so it decomposes over any partition of the
flattened tensor into contiguous *pieces* (an FSDP2 shard, a DeepSpeed segment, a ZeRO-1
range): each piece sums the pairs it holds completely and reports the partial sums of the
few blocks at its edges (:class:`PeriodPartials`); :func:`combine_partials` merges them into the
exact global score.  A single process is the special case of one piece.

This module is pure math: no ``torch.distributed``.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Dict, List, Sequence, Tuple

import numpy as np
import torch

LOG_EPS = 1e-12
MIN_BLOCKS = 4
MIN_ELIGIBLE_PERIOD = 8  # a period must exceed this to be selected
PERIOD_CAP = 1024
SCALE_BLOCK_MAX = 256



def divisors(n: int) -> List[int]:
    """All divisors of ``n`` in ascending order."""
    if n <= 0:
        return []
    small, large = [], []
    i = 1
    while i * i <= n:
        if n % i == 0:
            small.append(i)
            if i != n // i:
                large.append(n // i)
        i += 1
    return small + large[::-1]


def candidate_periods(numel: int) -> List[int]:
    """Divisors ``p`` of ``numel`` with at least :data:`MIN_BLOCKS` blocks, ascending."""
    return [p for p in divisors(numel) if numel // p >= MIN_BLOCKS]


def log_sq_eager(grad: torch.Tensor) -> torch.Tensor:
    """``ln(f64(f32(g)^2) + 1e-12)`` of a flattened gradient, in float64 (the reference; the native
    kernel, :func:`gefen_dist.kernels.dispatch.log_sq`, may differ in the last bit of the logarithm)."""
    g = grad.reshape(-1).float()
    x = (g * g).double()
    if x.numel() and bool(torch.isinf(x).any()):
        # |g| > 1.8e19 overflows the float32 square (the reference then scores NaN): square in float64
        x = torch.where(torch.isinf(x), g.double() * g.double(), x)
    return torch.log(x + LOG_EPS)


@dataclass
class PeriodPartials:
    """What one contiguous piece ``[start, start+length)`` of a tensor knows about each candidate.

    For candidate ``k`` with period ``p``, the piece touches blocks ``b0[k]..b1[k]``. Blocks strictly
    between them are complete and private to the piece; ``internal[k]`` is the sum of ``|dmu|``
    over adjacent pairs of those interior blocks. ``edge_blocks[k]``/``edge_sums[k]`` hold the sums
    of ``l`` over blocks ``b0, b0+1, b1-1, b1`` (those that exist; edge blocks may be partial).
    """

    start: int
    length: int
    periods: List[int]
    internal: List[float]
    edge_blocks: List[List[int]] = field(default_factory=list)
    edge_sums: List[List[float]] = field(default_factory=list)

    def to_payload(self) -> Tuple:
        """A plain picklable tuple (for an all-gather of Python objects)."""
        return (self.start, self.length, self.periods, self.internal, self.edge_blocks, self.edge_sums)

    @classmethod
    def from_payload(cls, t: Tuple) -> "PeriodPartials":
        return cls(*t)


def grad_period_partials_eager(grad: torch.Tensor, start: int, numel: int, periods: Sequence[int]) -> PeriodPartials:
    """``period_partials_eager(log_sq_eager(grad), start, numel, periods)`` for a gradient piece: the
    reference of the native kernels' fused statistics (:mod:`gefen_dist.kernels.dispatch`)."""
    return period_partials_eager(log_sq_eager(grad.reshape(-1)).cpu(), start, numel, periods)


def partials_from(start: int, length: int, periods: Sequence[int], res) -> PeriodPartials:
    internal, edge_blocks, edge_sums = res
    return PeriodPartials(start=start, length=length, periods=list(periods), internal=internal,
                          edge_blocks=edge_blocks, edge_sums=edge_sums)


def period_partials_eager(l: torch.Tensor, start: int, numel: int, periods: Sequence[int]) -> PeriodPartials:
    """Partial period statistics of one piece (numpy; the reference the native kernel is tested against).

    ``l`` is :func:`log_sq_eager` of the piece (float64, 1-D) whose first element sits at flat offset
    ``start`` of a tensor with ``numel`` elements; ``periods`` are the candidates (divisors of numel).

    Vectorised over candidates: block sums come from one prefix sum, boundaries for many
    candidates are gathered in one pass (chunked to bound memory).
    """
    length = int(l.numel())
    out = PeriodPartials(start=start, length=length, periods=list(periods), internal=[0.0] * len(periods))
    out.edge_blocks = [[] for _ in periods]
    out.edge_sums = [[] for _ in periods]
    if length == 0 or not periods:
        return out
    end = start + length
    ln = l.detach().cpu().numpy()
    prefix = np.zeros(length + 1, dtype=np.float64)
    np.cumsum(ln, out=prefix[1:])

    def span_sum(a: int, b: int) -> float:  # sum of l over global [a, b) ∩ piece
        a, b = max(a, start), min(b, end)
        return float(prefix[b - start] - prefix[a - start])

    ps = torch.tensor(list(periods), dtype=torch.int64)
    b0 = torch.div(start, ps, rounding_mode="floor")
    b1 = torch.div(end - 1, ps, rounding_mode="floor")
    n_interior = (b1 - b0 - 1).clamp(min=0)  # complete blocks strictly between the edges

    # Edge information (a handful of scalars per candidate).
    for k, p in enumerate(periods):
        e0, e1 = int(b0[k]), int(b1[k])
        blocks = sorted({b for b in (e0, e0 + 1, e1 - 1, e1) if e0 <= b <= e1})
        out.edge_blocks[k] = blocks
        out.edge_sums[k] = [span_sum(b * p, (b + 1) * p) for b in blocks]

    # Interior pairs: sum |mu_{b+1} - mu_b| over the complete blocks strictly inside the piece.
    # Block sums are differences of the prefix sum taken at stride p: a strided *view*, so each
    # candidate costs O(length/p) and no index arrays are built; period 1 uses l directly.
    internal = [0.0] * len(periods)
    for k, p in enumerate(periods):
        ni = int(n_interior[k])
        if ni < 2:
            continue
        a = (int(b0[k]) + 1) * p - start  # first interior boundary, local coordinates
        if p == 1:
            internal[k] = float(np.abs(np.diff(ln[a:a + ni])).sum())
            continue
        mu = np.diff(prefix[a:a + ni * p + 1:p]) / p  # ni block means from ni + 1 boundaries
        internal[k] = float(np.abs(np.diff(mu)).sum())
    out.internal = internal
    return out


def combine_partials(parts: Sequence[PeriodPartials], numel: int) -> List[float]:
    """Exact global scores from the partials of pieces that tile ``[0, numel)``.

    Identical pieces (replicas) are counted once; overlapping but different pieces are an error.
    """
    uniq: Dict[Tuple[int, int], PeriodPartials] = {}
    for part in parts:
        if part.length > 0:
            uniq.setdefault((part.start, part.length), part)
    pieces = sorted(uniq.values(), key=lambda q: q.start)
    pos = 0
    for q in pieces:
        if q.start != pos:
            raise ValueError(
                f"period statistics: pieces do not tile the tensor (gap or overlap at offset {pos}, "
                f"next piece starts at {q.start}); every element must be held by exactly one piece"
            )
        pos = q.start + q.length
    if pos != numel:
        raise ValueError(f"period statistics: pieces cover {pos} of {numel} elements")
    periods = pieces[0].periods
    scores = []
    for k, p in enumerate(periods):
        nblocks = numel // p
        sums: Dict[int, float] = {}
        internal = 0.0
        pairs = set()
        for q in pieces:
            internal += q.internal[k]
            for b, s in zip(q.edge_blocks[k], q.edge_sums[k]):
                # edge blocks shared between pieces are summed; interior-adjacent ones appear once
                sums[b] = sums.get(b, 0.0) + s
            e0, e1 = q.edge_blocks[k][0], q.edge_blocks[k][-1]
            for b in (e0 - 1, e0, e1 - 1, e1):
                if 0 <= b and b + 1 < nblocks:
                    pairs.add(b)
        # An interior-adjacent block (b0+1 / b1-1) is reported by exactly one piece, an edge block
        # by every piece that touches it: but a block reported as both edge of one piece and
        # interior-adjacent of another cannot happen (interior blocks are private).
        total = internal
        for b in sorted(pairs):
            total += abs(sums[b + 1] - sums[b]) / p
        scores.append(total / (nblocks - 1))
    return scores


def select_paper_period(periods: Sequence[int], scores: Sequence[float]) -> int:
    """The paper's selection: strict local maxima at inner list positions with p > 8, best
    score wins (ties: the larger p); none gives 1. Then the cap: a period above 1024 becomes
    its smallest divisor exceeding 1024."""
    best_p, best_s = 1, -math.inf
    for i in range(1, len(periods) - 1):
        p, s = periods[i], scores[i]
        if p <= MIN_ELIGIBLE_PERIOD:
            continue
        if s > scores[i - 1] and s > scores[i + 1]:
            if s > best_s or (s == best_s and p > best_p):
                best_p, best_s = p, s
    if best_p > PERIOD_CAP:
        best_p = next(d for d in divisors(best_p) if d > PERIOD_CAP)
    return best_p


def paper_period(grad: torch.Tensor, partials=grad_period_partials_eager) -> int:
    """The reference's period for a whole (unsharded) gradient: one piece (``partials``: how to
    compute the statistics, e.g. the native kernels' :func:`gefen_dist.kernels.dispatch.grad_period_partials`)."""
    n = grad.numel()
    cands = candidate_periods(n)
    if len(cands) < 3:
        return 1
    part = partials(grad, 0, n, cands)
    return select_paper_period(cands, combine_partials([part], n))


def row_slab(shape: Sequence[int]) -> int:
    """Elements in one dim-0 row (D1): ``prod(shape[1:])``; 1 for 0-D/1-D."""
    return int(math.prod(shape[1:])) if len(shape) >= 2 else 1


AUTO_ROW_BLOCKS_MAX = 8  # row_blocks="auto": at most this many blocks
# the rule from the shape: "auto", or "shape", its spelling where "auto" means something else (a Hugging Face
# DeepSpeed JSON: there the Trainer fills in every "auto" value and refuses one it does not know)
BY_SHAPE = ("auto", "shape")
AUTO_COL_BLOCKS_MAX = 8  # col_blocks="auto" (D21): at most this many blocks


def factored_row_blocks(shape: Sequence[int], rule="auto") -> int:
    """How many contiguous blocks of rows of a factored tensor keep their own column profile (D12).

    ``rule="auto"``: a tensor of ``R = k * S`` rows of ``S`` elements (an integer ``2 <= k <= 8``)
    gets ``k`` blocks of ``S`` rows, every other tensor one (``k`` above 8, i.e. tall thin tensors,
    was not measured and keeps one profile). A fused attention input projection
    ``[3d, d]`` thus gets one column profile each for q, k and v, an MLP up-projection ``[4d, d]``
    one per block of ``d`` hidden units. An int ``G`` asks for ``G`` blocks (it must divide the
    rows); ``1`` (or ``None``) is Adafactor's single column profile."""
    return _factored_blocks(shape, rule, cols=False)


def _factored_blocks(shape: Sequence[int], rule, cols: bool) -> int:
    """:func:`factored_row_blocks` (``cols`` False: blocks of rows, as many as the rows hold rows' lengths)
    or :func:`factored_col_blocks` (True: blocks of columns, as many as a row holds the row count)."""
    if len(shape) < 2 or rule is None:
        return 1
    rows, slab = int(shape[0]), row_slab(shape)
    name, total, unit = ("col_blocks", slab, rows) if cols else ("row_blocks", rows, slab)
    if rule in BY_SHAPE:
        cap = AUTO_COL_BLOCKS_MAX if cols else AUTO_ROW_BLOCKS_MAX
        return total // unit if unit > 0 and 2 * unit <= total <= cap * unit and total % unit == 0 else 1
    if isinstance(rule, bool) or not isinstance(rule, int) or rule < 1:
        raise ValueError(f"{name} must be 'auto', None or a positive int, got {rule!r}")
    if total % rule:
        what = f"the rows of {slab} elements" if cols else f"the {rows} rows"
        raise ValueError(f"{name}={rule} does not divide {what} of a tensor of shape {tuple(shape)}; use a divisor "
                         f"of {total}, 'auto' or 1")
    return int(rule)


def factored_col_blocks(shape: Sequence[int], rule=1) -> int:
    """How many contiguous blocks of columns of a factored tensor keep their own row statistic (D21,
    D12 transposed): ``v_ij = v_row[i, b(j)] * v_col_j / mean_{j' in b(j)} v_col_j'``.

    ``rule="auto"``: a tensor of ``R`` rows of ``k * R`` elements (an integer ``2 <= k <= 8``) gets
    ``k`` blocks of ``R`` columns, every other tensor one. Hugging Face GPT-2's ``Conv1D`` weights are
    stored ``(in, out)``, so its fused q, k, v projection ``[d, 3d]`` gets one block each for q, k and
    v (the sections D12's row blocks give an ``nn.Linear`` ``[3d, d]``), its MLP up-projection
    ``[d, 4d]`` one per block of ``d`` hidden units; in the ``nn.Linear`` layout the rule takes the MLP
    down-projection ``[d, 4d]``. An int ``K`` asks for ``K`` blocks (it must divide the row); ``1`` (or
    ``None``) is one row statistic per row. A tensor has row blocks or column blocks, not both."""
    return _factored_blocks(shape, rule, cols=True)


def resolve_period(p_paper: int, slab: int) -> int:
    """D1: share the second moment within a row only: ``gcd(P_paper, slab)``."""
    return math.gcd(int(p_paper), int(slab))


def shape_period(shape: Sequence[int], col_blocks: int = 1) -> int:
    """The period of a tensor from its shape alone: the row length ``prod(shape[1:])``, capped as
    the paper caps a detected period (a period above 1024 becomes its smallest divisor above
    1024). The factored second moment's period (it sets only the absmax-scale block there, D14),
    and the estimate of ``gefen-dist plan``. With ``col_blocks`` (D21) the rule applies to one
    block of columns, so that no absmax-scale block straddles two of them."""
    row = row_slab(shape) // int(col_blocks)
    if row <= PERIOD_CAP:
        return row
    return next(d for d in divisors(row) if d > PERIOD_CAP)


def nibble_period(shape: Sequence[int]) -> int:
    """``second_moment="nibbles"`` (D20): the period of a tensor, which there too sets only the
    first moment's absmax-scale block: the largest divisor of the row that is at most 256 (a
    four-bit first moment wants a finer scale than the row), or :func:`shape_period` where that
    divisor is under 32 (rows of a large prime length)."""
    row = row_slab(shape)
    d = max(x for x in divisors(row) if x <= SCALE_BLOCK_MAX)
    return d if d >= 32 or d == row else shape_period(shape)


def scale_block_for(period: int, slab: int) -> int:
    """Absmax-scale block: the period itself, or for period 1 the largest divisor of the row
    that is at most 256 (row-aligned, D1)."""
    if period > 1:
        return period
    return max(d for d in divisors(slab) if d <= SCALE_BLOCK_MAX)
