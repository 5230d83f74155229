"""DeepSpeed's flat-buffer step (D7, :mod:`gefen_dist.engine.flat_step`) in a fixed number of calls.

Segment by segment, a flat buffer's step costs a dozen torch operations per segment and phase (each
a launch on a GPU) besides its kernel launches: the column sums of ``g^2`` per block of rows, the
column means, the ``v_col`` EMA and its factors, the whole rows' kernel, and the exact (AdamW)
segments' eager update. On GPT-2's 148 tensors that is about 1,900 launches a step on a GPU
(``research/flat_host_ops.py``), many times the update's own device time. Where the buffer's
implementation is a multi-tensor kernel's (the native CPU kernel, :mod:`~gefen_dist.kernels.cpu_multi`,
or the Triton kernels, :mod:`~gefen_dist.kernels.triton_multi`), :class:`FlatBatch` takes the parts
of every segment that are whole:

* the column sums of every learned factored segment's whole rows in one ``ColumnSums`` run (per
  block of rows, D12), placed into the buffer's column statistics by one ``index_copy_``; rows cut
  by a partition edge add their partial sums afterwards, as before;
* the column means in one division, the ``v_col`` EMAs in two foreach operations, the column factors
  in one ``ColumnFactors`` run, and every whole row in one ``MultiStep`` run;
* ``second_moment="nibbles"`` (D20) instead of the column factors and ``MultiStep``: the column ratios
  around the ``v_col`` EMAs taken by shape (:class:`~gefen_dist.engine.column_stats.ColumnRatios`, whose
  ratios the cut rows are then finished with) and every whole row in one ``NibbleStep`` run (keyed by the
  owner's tensor indices, as the per-segment calls);
* the whole blocks of the shared second moment's segments (period 1 or the scale block) in one
  ``MultiStep`` run;
* the exact segments in one :func:`~gefen_dist.core.step.adamw_foreach_` (bitwise the per-segment
  :func:`~gefen_dist.core.step.adamw_step_`).

Rows and blocks cut by partition edges stay with the reference's phase functions (D7). A segment with
column blocks (D21) has its factors normalised per block of columns and ``K`` entries of ``v_row`` per row. Each
segment's result is what its own calls give: the multi-tensor kernels run the per-tensor kernels'
arithmetic on the same arguments (``tests/test_flat_batch.py`` compares the two paths bitwise). A
batch is built for a fixed layout (periods, learned segments) and fixed state and buffer storage,
and reused while they stay the same.
"""
from __future__ import annotations

import logging
from typing import Any, Dict, Optional

import torch

from ..core.step import ADAMW_KEYS, adamw_foreach_, ema_foreach_
from .column_stats import ColumnRatios, ColumnTable
from .flat_layout import _split
from .layout import Ranges

__all__ = ["FlatBatch", "batch_kernels", "batch_key"]

logger = logging.getLogger(__name__)


def batch_kernels(impl, flat: torch.Tensor, grad: torch.Tensor):
    """The multi-tensor kernels' module for a flat buffer stepped by ``impl`` (the native CPU
    kernel's or the Triton kernels'), or None when the per-segment path steps it (the eager
    reference; a gradient of another dtype than the buffer's, or not contiguous)."""
    if impl is None or impl.name not in ("cpu", "triton") or flat.dtype not in (torch.float32, torch.bfloat16):
        return None
    if grad.dtype != flat.dtype or not grad.is_contiguous() or grad.device != flat.device:
        _log_once(f"its gradient is {grad.dtype}{'' if grad.is_contiguous() else ', not contiguous,'} on {grad.device}, "
                  f"the buffer {flat.dtype} on {flat.device}")
        return None
    if impl.name == "cpu":
        from ..kernels import cpu_multi as mod
    else:
        from ..kernels import triton_step as mod
    return mod if mod.available(flat.device if flat.device.type == "cuda" else None) else None


_logged: set = set()


def _log_once(why: str) -> None:
    """One INFO line per reason and process: a flat buffer stepped segment by segment although its
    implementation has multi-tensor kernels (the same results, more launches)."""
    if why not in _logged:
        _logged.add(why)
        logger.info("Gefen (DeepSpeed): a flat buffer is stepped segment by segment: %s (the kernels read a "
                    "contiguous gradient of the buffer's dtype and device); logged once per reason.", why)


def batch_key(impl, flat: torch.Tensor, st: Dict[str, Any], factored: bool, rbr, nib: bool = False) -> tuple:
    """What a :class:`FlatBatch` is built for: the implementation, the buffer's and the state's
    storage, the periods and which segments have learned (here, and in the whole catalog, whose
    learned factored tensors place the column statistics)."""
    ptrs = tuple(t.data_ptr() for k in ("idx", "scale", "v", "v_row", "v_col", "exact_m", "exact_v")
                 for t in (st.get(k),) if isinstance(t, torch.Tensor))
    return (impl.name, flat.data_ptr(), flat.numel(), ptrs, tuple(st["periods"]), tuple(st["learned"]),
            tuple(st.get("global_learned", ())), factored, rbr, nib)


class FlatBatch:
    """The batched phases of one flat buffer's step (module docstring). ``layout``: the buffer's
    slots (``_slots``); ``ctx``: the step's factored catalog (None for a shared buffer); ``tensor_index``
    (``second_moment="nibbles"``): segment key -> the tensor's place in the optimizer (its draws' key)."""

    def __init__(self, key: tuple, kernels, st: Dict[str, Any], layout, ctx, flat: torch.Tensor,
                 tensor_index: Optional[Dict[Any, int]] = None):
        self.key = key
        self.nib = tensor_index is not None
        self.fpos: Dict[Any, int] = {}  # a factored segment's key -> its place in the column table
        dev = flat.device
        fv = flat.detach().reshape(-1)
        self.exact = self._exact(layout, st, fv)
        tensors, col_index, fitems, franges, colb = [], [], [], [], []
        sitems, sranges = [], []
        self.shared_keys = set()  # the shared segments whose whole blocks the batch steps
        self.whole = set()  # the segments it steps whole (no row or block cut by a partition edge)
        v_all = st.get("v_row") if ctx is not None else st.get("v")
        for sp, learned in zip(layout, st["learned"]):
            s = sp.seg
            if not s.numel or sp.exact or sp.span or not learned:
                continue
            a, e = s.param_offset, s.param_offset + s.numel
            ix = st["idx"][s.flat_offset:s.flat_offset + s.numel]
            sc = st["scale"][sp.scale_off:sp.scale_off + sp.scale_n]
            if sp.factored:
                S, B, G = ctx.slab_of[s.key], sp.block, ctx.nblk_of[s.key]
                rb = ctx.cat[s.key]["shape"][0] // G
                lo, hi, cut = _split(a, e, S)
                if not cut:
                    self.whole.add(s.key)
                vc = st["v_col"][sp.vcol_off:sp.vcol_off + sp.vcol_n]
                # (v_col, the whole rows' column-sum spec, rows per row block, contributes)
                tensors.append((vc.view(G, S) if G > 1 else vc, ((hi - lo) // S, S, lo // S, rb, G, flat.dtype), rb, True))
                colb.append(sp.colb)  # column blocks (D21): K entries of v_row per row
                col_index.append(torch.arange(ctx.col_off[s.key], ctx.col_off[s.key] + G * S))
                franges.append((s.flat_offset + lo - a, s.flat_offset + hi - a))
                so, ro, nrow = lo // B - a // B, lo // S - a // S, (hi - lo) // S
                vr = st["v_row"][sp.v_off:sp.v_off + sp.v_n]
                self.fpos[s.key] = len(tensors) - 1
                fitems.append((fv[franges[-1][0]:franges[-1][1]], ix[lo - a:hi - a], sc[so:so + nrow * (S // B)],
                               vr[ro * sp.colb:(ro + nrow) * sp.colb], len(tensors) - 1, S, B, lo // S, rb, G, s.key))
            elif sp.period in (1, sp.block):
                P, B = sp.period, sp.block
                lo, hi, cut = _split(a, e, B)
                if hi <= lo:
                    continue
                if not cut:
                    self.whole.add(s.key)
                so, vo = lo // B - a // B, lo // P - a // P
                vv = v_all[sp.v_off:sp.v_off + sp.v_n]
                sitems.append(kernels.StepItem(fv[s.flat_offset + lo - a:s.flat_offset + hi - a], ix[lo - a:hi - a],
                                               sc[so:so + (hi - lo) // B], vv[vo:vo + (hi - lo) // P], None,
                                               B, B, 1 if P == 1 else 0))
                sranges.append((s.flat_offset + lo - a, s.flat_offset + hi - a))
                self.shared_keys.add(s.key)
        # the column sums, means and factors (or, "nibbles", ratios) of the factored segments (the CUDA
        # batch's table)
        self.table = ColumnTable(kernels, tensors, dev, factored=[not self.nib] * len(tensors),
                                 col_blocks=colb) if tensors else None
        self.fmulti = self.ratios = None
        if tensors:
            self.col_index = torch.cat(col_index).to(dev)  # where each segment's sums sit in the catalog's
        if tensors and self.nib:
            self.ratios = ColumnRatios(self.table.vcols, dev)
            # (one row block: rb as the per-segment call passes it to the kernel, its rows + 1)
            items = [kernels.NibbleItem(p, ix, sc, vr, self.ratios.old[k], self.ratios.new[k], S, B, row0,
                                        rb if G > 1 else row0 + p.numel() // S + 1, tensor_index[key])
                     for p, ix, sc, vr, k, S, B, row0, rb, G, key in fitems]
            self.fmulti = kernels.NibbleStep(items, dev) if any(it.param.numel() for it in items) else None
        elif tensors:
            items = [kernels.StepItem(p, ix, sc, vr, self.table.factor_views[k], S, B, 2, row0, rb, colb[k])
                     for p, ix, sc, vr, k, S, B, row0, rb, _, _ in fitems]
            self.fmulti = kernels.MultiStep(items, dev) if any(it.param.numel() for it in items) else None
        self.franges = Ranges(franges, fv.numel())
        self.smulti = kernels.MultiStep(sitems, dev) if sitems else None
        self.sranges = Ranges(sranges, fv.numel())
        logger.debug("gefen_dist: flat batch (%s) of %d factored, %d shared and %d exact segments",
                     kernels.__name__.rsplit(".", 1)[-1], len(franges), len(sranges),
                     len(self.exact[0]) if self.exact else 0)

    @staticmethod
    def _exact(layout, st, fv) -> Optional[tuple]:
        """The exact segments' parameter views, AdamW state views and gradient ranges."""
        ps, ms, vs, ranges = [], [], [], []
        for sp in layout:
            s = sp.seg
            if sp.exact and s.numel:
                ps.append(fv[s.flat_offset:s.flat_offset + s.numel])
                ms.append(st["exact_m"][sp.exact_off:sp.exact_off + s.numel])
                vs.append(st["exact_v"][sp.exact_off:sp.exact_off + s.numel])
                ranges.append((s.flat_offset, s.flat_offset + s.numel))
        return (ps, ms, vs, Ranges(ranges, fv.numel())) if ps else None

    # ------------------------------------------------------------------ the step's phases
    def column_sums_into(self, cols: torch.Tensor, gv: torch.Tensor) -> None:
        """The whole rows' column sums of every factored segment into ``cols`` (the buffer's zeroed
        float64 column statistics, the catalog's layout): what the per-segment path adds there first."""
        if self.table is not None:
            sums = self.table.column_sums(self.franges.of(gv))
            cols.index_copy_(0, self.col_index, sums.to(cols.device))

    def step_exact(self, gv: torch.Tensor, hp: Dict[str, Any]) -> None:
        """The exact segments' AdamW step (the per-segment path's ``adamw_step_`` calls) in one foreach."""
        if self.exact is not None:
            ps, ms, vs, ranges = self.exact
            adamw_foreach_(ps, ranges.of(gv), ms, vs, **{k: hp[k] for k in ADAMW_KEYS})

    def step_factored(self, cols: torch.Tensor, gv: torch.Tensor, codebook: torch.Tensor, hp: Dict[str, Any]) -> None:
        """Every factored segment's ``v_col`` from the (reduced) column sums ``cols``, then its whole
        rows (the per-segment path's ``quantized_step_factored_`` calls)."""
        if self.table is None:
            return
        self.table.column_means(cols[self.col_index.to(cols.device)].to(self.table.means.device))
        ema_foreach_(self.table.vcols, self.table.views, hp["beta2"])
        self.table.factors.run()
        if self.fmulti is not None:
            self.fmulti.run(self.franges.of(gv), codebook, **hp)

    def step_nibbles(self, cols: torch.Tensor, gv: torch.Tensor, codebook: torch.Tensor, hp: Dict[str, Any],
                     step: int) -> None:
        """``second_moment="nibbles"``: every factored segment's ``v_col`` between its column ratios (kept
        in :attr:`ratios` for the cut rows), then its whole rows (the per-segment path's
        ``nibble_step_factored_`` calls)."""
        if self.table is None:
            return
        self.table.column_means(cols[self.col_index.to(cols.device)].to(self.table.means.device))
        self.ratios.run(self.table.views, hp["beta2"])
        if self.fmulti is not None:
            self.fmulti.run(self.franges.of(gv), codebook, step, **hp)

    def step_shared(self, gv: torch.Tensor, codebook: torch.Tensor, hp: Dict[str, Any]) -> None:
        """The whole blocks of every shared segment of period 1 or its scale block."""
        if self.smulti is not None:
            self.smulti.run(self.sranges.of(gv), codebook, **hp)
