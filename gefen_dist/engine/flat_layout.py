"""The layout of a flat buffer made of segments of many tensors (:mod:`gefen_dist.engine.flat`):
what each segment is, where its state lives (its slots), and how a range splits into whole
blocks and cut ones."""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from .layout import Geometry, is_exact
from .state import MODE_FACTORED, MODE_SHARED, StateSpec, factored_blocks, quantized_mode


@dataclass(frozen=True)
class Segment:
    """One rank-local contiguous piece of a global tensor inside a flat buffer."""

    key: str  # identical on every rank for the same tensor, unique within the buffer
    name: str
    shape: Tuple[int, ...]  # global shape
    param_offset: int  # start inside the flattened global tensor
    flat_offset: int  # start inside the flat buffer
    numel: int

    def as_dict(self) -> Dict[str, Any]:
        d = asdict(self)
        d["shape"] = list(self.shape)
        return d

    @classmethod
    def from_dict(cls, d: Dict[str, Any]) -> "Segment":
        return cls(d["key"], d["name"], tuple(int(s) for s in d["shape"]), int(d["param_offset"]),
                   int(d["flat_offset"]), int(d["numel"]))


class LayoutError(RuntimeError):
    """The flat buffer's layout could not be recovered or does not match the parameters."""


def verify_segments(flat: torch.Tensor, segments: Sequence[Segment], sources: Sequence[torch.Tensor],
                    where: str) -> None:
    """Check once that ``flat[segment] == source[segment]`` (the flat master copy of each piece
    equals the parameter's data, in the parameter's dtype); raise :class:`LayoutError` if not."""
    covered = 0
    flat_v = flat.detach().reshape(-1)
    for seg, src in zip(segments, sources):
        if seg.flat_offset < 0 or seg.flat_offset + seg.numel > flat_v.numel():
            raise LayoutError(f"{where}: segment of {seg.name!r} [{seg.flat_offset}, +{seg.numel}) lies outside "
                              f"the flat buffer of {flat_v.numel()} elements")
        covered += seg.numel
        if src is None or src.numel() == 0 or seg.numel == 0:
            continue
        a = flat_v[seg.flat_offset:seg.flat_offset + seg.numel]
        b = src.detach().reshape(-1)
        if b.numel() < seg.numel:
            continue  # data not resident here (swapped out): cannot compare
        b = b[:seg.numel] if b.numel() != math.prod(seg.shape) else b[seg.param_offset:seg.param_offset + seg.numel]
        if not torch.equal(a.to(device=b.device, dtype=b.dtype), b):
            raise LayoutError(
                f"{where}: the flat optimizer buffer does not hold parameter {seg.name!r} (shape {seg.shape}) "
                f"elements [{seg.param_offset}, {seg.param_offset + seg.numel}) at offset {seg.flat_offset}. "
                "The recovered layout is wrong (for DeepSpeed ZeRO-1/2 with round_robin_gradients this is a known "
                "DeepSpeed mapping bug: build the engine with gefen_dist.integrations.deepspeed.initialize, or "
                "disable round_robin_gradients). Refusing to treat the buffer as one tensor."
            )
    if covered > flat_v.numel():
        raise LayoutError(f"{where}: segments cover {covered} elements, more than the buffer's {flat_v.numel()}")


# --------------------------------------------------------------------------- plans
@dataclass
class _SegSlots:
    seg: Segment
    exact: bool
    period: int = 0
    block: int = 0  # scale block B (a multiple of the period)
    scale_off: int = 0
    scale_n: int = 0
    v_off: int = 0
    v_n: int = 0
    exact_off: int = 0
    vcol_off: int = 0  # factored: this segment's full v_col ([slab]) in st["v_col"]
    vcol_n: int = 0
    factored: bool = False  # its second moment is v_row x v_col (else one v per v-block, D15)
    colb: int = 1  # factored: its column blocks (D21), ``v_row`` holding that many entries per row
    span: bool = False  # narrow rows kept per block of rows (D16): its state is the buffer's span_* arrays


def _slots(segments: Sequence[Segment], periods: Sequence[int], small_threshold: Optional[int],
          factored: bool = False, row_blocks=1, few_rows_shared: bool = False,
          span=None, col_blocks=1) -> Tuple[List[_SegSlots], int, int, int]:
    """Offsets of every segment's state. Shared second moment: ``v`` per touched v-block (period).
    Factored (``factored=True``): ``v`` is ``v_row``, one entry per touched row (independent of the
    period), and ``vcol_off``/``vcol_n`` place a full ``v_col`` per non-empty quantized segment:
    ``G x slab`` floats with ``G = factored_row_blocks(shape, row_blocks)`` row blocks (D12; the
    state records its rule as ``st["row_blocks"]``, 1 for states saved before D12), and ``K`` entries of
    ``v_row`` per touched row with ``K = factored_col_blocks(shape, col_blocks)`` column blocks (D21,
    ``st["col_blocks"]``; 1 for the one-byte layout and states saved before D21).
    ``few_rows_shared``: the layout of the versions of D15 (withdrawn), in which a tensor of few rows
    kept the shared second moment in a factored buffer (``factored`` False on its slots, its ``v`` per
    touched v-block in ``st["v_row"]``, no ``v_col``); only for reading their saved state.
    ``small_threshold=None`` reads a *saved* state without knowing the optimizer's threshold: a
    segment is exact iff its period is 0 (quantized segments always have a period >= 1).
    ``span(shape)``: whether a tensor keeps its state per block of rows (D16, ``narrow_rows="span"``):
    such a segment has no slot here (its state lives in the buffer's ``span_*`` arrays, whole)."""
    out, so, vo, eo, co = [], 0, 0, 0, 0
    for seg, per in zip(segments, periods):
        if span is not None and span(seg.shape):
            out.append(_SegSlots(seg, False, int(per), int(per), span=True))
            continue
        if (int(per) == 0) if small_threshold is None else is_exact(seg.shape, small_threshold):
            out.append(_SegSlots(seg, True, exact_off=eo))
            eo += seg.numel
            continue
        # the segment's state as the one state spec lays out a flat range of its tensor
        fac = factored and quantized_mode(seg.shape, MODE_FACTORED, few_rows_shared) == MODE_FACTORED
        G, K = factored_blocks(seg.shape, row_blocks, col_blocks) if fac else (1, 1)
        spec = StateSpec(MODE_FACTORED if fac else MODE_SHARED, Geometry.quantized(seg.shape, int(per)), G, K)
        t = spec.range_tensors(seg.param_offset, seg.param_offset + seg.numel)
        sn = math.prod(t["scale"][0])
        vn = math.prod(t["v_row" if fac else "v"][0])
        cn = math.prod(t["v_col"][0]) if (fac and seg.numel) else 0
        out.append(_SegSlots(seg, False, per, spec.geometry.scale_block, so, sn, vo, vn, vcol_off=co, vcol_n=cn,
                             factored=fac, colb=K))
        so += sn
        vo += vn
        co += cn
    return out, so, vo, eo


def _split(a: int, e: int, B: int) -> Tuple[int, int, List[Tuple[int, int, int]]]:
    """Split ``[a, e)`` into whole blocks of ``B`` (``[lo, hi)``) and the blocks it covers only
    partly: ``(lo, hi, [(block index, start, end), ...])``."""
    if e <= a:
        return a, a, []
    A = -(-a // B) * B
    E = (e // B) * B
    if A > E:  # inside one block, aligned on neither side
        return a, a, [(a // B, a, e)]
    parts = []
    if a < A:
        parts.append((a // B, a, A))
    if E < e:
        parts.append((E // B, E, e))
    return A, E, parts
