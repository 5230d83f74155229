"""One description of a tensor's Gefen state: its mode, keys, shapes and dtypes (D2, D5, D12).

A tensor's state is a function of its *global* shape, its param group's ``second_moment`` and
``row_blocks``, the optimizer's ``small_threshold`` and (once learned) its period, never of the
world size. :class:`StateSpec` says what that state is; allocation, validation of loaded state
and the report read it from here instead of guessing the mode from which keys a dict holds.

=============  =================================================================  ==============
mode           tensors (besides ``step``; quantized ones also hold ``period``,      bytes/element
               ``scale_block``, ``learned`` and the shared ``codebook``)
=============  =================================================================  ==============
exact          ``exp_avg``, ``exp_avg_sq`` (fp32, the parameter's shape)            8
shared         ``idx`` (uint8), ``scale`` [rows, slab/B], ``v`` [rows, slab/P]      1 + 4/B + 4/P
elementwise    as shared with period 1 (``v`` per element)                         ~5
factored       ``idx``, ``scale``, ``v_row`` [rows, 1], ``v_col`` [G, slab] or       ~1 + 4/B
               [slab] (replicated: the same on every rank)
span           ``idx``; ``scale``, ``v_blk`` [nb], ``v_col`` [slab], replicated     ~1 + 8/1024
               (``narrow_rows="span"``, rows of < 80 elements, blocks of rows, D16)
rows8          as span, plus ``scale_code``, ``v_code`` uint8 [rows] (each row's     1 + 2/S + ~0.01
               scale and ``v`` against the blocks' ``scale``/``v_blk``), sharded
               with the rows (``narrow_rows="rows8"``, rows of 22-79, D19)
=============  =================================================================  ==============

A factored group's tensors of few rows are factored too (``v_col`` costs ``4 / rows`` B/param: 5.0 in all
for ``(1, N)``). From 2026-12-02 to 2026-12-05 they kept the shared mode instead (D15, withdrawn: a
dense single-output head trained 14x worse than with AdamW); :func:`few_rows_shared_in` recognises the
state such versions saved.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

import torch

from ..core import periods as _periods
from ..core import rows8 as _rows8
from ..core import span as _span
from .layout import KIND_QUANTIZED, Geometry, few_rows, global_shape, is_exact

MODE_EXACT, MODE_SHARED, MODE_FACTORED, MODE_ELEMENTWISE = "exact", "shared", "factored", "elementwise"
MODE_SPAN = "span"  # a state mode, not a second_moment setting: narrow_rows="span" of a factored group (D16)
MODE_ROWS8 = "rows8"  # narrow_rows="rows8": rows of 22-79 elements, scale and v per row in one-byte codes (D19)
SPAN_MODES = (MODE_SPAN, MODE_ROWS8)  # the modes stepped in two phases by the span kernels
SECOND_MOMENTS = (MODE_SHARED, MODE_FACTORED, MODE_ELEMENTWISE)
# second_moment="nibbles" (D20): a factored group whose state bytes hold both moments, each in four bits
# (core/nibbles.py). Its state is the factored mode's, tensor for tensor; only the step's math and the
# codebook's size (16) differ. gefen_dist.Gefen, ZeroGefen and the DeepSpeed optimizer (ZeRO-1/2/3) step it
NIBBLES = "nibbles"
SECOND_MOMENT_SETTINGS = SECOND_MOMENTS + (NIBBLES,)
NARROW_ROWS = ("auto", "rows", "span", "rows8")
DEFAULT_NARROW_ROWS = "auto"  # the constructors' default (D18); a group saved without the key was "rows"
DEFAULT_SECOND_MOMENT = MODE_FACTORED  # Gefen's, ZeroGefen's and the DeepSpeed Gefen's constructor default

__all__ = ["StateSpec", "SECOND_MOMENTS", "NIBBLES", "SECOND_MOMENT_SETTINGS", "codebook_size", "codebook_size_of", "nibbles_in", "quantizes", "DEFAULT_SECOND_MOMENT", "MODE_EXACT", "MODE_SHARED", "MODE_FACTORED",
           "MODE_ELEMENTWISE", "MODE_SPAN", "MODE_ROWS8", "SPAN_MODES", "NARROW_ROWS", "rows8_mode", "DEFAULT_NARROW_ROWS", "span_mode", "narrow_rows_of",
           "narrow_layouts_differ", "narrow_layout", "second_moment_of", "mode_of", "mode_of_saved", "tensor_keys", "fixed_period", "new_step", "step_of",
           "quantized_mode", "few_rows_shared_in", "factored_blocks"]


def new_step(value=0) -> torch.Tensor:
    """A tensor's ``step`` as ``torch.optim.AdamW`` keeps it (not capturable): a 0-dim float32 CPU
    tensor, so code written for AdamW (``state["step"].item()``, DCP, torch's optimizer tests)
    reads it the same way. ``value``: an int or a one-element tensor."""
    return torch.tensor(float(value), dtype=torch.float32)


def step_of(st: Mapping[str, Any]) -> int:
    """The step count of a state entry as an int (the bias corrections and the bound need one)."""
    return int(st["step"])


def steps_of(states) -> List[int]:
    """:func:`step_of` of many state entries, read in one go (two torch calls, not one per entry: a
    step reads every tensor's count)."""
    steps = [st["step"] for st in states]
    if not steps:
        return []
    t0 = steps[0]
    if isinstance(t0, torch.Tensor) and all(isinstance(t, torch.Tensor) and t.dim() == 0 and t.dtype == t0.dtype
                                            and t.device == t0.device for t in steps):
        return [int(x) for x in torch.stack(steps).tolist()]
    return [int(t) for t in steps]


def second_moment_of(group: Mapping[str, Any]) -> str:
    """The ``second_moment`` of a live param group (:data:`DEFAULT_SECOND_MOMENT` where the group
    has none, as the optimizers' constructors default)."""
    return group.get("second_moment", DEFAULT_SECOND_MOMENT)


def quantizes(group: Mapping[str, Any], small_threshold: int) -> bool:
    """Whether param ``group`` (of an optimizer with ``small_threshold``) holds a tensor whose first
    moment is quantized, i.e. one that reads the optimizer's codebook."""
    return any(mode_of(global_shape(p), group, small_threshold) != MODE_EXACT for p in group["params"])


def nibbles_in(groups, small_threshold: Optional[int] = None) -> bool:
    """Whether the param ``groups`` keep both moments in four bits each (``second_moment="nibbles"``,
    D20). The codebook is the optimizer's (16 codewords for it, 256 otherwise), so every group that
    quantizes a tensor uses it or none does; with ``small_threshold`` given, groups that quantize
    nothing do not count (their ``second_moment`` is moot)."""
    return any(second_moment_of(g) == NIBBLES and (small_threshold is None or quantizes(g, small_threshold))
               for g in groups)


def codebook_size(groups, small_threshold: Optional[int] = None) -> int:
    """The number of codewords of the optimizer with param ``groups``: 16 for ``"nibbles"``, else 256
    (``small_threshold``: as :func:`nibbles_in`)."""
    return 16 if nibbles_in(groups, small_threshold) else 256


def codebook_size_of(opt) -> int:
    """:func:`codebook_size` of an optimizer (its ``param_groups``, read through its cached table of modes,
    ``opt._mode``); 256 at once where no group names ``"nibbles"`` (a load calls this for every entry)."""
    groups = opt.param_groups
    if not nibbles_in(groups):
        return 256
    return 16 if any(second_moment_of(g) == NIBBLES and any(opt._mode(p) != MODE_EXACT for p in g["params"])
                     for g in groups) else 256


def threshold_of(group: Mapping[str, Any], small_threshold: int) -> int:
    """The ``small_threshold`` of param ``group``: its own when it sets one, else the optimizer's."""
    return group.get("small_threshold", small_threshold)


def narrow_rows_of(group: Mapping[str, Any]) -> str:
    """The ``narrow_rows`` of a live param group (:data:`DEFAULT_NARROW_ROWS` where it has none, as
    the constructors default). A *saved* group without the key predates D16 and was ``"rows"``."""
    return group.get("narrow_rows", DEFAULT_NARROW_ROWS)


def span_mode(shape: Sequence[int], second_moment: str, narrow_rows: str, small_threshold: int) -> bool:
    """Whether a tensor of global ``shape`` keeps its state per block of rows (D16): a group with the
    factored second moment and ``narrow_rows="span"`` (rows narrower than
    :data:`gefen_dist.core.span.SPAN_BELOW`) or ``"auto"`` (narrower than
    :data:`gefen_dist.core.span.SPAN_AUTO_BELOW`, D18), at least ``small_threshold`` elements.
    ``(N, 1)`` tensors too, which :func:`gefen_dist.engine.layout.is_exact` keeps exact otherwise."""
    shape = tuple(int(s) for s in shape)
    if second_moment != MODE_FACTORED or not 0 < math.prod(shape) or math.prod(shape) < small_threshold:
        return False
    if narrow_rows == "span":
        return _span.span_eligible(shape)
    return narrow_rows in ("auto", "rows8") and _span.span_by_default(shape)


def rows8_mode(shape: Sequence[int], second_moment: str, narrow_rows: str, small_threshold: int) -> bool:
    """Whether a tensor of global ``shape`` keeps its scale and second moment per row in one-byte codes
    (D19): a group with the factored second moment and ``narrow_rows="rows8"``, rows of 22-79 elements
    (:func:`gefen_dist.core.rows8.rows8_eligible`), at least ``small_threshold`` elements."""
    shape = tuple(int(s) for s in shape)
    n = math.prod(shape)
    return (narrow_rows == "rows8" and second_moment == MODE_FACTORED and 0 < n and n >= small_threshold
            and _rows8.rows8_eligible(shape))


def narrow_layout(shape: Sequence[int], second_moment: str, narrow_rows: str, small_threshold: int) -> Optional[str]:
    """:data:`MODE_SPAN` or :data:`MODE_ROWS8` for a tensor kept by one of the two-phase narrow-row
    layouts under these settings, else None."""
    if rows8_mode(shape, second_moment, narrow_rows, small_threshold):
        return MODE_ROWS8
    return MODE_SPAN if span_mode(shape, second_moment, narrow_rows, small_threshold) else None


def narrow_layouts_differ(shapes, second_moment: str, a: str, b: str, small_threshold: int) -> bool:
    """Whether ``narrow_rows`` ``a`` and ``b`` keep some tensor of the global ``shapes`` differently
    (per block of rows under one, per row or exact under the other): whether a checkpoint saved
    under one loads under the other."""
    return a != b and any(narrow_layout(s, second_moment, a, small_threshold)
                          != narrow_layout(s, second_moment, b, small_threshold) for s in shapes)


def mode_of(shape: Sequence[int], group: Mapping[str, Any], small_threshold: int) -> str:
    """The mode of a live tensor of global ``shape`` in param ``group`` of an optimizer with
    ``small_threshold``: :data:`MODE_EXACT` for small / 1-D tensors, else the group's
    ``second_moment`` (the ``mode`` of :meth:`StateSpec.of`, which does not depend on the period).
    What live optimizer code asks instead of looking at the keys of a state dict. A group's own
    ``small_threshold`` (:class:`gefen_dist.Gefen` allows one per group) overrides the optimizer's."""
    narrow = narrow_layout(shape, second_moment_of(group), narrow_rows_of(group), threshold_of(group, small_threshold))
    if narrow is not None:
        return narrow
    if is_exact(tuple(int(s) for s in shape), threshold_of(group, small_threshold)):
        return MODE_EXACT
    return quantized_mode(shape, second_moment_of(group))


def quantized_mode(shape: Sequence[int], second_moment: str, few_rows_shared: bool = False) -> str:
    """The mode of a quantized tensor of global ``shape`` in a group with ``second_moment``: the
    group's. ``few_rows_shared``: as the versions of D15 (withdrawn) kept it, a factored group's
    tensors of few rows (:func:`gefen_dist.engine.layout.few_rows`) in the shared mode with the
    shape period; only for reading the state those versions saved (:func:`few_rows_shared_in`)."""
    if few_rows_shared and second_moment == MODE_FACTORED and few_rows(shape):
        return MODE_SHARED
    return MODE_FACTORED if second_moment == NIBBLES else second_moment


def few_rows_shared_in(st: Mapping[str, Any]) -> bool:
    """Whether a saved DeepSpeed flat-buffer state keeps its few-row tensors' second moment shared
    (D15, withdrawn): ``st["few_rows"]`` is 64 in the states of the versions that did, 0 in newer
    ones, absent in older ones (which were factored, as now)."""
    return bool(st.get("few_rows"))


def mode_of_saved(entry: Mapping[str, Any]) -> Optional[str]:
    """The mode of a *saved* per-tensor state entry, read from the keys it holds: a checkpoint
    file's, a foreign state dict's, the leaves of a DCP directory's metadata or a DeepSpeed flat
    buffer's state as loaded from disk (any mapping supporting ``in``).

    This is the only place in gefen_dist that decides a mode from keys, because a file on disk
    carries no :class:`StateSpec`: nothing in it says which param group's ``second_moment`` or
    which ``small_threshold`` made the entry, so its keys are all there is. Live optimizer code
    asks :func:`mode_of` / :class:`StateSpec` instead.

    Returns :data:`MODE_ROWS8` (``idx`` with ``v_code``), :data:`MODE_SPAN` (``idx`` with ``v_blk``), :data:`MODE_FACTORED` (``idx`` with ``v_row``/``v_col``), :data:`MODE_SHARED`
    (``idx`` with ``v``; ``elementwise`` state is shared state with period 1, the same keys, and
    cannot be told apart from it here), :data:`MODE_EXACT` (``exp_avg``) or None for an entry that
    holds none of Gefen's layouts (empty, or another optimizer's)."""
    if "idx" in entry:
        if "v_code" in entry:
            return MODE_ROWS8
        if "v_blk" in entry:
            return MODE_SPAN
        return MODE_FACTORED if ("v_col" in entry or "v_row" in entry) else MODE_SHARED
    if "exp_avg" in entry:
        return MODE_EXACT
    return None


def tensor_keys(mode: str) -> Tuple[str, ...]:
    """The state tensors of a tensor in ``mode`` (besides ``step``, the ints and the codebook)."""
    if mode == MODE_EXACT:
        return ("exp_avg", "exp_avg_sq")
    if mode == MODE_SPAN:
        return ("idx", "scale", "v_blk", "v_col")
    if mode == MODE_ROWS8:
        return ("idx", "scale", "v_blk", "v_col", "scale_code", "v_code")
    return ("idx", "scale", "v_row", "v_col") if mode == MODE_FACTORED else ("idx", "scale", "v")


def fixed_period(shape: Sequence[int], second_moment: str, col_blocks: int = 1) -> Optional[int]:
    """The period of a quantized tensor when its mode fixes it, None when it is detected from the
    first nonzero gradient (``"shared"``, the paper's scheme). ``"elementwise"``: 1. ``"factored"``:
    the period from the shape (:func:`gefen_dist.core.periods.shape_period`, D14): there the period
    sets only the absmax-scale block, and fixing it makes every state shape a function of the
    parameter's global shape, so a fresh optimizer's state has the shapes of a trained one's (the
    generic ``get_state_dict`` -> ``dcp.load`` -> ``set_state_dict`` resume works). With
    ``col_blocks`` (D21, factored) the rule applies to one block of columns."""
    if second_moment == MODE_ELEMENTWISE:
        return 1
    if second_moment == MODE_FACTORED:
        return _periods.shape_period(shape, col_blocks)
    if second_moment == NIBBLES:  # blocks of at most 256 for the four-bit first moment (D20)
        return _periods.nibble_period(shape)
    return None


def factored_blocks(shape: Sequence[int], row_blocks, col_blocks, second_moment: str = MODE_FACTORED) -> Tuple[int, int]:
    """``(G, K)``: the row blocks (D12) and column blocks (D21) of a factored tensor of global ``shape`` in a
    group with these settings (column blocks for ``second_moment="factored"`` only, not ``"nibbles"``); a
    ``ValueError`` naming the fix where a tensor would get both."""
    shape = tuple(int(s) for s in shape)
    G = _periods.factored_row_blocks(shape, row_blocks)
    K = _periods.factored_col_blocks(shape, col_blocks) if second_moment == MODE_FACTORED else 1
    if G > 1 and K > 1:
        raise ValueError(f"a tensor of shape {shape} gets {G} row blocks (row_blocks={row_blocks!r}) and {K} "
                         f"column blocks (col_blocks={col_blocks!r}); a tensor takes one or the other: set "
                         "row_blocks=1 or col_blocks=1 for it (a param group of its own)")
    return G, K


@dataclass(frozen=True)
class StateSpec:
    """The state of one global tensor: ``mode`` (one of exact/shared/factored/elementwise), its
    block ``geometry`` and, for the factored mode, the number of row blocks with their own column
    profile (``row_blocks``, D12) and of column blocks with their own row statistic (``col_blocks``,
    D21: ``v_row`` ``[rows, col_blocks]``)."""

    mode: str
    geometry: Geometry
    row_blocks: int = 1
    col_blocks: int = 1

    @classmethod
    def of(cls, shape: Sequence[int], *, second_moment: str, small_threshold: int,
           period: Optional[int] = None, row_blocks="auto", narrow_rows: str = DEFAULT_NARROW_ROWS,
           col_blocks=1) -> "StateSpec":
        """The spec of a tensor of global ``shape`` in a group with ``second_moment``, ``row_blocks``,
        ``narrow_rows`` and ``col_blocks``; ``period`` None is the placeholder of a tensor that has not
        learned its period yet (:func:`fixed_period`, else the row). A span tensor's (D16) period and
        scale block are its block of ``k`` rows, ``k * slab`` elements (the last block may be
        shorter). Column blocks apply to ``second_moment="factored"`` only (not ``"nibbles"``)."""
        shape = tuple(int(s) for s in shape)
        narrow = narrow_layout(shape, second_moment, narrow_rows, small_threshold)
        if narrow is not None:
            L = _span.span_period(shape)
            return cls(narrow, Geometry(KIND_QUANTIZED, shape, L, L))
        if is_exact(shape, small_threshold):
            return cls(MODE_EXACT, Geometry.exact(shape))
        if second_moment not in SECOND_MOMENT_SETTINGS:
            raise ValueError(f"Invalid second_moment: {second_moment!r} (expected one of {SECOND_MOMENT_SETTINGS})")
        mode = quantized_mode(shape, second_moment)
        G, K = factored_blocks(shape, row_blocks, col_blocks, second_moment) if mode == MODE_FACTORED else (1, 1)
        if period is None:  # placeholder: the fixed period, or the row until one is detected
            period = fixed_period(shape, second_moment, K) or _periods.row_slab(shape)
        per = int(period)
        return cls(mode, Geometry.quantized(shape, per), G, K)

    @property
    def exact(self) -> bool:
        return self.mode == MODE_EXACT

    @property
    def tensor_keys(self) -> Tuple[str, ...]:
        return tensor_keys(self.mode)

    @property
    def keys(self) -> Tuple[str, ...]:
        """Every key of the state dict entry, in its order."""
        if self.exact:
            return ("step",) + self.tensor_keys
        return ("step", "period", "scale_block", "learned") + self.tensor_keys + ("codebook",)

    def tensors(self, local_shape: Sequence[int]) -> Dict[str, Tuple[tuple, tuple, torch.dtype, bool]]:
        """``key -> (local shape, global shape, dtype, sharded)`` of the state tensors of a piece of
        ``local_shape`` (whole dim-0 rows of the global tensor); ``sharded`` False for what every rank
        holds whole (``v_col``)."""
        geo = self.geometry
        gshape = geo.global_shape
        if self.exact:
            ls = tuple(local_shape)
            return {"exp_avg": (ls, gshape, torch.float32, True), "exp_avg_sq": (ls, gshape, torch.float32, True)}
        rows = int(local_shape[0])
        if self.mode in SPAN_MODES:  # replicated block state (D16), and per-row codes (D19)
            nb, S = (_span.span_blocks(gshape),), (geo.slab,)
            out = {"idx": (tuple(local_shape), gshape, torch.uint8, True), "scale": (nb, nb, torch.float32, False),
                   "v_blk": (nb, nb, torch.float32, False), "v_col": (S, S, torch.float32, False)}
            if self.mode == MODE_ROWS8:  # one byte each per row, sharded with the rows (D19)
                for k in ("scale_code", "v_code"):
                    out[k] = ((rows,), (gshape[0],), torch.uint8, True)
            return out
        loc, glo = geo.state_shapes(rows), geo.state_shapes(gshape[0])
        out = {"idx": (loc["idx"], glo["idx"], torch.uint8, True),
               "scale": (loc["scale"], glo["scale"], torch.float32, True)}
        if self.mode == MODE_FACTORED:
            out["v_row"] = ((rows, self.col_blocks), (gshape[0], self.col_blocks), torch.float32, True)
            vc = ((self.row_blocks,) if self.row_blocks > 1 else ()) + (geo.slab,)
            out["v_col"] = (vc, vc, torch.float32, False)
        else:
            out["v"] = (loc["v"], glo["v"], torch.float32, True)
        return out

    def range_tensors(self, start: int, end: int) -> Dict[str, Tuple[tuple, torch.dtype, bool]]:
        """``key -> (shape, dtype, sharded)`` of the state of the flat range ``[start, end)`` of the
        tensor (row-major global element indices; ZeroGefen's partitions, a segment of a DeepSpeed
        flat buffer): per-element tensors of its ``end - start`` elements, one entry per scale
        block / v-block / row (factored ``v_row``) that the range touches (a range cut inside a
        block keeps a whole entry for it), ``v_col`` whole (replicated, ``sharded`` False)."""
        n = end - start

        def touched(unit: int) -> int:
            return ((end - 1) // unit - start // unit + 1) if n > 0 else 0

        if self.exact:
            return {"exp_avg": ((n,), torch.float32, True), "exp_avg_sq": ((n,), torch.float32, True)}
        if self.mode in SPAN_MODES:  # idx of the range; the block state whole, replicated (D16, D19)
            gshape = self.geometry.global_shape
            nb, S = (_span.span_blocks(gshape),), (self.geometry.slab,)
            out = {"idx": ((n,), torch.uint8, True), "scale": (nb, torch.float32, False),
                   "v_blk": (nb, torch.float32, False), "v_col": (S, torch.float32, False)}
            if self.mode == MODE_ROWS8:  # the codes of the rows the range touches (D19)
                for k in ("scale_code", "v_code"):
                    out[k] = ((touched(self.geometry.slab),), torch.uint8, True)
            return out
        geo = self.geometry
        out = {"idx": ((n,), torch.uint8, True), "scale": ((touched(geo.scale_block),), torch.float32, True)}
        if self.mode == MODE_FACTORED:
            # (column blocks, D21: one entry per block of the rows touched; ZeroGefen cuts them at rows)
            K = self.col_blocks
            out["v_row"] = ((touched(geo.slab),) + ((K,) if K > 1 else ()), torch.float32, True)
            out["v_col"] = (((self.row_blocks,) if self.row_blocks > 1 else ()) + (geo.slab,), torch.float32, False)
        else:
            out["v"] = ((touched(geo.period),), torch.float32, True)
        return out

    def allocate_range(self, start: int, end: int, device: torch.device, *, learned: bool, step,
                       codebook: Optional[torch.Tensor]) -> dict:
        """Zero state for the flat range ``[start, end)`` (:meth:`range_tensors`), as :meth:`allocate`."""
        st = {"step": new_step(step)}
        if not self.exact:
            st.update(period=self.geometry.period, scale_block=self.geometry.scale_block, learned=int(learned))
        for key, (shape, dtype, _) in self.range_tensors(start, end).items():
            st[key] = torch.zeros(shape, dtype=dtype, device=device)
        if not self.exact:
            st["codebook"] = codebook
        return st

    def allocate(self, local_shape: Sequence[int], device: torch.device, *, learned: bool, step: int,
                 codebook: Optional[torch.Tensor], wrap: Callable[[torch.Tensor, tuple], torch.Tensor]) -> dict:
        """Zero state for a piece of ``local_shape`` on ``device``; ``wrap(local, global_shape)`` turns
        a sharded local tensor into what the optimizer stores (a DTensor for FSDP2 parameters)."""
        st = {"step": new_step(step)}
        if not self.exact:
            st.update(period=self.geometry.period, scale_block=self.geometry.scale_block, learned=int(learned))
        for key, (ls, gs, dtype, sharded) in self.tensors(local_shape).items():
            t = torch.zeros(ls, dtype=dtype, device=device)
            st[key] = wrap(t, gs) if sharded else t
        if not self.exact:
            st["codebook"] = codebook
        return st
