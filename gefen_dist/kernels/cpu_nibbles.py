"""The native CPU step of ``second_moment="nibbles"`` (D20): the ctypes wrapper of ``gefen_nibble_step``
(csrc/gefen_step.c), beside :mod:`gefen_dist.kernels.cpu` (the library, its argument structs and checks)."""
from __future__ import annotations

import ctypes
import math
import types

import torch

from ..core import nibbles as _nb
from . import cpu, cpu_build

__all__ = ["nibble_step_factored_"]

# the nearest-codeword table fields of _Args, which the one-byte layout's kernel does not read
_NO_TABLE = types.SimpleNamespace(mode=0, nb=1, h=1.0, ent=None)


def nibble_step_factored_(param, grad, code, scale, v_row, v_col, codebook, col_mean_sq, *, lr, beta1, beta2, eps,
                          weight_decay, bc1, bc2, scale_block, key, row0=0, row_block=0, bound=None,
                          update="fp32") -> None:
    """:func:`gefen_dist.core.nibbles.nibble_step_factored_eager_` (same contract, bitwise the same
    results: tests/test_nibbles.py) with the rows in the native kernel (D20); ``v_col``'s EMA and the
    column ratios before and after it in the eager path's torch operations. Falls back to the eager path
    when the native library is unavailable."""
    kw = dict(lr=lr, beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay, bc1=bc1, bc2=bc2,
              scale_block=scale_block, key=key, row0=row0, row_block=row_block, bound=bound, update=update)
    lib = cpu._lib(cpu_build.NATIVE)  # the faster build for this step where the two differ (cpu_build.py)
    n, S, B = param.numel(), v_col.shape[-1], int(scale_block)
    if lib is None or param.dtype not in (torch.float32, torch.bfloat16):
        _nb.nibble_step_factored_eager_(param, grad, code, scale, v_row, v_col, codebook, col_mean_sq, **kw)
        return
    if n:
        cpu._check("param", param, None, n)
    G = _nb.check_piece(param, grad, code, scale, v_row, v_col, col_mean_sq, scale_block=B, row_block=row_block,
                        update=update, grad_like_param=True)
    ratio_old, ratio_new = _nb.ratios_around_ema_(v_col, col_mean_sq, beta2)
    if n == 0:
        return
    a = cpu._make_args(param, n, S, B, _NO_TABLE, lr=lr, beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay,
                   bc1=bc1, bc2=bc2, bound=bound, simd=1)
    cb = codebook.to(torch.float32).contiguous()
    na = cpu._NibbleArgs(ratio_old.data_ptr(), ratio_new.data_ptr(), cb.data_ptr(), int(row0),
                     int(row_block) if G > 1 else int(row0) + n // S + 1, math.inf if bound is None else bound,
                     int(key) & 0xFFFFFFFF, int(update == "decoded"))
    rc = lib.gefen_nibble_step(ctypes.byref(a), ctypes.byref(na), param.data_ptr(), grad.data_ptr(),
                               code.data_ptr(), scale.data_ptr(), v_row.data_ptr())
    if rc != 0:  # (the sizes are checked above: 2 is out of memory, before anything was written)
        raise RuntimeError(f"gefen_nibble_step failed with code {rc}" + (" (out of memory)" if rc == 2 else ""))
    for t in (param, code, scale, v_row):
        torch.autograd.graph.increment_version(t)
