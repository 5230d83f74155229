"""Codebook quantisation primitives (paper §3, §4 h-m; D3, D5). Pure math, no distributed."""
from __future__ import annotations

import torch

NUM_BINS = 4096
NUM_CODEWORDS = 256
_HIST_CHUNK = 1 << 22  # elements per chunk when building histograms (bounds int64 temporaries)


def block_histogram_eager(values: torch.Tensor, block: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """Add the 4096-bin histogram of ``values`` normalised by the absmax of each ``block``
    consecutive elements (the blocks that will actually scale them, D3) to ``out`` (int64).

    ``z = x / absmax`` in float32 (0 for all-zero blocks), ``bin = clamp(floor((z+1)*2048), 0, 4095)``.
    The reference (any device); :func:`gefen_dist.kernels.dispatch.block_histogram` uses the native
    kernel on CPU (bitwise the same counts)."""
    if out is None:
        out = torch.zeros(NUM_BINS, dtype=torch.int64)
    flat = values.reshape(-1)
    if flat.numel() == 0:
        return out
    if flat.numel() % block:
        raise ValueError(f"block_histogram: {flat.numel()} values are not a whole number of blocks of {block}")
    rows = flat.view(-1, block)
    step = max(1, _HIST_CHUNK // block)
    for r0 in range(0, rows.shape[0], step):
        x = rows[r0:r0 + step].float()
        scaled_histogram(x, x.abs().amax(dim=1, keepdim=True), out)
    return out


def scaled_histogram(x: torch.Tensor, a: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """Add the histogram of float32 ``x`` normalised by ``a`` (its absmax scales, broadcast against
    it; 0 for all-zero blocks) to ``out``: :func:`block_histogram_eager`'s binning, for blocks that
    are not runs of consecutive elements of one piece (D16's blocks of rows, whose absmax is
    reduced over the ranks that hold them)."""
    z = torch.where(a > 0, x / torch.where(a > 0, a, torch.ones_like(a)), torch.zeros_like(x))
    bins = torch.floor((z + 1.0) * 2048.0).clamp_(0, NUM_BINS - 1).to(torch.int64)
    out += torch.bincount(bins.reshape(-1), minlength=NUM_BINS).to(out.device)
    return out


def nearest_codeword(z: torch.Tensor, codebook: torch.Tensor) -> torch.Tensor:
    """Index (uint8) of the nearest codeword: ``j = #{C_k < z}``, candidates ``j-1`` and ``j``
    (clamped), the lower one on ties; values beyond the ends clamp; NaN maps to the last index (255
    for the ``NUM_CODEWORDS`` codebook; any ascending codebook of at most 256 entries works)."""
    last = codebook.numel() - 1
    j = torch.searchsorted(codebook, z.contiguous(), right=False)
    lo = (j - 1).clamp_(min=0)
    hi = j.clamp_(max=last)
    take_hi = (z - codebook[hi]).abs() < (z - codebook[lo]).abs()
    out = torch.where(take_hi, hi, lo)
    out = torch.where(torch.isnan(z), torch.full_like(out, last), out)
    return out.to(torch.uint8)


def dequantize(idx: torch.Tensor, scale: torch.Tensor, codebook: torch.Tensor, block: int) -> torch.Tensor:
    """``C[idx] * scale`` in float32, shaped ``[numel/block, block]``."""
    return codebook[idx.reshape(-1, block).long()] * scale.reshape(-1, 1)


def flip_points(codebook: torch.Tensor) -> torch.Tensor:
    """For each pair of adjacent codewords ``(C[k], C[k+1])`` (``C[256] = +inf`` past the end), the
    smallest float32 ``z`` that the two-candidate rule sends to the upper one (``z > C[k+1]`` or
    ``|z - C[k+1]| < |z - C[k]|``, float32 differences; :func:`nearest_codeword`'s tie rule): float32
    ``[len(codebook)]``, ``+inf`` for the last pair. The rule is monotone in ``z`` (below ``C[k]`` both
    differences are negative and ``|z - C[k+1]| >= |z - C[k]|``, rounding being monotone; between the
    two codewords one difference shrinks as the other grows; above ``C[k+1]`` it holds), so a bisection
    over the float32 bit patterns finds the switch exactly, and for every non-NaN ``z`` whose candidates
    are ``k`` and ``k + 1`` the nearest index is ``k + (z >= flip_points[k])``: what the kernels use instead
    of comparing two distances (the AVX2 C kernel computes the same points in C)."""
    import numpy as np

    c = codebook.detach().to("cpu", torch.float32).numpy().astype(np.float32)
    c0, c1 = c, np.append(c[1:], np.float32(np.inf)).astype(np.float32)

    def upper(z):
        with np.errstate(invalid="ignore"):
            return (z > c1) | (np.abs((z - c1).astype(np.float32)) < np.abs((z - c0).astype(np.float32)))

    def key(x):  # float32 -> a signed integer in the floats' order (both zeros -> 0)
        u = x.astype(np.float32).view(np.uint32).astype(np.int64)
        return np.where(u >> 31 == 1, -(u & 0x7FFFFFFF), u)

    def unkey(k):
        u = np.where(k < 0, (-k) | 0x80000000, k).astype(np.uint32)
        return u.view(np.float32)

    out = np.full(c.shape, np.inf, dtype=np.float32)
    live = np.isfinite(c1)
    at_c0 = live & upper(c0)
    out[at_c0] = c0[at_c0]
    live &= ~at_c0
    lo, hi = key(c0), key(np.where(live, c1, c0)) + 1  # the rule is false at lo, true at hi (the float above c1)
    while True:
        go = live & (hi - lo > 1)
        if not go.any():
            break
        mid = lo + (hi - lo) // 2
        up = upper(unkey(mid))
        hi = np.where(go & up, mid, hi)
        lo = np.where(go & ~up, mid, lo)
    out[live] = unkey(hi)[live]
    return torch.from_numpy(out)


def bucket_entries(cb: torch.Tensor, lut: torch.Tensor) -> torch.Tensor:
    """The nearest-codeword table of the kernels' two-candidate mode as one 16-byte entry per bucket:
    float32 ``[nb, 4]``, row ``b`` = ``(C[j], C[j + 1], flip point of the pair, j)`` with ``j = lut[b]``
    (the int32 ``j`` stored as its bits), ``cb`` the 257-entry codebook (``cb[256] = +inf``). A kernel
    that reads the row takes ``j + (z >= flip point)`` and the matching codeword: exactly the two-candidate
    rule (:func:`flip_points`), with no dependent lookup. One builder for the C kernel's AVX2 path and
    the Triton update kernel."""
    cbf = cb.detach().to("cpu", torch.float32).reshape(-1)
    j = lut.detach().to("cpu", torch.int32).reshape(-1)
    thr = flip_points(cbf[:-1])
    jl = j.long()
    return torch.stack([cbf[jl], cbf[jl + 1], thr[jl], j.view(torch.float32)], dim=1).contiguous()
