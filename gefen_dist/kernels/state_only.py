"""ZeRO-1's owners' state-only updates by a fused step (the native CPU kernel or the Triton one):
the kernel's own full step, run with ``lr = weight_decay = 0`` on a zero scratch parameter (which it
then leaves at zero), chunk by chunk of whole blocks or rows so that the scratch stays small (it
was the size of the owner's whole range). The state (``idx``, ``scale``, ``v`` / ``v_row``) never
depends on the parameter, the learning rate or the column profile, so it is bitwise the full
step's."""
from __future__ import annotations

from typing import Callable

import torch

__all__ = ["state_only_", "factored_state_only_"]


def state_only_(step: Callable, grad, idx, scale, v, codebook, *, period: int, scale_block: int, hp: dict,
                max_elems: int) -> None:
    """``step`` (a ``quantized_step_``) over chunks of whole blocks of at most ``max_elems`` elements;
    ``hp``: ``beta1``, ``beta2``, ``eps``, ``bc1``, ``bc2``."""
    P, n = int(period), idx.numel()
    chunk = max(P, (max_elems // P) * P)
    scratch = torch.zeros(min(n, chunk), dtype=grad.dtype, device=grad.device)
    for c0 in range(0, n, chunk):
        c1 = min(n, c0 + chunk)
        step(scratch[:c1 - c0], grad[c0:c1], idx[c0:c1], scale[c0 // P:c1 // P], v[c0 // P:c1 // P], codebook,
             lr=0.0, weight_decay=0.0, period=P, scale_block=scale_block, **hp)


def factored_state_only_(step: Callable, grad, idx, scale, v_row, codebook, *, slab: int, scale_block: int,
                         hp: dict, max_elems: int) -> None:
    """``step`` (a ``quantized_step_factored_``) over chunks of whole rows of ``slab`` elements (at
    most ``max_elems`` elements, at least one row), against a zero column profile (the row-local
    state does not read it); ``hp`` as :func:`state_only_`. A ``[rows, K]`` ``v_row`` (column blocks, D21) is
    cut by rows with the rest."""
    S, n = int(slab), idx.numel()
    K = int(v_row.shape[-1]) if v_row.dim() == 2 else 1
    rows, nb = n // S, S // int(scale_block)
    per = max(1, max_elems // S)
    zeros = torch.zeros(S, dtype=torch.float32, device=grad.device)
    scratch = torch.zeros(min(rows, per) * S, dtype=grad.dtype, device=grad.device)
    g, ix, sc, vr = grad.reshape(-1), idx.reshape(-1), scale.reshape(-1), v_row.reshape(-1, K) if K > 1 else v_row.reshape(-1)
    for r0 in range(0, rows, per):
        r1 = min(rows, r0 + per)
        step(scratch[:(r1 - r0) * S], g[r0 * S:r1 * S], ix[r0 * S:r1 * S], sc[r0 * nb:r1 * nb], vr[r0:r1],
             zeros.clone(), codebook, zeros, lr=0.0, weight_decay=0.0, scale_block=scale_block, **hp)
