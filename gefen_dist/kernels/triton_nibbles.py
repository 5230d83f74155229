"""The GPU step of ``second_moment="nibbles"`` (D20; Triton): the math of
:func:`gefen_dist.core.nibbles.nibble_step_factored_eager_`, one launch per tensor
(:func:`nibble_step_factored_`) or per (dtype, tile) for many tensors (:class:`NibbleStep`, the optimizer's
multi-tensor batch), ``ROWS`` rows per program (:func:`_nibble_rows`, the code both run), each row swept in
power-of-two column chunks (any row length and scale block):

* sweep 0: the row's mean of ``g^2`` -> ``v_row`` (the old value kept for decoding);
* per scale block, sweep 1: ``m = lerp(C[code >> 4] M, g, 1 - beta1)``, its absmax (NaN-propagating);
* sweep 2: ``m`` again (the same operations, so the same bits), ``v = beta2 (v_row_old r_old) L[code & 15]
  + (1 - beta2) g^2``, both codes rounded stochastically with the uniforms of the element's global index
  (``lowbias32`` in 64-bit integer arithmetic masked to 32 bits, as the reference), the parameter.

Numerics as :mod:`gefen_dist.kernels.triton_kernels` (``enable_fp_fusion=False``; ``tl.fma`` where torch
fuses lerp and add(alpha); correctly rounded ``div_rn`` / ``sqrt_rn``). The row mean of ``g^2`` is summed
in another order than torch's reduction, so ``v_row`` can differ from the reference's in its last bit,
and with it, rarely, a second-moment code whose draw lies within an ulp of its fraction; scales and the
first moment's codes never depend on it (tests/test_triton_nibbles.py, through the interpreter).
"""
from __future__ import annotations

import threading
from contextlib import nullcontext as _nullcontext
from typing import Optional

import torch

from ..core.nibbles import KEY_STEP
from ..core.nibbles import step_key as _nb_step_key
from . import triton_kernels as _tk
from .triton_kernels import _HAVE_TRITON, _interpret, tl, triton
from .triton_tables import _check, _fma_flags, update_scalars

__all__ = ["nibble_step_factored_", "NibbleStep", "nibble_config"]


def _hash32(x):
    """lowbias32 of int64 ``x`` (values in [0, 2^32)), in int64 arithmetic masked to 32 bits."""
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & 0xFFFFFFFF
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & 0xFFFFFFFF
    return x ^ (x >> 16)


def _round16(x, lv_ptr, u):
    """The code of ``x`` over the 16 ascending levels at ``lv_ptr`` (core.nibbles.round_stochastic)."""
    j = tl.zeros(x.shape, dtype=tl.int32)
    for k in tl.static_range(1, 15):
        j += (tl.load(lv_ptr + k) <= x).to(tl.int32)
    lo = tl.load(lv_ptr + j)
    f = tl.div_rn(x - lo, tl.load(lv_ptr + j + 1) - lo)
    f = tl.where(f < 0.0, 0.0, f)  # comparisons are false for NaN: a NaN fraction stays NaN
    f = tl.where(f > 1.0, 1.0, f)
    return j + (u < f).to(tl.int32)


def _m_of(g, c, cb_ptr, Mb, lerp_c, LERP_SMALL: tl.constexpr, FUSED_LERP: tl.constexpr):
    """``lerp(C[c >> 4] * M, g, 1 - beta1)`` as torch computes it."""
    m0 = tl.load(cb_ptr + (c >> 4)) * Mb
    d = g - m0
    base = m0 if LERP_SMALL else g
    if FUSED_LERP:
        return tl.fma(d, lerp_c, base)
    return base + d * lerp_c


def _nibble_kernel(
    p_ptr, g_ptr, code_ptr, scale_ptr, vrow_ptr, ro_ptr, rn_ptr, cb_ptr, lv_ptr,
    nrows, S, B, NBLK, S_f, row0, row_block, key,
    lerp_c, beta2, alpha2, sqrt_bc2, eps, inv_bc1, lr, decay, ubound,
    LERP_SMALL: tl.constexpr, FUSED_LERP: tl.constexpr, FUSED_AXPY: tl.constexpr, HAS_WD: tl.constexpr,
    IS_BF16: tl.constexpr, DECODED: tl.constexpr, ROWS: tl.constexpr, BLOCK_SIZE: tl.constexpr,
):
    """One tensor per launch: program ``pid`` steps rows ``pid * ROWS ..`` (:func:`_nibble_rows`)."""
    _nibble_rows_jit(p_ptr, g_ptr, code_ptr, scale_ptr, vrow_ptr, ro_ptr, rn_ptr, cb_ptr, lv_ptr,
                     tl.program_id(0) * ROWS, nrows, S, B, NBLK, S_f, row0, row_block, key,
                     lerp_c, beta2, alpha2, sqrt_bc2, eps, inv_bc1, lr, decay, ubound,
                     LERP_SMALL, FUSED_LERP, FUSED_AXPY, HAS_WD, IS_BF16, DECODED, ROWS, BLOCK_SIZE)


_META = tl.constexpr(12) if _HAVE_TRITON else 12  # int64 fields per tensor of the multi-tensor table (NibbleStep)
# the step's multiplier in core.nibbles.step_key, for the capturable kernel's key from the device step
_KEY_STEP = tl.constexpr(KEY_STEP) if _HAVE_TRITON else KEY_STEP


def _nibble_multi_kernel(
    meta_ptr, gptr_ptr, prog_ptr, cb_ptr, lv_ptr, hp_ptr, step_ptr, step_key_part,
    lerp_c, beta2, alpha2, sqrt_bc2, eps, inv_bc1, lr, decay, ubound,
    LERP_SMALL: tl.constexpr, FUSED_LERP: tl.constexpr, FUSED_AXPY: tl.constexpr, HAS_WD: tl.constexpr,
    IS_BF16: tl.constexpr, DECODED: tl.constexpr, ROWS: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    DEVICE_HP: tl.constexpr = False,
):
    """Many tensors per launch: program ``pid`` steps rows ``prog[pid, 1] ..`` of tensor ``prog[pid, 0]``,
    whose pointers and sizes are row ``t`` of ``meta`` (:class:`NibbleStep`: parameter, codes, scales,
    ``v_row``, the column ratios before / after the EMA, rows, ``S``, ``B``, first global row, rows per row
    block, the tensor's part of the key) and whose gradient's address is ``gptr[t]``; the key of its draws
    is ``step_key_part + meta[t, 11]`` modulo 2^32 (:func:`gefen_dist.core.nibbles.step_key`).

    ``DEVICE_HP`` (``capturable=True``): the scalars that change from step to step are read from the
    device, ``hp_ptr`` = (skip, sqrt(bc2), 1 / bc1, lr, 1 - lr wd, bound) in float32 (as the default's
    multi-tensor kernel reads them), and the step number from ``step_ptr`` (the launch group's float32
    step count, after this step's increment), whose part of the key replaces ``step_key_part``; a
    non-zero ``skip`` masks every row, so the launch changes nothing. Otherwise neither is read."""
    pid = tl.program_id(0)
    t = tl.load(prog_ptr + 2 * pid)
    r_first = tl.load(prog_ptr + 2 * pid + 1).to(tl.int32)
    mb = meta_ptr + t * _META
    p_ptr, g_ptr = _tk._table_ptrs_jit(mb, gptr_ptr, t, IS_BF16)
    S = tl.load(mb + 7).to(tl.int32)
    B = tl.load(mb + 8).to(tl.int32)
    nrows = tl.load(mb + 6).to(tl.int32)
    if DEVICE_HP:
        nrows, sqrt_bc2, inv_bc1, lr, decay, ubound = _tk._device_scalars_jit(hp_ptr, nrows)
        key = (tl.load(mb + 11) + ((tl.load(step_ptr).to(tl.int64) * _KEY_STEP) & 0xFFFFFFFF)) & 0xFFFFFFFF
    else:
        key = (tl.load(mb + 11) + step_key_part) & 0xFFFFFFFF
    _nibble_rows_jit(p_ptr, g_ptr, tl.load(mb + 1).to(tl.pointer_type(tl.uint8)),
                     tl.load(mb + 2).to(tl.pointer_type(tl.float32)), tl.load(mb + 3).to(tl.pointer_type(tl.float32)),
                     tl.load(mb + 4).to(tl.pointer_type(tl.float32)), tl.load(mb + 5).to(tl.pointer_type(tl.float32)),
                     cb_ptr, lv_ptr, r_first, nrows, S, B, S // B, S.to(tl.float32),
                     tl.load(mb + 9).to(tl.int32), tl.load(mb + 10).to(tl.int32), key,
                     lerp_c, beta2, alpha2, sqrt_bc2, eps, inv_bc1, lr, decay, ubound,
                     LERP_SMALL, FUSED_LERP, FUSED_AXPY, HAS_WD, IS_BF16, DECODED, ROWS, BLOCK_SIZE)


def _nibble_rows(
    p_ptr, g_ptr, code_ptr, scale_ptr, vrow_ptr, ro_ptr, rn_ptr, cb_ptr, lv_ptr,
    r_first, nrows, S, B, NBLK, S_f, row0, row_block, key,
    lerp_c, beta2, alpha2, sqrt_bc2, eps, inv_bc1, lr, decay, ubound,
    LERP_SMALL: tl.constexpr, FUSED_LERP: tl.constexpr, FUSED_AXPY: tl.constexpr, HAS_WD: tl.constexpr,
    IS_BF16: tl.constexpr, DECODED: tl.constexpr, ROWS: tl.constexpr, BLOCK_SIZE: tl.constexpr,
):
    """Rows ``r_first .. r_first + ROWS - 1`` of one tensor (the module docstring's three sweeps)."""
    rows = r_first + tl.arange(0, ROWS)
    rmask = rows < nrows
    rbase = rows.to(tl.int64) * S
    grow = (rows + row0).to(tl.int64)  # global rows: the random numbers' index and the row block
    cols0 = tl.arange(0, BLOCK_SIZE)

    # ---- sweep 0: the row's mean of g^2 -> v_row --------------------------------------------
    ss = tl.zeros([ROWS, BLOCK_SIZE], dtype=tl.float32)
    for c0 in range(0, S, BLOCK_SIZE):
        cols = c0 + cols0
        mask = rmask[:, None] & (cols < S)[None, :]
        g = _tk._load_f32_jit(g_ptr, rbase[:, None] + cols[None, :], mask, IS_BF16)
        ss += g * g
    r = tl.div_rn(tl.sum(ss, axis=1), S_f)
    vr_old = tl.load(vrow_ptr + rows, mask=rmask, other=0.0)
    vt = vr_old * beta2
    if FUSED_AXPY:
        vr_new = tl.fma(r, alpha2, vt)
    else:
        vr_new = vt + r * alpha2
    tl.store(vrow_ptr + rows, vr_new, mask=rmask)
    cfbase = (grow // row_block) * S  # this row's block of rows (D12) in the column ratios

    for kb in range(0, NBLK):
        bbase = rbase + kb * B
        srow = rows.to(tl.int64) * NBLK + kb
        Mb = tl.load(scale_ptr + srow, mask=rmask, other=0.0)[:, None]

        # ---- sweep 1: the absmax of m (NaN-propagating) -----------------------------------
        amax = tl.zeros([ROWS, BLOCK_SIZE], dtype=tl.float32)
        for c0 in range(0, B, BLOCK_SIZE):
            cols = c0 + cols0
            mask = rmask[:, None] & (cols < B)[None, :]
            offs = bbase[:, None] + cols[None, :]
            g = _tk._load_f32_jit(g_ptr, offs, mask, IS_BF16)
            c = tl.load(code_ptr + offs, mask=mask, other=0).to(tl.int32)
            m = _m_of_jit(g, c, cb_ptr, Mb, lerp_c, LERP_SMALL, FUSED_LERP)
            am = tl.where(mask, tl.abs(m), 0.0)
            amax = tl.where((am > amax) | (am != am), am, amax)
        bad = amax != amax
        A = tl.max(tl.where(bad, 0.0, amax), axis=1)
        nan_sum = tl.sum(tl.where(bad, amax, 0.0), axis=1)  # NaN where any m is NaN, else 0
        A = tl.where(nan_sum != nan_sum, nan_sum, A)
        tl.store(scale_ptr + srow, A, mask=rmask)
        pos = (A > 0.0)[:, None]
        Ad = tl.where(A > 0.0, A, 1.0)[:, None]
        Ab = A[:, None]

        # ---- sweep 2: both codes, the parameter --------------------------------------------
        for c0 in range(0, B, BLOCK_SIZE):
            cols = c0 + cols0
            mask = rmask[:, None] & (cols < B)[None, :]
            offs = bbase[:, None] + cols[None, :]
            g = _tk._load_f32_jit(g_ptr, offs, mask, IS_BF16)
            c = tl.load(code_ptr + offs, mask=mask, other=0).to(tl.int32)
            m = _m_of_jit(g, c, cb_ptr, Mb, lerp_c, LERP_SMALL, FUSED_LERP)
            ccol = kb * B + cols
            ro = tl.load(ro_ptr + cfbase[:, None] + ccol[None, :], mask=mask, other=0.0)
            rn = tl.load(rn_ptr + cfbase[:, None] + ccol[None, :], mask=mask, other=0.0)
            v0 = (vr_old[:, None] * ro) * tl.load(lv_ptr + (c & 15))
            if FUSED_AXPY:
                v = tl.fma(g * g, alpha2, v0 * beta2)
            else:
                v = v0 * beta2 + (g * g) * alpha2
            gi = grow[:, None] * S + ccol[None, :]  # the element's global index (int64)
            k = _hash32_jit((key + (gi >> 32) * 0x9E3779B1) & 0xFFFFFFFF)
            h = _hash32_jit((gi & 0xFFFFFFFF) ^ k)
            um = (h >> 16).to(tl.float32) * (1.0 / 65536.0)
            uv = (h & 0xFFFF).to(tl.float32) * (1.0 / 65536.0)
            mc = _round16_jit(tl.where(pos, tl.div_rn(m, Ad), 0.0), cb_ptr, um)
            fn = vr_new[:, None] * rn
            vc = _round16_jit(tl.where(fn > 0.0, tl.div_rn(v, tl.where(fn > 0.0, fn, 1.0)), 0.0), lv_ptr, uv)
            tl.store(code_ptr + offs, ((mc << 4) | vc).to(tl.uint8), mask=mask)
            if DECODED:
                m = tl.load(cb_ptr + mc) * Ab
                v = fn * tl.load(lv_ptr + vc)
            sg = tl.div_rn(1.0, tl.div_rn(tl.sqrt_rn(v), sqrt_bc2) + eps) * inv_bc1
            u = m * sg
            u = tl.where(u > ubound, ubound, tl.where(u < -ubound, -ubound, u))  # NaN stays NaN
            _tk._update_param_jit(p_ptr, offs, mask, u * lr, decay, HAS_WD, IS_BF16)


def nibble_config(B: int, block_size: Optional[int] = None):
    """(ROWS, BLOCK_SIZE, num_warps) of a launch over scale blocks of ``B``: column chunks of the power
    of two at or above ``B`` up to 256, rows filling 128 elements (one row of a 256 chunk), 4 warps. Larger
    tiles spill on sm_90 (8 x 256: 255 registers and 120 spill stores; 8 x 32 and 4 x 64: one each); the
    shipped ones do not (tests/test_triton_sm90.py)."""
    bs = block_size or min(1 << max(0, int(B) - 1).bit_length(), 256)
    return max(1, 128 // bs), bs, 4


_lock = threading.Lock()
_cache = {}
_hash32_jit = _round16_jit = _m_of_jit = _nibble_rows_jit = None


def _kernel(name: str = "step"):
    """The jit-wrapped kernel ``name`` (``"step"``: one tensor per launch, ``"multi"``: many) compiled, or
    interpreted under TRITON_INTERPRET=1, with the helpers it calls bound to their module-level names
    (triton_kernels' own helpers bound there first)."""
    interp = _interpret()
    _tk._kernel("step")  # binds _load_f32_jit / _update_param_jit in triton_kernels for this mode
    with _lock:
        hit = _cache.get(interp)
        if hit is None:
            hit = _cache[interp] = (triton.jit(_hash32), triton.jit(_round16), triton.jit(_m_of),
                                    triton.jit(_nibble_rows),
                                    {"step": triton.jit(_nibble_kernel), "multi": triton.jit(_nibble_multi_kernel)})
        g = globals()
        g["_hash32_jit"], g["_round16_jit"], g["_m_of_jit"], g["_nibble_rows_jit"] = hit[:4]
        return hit[4][name]


def nibble_step_factored_(param, grad, code, scale, v_row, v_col, codebook, col_mean_sq, *, lr, beta1, beta2, eps,
                          weight_decay, bc1, bc2, scale_block, key, row0=0, row_block=0, bound=None,
                          update="fp32", block_size: Optional[int] = None) -> None:
    """:func:`gefen_dist.core.nibbles.nibble_step_factored_eager_` on CUDA tensors (or CPU tensors under
    ``TRITON_INTERPRET=1``), one launch; ``v_col``'s EMA and the column ratios before and after it in the
    reference's torch operations on the device, with no host synchronisation."""
    from ..core import nibbles as _nb

    if not _HAVE_TRITON:
        raise RuntimeError("triton is not importable")
    n, S, B = param.numel(), v_col.shape[-1], int(scale_block)
    device = param.device
    if device.type != "cuda" and not _interpret():
        raise ValueError(f"the Triton step needs CUDA tensors (or TRITON_INTERPRET=1), got {device}")
    if param.dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"param dtype {param.dtype} not supported (float32, bfloat16)")
    if n:
        _check("param", param, device, None, n)
    G = _nb.check_piece(param, grad, code, scale, v_row, v_col, col_mean_sq, scale_block=B, row_block=row_block,
                        update=update, grad_like_param=True)
    ratio_old, ratio_new = _nb.ratios_around_ema_(v_col, col_mean_sq, beta2)
    if n == 0:
        return
    scalars, consts = _launch_scalars(device, lr=lr, beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay,
                                      bc1=bc1, bc2=bc2, bound=bound, update=update)
    nrows = n // S
    rows, bs, warps = nibble_config(B, block_size)
    rb = int(row_block) if G > 1 else int(row0) + nrows + 1
    bf16 = param.dtype == torch.bfloat16
    pk, gk = (param.view(torch.int16), grad.view(torch.int16)) if bf16 else (param, grad)
    ctx = torch.cuda.device(device) if device.type == "cuda" else _nullcontext()
    with ctx:
        _kernel()[(triton.cdiv(nrows, rows),)](
            pk, gk, code, scale, v_row, ratio_old, ratio_new, _codebook(codebook, device), _levels(device),
            nrows, S, B, S // B, float(S), int(row0), rb, int(key) & 0xFFFFFFFF, *scalars,
            IS_BF16=bf16, ROWS=rows, BLOCK_SIZE=bs, num_warps=warps, enable_fp_fusion=False, **consts,
        )
    for t in (param, code, scale, v_row):
        torch.autograd.graph.increment_version(t)


def _launch_scalars(device, *, lr, beta1, beta2, eps, weight_decay, bc1, bc2, bound, update):
    """The float scalars of a launch (lerp_c .. ubound, as torch rounds them) and its step constexprs
    (the fused forms of this device's lerp / add(alpha), weight decay, the update rule)."""
    import numpy as np

    w = 1.0 - beta1
    small = abs(w) < 0.5
    wf = np.float32(w)
    fused_lerp, fused_axpy = _fma_flags(device, small)
    sqrt_bc2, eps32, inv_bc1, lr32, decay, ubound = update_scalars(lr=lr, eps=eps, weight_decay=weight_decay,
                                                                   bc1=bc1, bc2=bc2, bound=bound)
    scalars = (float(wf) if small else float(wf - np.float32(1.0)), float(np.float32(beta2)),
               float(np.float32(1.0 - beta2)), sqrt_bc2, eps32, inv_bc1, lr32, decay, ubound)
    consts = dict(LERP_SMALL=small, FUSED_LERP=fused_lerp, FUSED_AXPY=fused_axpy, HAS_WD=(weight_decay != 0.0),
                  DECODED=(update == "decoded"))
    return scalars, consts


def _codebook(codebook: torch.Tensor, device) -> torch.Tensor:
    return codebook.to(device=device, dtype=torch.float32).contiguous()


def _levels(device) -> torch.Tensor:
    """``core.nibbles.V_LEVELS`` on ``device`` (the per-tensor launch makes them per call, as before;
    :class:`NibbleStep` once, at construction)."""
    from ..core import nibbles as _nb

    return torch.tensor(_nb.V_LEVELS, dtype=torch.float32, device=device)


# ptxas's own choice for the multi-tensor kernel spilled one register (an 8-byte stack frame) in the tiles of 128 and
# 256 columns; a register ceiling stated explicitly gives 56-88 registers and no spill in every tile nibble_config
# picks (benchmarks/triton_sm90.py compile_nibbles_multi, sm_90; tests/test_triton_sm90.py).
_MULTI_MAXNREG = 128


class NibbleStep:
    """The ``second_moment="nibbles"`` update (D20) of many tensors with one launch per (dtype, tile
    configuration) of :func:`_nibble_multi_kernel`: each row's work as in :func:`nibble_step_factored_`'s
    launch (the same tile, :func:`nibble_config`), so each tensor's result is bitwise its own launch's
    given the same column ratios. Built once for a fixed set of :class:`~gefen_dist.kernels.triton_multi.NibbleItem`
    (their state tensors must stay in place); :meth:`run` takes this step's gradients and step number (the
    keys are computed on the device: no table copied per step)."""

    def __init__(self, items, device: torch.device):
        from .triton_tables import _GradTable, _pinned_to

        self.device = torch.device(device)
        self.items = list(items)
        buckets = {}
        for i, it in enumerate(self.items):
            it.check(i)
            if it.param.numel():
                buckets.setdefault((it.param.dtype == torch.bfloat16,) + nibble_config(it.B), []).append(i)
        self._touched = [t for it in self.items for t in (it.param, it.code, it.scale, it.v_row)]
        self._lv = _levels(self.device)
        self._launches = []
        for (bf16, rows, bs, warps), members in buckets.items():
            meta, prog = [], []
            for t, i in enumerate(members):
                it = self.items[i]
                nrows = it.param.numel() // it.S
                meta.append([it.param.data_ptr(), it.code.data_ptr(), it.scale.data_ptr(), it.v_row.data_ptr(),
                             it.ratio_old.data_ptr(), it.ratio_new.data_ptr(), nrows, it.S, it.B, it.row0, it.rb,
                             _nb_step_key(0, 0, it.index)])  # the tensor's part of step_key
                prog += [[t, r] for r in range(0, nrows, rows)]
            self._launches.append(dict(bf16=bf16, rows=rows, bs=bs, warps=warps, members=members,
                                       meta=_pinned_to(meta, self.device), prog=_pinned_to(prog, self.device),
                                       nprog=len(prog), grads=_GradTable(self.device)))

    @property
    def launches(self) -> int:
        return len(self._launches)

    def run(self, grads, codebook: torch.Tensor, step, *, lr, beta1: float, beta2: float, eps: float,
            weight_decay: float, bc1, bc2, bound=None, update: str = "fp32", hp: Optional[torch.Tensor] = None) -> None:
        """Step ``step`` of every item: ``grads[i]`` (contiguous, the item's dtype and size) for item ``i``,
        its draws keyed by ``step_key(0, step, index)``; ``codebook`` the 16 first-moment codewords. With
        ``hp`` (``capturable=True``: float32 on the device, filled by
        :func:`~gefen_dist.kernels.triton_tables.device_step_scalars`) ``step`` is the launch group's step
        count on the device, and the kernel reads it, lr, the bias corrections, the bound and the skip
        flag there (``lr``, ``bc1``, ``bc2`` and ``bound``, tensors then, are not read on the host)."""
        if not self._launches:
            return
        if hp is not None:  # placeholders for the scalars the kernel reads from hp
            lr, bc1, bc2, bound = 0.0, 1.0, 1.0, None
        scalars, consts = _launch_scalars(self.device, lr=lr, beta1=beta1, beta2=beta2, eps=eps,
                                          weight_decay=weight_decay, bc1=bc1, bc2=bc2, bound=bound, update=update)
        cb, lv = _codebook(codebook, self.device), self._lv
        step_part = 0 if hp is not None else _nb_step_key(0, step, 0)  # the step's part of every tensor's key
        hp_t = cb if hp is None else hp  # (not read without DEVICE_HP)
        step_t = cb if hp is None else step
        kern = _kernel("multi")
        ctx = torch.cuda.device(self.device) if self.device.type == "cuda" else _nullcontext()
        with ctx:
            for L in self._launches:
                gs = [grads[i] for i in L["members"]]
                kern[(L["nprog"],)](L["meta"], L["grads"](gs), L["prog"], cb, lv, hp_t, step_t, step_part, *scalars,
                                    IS_BF16=L["bf16"], ROWS=L["rows"], BLOCK_SIZE=L["bs"], num_warps=L["warps"],
                                    enable_fp_fusion=False, maxnreg=_MULTI_MAXNREG, DEVICE_HP=hp is not None,
                                    **consts)
        torch.autograd.graph.increment_version(self._touched)
