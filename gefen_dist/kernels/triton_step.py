"""Fused GPU step for quantized tensors (Triton): the per-tensor entry points.

``quantized_step_`` has the signature and the math of
:func:`gefen_dist.core.step.quantized_step_eager_` and runs it in one kernel launch per call
(``quantized_step_factored_`` likewise for the factored second moment). The implementation is in
three modules beside this one:

* :mod:`~gefen_dist.kernels.triton_kernels`: the kernels (layout, numerics and the nearest-codeword
  lookup are described there);
* :mod:`~gefen_dist.kernels.triton_tables`: the codebook's device table, numerics flags, launch
  configuration and scalar arguments;
* :mod:`~gefen_dist.kernels.triton_multi`: many tensors per launch (:class:`MultiStep`,
  :class:`ColumnSums`, :class:`ColumnFactors`), the optimizer's CUDA path.
"""
from __future__ import annotations

from contextlib import nullcontext as _nullcontext
from typing import Optional

import torch

from .triton_kernels import _HAVE_TRITON, _interpret, _kernel, triton
from .triton_multi import ColumnFactors, ColumnSums, MultiStep, NibbleItem, StepItem, multi_launch_options
from .triton_nibbles import NibbleStep
from .triton_tables import _check, _config, _device_table, _step_scalars
from ..core.step import check_col_blocks, per_column_block

__all__ = ["available", "quantized_step_", "quantized_step_factored_", "StepItem", "MultiStep", "ColumnSums",
           "ColumnFactors", "multi_launch_options", "NibbleItem", "NibbleStep"]


def available(device: Optional[torch.device] = None) -> bool:
    """Whether the Triton kernel can run: triton importable and CUDA available (for ``device``
    when given), or ``TRITON_INTERPRET=1`` (CPU tensors through the Triton interpreter)."""
    if not _HAVE_TRITON:
        return False
    if _interpret():
        return True
    if device is not None and torch.device(device).type != "cuda":
        return False
    return torch.cuda.is_available()


# --------------------------------------------------------------------------------------
# the step
# --------------------------------------------------------------------------------------

def quantized_step_(
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
    bound: Optional[float] = None,
) -> None:
    """One Gefen update of a quantized piece, in place (Triton kernel; same contract as
    :func:`gefen_dist.core.step.quantized_step_eager_`). CUDA tensors, or CPU tensors with
    ``TRITON_INTERPRET=1``."""
    _launch(param, grad, idx, scale, v, codebook, lr=lr, beta1=beta1, beta2=beta2, eps=eps,
            weight_decay=weight_decay, bc1=bc1, bc2=bc2, period=period, scale_block=scale_block, bound=bound)


def quantized_step_factored_(
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
    block_size: Optional[int] = None,
    bound: Optional[float] = None,
) -> None:
    """Gefen update with a factored second moment, in place (Triton kernel; same contract as
    :func:`gefen_dist.core.step.quantized_step_factored_eager_`). The ``v_col`` EMA is two torch
    operations on the device, the column factors ``sqrt(v_col / mean(v_col))`` one launch
    (:class:`ColumnFactors`, the mean summed in its order), each row's ``v_row`` and its scale
    blocks the update kernel's, with no host synchronisation."""
    n = param.numel()
    S, B = v_col.shape[-1], int(scale_block)
    if B < 1 or S < 1 or S % B:
        raise ValueError(f"scale block {B} must divide the row length {S}")
    if n % S:
        raise ValueError(f"numel {n} is not a multiple of the row length {S}")
    G = v_col.numel() // S
    device = param.device
    _check("v_col", v_col, device, torch.float32, G * S)
    _check("col_mean_sq", col_mean_sq, device, torch.float32, G * S)
    if G > 1 and (row_block < 1 or row0 < 0 or row0 + n // S > G * row_block):
        raise ValueError(f"v_col has {G} row blocks: need row_block >= 1 and rows [{row0}, {row0 + n // S}) "
                         f"inside {G} x {row_block} rows")
    K = check_col_blocks(v_row, v_col, B)  # column blocks (D21)
    if n:
        _check("v_row", v_row, device, torch.float32, n // S * K)
    v_col.mul_(beta2).add_(col_mean_sq.view_as(v_col), alpha=1.0 - beta2)
    if n == 0:
        return
    rb = int(row_block) if G > 1 else row0 + n // S + 1  # one block: every row in block 0
    cf = per_column_block(lambda v: ColumnFactors([v], device).run()[0], K)(v_col)
    _run(param, grad, idx, scale, v_row, cf, codebook, S=S, B=B, mode=2, row0=int(row0), row_block=rb,
         lr=lr, beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay, bc1=bc1, bc2=bc2,
         block_size=block_size, bound=bound, col_blocks=K)


def _launch(param, grad, idx, scale, v, codebook, *, lr, beta1, beta2, eps, weight_decay, bc1,
            bc2, period, scale_block, block_size: Optional[int] = None, bound: Optional[float] = None) -> None:
    P, B = int(period), int(scale_block)
    if P < 1 or B < 1 or not (P == 1 or P == B):
        raise ValueError(f"need period == scale_block or period == 1 (got P={P}, B={B})")
    n = param.numel()
    if n % B or n % P:
        raise ValueError(f"numel {n} is not a multiple of the blocks (P={P}, B={B})")
    if n:
        _check("v", v, param.device, torch.float32, n // P)
    _run(param, grad, idx, scale, v, v, codebook, S=B, B=B, mode=1 if P == 1 else 0, row0=0, row_block=1,
         lr=lr, beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay, bc1=bc1, bc2=bc2,
         block_size=block_size, bound=bound)


def _run(param, grad, idx, scale, v, v_col, codebook, *, S, B, mode, row0, row_block, lr, beta1, beta2,
         eps, weight_decay, bc1, bc2, block_size, bound=None, col_blocks: int = 1) -> None:
    """Check the common arguments and launch the kernel over ``numel / S`` rows of ``S``."""
    n = param.numel()
    if n == 0:
        return
    if not _HAVE_TRITON:
        raise RuntimeError("triton is not importable")
    device = param.device
    if device.type != "cuda" and not _interpret():
        raise ValueError(f"the Triton step needs CUDA tensors (or TRITON_INTERPRET=1), got {device}")
    if param.dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"param dtype {param.dtype} not supported (float32, bfloat16)")
    _check("param", param, device, None, n)
    _check("grad", grad, device, param.dtype, n)
    _check("idx", idx, device, torch.uint8, n)
    _check("scale", scale, device, torch.float32, n // B)
    tab = _device_table(codebook, device)

    scalars, consts = _step_scalars(device, tab, lr=lr, beta1=beta1, beta2=beta2, eps=eps,
                                    weight_decay=weight_decay, bc1=bc1, bc2=bc2, bound=bound)
    nrows = n // S
    rows, bs, warps = _config(B, nrows, block_size)
    grid = (triton.cdiv(nrows, rows),)
    kern = _kernel()
    bf16 = param.dtype == torch.bfloat16
    # bfloat16 travels as int16 bits (converted by hand in the kernel)
    pk, gk = (param.view(torch.int16), grad.view(torch.int16)) if bf16 else (param, grad)
    ctx = torch.cuda.device(device) if device.type == "cuda" else _nullcontext()
    with ctx:
        kern[grid](
            pk, gk, idx, scale, v, v_col, tab.cb, tab.kernel_table(mode),
            nrows, S, B, S // B, float(B), float(S), tab.scan_steps, row0, row_block, *scalars,
            int(col_blocks), S // int(col_blocks), float(S // int(col_blocks)),
            MODE=mode, IS_BF16=bf16, ROWS=rows, BLOCK_SIZE=bs, COLB=col_blocks > 1, num_warps=warps,
            enable_fp_fusion=False, **consts,
        )
    for t in (param, idx, scale, v):
        torch.autograd.graph.increment_version(t)
