"""What this rank holds of each global tensor, and the block geometry of its state.

Every backend reduces to the same picture: a parameter is a *global* tensor of shape ``S``;
this rank holds one contiguous piece ``[start, start+numel)`` of its row-major flattening
(the whole tensor for single process and DDP, whole dim-0 rows for FSDP2 ``Shard(0)`` and
ZeRO-1 ranges). The optimizer's math works on pieces; decisions (exact vs quantized, periods,
the codebook) are functions of the global tensor only, so they agree on every rank and at
every world size.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Sequence, Tuple

import torch

from ..core.periods import row_slab, scale_block_for

KIND_EXACT = "exact"
KIND_QUANTIZED = "quantized"


@dataclass(frozen=True)
class Geometry:
    """Block geometry of one tensor's state (a function of the global shape and period)."""

    kind: str
    global_shape: Tuple[int, ...]
    period: int = 1
    scale_block: int = 1

    @property
    def numel(self) -> int:
        return int(math.prod(self.global_shape))

    @property
    def slab(self) -> int:
        return row_slab(self.global_shape)

    @classmethod
    def exact(cls, shape: Sequence[int]) -> "Geometry":
        return cls(KIND_EXACT, tuple(int(s) for s in shape))

    @classmethod
    def quantized(cls, shape: Sequence[int], period: int) -> "Geometry":
        shape = tuple(int(s) for s in shape)
        slab = row_slab(shape)
        if slab % period:
            raise ValueError(f"period {period} does not divide the row length {slab} of shape {shape}")
        return cls(KIND_QUANTIZED, shape, int(period), scale_block_for(int(period), slab))

    def state_shapes(self, local_rows: int) -> dict:
        """Shapes of the state tensors for a piece of ``local_rows`` dim-0 rows."""
        if self.kind == KIND_EXACT:
            return {}
        rest = self.global_shape[1:]
        return {
            "idx": (local_rows, *rest),
            "scale": (local_rows, self.slab // self.scale_block),
            "v": (local_rows, self.slab // self.period),
        }

    def state_bytes_per_element(self) -> float:
        if self.kind == KIND_EXACT:
            return 8.0
        return 1.0 + 4.0 / self.scale_block + 4.0 / self.period


def is_exact(shape: Sequence[int], small_threshold: int) -> bool:
    """D2: 0-D/1-D tensors, zero-size tensors, tensors with fewer than ``small_threshold`` global
    elements, and tensors whose dim-0 rows hold one element (``(N, 1)``, ``(N, 1, 1)``) keep exact
    AdamW state. Blocks never span rows (D1), so a one-element row would hold its own fp32 scale and
    second moment besides its index: 9 B/param in every mode, more than AdamW's 8."""
    n = int(math.prod(shape))
    return len(shape) < 2 or n == 0 or n < small_threshold or one_element_rows(shape)


def one_element_rows(shape: Sequence[int]) -> bool:
    """A tensor of ``ndim >= 2`` whose dim-0 rows hold one element each (``(N, 1)``, ``(N, 1, 1)``):
    exact whatever its size (:func:`is_exact`)."""
    return len(shape) >= 2 and int(math.prod(shape[1:])) == 1


FEW_ROWS = 64  # below this many dim-0 rows a factored column profile costs more than 4/64 B/param


def few_rows(shape: Sequence[int]) -> bool:
    """A tensor of ``ndim >= 2`` with fewer than :data:`FEW_ROWS` dim-0 rows (``(1, N)``, a ViT
    position embedding ``(1, 197, 768)``, a two-class head ``(2, d)``). The factored second moment's
    column profile ``v_col`` holds one fp32 per column, ``4 / rows`` B/param (5.0 B/param in all for
    ``(1, N)``). Such tensors are factored like any other; the versions of D15 (withdrawn) kept them
    shared, and this tells their saved state apart (:func:`gefen_dist.engine.state.quantized_mode`)."""
    return len(shape) >= 2 and int(shape[0]) < FEW_ROWS


def global_shape(p: torch.Tensor) -> Tuple[int, ...]:
    """The global shape of a parameter, as the optimizer sees it (DeepSpeed ZeRO-3 partitions report
    ``ds_shape``). A complex parameter is stepped as its real view (``torch.view_as_real``, as
    ``torch.optim.AdamW`` does), so its shape gains a trailing 2."""
    ds_shape = getattr(p, "ds_shape", None)
    shape = tuple(int(s) for s in (ds_shape if ds_shape is not None else p.shape))
    return shape + (2,) if p.is_complex() else shape


@dataclass
class Piece:
    """This rank's piece of a global tensor: flat elements ``[start, start + local.numel())``.

    ``contributes`` is False on replicas that must not add to global statistics a second time
    (DDP ranks other than 0, HSDP replicas), so sums match a single process exactly.
    """

    local: torch.Tensor
    grad: Optional[torch.Tensor]
    start: int
    shape: Tuple[int, ...]
    contributes: bool = True

    @property
    def local_rows(self) -> int:
        slab = row_slab(self.shape)
        return self.local.numel() // slab if len(self.shape) >= 2 else self.local.numel()


class Ranges:
    """Fixed ranges ``[(start, end), ...]`` of a flat tensor of ``total`` elements, cut out of such a
    tensor by one ``split_with_sizes`` (one torch call, not a slice per range: a step cuts hundreds of
    them); ranges not in increasing order are sliced one by one."""

    def __init__(self, ranges: Sequence[Tuple[int, int]], total: int):
        self.ranges = list(ranges)
        self.cuts, pos = [], 0
        for a, b in self.ranges:
            if a < pos:
                self.cuts = None
                break
            self.cuts += (a - pos, b - a)
            pos = b
        else:
            self.cuts.append(total - pos)

    def of(self, t: torch.Tensor) -> list:
        """The ranges of flat tensor ``t`` (views)."""
        if not self.ranges:
            return []
        if self.cuts is None:
            return [t[a:b] for a, b in self.ranges]
        return list(torch.split_with_sizes(t, self.cuts)[1::2])


def is_dtensor(t: torch.Tensor) -> bool:
    return hasattr(t, "device_mesh") and hasattr(t, "placements") and hasattr(t, "_local_tensor")


def local_tensor(t: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """The rank-local data of a DTensor (or the tensor itself); a complex tensor as its real view
    (``torch.view_as_real``: the same storage, a trailing dimension of 2)."""
    if t is None:
        return None
    t = t._local_tensor if is_dtensor(t) else t
    return torch.view_as_real(t) if t.is_complex() else t


def check_supported(p: torch.Tensor, name: str) -> None:
    """Refuse layouts whose local piece is not a contiguous range of whole rows."""
    if type(p).__name__ == "FlatParameter" or getattr(p, "_is_flat_param", False):
        raise TypeError(
            f"parameter {name!r} is an FSDP1 FlatParameter: it concatenates and cuts many tensors, so "
            "per-tensor Gefen state cannot be kept. Use FSDP2 (torch.distributed.fsdp.fully_shard), "
            "DDP, gefen_dist.ZeroGefen or DeepSpeed instead."
        )
    if not is_dtensor(p):
        return
    if p.is_complex():
        raise TypeError(f"parameter {name!r} is a complex DTensor: gefen_dist steps complex parameters as their "
                        "real view on plain tensors only; shard torch.view_as_real(param) instead")
    from torch.distributed.tensor.placement_types import Partial, Replicate, Shard

    for pl in p.placements:
        if isinstance(pl, Replicate):
            continue
        if type(pl) is Shard and pl.dim == 0:
            continue
        if isinstance(pl, Partial):
            raise TypeError(f"parameter {name!r} has a Partial placement; reduce it before the optimizer step")
        desc = f"{type(pl).__name__.lstrip('_')}({pl.dim})" if hasattr(pl, "dim") else repr(pl)
        raise TypeError(
            f"parameter {name!r} has placement {desc} on mesh {p.device_mesh}: gefen_dist supports "
            "Shard(0) (FSDP2's default) and Replicate, whose pieces are whole rows. For FSDP2 drop "
            "shard_placement_fn (or return Shard(0)); tensor-parallel column sharding "
            "(Shard(d>0), _StridedShard) is not supported yet."
        )


def piece_of(p: torch.Tensor, rank: int = 0, replicated: bool = False) -> Piece:
    """The piece this rank holds of parameter ``p``.

    Plain tensors are whole (on several ranks, replicas: only rank 0 contributes to sums).
    DTensors with ``Shard(0)``/``Replicate`` placements hold whole rows starting at the global
    offset of their chunk; along replicate mesh dims only coordinate 0 contributes.
    """
    if not is_dtensor(p):
        return Piece(local=local_tensor(p), grad=local_tensor(p.grad), start=0, shape=global_shape(p),
                     contributes=(not replicated) or rank == 0)
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
    from torch.distributed.tensor.placement_types import Replicate

    shape = tuple(p.shape)
    _, offset = compute_local_shape_and_global_offset(shape, p.device_mesh, p.placements)
    coord = p.device_mesh.get_coordinate() or []
    contributes = all(c == 0 for c, pl in zip(coord, p.placements) if isinstance(pl, Replicate))
    start = int(offset[0]) * row_slab(shape) if shape else 0
    return Piece(local=p._local_tensor, grad=local_tensor(p.grad), start=start, shape=shape,
                 contributes=contributes)


def like_param(local: torch.Tensor, p: torch.Tensor, global_shape_: Sequence[int]) -> torch.Tensor:
    """Wrap a state tensor's local piece as a DTensor with ``p``'s mesh and placements and an
    explicit global shape/stride (uneven shards differ per rank), on ``local``'s device."""
    if not is_dtensor(p):
        return local
    from torch.distributed.tensor import DTensor

    shape = tuple(int(s) for s in global_shape_)
    stride = tuple(int(math.prod(shape[i + 1:])) for i in range(len(shape)))
    out = DTensor.from_local(local, p.device_mesh, p.placements, run_check=False, shape=shape, stride=stride)
    return out
