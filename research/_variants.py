"""Ablation variants of ``gefen_dist.Gefen`` for the quality benchmark (research code only;
``research/quality_variants.py`` registers them with ``benchmarks/quality.py``).

``GefenVariant`` subclasses :class:`gefen_dist.Gefen` and changes one mechanism at a time, leaving
everything else (period detection, codebook learning, exact small tensors, bias correction,
decoupled weight decay) to the parent class:

* ``first_moment="fp32"``: an unquantized float32 first moment (4 B/param) instead of the uint8
  codebook index plus per-block absmax scale.
* ``second_moment_mode="exact"``: a per-element float32 second moment (4 B/param) while the first
  moment stays quantized on the default scale blocks; ``"shared"``/``"factored"`` as in Gefen.
* ``period_rule``: ``"paper"`` (the paper's detection, then gcd with the row, D1: the default),
  ``"row"`` (the whole dim-0 row is one block), ``"one"`` (period 1: per-element second moment, and
  scale blocks of the largest divisor of the row <= 256).
* ``rounding="stochastic"``: unbiased stochastic rounding between the two neighbouring codewords,
  with a generator seeded from (seed, step, tensor index) so every rank draws the same numbers.
* ``v_override={id(param): "exact" | "row" | "sm3" | "grouped"}``: for those parameters only, a
  per-element float32 second moment (``"exact"``), one shared second moment per dim-0 row
  (``"row"``), or the SM3 cover or grouped estimate below (``"sm3"``, ``"grouped"``; with
  ``second_moment_mode="factored"``), the others
  keeping ``second_moment_mode``: to locate which tensors a second-moment estimator costs loss on.
* ``second_moment_mode="grouped"`` (``v_groups=K``): the factored estimate with K column profiles
  instead of one. Every step the rows are ranked by their ``v_row`` and split into K equal
  quantile groups; each group keeps an EMA of its rows' column sums of g^2, and a row's step size
  uses its group's column profile (``v_row[i] * C_k[j] / mean(C_k)``). Costs K x cols floats per
  tensor. Single-process (the ranking is over the local rows).
* ``second_moment_mode="rowblock"`` (``v_groups=K``): as ``"grouped"``, but the K groups are K
  contiguous blocks of rows (the rows must split evenly): for an attention input projection
  ``[3d, d]``, K = 3 gives q, k and v each their own column profile, K = 3 x heads each head's
  q, k and v. Costs K x cols floats per tensor.
* ``second_moment_mode="factored_clamp"``: the factored estimate raised, per element, to the two
  lower bounds every per-element EMA ``v`` obeys: ``v_t >= (1 - b2) g_t^2`` and (Cauchy-Schwarz on
  the two EMAs, zero-initialised) ``v_t >= kappa_t m_t^2`` with ``kappa_t = (1 - b2) / ((1 - b1)^2
  sum_{k<t} (b1^2 / b2)^k)`` (5 at t = 1, 0.737 for large t at betas (0.9, 0.95)), ``m_t`` the
  (quantized) first moment used in the update. No extra state: the normalised update can no
  longer exceed what AdamW's can.
* ``second_moment_mode="sm3"``: SM3-II's cover (Anil, Gupta, Koren, Singer 2019) with an EMA, on the
  factored layout's row and column vectors: per element ``nu = b2 min(R_i, C_j) + (1 - b2) g^2``
  (a temporary), then ``R_i = max_j nu``, ``C_j = max_i nu``. By induction ``nu >= v`` of
  the per-element EMA, so every step is at most AdamW's, never larger (the factored estimate errs
  both ways). Same state as factored. Single-process (the maxima are over the local tensor).
* ``codebook_scope="tensor"``: each quantized tensor learns its own 256-entry codebook, by the same
  exact DP, from the histogram of its own first gradient (the library learns one codebook from the
  histogram of all of them, D4). Tensors whose first gradient is zero everywhere keep the global
  codebook. Costs 1 KiB per tensor.
* ``second_moment_mode="meanvar"``: the element's own (bias-corrected) first moment supplies the
  mean and the factored layout the variance: ``v_row``/``v_col`` hold EMAs of the row and column
  means of the squared innovations ``g_t - m_hat_{t-1}`` (from t = 2, each divided by
  ``1 + c_{t-1}``, ``c_t = Var(m_hat_t) / sigma^2 = (1-b1)/(1+b1) (1+b1^t)/(1-b1^t)``, so each
  estimates the gradient's variance), and ``v_hat = m_hat^2 + (1 - c_t) var_hat``: exact for a
  gradient whose mean is not rank-1 but whose variance is, and ``|step| <= lr``. Same state as
  factored; with the 8-bit or the fp32 first moment. Single-process (local column means).
* ``second_moment_mode="meanvar_min"``: ``v_hat = max(min(fact_hat, m_hat^2 + (1 - c_t) var_hat),
  (1 - b2) g^2 / bc2)``: the factored estimate of ``g^2`` (the parent's ``v_row``/``v_col``) and,
  next to it, the meanvar mode's factored EMAs of the innovations (``e_row``/``e_col``, as many
  floats again). The element's own mean can only lengthen the factored step (for consistent,
  high signal-to-noise elements, which a row/column average under-steps), never shorten it (the
  meanvar mode's early plateau); the floor is the bound every per-element EMA ``v`` obeys.
  8-bit first moment only. Single-process (local column means).
* ``second_moment_mode="factored_q4"``: the factored estimate times a per-element low-bit
  correction, i.e. a per-element EMA ``v`` stored in ``v_bits`` (default 4) relative to the
  factored estimate ``fact = v_row[i] v_col[j] / mean(v_col)`` (rank-1 normalisation, as Li et al.
  2023 do for their 4-bit ``v``): code ``c`` stands for ``v = fact * 2^((c - q4_zero) * q4_step)``
  (defaults 8 and 0.5: ``2^-4``..``2^3.5`` around ``fact``). Each step rebuilds ``v_{t-1}`` from
  the codes and the previous ``fact``, advances it exactly (``b2 v + (1 - b2) g^2``), steps with
  that value, and stores it back by stochastic rounding between the two neighbouring levels with
  the probability that keeps ``E[v]`` unbiased (so an EMA that decays by ``b2`` per step can still
  move between levels). With the 8-bit first moment the codes are packed two per byte (+0.5
  B/element); with ``first_moment="quant4"`` they share the first moment's byte.
  ``q4_floor=True``: the element's ``v`` is kept at or above the factored estimate
  (``v_t = max(fact_t, b2 v_{t-1} + (1 - b2) g^2)``), so the correction only ever shortens a step
  the factored estimate makes too long; use it with ``q4_zero=0`` (levels ``1x``..``2^(15 step)``).
* ``second_moment_mode="li4"``: Li, Chen, Zhu 2023 ("Memory Efficient Optimizers with 4-bit States")'s
  4-bit second moment on the factored layout's storage: a per-element EMA ``v`` stored as a 4-bit code
  (two per byte, +0.5 B/element) relative to the rank-1 normaliser ``N_ij = min(max_j v_ij, max_i v_ij)``
  (the row and column maxima of the new ``v``, kept in ``v_row`` / ``v_col``), with their linear mapping
  that excludes zero (code ``k`` stands for ``(k + 1) / 16 N``) and deterministic nearest rounding. Each
  step rebuilds ``v`` from the codes and the stored maxima, advances it exactly, steps with it and stores
  it back: no random numbers, so every shard layout gets the same codes. Elements far below their
  row's and column's maxima are held at ``N / 16`` (never zero, never a long step); an EMA decaying by
  ``b2`` per step moves down a level only from codes >= 9 (rounding), below that it stays (shorter steps).
* ``first_moment="quant4"``: a low-bit first moment (``m_bits``, default 4): 2^m_bits codewords
  learned by the same exact DP from the same global histogram of the first gradient (ends at -1
  and +1), on the default scale blocks. It is stored in one byte per element, the index in the low
  ``m_bits`` and, with ``factored_q4``, the ``v_bits``-bit v code above it (``m_bits + v_bits <= 8``):
  1 B/element, the default's budget, with a per-element ``v``. (With the 8-bit first moment the
  4-bit v codes are packed two per byte instead.)
* ``m_override={id(param): "quant4"}``: the low-bit first moment for those parameters only;
  ``lowbit_override={id(param): dict(m_bits=, v_bits=, q4_zero=, q4_step=)}``: other bit splits and
  levels for those parameters (one low-bit codebook per distinct ``m_bits``).
* ``v_innov=True`` (``"factored"`` / ``"rowblock"``): each element's step size uses AdamW's
  recursion for ``v`` with only the history factored, ``v_hat_t = b2 fact_{t-1} + (1 - b2) g_t^2``
  (``fact_{t-1}``: the factored estimate before this step's gradient; the row and column EMAs then
  advance as usual), bias-corrected for ``t`` updates. The current gradient enters every element's
  step exactly, as in AdamW, so an element whose gradient jumps is damped at once rather than
  through its row and column means. Same state; equal to the factored estimate where that is exact
  (a constant rank-1 ``g^2``).
* ``codebook_refresh=N``: every N steps, re-learn the codebook from the histogram of the current
  (pre-rounding) normalised first moments and re-encode every index into the new codebook (the
  end codewords stay at -1/+1, so the absmax scales are unchanged).

The update is evaluated eagerly here (small models only: no chunking).
"""
from __future__ import annotations

import math
from typing import Optional

import torch

from gefen_dist import Gefen
from gefen_dist.core import periods as _periods
from gefen_dist.core.quant import NUM_BINS, nearest_codeword
from gefen_dist.kernels.dispatch import block_histogram
from gefen_dist.engine.layout import local_tensor

__all__ = ["GefenVariant"]


def stochastic_codeword(z: torch.Tensor, codebook: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """Index (uint8) of ``lo`` or ``hi`` (the codewords around z), ``hi`` with probability
    ``(z - C_lo) / (C_hi - C_lo)``: unbiased, ``E[C[idx]] == z`` inside [-1, 1]."""
    z = z.contiguous()
    j = torch.searchsorted(codebook, z, right=False)
    lo = (j - 1).clamp_(min=0)
    hi = j.clamp_(max=codebook.numel() - 1)
    c_lo, c_hi = codebook[lo], codebook[hi]
    gap = c_hi - c_lo
    frac = torch.where(gap > 0, (z - c_lo) / torch.where(gap > 0, gap, torch.ones_like(gap)),
                       torch.zeros_like(z)).clamp_(0.0, 1.0)
    u = torch.rand(z.shape, generator=gen, dtype=torch.float32)
    out = torch.where(u < frac, hi, lo)
    out = torch.where(torch.isnan(z), torch.full_like(out, codebook.numel() - 1), out)
    return out.to(torch.uint8)


Q4_ZERO = 8  # the code for "v equals the factored estimate"


def pack4(codes: torch.Tensor) -> torch.Tensor:
    """Two 4-bit codes (uint8 values 0..15) per byte, the even element in the low nibble."""
    c = codes.reshape(-1).to(torch.uint8)
    if c.numel() % 2:
        c = torch.cat([c, c.new_zeros(1)])
    c = c.view(-1, 2)
    return c[:, 0] | (c[:, 1] << 4)


def unpack4(packed: torch.Tensor, n: int) -> torch.Tensor:
    """The inverse of :func:`pack4`: ``n`` codes (uint8) from ``ceil(n / 2)`` bytes."""
    return torch.stack([packed & 15, packed >> 4], dim=1).view(-1)[:n]


def q4_levels(codes: torch.Tensor, zero: int = Q4_ZERO, step: float = 0.5) -> torch.Tensor:
    """The ratio ``2^((c - zero) * step)`` each 4-bit v code stands for (float32)."""
    return torch.exp2((codes.float() - zero) * step)


def q4_encode(ratio: torch.Tensor, gen: Optional[torch.Generator], zero: int = Q4_ZERO,
              step: float = 0.5, levels: int = 16) -> torch.Tensor:
    """Codes (uint8, 0..levels-1) for ``ratio = v / fact`` (>= 0). With a generator: stochastic
    rounding between the two neighbouring levels, unbiased in ``v`` inside the range; without one:
    the nearest level in log scale. Clipped to the end levels outside the range."""
    r = ratio.float()
    top = levels - 1
    x = torch.log2(r.clamp(min=2.0 ** -60)) / step + zero
    if gen is None:
        return torch.round(x).clamp_(0, top).to(torch.uint8)
    lo = torch.floor(x).clamp_(0, top)
    hi = (lo + 1).clamp_(max=top)
    v_lo, v_hi = q4_levels(lo, zero, step), q4_levels(hi, zero, step)
    gap = v_hi - v_lo
    p = torch.where(gap > 0, (r - v_lo) / torch.where(gap > 0, gap, torch.ones_like(gap)),
                    torch.zeros_like(r)).clamp_(0.0, 1.0)
    u = torch.rand(r.shape, generator=gen, dtype=torch.float32)
    return torch.where(u < p, hi, lo).to(torch.uint8)


def _block_ema(cb: torch.Tensor, ix: torch.Tensor, sc: torch.Tensor, g_blocks: torch.Tensor, b1: float):
    """Dequantise ``cb[ix] * sc`` ([blocks, B]), take the EMA towards ``g``, store the new absmax in
    ``sc`` ([blocks, 1]); returns (m, absmax, m normalised by its block's absmax)."""
    m = cb[ix.long()] * sc
    m.lerp_(g_blocks, 1.0 - b1)
    a = m.abs().amax(dim=1, keepdim=True)
    sc.copy_(a)
    z = torch.where(a > 0, m / torch.where(a > 0, a, torch.ones_like(a)), torch.zeros_like(m))
    return m, a, z


def ema_kappa(b1: float, b2: float, t: int) -> float:
    """The largest ``kappa`` with ``v_t >= kappa * m_t^2`` for every gradient sequence, where m and
    v are zero-initialised EMAs (``m_t = b1 m + (1-b1) g``, ``v_t = b2 v + (1-b2) g^2``): by
    Cauchy-Schwarz, ``m_t^2 <= (1-b1)^2 / (1-b2) * sum_{k<t} (b1^2/b2)^k * v_t`` (equality at t = 1)."""
    r = b1 * b1 / b2
    horizon = (1.0 - r ** t) / (1.0 - r) if r != 1.0 else float(t)
    return (1.0 - b2) / ((1.0 - b1) ** 2 * horizon)


def _placeholder_idx(local: torch.Tensor) -> torch.Tensor:
    """The ``idx`` of a variant whose first moment lives elsewhere (``m32``, ``code``): a uint8
    tensor of the parameter's shape, because the library's step checks a quantized tensor's shape
    on its ``idx`` (a changed parameter shape is refused). Never read; not counted in
    :meth:`GefenVariant.state_bytes`."""
    return torch.zeros(tuple(local.shape), dtype=torch.uint8, device=local.device)


def _uses_idx(st) -> bool:
    return "idx" in st and "m32" not in st and "code" not in st


class GefenVariant(Gefen):
    def __init__(self, params, *args, first_moment: str = "quant", second_moment_mode: Optional[str] = None,
                 period_rule: str = "paper", rounding: str = "nearest", codebook_refresh: int = 0,
                 seed: int = 0, v_override: Optional[dict] = None, v_groups=4,
                 codebook_scope: str = "global", m_override: Optional[dict] = None,
                 q4_zero: int = Q4_ZERO, q4_step: float = 0.5, q4_rounding: str = "stochastic",
                 m_bits: int = 4, v_bits: int = 4, lowbit_override: Optional[dict] = None,
                 q4_floor: bool = False, v_lag: bool = False, v_innov: bool = False, v_clamp: bool = False,
                 **kw):
        assert first_moment in ("quant", "fp32", "quant4")
        assert period_rule in ("paper", "row", "one")
        assert rounding in ("nearest", "stochastic")
        assert codebook_scope in ("global", "tensor")
        self.first_moment = first_moment
        self.codebook_scope = codebook_scope
        self.v_mode = second_moment_mode or kw.get("second_moment", "shared")
        assert self.v_mode in ("shared", "factored", "exact", "grouped", "factored_clamp", "sm3", "factored_q4",
                               "meanvar", "meanvar_min", "rowblock", "rowblock_meanvar_min", "li4")
        if self.v_mode in ("shared", "factored"):
            kw["second_moment"] = self.v_mode  # explicit: the library default is "factored"
        if self.v_mode in ("grouped", "factored_clamp", "sm3", "factored_q4", "meanvar", "meanvar_min", "rowblock",
                           "rowblock_meanvar_min", "li4"):
            kw["second_moment"] = "factored"  # v_row / v_col come from the parent's factored layout
        # K, or {id(param): K} (parameters not in it: 4)
        self.v_groups = {k: int(v) for k, v in v_groups.items()} if isinstance(v_groups, dict) else int(v_groups)
        # "exact": the library default's layout (periods, scale blocks), with this class's own
        # per-element v
        self.period_rule = period_rule
        self.rounding = rounding
        self.codebook_refresh = int(codebook_refresh)
        self.v_override = dict(v_override or {})
        assert set(self.v_override.values()) <= {"exact", "row", "sm3", "grouped", "factored_q4", "rowblock",
                                                 "meanvar_min", "rowblock_meanvar_min"}
        self.m_override = dict(m_override or {})
        assert set(self.m_override.values()) <= {"quant4"}
        self.codebooks_lowbit: dict = {}  # m_bits -> codebook
        assert 0 <= q4_zero <= 15 and q4_step > 0 and q4_rounding in ("stochastic", "nearest")
        self.q4_zero, self.q4_step, self.q4_rounding = int(q4_zero), float(q4_step), q4_rounding
        assert 2 <= m_bits <= 7 and 1 <= v_bits <= 4 and q4_zero < 2 ** v_bits
        self.m_bits, self.v_bits = int(m_bits), int(v_bits)
        self.q4_floor = bool(q4_floor)
        # "factored" / "rowblock": step with the second-moment EMAs as they were *before* this step's
        # gradient (from the second step on, bias-corrected for t - 1 updates): a delayed v, as
        # AdaShift (Zhou et al. 2019) decorrelates v from g
        self.v_lag = bool(v_lag)
        # "factored" / "rowblock": the per-element EMA's recursion with only its history factored:
        # v_hat_t = b2 fact_{t-1} + (1 - b2) g_t^2 (fact_{t-1}: the factored estimate before this
        # step's gradient; its row and column EMAs then advance as usual). The current gradient
        # enters every element's step size exactly, as in AdamW; no extra state
        self.v_innov = bool(v_innov)
        assert not (self.v_lag and self.v_innov), "v_lag and v_innov are exclusive"
        # "grouped" / "rowblock": factored_clamp's per-element floors ((1 - b2) g^2 and kappa m^2) on
        # the grouped estimate; no extra state
        self.v_clamp = bool(v_clamp)
        assert not (self.v_clamp and (self.v_lag or self.v_innov)), "v_clamp excludes v_lag and v_innov"
        self.lowbit_override = {k: dict(v) for k, v in (lowbit_override or {}).items()}
        for cfg in self.lowbit_override.values():
            assert set(cfg) <= {"m_bits", "v_bits", "q4_zero", "q4_step", "q4_floor"}, cfg
        self.seed = int(seed)
        self._refresh_counts: Optional[torch.Tensor] = None
        self.refreshes = 0
        kw.setdefault("fused", False)
        # the variants replace the update with their own (unclamped) math: compare against the
        # parent without the D13 clamp
        kw.setdefault("bound_updates", False)
        kw.setdefault("row_blocks", 1)  # the parent's factored layout with one column profile (as before D12)
        super().__init__(params, *args, **kw)
        self._pindex = {}

    # ---------------------------------------------------------------- periods
    def _learn_periods(self, live):
        if self.v_override:
            base = (super()._learn_periods(live) if self.period_rule == "paper" else
                    [_periods.row_slab(pc.shape) if self.period_rule == "row" else 1 for _, pc in live])
            return [_periods.row_slab(pc.shape) if self.v_override.get(id(p)) == "row" else q
                    for (p, pc), q in zip(live, base)]
        if self.period_rule == "paper":
            return super()._learn_periods(live)
        if self.period_rule == "row":
            return [_periods.row_slab(pc.shape) for _, pc in live]
        return [1 for _ in live]

    # ---------------------------------------------------------------- codebook
    def _learn_codebook(self, live, t_periods):
        super()._learn_codebook(live, t_periods)
        if self.first_moment == "quant4" or self.m_override:
            self._learn_codebook_lowbit(live)
        if self.codebook_scope != "tensor":
            return
        from gefen_dist.core.codebook import solve_codebook

        for p, pc in live:
            st = self.state[p]
            counts = torch.zeros(NUM_BINS, dtype=torch.int64)
            if pc.contributes and pc.grad is not None and pc.grad.numel():
                block_histogram(pc.grad, st["scale_block"], out=counts)
            self._comm.all_reduce_sum_(counts)
            if int(counts.sum()) == 0:
                continue
            dev = local_tensor(st["idx"]).device
            st["codebook"] = solve_codebook(counts.numpy()).codebook.to(device=dev, dtype=torch.float32)

    def _learn_codebook_lowbit(self, live):
        """The 2^m_bits-entry codebook of the low-bit first moment: the same exact DP (ends forced
        to -1/+1) on the same global histogram the 256-entry codebook is learned from."""
        import numpy as np

        from gefen_dist.core.codebook import bin_centres, dp_segments

        cnt = self._global_histogram(live).numpy()
        nz = np.flatnonzero(cnt)
        self.codebooks_lowbit = {}
        for p, _ in live:
            st = self.state[p]
            if "code" not in st:
                continue
            mb = st["m_bits"]
            if mb not in self.codebooks_lowbit:
                k = 2 ** mb
                if nz.size >= k:
                    cb, _, _, _ = dp_segments(bin_centres()[nz], cnt[nz].astype(np.float64), k)
                else:  # degenerate first gradient: a uniform grid
                    cb = np.linspace(-1.0, 1.0, k, dtype=np.float32)
                self.codebooks_lowbit[mb] = torch.from_numpy(np.asarray(cb, dtype=np.float32).copy())
            st["codebook_m"] = self.codebooks_lowbit[mb]

    # ---------------------------------------------------------------- state
    def _alloc(self, p, piece, period=None, *, learned, step=0):
        super()._alloc(p, piece, period, learned=learned, step=step)
        st = self.state[p]
        if "idx" not in st:
            return
        dev = piece.local.device
        if self.first_moment == "fp32":
            st["m32"] = torch.zeros(tuple(piece.local.shape), dtype=torch.float32, device=dev)
            st["idx"] = _placeholder_idx(piece.local)  # unused: not counted (state_bytes)
            st["scale"] = torch.zeros(0, dtype=torch.float32, device=dev)
        mode = self.v_override.get(id(p), self.v_mode)
        n = piece.local.numel()
        cfg = dict(m_bits=self.m_bits, v_bits=self.v_bits, q4_zero=self.q4_zero, q4_step=self.q4_step,
                   q4_floor=self.q4_floor)
        cfg.update(self.lowbit_override.get(id(p), {}))
        st.update(cfg)
        mb, vb, z0 = cfg["m_bits"], cfg["v_bits"], cfg["q4_zero"]
        assert 2 <= mb <= 7 and 1 <= vb <= 4 and 0 <= z0 < 2 ** vb, cfg
        if self.m_override.get(id(p), self.first_moment) == "quant4":
            # one byte per element: the low-bit m index in the low m_bits, the v code above it
            st["idx"] = _placeholder_idx(piece.local)  # replaced by `code`: not counted (state_bytes)
            st["code"] = torch.zeros(n, dtype=torch.uint8, device=dev)
            if mode == "factored_q4":
                assert mb + vb <= 8, cfg
                st["code"].fill_(z0 << mb)
        if mode == "factored_q4":
            assert "v_col" in st, "factored_q4 needs the factored layout"
            if "code" not in st:  # 8-bit m: the v codes packed two per byte
                assert vb == 4, "with the 8-bit first moment the v correction is 4 bits"
                st["vq"] = pack4(torch.full((n,), z0, dtype=torch.uint8, device=dev))
        if mode == "li4":  # the codes; v_row / v_col hold the row and column maxima of v
            assert "v_col" in st and st["v_col"].dim() == 1, "li4 needs the factored layout with one column profile"
            st["vq"] = pack4(torch.zeros(n, dtype=torch.uint8, device=dev))
        if mode == "exact":
            st["v"] = torch.zeros(tuple(piece.local.shape), dtype=torch.float32, device=dev)
        elif mode == "row":
            st.pop("v_row", None), st.pop("v_col", None)
            st["v"] = torch.zeros(piece.local_rows, dtype=torch.float32, device=dev)
        elif mode == "meanvar_min":  # the innovations' factored EMAs, next to the parent's of g^2
            assert "v_col" in st, "meanvar_min needs the factored layout"
            st["e_row"] = torch.zeros_like(local_tensor(st["v_row"]).view(-1))
            st["e_col"] = torch.zeros_like(st["v_col"])
        if mode in ("grouped", "rowblock", "rowblock_meanvar_min"):
            assert "v_col" in st, f"{mode} needs the factored layout"
            K = self.v_groups.get(id(p), 4) if isinstance(self.v_groups, dict) else self.v_groups
            st["v_colg"] = torch.zeros(K, st["v_col"].numel(), dtype=torch.float32, device=dev)
        if mode == "rowblock_meanvar_min":  # and the innovations' row EMA and per-block column profiles
            st["e_row"] = torch.zeros_like(local_tensor(st["v_row"]).view(-1))
            st["e_colg"] = torch.zeros_like(st["v_colg"])

    # ---------------------------------------------------------------- step
    @torch.no_grad()
    def state_bytes(self) -> int:
        """The library's count less the unread ``idx`` placeholders (:func:`_placeholder_idx`)."""
        unused = sum(local_tensor(st["idx"]).numel() for st in self.state.values()
                     if "idx" in st and not _uses_idx(st))
        return super().state_bytes() - unused

    def step(self, closure=None):
        loss = super().step(closure)
        if self._refresh_counts is not None:
            self._refresh_codebook()
        return loss

    def _refresh_codebook(self) -> None:
        from gefen_dist.core.codebook import solve_codebook

        counts = self._refresh_counts
        self._refresh_counts = None
        self._comm.all_reduce_sum_(counts)
        old = self.codebook
        new = solve_codebook(counts.numpy()).codebook.to(device=old.device, dtype=torch.float32)
        for st in self.state.values():
            if _uses_idx(st):
                ix = local_tensor(st["idx"])
                ix.copy_(nearest_codeword(old[ix.long()], new).view_as(ix))
        self.codebook = new
        for st in self.state.values():
            if "codebook" in st:
                st["codebook"] = new
        self.refreshes += 1

    @staticmethod
    def _factored_ema(st, g, col_mean_sq, b2):
        """Advance the factored layout's EMAs (``v_col`` by the column means of g^2, all-reduced by
        the parent; ``v_row`` by the local row means); returns v_row, v_col and g^2 as [rows, cols]."""
        v_col, v_row = st["v_col"], local_tensor(st["v_row"]).view(-1)
        v_col.mul_(b2).add_(col_mean_sq, alpha=1.0 - b2)
        g2 = (g * g).view(-1, v_col.numel())
        v_row.mul_(b2).add_(g2.mean(dim=1), alpha=1.0 - b2)
        return v_row, v_col, g2

    @staticmethod
    def _row_blocks(R: int, K: int, device) -> torch.Tensor:
        """Each of R rows' block id when the rows split into K equal contiguous blocks."""
        assert R % K == 0, f"rowblock: {R} rows do not split into {K} equal blocks"
        return torch.arange(R, device=device) // (R // K)

    @staticmethod
    def _profile_ratio(colg: torch.Tensor, grp: torch.Tensor, fallback: torch.Tensor) -> torch.Tensor:
        """[R, C]: each row's group column profile over its own mean (``fallback``, a [C] column
        vector normalised the same way, where the group's profile is still all zero)."""
        prof = colg[grp]
        mg = prof.mean(dim=1, keepdim=True)
        mc = float(fallback.mean())
        fb = (fallback / mc) if mc > 0 else torch.zeros_like(fallback)
        return torch.where(mg > 0, prof / torch.where(mg > 0, mg, torch.ones_like(mg)), fb.unsqueeze(0))

    @staticmethod
    def _mhat_var_ratio(b1: float, t: int) -> float:
        """c_t = Var(m_hat_t) / sigma^2 for i.i.d. gradients of variance sigma^2."""
        return (1.0 - b1) / (1.0 + b1) * (1.0 + b1 ** t) / (1.0 - b1 ** t)

    def _innovation_sq(self, st, g: torch.Tensor, t: int, b1: float, B: int, cols: int) -> torch.Tensor:
        """[rows, cols]: (g_t - m_hat_{t-1})^2 / (1 + c_{t-1}), an estimate of the gradient's
        variance (t >= 2); m_hat the bias-corrected fp32 or quantized first moment before this step."""
        if self.first_moment == "fp32":
            m_prev = st["m32"].view(-1)
        else:
            m_prev = (st["codebook"][local_tensor(st["idx"]).view(-1, B).long()]
                      * local_tensor(st["scale"]).view(-1, 1)).view(-1)
        e = g - m_prev / (1.0 - b1 ** (t - 1))
        return e.square_().div_(1.0 + self._mhat_var_ratio(b1, t - 1)).view(-1, cols)

    def _update(self, group, p, col_mean_sq=None):
        st = self.state[p]
        v_mode = self.v_override.get(id(p), self.v_mode)
        default = (self.first_moment == "quant"
                   and self.v_mode not in ("exact", "grouped", "factored_clamp", "sm3", "factored_q4", "meanvar",
                                           "meanvar_min", "rowblock", "rowblock_meanvar_min", "li4")
                   and self.rounding == "nearest"
                   and not self.codebook_refresh and not self.v_lag and not self.v_innov and not self.v_clamp
                   and id(p) not in self.v_override
                   and id(p) not in self.m_override and self.codebook_scope == "global")
        if default or "exp_avg" in st or not st.get("learned", 1):
            return super()._update(group, p, col_mean_sq)
        st["step"] += 1
        t = st["step"]
        b1, b2 = group["betas"]
        lr = float(group["lr"])
        eps, wd = group["eps"], group["weight_decay"]
        bc1, bc2 = 1.0 - b1 ** t, 1.0 - b2 ** t
        param = local_tensor(p)
        g = local_tensor(p.grad).float().reshape(-1)
        n = g.numel()
        P, B = st["period"], st["scale_block"]
        # second moment -> per-element step size
        if v_mode == "exact":
            v = local_tensor(st["v"]).view(-1)
            v.mul_(b2).addcmul_(g, g, value=1.0 - b2)
            sigma = (v.sqrt() / math.sqrt(bc2)).add_(eps).reciprocal_().mul_(1.0 / bc1)
        elif v_mode in ("shared", "row"):
            v = local_tensor(st["v"]).view(-1)
            v.mul_(b2).add_((g * g).view(-1, P).mean(dim=1), alpha=1.0 - b2)
            sb = (v.sqrt() / math.sqrt(bc2)).add_(eps).reciprocal_().mul_(1.0 / bc1)
            sigma = sb.repeat_interleave(P)
        elif v_mode in ("grouped", "rowblock"):
            lag = (self.v_lag or self.v_innov) and t > 1
            if lag:
                old = (local_tensor(st["v_row"]).view(-1).clone(), st["v_col"].clone(), st["v_colg"].clone())
            v_row, v_col, g2 = self._factored_ema(st, g, col_mean_sq, b2)
            g2_now = g2
            K, R = st["v_colg"].shape[0], v_row.numel()
            if v_mode == "rowblock":  # K contiguous row blocks (e.g. c_attn's q / k / v, or its heads)
                grp = self._row_blocks(R, K, g.device)
            else:
                grp = torch.empty(R, dtype=torch.long, device=g.device)
                grp[v_row.argsort()] = torch.arange(R, device=g.device) * K // R  # K equal quantile groups
            colg = st["v_colg"]
            colg.mul_(b2).index_add_(0, grp, g2, alpha=1.0 - b2)
            bc2v = bc2
            if lag:
                v_row, v_col, colg, bc2v = old[0], old[1], old[2], 1.0 - b2 ** (t - 1)
            ratio = self._profile_ratio(colg, grp, v_col)  # [R, slab]: each row's group column profile
            if self.v_clamp:  # factored_clamp's two per-element floors, on the row blocks' estimate
                vhat = torch.maximum((v_row.unsqueeze(1) * ratio).view(-1), g2.view(-1) * (1.0 - b2))
                sigma = None  # the kappa m^2 floor needs this step's first moment: formed below
            else:
                if self.v_innov:  # b2 fact_{t-1} + (1 - b2) g_t^2 (at t = 1: (1 - b2) g^2), bias-corrected for t
                    vh = ((v_row.unsqueeze(1) * ratio).mul_(b2).add_(g2_now, alpha=1.0 - b2) if lag
                          else g2_now * (1.0 - b2))
                    denom = vh.div_(bc2).sqrt_().add_(eps)
                else:
                    denom = (v_row.sqrt().unsqueeze(1) * ratio.sqrt_()).div_(math.sqrt(bc2v)).add_(eps)
                sigma = denom.reciprocal_().mul_(1.0 / bc1).view(-1)
        elif v_mode == "li4":  # Li et al. 2023: rank-1 normalised, zero-excluding linear 4-bit codes
            v_row, v_col = local_tensor(st["v_row"]).view(-1), st["v_col"].view(-1)
            R, C = v_row.numel(), v_col.numel()
            norm = torch.minimum(v_row.unsqueeze(1), v_col.unsqueeze(0))
            v = norm * (unpack4(st["vq"], n).view(R, C).float() + 1.0) / 16.0
            g2 = (g * g).view(R, C)
            v.mul_(b2).add_(g2, alpha=1.0 - b2)
            v_row.copy_(v.amax(dim=1))
            v_col.copy_(v.amax(dim=0))
            norm = torch.minimum(v_row.unsqueeze(1), v_col.unsqueeze(0))
            x = torch.where(norm > 0, v / torch.where(norm > 0, norm, torch.ones_like(norm)), torch.zeros_like(v))
            st["vq"].copy_(pack4(torch.round(x * 16.0 - 1.0).clamp_(0, 15).to(torch.uint8).view(-1)))
            sigma = (v.sqrt() / math.sqrt(bc2)).add_(eps).reciprocal_().mul_(1.0 / bc1).view(-1)
        elif v_mode == "sm3":
            v_col, v_row = st["v_col"], local_tensor(st["v_row"]).view(-1)
            g2 = (g * g).view(-1, v_col.numel())
            nu = torch.minimum(v_row.unsqueeze(1), v_col.unsqueeze(0)).mul_(b2).add_(g2, alpha=1.0 - b2)
            v_row.copy_(nu.amax(dim=1))
            v_col.copy_(nu.amax(dim=0))
            sigma = (nu.sqrt_().div_(math.sqrt(bc2))).add_(eps).reciprocal_().mul_(1.0 / bc1).view(-1)
        elif v_mode == "factored_q4":
            v_col, v_row = st["v_col"], local_tensor(st["v_row"]).view(-1)
            mb, vb, z0, dz = st["m_bits"], st["v_bits"], st["q4_zero"], st["q4_step"]
            codes = (unpack4(st["vq"], n) if "vq" in st else st["code"] >> mb).view(v_row.numel(), v_col.numel())
            mc0 = float(v_col.mean())
            fact0 = (v_row.unsqueeze(1) * v_col.unsqueeze(0) / mc0) if mc0 > 0 else torch.zeros_like(codes, dtype=torch.float32)
            v_prev = fact0 * q4_levels(codes, z0, dz)
            v_row, v_col, g2 = self._factored_ema(st, g, col_mean_sq, b2)
            mc = float(v_col.mean())
            fact = (v_row.unsqueeze(1) * v_col.unsqueeze(0) / mc) if mc > 0 else torch.zeros_like(g2)
            v_new = v_prev.mul_(b2).add_(g2, alpha=1.0 - b2)
            if st["q4_floor"]:  # never below the factored estimate: only the too-far steps change
                v_new = torch.maximum(v_new, fact)
            sigma = (v_new.sqrt() / math.sqrt(bc2)).add_(eps).reciprocal_().mul_(1.0 / bc1).view(-1)
            gen = None
            if self.q4_rounding == "stochastic":
                pid = self._pindex.setdefault(id(p), len(self._pindex))
                gen = torch.Generator().manual_seed((self.seed * 1_000_003 + pid * 7919 + int(t) * 31 + 17) % (2**63))
            ratio = torch.where(fact > 0, v_new / torch.where(fact > 0, fact, torch.ones_like(fact)),
                                torch.full_like(fact, 1.0))
            vc = q4_encode(ratio, gen, z0, dz, 2 ** vb).view(-1)
            if "vq" in st:
                st["vq"].copy_(pack4(vc))
            else:
                st["code"].copy_((st["code"] & (2 ** mb - 1)) | (vc << mb))
        elif v_mode == "meanvar":  # the factored estimate of the innovations' variance; m^2 added below
            assert self.first_moment in ("quant", "fp32"), "meanvar: the 8-bit or the fp32 first moment"
            v_col, v_row = st["v_col"], local_tensor(st["v_row"]).view(-1)
            c_t = self._mhat_var_ratio(b1, t)
            if t > 1:  # innovation g_t - m_hat_{t-1}: variance sigma^2 (1 + c_{t-1}), scaled to sigma^2
                e2 = self._innovation_sq(st, g, t, b1, B, v_col.numel())
                v_col.mul_(b2).add_(e2.mean(dim=0), alpha=1.0 - b2)
                v_row.mul_(b2).add_(e2.mean(dim=1), alpha=1.0 - b2)
            mc = float(v_col.mean())
            col_f = v_col / mc if mc > 0 else torch.zeros_like(v_col)
            # bias-corrected from t = 2 (the first innovation); E[m_hat_t^2] = mu^2 + c_t sigma^2
            var_hat = (v_row.unsqueeze(1) * col_f.unsqueeze(0)).view(-1).mul_(
                max(0.0, 1.0 - c_t) / (1.0 - b2 ** (t - 1)) if t > 1 else 0.0)
            sigma = None
        elif v_mode in ("meanvar_min", "rowblock_meanvar_min"):  # min(factored, m_hat^2 + factored variance)
            assert self.first_moment == "quant", "meanvar_min: the 8-bit first moment"
            v_row, v_col, g2 = self._factored_ema(st, g, col_mean_sq, b2)
            e_row = st["e_row"]
            c_t = self._mhat_var_ratio(b1, t)
            e2 = None
            if t > 1:  # the innovation g_t - m_hat_{t-1}, scaled to the gradient's variance
                e2 = self._innovation_sq(st, g, t, b1, B, v_col.numel())
                e_row.mul_(b2).add_(e2.mean(dim=1), alpha=1.0 - b2)
            if v_mode == "meanvar_min":  # one column profile for g^2 and one for the innovations
                e_col = st["e_col"]
                if e2 is not None:
                    e_col.mul_(b2).add_(e2.mean(dim=0), alpha=1.0 - b2)
                mc, mce = float(v_col.mean()), float(e_col.mean())
                col_f = v_col / mc if mc > 0 else torch.zeros_like(v_col)
                ecol_f = (e_col / mce).unsqueeze(0) if mce > 0 else None
            else:  # one column profile per block of rows, for both (as the default's row blocks, D12)
                colg, e_colg = st["v_colg"], st["e_colg"]
                grp = self._row_blocks(v_row.numel(), colg.shape[0], g.device)
                colg.mul_(b2).index_add_(0, grp, g2, alpha=1.0 - b2)
                if e2 is not None:
                    e_colg.mul_(b2).index_add_(0, grp, e2, alpha=1.0 - b2)
                col_f = self._profile_ratio(colg, grp, v_col)
                ecol_f = self._profile_ratio(e_colg, grp, e_colg.sum(dim=0)) if float(e_colg.sum()) > 0 else None
            fact_hat = (v_row.unsqueeze(1) * col_f).view(-1).div_(bc2)
            var_hat = (e_row.unsqueeze(1) * ecol_f).view(-1).mul_(
                max(0.0, 1.0 - c_t) / (1.0 - b2 ** (t - 1))) if (t > 1 and ecol_f is not None) else torch.zeros_like(g)
            floor_hat = g2.reshape(-1) * ((1.0 - b2) / bc2)  # every per-element EMA v obeys v_t >= (1-b2) g_t^2
            sigma = None
        elif v_mode == "factored_clamp":  # sigma is formed after the first moment, below
            v_row, v_col, g2 = self._factored_ema(st, g, col_mean_sq, b2)
            mc = float(v_col.mean())
            col_f = (v_col / mc).sqrt() if mc > 0 else torch.zeros_like(v_col)
            vhat = (v_row.sqrt().unsqueeze(1) * col_f.unsqueeze(0)).square_().view(-1)
            vhat = torch.maximum(vhat, g2.view(-1) * (1.0 - b2))
            sigma = None
        else:  # factored (Adafactor estimator, as gefen_dist.core.step)
            lag = (self.v_lag or self.v_innov) and t > 1
            if lag:
                old = (local_tensor(st["v_row"]).view(-1).clone(), st["v_col"].clone())
            v_row, v_col, g2_now = self._factored_ema(st, g, col_mean_sq, b2)
            bc2v = bc2
            if lag:
                v_row, v_col, bc2v = old[0], old[1], 1.0 - b2 ** (t - 1)
            mc = float(v_col.mean())
            col_f = (v_col / mc).sqrt() if mc > 0 else torch.zeros_like(v_col)
            if self.v_innov:  # as in the rowblock branch
                vh = ((v_row.sqrt().unsqueeze(1) * col_f.unsqueeze(0)).square_().mul_(b2)
                      .add_(g2_now, alpha=1.0 - b2) if lag else g2_now * (1.0 - b2))
                denom = vh.div_(bc2).sqrt_().add_(eps)
            else:
                denom = (v_row.sqrt().unsqueeze(1) * col_f.unsqueeze(0)).div_(math.sqrt(bc2v)).add_(eps)
            sigma = denom.reciprocal_().mul_(1.0 / bc1).view(-1)
        # first moment
        if self.first_moment == "fp32":
            m = st["m32"].view(-1)
            m.lerp_(g, 1.0 - b1)
            q = m
        elif "code" in st:
            cb = st["codebook_m"]
            mask = 2 ** st["m_bits"] - 1
            ix4 = (st["code"] & mask).view(-1, B)
            _, a, z = _block_ema(cb, ix4, local_tensor(st["scale"]).view(-1, 1), g.view(-1, B), b1)
            new = nearest_codeword(z, cb)
            st["code"].copy_((st["code"] & (255 - mask)) | new.view(-1))
            q = (cb[new.long()] * a).view(-1)
        else:
            cb = st["codebook"]
            ix = local_tensor(st["idx"]).view(-1, B)
            m, a, z = _block_ema(cb, ix, local_tensor(st["scale"]).view(-1, 1), g.view(-1, B), b1)
            if self.codebook_refresh and t % self.codebook_refresh == 0:
                if self._refresh_counts is None:
                    self._refresh_counts = torch.zeros(NUM_BINS, dtype=torch.int64)
                block_histogram(m, B, out=self._refresh_counts)
            if self.rounding == "stochastic":
                pid = self._pindex.setdefault(id(p), len(self._pindex))
                gen = torch.Generator().manual_seed((self.seed * 1_000_003 + pid * 7919 + int(t)) % (2**63))
                new = stochastic_codeword(z, cb, gen)
            else:
                new = nearest_codeword(z, cb)
            ix.copy_(new)
            q = (cb[new.long()] * a).view(-1)
        if sigma is None and v_mode in ("meanvar_min", "rowblock_meanvar_min"):  # never shorter than factored
            vhat = torch.minimum(fact_hat, (q.view(-1) / bc1).square().add_(var_hat))
            vhat = torch.maximum(vhat, floor_hat)
            sigma = vhat.sqrt_().add_(eps).reciprocal_().mul_(1.0 / bc1)
        if sigma is None and v_mode == "meanvar":  # v_hat = m_hat^2 + (1 - c_t) var_hat
            vhat = (q.view(-1) / bc1).square().add_(var_hat)
            sigma = vhat.sqrt_().add_(eps).reciprocal_().mul_(1.0 / bc1)
        if sigma is None:  # factored_clamp: v >= kappa m^2 (Cauchy-Schwarz on the two EMAs)
            kappa = ema_kappa(b1, b2, t)
            vhat = torch.maximum(vhat, q.view(-1).square() * kappa)
            sigma = (vhat.sqrt() / math.sqrt(bc2)).add_(eps).reciprocal_().mul_(1.0 / bc1)
        pf = param.view(-1)
        if wd != 0.0:
            pf.mul_(1.0 - lr * wd)
        pf.sub_(q * sigma * lr)
        assert pf.numel() == n


class LagColGefen(Gefen):
    """The library's Gefen (every option as passed), but the factored second moment's column EMA
    advances with the *previous* step's column means of g^2 (the first step uses its own): what
    fusing the column statistics into the kernel's single read of g would compute, since the
    column means of step t would then only be complete after step t's update. Benchmark code: it
    measures what the one-step lag costs in loss before any backend is changed."""

    def _update(self, group, p, col_mean_sq=None):
        if col_mean_sq is not None:
            st = self.state[p]
            prev = st.get("lag_col_mean_sq")
            st["lag_col_mean_sq"] = col_mean_sq.detach().clone()
            if prev is not None:
                col_mean_sq = prev
        return super()._update(group, p, col_mean_sq)


class ColBlockGefen(Gefen):
    """The library's Gefen (every option as passed), but each 2-D factored tensor of ``R`` rows of
    ``k x R`` elements (``2 <= k <= 8``: Hugging Face GPT-2's ``Conv1D`` ``c_attn`` ``(d, 3d)`` and ``c_fc``
    ``(d, 4d)``) keeps D12's estimator transposed: one row EMA per block of ``R`` columns,
    ``v_ij = v_row[i, b(j)] * v_col_j / mean_{j' in b(j)} v_col_j'`` with ``b(j) = j // R`` (the column
    EMA stays one profile, normalised per column block; the same bytes as D12's row blocks). Those
    tensors are stepped eagerly here with the library's first-moment and update functions
    (``core.step.requantize_``, ``apply_`` with the D13 bound), every other tensor by the library's
    per-tensor path (the multi-tensor batch is off: it would step them all natively). Research
    only: it measures whether column blocks recover, in the ``Conv1D`` layout, what D12's row blocks
    gain in the ``nn.Linear`` one, before any kernel is changed."""

    scale_in_blocks = False  # ColBlockScaleGefen: absmax-scale blocks that never straddle two column blocks

    @staticmethod
    def column_blocks(shape) -> int:
        if len(shape) != 2:
            return 0
        R, S = shape
        k = S // R if R > 0 and S % R == 0 else 0
        return k if 2 <= k <= 8 else 0

    def _batched_step(self, entries) -> bool:
        return False

    @torch.no_grad()
    def step(self, closure=None):
        """The library's step; a column-blocked tensor's first (learning) step, which advances the library's
        ``v_row`` and ``v_col`` EMAs by that gradient, starts its per-block row EMAs from the same gradient."""
        from gefen_dist.core.step import ema_

        first = []
        for group in self.param_groups:
            for p in group["params"]:
                K = self.column_blocks(tuple(p.shape))
                if K and p.grad is not None and not (self.state.get(p) or {}).get("learned"):
                    g = local_tensor(p.grad).float().reshape(p.shape[0], K, -1)
                    first.append((p, group["betas"][1], (g * g).mean(dim=-1)))
        loss = super().step(closure)
        for p, b2, means in first:
            st = self.state.get(p) or {}
            if st.get("learned") and "v_col" in st and st["v_col"].dim() == 1 and "v_rowk" not in st:
                st["v_rowk"] = ema_(torch.zeros_like(means), means, b2)
        return loss

    def _update(self, group, p, col_mean_sq=None):
        from gefen_dist.core.step import apply_, ema_, hyperparameters, inv_rms_, requantize_
        from gefen_dist.engine.state import MODE_FACTORED, step_of

        st = self.state[p]
        K = self.column_blocks(tuple(p.shape))
        if (not K or self._mode(p) != MODE_FACTORED or not st.get("learned") or col_mean_sq is None
                or st["v_col"].dim() != 1 or self._comm.world_size > 1):
            return super()._update(group, p, col_mean_sq)
        st["step"] += 1
        hp = hyperparameters(group, step_of(st), self.bound_updates)
        param, grad = local_tensor(p), local_tensor(p.grad)
        R, S = param.shape
        C = S // K
        if self.scale_in_blocks and C % st["scale_block"]:
            self._rescale_blocks(st, _periods.shape_period((R, C)))
        B = st["scale_block"]
        v_col = st["v_col"]
        ema_(v_col, col_mean_sq.view_as(v_col), hp["beta2"])
        if "v_rowk" not in st:
            st["v_rowk"] = torch.zeros(R, K, dtype=torch.float32, device=param.device)
        g = grad.float().reshape(R, S)
        ema_(st["v_rowk"], (g * g).view(R, K, C).mean(dim=-1), hp["beta2"])
        vc = v_col.view(K, C)
        mean = vc.mean(dim=-1, keepdim=True)
        col_f = torch.where(mean > 0, vc / mean, torch.zeros_like(vc)).sqrt_().view(1, S)
        rms = st["v_rowk"].sqrt().repeat_interleave(C, dim=1) * col_f
        sigma = inv_rms_(rms, hp["eps"], hp["bc1"], math.sqrt(hp["bc2"]))
        cb = st["codebook"]
        new, a = requantize_(local_tensor(st["idx"]).view(-1, B), local_tensor(st["scale"]).view(-1, 1),
                             g.reshape(-1, B), cb, hp["beta1"])
        apply_(param.view(R, S), (cb[new.long()] * a).view(R, S), sigma, hp["lr"], hp["weight_decay"], hp["bound"])

    @staticmethod
    def _rescale_blocks(st, B: int) -> None:
        """Re-encode the first moment on absmax-scale blocks of ``B`` elements (once, before the tensor's second
        update): the stored ``C[idx] * M`` dequantised on the old blocks, quantised on the new ones."""
        from gefen_dist.core.step import quantize

        cb, B0 = st["codebook"], st["scale_block"]
        idx, sc = local_tensor(st["idx"]), local_tensor(st["scale"])
        m = (cb[idx.view(-1, B0).long()] * sc.view(-1, 1)).view(-1, B)
        a = m.abs().amax(dim=1, keepdim=True)
        idx.view(-1, B).copy_(quantize(m, a, cb))
        st["scale"] = a.view(-1).clone()
        st["scale_block"] = B


class ColBlockScaleGefen(ColBlockGefen):
    """:class:`ColBlockGefen` with the column-blocked tensors' absmax-scale blocks inside their column blocks (the
    factored mode's period rule applied to a block of ``R`` columns instead of the row: ``R`` itself up to 1024
    elements), so that one row EMA serves each scale block whole: the layout a kernel would step."""

    scale_in_blocks = True
