"""The learner: periods and the codebook from the first nonzero gradient, over pieces (D3, D4, D6).

Every function here takes the pieces this rank holds (:class:`gefen_dist.engine.layout.Piece`: a
contiguous range of a global tensor's flattening, with the gradient of that range) and the
communicator of the optimizer's process group; every rank reaches the same decisions from the
same collectives, entered by all ranks in the same order. Nothing here holds optimizer state:
the optimizers (and their backends) allocate state from what these functions return.
"""
from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from ..core import codebook as _codebook
from ..core import periods as _periods
from ..core import rows8 as _rows8
from ..core import span as _span
from ..core.quant import NUM_BINS
from ..kernels import dispatch as _dispatch
from .layout import Piece

__all__ = ["live_pieces", "learn_periods", "learn_periods_by_key", "global_histogram", "learn_codebook", "CodebookFit",
           "check_same_tensors", "check_agreement"]


def live_pieces(comm, pieces: Sequence[Piece]) -> List[bool]:
    """Which pieces belong to a tensor whose gradient is nonzero somewhere (one MAX all-reduce of a
    small vector; NaN counts as nonzero, so a non-finite gradient is never mistaken for 'not yet')."""
    amax = torch.tensor([float(pc.grad.abs().max()) if pc.grad is not None and pc.grad.numel() else 0.0
                         for pc in pieces], dtype=torch.float64)
    comm.all_reduce_max_(amax)
    return [bool(a > 0) or math.isnan(float(a)) for a in amax.tolist()]


def learn_periods(comm, pieces: Sequence[Piece], fixed: Sequence[Optional[int]]) -> List[int]:
    """The period of each piece's tensor (D1, D6): the paper's rule on the global gradient, from
    partial statistics that each rank computes for what it holds and one all-gather combines.
    Every rank passes the same tensors in the same order (a piece of each). ``fixed[i]``: the
    period the tensor's mode fixes (:func:`gefen_dist.engine.state.fixed_period`), None to
    detect it; the list is the same on every rank, so the gathered payloads still line up."""
    found = learn_periods_by_key(comm, {i: (pc.shape, f) for i, (pc, f) in enumerate(zip(pieces, fixed))},
                                 {i: pc for i, pc in enumerate(pieces)})
    return [found[i] for i in range(len(pieces))]


def learn_periods_by_key(comm, tensors: Dict[Any, Tuple[Sequence[int], Optional[int]]], pieces: Dict[Any, Piece]
                         ) -> Dict[Any, int]:
    """:func:`learn_periods` for tensors that not every rank holds (DeepSpeed's flat buffers):
    ``tensors`` maps a rank-independent key to (global shape, fixed period or None) and is the
    same on every rank; ``pieces`` holds this rank's piece of some of them. One all-gather of the
    partials of the tensors to detect (none when every period is fixed)."""
    payload, cands = {}, {}
    for key, (shape, fixed) in tensors.items():
        n = int(math.prod(shape))
        cands[key] = [] if fixed is not None else _periods.candidate_periods(n)
        pc = pieces.get(key)
        if pc is None or len(cands[key]) < 3:
            continue
        g = pc.grad.reshape(-1) if pc.grad is not None else torch.zeros(0)
        payload[key] = _dispatch.grad_period_partials(g, pc.start, n, cands[key]).to_payload()
    detect = any(f is None for _, f in tensors.values())
    gathered = comm.all_gather_object(payload) if detect else []
    out = {}
    for key, (shape, fixed) in tensors.items():
        if fixed is not None:
            out[key] = int(fixed)
            continue
        n = int(math.prod(shape))
        if len(cands[key]) < 3:
            p_paper = 1
        else:
            parts = [_periods.PeriodPartials.from_payload(r[key]) for r in gathered if key in r]
            p_paper = _periods.select_paper_period(cands[key], _periods.combine_partials(parts, n))
        out[key] = _periods.resolve_period(p_paper, _periods.row_slab(shape))
    return out


def _narrow_piece(pc, narrow) -> "_span.SpanPiece":
    """The span piece whose blocks normalise a narrow-row piece's first gradient: blocks of rows for
    ``"span"`` (D16), single rows for ``"rows8"`` (D19, each row its own scale)."""
    sp = _span.SpanPiece.of(pc.shape, pc.start, pc.local.numel())
    return _rows8.kernel_piece(sp) if narrow == "rows8" else sp


def global_histogram(comm, items: Sequence[Tuple]) -> torch.Tensor:
    """The histogram (``NUM_BINS`` int64) of every quantized piece's gradient normalised by its
    scale blocks' absmax (``items``: (piece, scale block) or (piece, scale block, narrow)), summed
    over ranks (replicas counted once): what the codebook is learned from (D3). A span piece's
    blocks of rows (D16, ``narrow`` ``"span"``; ``"rows8"``: blocks of one row, D19) may be cut by the
    shards: their absmax is reduced first (one MAX all-reduce, entered whenever any such piece is
    listed, as on every rank)."""
    counts = torch.zeros(NUM_BINS, dtype=torch.int64)
    spans = [(pc, _narrow_piece(pc, sp[0])) for pc, _, *sp in items if sp and sp[0]]
    amax = {}
    if spans:
        parts = [_span.span_grad_absmax(pc.grad if pc.grad is not None else torch.zeros(pc.local.shape), sp).cpu()
                 for pc, sp in spans]
        buf = torch.cat(parts)
        comm.all_reduce_max_(buf)
        amax = {id(pc): (a, sp) for (pc, sp), a in zip(spans, buf.split([p.numel() for p in parts]))}
    for pc, block, *sp in items:
        if pc.contributes and pc.grad is not None and pc.grad.numel():
            if id(pc) in amax:
                _span.span_histogram(pc.grad, *amax[id(pc)], counts)
            else:
                _dispatch.block_histogram(pc.grad, block, out=counts)
    comm.all_reduce_sum_(counts)
    return counts


@dataclass
class CodebookFit:
    """A learned codebook and what the report and logs say about it."""

    codebook: torch.Tensor  # float32 [256], CPU
    info: Dict[str, Any]


def learn_codebook(counts: torch.Tensor, symmetric: bool = True, k: int = 256) -> CodebookFit:
    """The job's codebook from the global histogram (the exact DP, native when it builds), with its
    summary: active bins, SSE, method, values, RMS error (normalised units), the DP's time and
    whether it was fitted to the histogram and its mirror image (``symmetric``, D17: the default of
    every optimizer; False is the paper's codebook). The SSE and RMS error are the fitted
    histogram's (for ``symmetric``, twice the values). ``k``: the number of codewords (16 for
    ``second_moment="nibbles"``, D20)."""
    fitted = _codebook.mirrored_counts(counts) if symmetric else counts.numpy()
    res = _dispatch.solve_codebook(fitted, k=k)
    total = int(fitted.sum())
    info = dict(active_bins=res.active_bins, sse=res.sse, method=res.method, values=int(counts.sum()),
                rms_error=math.sqrt(res.sse / max(1, total)), seconds_dp=res.seconds, symmetric=bool(symmetric))
    return CodebookFit(res.codebook.to(torch.float32), info)


def check_same_tensors(comm, shapes: Sequence[Sequence[int]]) -> None:
    """Raise on every rank if ranks hold different lists of quantized tensors to learn. Fixed-size
    (4 int64), so the check itself cannot mismatch; it runs before the variable-size collectives
    of :func:`learn_periods`, where ranks about to learn different tensors (an extra parameter on
    one rank) would otherwise make gloo abort the process or NCCL hang instead of a clear error."""
    if comm.world_size == 1:
        return
    h = int.from_bytes(hashlib.sha256(repr([tuple(s) for s in shapes]).encode()).digest()[:6], "little")
    t = torch.tensor([len(shapes), -len(shapes), h, -h], dtype=torch.int64)
    comm.all_reduce_max_(t)
    if int(t[0]) != -int(t[1]) or int(t[2]) != -int(t[3]):
        what = (f"this rank has {len(shapes)} quantized tensors; ranks hold between {-int(t[1])} and "
                f"{int(t[0])}" if int(t[0]) != -int(t[1]) else
                f"all have {len(shapes)} quantized tensors, but their shapes differ")
        raise RuntimeError(
            f"gefen_dist: ranks disagree about the tensors to learn ({what}). Every rank must build "
            "Gefen over the same parameters in the same order; check that the model and param groups "
            "are identical on all ranks."
        )


def check_agreement(comm, codebook: Optional[torch.Tensor], records: Sequence[Any]) -> None:
    """Raise on every rank unless all ranks hold the same codebook and per-tensor ``records``
    (periods, learned flags): one fixed-size digest comparison."""
    if comm.world_size == 1:
        return
    h = hashlib.sha256(codebook.cpu().numpy().tobytes() if codebook is not None else b"")
    for r in records:
        h.update(repr(r).encode())
    comm.check_agreement("periods and codebook", h.digest())
