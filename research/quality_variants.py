"""The quality benchmark's ablation variants (research): each changes one mechanism of Gefen.

``benchmarks/quality.py`` holds the product configurations; this module registers the variants
(``research/_variants.py``: subclasses that override Gefen's private methods) with
``quality.register`` and then runs the same command line, so every variant name, the
``ablations`` group and ``--report`` work as they did. The report's tables are spliced into
``research/quality-log.md`` (markers ``quality_table_<tag>.md``)::

    python research/quality_variants.py --only adamw,u_square_blocks --workloads lm --seeds 0,1
    python research/quality_variants.py --seeds 0 --only ablations --lm-preset tiny --lm-context 64
    python research/quality_variants.py --report --tag small --workloads lm

Research imports benchmarks, never the reverse.
"""
from __future__ import annotations

import math
import sys
from pathlib import Path
from typing import Optional

ROOT = Path(__file__).resolve().parents[1]
for _p in (ROOT / "research", ROOT / "benchmarks", ROOT):
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))

import torch  # noqa: E402
from torch import nn  # noqa: E402

import quality  # noqa: E402
from quality import _adamw, _gefen  # noqa: E402

LOG = ROOT / "research" / "quality-log.md"

Q4V = dict(q4_step=1.0 / 3.0, q4_zero=6)  # levels 2^(-2) .. 2^3 around the factored estimate
Q4V_EMB = dict(m_bits=4, v_bits=4, **Q4V)
Q4V_FLOOR = dict(q4_step=1.0 / 3.0, q4_zero=0, q4_floor=True)  # levels 1x .. 2^5 above the factored estimate

def _lagcol(**kw):
    def make(groups, lr, betas, seed):
        from _variants import LagColGefen
        kw.setdefault("fused", False)
        return LagColGefen(groups, lr=lr, betas=betas, eps=1e-8, **kw)
    return make


def _colblocks(scale_in_blocks: bool = False, **kw):
    def make(groups, lr, betas, seed):
        from _variants import ColBlockGefen, ColBlockScaleGefen
        return (ColBlockScaleGefen if scale_in_blocks else ColBlockGefen)(groups, lr=lr, betas=betas, eps=1e-8,
                             **dict(dict(fused=None, second_moment="factored", row_blocks="auto"), **kw))
    return make


def _variant(**kw):
    def make(groups, lr, betas, seed):
        from _variants import GefenVariant
        return GefenVariant(groups, lr=lr, betas=betas, eps=1e-8, seed=seed, **kw)
    return make


def _variant_emb(mode: Optional[str], m_mode: Optional[str] = None, **kw):
    """A GefenVariant whose nn.Embedding weights (the GPT's wte, tied to the LM head, and wpe) get
    the second moment ``mode`` ("exact" / "row" / ...) and, with ``m_mode``, that first moment
    ("quant4"), every other tensor ``kw``'s."""
    def make(groups, lr, betas, seed, *, model, **_):
        from _variants import GefenVariant
        emb = {id(m.weight): mode for m in model.modules() if isinstance(m, nn.Embedding)}
        m_over = {k: m_mode for k in emb} if m_mode else None
        v_over = emb if mode else None  # None: the embeddings keep kw's second moment
        return GefenVariant(groups, lr=lr, betas=betas, eps=1e-8, seed=seed, v_override=v_over,
                            m_override=m_over, **kw)
    make.needs_model = True
    return make


def _variant_named(mode: str, substrings, **kw):
    """A GefenVariant whose parameters with a name containing one of ``substrings`` get the second
    moment ``mode`` ("exact", ...), every other tensor ``kw``'s: to locate which tensors an
    estimator costs loss on."""
    def make(groups, lr, betas, seed, *, model, **_):
        from _variants import GefenVariant
        over = {id(p): mode for name, p in model.named_parameters() if any(s in name for s in substrings)}
        assert over, f"no parameter name contains any of {substrings}"
        return GefenVariant(groups, lr=lr, betas=betas, eps=1e-8, seed=seed, v_override=over, **kw)
    make.needs_model = True
    return make


def _gefen_named(mode: str, substrings, **kw):
    """gefen_dist Gefen (the library, native CPU step) with the parameters whose name contains one of
    ``substrings`` in a param group of their own with ``second_moment=mode``; every other tensor as
    ``kw`` says: the library-path counterpart of :func:`_variant_named`."""
    def select(model):
        chosen = {id(p) for name, p in model.named_parameters() if any(s in name for s in substrings)}
        assert chosen, f"no parameter name contains any of {substrings}"
        return chosen
    return quality._gefen_group(select, mode, **kw)


def _gefen_rows_per_block(rows: int, **kw):
    """gefen_dist Gefen (the library, native CPU step), the default but with one column profile of the factored
    ``v`` per block of ``rows`` rows (the library's ``row_blocks=R // rows`` per tensor, in param groups by
    row count) for every tensor of ``R >= 2 rows`` rows that ``rows`` divides; the other tensors ``"auto"``."""
    def make(groups, lr, betas, seed):
        from gefen_dist import Gefen
        out = []
        for g in groups:
            by: dict = {}
            for p in g["params"]:
                R = p.shape[0] if p.dim() >= 2 else 0
                by.setdefault(R // rows if R >= 2 * rows and R % rows == 0 else "auto", []).append(p)
            out += [{**g, "params": ps, "row_blocks": rb} for rb, ps in by.items()]
        return Gefen(out, lr=lr, betas=betas, eps=1e-8, **dict(dict(fused=None, second_moment="factored"), **kw))
    return make


class Conv1DLike(nn.Module):
    """Hugging Face GPT-2's ``Conv1D`` layout of a linear layer: the weight stored ``(in, out)``, ``y = x W + b``
    (``torch.addmm``), so that the fused q, k, v projection's sections and the MLP's hidden units are blocks of
    columns, not rows. Built from an ``nn.Linear`` with its weight transposed (the same function)."""

    def __init__(self, lin: nn.Linear):
        super().__init__()
        self.weight = nn.Parameter(lin.weight.detach().t().contiguous())
        self.bias = nn.Parameter(lin.bias.detach().clone()) if lin.bias is not None else None

    def forward(self, x):
        flat = x.reshape(-1, x.shape[-1])
        y = torch.addmm(self.bias, flat, self.weight) if self.bias is not None else flat @ self.weight
        return y.view(*x.shape[:-1], self.weight.shape[1])


def _conv1d_layout(inner):
    """``inner(groups, lr, betas, seed)`` on the model with every linear layer of its blocks (attention input and
    output projections, MLP) in :class:`Conv1DLike`'s layout, the model changed in place before the first step
    (the same function at init; the param groups rebuilt by the harness's weight-decay rule)."""
    def make(groups, lr, betas, seed, *, model, **_):
        for blk in model.blocks:
            for mod, name in ((blk.attn, "c_attn"), (blk.attn, "c_proj"), (blk.mlp, "c_fc"), (blk.mlp, "c_proj")):
                lin = getattr(mod, name)
                assert isinstance(lin, nn.Linear), (name, type(lin))
                setattr(mod, name, Conv1DLike(lin))
        return inner(quality.param_groups(model, groups[0]["weight_decay"]), lr, betas, seed)
    make.needs_model = True
    return make


def _code_v8(v: torch.Tensor, gen: torch.Generator, steps: float = 16, levels: int = 256) -> torch.Tensor:
    """``v`` as stored in one byte per element: ``R_b 2^(-c / steps)``, ``c`` in 0..254 (``levels - 2`` with
    fewer levels: 4 bits are ``levels=16``), ``R_b`` the largest
    ``v`` of each block of 256 elements (flattened), rounded stochastically between the two nearest codes
    (unbiased in the code; research/head_vshare.py's ``adamw_code16x256``); 0 stays 0."""
    flat = v.reshape(-1)
    pad = (-flat.numel()) % 256
    vb = torch.cat([flat, flat.new_zeros(pad)]).view(-1, 256)
    ref = vb.amax(1, keepdim=True)
    x = (-steps * torch.log2(vb / ref.clamp_min(1e-38))).clamp(0, levels - 2)
    lo = x.floor()
    c = lo + (torch.rand(x.shape, generator=gen) < x - lo).to(x.dtype)
    out = torch.where(vb > 0, ref * torch.exp2(-c / steps), torch.zeros_like(vb))
    return out.view(-1)[:flat.numel()].view_as(v)


def _code_v_fac(v: torch.Tensor, gen: torch.Generator, steps: float = 2, levels: int = 16) -> torch.Tensor:
    """``v`` (2-D) as ``levels`` codes of its ratio to its own rank-1 (factored) estimate
    ``fac = r c / mean(c)`` (``r``, ``c`` the row and column means of ``v``: what fp32 ``v_row`` / ``v_col``
    EMAs of ``g^2`` hold): ``v = fac 2^((k - levels / 2) / steps)``, ``k`` in ``0 .. levels - 1``, rounded
    stochastically in ``k``; 0 where ``fac`` is 0."""
    r, c = v.mean(1, keepdim=True), v.mean(0, keepdim=True)
    fac = r * c / c.mean().clamp_min(1e-38)
    x = (steps * torch.log2(v.clamp_min(1e-38) / fac.clamp_min(1e-38)) + levels // 2).clamp(0, levels - 1)
    lo = x.floor()
    k = lo + (torch.rand(x.shape, generator=gen) < x - lo).to(x.dtype)
    return torch.where(fac > 0, fac * torch.exp2((k - levels // 2) / steps), torch.zeros_like(v))


def _keep_v(v: torch.Tensor, gen, steps: float = 0, levels: int = 0) -> torch.Tensor:
    """No coding: ``v`` as it is (a variant that re-codes only its first moment)."""
    return v


def _code_v_mm(v: torch.Tensor, gen: torch.Generator, steps: float = 0, levels: int = 16) -> torch.Tensor:
    """``v`` as ``levels`` log codes spread over each 256-block's own range: ``c = (log2 R_b - log2 v) / s_b``,
    ``s_b = (log2 R_b - log2 r_b) / (levels - 1)`` (``R_b``, ``r_b`` the block's largest and smallest nonzero
    ``v``; two fp32 per block), rounded stochastically in ``c``: a block of narrow range gets fine steps, a
    wide one coarse steps and no clamping (``steps`` unused: the resolution is the block's); 0 stays 0."""
    flat = v.reshape(-1)
    pad = (-flat.numel()) % 256
    vb = torch.cat([flat, flat.new_zeros(pad)]).view(-1, 256)
    hi = vb.amax(1, keepdim=True).clamp_min(1e-38)
    lo = torch.where(vb > 0, vb, torch.full_like(vb, float("inf"))).amin(1, keepdim=True)
    lo = torch.where(torch.isfinite(lo), lo, hi)
    s = ((torch.log2(hi) - torch.log2(lo)) / (levels - 1)).clamp_min(1e-6)
    x = ((torch.log2(hi) - torch.log2(vb.clamp_min(1e-38))) / s).clamp(0, levels - 1)
    f = x.floor()
    c = f + (torch.rand(x.shape, generator=gen) < x - f).to(x.dtype)
    out = torch.where(vb > 0, hi * torch.exp2(-c * s), torch.zeros_like(vb))
    return out.view(-1)[:flat.numel()].view_as(v)


def _m_subset_table(opt, k: int) -> torch.Tensor:
    """A map of the 256 codeword indices onto ``k`` of them: the exact DP (core/codebook.dp_segments) on
    the learned codewords weighted by how many first-moment indices use each now, each segment's
    representative the member nearest its weighted mean, then every codeword to its nearest representative:
    a ``k``-entry first-moment codebook (``k = 16``: 4 bits) emulated inside the 256-entry one."""
    import numpy as np
    from gefen_dist.core.codebook import dp_segments
    sts = [st for st in opt.state.values() if st and "idx" in st and st.get("learned", True)]
    cb = sts[0]["codebook"].float().cpu()
    counts = torch.zeros(256, dtype=torch.float64)
    for st in sts:
        counts += torch.bincount(st["idx"].reshape(-1).long(), minlength=256).double()
    means, _, _, _ = dp_segments(cb.numpy().astype(np.float64), counts.numpy() + 1e-3, k)
    reps = torch.tensor([int((cb - float(m)).abs().argmin()) for m in means])
    return reps[(cb[:, None] - cb[reps][None, :]).abs().argmin(1)].to(torch.uint8)


def _m_subset_stochastic(table: torch.Tensor, cb: torch.Tensor):
    """For :func:`_m_subset_table`'s representatives, each codeword's two bracketing representatives and the
    probability of the upper one that makes the choice unbiased in the codeword's value: ``(lo, hi, p_hi)``."""
    reps = table.long().unique()  # ascending codeword indices (the codebook ascends)
    c = cb.float()
    pos = torch.searchsorted(c[reps], c, right=True).clamp(1, reps.numel() - 1)
    lo, hi = reps[pos - 1], reps[pos]
    p = ((c - c[lo]) / (c[hi] - c[lo])).clamp(0, 1)
    return lo.to(torch.uint8), hi.to(torch.uint8), p


def _byte_moments(ref: str, **opts):
    def make(groups, lr, betas, seed, **kw):
        from byte_moments import make_variant
        return make_variant(ref, **opts)(groups, lr, betas, seed, **kw)
    return make


def _gefen_named_v8(substrings, steps: float = 16, levels: int = 256, coder=None, m_levels=None,
                    m_stochastic=False, **kw):
    """:func:`_gefen_named` with ``second_moment="elementwise"``, the group's per-element ``v`` re-coded
    after every step to what a one-byte log code per element (:func:`_code_v8`) would hold: an emulation
    of an 8-bit per-element second moment (~2 B/param with the 8-bit first moment) on the library's
    elementwise path (the D13 bound, row blocks and the native step as the default)."""
    def make(groups, lr, betas, seed, *, model, **_):
        opt = _gefen_named("elementwise", substrings, **kw)(groups, lr, betas, seed, model=model)
        gen = torch.Generator().manual_seed(1_000_003 + seed)
        coded = [p for g in opt.param_groups if g.get("second_moment") == "elementwise" for p in g["params"]]
        inner = opt.step
        maps = {}  # the first moment's maps onto m_levels codewords, made once the codebook is learned

        def recode_m():
            if not maps:
                maps["nearest"] = _m_subset_table(opt, m_levels)
                cb = next(st["codebook"] for st in opt.state.values() if st and "idx" in st)
                maps["lo"], maps["hi"], maps["p_hi"] = _m_subset_stochastic(maps["nearest"], cb.cpu())
            for st in opt.state.values():
                if st and "idx" in st:
                    ix = st["idx"].long()
                    if m_stochastic:  # between the two representatives around the codeword, unbiased
                        up = torch.rand(ix.shape, generator=gen) < maps["p_hi"][ix]
                        st["idx"].copy_(torch.where(up, maps["hi"][ix], maps["lo"][ix]))
                    else:
                        st["idx"].copy_(maps["nearest"][ix])

        def step(closure=None):
            out = inner(closure)
            with torch.no_grad():
                for p in coded:
                    st = opt.state.get(p)
                    if st and "v" in st:
                        code = coder if (coder and (coder is not _code_v_fac or st["v"].dim() == 2)) else _code_v8
                        st["v"].copy_(code(st["v"], gen, steps, levels))
                if m_levels:
                    recode_m()
            return out
        opt.step = step
        return opt
    make.needs_model = True
    return make


def _variant_attn_rowblock(per_head: bool, **kw):
    """A GefenVariant whose attention input projections (``attn.c_attn``, [3d, d]: q, k, v stacked
    by rows, each head's rows contiguous) get the ``"rowblock"`` second moment with one column
    profile per section (q, k, v) or, ``per_head``, per head of each section; every other tensor
    ``kw``'s."""
    def make(groups, lr, betas, seed, *, model, n_heads, **_):
        from _variants import GefenVariant
        over = {id(p): "rowblock" for name, p in model.named_parameters() if "attn.c_attn.weight" in name}
        assert over, "no attn.c_attn.weight"
        return GefenVariant(groups, lr=lr, betas=betas, eps=1e-8, seed=seed, v_override=over,
                            v_groups=3 * n_heads if per_head else 3, **kw)
    make.needs_model = True
    return make


def _variant_square_rowblocks(**kw):
    """A GefenVariant in which every 2-D tensor of R = k x C rows (k >= 2 an integer, C columns) gets
    the ``"rowblock"`` second moment with k blocks of C rows (a shape rule, no names): c_attn
    [3d, d] gets q, k, v, mlp.c_fc [4d, d] four blocks of d hidden units; every other tensor ``kw``'s."""
    def make(groups, lr, betas, seed, *, model, **_):
        from _variants import GefenVariant
        over, K = {}, {}
        for _, p in model.named_parameters():
            if p.dim() == 2 and p.shape[0] >= 2 * p.shape[1] and p.shape[0] % p.shape[1] == 0:
                over[id(p)], K[id(p)] = "rowblock", p.shape[0] // p.shape[1]
        return GefenVariant(groups, lr=lr, betas=betas, eps=1e-8, seed=seed, v_override=over, v_groups=K, **kw)
    make.needs_model = True
    return make


def _variant_blocks_meanvar_min(**kw):
    """(z) s_meanvar_min on the default's layout: every 2-D tensor of R = k x C rows (2 <= k <= 8, the
    library's row_blocks="auto" rule) gets ``"rowblock_meanvar_min"`` with k blocks (one column
    profile per block for g^2 and for the innovations), every other tensor ``"meanvar_min"``."""
    def make(groups, lr, betas, seed, *, model, **_):
        from _variants import GefenVariant
        from gefen_dist.core.periods import factored_row_blocks

        K = {id(p): k for p in model.parameters() if p.dim() == 2 and (k := factored_row_blocks(p.shape)) > 1}
        return GefenVariant(groups, lr=lr, betas=betas, eps=1e-8, seed=seed,
                            v_override=dict.fromkeys(K, "rowblock_meanvar_min"), v_groups=K,
                            second_moment_mode="meanvar_min", **kw)
    make.needs_model = True
    return make


def _variant_blocks_emb(mode: str, m_mode: Optional[str] = None, **kw):
    """u_square_blocks (row blocks on every [k x C, C] tensor) with the embeddings (wte, tied to
    the LM head, and wpe) given the second moment ``mode`` and first moment ``m_mode``, as
    :func:`_variant_emb` does."""
    def make(groups, lr, betas, seed, *, model, **_):
        from _variants import GefenVariant
        emb = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
        over, K = {k: mode for k in emb}, {}
        for _, p in model.named_parameters():
            if (id(p) not in emb and p.dim() == 2 and 2 * p.shape[1] <= p.shape[0] <= 8 * p.shape[1]
                    and p.shape[0] % p.shape[1] == 0):
                over[id(p)], K[id(p)] = "rowblock", p.shape[0] // p.shape[1]
        m_over = {k: m_mode for k in emb} if m_mode else None
        return GefenVariant(groups, lr=lr, betas=betas, eps=1e-8, seed=seed, v_override=over, v_groups=K,
                            m_override=m_over, **kw)
    make.needs_model = True
    return make


def _lowbit_split(m_bits: int, v_bits: int, q4_zero: int):
    """(o) every quantized tensor stores one byte per element split into an ``m_bits`` first moment
    and a ``v_bits`` per-element v correction (levels 2^(k/3) around the factored estimate, k from
    -q4_zero); the embeddings (wte = LM head, wpe) keep the (m) split of 4 + 4 bits."""
    def make(groups, lr, betas, seed, *, model, **_):
        from _variants import GefenVariant
        emb = {id(m.weight): dict(Q4V_EMB) for m in model.modules() if isinstance(m, nn.Embedding)}
        return GefenVariant(groups, lr=lr, betas=betas, eps=1e-8, seed=seed, first_moment="quant4",
                            second_moment_mode="factored_q4", m_bits=m_bits, v_bits=v_bits, q4_zero=q4_zero,
                            q4_step=1.0 / 3.0, lowbit_override=emb)
    make.needs_model = True
    return make


# name -> (description, factory); the letters are the ablation families of research/quality-log.md
def _rows8_steps(scale_steps: int, v_steps: int):
    """narrow_rows="rows8" with ``scale_steps`` / ``v_steps`` codes per octave (the library: 8 and 16)."""
    inner = _gefen(second_moment="factored", row_blocks="auto", narrow_rows="rows8")

    def make(groups, lr, betas, seed):
        from gefen_dist.core import rows8

        rows8.SCALE_STEPS, rows8.V_STEPS = scale_steps, v_steps
        return inner(groups, lr, betas, seed)
    return make


# quasi_uniforms' rotations per step on the 2^-16 grid: frac(sqrt 2) (first moment), frac(golden ratio) (v)
ROTATION_M, ROTATION_V = 27146, 40503


def quasi_uniforms(start: int, numel: int, key, device=None):
    """The one-byte layout's draws with a low-discrepancy sequence in time (research only): element ``i`` of
    tensor ``t`` at step ``s`` draws ``frac(o_i + s * alpha)`` on the 2^-16 grid, ``o_i`` a fixed hash of
    (``i``, ``t``) (its two 16-bit halves for the two moments), ``alpha`` frac(sqrt 2) for the first moment
    and the golden ratio's for ``v`` (:data:`ROTATION_M` / :data:`ROTATION_V`, on the 2^-16 grid).
    Each element's draws are equidistributed over steps like i.i.d. ones, but a run of roundings up is
    followed by rounds down (a rotation's partial sums stay bounded), so a code's rounding errors, which the
    EMA carries for ~1 / (1 - beta2) steps, largely cancel instead of adding up. The emulation that preceded
    the library's rule of 2026-12-07 (D20; withdrawn 2026-12-08, the library draws i.i.d. again); its offsets
    are another hash than that rule's, so its runs are a second realisation of it. ``key``: ``(step, tensor)``
    (:func:`_quasi_key`)."""
    import torch

    from gefen_dist.core import nibbles as nb

    step, tensor = key
    i = torch.arange(start, start + numel, dtype=torch.int64, device=device)
    h = nb.hash32(i ^ nb.hash32_int(int(tensor) * 0xC2B2AE3D + 0x2545F491))
    um = ((h >> 16) + int(step) * ROTATION_M) & 0xFFFF
    uv = ((h & 0xFFFF) + int(step) * ROTATION_V) & 0xFFFF
    return um.to(torch.float32) * nb._U16, uv.to(torch.float32) * nb._U16


def _quasi_key(seed: int, step: int, tensor: int):
    return (int(step), int(tensor))


def _withdrawn(name: str, why: str):
    """A variant whose runs came from a library rule this tree no longer has: constructing it raises."""
    def make(groups, lr, betas, seed):
        raise RuntimeError(f"variant {name!r}: {why}")
    return make


def _nibbles_quasi():
    """``second_moment="nibbles"`` on the eager reference with :func:`quasi_uniforms` in place of the
    library's i.i.d. draws (both moments). Patches ``gefen_dist.core.nibbles.uniforms`` and
    ``gefen_dist.engine.tensor_step.step_key`` for the process: run it in a process of its own (the
    quality scripts do)."""
    inner = _gefen(second_moment="nibbles", row_blocks="auto", fused=False)

    def make(groups, lr, betas, seed):
        from gefen_dist.core import nibbles as nb
        from gefen_dist.engine import tensor_step as ts

        nb.uniforms, ts.step_key = quasi_uniforms, _quasi_key
        return inner(groups, lr, betas, seed)
    return make


def _rows8_exact(part: str):
    """narrow_rows="rows8" with one of its two per-row quantities kept exact in float32 beside the codes
    (research only, one process): ``"v"`` (the second moment's EMA runs on float32 values, the scale
    stays coded) or ``"scale"`` (each row's scale is its maximum, ``v`` stays coded). Separates the two
    codes' costs on the tiny LM. Patches ``gefen_dist.engine.span_step``'s two rows8 hooks for the
    process (run these variants in a process of their own); the exact values live in the state dict
    (``_exact_v`` / ``_exact_scale``), so the state bytes printed for this variant count them."""
    inner = _gefen(second_moment="factored", row_blocks="auto", narrow_rows="rows8")

    def make(groups, lr, betas, seed):
        import math

        import torch

        from gefen_dist.core.step import ema_
        from gefen_dist.engine import span_step as ss

        decoded, update = getattr(ss, "_orig_rows8", (ss._rows8_decoded, ss._rows8_update_))
        ss._orig_rows8 = (decoded, update)

        def _decoded(st, sp):
            scale, v_old = decoded(st, sp)
            if part == "v" and "_exact_v" in st:
                v_old = st["_exact_v"].double()
            if part == "scale" and "_exact_scale" in st:
                scale = st["_exact_scale"].clone()
            return scale, v_old

        def _update(st, shape, sp, v_old, col, row_sum, row_amax, beta2, step):
            scale, v = update(st, shape, sp, v_old, col, row_sum, row_amax, beta2, step)
            if part == "v":  # the EMA of this step from the exact old value, not rounded
                v = ema_(v_old.to(torch.float32).clone(), (row_sum / math.prod(shape[1:])).to(torch.float32), beta2)
                st["_exact_v"] = v.clone()
            else:  # the rows' maxima themselves
                scale = row_amax.to(torch.float32).clone()
                st["_exact_scale"] = scale.clone()
            return scale, v

        ss._rows8_decoded, ss._rows8_update_ = _decoded, _update
        return inner(groups, lr, betas, seed)
    return make


def _adamw_fused(groups, lr, betas, seed):
    """torch AdamW with ``fused=True``: AdamW's math, rounded in another order (parameters differ by ~1 ulp
    after a few steps): the control for how much of an optimizer's plateau outcome a rounding-level
    perturbation decides."""
    return torch.optim.AdamW(groups, lr=lr, betas=betas, eps=1e-8, fused=True)


def _adamw_arnoise(sigma: float, phi: float):
    """torch AdamW whose every update is scaled per element by ``exp(sigma a_t)``, ``a_t`` a stationary AR(1)
    process per element (``a_t = phi a_{t-1} + sqrt(1 - phi^2) xi_t``, ``xi`` standard normal, a seeded
    generator): the step-size noise of a coarsely coded second moment, whose rounding error the EMA carries
    over ~1 / (1 - beta2) steps (``phi`` = beta2), with the log-normal spread measured for ``"nibbles"`` at
    step 150 of ``base`` (research/nibble_v_ratio.py: a 90% band of ~0.77-1.39, ``sigma`` ~0.18); ``phi = 0``:
    the same spread drawn afresh every step. Median factor 1: noise without a bias of the step size."""
    def make(groups, lr, betas, seed):
        opt = torch.optim.AdamW(groups, lr=lr, betas=betas, eps=1e-8)
        gen = torch.Generator().manual_seed(3_000_017 + seed)
        params = [p for g in opt.param_groups for p in g["params"]]
        state = [torch.randn(p.shape, generator=gen) for p in params]
        inner = opt.step
        keep = math.sqrt(1.0 - phi * phi)

        def step(closure=None):
            old = [p.detach().clone() for p in params]
            out = inner(closure)
            with torch.no_grad():
                for p, o, a in zip(params, old, state):
                    a.mul_(phi).add_(torch.randn(p.shape, generator=gen), alpha=keep)
                    p.copy_(o.add_((p - o).mul_(torch.exp(a * sigma).to(p.dtype))))
            return out
        opt.step = step
        return opt
    return make


def _adamw_jitter(rel: float):
    """torch AdamW whose every update is scaled per element by ``1 + rel * xi`` (``xi`` = +-1 with equal
    chance, a seeded generator): an unbiased perturbation of the trajectory of about the size of a
    quantized optimizer's per-step error, for how far a run's early-plateau outcome is decided by noise
    that favours neither direction."""
    def make(groups, lr, betas, seed):
        opt = torch.optim.AdamW(groups, lr=lr, betas=betas, eps=1e-8)
        gen = torch.Generator().manual_seed(2_000_003 + seed)
        params = [p for g in opt.param_groups for p in g["params"]]
        inner = opt.step

        def step(closure=None):
            old = [p.detach().clone() for p in params]
            out = inner(closure)
            with torch.no_grad():
                for p, o in zip(params, old):
                    xi = torch.randint(0, 2, p.shape, generator=gen).to(p.dtype).mul_(2).sub_(1)
                    p.add_((p - o).mul_(xi.mul_(rel)))
            return out
        opt.step = step
        return opt
    return make


RESEARCH_VARIANTS = {
    # (x) AdamW against itself: the same math rounded differently (fused=True), for the noise floor of paired gaps
    "x_adamw_fused": ("(x) torch AdamW with fused=True (AdamW's math, another rounding order)", _adamw_fused),
    "x_adamw_jitter1": ("(x) torch AdamW with each update scaled per element by 1 +- 1% (unbiased, seeded)",
                        _adamw_jitter(0.01)),
    # (x) AdamW against a small systematic change of itself: the whole schedule's lr x1.1 or x0.9
    "x_adamw_lr1.1": ("(x) torch AdamW, lr x1.1 (the control for how far a small systematic change moves the plateau "
                      "outcome)", _adamw),
    "x_adamw_lr0.9": ("(x) torch AdamW, lr x0.9", _adamw),
    # (x) AdamW with the step-size noise a coarsely coded v carries (log-normal, sigma 0.18), correlated over ~20
    # steps as beta2's EMA carries it, or drawn afresh each step: is the wandering v what delays "nibbles"' escape?
    "x_adamw_arnoise": ("(x) torch AdamW with each update scaled per element by exp(0.18 a), a an AR(1) process with "
                        "coefficient 0.95 (beta2): a coded v's correlated step-size noise", _adamw_arnoise(0.18, 0.95)),
    "x_adamw_iidnoise": ("(x) x_adamw_arnoise drawn afresh every step (coefficient 0)", _adamw_arnoise(0.18, 0.0)),
    "x_adamw_iidnoise_half": ("(x) x_adamw_iidnoise with half the spread (sigma 0.09): how much step-size noise the "
                              "plateau escape tolerates", _adamw_arnoise(0.09, 0.0)),
    "x_adamw_jitter10": ("(x) torch AdamW with each update scaled per element by 1 +- 10% (unbiased, seeded)",
                         _adamw_jitter(0.10)),
    # (a) unquantized first moment
    "a_fp32m_shared": ("(a) fp32 first moment, shared second moment", _variant(first_moment="fp32")),
    "a_fp32m_factored": ("(a) fp32 first moment, factored second moment",
                         _variant(first_moment="fp32", second_moment_mode="factored")),
    # (b) per-element second moment, quantized first moment on the default scale blocks
    "b_quantm_exactv": ("(b) quantized first moment, per-element fp32 second moment",
                        _variant(second_moment_mode="exact")),
    # (c) period rules for the shared second moment
    "c_period_row": ("(c) shared v, period = whole row", _variant(period_rule="row")),
    "c_period_one": ("(c) period 1 (per-element v; scale block = largest divisor of row <= 256)",
                     _variant(period_rule="one")),
    # (d) small-tensor threshold
    "d_thresh0": ("(d) shared, small_threshold=0 (only 1-D tensors exact)", _gefen(second_moment="shared", small_threshold=0)),
    "d_thresh64k": ("(d) shared, small_threshold=65536", _gefen(second_moment="shared", small_threshold=65536)),
    "d_factored_thresh0": ("(d) factored, small_threshold=0", _gefen(second_moment="factored", small_threshold=0)),
    # (h) which tensors the factored second moment costs loss on
    "h_factored_emb_exactv": ("(h) factored, but per-element fp32 v for the embeddings (wte = LM head, wpe)",
                              _variant_emb("exact", second_moment_mode="factored")),
    "h_factored_emb_rowv": ("(h) factored, but one v per row for the embeddings (wte = LM head, wpe)",
                            _variant_emb("row", second_moment_mode="factored")),
    "h_factored_emb_sm3": ("(h) factored, but the SM3 cover (steps never larger than AdamW's) for the embeddings "
                           "(wte = LM head, wpe); same state", _variant_emb("sm3", second_moment_mode="factored")),
    "h_factored_emb_grouped4": ("(h) factored, but 4 column profiles (rows grouped by v_row quantile, as j_grouped4) "
                                "for the embeddings only (wte = LM head, wpe)",
                                _variant_emb("grouped", second_moment_mode="factored", v_groups=4)),
    # (j) the factored estimate with K column profiles (rows grouped by v_row quantile)
    "j_grouped4": ("(j) factored with 4 column profiles, rows grouped by v_row quantile (all tensors)",
                   _variant(second_moment_mode="grouped", v_groups=4)),
    # (k) the factored estimate raised to the per-element EMA's own lower bounds (no extra state)
    "k_factored_clamp": ("(k) factored, raised per element to (1-b2) g^2 and kappa m^2 (bounds every "
                         "per-element EMA v obeys; no extra state)", _variant(second_moment_mode="factored_clamp")),
    # (l) SM3-II's cover of the per-element v (an upper bound: steps never larger than AdamW's)
    "l_sm3": ("(l) SM3 cover on the factored layout's row/column vectors: v_hat = b2 min(R_i, C_j) + "
              "(1-b2) g^2 >= AdamW's v per element (same state as factored)", _variant(second_moment_mode="sm3")),
    # (m) a per-element v in 4 bits relative to the factored estimate, paid for with a 4-bit m
    "m_q4v_all": ("(m) 4-bit m (16-entry DP codebook) and a per-element 4-bit v relative to the factored "
                  "estimate (levels 2^(k/3), k=-6..9, stochastic rounding) on every quantized tensor: 1 B/element, "
                  "the default's budget", _variant(first_moment="quant4", second_moment_mode="factored_q4", **Q4V)),
    "m_q4v_emb": ("(m) default, but 4-bit m and the per-element 4-bit v correction for the embeddings only "
                  "(wte = LM head, wpe): the default's budget",
                  _variant_emb("factored_q4", m_mode="quant4", second_moment_mode="factored", **Q4V)),
    "m_emb_q4v_m8": ("(m) default, but the per-element 4-bit v correction for the embeddings only, their first "
                     "moment kept at 8 bits (embeddings 1.5 B/element): m_q4v_emb without the 4-bit m",
                     _variant_emb("factored_q4", second_moment_mode="factored", **Q4V)),
    "m_emb_m4": ("(m) default, but a 4-bit first moment for the embeddings only (factored v everywhere): "
                 "m_q4v_emb without the v correction", _variant_emb(None, m_mode="quant4", second_moment_mode="factored")),
    "n_quant8m_q4v": ("(n) 8-bit m (the default's) and the per-element 4-bit v correction on every quantized tensor "
                      "(1.5 B/element): how much of per-element v's gain 4 bits keep",
                      _variant(second_moment_mode="factored_q4", **Q4V)),
    # (p) the (m) split with the element's v never below the factored estimate
    "p_q4vmax_emb": ("(p) as m_q4v_emb (4-bit m + per-element 4-bit v code for the embeddings only), but the "
                     "element's v kept >= the factored estimate (levels 2^(k/3), k=0..15): only steps the factored "
                     "estimate makes too long are shortened; the default's budget",
                     _variant_emb("factored_q4", m_mode="quant4", second_moment_mode="factored", **Q4V_FLOOR)),
    "p_q4vmax_all": ("(p) the floored 4-bit v code with a 4-bit m on every quantized tensor: 1 B/element, the "
                     "default's budget", _variant(first_moment="quant4", second_moment_mode="factored_q4", **Q4V_FLOOR)),
    # (q) per-element mean + factored variance: the same state as the default
    "q_meanvar": ("(q) the element's own m_hat^2 plus the factored estimate of the gradient's variance, from the "
                  "innovations g_t - m_hat_{t-1} (t >= 2, each scaled by 1/(1 + c_{t-1})): v_hat = m_hat^2 + "
                  "(1 - c_t) var_hat, c_t = Var(m_hat_t)/sigma^2; same state as the default, no step longer than lr",
                  _variant(second_moment_mode="meanvar")),
    "q_meanvar_fp32m": ("(q) as q_meanvar with an fp32 first moment (no rounding error in the innovations)",
                        _variant(second_moment_mode="meanvar", first_moment="fp32")),
    # (s) the element's own mean may only lengthen the factored step
    "s_meanvar_min": ("(s) v_hat = max(min(factored, m_hat^2 + factored innovation variance), (1-b2) g^2): the "
                      "element's own mean lengthens the factored step of consistent elements, never shortens it; "
                      "2 more float vectors per tensor", _variant(second_moment_mode="meanvar_min")),
    # (t) which non-embedding tensors the factored estimate costs loss on
    "t_exactv_attn": ("(t) factored, but a per-element fp32 v for the attention input projections (c_attn: q, k, v) "
                      "only", _variant_named("exact", ("attn.c_attn",), second_moment_mode="factored")),
    "t_exactv_mlp": ("(t) factored, but a per-element fp32 v for the MLP weights (mlp.c_fc, mlp.c_proj) only",
                     _variant_named("exact", ("mlp.c_fc", "mlp.c_proj"), second_moment_mode="factored")),
    "u_attn_qkv": ("(u) factored, but the attention input projections (c_attn) keep one column profile per section "
                   "(q, k, v): 3 x d floats more per layer", _variant_attn_rowblock(False, second_moment_mode="factored")),
    "u_attn_heads": ("(u) factored, but the attention input projections (c_attn) keep one column profile per head of "
                     "each of q, k, v: 3 x heads x d floats more per layer",
                     _variant_attn_rowblock(True, second_moment_mode="factored")),
    "u_square_blocks": ("(u) factored, but every 2-D tensor of k x C rows (C columns, k >= 2) keeps one column "
                        "profile per block of C rows: c_attn's q, k, v and mlp.c_fc's four blocks (a shape rule)",
                        _variant_square_rowblocks(second_moment_mode="factored")),
    # (x) speed: the column statistics one step late (would let the kernel fuse them into its read of g)
    "x_lagcol": ("(x) gefen_dist Gefen, defaults (row blocks), but v_col advanced with the previous step's column "
                 "means of g^2: the one-step lag that fusing the column pass into the kernel would need",
                 _lagcol(row_blocks="auto")),
    "x_lagv": ("(x) u_square_blocks (the default's math), but every step uses the second-moment EMAs from before "
               "its own gradient (v_row and the column profiles of step t-1, bias-corrected for t-1 updates; the "
               "first step its own): a delayed v as in AdaShift; same state",
               _variant_square_rowblocks(second_moment_mode="factored", v_lag=True)),
    # (y) the per-element recursion with a factored history: the current gradient enters exactly
    "n_li4v": ("(n) 8-bit m (the default's codebook and scale blocks) and Li et al. 2023's 4-bit per-element v (rank-1 "
               "normalisation by min(row max, column max), linear levels (k+1)/16 without zero, nearest rounding) on "
               "every quantized tensor: ~1.5 B/param, a candidate 'quality' setting",
               _variant(second_moment_mode="li4")),
    "y_innov": ("(y) u_square_blocks (the default's math), but each element's step uses b2 fact_{t-1} + (1 - b2) g_t^2: "
                "AdamW's recursion for v with only the history factored, the current gradient per element; same state",
                _variant_square_rowblocks(second_moment_mode="factored", v_innov=True)),
    # (z) the element's own mean (s) on the default's row blocks (u / D12)
    "z_blocks_meanvar_min": ("(z) s_meanvar_min with the default's row blocks: v_hat = max(min(factored, m_hat^2 + "
                             "factored innovation variance), (1-b2) g^2), both factored estimates with one column "
                             "profile per block of C rows of a [k x C, C] tensor; 2 more float vectors per tensor "
                             "(k column profiles for the blocked ones)", _variant_blocks_meanvar_min()),
    "z_blocks_clamp": ("(z) k_factored_clamp with the default's row blocks: the row blocks' factored estimate raised, per "
                       "element, to (1-b2) g^2 and kappa m^2 (no step longer than AdamW's can be); same state as the "
                       "default", _variant_square_rowblocks(second_moment_mode="factored_clamp", v_clamp=True)),
    "w_blocks_emb_q4vmax": ("(w) u_square_blocks plus p_q4vmax_emb's 4-bit m + floored per-element 4-bit v code "
                            "for the embeddings: the default's budget",
                            _variant_blocks_emb("factored_q4", m_mode="quant4", second_moment_mode="factored",
                                                **Q4V_FLOOR)),
    # (r) the two partial fixes together, at the default's budget
    "r_clamp_emb_q4vmax": ("(r) k_factored_clamp on every tensor but the embeddings, which get p_q4vmax_emb's 4-bit m + "
                           "floored per-element 4-bit v code: the default's budget",
                           _variant_emb("factored_q4", m_mode="quant4", second_moment_mode="factored_clamp",
                                        **Q4V_FLOOR)),
    # (o) the same byte split differently on the other tensors
    "o_m5v3": ("(o) as m_q4v_emb for the embeddings; every other quantized tensor 5-bit m (32-entry DP codebook) + "
               "3-bit v correction (levels 2^(k/3), k=-3..4): 1 B/element", _lowbit_split(5, 3, 3)),
    "o_m6v2": ("(o) as m_q4v_emb for the embeddings; every other quantized tensor 6-bit m (64-entry DP codebook) + "
               "2-bit v correction (levels 2^(k/3), k=-1..2): 1 B/element", _lowbit_split(6, 2, 1)),
    # (e) codebook refresh
    "e_refresh100": ("(e) shared, codebook re-learned every 100 steps", _variant(codebook_refresh=100)),
    "e_factored_refresh100": ("(e) factored, codebook re-learned every 100 steps",
                              _variant(second_moment_mode="factored", codebook_refresh=100)),
    "e_factored_cb_tensor": ("(e) factored, one codebook per tensor (each learned from its own first gradient)",
                             _variant(second_moment_mode="factored", codebook_scope="tensor")),
    # (f) rounding
    "f_stochastic": ("(f) shared, stochastic rounding (seeded per step and tensor)", _variant(rounding="stochastic")),
    "f_factored_stochastic": ("(f) factored, stochastic rounding",
                              _variant(second_moment_mode="factored", rounding="stochastic")),
    # (g) lr scaling
    "g_shared_lr1.5": ("(g) shared, lr x1.5", _gefen(second_moment="shared")),
    "g_shared_lr0.7": ("(g) shared, lr x0.7", _gefen(second_moment="shared")),
    "g_factored_lr1.5": ("(g) factored, lr x1.5", _gefen(second_moment="factored")),
    "g_adamw_lr1.5": ("(g) AdamW, lr x1.5 (the control for the lr-scaled Gefen rows)", _adamw),
    "g_default_lr0.75": ("(g) gefen_dist Gefen, defaults (row blocks, D12), lr x0.75",
                         _gefen(second_moment="factored", row_blocks="auto")),
    "g_adamw_lr0.75": ("(g) AdamW, lr x0.75 (the control for g_default_lr0.75)", _adamw),
    "g_default_lr1.5": ("(g) gefen_dist Gefen, defaults (row blocks, D12), lr x1.5",
                        _gefen(second_moment="factored", row_blocks="auto")),
    # (v) D13 vs D14 on the shipped default: the bound off, the shape period (D14) kept
    "v_default_unbounded": ("(v) gefen_dist Gefen, defaults but bound_updates=False (D14's shape period, no "
                            "D13 clamp): separates the bound from the period rule",
                            _gefen(second_moment="factored", row_blocks="auto", bound_updates=False)),
    # (v) a bound twice AdamW's: the largest factor that keeps issue 26's three workloads within 5% of
    # AdamW (bag of features 0.87x AdamW's loss at 2x, 1.19x at 4x; dead first batch, plain MLP ~1.00x)
    # (v) D17: the default against the paper's codebook fit, both on the native CPU step (fused=None; the
    # other variants run the eager path), paired by seed on one host
    "v_default_fused": ("(v) gefen_dist Gefen, defaults (D17's symmetric codebook fit), native CPU step",
                        _gefen(second_moment="factored", row_blocks="auto", fused=None)),
    "v_default_paper_cb_fused": ("(v) the default with symmetric_codebook=False (the paper's codebook fit, the default "
                                 "before D17), native CPU step", _gefen(second_moment="factored", row_blocks="auto",
                                                                        fused=None, symmetric_codebook=False)),
    # (v) the default with the embeddings (wte, tied to the LM head, and wpe) in a param group of their own
    # with second_moment="elementwise" (the library option), native CPU step: the embeddings' share of the gap
    # measured again on the current default (row blocks, the relaxed D13 bound, D17), paired with v_default_fused
    "v_emb_elementwise_fused": ("(v) the default (D17), with the embeddings' param group second_moment="
                                "\"elementwise\", native CPU step",
                                quality._gefen_emb("elementwise", second_moment="factored", row_blocks="auto",
                                                   fused=None)),
    # (v) which non-embedding tensors carry the current default's gap on `small`: the attention input
    # projections or the MLP weights in a param group of their own with second_moment="elementwise" (fp32 v
    # per element, D11), the rest the default; paired with v_default_fused and v_emb_elementwise_fused
    "v_attn_elementwise_fused": ("(v) the default (D17), with the attention input projections (attn.c_attn) in a "
                                 "param group with second_moment=\"elementwise\", native CPU step",
                                 _gefen_named("elementwise", ("attn.c_attn",), second_moment="factored",
                                              row_blocks="auto")),
    "v_mlp_elementwise_fused": ("(v) the default (D17), with the MLP weights (mlp.c_fc, mlp.c_proj) in a param "
                                "group with second_moment=\"elementwise\", native CPU step",
                                _gefen_named("elementwise", ("mlp.c_fc", "mlp.c_proj"), second_moment="factored",
                                             row_blocks="auto")),
    # (v) a per-element v in one byte (log codes, 16 per octave, stochastic; emulated on the elementwise path):
    # does it keep what the per-element fp32 v gains? (research/head_vshare.py: neutral on a dense head)
    "v_all_elementwise_fused": ("(v) the default (D17), with every weight in a param group with second_moment="
                                "\"elementwise\" (fp32 v per element, ~5 B/param), native CPU step",
                                _gefen_named("elementwise", ("weight",), second_moment="factored", row_blocks="auto")),
    "v_all_v8_fused": ("(v) as v_all_elementwise_fused with every per-element v re-coded after each step to a one-byte "
                       "log code (16 per octave, stochastic, per-256 references): ~2.0 B/param",
                       _gefen_named_v8(("weight",), second_moment="factored", row_blocks="auto")),
    # (v) the same for the embeddings (wte, tied to the LM head, and wpe) and the attention input projections only,
    # the two classes whose per-element fp32 v gained on seed 6: ~1.5 B/param on GPT-2 small with one byte of v
    "v_embattn_elementwise_fused": ("(v) the default (D17), with wte, wpe and attn.c_attn in a param group with "
                                    "second_moment=\"elementwise\" (fp32 v per element), native CPU step",
                                    _gefen_named("elementwise", ("wte.", "wpe.", "attn.c_attn"),
                                                 second_moment="factored", row_blocks="auto")),
    "v_embattn_v8_fused": ("(v) as v_embattn_elementwise_fused with their per-element v re-coded after each step to a "
                           "one-byte log code (as v_all_v8_fused)",
                           _gefen_named_v8(("wte.", "wpe.", "attn.c_attn"), second_moment="factored",
                                           row_blocks="auto")),
    # (v) which tensors' v needs a one-byte code for `base`'s early plateau to be left on time (v_all_v8_fused is on
    # time on seeds 3, 6, 10; the default is late on 3 and 9): the attention input projections alone (induction-head
    # circuits form in them; ~1.19 B/param on GPT-2 small) or the embeddings alone (~1.33 B/param)
    "v_attn_v8_fused": ("(v) the default (D17), with the attention input projections' per-element v re-coded after each "
                        "step to a one-byte log code (as v_all_v8_fused): ~1.19 B/param on GPT-2 small",
                        _gefen_named_v8(("attn.c_attn",), second_moment="factored", row_blocks="auto")),
    "v_attn_v4fac4_fused": ("(v) v_attn_v8_fused with half a byte: the attention input projections' v in 4-bit codes "
                            "against their factored estimate (as v_all_v4fac4_fused): ~1.10 B/param on GPT-2 small",
                            _gefen_named_v8(("attn.c_attn",), 4, 16, coder=_code_v_fac, second_moment="factored",
                                            row_blocks="auto")),
    "v_emb_v8_fused": ("(v) the default (D17), with the embeddings' (wte, wpe) per-element v re-coded after each step to "
                       "a one-byte log code (as v_all_v8_fused): ~1.33 B/param on GPT-2 small",
                       _gefen_named_v8(("wte.", "wpe."), second_moment="factored", row_blocks="auto")),
    # (v) half a byte: 16 levels, one per octave (a 15-octave range: research/head_vshare.py's dense head needs the
    # range more than the resolution); ~1.52 B/param, inside issue 26's 1.6 for a quality setting
    "v_all_v4_fused": ("(v) as v_all_v8_fused with 4-bit codes, one per octave (16 levels, per-256 references): "
                       "~1.52 B/param", _gefen_named_v8(("weight",), 1, 16, second_moment="factored", row_blocks="auto")),
    "v_all_v4fac_fused": ("(v) as v_all_v4_fused, but each 2-D tensor's 4-bit codes relative to its factored estimate "
                          "(two per octave, 2^-4 .. 2^3.5 of it; fp32 row and column means beside them): ~1.5 B/param",
                          _gefen_named_v8(("weight",), 2, 16, coder=_code_v_fac, second_moment="factored",
                                          row_blocks="auto")),
    # (v) finer steps against the factored estimate (2026-12-07: two per octave delay the early-plateau escape on
    # `base` seed 6, 16 per octave do not): four per octave over 4 octaves (4 bits), or over 8 (5 bits)
    "v_all_v4fac4_fused": ("(v) as v_all_v4fac_fused with four codes per octave (2^-2 .. 2^1.75 of the estimate)",
                           _gefen_named_v8(("weight",), 4, 16, coder=_code_v_fac, second_moment="factored",
                                           row_blocks="auto")),
    "v_all_v5fac4_fused": ("(v) 5-bit codes against the factored estimate, four per octave (2^-4 .. 2^3.75 of it)",
                           _gefen_named_v8(("weight",), 4, 32, coder=_code_v_fac, second_moment="factored",
                                           row_blocks="auto")),
    # (v) v_all_v8_fused's one-byte codes of v (on time on `base` seeds 3, 6, 10 where 4-bit codes are late) with
    # the 4-bit stochastic first moment of the one-byte layout: 12 bits per element, ~1.5 B/param
    "v_all_m4sv8_fused": ("(v) v_all_v8_fused (8-bit codes of v, 16 per octave, per-256 maxima) with a 4-bit first "
                          "moment rounded stochastically (16 codewords): ~1.5 B/param",
                          _gefen_named_v8(("weight",), m_levels=16, m_stochastic=True, second_moment="factored",
                                          row_blocks="auto")),
    # (v) the 4-bit stochastic first moment alone, beside an fp32 per-element v (no coding of v): the first moment's
    # share of the one-byte layout's late escapes on base, without v's rounding noise
    "v_all_m4s_fused": ("(v) a 4-bit first moment rounded stochastically (16 codewords) with an fp32 per-element v "
                        "(~5 B/param: an emulation, not a layout)",
                        _gefen_named_v8(("weight",), coder=_keep_v, m_levels=16, m_stochastic=True,
                                        second_moment="factored", row_blocks="auto")),
    # (v) 12 bits per element split evenly (~1.5 B/param, inside issue 26's 1.6 for a quality setting): a 6-bit first
    # moment (64 of the learned codewords) and 6-bit codes of v, 8 per octave over 8 octaves below each 256-block's maximum
    "v_all_m6v6_fused": ("(v) a 6-bit first moment (64 codewords, nearest) and 6-bit codes of v (8 per octave, per-256 "
                         "maxima, stochastic): ~1.5 B/param",
                         _gefen_named_v8(("weight",), 8, 64, m_levels=64, second_moment="factored", row_blocks="auto")),
    "v_all_m6sv6_fused": ("(v) v_all_m6v6_fused with the first moment rounded stochastically: ~1.5 B/param",
                          _gefen_named_v8(("weight",), 8, 64, m_levels=64, m_stochastic=True, second_moment="factored",
                                          row_blocks="auto")),
    # (v) the range of half a byte: 16 levels over each 256-block's own (min, max) of v, and a 4-bit first moment (16
    # of the 256 learned codewords, chosen by the same DP): 4 + 4 bits ~ 1.03 B/param, inside the default's 1.1
    "v_all_v4mm_fused": ("(v) as v_all_v4_fused with the 16 levels spread over each 256-block's own log range "
                         "(min and max nonzero v): ~1.55 B/param",
                         _gefen_named_v8(("weight",), 0, 16, coder=_code_v_mm, second_moment="factored",
                                         row_blocks="auto")),
    "v_all_m4v4_fused": ("(v) as v_all_v4_fused with a 4-bit first moment too (16 of the learned codewords, by the DP "
                         "on their use after step 1): ~1.03 B/param", _gefen_named_v8(
                             ("weight",), 1, 16, m_levels=16, second_moment="factored", row_blocks="auto")),
    "v_all_m4v4mm_fused": ("(v) v_all_v4mm_fused with the 4-bit first moment of v_all_m4v4_fused: ~1.05 B/param",
                           _gefen_named_v8(("weight",), 0, 16, coder=_code_v_mm, m_levels=16,
                                           second_moment="factored", row_blocks="auto")),
    "v_all_m4sv4_fused": ("(v) as v_all_m4v4_fused with the 4-bit first moment rounded stochastically between its two "
                          "nearest representatives (unbiased in the value): ~1.03 B/param", _gefen_named_v8(
                              ("weight",), 1, 16, m_levels=16, m_stochastic=True, second_moment="factored",
                              row_blocks="auto")),
    # (v) one byte per element for both moments (the default's bytes, ~1.02 B/param): k bits of first moment (2^k of the
    # learned codewords) and 8 - k bits of v relative to the factored estimate the default's v_row / v_col already hold
    "v_all_m6v2fac_fused": ("(v) one byte per element: a 6-bit first moment (64 learned codewords, nearest) and a 2-bit v "
                            "vs the factored estimate (2^-2 .. 2^1, one per octave, stochastic): ~1.02 B/param",
                            _gefen_named_v8(("weight",), 1, 4, coder=_code_v_fac, m_levels=64,
                                            second_moment="factored", row_blocks="auto")),
    "v_all_m6sv2fac_fused": ("(v) v_all_m6v2fac_fused with the first moment rounded stochastically: ~1.02 B/param",
                             _gefen_named_v8(("weight",), 1, 4, coder=_code_v_fac, m_levels=64, m_stochastic=True,
                                             second_moment="factored", row_blocks="auto")),
    "v_all_m5sv3fac_fused": ("(v) one byte per element: a 5-bit first moment (32 codewords, stochastic) and a 3-bit v vs "
                             "the factored estimate (2^-4 .. 2^3, one per octave): ~1.02 B/param",
                             _gefen_named_v8(("weight",), 1, 8, coder=_code_v_fac, m_levels=32, m_stochastic=True,
                                             second_moment="factored", row_blocks="auto")),
    "v_all_m4sv4fac_fused": ("(v) one byte per element: a 4-bit first moment (16 codewords, stochastic) and a 4-bit v vs "
                             "the factored estimate (2^-4 .. 2^3.5, two per octave): ~1.02 B/param",
                             _gefen_named_v8(("weight",), 2, 16, coder=_code_v_fac, m_levels=16, m_stochastic=True,
                                             second_moment="factored", row_blocks="auto")),
    # (v) the prototype optimizer of that layout (research/byte_moments.py: 16-entry codebook by the DP, stochastic
    # rounding keyed by element index, v's codes against the factored EMAs or per-256 maxima, one uint8 per element)
    "v_bytes_fac_proto": ("(v) research/byte_moments.py, ref='fac': one byte per element (4-bit m, 4-bit v vs the "
                          "factored estimate), plain torch: ~1.02 B/param", _byte_moments("fac")),
    "v_bytes_block_proto": ("(v) research/byte_moments.py, ref='block': 4-bit v vs per-256 maxima: ~1.03 B/param",
                            _byte_moments("block")),
    # its ref="none": the default's layout (8-bit first moment, the factored v) with the first moment rounded to
    # the nearest codeword (as the library) or stochastically: is stochastic rounding what the byte layouts gain?
    # the update from the stored (stochastically rounded) codes instead of the float32 moments: what the build must
    # do where a rank applies an update it did not compute (ZeroGefen and DeepSpeed move only the compressed state)
    "v_bytes_fac_dec_proto": ("(v) v_bytes_fac_proto with the update from the decoded codes (both moments as stored)",
                              _byte_moments("fac", update="decoded")),
    # the library's function of that layout (gefen_dist.core.nibbles, the prototype's ref="core"): the library's
    # scale blocks and D12 row blocks, v rounded unbiased in its value (not its code), one hash for both draws
    # the library's Gefen(second_moment="nibbles") (D20): what v_nib_core steps, through the engine
    # (y) finer row blocks of the factored v (D12's column profile per block of rows, down to blocks of 64 or 32
    # rows): 4 / rows B/param more on the tensors they divide (GPT-2 small: ~1.06 / ~1.10 B/param in all)
    "y_rb64_fused": ("(y) gefen_dist Gefen, the default with one column profile per block of 64 rows (row_blocks = "
                     "R // 64 where 64 divides the R >= 128 rows; else 'auto'), native CPU step",
                     _gefen_rows_per_block(64)),
    "y_rb32_fused": ("(y) as y_rb64_fused with blocks of 32 rows", _gefen_rows_per_block(32)),
    # (z) Hugging Face GPT-2's Conv1D layout ((in, out) weights): D12's row blocks do not apply to it (the q, k, v
    # sections and the hidden units are blocks of columns), so its default is Adafactor's single profile there
    "z_conv1d_adamw": ("(z) torch AdamW on the model with its blocks' linear layers in the Conv1D layout",
                       _conv1d_layout(_adamw)),
    "z_conv1d_default_fused": ("(z) gefen_dist Gefen, defaults (native step), on the model with its blocks' linear "
                               "layers in the Conv1D layout", _conv1d_layout(_gefen(second_moment="factored",
                                                                                     row_blocks="auto", fused=None))),
    "z_conv1d_colblocks": ("(z) as z_conv1d_default_fused, but every (R, k x R) weight (2 <= k <= 8: c_attn, c_fc in this "
                           "layout) keeps one row EMA per block of R columns (D12 transposed; research/_variants.py's "
                           "ColBlockGefen, those tensors stepped eagerly)", _conv1d_layout(_colblocks())),
    "z_conv1d_colblocks_sb": ("(z) as z_conv1d_colblocks with the column-blocked tensors' absmax-scale blocks inside their "
                              "column blocks (R elements here: 192, against the row's 576 and 768)",
                              _conv1d_layout(_colblocks(scale_in_blocks=True))),
    "z_conv1d_colblocks_lib": ("(z) gefen_dist Gefen(col_blocks='auto') (D21, native step) on the model with its blocks' "
                               "linear layers in the Conv1D layout: the library's column blocks (scale blocks inside them)",
                               _conv1d_layout(_gefen(second_moment="factored", row_blocks="auto", col_blocks="auto",
                                                     fused=None))),
    "y_colblocks_lib": ("(y) gefen_dist Gefen(col_blocks='auto') (D21, native step), nn.Linear layout: the default plus "
                        "column blocks on the MLP down-projection (d, 4d)",
                        _gefen(second_moment="factored", row_blocks="auto", col_blocks="auto", fused=None)),
    "y_colblocks": ("(y) the default (nn.Linear layout) plus D12 transposed on every (R, k x R) weight (2 <= k <= 8: "
                    "the MLP's down-projection, (d, 4d) here): one row EMA per block of R columns (research/_variants.py's "
                    "ColBlockGefen, those tensors stepped eagerly)", _colblocks()),
    "v_nibbles": ("(v) gefen_dist Gefen(second_moment='nibbles'): one byte per element for both moments (D20), "
                  "~1.02 B/param", _gefen(second_moment="nibbles", row_blocks="auto", fused=None)),
    "v_nibbles_quasi": ("(v) gefen_dist Gefen(second_moment='nibbles') with its quasi-random draws in time (the "
                        "library's rule from 2026-12-07 to 2026-12-08, D20; withdrawn): its runs came from commits "
                        "8732e2c..5612db4; this tree's library draws i.i.d., so the name refuses to run",
                        _withdrawn("v_nibbles_quasi", "the library's quasi-random draws were withdrawn on 2026-12-08; "
                                   "run it from a worktree of commit 5612db4, or run v_nibbles_qr (their eager "
                                   "emulation)")),
    "v_nibbles_qr": ("(v) second_moment='nibbles' (eager reference) with quasi-random draws in time (a rotation by "
                     "frac(sqrt 2) / frac(golden ratio) per step from a fixed per-element offset) instead of i.i.d. ones",
                     _nibbles_quasi()),
    "v_nib_core": ("(v) gefen_dist.core.nibbles through research/byte_moments.py (ref='core'): one byte per element, "
                   "the update from the float32 moments: ~1.02 B/param", _byte_moments("core")),
    "v_nib_core_dec": ("(v) v_nib_core with the update from the stored codes", _byte_moments("core", update="decoded")),
    "v_bytes_m8_nearest_proto": ("(v) research/byte_moments.py, ref='none', m_round='nearest': the default's layout "
                                 "in plain torch (~1.02 B/param)", _byte_moments("none", m_round="nearest")),
    "v_bytes_m8_stoch_proto": ("(v) as v_bytes_m8_nearest_proto with the first moment rounded stochastically",
                               _byte_moments("none")),
    "v_default_bound2": ("(v) gefen_dist Gefen, defaults but bound_updates=2.0 (every normalised update clamped "
                         "to 2 K_t instead of K_t)", _gefen(second_moment="factored", row_blocks="auto",
                                                            bound_updates=2.0)),
    # (w) D19 on the tiny LM (d_model 64: every weight but the MLP's c_proj has rows of 64): rows8 against the
    # default ("auto", named explicitly so that its runs stay its own if the default changes), with controls
    "gefen_auto": ("gefen_dist Gefen, the default named explicitly: narrow_rows='auto' (D18: rows of 22-79 elements "
                   "per row in float32)", _gefen(second_moment="factored", row_blocks="auto", narrow_rows="auto")),
    "w_rows8": ("(w) gefen_dist Gefen, narrow_rows='rows8' (D19: rows of 22-79 elements with their scale and v in "
                "one-byte codes, one column profile per tensor), the other settings the default's",
                _gefen(second_moment="factored", row_blocks="auto", narrow_rows="rows8")),
    # (w) the row codes' resolution: the scale in 16 codes per octave (rounded up by at most 4.4%, not 9%),
    # and v in 32 (2.2% a code; its range from the block maximum shrinks to 2^-7.9). Format experiments: the
    # constants of gefen_dist.core.rows8 are set for the run (a state of one setting does not decode under
    # the other)
    "w_rows8_s16": ("(w) narrow_rows='rows8' with the scale in 16 codes per octave",
                    _rows8_steps(16, 16)),
    "w_rows8_v32": ("(w) narrow_rows='rows8' with v in 32 codes per octave", _rows8_steps(8, 32)),
    "w_rows8_exact_v": ("(w) narrow_rows='rows8' with each row's v in float32 beside the codes (the scale coded)",
                        _rows8_exact("v")),
    "w_rows8_exact_scale": ("(w) narrow_rows='rows8' with each row's scale its maximum in float32 (v coded)",
                            _rows8_exact("scale")),
    "w_auto_rb1": ("(w) gefen_dist Gefen, narrow_rows='auto' (per row in float32) with row_blocks=1 (one column "
                   "profile, as narrow_rows='rows8' keeps)",
                   _gefen(second_moment="factored", row_blocks=1, narrow_rows="auto")),
}
LR_SCALE = {"x_adamw_lr1.1": 1.1, "x_adamw_lr0.9": 0.9, "g_shared_lr1.5": 1.5, "g_shared_lr0.7": 0.7, "g_factored_lr1.5": 1.5, "g_adamw_lr1.5": 1.5,
            "g_default_lr1.5": 1.5, "g_default_lr0.75": 0.75, "g_adamw_lr0.75": 0.75}


def _state_q4_embeddings(m4: bool):
    """GPT-2-small state row: the default (one column profile) with the embeddings' per-element
    4-bit v correction, and with ``m4`` their 4-bit first moment (+ its 16-entry codebook)."""
    def build(params):
        from _variants import GefenVariant

        ids = {id(p): "factored_q4" for name, p in params if name in quality.EMBEDDINGS}
        return GefenVariant(params, lr=1e-3, second_moment_mode="factored", v_override=ids,
                            m_override={k: "quant4" for k in ids} if m4 else None)
    build.period_one = lambda name: False
    build.extra_bytes = 16 * 4 if m4 else 0
    return build


GPT2_STATE_ROWS = {
    "factored, embeddings 4-bit m + 4-bit v correction (m_q4v_emb)": _state_q4_embeddings(True),
    "factored, embeddings 8-bit m + 4-bit v correction (m_emb_q4v_m8)": _state_q4_embeddings(False),
}


def register_all() -> None:
    """Add every research variant (and its GPT-2-small state rows) to ``benchmarks/quality.py``."""
    quality.OWN_MODULES.add("_variants")
    for name, (desc, factory) in RESEARCH_VARIANTS.items():
        quality.register(name, desc, factory, LR_SCALE.get(name))
    quality.GPT2_STATE_ROWS.update(GPT2_STATE_ROWS)


register_all()


def main(argv=None):
    return quality.main(argv, doc=LOG, script="research/quality_variants.py")


if __name__ == "__main__":
    main()
