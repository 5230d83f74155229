"""Where ``narrow_rows="span"`` (D16) loses on a dense layer of narrow rows: which of its two shared
quantities (the absmax scale per block of rows, the second moment per block of rows) costs the loss.

    python research/narrow_variants.py [--seeds 0,1,2,3,4] [--workloads digits,recsys,bag,narrow_mlp]
                                       [--out research/results/narrow_variants.json]

The span layout keeps, per block of ``k = ceil(1024 / S)`` rows of ``S`` elements, one absmax scale
``M_b`` and one second moment ``v_blk`` (times the column profile). The variants below change one
of the two back to per row, in float32, with torch operations (the library's own state keeps
being updated beside them and is not used for the step); their extra state is *not* within the
1.1 B/param budget (a float32 per row is ``4 / S`` B/param), so they locate the loss, they are not
candidates as they stand:

* ``span_rowv``: the second moment per row (``v_row``, as the factored default), the scale per block;
* ``span_rowscale``: the scale per row (``M_i``, as the default), the second moment per block;
* ``span_rowboth``: both per row (the default's quantities with span's single column profile);
* ``span_rows8``: both per row, each in one byte: the scale as ``M_i = M_b 2^(-e_i / 8)`` (``e_i``
  the largest code with ``M_i >= max |m_i|``, ``M_b`` the block's float32 maximum), the second
  moment as ``v_i = V_b 2^(-c_i / 16)`` (``V_b`` the block's float32 maximum of the rows' new ``v``,
  ``c_i`` rounded stochastically so that an EMA that moves by ``1 - beta2`` per step still moves;
  code 255: ``v_i = 0``). State ``1 + 2 / S + 8 / (k S)`` B/param plus the column profile: 1.04 for
  rows of 64, 1.13 for rows of 16 (over the budget below rows of ~21; 4-bit codes would halve it);
* ``span_rows8f``: as ``span_rows8`` with the row's ``v`` floored at ``2^-8`` of its block's maximum
  (codes up to 128): rare rows keep a second moment near their block's, as span's do;
* ``span_rows4``: both codes in 4 bits (``1 + 1 / S`` B/param): ``v`` in steps of half an octave down
  to ``2^-7`` of the block's maximum (code 15: zero), the scale in steps of half an octave down to
  ``2^-7.5``.

Workloads: ``benchmarks/narrow_quality.py``'s (held-out loss; ``digits``, ``tests/test_quality.py``'s
classifier whose first weight has rows of 64 elements: training loss of the last 50 of 300 steps,
the test's measure). Single process, CPU, ``fused=False`` for every Gefen
setting (the variants replace the reference span step), 1 thread.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks"), str(ROOT / "tests")]

import narrow_quality as NQ  # noqa: E402
from gefen_dist import Gefen  # noqa: E402
from gefen_dist.core import span as _span  # noqa: E402
from gefen_dist.core.step import apply_, column_factors, ema_, first_moment, inv_rms_, quantize  # noqa: E402

VARIANTS = {"span_rowv": (True, False), "span_rowscale": (False, True), "span_rowboth": (True, True),
            "span_rows8": (True, True), "span_rows8f": (True, True), "span_rows4": (True, True)}
# the coded variants: (codes per octave of v, largest v code, codes per octave of the scale, largest scale code)
CODES = {"span_rows8": (16, 254, 8, 255), "span_rows8f": (16, 128, 8, 255), "span_rows4": (2, 14, 2, 15)}
OPTS = ("adamw", "gefen_rows", "gefen_span") + tuple(VARIANTS)
T95 = NQ.T95


class SpanVariant(Gefen):
    """Gefen with ``narrow_rows="span"`` whose span tensors keep the second moment and/or the scale
    per row (float32 side state, research only; whole rows, single process)."""

    def __init__(self, params, *, row_v: bool, row_scale: bool, codes=None, **kw):
        super().__init__(params, narrow_rows="span", fused=False, **kw)
        self._row_v, self._row_scale, self._codes, self._extra = row_v, row_scale, codes, {}
        self._gen = torch.Generator().manual_seed(0)

    def _side(self, idx, sp):
        key = idx.data_ptr()
        if key not in self._extra:
            self._extra[key] = dict(v_row=torch.zeros(sp.nrows), scale=torch.zeros(sp.nrows, 1), g=None)
        return self._extra[key]

    def _code_v(self, v, bid, nb):
        """``v`` (float32 per row) as stored by one-byte codes per row and the blocks' maxima."""
        vb = torch.zeros(nb).scatter_reduce_(0, bid, v, "amax")
        ref = vb.index_select(0, bid)
        pos = (v > 0) & (ref > 0)
        vs, vmax = self._codes[0], self._codes[1]
        x = torch.where(pos, -vs * torch.log2(torch.where(pos, v / ref, torch.ones_like(v))), torch.zeros_like(v))
        lo = x.floor()
        c = lo + (torch.rand(v.shape, generator=self._gen) < (x - lo)).float()  # unbiased in the code
        c = c.clamp(0, vmax)
        return torch.where(pos, ref * torch.exp2(-c / vs), torch.zeros_like(v))

    def _code_scale(self, a, bid, nb):
        """Row maxima ``a`` (``[rows, 1]``) as stored: the block's maximum times ``2^(-e / 8)``, ``e``
        the largest code that keeps the stored scale at or above ``a``."""
        ss, smax = self._codes[2], self._codes[3]
        mb = torch.zeros(nb).scatter_reduce_(0, bid, a[:, 0], "amax").index_select(0, bid).unsqueeze(1)
        pos = (a > 0) & (mb > 0)
        e = torch.where(pos, (-ss * torch.log2(torch.where(pos, a / mb, torch.ones_like(a)))).floor(),
                        torch.full_like(a, float(smax))).clamp(0, smax)
        out = mb * torch.exp2(-e / ss)
        low = out < a  # float rounding: one code up
        return torch.where(low, mb * torch.exp2(-(e - 1).clamp(min=0) / ss), out)

    def _impl(self, t, p=None, group=None):
        impl = super()._impl(t, p, group)
        opt = self

        def stats(grad, idx, scale, codebook, sp, beta1, bid=None):
            assert sp.whole_rows and sp.row0 == 0 and sp.nrows == sp.rows, "single process, whole tensors"
            m, col, blk, amax = _span.span_statistics(grad, idx, scale, codebook, sp, beta1)
            ex = opt._side(idx, sp)
            g = grad.reshape(sp.nrows, sp.slab).float()
            ex["g"] = g
            if opt._row_scale:  # the previous M per row
                m = first_moment(idx.reshape(sp.nrows, sp.slab), ex["scale"], g, codebook, beta1)
            return m, col, blk, amax

        def update(param, idx, scale, v_blk, v_col, m, col_sum, blk_sum, amax, codebook, sp, *, lr, beta2, eps,
                   weight_decay, bc1, bc2, bound=None, beta1=0.0, bid=None, nearest=None):
            _span.span_state_(scale, v_blk, v_col, col_sum, blk_sum, amax, sp, beta2)  # the library's, unused
            ex = opt._side(idx, sp)
            bid = sp.block_ids(m.device)
            g = ex.pop("g")
            ema_(ex["v_row"], (g * g).mean(dim=1), beta2)
            if opt._codes:
                ex["v_row"] = opt._code_v(ex["v_row"], bid, sp.nb)
            a = m.abs().amax(dim=1, keepdim=True) if opt._row_scale else scale.index_select(0, bid).unsqueeze(1)
            if opt._codes:
                a = opt._code_scale(a, bid, sp.nb)
            ex["scale"] = a.clone() if opt._row_scale else ex["scale"]
            new = quantize(m, a, codebook, nearest)
            idx.view(sp.nrows, sp.slab).copy_(new)
            vr = ex["v_row"] if opt._row_v else v_blk.index_select(0, bid)
            rms = vr.sqrt().unsqueeze(1) * column_factors(v_col).unsqueeze(0)
            sigma = inv_rms_(rms, eps, bc1, math.sqrt(bc2))
            q = codebook[new.long()]
            apply_(param.view(sp.nrows, sp.slab), q * a, sigma, lr, weight_decay, bound)

        return dataclasses.replace(impl, span_statistics=stats, span_update_=update)


def make_opt(name, params, **kw):
    if name in VARIANTS:
        rv, rs = VARIANTS[name]
        return SpanVariant(params, row_v=rv, row_scale=rs, codes=CODES.get(name), **kw)
    if name == "adamw":
        return torch.optim.AdamW(params, **kw)
    return Gefen(params, narrow_rows="span" if name == "gefen_span" else "rows", fused=False, **kw)


WORKLOADS = {**NQ.WORKLOADS, **NQ.EXTRA}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", default="0,1,2,3,4")
    ap.add_argument("--workloads", default="digits,recsys,bag,narrow_mlp")
    ap.add_argument("--opts", default=",".join(OPTS))
    ap.add_argument("--out", default=str(ROOT / "research" / "results" / "narrow_variants.json"))
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    NQ.make_opt = make_opt  # the benchmark's workloads build their optimizer through this name
    seeds = [int(s) for s in args.seeds.split(",")]
    opts = args.opts.split(",")
    res = dict(command="python research/narrow_variants.py " + " ".join(sys.argv[1:] if argv is None else argv),
               torch=torch.__version__, date=time.strftime("%Y-%m-%d"), seeds=seeds, runs={}, summary={})
    for wl in args.workloads.split(","):
        runs = res["runs"][wl] = {}
        for seed in seeds:
            runs[str(seed)] = {}
            for name in opts:
                t0 = time.perf_counter()
                loss, b = WORKLOADS[wl](name, seed)
                runs[str(seed)][name] = dict(loss=loss, bytes=b, seconds=time.perf_counter() - t0)
                print(f"{wl} seed {seed} {name}: loss {loss:.5f}, {b:.3f} B/param", flush=True)
        row = res["summary"][wl] = {}
        for name in opts:
            if name == "adamw":
                continue
            gaps = [100.0 * (runs[str(s)][name]["loss"] / runs[str(s)]["adamw"]["loss"] - 1.0) for s in seeds]
            mean = statistics.fmean(gaps)
            half = (T95.get(len(gaps) - 1, 2.0) * statistics.stdev(gaps) / math.sqrt(len(gaps))
                    if len(gaps) > 1 else float("nan"))
            row[name] = dict(gaps=gaps, mean=mean, lo=mean - half, hi=mean + half)
            print(f"{wl} {name}: {mean:+.2f}% [{mean - half:+.2f}%, {mean + half:+.2f}%]; "
                  + ", ".join(f"{g:+.2f}%" for g in gaps), flush=True)
    Path(args.out).write_text(json.dumps(res, indent=1) + "\n")


if __name__ == "__main__":
    main()
