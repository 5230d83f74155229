"""The per-tensor update (paper §4, with D5 numerics), eager torch implementation.

These functions act in place on *flat local pieces* whose length is a multiple of the blocks
(every backend hands whole blocks here; DeepSpeed's cut blocks are reconciled by the caller).
They are the reference for the fused kernels (``gefen_dist.kernels``), which must agree to
rounding level.

Quantized tensors, per v-block ``b`` of ``P`` elements and scale block of ``B`` elements
(``B == P`` or ``P == 1``)::

    v_b   <- beta2 * v_b + (1 - beta2) * mean(g^2 over block b)
    sigma <- (1 / (sqrt(v_b) / sqrt(bc2) + eps)) * (1 / bc1)
    m     <- lerp(C[idx] * M, g, 1 - beta1)          (float32)
    M     <- max |m| over the scale block;  idx <- nearest(m / M)
    p     <- p * (1 - lr*wd) - lr * sigma * C[idx] * M

State is float32 whatever the parameter dtype (D5); the parameter is updated in float32 and
rounded once to its dtype.
"""
from __future__ import annotations

import math
from typing import List, Optional

import torch

from .quant import nearest_codeword

# Rows (v-blocks) processed per chunk in the eager path, to bound float32 temporaries.
_EAGER_CHUNK_ELEMS = 1 << 22


def scalar_value(x) -> float:
    """A hyperparameter given as a number or a 0-dim tensor (a tensor ``lr``), as a float."""
    return float(x.item()) if isinstance(x, torch.Tensor) else float(x)


def bias_corrections(step: int, beta1: float, beta2: float) -> tuple[float, float]:
    """``1 - beta^t`` in double precision, as torch's Adam computes them."""
    return 1.0 - beta1 ** step, 1.0 - beta2 ** step


# The default ``bound_updates``: every quantized element's normalised update clamped to twice
# AdamW's own bound K_t (D13), relaxed in the first steps (:func:`clamp_bound`). Measured (docs/algorithm.md, D13; research/quality-log.md): on the
# `small` LM, paired by seed against the clamp at K_t, -0.90 points of validation loss on the mean
# of six seeds (the clamp at K_t costs +0.90 against no clamp there, the clamp at 2 K_t +0.02);
# on digits -1.43% of held-out loss against AdamW where K_t gives +0.10% and no clamp +7.9%; the
# sparse-feature, dead-first-batch and plain MLP workloads within 5% of AdamW (4 K_t is not: 1.19x).
DEFAULT_BOUND_UPDATES = 2.0


def bound_factor(bounded) -> Optional[float]:
    """The factor on AdamW's bound of a ``bound_updates`` setting: ``True`` 1.0 (AdamW's own bound),
    ``False`` None (unbounded), a real number >= 1 itself (the default,
    :data:`DEFAULT_BOUND_UPDATES`, is 2.0); anything else raises, naming the value."""
    if bounded is True:
        return 1.0
    if bounded is False:
        return None
    if isinstance(bounded, (int, float)) and not isinstance(bounded, bool) and math.isfinite(bounded) \
            and bounded >= 1.0:
        return float(bounded)
    raise ValueError(f"Invalid bound_updates: {bounded!r} (expected True, False or a finite factor >= 1 on "
                     "AdamW's bound)")


def hyperparameters(group: dict, step: int, bounded=DEFAULT_BOUND_UPDATES) -> dict:
    """The scalars of one update of a tensor at ``step`` (>= 1) in param group ``group``: lr (a tensor
    lr as a float), beta1, beta2, eps, weight_decay, the bias corrections bc1, bc2 and the update
    bound (``bounded`` as :func:`bound_factor` reads it: :func:`clamp_bound`, or None when ``bounded``
    is False: the paper's unbounded update)."""
    beta1, beta2 = group["betas"]
    bc1, bc2 = bias_corrections(step, beta1, beta2)
    f = bound_factor(bounded)
    return dict(lr=scalar_value(group["lr"]), beta1=beta1, beta2=beta2, eps=group["eps"],
                weight_decay=group["weight_decay"], bc1=bc1, bc2=bc2,
                bound=None if f is None else clamp_bound(f, beta1, beta2, step))


def device_hyperparameters(group: dict, step: torch.Tensor, bounded=DEFAULT_BOUND_UPDATES) -> dict:
    """:func:`hyperparameters` from a step count held on the device (``capturable=True``): the same
    keys, with ``lr``, ``bc1``, ``bc2`` and ``bound`` float64 0-dim tensors on ``step``'s device
    computed by tensor operations (no host synchronisation, so a CUDA graph can capture them), the
    others floats. The same formulas in the same order as the host's double-precision ones, so
    rounded to float32 they are the host's values (``tests/test_triton_step.py``). A tensor ``lr``
    is read on the device (its value at each replay); a float ``lr`` is a constant of the step."""
    beta1, beta2 = group["betas"]
    t = step.to(torch.float64)
    lr = group["lr"]
    lr = lr.to(device=t.device, dtype=torch.float64).reshape(()) if isinstance(lr, torch.Tensor) \
        else torch.full((), float(lr), dtype=torch.float64, device=t.device)
    f = bound_factor(bounded)
    return dict(lr=lr, beta1=beta1, beta2=beta2, eps=group["eps"], weight_decay=group["weight_decay"],
                bc1=1.0 - beta1 ** t, bc2=1.0 - beta2 ** t,
                bound=None if f is None else clamp_bound(f, beta1, beta2, t))


def adamw_hyperparameters(group: dict, step: int) -> dict:
    """:func:`hyperparameters` of an exact (AdamW) tensor: no update bound (AdamW's own update), the
    keywords of :func:`adamw_step_` / :func:`adamw_foreach_`."""
    hp = hyperparameters(group, step, bounded=False)
    hp.pop("bound")
    return hp


def clamp_bound(factor: float, beta1: float, beta2: float, step: int) -> float:
    """The clamp of the normalised update at ``step`` for a ``bound_updates`` factor ``c`` (D13):
    ``c (1 + beta1^(t-1)) K_t``, :func:`update_bound`'s ``K_t`` relaxed by up to 2x in the first steps
    (``2 c K_1 = 2c`` at ``t = 1``), the relaxation decaying with the first moment's memory to ``c K_t``.

    Why the relaxation: in the first steps the factored second moment comes from a handful of
    gradients, and a clamp at ``c K_t`` binds on many elements there (6.9% of the quantized elements
    of the `base` LM at ``t = 1`` for ``c = 2``); measured on that model (seed 0,
    research/results/bound_early_steps.json), clamping the first ten steps alone at ``2 K_t`` derailed
    training (training loss 3.20 at step 30 against 2.86 unclamped and 2.90 for AdamW; clamping only
    after step 10: 2.86), while the relaxed clamp trains (2.83); issue 26's three workloads stay
    within 5% of AdamW (docs/algorithm.md, D13)."""
    t = step if isinstance(step, torch.Tensor) else int(step)
    return factor * (1.0 + beta1 ** (t - 1)) * update_bound(beta1, beta2, t)


def update_bound(beta1: float, beta2: float, step: int) -> float:
    """AdamW's tight bound on its per-element normalised update after ``step`` steps (D13): for every
    gradient sequence ``|m_hat_t| / (sqrt(v_hat_t) + eps) <= K_t`` with

        K_t = (1-beta1)/(1-beta1^t) * sqrt((1-beta2^t)/(1-beta2)) * sqrt(sum_{j<t} (beta1^2/beta2)^j)

    (Cauchy-Schwarz on the two EMAs; equality for ``g_k`` proportional to ``(beta1/beta2)^(t-k)``).
    ``K_1 = 1``; non-decreasing in ``t``; as ``t -> inf`` it tends to
    ``(1-beta1)/sqrt((1-beta2)(1-beta1^2/beta2))`` when ``beta1^2 < beta2`` (7.27 for (0.9, 0.999),
    1.165 for (0.9, 0.95)). Gefen clamps every quantized element's normalised update
    ``sigma_i * C[idx_i] * M_b`` to ``[-K_t, K_t]``, so ``|dp_i| <= K_t * lr`` (weight decay aside)
    whatever the gradients, as for AdamW (docs/algorithm.md).

    ``step`` may also be a float64 tensor (the device-side step of ``capturable=True``,
    :func:`device_hyperparameters`): the same operations in the same order, as tensor operations."""
    dev = isinstance(step, torch.Tensor)
    t = step if dev else int(step)
    if not dev and t < 1:
        raise ValueError(f"update_bound: step must be >= 1, got {step}")
    sqrt = torch.sqrt if dev else math.sqrt
    if beta1 == 0.0:  # m_t = g_t: |g_t| / sqrt(v_hat_t) <= sqrt((1-beta2^t)/(1-beta2))
        return sqrt((1.0 - beta2 ** t) / (1.0 - beta2))
    if beta2 == 0.0:  # v_t = g_t^2: AdamW itself is unbounded after the first step
        return torch.where(t == 1, 1.0, math.inf).to(t) if dev else (1.0 if t == 1 else math.inf)
    rho = beta1 * beta1 / beta2
    s = (t if dev else float(t)) if rho == 1.0 else (1.0 - rho ** t) / (1.0 - rho)
    return (1.0 - beta1) / (1.0 - beta1 ** t) * sqrt((1.0 - beta2 ** t) / (1.0 - beta2) * s)


# ---------------------------------------------------------------------------------------------
# Phases of the update. Every eager path (the whole step here, ZeRO-1's owners and appliers, the
# cut blocks of DeepSpeed's flat buffers) composes these; the fused kernels implement the same.
# ---------------------------------------------------------------------------------------------

def check_tensor(name: str, t: torch.Tensor, dtype, numel: int) -> None:
    """The layout checks every implementation makes of a state or gradient tensor before anything
    changes (the device is each caller's own check): contiguous, of ``dtype`` (None: any), ``numel``
    elements; each error names the tensor and what it should be."""
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous")
    if dtype is not None and t.dtype != dtype:
        raise ValueError(f"{name} must be {dtype}, got {t.dtype}")
    if t.numel() != numel:
        raise ValueError(f"{name} has {t.numel()} elements, expected {numel}")


def ema_(v: torch.Tensor, x: torch.Tensor, beta2: float) -> torch.Tensor:
    """``v <- beta2 * v + (1 - beta2) * x`` in place (a second-moment statistic)."""
    return v.mul_(beta2).add_(x, alpha=1.0 - beta2)


def ema_foreach_(vs: List[torch.Tensor], xs: List[torch.Tensor], beta2: float) -> None:
    """:func:`ema_` of many statistics in two foreach operations (the same arithmetic per element)."""
    if vs:
        torch._foreach_mul_(vs, beta2)
        torch._foreach_add_(vs, xs, alpha=1.0 - beta2)


def inv_rms_(rms: torch.Tensor, eps: float, bc1: float, sqrt_bc2: float) -> torch.Tensor:
    """``sigma = (1 / (rms / sqrt(bc2) + eps)) * (1 / bc1)``, in place on ``rms`` (a fresh tensor:
    ``sqrt(v)``, or ``sqrt(v_row) * col_f`` for the factored second moment)."""
    return rms.div_(sqrt_bc2).add_(eps).reciprocal_().mul_(1.0 / bc1)


def first_moment(ib: torch.Tensor, sb: torch.Tensor, g: torch.Tensor, codebook: torch.Tensor,
                 beta1: float) -> torch.Tensor:
    """The new first moment ``lerp(C[idx] * M, g, 1 - beta1)`` in float32 (``ib`` uint8 indices,
    ``sb`` their scales broadcast against them, ``g`` float32 of the same shape)."""
    m = codebook[ib.long()] * sb
    return m.lerp_(g, 1.0 - beta1)


def quantize(m: torch.Tensor, a: torch.Tensor, codebook: torch.Tensor, nearest=nearest_codeword) -> torch.Tensor:
    """Nearest-codeword indices (uint8) of ``m / a`` (``a``: the absmax scales broadcast against
    ``m``; 0 where the scale is 0). ``nearest``: :func:`~gefen_dist.core.quant.nearest_codeword` or
    an implementation with its results (the native table lookup,
    :func:`gefen_dist.kernels.dispatch.nearest`)."""
    z = torch.where(a > 0, m / torch.where(a > 0, a, torch.ones_like(a)), torch.zeros_like(m))
    return nearest(z, codebook)


def requantize_(ib: torch.Tensor, sb: torch.Tensor, g_blocks: torch.Tensor, codebook: torch.Tensor,
                beta1: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Dequantise ``C[idx] * M``, take the EMA towards ``g``, store the new absmax ``M`` and
    nearest indices in place (``ib``: [blocks, B] uint8, ``sb``: [blocks, 1]); returns (new idx,
    absmax) for the parameter update."""
    m = first_moment(ib, sb, g_blocks, codebook, beta1)
    a = m.abs().amax(dim=1, keepdim=True)
    sb.copy_(a)
    new = quantize(m, a, codebook)
    ib.copy_(new)
    return new, a


def _apply_update_(p: torch.Tensor, u: torch.Tensor, weight_decay: float, decay: float) -> None:
    """``p <- p * decay - u`` in float32 (decay skipped when ``weight_decay == 0``), rounded once to
    the parameter's dtype."""
    p32 = p if p.dtype == torch.float32 else p.float()
    if weight_decay != 0.0:
        p32.mul_(decay)
    p32.sub_(u)
    if p32 is not p:
        p.copy_(p32)


def apply_(p: torch.Tensor, qa: torch.Tensor, sigma: torch.Tensor, lr: float, weight_decay: float,
           bound: float | None = None) -> None:
    """The parameter update ``p <- p * (1 - lr*wd) - clamp((C[idx] * M) * sigma, +-bound) * lr``:
    ``qa`` is the dequantised first moment ``C[idx] * M`` (consumed), ``sigma`` broadcasts against
    it, ``p`` has its number of elements. ``bound``: :func:`update_bound` (D13), or None for the
    paper's unbounded update (a NaN stays NaN either way)."""
    u = qa.mul_(sigma)
    if bound is not None:
        u.clamp_(-bound, bound)
    u.mul_(lr)
    _apply_update_(p, u.view(p.shape), weight_decay, 1.0 - lr * weight_decay)


def decay_only_(p: torch.Tensor, lr: float, weight_decay: float) -> None:
    """The update of a quantized tensor whose gradient has been globally zero so far (D4: its
    state is not learned yet, so ``m`` and ``v`` are exactly zero): only the weight decay."""
    if weight_decay != 0.0 and lr != 0.0 and p.numel():
        p.mul_(1.0 - lr * weight_decay)


def _shared_chunks(grad, idx, scale, v, codebook, *, beta1, beta2, eps, bc1, bc2, period, scale_block):
    """The state update of a quantized piece with a shared second moment, chunk by chunk of whole
    blocks: yields ``(start, end, sigma [blocks of P], new idx [., B], absmax [., 1])``."""
    n = idx.numel()
    P, B = period, scale_block
    # Whole scale blocks (which contain whole v-blocks or are contained in one when P == 1).
    unit = max(P, B)
    chunk = max(unit, (_EAGER_CHUNK_ELEMS // unit) * unit)
    gf, ix, sf, vf = grad.reshape(-1), idx.view(-1), scale.view(-1), v.view(-1)
    sqrt_bc2 = math.sqrt(bc2)
    for s in range(0, n, chunk):
        e = min(n, s + chunk)
        g = gf[s:e].float().view(-1, P)
        vb = ema_(vf[s // P:e // P], (g * g).mean(dim=1), beta2)
        sigma = inv_rms_(vb.sqrt(), eps, bc1, sqrt_bc2)
        new, a = requantize_(ix[s:e].view(-1, B), sf[s // B:e // B].view(-1, 1), g.view(-1, B), codebook, beta1)
        yield s, e, sigma, new, a


def quantized_state_eager_(grad, idx, scale, v, codebook, *, beta1, beta2, eps, bc1, bc2, period,
                           scale_block) -> torch.Tensor:
    """The state update of :func:`quantized_step_eager_` without the parameter update (ZeRO-1's
    owners): updates ``v``, ``scale``, ``idx`` in place and returns ``sigma`` per v-block."""
    sigma = torch.empty_like(v.view(-1))
    P = period
    for s, e, sg, _, _ in _shared_chunks(grad, idx, scale, v, codebook, beta1=beta1, beta2=beta2, eps=eps,
                                         bc1=bc1, bc2=bc2, period=period, scale_block=scale_block):
        sigma[s // P:e // P] = sg
    return sigma


def quantized_step_eager_(
    param: torch.Tensor,
    grad: torch.Tensor,
    idx: torch.Tensor,
    scale: torch.Tensor,
    v: torch.Tensor,
    codebook: torch.Tensor,
    *,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    bc1: float,
    bc2: float,
    period: int,
    scale_block: int,
    bound: float | None = None,
) -> None:
    """One Gefen update of a quantized piece, in place. All tensors are contiguous views of
    the same ``numel`` (``scale``: numel/B, ``v``: numel/P elements). ``bound``: the clamp of the
    normalised update (:func:`update_bound`; None: unbounded, the paper's)."""
    if param.numel() == 0:
        return
    pf, P = param.view(-1), period
    for s, e, sigma, new, a in _shared_chunks(grad, idx, scale, v, codebook, beta1=beta1, beta2=beta2, eps=eps,
                                              bc1=bc1, bc2=bc2, period=period, scale_block=scale_block):
        apply_(pf[s:e], (codebook[new.long()] * a).view(-1, P), sigma.view(-1, 1), lr, weight_decay, bound)


def adamw_step_(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    *,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    bc1: float,
    bc2: float,
    bound: float | None = None,
) -> None:
    """Exact AdamW (torch's single-tensor formula) with float32 state, for small and 1-D
    tensors (D2). The parameter is updated in float32 and rounded once to its dtype. ``bound`` is
    accepted so that one hyperparameter dict serves every tensor, and unused: AdamW's update is
    within :func:`update_bound` by construction."""
    if param.numel() == 0:
        return
    g = grad.float()
    p = param if param.dtype == torch.float32 else param.float()
    if weight_decay != 0.0:
        p.mul_(1.0 - lr * weight_decay)
    exp_avg.lerp_(g, 1.0 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(g, g, value=1.0 - beta2)
    denom = (exp_avg_sq.sqrt() / math.sqrt(bc2)).add_(eps)
    p.addcdiv_(exp_avg, denom, value=-(lr / bc1))
    if p is not param:
        param.copy_(p)


ADAMW_KEYS = ("lr", "beta1", "beta2", "eps", "weight_decay", "bc1", "bc2")  # adamw_foreach_'s scalars, of hyperparameters()


def adamw_foreach_(
    params: list,
    grads: list,
    exp_avgs: list,
    exp_avg_sqs: list,
    *,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    bc1: float,
    bc2: float,
) -> None:
    """:func:`adamw_step_` over many tensors with ``torch._foreach_*`` operations (the same
    operations in the same order, a few kernel launches in all instead of seven per tensor;
    used for the exact tensors on CUDA, where launches, not bytes, dominate small tensors)."""
    keep = [i for i, p in enumerate(params) if p.numel()]
    if not keep:
        return
    params = [params[i] for i in keep]
    m = [exp_avgs[i] for i in keep]
    v = [exp_avg_sqs[i] for i in keep]
    # float32 working copies of low-precision tensors: one foreach copy each way, not one per tensor
    g = _float32_copies([grads[i] for i in keep])
    p32 = _float32_copies(params)
    if weight_decay != 0.0:
        torch._foreach_mul_(p32, 1.0 - lr * weight_decay)
    torch._foreach_lerp_(m, g, 1.0 - beta1)
    torch._foreach_mul_(v, beta2)
    torch._foreach_addcmul_(v, g, g, value=1.0 - beta2)
    denom = torch._foreach_sqrt(v)
    torch._foreach_div_(denom, math.sqrt(bc2))
    torch._foreach_add_(denom, eps)
    torch._foreach_addcdiv_(p32, m, denom, value=-(lr / bc1))
    back = [(p, q) for p, q in zip(params, p32) if q is not p]
    if back:
        torch._foreach_copy_([p for p, _ in back], [q for _, q in back])


def adamw_fused_(params: list, grads: list, exp_avgs: list, exp_avg_sqs: list, steps: list, *, lr, betas, eps: float,
                 weight_decay: float, found_inf: Optional[torch.Tensor] = None) -> None:
    """The exact tensors' AdamW update by torch's fused kernel (``torch._fused_adamw_``), which reads
    the step counts (already advanced: float32 tensors on the parameters' device), a tensor ``lr`` and
    ``found_inf`` on the device: no host synchronisation, so the step can be captured in a CUDA
    graph (``capturable=True``). A non-zero ``found_inf`` leaves every tensor as it was. The state is
    float32 whatever the parameter dtype (D5): other parameters are stepped in float32 copies and
    rounded back once (unchanged on a skipped step: the round trip is exact). Equal to
    :func:`adamw_foreach_` within float32 rounding (the same update, other operations)."""
    keep = [i for i, p in enumerate(params) if p.numel()]
    if not keep:
        return
    params = [params[i] for i in keep]
    g = _float32_copies([grads[i] for i in keep])
    p32 = _float32_copies(params)
    torch._fused_adamw_(p32, g, [exp_avgs[i] for i in keep], [exp_avg_sqs[i] for i in keep], [],
                        [steps[i] for i in keep], lr=lr, beta1=betas[0], beta2=betas[1],
                        weight_decay=weight_decay, eps=eps, amsgrad=False, maximize=False, grad_scale=None,
                        found_inf=found_inf)
    back = [(p, q) for p, q in zip(params, p32) if q is not p]
    if back:
        torch._foreach_copy_([p for p, _ in back], [q for _, q in back])


def _float32_copies(ts: list) -> list:
    """``t.float()`` for each tensor (the tensor itself when float32), converted in one foreach copy."""
    low = [i for i, t in enumerate(ts) if t.dtype != torch.float32]
    if not low:
        return list(ts)
    out = list(ts)
    dst = [torch.empty(ts[i].shape, dtype=torch.float32, device=ts[i].device) for i in low]
    torch._foreach_copy_(dst, [ts[i] for i in low])
    for i, d in zip(low, dst):
        out[i] = d
    return out


def column_sumsq(grad: torch.Tensor, slab: int) -> torch.Tensor:
    """Sum of ``g^2`` over the rows this piece holds, per column: float32 squares accumulated in
    float64 (``[slab]``), so the order in which shards are summed does not change the float32
    result.

    The factored second moment needs the column mean over *all* rows of the global tensor: sharded
    callers all-reduce these partial sums (SUM) before :func:`quantized_step_factored_eager_`.
    """
    g = grad.reshape(-1, slab)
    out = torch.zeros(slab, dtype=torch.float64, device=grad.device)
    rows = max(1, _EAGER_CHUNK_ELEMS // max(1, slab))
    for r0 in range(0, g.shape[0], rows):
        c = g[r0:r0 + rows].float()
        out.add_((c * c).sum(dim=0, dtype=torch.float64))
    return out


def block_column_sumsq(grad: torch.Tensor, slab: int, row0: int, row_block: int, nblocks: int,
                       sumsq=column_sumsq) -> torch.Tensor:
    """:func:`column_sumsq` per block of rows (D12): ``[nblocks * slab]`` float64, block ``b``
    holding the sums over the rows of this piece (global rows ``row0 ..``) that fall in global rows
    ``[b * row_block, (b + 1) * row_block)``; blocks the piece does not touch are zero. With one
    block it is ``sumsq(grad, slab)``. ``sumsq`` sums one contiguous range of rows (the eager
    function or the native kernel's); the result lies on the device ``sumsq`` returns."""
    if nblocks == 1:
        return sumsq(grad, slab)
    g = grad.reshape(-1)
    nr = g.numel() // slab
    parts = []
    r = 0
    while r < nr:
        b = (row0 + r) // row_block
        end = min(nr, (b + 1) * row_block - row0)
        parts.append((b, sumsq(g[r * slab:end * slab], slab)))
        r = end
    # on the device ``sumsq`` returns (no host copy for CUDA gradients)
    out = torch.zeros(nblocks * slab, dtype=torch.float64, device=parts[0][1].device if parts else "cpu")
    for b, part in parts:
        out[b * slab:(b + 1) * slab] += part
    return out


def column_ratios(v_col: torch.Tensor) -> torch.Tensor:
    """``v_col / mean(v_col)`` (``[slab]``), or per block of rows for a ``[G, slab]`` ``v_col``
    (D12: each block's profile normalised by its own mean); zeros where the mean is not positive
    (0, or NaN). Tensor operations only: no host synchronisation on a GPU."""
    mean_c = v_col.mean(dim=-1, keepdim=True)  # per row block: the same values as each row's own mean
    return torch.where(mean_c > 0, v_col / mean_c, torch.zeros((), dtype=v_col.dtype, device=v_col.device))


def column_factors(v_col: torch.Tensor, col_blocks: int = 1) -> torch.Tensor:
    """``sqrt(v_col / mean(v_col))``, per block of rows for a ``[G, slab]`` ``v_col`` (D12), or with
    ``col_blocks`` ``K > 1`` (D21; ``v_col`` ``[slab]``) each block of ``slab / K`` columns over its own
    mean (``[slab]``)."""
    if col_blocks > 1:
        return column_ratios(v_col.view(int(col_blocks), -1)).sqrt_().view(v_col.shape)
    return column_ratios(v_col).sqrt_()


def per_column_block(factors, K: int):
    """``factors`` (a function of a ``v_col``: an implementation's column factors) applied to each of ``K``
    blocks of columns on its own (D21: ``v_col`` read as ``[K, slab / K]``, the result flat ``[slab]``);
    ``factors`` itself for ``K == 1``."""
    return factors if K == 1 else (lambda v: factors(v.view(K, -1)).view(-1))


def col_blocks_of(v_row: torch.Tensor) -> int:
    """The column blocks (D21) of a factored state: the columns of its ``v_row`` (``[rows, K]``; 1 for
    ``[rows, 1]`` or ``[rows]``)."""
    return int(v_row.shape[-1]) if v_row.dim() == 2 else 1


def check_col_blocks(v_row: torch.Tensor, v_col: torch.Tensor, scale_block: int) -> int:
    """The column blocks ``K`` of a factored call (D21: ``v_row`` ``[rows, K]``), checked for a kernel: one
    column profile, and the scale block dividing each block of ``slab / K`` columns (a ``ValueError`` else)."""
    K, S, B = col_blocks_of(v_row), v_col.shape[-1], int(scale_block)
    if K > 1 and (v_col.dim() > 1 or S % K or (S // K) % B):
        raise ValueError(f"v_row has {K} column blocks: need one column profile (v_col {tuple(v_col.shape)}) and "
                         f"the scale block {B} dividing the {S // K if S % K == 0 else S / K} columns of a block")
    return K


def row_block_args(v_col: torch.Tensor, global_rows: int, start: int) -> dict:
    """``row0`` / ``row_block`` for a factored step over whole rows starting at flat element ``start``
    of a tensor of ``global_rows`` rows when its ``v_col`` has row blocks (D12), else nothing."""
    if v_col.dim() < 2:
        return {}
    slab = v_col.shape[-1]
    return dict(row0=start // slab, row_block=global_rows // v_col.shape[0])


def row_factors(col_f: torch.Tensor, row0: int, r0: int, r1: int, row_block: int) -> torch.Tensor:
    """The column factors of local rows ``[r0, r1)`` (global ``row0 + r``): ``[1, slab]`` for one
    block (broadcast), else ``[r1 - r0, slab]``, row ``r`` taking its block's profile."""
    if col_f.dim() == 1:
        return col_f.unsqueeze(0)
    blk = torch.div(torch.arange(row0 + r0, row0 + r1, device=col_f.device), row_block, rounding_mode="floor")
    return col_f.index_select(0, blk)


def quantized_step_factored_eager_(
    param: torch.Tensor,
    grad: torch.Tensor,
    idx: torch.Tensor,
    scale: torch.Tensor,
    v_row: torch.Tensor,
    v_col: torch.Tensor,
    codebook: torch.Tensor,
    col_mean_sq: torch.Tensor,
    *,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    bc1: float,
    bc2: float,
    scale_block: int,
    row0: int = 0,
    row_block: int = 0,
    bound: float | None = None,
) -> None:
    """Gefen update with a factored (row x column) second moment, in place.

    ``v_row`` ([rows] of this piece) and ``v_col`` ([slab], the same on every rank) are EMAs of
    the row and column means of ``g^2``; the second moment of element (i, j) is
    ``v_row_i * v_col_j / mean(v_col)`` (Adafactor's estimator; ``mean(v_col) == mean(v_row)``
    over the global tensor, so no extra reduction is needed). ``col_mean_sq`` is the column mean
    of ``g^2`` over all global rows. The first moment is quantized exactly as in
    :func:`quantized_step_eager_`.

    Row blocks (D12): a ``[G, slab]`` ``v_col`` (and ``col_mean_sq``, the column means over each
    block's ``row_block`` global rows) gives every block of rows its own column profile; this
    piece's first row is global row ``row0``. Column blocks (D21): a ``[rows, K]`` ``v_row`` keeps
    each row's mean of ``g^2`` per block of ``slab / K`` columns, and the column factors are
    normalised per block (:func:`column_factors`). ``bound``: as for :func:`quantized_step_eager_`.
    """
    slab = v_col.shape[-1]
    ema_(v_col, col_mean_sq.view_as(v_col), beta2)
    if param.numel() == 0:
        return
    if v_col.dim() > 1 and row_block < 1:
        raise ValueError(f"a v_col of shape {tuple(v_col.shape)} (row blocks) needs row_block >= 1")
    K = col_blocks_of(v_row)
    if K > 1 and v_col.dim() > 1:
        raise ValueError(f"a factored state has row blocks (v_col {tuple(v_col.shape)}) or column blocks "
                         f"(v_row {tuple(v_row.shape)}), not both")
    col_f = column_factors(v_col, K)
    sqrt_bc2 = math.sqrt(bc2)
    p_all = param.view(-1, slab)
    for r0, r1, rsq, new, a in _factored_chunks(grad, idx, scale, v_row, codebook, slab=slab, beta1=beta1,
                                                beta2=beta2, scale_block=scale_block):
        rms = (rsq.repeat_interleave(slab // K, dim=1) * col_f if K > 1
               else rsq.unsqueeze(1) * row_factors(col_f, row0, r0, r1, row_block))
        sigma = inv_rms_(rms, eps, bc1, sqrt_bc2)
        apply_(p_all[r0:r1], (codebook[new.long()] * a).view(r1 - r0, slab), sigma, lr, weight_decay, bound)


def _factored_chunks(grad, idx, scale, v_row, codebook, *, slab, beta1, beta2, scale_block):
    """The row-local state update of a factored piece (``v_row``, ``m``, ``idx``, ``scale``), chunk by
    chunk of whole rows: yields ``(r0, r1, sqrt(v_row) [r1 - r0] (column blocks, D21: [r1 - r0, K]),
    new idx [., B], absmax [., 1])``."""
    B = scale_block
    K = col_blocks_of(v_row)
    rows_per = max(1, _EAGER_CHUNK_ELEMS // slab)
    g_all = grad.reshape(-1, slab)
    i_all = idx.view(-1, slab)
    s_all = scale.view(-1, slab // B)
    vr_all = v_row.view(-1, K) if K > 1 else v_row.view(-1)
    for r0 in range(0, g_all.shape[0], rows_per):
        r1 = min(g_all.shape[0], r0 + rows_per)
        g = g_all[r0:r1].float()
        g2 = g * g
        rsq = ema_(vr_all[r0:r1], g2.view(r1 - r0, K, slab // K).mean(dim=2) if K > 1 else g2.mean(dim=1),
                   beta2).sqrt()
        new, a = requantize_(i_all[r0:r1].reshape(-1, B), s_all[r0:r1].reshape(-1, 1), g.reshape(-1, B),
                             codebook, beta1)
        yield r0, r1, rsq, new, a


def factored_state_eager_(grad, idx, scale, v_row, codebook, *, slab, beta1, beta2, scale_block, eps=None, bc1=None,
                          bc2=None) -> torch.Tensor:
    """The row-local state update of :func:`quantized_step_factored_eager_` without the column factor
    and the parameter update (ZeRO-1's owners): updates ``v_row``, ``scale``, ``idx`` in place and
    returns ``sqrt(v_row)`` per row (column blocks, D21: per row and block, flat ``[rows * K]``), the full
    step's values (``eps``, ``bc1``, ``bc2`` are accepted for the signature of the kernels' state functions
    and unused: the state never depends on them)."""
    K = col_blocks_of(v_row)
    rsq = torch.empty(idx.numel() // slab, K, dtype=torch.float32, device=idx.device)
    for r0, r1, r, _, _ in _factored_chunks(grad, idx, scale, v_row, codebook, slab=slab, beta1=beta1,
                                            beta2=beta2, scale_block=scale_block):
        rsq[r0:r1] = r.view(r1 - r0, K)
    return rsq.view(-1)
