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
        a = x.abs().amax(dim=1, keepdim=True)
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
