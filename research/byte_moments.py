"""A prototype, in plain torch, of one byte per element for both moments: the layout that
research/quality-log.md ("One byte per element for both moments") emulated on the library's
elementwise path, written out as the optimizer it would be, so that what the emulation glossed over
is in it: a 16-entry first-moment codebook fitted by the DP itself (not 16 of the 256), stochastic
rounding from float32 with counter-based random numbers keyed by the element's index, ``v``'s codes
against the factored estimate's float32 row and column EMAs (or per-256 maxima), and the state really
held in one ``uint8`` per element. It is research: nothing in ``gefen_dist`` imports it; the library's
build would put the same math in core/ and the kernels.

Per tensor of >= ``small_threshold`` elements and >= 2 dimensions, viewed as ``[rows, cols]``
(``rows = shape[0]``):

* ``code`` uint8 ``[rows, cols]``: high nibble the first moment's codeword index, low nibble ``v``'s
  code;
* ``scale`` float32 ``[rows, ceil(cols / 256)]``: the first moment's absmax per block of 256 along the
  row (blocks never cross rows, so a row-sharded layout keeps them whole);
* ``ref="fac"``: ``v_row`` ``[rows]`` and ``v_col`` ``[cols]``, EMAs of ``g^2``'s row and column means
  (the default's factored statistics); ``v = fac 2^((c - 8) / 2)``, ``fac = v_row v_col / mean(v_col)``,
  ``c`` in 0..15 (2^-4 .. 2^3.5 of the estimate, two codes per octave);
  ``ref="block"``: ``vmax`` ``[rows, ceil(cols / 256)]``; ``v = vmax 2^-c``, ``c`` in 0..14, 15 = zero;
* one 16-entry codebook for all tensors, the exact DP (core/codebook.dp_segments, K = 16) on the first
  step's histogram of ``g / absmax`` and its mirror image (D17), -1 and +1 pinned.

A step decodes both moments, advances them in float32, applies AdamW's update from those float32
values with D13's clamp (``bound_updates=2.0``'s), and stores them again: the first moment rounded
stochastically between its two nearest codewords (unbiased in the value), ``v``'s code stochastically
between its two nearest codes (unbiased in the code). The random numbers are a 32-bit integer hash of
(seed, step, tensor, stream) and the element's index, the same bits for any sharding. Other tensors:
AdamW's float32 state. ``foreach``-free and unfused: a reference, not a fast path.
"""
from __future__ import annotations

from typing import Optional

import numpy as np
import torch

from gefen_dist.core.codebook import NUM_BINS, bin_centres, dp_segments, mirrored_counts, solve_codebook
from gefen_dist.core.nibbles import NIBBLE_CODEWORDS, hash32, nibble_step_factored_eager_, step_key
from gefen_dist.core.periods import factored_row_blocks, scale_block_for
from gefen_dist.core.quant import block_histogram_eager
from gefen_dist.core.step import DEFAULT_BOUND_UPDATES, clamp_bound, hyperparameters

BLOCK = 256
_M32 = 0xFFFFFFFF


def uniforms(numel: int, key: int, start: int = 0) -> torch.Tensor:
    """float32 in [0, 1) for elements ``start .. start+numel-1`` (their index in the whole tensor) under
    ``key``: 24 bits of ``hash32(i ^ hash32(key))``, so a shard draws what the whole tensor would there."""
    k = int(hash32(torch.tensor([key & _M32]))[0])
    h = hash32(torch.arange(start, start + numel, dtype=torch.int64) ^ k)
    return (h >> 8).to(torch.float32) * (1.0 / (1 << 24))


def _key(seed: int, step: int, tensor: int, stream: int) -> int:
    return (seed * 0x9E3779B1 + step * 0x85EBCA77 + tensor * 0xC2B2AE3D + stream * 0x27D4EB2F) & _M32


def fit_codebook16(zs, k: int = 16) -> torch.Tensor:
    """The ``k``-entry codebook (16 here; 256 is the default's): the exact DP (K = k) on the histogram of
    the normalised values ``zs`` (a list of float32 tensors in [-1, 1]) plus its mirror image; with fewer
    than ``k`` active bins, ``k`` even levels."""
    counts = torch.zeros(NUM_BINS, dtype=torch.int64)
    for z in zs:
        j = ((z.reshape(-1).double() + 1.0) * (NUM_BINS / 2)).floor().clamp(0, NUM_BINS - 1).long()
        counts += torch.bincount(j, minlength=NUM_BINS)
    w = mirrored_counts(counts.numpy()).astype(np.float64)
    live = w > 0
    if int(live.sum()) < k:
        return torch.linspace(-1, 1, k)
    cb, _, _, _ = dp_segments(bin_centres().astype(np.float64)[live], w[live], k)
    return torch.from_numpy(np.asarray(cb, dtype=np.float32))


class ByteMoments(torch.optim.Optimizer):
    """AdamW with one byte per element for both moments on large tensors (see the module's text)."""

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, *, ref: str = "fac",
                 seed: int = 0, small_threshold: int = 4096, bound: Optional[float] = DEFAULT_BOUND_UPDATES,
                 m_round: str = "stochastic", update: str = "fp32", only=None, draws: str = "iid"):
        if ref not in ("fac", "block", "none", "core"):
            raise ValueError(f"ref must be 'fac', 'block', 'none' or 'core', got {ref!r}")
        if m_round not in ("stochastic", "nearest"):
            raise ValueError(f"m_round must be 'stochastic' or 'nearest', got {m_round!r}")
        if update not in ("fp32", "decoded"):
            raise ValueError(f"update must be 'fp32' or 'decoded', got {update!r}")
        if draws not in ("iid", "quasi"):
            raise ValueError(f"draws must be 'iid' or 'quasi', got {draws!r}")
        # "iid": each step's uniforms hashed anew (keyed by the step; the library's rule, D20); "quasi": the
        # rule the library had from 2026-12-07 to 2026-12-08: a per-element offset keyed without the step,
        # advanced by t * frac(sqrt 2) (first moment) / t * frac(golden ratio) (v) modulo 1
        self.draws = draws
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))
        # "fp32": the update from the float32 moments before they are stored; "decoded": from the stored codes
        # (what the library's default does with its first moment, and what a ZeRO-1 rank that receives only
        # the compressed state can compute)
        self.update = update
        self.ref, self.seed, self.small_threshold, self.bound = ref, seed, small_threshold, bound
        # ref="none": no per-element v (the factored estimate itself, as the default), the whole byte the
        # first moment's index into 256 codewords: the default's layout with this prototype's rounding
        self.m_round, self.k = m_round, 256 if ref == "none" else 16
        self.only = None if only is None else {id(p) for p in only}  # code these tensors only (others: AdamW)
        self.codebook: Optional[torch.Tensor] = None

    def _coded(self, p) -> bool:
        return p.dim() >= 2 and p.numel() >= self.small_threshold and (self.only is None or id(p) in self.only)

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        coded = [(g, i, p) for g in self.param_groups for i, p in enumerate(g["params"])
                 if p.grad is not None and self._coded(p)]
        if self.codebook is None and coded and self.ref == "core":
            self.codebook = _core_codebook([p.grad for _, _, p in coded])
        elif self.codebook is None and coded:  # the first step's m = (1 - beta1) g, normalised per block
            ms = [(1 - g["betas"][0]) * p.grad.float().reshape(p.shape[0], -1) for g, _, p in coded]
            self.codebook = fit_codebook16([m / _expand(_block_absmax(m), m.shape[1]).clamp_min(1e-38) for m in ms],
                                           self.k)
        for n, group in enumerate(self.param_groups):
            for i, p in enumerate(group["params"]):
                if p.grad is None:
                    continue
                if self._coded(p) and self.ref == "core":
                    self._step_core(p, group, tensor=1000 * n + i)
                elif self._coded(p):
                    self._step_coded(p, group, tensor=1000 * n + i)
                else:
                    self._step_adamw(p, group)
        return loss

    def _step_adamw(self, p, group):
        st = self.state[p]
        if not st:
            st["step"] = 0
            st["exp_avg"] = torch.zeros_like(p, dtype=torch.float32)
            st["exp_avg_sq"] = torch.zeros_like(p, dtype=torch.float32)
        b1, b2 = group["betas"]
        st["step"] += 1
        t, g = st["step"], p.grad.float()
        st["exp_avg"].lerp_(g, 1 - b1)
        st["exp_avg_sq"].mul_(b2).addcmul_(g, g, value=1 - b2)
        u = (st["exp_avg"] / (1 - b1 ** t)) / ((st["exp_avg_sq"] / (1 - b2 ** t)).sqrt() + group["eps"])
        p.mul_(1 - group["lr"] * group["weight_decay"]).add_(u.to(p.dtype), alpha=-group["lr"])

    def _step_coded(self, p, group, tensor: int):
        st = self.state[p]
        rows = p.shape[0]
        g = p.grad.float().reshape(rows, -1)
        cols = g.shape[1]
        nb = -(-cols // BLOCK)
        if not st:
            st["step"] = 0
            st["code"] = torch.zeros(rows, cols, dtype=torch.uint8)
            st["scale"] = torch.zeros(rows, nb)
            if self.ref != "block":
                st["v_row"], st["v_col"] = torch.zeros(rows), torch.zeros(cols)
            else:
                st["vmax"] = torch.zeros(rows, nb)
        b1, b2 = group["betas"]
        t = st["step"] + 1
        if t == 1:
            m_prev = torch.zeros_like(g)
            v_prev = torch.zeros_like(g)
        else:
            m_prev, v_prev = self._decode(st, rows, cols)
        g2 = g * g
        m = b1 * m_prev + (1 - b1) * g
        if self.ref != "block":  # after decoding (v's codes are against the previous estimate)
            st["v_row"].mul_(b2).add_(g2.mean(1), alpha=1 - b2)
            st["v_col"].mul_(b2).add_(g2.mean(0), alpha=1 - b2)
        v = self._factored(st) if self.ref == "none" else b2 * v_prev + (1 - b2) * g2
        st["step"] = t
        if self.update == "decoded":
            self._encode(st, m, v, rows, cols, (self.seed, t, tensor))
            m, v_dec = self._decode(st, rows, cols)
            v = v if v_dec is None else v_dec
        u = (m / (1 - b1 ** t)) / ((v / (1 - b2 ** t)).sqrt() + group["eps"])
        if self.bound:
            k = clamp_bound(self.bound, b1, b2, t)
            u.clamp_(-k, k)
        p.mul_(1 - group["lr"] * group["weight_decay"]).add_(u.view_as(p).to(p.dtype), alpha=-group["lr"])
        if self.update == "fp32":
            self._encode(st, m, v, rows, cols, (self.seed, t, tensor))

    def _step_core(self, p, group, tensor: int):
        """ref="core": the library's function (gefen_dist.core.nibbles) with the library's blocks: scale
        blocks of the largest divisor of the row <= 256, D12's row blocks of ``v_col`` (``"auto"``)."""
        st = self.state[p]
        g = p.grad.reshape(p.shape[0], -1)
        rows, slab = g.shape
        G = factored_row_blocks(tuple(p.shape), "auto")
        if not st:
            st["step"] = 0
            st["B"] = scale_block_for(slab, slab)
            st["code"] = torch.zeros(rows, slab, dtype=torch.uint8)
            st["scale"] = torch.zeros(rows, slab // st["B"])
            st["v_row"] = torch.zeros(rows)
            st["v_col"] = torch.zeros(G, slab) if G > 1 else torch.zeros(slab)
        st["step"] += 1
        t = st["step"]
        g2 = g.float().square()
        col = g2.view(G, rows // G, slab).mean(1) if G > 1 else g2.mean(0)
        nibble_step_factored_eager_(p.data.view(-1), g.reshape(-1), st["code"], st["scale"], st["v_row"], st["v_col"],
                                    self.codebook, col, scale_block=st["B"], key=step_key(self.seed, t, tensor),
                                    row_block=rows // G, update=self.update,
                                    **hyperparameters(group, t, self.bound if self.bound else False))

    def _factored(self, st):
        vc = st["v_col"]
        return st["v_row"][:, None] * (vc / vc.mean().clamp_min(1e-38))[None, :]

    def _decode(self, st, rows, cols):
        code = st["code"].long()
        if self.ref == "none":
            return self.codebook[code] * _expand(st["scale"], cols), None
        m = self.codebook[code >> 4] * _expand(st["scale"], cols)
        c = (code & 15).float()
        if self.ref == "fac":
            v = self._factored(st) * torch.exp2((c - 8) / 2)
        else:
            ref = _expand(st["vmax"], cols)
            v = torch.where(c < 15, ref * torch.exp2(-c), torch.zeros_like(c))
        return m, v

    def _uniforms(self, n, key, stream):
        seed, t, tensor = key
        if self.draws == "iid":
            return uniforms(n, _key(seed, t, tensor, stream))
        alpha = (2 ** 0.5 - 1, (5 ** 0.5 - 1) / 2)[stream]
        return torch.frac(uniforms(n, _key(seed, 0, tensor, stream)).double() + (t * alpha) % 1.0).float()

    def _encode(self, st, m, v, rows, cols, key):
        n = rows * cols
        u1 = self._uniforms(n, key, 0).view(rows, cols)
        u2 = self._uniforms(n, key, 1).view(rows, cols)
        a = _block_absmax(m)
        st["scale"].copy_(a)
        z = m / _expand(a, cols).clamp_min(1e-38)
        cb = self.codebook
        lo = (torch.searchsorted(cb, z.contiguous(), right=True) - 1).clamp(0, self.k - 2)
        frac = ((z - cb[lo]) / (cb[lo + 1] - cb[lo])).clamp(0, 1)
        mc = lo + ((u1 < frac) if self.m_round == "stochastic" else (frac > 0.5)).long()  # nearest: ties low
        if self.ref == "none":
            st["code"].copy_(mc.to(torch.uint8))
            return
        if self.ref == "fac":
            fac = self._factored(st)
            x = (2 * torch.log2(v.clamp_min(1e-38) / fac.clamp_min(1e-38)) + 8).clamp(0, 15)
            f = x.floor()
            vc = (f + (u2 < x - f).float()).long()
        else:
            vm = _block_absmax(v)
            st["vmax"].copy_(vm)
            ref = _expand(vm, cols).clamp_min(1e-38)
            x = (-torch.log2(v.clamp_min(1e-38) / ref)).clamp(0, 14)
            f = x.floor()
            vc = torch.where(v > 0, (f + (u2 < x - f).float()).long(), torch.full_like(f, 15).long())
        st["code"].copy_((mc << 4 | vc).to(torch.uint8))


def _core_codebook(grads) -> torch.Tensor:
    """ref="core": the 16-entry codebook of the first step's gradients normalised per scale block (the
    library's histogram, core.quant.block_histogram_eager, mirrored as D17) by core.codebook.solve_codebook."""
    counts = torch.zeros(NUM_BINS, dtype=torch.int64)
    for g in grads:
        slab = g.reshape(g.shape[0], -1).shape[1]
        block_histogram_eager(g.detach().float().reshape(-1), scale_block_for(slab, slab), out=counts)
    return solve_codebook(mirrored_counts(counts), k=NIBBLE_CODEWORDS).codebook


def _expand(blocks: torch.Tensor, cols: int) -> torch.Tensor:
    """``[rows, nb]`` per-block values to ``[rows, cols]``."""
    return blocks.repeat_interleave(BLOCK, 1)[:, :cols]


def _block_absmax(x: torch.Tensor) -> torch.Tensor:
    """``[rows, ceil(cols / 256)]``: the largest ``|x|`` of each block of 256 along each row."""
    rows, cols = x.shape
    pad = (-cols) % BLOCK
    xp = torch.nn.functional.pad(x.abs(), (0, pad))
    return xp.view(rows, -1, BLOCK).amax(2)


def make_variant(ref: str, **kw):
    """A research/quality_variants.py factory ``(groups, lr, betas, seed) -> ByteMoments``."""
    def make(groups, lr, betas, seed, **_):
        return ByteMoments(groups, lr=lr, betas=betas, eps=1e-8, ref=ref, seed=seed, **kw)
    return make


if __name__ == "__main__":  # a smoke run: a small MLP, the state's bytes
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.GELU(), torch.nn.Linear(512, 256))
    opt = ByteMoments(net.parameters(), lr=1e-3)
    for _ in range(20):
        opt.zero_grad()
        loss = net(torch.randn(64, 256)).pow(2).mean()
        loss.backward()
        opt.step()
    from launch.peers import state_bytes  # the benchmarks' count (run from the repository root)

    print(f"loss {loss.item():.4f}; codebook {[round(c, 4) for c in opt.codebook.tolist()]}; "
          f"state {state_bytes(opt) / sum(p.numel() for p in net.parameters()):.3f} B/param")
