"""FSDP2 (``torch.distributed.fsdp.fully_shard``) helpers for Gefen.

* :func:`shard_model`: ``fully_shard`` each transformer block, then the root.
* :func:`build_optimizer`: Gefen over named parameters, weight decay on >=2-D tensors only.
* :func:`clip_grad_norm_`: the global gradient norm under FSDP2/HSDP/DDP, as a plain tensor.
* :func:`save_checkpoint` / :func:`load_checkpoint`: :mod:`gefen_dist.checkpoint` (DCP).

Gefen's state under FSDP2 is DTensors laid out like the parameters (see ``docs/checkpoints.md``),
so nothing else is needed: build the optimizer *after* sharding, over the sharded parameters.
"""
from __future__ import annotations

import logging
import math
from typing import Any, Dict, Iterable, List, Optional, Sequence, Tuple, Union

import torch
from torch import nn

from ..engine.layout import is_dtensor

logger = logging.getLogger(__name__)

__all__ = ["shard_model", "build_optimizer", "clip_grad_norm_", "save_checkpoint", "load_checkpoint",
           "default_mesh"]


def default_mesh():
    """A 1-D device mesh over the default process group (``cuda`` under NCCL, else ``cpu``)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    if not dist.is_initialized():
        raise RuntimeError("shard_model needs torch.distributed to be initialised (init_process_group)")
    backend = dist.get_backend()
    dev = "cuda" if ("nccl" in str(backend) and torch.cuda.is_available()) else "cpu"
    return init_device_mesh(dev, (dist.get_world_size(),))


def _mp_policy(mp_policy):
    from torch.distributed.fsdp import MixedPrecisionPolicy

    if mp_policy is None or mp_policy is False:
        return None
    if isinstance(mp_policy, MixedPrecisionPolicy):
        return mp_policy
    if mp_policy is True or mp_policy in ("bf16", "bfloat16", torch.bfloat16):
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    raise ValueError(f"mp_policy: expected a MixedPrecisionPolicy, True or 'bf16', got {mp_policy!r}")


def _blocks(model: nn.Module, block_types: Optional[Sequence[type]]) -> List[nn.Module]:
    if block_types:
        types = tuple(block_types)
        found = [m for m in model.modules() if isinstance(m, types) and m is not model]
    else:
        found = []
        for m in model.modules():
            if isinstance(m, nn.ModuleList):
                found.extend(m.children())
    # children before parents (fully_shard a parent after its sharded children), no duplicates
    seen, out = set(), []
    order = {id(m): i for i, m in enumerate(model.modules())}
    for m in sorted(found, key=lambda m: -order[id(m)]):
        if id(m) not in seen:
            seen.add(id(m))
            out.append(m)
    return out


def shard_model(model: nn.Module, mesh=None, block_types: Optional[Sequence[type]] = None,
                mp_policy: Union[None, bool, str, Any] = None, reshard_after_forward: bool = True) -> nn.Module:
    """Apply FSDP2 ``fully_shard`` to each block of ``model`` and then to the root; returns ``model``.

    Args:
        mesh: a 1-D mesh (FSDP) or a 2-D ``(replicate, shard)`` mesh (HSDP); default: 1-D over WORLD.
        block_types: module classes to shard individually (e.g. ``[TransformerBlock]``); default:
            every child of every ``nn.ModuleList``.
        mp_policy: a ``MixedPrecisionPolicy``, or ``True``/``"bf16"`` for bf16 compute with fp32
            gradient reduction. The sharded parameters (and Gefen's state) stay fp32.
        reshard_after_forward: passed to ``fully_shard`` (False trades memory for fewer all-gathers).
    """
    from torch.distributed.fsdp import fully_shard

    mesh = mesh if mesh is not None else default_mesh()
    kw: Dict[str, Any] = dict(mesh=mesh, reshard_after_forward=reshard_after_forward)
    mp = _mp_policy(mp_policy)
    if mp is not None:
        kw["mp_policy"] = mp
    blocks = _blocks(model, block_types)
    for b in blocks:
        fully_shard(b, **kw)
    fully_shard(model, **kw)
    logger.info("fully_shard: %d blocks + root on mesh %s", len(blocks), mesh)
    return model


def build_optimizer(model: nn.Module, lr: float = 1e-3, weight_decay: float = 0.0, **gefen_kwargs):
    """Gefen over ``model.named_parameters()``: weight decay on >=2-D parameters only.

    Build it after :func:`shard_model` (over the sharded parameters). Extra keyword arguments go
    to :class:`gefen_dist.Gefen` (``betas``, ``eps``, ``small_threshold``, ``process_group``...).
    """
    from ..optim.gefen import Gefen

    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        (decay if p.ndim >= 2 else no_decay).append((name, p))
    groups = []
    if decay:
        groups.append({"params": decay, "weight_decay": weight_decay})
    if no_decay:
        groups.append({"params": no_decay, "weight_decay": 0.0})
    if not groups:
        raise ValueError("build_optimizer: the model has no trainable parameters")
    return Gefen(groups, lr=lr, weight_decay=weight_decay, **gefen_kwargs)


# ----------------------------------------------------------------------------- gradient clipping
def _shard_dims(t) -> Tuple[int, ...]:
    """Mesh dims along which a DTensor is split (its pieces must be summed); Replicate dims are not."""
    from torch.distributed.tensor.placement_types import Partial, Replicate

    dims = []
    for i, pl in enumerate(t.placements):
        if isinstance(pl, Replicate):
            continue
        if isinstance(pl, Partial):
            raise RuntimeError("clip_grad_norm_: a gradient has a Partial placement; reduce it first")
        dims.append(i)  # Shard, _StridedShard and other splitting placements
    return tuple(dims)


@torch.no_grad()
def clip_grad_norm_(model_or_params: Union[nn.Module, Iterable[torch.Tensor], torch.Tensor], max_norm: float,
                    norm_type: float = 2.0, error_if_nonfinite: bool = False) -> torch.Tensor:
    """Clip gradients to a global norm ``max_norm``; returns the global norm (a plain tensor).

    Works on plain gradients (single process, DDP: already identical on every rank, so nothing is
    communicated) and on DTensor gradients (FSDP2, HSDP): each rank sums ``|g|^p`` over its local
    shards; the sums are all-reduced over the mesh dims along which the gradient is sharded, never
    over Replicate dims (HSDP replicas are not counted twice). The result is the same on every
    rank and equals ``torch.nn.utils.clip_grad_norm_`` of the unsharded model.
    """
    import torch.distributed as dist

    if isinstance(model_or_params, nn.Module):
        params = list(model_or_params.parameters())
    elif isinstance(model_or_params, torch.Tensor):
        params = [model_or_params]
    else:
        params = list(model_or_params)
    grads = [p.grad for p in params if p.grad is not None]
    norm_type = float(norm_type)
    inf = math.isinf(norm_type)
    plain_dev = None
    plain_acc = None
    # (mesh, shard dims) -> accumulator; insertion order is the parameter order, identical on all ranks
    groups: Dict[Tuple[int, Tuple[int, ...]], List[Any]] = {}
    for g in grads:
        if is_dtensor(g):
            loc = g._local_tensor
            key = (id(g.device_mesh), _shard_dims(g))
            if key not in groups:
                groups[key] = [g.device_mesh, key[1], torch.zeros((), dtype=torch.float64, device=loc.device)]
            acc = groups[key]
            acc[2] = _accumulate(acc[2], loc, norm_type, inf)
        else:
            if plain_acc is None:
                plain_dev = g.device
                plain_acc = torch.zeros((), dtype=torch.float64, device=g.device)
            plain_acc = _accumulate(plain_acc, g, norm_type, inf)
    parts = []
    for mesh, dims, acc in groups.values():
        for d in dims:
            pg = mesh.get_group(d)
            dist.all_reduce(acc, op=dist.ReduceOp.MAX if inf else dist.ReduceOp.SUM, group=pg)
        parts.append(acc)
    if plain_acc is not None:
        parts.append(plain_acc)
    if not parts:
        return torch.zeros(())
    dev = plain_dev if plain_dev is not None else parts[0].device
    parts = [x.to(dev) for x in parts]
    if inf:
        total = torch.stack(parts).max()
    else:
        total = torch.stack(parts).sum() ** (1.0 / norm_type)
    total = total.to(torch.float32)
    if error_if_nonfinite and not torch.isfinite(total):
        raise RuntimeError(f"The total norm of order {norm_type} for gradients is non-finite, so it cannot be "
                           "clipped. To disable this error, set error_if_nonfinite=False")
    coef = (float(max_norm) / (float(total) + 1e-6))
    if coef < 1.0:
        for g in grads:
            loc = g._local_tensor if is_dtensor(g) else g
            loc.mul_(coef)
    return total


def _accumulate(acc: torch.Tensor, g: torch.Tensor, p: float, inf: bool) -> torch.Tensor:
    if g.numel() == 0:
        return acc
    if inf:
        return torch.maximum(acc, g.detach().abs().max().to(torch.float64))
    n = torch.linalg.vector_norm(g.detach(), p, dtype=torch.float32).to(torch.float64)
    return acc + n ** p


# ----------------------------------------------------------------------------- checkpoints
def save_checkpoint(model: nn.Module, optimizer, checkpoint_id, extra: Optional[Dict[str, Any]] = None, **kw):
    """Sharded DCP checkpoint of model + Gefen (see :func:`gefen_dist.checkpoint.save`)."""
    from .. import checkpoint

    return checkpoint.save(model, optimizer, checkpoint_id, extra=extra, **kw)


def load_checkpoint(model: nn.Module, optimizer, checkpoint_id, extra: Optional[Dict[str, Any]] = None, **kw):
    """Load a DCP checkpoint at any world size (see :func:`gefen_dist.checkpoint.load`)."""
    from .. import checkpoint

    return checkpoint.load(model, optimizer, checkpoint_id, extra=extra, **kw)
