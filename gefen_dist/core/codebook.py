"""Optimal Gefen codebook from a histogram of normalised values (pure math, no collectives).

The normalised values z in [-1, 1] are binned into ``NUM_BINS`` bins,
``j = clamp(floor((z + 1) * 2048), 0, 4095)``, with centres ``c_j = -1 + (2j + 1) / 4096``.
The active bins (count > 0) give N ascending weighted points. The codebook has
``NUM_CODEWORDS = K`` entries: the first is pinned to -1, the last to +1, the others are the
float32 weighted means of their clusters, and the clustering (contiguous segments of the
sorted points) minimises the weighted SSE exactly:

    D[0][0] = 0;  D[e][k] = min_{s=k..e} D[s-1][k-1] + cost_k(s, e)   (ties: smallest s)

with cost_1 / cost_K the SSE around -1 / +1 and cost_k the SSE around the segment mean, all
from float64 prefix sums. The reference evaluates this in O(K N^2); here the middle layers
use divide-and-conquer over the monotone smallest argmin (the SSE cost satisfies the
quadrangle inequality), O(K N log N), here in numpy and in C (``kernels/csrc/dp.c``, passed in
as ``dp`` by :mod:`gefen_dist.kernels.dispatch`), which evaluates every cost with the same IEEE
operations, so both agree bit for bit.

With fewer than K active bins the reference's padding is faulty (it overwrites c_1 and
duplicates codewords); gefen_dist instead keeps -1, +1 and every active centre and fills the
remaining slots by repeatedly inserting the midpoint of the currently largest gap (leftmost on
ties). At N = K - 1 those are K + 1 values, so the one centre cheapest to snap to its nearest
neighbour is left out (and ``sse`` reports that cost; otherwise it is 0).
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Callable, Optional, Tuple

import numpy as np
import torch

logger = logging.getLogger(__name__)

NUM_BINS = 4096
NUM_CODEWORDS = 256

__all__ = [
    "NUM_BINS",
    "NUM_CODEWORDS",
    "CodebookResult",
    "bin_centres",
    "solve_codebook",
    "dp_segments",
    "mirrored_counts",
]


# (W, S, Q, K) -> (1-based segment starts int64 [K], objective): the middle of the DP
DPSolver = Callable[[np.ndarray, np.ndarray, np.ndarray, int], Tuple[np.ndarray, float]]


@dataclass
class CodebookResult:
    codebook: torch.Tensor  # float32 [NUM_CODEWORDS], CPU, strictly ascending
    active_bins: int
    sse: float
    seconds: float
    method: str  # "native-dc", "numpy-dc" or "pad"
    # cluster (codeword) index of each active bin, ascending bin order; int64 [active_bins]
    assignment: Optional[np.ndarray] = None


def bin_centres() -> np.ndarray:
    """float32 [NUM_BINS] bin centres -1 + (2j + 1) / 4096 (exact in float32)."""
    j = np.arange(NUM_BINS, dtype=np.float64)
    return (-1.0 + (2.0 * j + 1.0) / NUM_BINS).astype(np.float32)


# --------------------------------------------------------------------------------------
# numpy backend (same arithmetic as dp.c, one vectorised pass per recursion level)
# --------------------------------------------------------------------------------------

def _cost_mean(W, S, Q, s, e):
    w = W[e] - W[s - 1]
    sx = S[e] - S[s - 1]
    q = Q[e] - Q[s - 1]
    return q - (sx * sx) / w


def _cost_lo(W, S, Q, s, e):
    w = W[e] - W[s - 1]
    sx = S[e] - S[s - 1]
    q = Q[e] - Q[s - 1]
    return (q + 2.0 * sx) + w


def _cost_hi(W, S, Q, s, e):
    w = W[e] - W[s - 1]
    sx = S[e] - S[s - 1]
    q = Q[e] - Q[s - 1]
    return (q - 2.0 * sx) + w


def _dp_numpy(W: np.ndarray, S: np.ndarray, Q: np.ndarray, K: int) -> Tuple[np.ndarray, float]:
    n = W.shape[0] - 1
    stride = n + 1
    arg = np.zeros((K + 1, stride), dtype=np.int64)
    prev = np.full(stride, np.inf)
    cur = np.full(stride, np.inf)

    e1 = np.arange(1, n - K + 2)
    prev[e1] = _cost_lo(W, S, Q, np.ones_like(e1), e1)
    arg[1, e1] = 1

    for k in range(2, K):
        top = n - K + k
        lo = np.array([k], dtype=np.int64)
        hi = np.array([top], dtype=np.int64)
        olo = lo.copy()
        ohi = hi.copy()
        argk = arg[k]
        while lo.size:
            mid = (lo + hi) >> 1
            cnt = np.minimum(mid, ohi) - olo + 1
            first = np.empty_like(cnt)
            first[0] = 0
            np.cumsum(cnt[:-1], out=first[1:])
            total = int(first[-1] + cnt[-1])
            s = np.arange(total, dtype=np.int64) + np.repeat(olo - first, cnt)
            e = np.repeat(mid, cnt)
            val = prev[s - 1] + _cost_mean(W, S, Q, s, e)
            mn = np.minimum.reduceat(val, first)
            cand = np.where(val == np.repeat(mn, cnt), s, np.int64(n + 1))
            best = np.minimum.reduceat(cand, first)
            cur[mid] = mn
            argk[mid] = best
            left = mid > lo
            right = mid < hi
            lo = np.concatenate((lo[left], mid[right] + 1))
            hi = np.concatenate((mid[left] - 1, hi[right]))
            olo, ohi = (np.concatenate((olo[left], best[right])),
                        np.concatenate((best[left], ohi[right])))
        prev, cur = cur, prev

    s = np.arange(K, n + 1)
    val = prev[s - 1] + _cost_hi(W, S, Q, s, np.full_like(s, n))
    i = int(np.argmin(val))  # first minimum: smallest s
    arg[K, n] = s[i]
    obj = float(val[i])

    starts = np.empty(K, dtype=np.int64)
    e = n
    for k in range(K, 0, -1):
        sk = int(arg[k, e])
        starts[k - 1] = sk
        e = sk - 1
    return starts, obj


# --------------------------------------------------------------------------------------
# public entry points
# --------------------------------------------------------------------------------------

def _prefix(centres: np.ndarray, weights: np.ndarray) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
    c = np.asarray(centres, dtype=np.float32).astype(np.float64)
    w = np.asarray(weights, dtype=np.float64)
    wc = w * c
    wcc = wc * c
    n = c.shape[0]
    W = np.zeros(n + 1)
    S = np.zeros(n + 1)
    Q = np.zeros(n + 1)
    np.cumsum(w, out=W[1:])  # sequential accumulation
    np.cumsum(wc, out=S[1:])
    np.cumsum(wcc, out=Q[1:])
    return W, S, Q


def dp_segments(centres: np.ndarray, weights: np.ndarray, K: int = NUM_CODEWORDS,
                dp: Optional[DPSolver] = None) -> Tuple[np.ndarray, np.ndarray, float, str]:
    """Exact DP on ascending ``centres`` with positive ``weights`` (len N >= K >= 2).

    Returns ``(codebook float32 [K], seg_start int64 [K] (1-based), objective, method)``.
    ``dp``: the solver of the prefix-sum DP (``(W, S, Q, K) -> (starts, objective)``, e.g. the
    native one of :mod:`gefen_dist.kernels.dp`); None: this module's numpy solver.
    """
    n = int(np.asarray(centres).shape[0])
    if K < 2 or n < K:
        raise ValueError(f"dp_segments needs N >= K >= 2 (N={n}, K={K})")
    W, S, Q = _prefix(centres, weights)
    if dp is not None:
        starts, obj = dp(W, S, Q, K)
        method = getattr(dp, "method", "custom-dc")
    else:
        starts, obj = _dp_numpy(W, S, Q, K)
        method = "numpy-dc"
    ends = np.empty(K, dtype=np.int64)
    ends[:-1] = starts[1:] - 1
    ends[-1] = n
    means = (S[ends] - S[starts - 1]) / (W[ends] - W[starts - 1])
    cb = means.astype(np.float32)
    cb[0] = -1.0
    cb[-1] = 1.0
    return cb, starts, obj, method


def _pad_codebook(active: np.ndarray, weights: np.ndarray, K: int) -> np.ndarray:
    """Codebook for N < K active centres: -1, +1, every active centre, then midpoints.

    ``N = K - 1`` is the one case where -1, +1 and all centres do not fit (K + 1 values);
    then the centre that is cheapest to snap to its nearest neighbour (weight times squared
    distance; the leftmost on ties) is left out.
    """
    vals = np.concatenate(([-1.0], active.astype(np.float64), [1.0]))
    w = np.asarray(weights, dtype=np.float64)
    while vals.size > K:  # only at N = K - 1, once
        d = np.diff(vals)
        snap = w * np.minimum(d[:-1], d[1:]) ** 2
        i = int(np.argmin(snap))
        vals = np.delete(vals, i + 1)
        w = np.delete(w, i)
    out = vals.tolist()
    while len(out) < K:
        arr = np.asarray(out)
        i = int(np.argmax(np.diff(arr)))  # leftmost largest gap
        m = float(np.float32((arr[i] + arr[i + 1]) * 0.5))
        if not (arr[i] < m < arr[i + 1]):
            raise RuntimeError("codebook padding ran out of float32 resolution")
        out.insert(i + 1, m)
    return np.asarray(out, dtype=np.float32)


def _to_counts(counts) -> np.ndarray:
    if isinstance(counts, torch.Tensor):
        counts = counts.detach().cpu().numpy()
    arr = np.asarray(counts)
    if arr.shape != (NUM_BINS,):
        raise ValueError(f"counts must have shape ({NUM_BINS},), got {arr.shape}")
    if not (np.issubdtype(arr.dtype, np.integer) or arr.dtype == np.bool_):
        raise TypeError(f"counts must be an integer histogram, got dtype {arr.dtype}")
    arr = arr.astype(np.int64)
    if (arr < 0).any():
        raise ValueError("counts must be non-negative")
    return arr


def mirrored_counts(counts) -> np.ndarray:
    """The histogram plus its mirror image (int64 ``[NUM_BINS]``): bin ``j`` gets the counts of
    ``j`` and ``NUM_BINS - 1 - j``, whose centres are ``c`` and ``-c``. The DP on it minimises the
    first moment's quantization error averaged over a value and its negation, so the codebook
    resolves both signs alike whatever the sign balance of the first step's gradient (D17; the
    paper's codebook is the DP on the histogram itself)."""
    cnt = _to_counts(counts)
    return cnt + cnt[::-1]


def solve_codebook(counts, dp: Optional[DPSolver] = None, k: int = NUM_CODEWORDS) -> CodebookResult:
    """Optimal ``k``-entry codebook (256 by default; 16 for the one-byte layout's first moment,
    :mod:`gefen_dist.core.nibbles`) for a ``NUM_BINS`` histogram (int64 numpy array or torch tensor).
    ``dp``: as for :func:`dp_segments` (:func:`gefen_dist.kernels.dispatch.solve_codebook` passes the
    native solver when it builds; both give the same codebook bit for bit)."""
    t0 = time.perf_counter()
    cnt = _to_counts(counts)
    idx = np.flatnonzero(cnt)
    n = int(idx.size)
    centres = bin_centres()[idx]
    weights = cnt[idx].astype(np.float64)
    K = int(k)
    if K < 2:
        raise ValueError(f"solve_codebook needs k >= 2 codewords, got {k!r}")
    if n >= K:
        cb, starts, sse, method = dp_segments(centres, weights, K, dp=dp)
        assignment = np.repeat(np.arange(K, dtype=np.int64), np.diff(np.append(starts, n + 1)))
    else:
        cb = _pad_codebook(centres, weights, K)
        method = "pad"
        # nearest codeword (the left one on an exact tie)
        right = np.clip(np.searchsorted(cb, centres), 1, K - 1)
        go_left = (centres - cb[right - 1]) <= (cb[right] - centres)
        assignment = np.where(go_left, right - 1, right).astype(np.int64)
        diff = cb[assignment].astype(np.float64) - centres.astype(np.float64)
        sse = float(np.sum(weights * diff * diff))
    seconds = time.perf_counter() - t0
    logger.debug("codebook: N=%d method=%s sse=%.6g in %.4fs", n, method, sse, seconds)
    return CodebookResult(codebook=torch.from_numpy(cb.copy()), active_bins=n, sse=sse,
                          seconds=seconds, method=method, assignment=assignment)
