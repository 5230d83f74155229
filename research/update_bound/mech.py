"""Prototype update-bounding mechanisms for Gefen's quantized tensors, without editing gefen_dist/.

The eager steps of ``gefen_dist.core.step`` are re-implemented here with one hook: after the
normalised update ``r_i = sigma_i * C[idx_i] * M_b`` (the update divided by lr) is formed, a
*mechanism* may change it before ``p <- p*(1 - lr*wd) - lr*r``. ``use(name, **kw)`` patches
``gefen_dist.optim.gefen``'s references to the eager functions (so ``Gefen(fused=False)`` runs
them); ``use(None)`` restores the library's own functions. With ``name="none"`` the patched steps
reproduce the library's eager steps (checked bitwise in ``check_identity``).

Mechanisms (per element; ``t`` the tensor's step, ``K_t = update_bound(beta1, beta2, t)``):

* ``none``      the library's update.
* ``clamp``     ``r <- clamp(r, -K_t, K_t)`` (kw ``c``: a constant instead of K_t; kw ``scale``: c*K_t).
* ``floor``     the element's second moment floored by its own current contribution,
                ``v_eff = max(v_est, (1-beta2) g^2)``, sigma recomputed from v_eff.
* ``floor_clamp`` floor, then clamp to K_t.
* ``tanh``      a soft bound in the spirit of Adam-atan2 (Everett et al. 2024):
                ``r <- K_t * tanh(r / K_t)`` (smooth, identity to first order, |r| < K_t).
* ``rms``       Adafactor's update clipping per tensor: ``r <- r / max(1, RMS(r) / d)`` (d=1).
* kw ``zero_code``: the codeword nearest 0 is snapped to exactly 0 (learned codebooks have no
                exact 0, so a first moment whose gradient is 0 never decays below C_0 * M).
"""
from __future__ import annotations

import math
from contextlib import contextmanager

import torch

import gefen_dist.optim.gefen as _opt
from gefen_dist.core import step as _step
from gefen_dist.core.quant import nearest_codeword
from gefen_dist.core.step import _apply_update_, column_factors, row_factors

_ORIG = dict(shared=_step.quantized_step_eager_, factored=_step.quantized_step_factored_eager_)
CFG = dict(name="none", kw={})
STATS = dict(max_r_before=0.0, max_r_after=0.0, worst=None, n=0, n_over=0)


def update_bound(beta1: float, beta2: float, step: int) -> float:
    """AdamW's tight bound on ``|m_hat_t| / sqrt(v_hat_t)`` (eps = 0) after ``step`` steps:
    ``(1-b1)/(1-b1^t) * sqrt((1-b2^t)/(1-b2)) * sqrt(sum_{j<t} (b1^2/b2)^j)``; 1 at t = 1."""
    t = int(step)
    if t < 1:
        raise ValueError("step must be >= 1")
    if beta1 == 0.0:
        return 1.0 / math.sqrt(1.0 - beta2) * math.sqrt(1.0 - beta2 ** t) if beta2 > 0 else 1.0
    if beta2 == 0.0:
        # v_t = g_t^2: m_t / |g_t| unbounded unless t == 1 (AdamW itself has no bound)
        return 1.0 if t == 1 else math.inf
    rho = beta1 * beta1 / beta2
    s = float(t) if abs(rho - 1.0) < 1e-15 else (1.0 - rho ** t) / (1.0 - rho)
    return (1.0 - beta1) / (1.0 - beta1 ** t) * math.sqrt((1.0 - beta2 ** t) / (1.0 - beta2)) * math.sqrt(s)


def step_of(bc1: float, bc2: float, beta1: float, beta2: float) -> int:
    """The step t from the bias corrections the optimizer passes (1 - beta^t)."""
    for bc, b in ((bc2, beta2), (bc1, beta1)):
        if 0.0 < b < 1.0 and 1.0 - bc > 0.0:
            return max(1, int(round(math.log(1.0 - bc) / math.log(b))))
    return 10 ** 9


def _mechanism(r, g, v_el, q, *, bc1, bc2, eps, beta1, beta2, M=None):
    """r, g, v_el, q: float32 [rows, cols] (v_el the per-element second-moment estimate)."""
    name, kw = CFG["name"], CFG["kw"]
    t = step_of(bc1, bc2, beta1, beta2)
    K = update_bound(beta1, beta2, t)
    rb = float(r.abs().max()) if r.numel() else 0.0
    if rb > STATS["max_r_before"]:
        STATS["max_r_before"] = rb
        k = int(r.abs().argmax())
        STATS["worst"] = dict(t=t, r=float(r.reshape(-1)[k]), g=float(g.reshape(-1)[k]),
                              v=float(v_el.reshape(-1)[k]), q=float(q.reshape(-1)[k]), K=K)
        if M is not None:
            Mk = float(M.reshape(-1)[k])
            STATS["worst"].update(M=Mk, C_idx=float(q.reshape(-1)[k]) / Mk if Mk else 0.0)
    if name == "none":
        out = r
    elif name == "clamp":
        c = kw.get("c", K * kw.get("scale", 1.0))
        out = r.clamp(-c, c)
    elif name in ("floor", "floor_clamp"):
        v_eff = torch.maximum(v_el, (1.0 - beta2) * g * g)
        sigma = (v_eff.sqrt() / math.sqrt(bc2) + eps).reciprocal() * (1.0 / bc1)
        out = q * sigma
        if name == "floor_clamp":
            c = K * kw.get("scale", 1.0)
            out = out.clamp(-c, c)
    elif name == "tanh":
        out = K * torch.tanh(r / K)
    elif name == "rms":
        rms = float(r.pow(2).mean().sqrt())
        out = r / max(1.0, rms / kw.get("d", 1.0))
    else:
        raise ValueError(name)
    STATS["n"] += r.numel()
    STATS["n_over"] += int((r.abs() > K).sum())  # elements whose unmodified update exceeds K_t
    ra = float(out.abs().max()) if out.numel() else 0.0
    STATS["max_r_after"] = max(STATS["max_r_after"], ra)
    return out


def zero_snapped(codebook):
    """The codebook with its codeword nearest 0 replaced by exactly 0 (order is kept): a first
    moment whose gradient stays 0 then decays to exactly 0, as AdamW's does."""
    cb = codebook.clone()
    cb[int(cb.abs().argmin())] = 0.0
    return cb


def _requant(ib, sb, gb, codebook, beta1):
    if CFG["kw"].get("zero_code"):
        codebook = zero_snapped(codebook)
    m = codebook[ib.long()] * sb
    m.lerp_(gb, 1.0 - beta1)
    a = m.abs().amax(dim=1, keepdim=True)
    sb.copy_(a)
    z = torch.where(a > 0, m / torch.where(a > 0, a, torch.ones_like(a)), torch.zeros_like(m))
    new = nearest_codeword(z, codebook)
    ib.copy_(new)
    return new, a, codebook[new.long()] * a


def shared_step_(param, grad, idx, scale, v, codebook, *, lr, beta1, beta2, eps, weight_decay, bc1, bc2,
                 period, scale_block):
    n = param.numel()
    if n == 0:
        return
    P, B = period, scale_block
    g = grad.reshape(-1).float().view(-1, P)
    vb = v.view(-1)
    vb.mul_(beta2).add_((g * g).mean(dim=1), alpha=1.0 - beta2)
    sigma = vb.sqrt().div_(math.sqrt(bc2)).add_(eps).reciprocal_().mul_(1.0 / bc1)
    _, _, q = _requant(idx.view(-1, B), scale.view(-1, 1), g.view(-1, B), codebook, beta1)
    Mel = scale.view(-1, 1).expand(-1, B).reshape(-1, P)
    q = q.view(-1, P)
    r = q * sigma.view(-1, 1)
    r = _mechanism(r, g, vb.view(-1, 1).expand_as(g), q, bc1=bc1, bc2=bc2, eps=eps, beta1=beta1, beta2=beta2,
                   M=Mel)
    _apply_update_(param.view(-1), (r * lr).view(-1), weight_decay, 1.0 - lr * weight_decay)


def factored_step_(param, grad, idx, scale, v_row, v_col, codebook, col_mean_sq, *, lr, beta1, beta2, eps,
                   weight_decay, bc1, bc2, scale_block, row0=0, row_block=0):
    n = param.numel()
    slab = v_col.shape[-1]
    v_col.mul_(beta2).add_(col_mean_sq.view_as(v_col), alpha=1.0 - beta2)
    if n == 0:
        return
    B = scale_block
    col_f = column_factors(v_col)
    g = grad.reshape(-1, slab).float()
    R = g.shape[0]
    vr = v_row.view(-1)
    vr.mul_(beta2).add_((g * g).mean(dim=1), alpha=1.0 - beta2)
    cf = row_factors(col_f, row0, 0, R, row_block)
    denom = (vr.sqrt().unsqueeze(1) * cf).div_(math.sqrt(bc2)).add_(eps)
    sigma = denom.reciprocal_().mul_(1.0 / bc1)
    # the per-element v estimate (for the floor): v_row_i * v_col_j / mean(v_col)
    v_el = vr.unsqueeze(1) * cf * cf
    _, _, q = _requant(idx.view(-1, B), scale.view(-1, 1), g.reshape(-1, B), codebook, beta1)
    Mel = scale.view(-1, 1).expand(-1, B).reshape(R, slab)
    q = q.view(R, slab)
    r = q * sigma
    r = _mechanism(r, g, v_el, q, bc1=bc1, bc2=bc2, eps=eps, beta1=beta1, beta2=beta2, M=Mel)
    _apply_update_(param.view(-1, slab), r * lr, weight_decay, 1.0 - lr * weight_decay)


def use(name=None, **kw):
    """Install mechanism ``name`` (None: the library's own eager steps)."""
    STATS.update(max_r_before=0.0, max_r_after=0.0, worst=None, n=0, n_over=0)
    if name is None:
        _opt.quantized_step_eager_ = _ORIG["shared"]
        _opt.quantized_step_factored_eager_ = _ORIG["factored"]
        return
    CFG["name"], CFG["kw"] = name, dict(kw)
    _opt.quantized_step_eager_ = shared_step_
    _opt.quantized_step_factored_eager_ = factored_step_


@contextmanager
def mechanism(name=None, **kw):
    use(name, **kw)
    try:
        yield STATS
    finally:
        use(None)


# name -> (mechanism, kwargs) for the tables
MECHS = {
    "a_clampK": ("clamp", {}),
    "a2_clamp2K": ("clamp", {"scale": 2.0}),
    "b_clamp1": ("clamp", {"c": 1.0}),
    "b_clamp2": ("clamp", {"c": 2.0}),
    "c_floor": ("floor", {}),
    "d_floor_clampK": ("floor_clamp", {}),
    "d2_floor_clamp2K": ("floor_clamp", {"scale": 2.0}),
    "e_tanhK": ("tanh", {}),
    "e_rms": ("rms", {}),
    "f_zero_only": ("none", {"zero_code": True}),
    "g_clampK_zero": ("clamp", {"zero_code": True}),
    "h_floor_clampK_zero": ("floor_clamp", {"zero_code": True}),
}
