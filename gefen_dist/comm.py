"""The few collectives Gefen needs, behind one small interface.

Gefen communicates only when it learns (the first step with a nonzero gradient, and the first
gradient of a parameter added later): a MAX to agree on which tensors have a nonzero gradient,
an all-gather of period partials (:mod:`gefen_dist.core.periods`), a SUM of the codebook
histogram, and a one-time agreement check. Every rank enters every call, in the same order,
whatever it holds locally (an empty shard contributes zeros), or the job would deadlock.

:class:`LocalComm` is the single-process identity; :class:`ProcessGroupComm` wraps a
``torch.distributed`` process group (CPU tensors travel through gloo; for NCCL groups they
are moved to the current CUDA device).
"""
from __future__ import annotations

import hashlib
import logging
from typing import Any, List, Optional

import torch

logger = logging.getLogger(__name__)


class LocalComm:
    """One process: every collective is the identity."""

    world_size = 1
    rank = 0

    def all_reduce_sum_(self, t: torch.Tensor) -> torch.Tensor:
        return t

    def all_reduce_max_(self, t: torch.Tensor) -> torch.Tensor:
        return t

    def all_gather_object(self, obj: Any) -> List[Any]:
        return [obj]

    def check_agreement(self, what: str, payload: bytes) -> None:
        """Raise if ranks disagree about ``payload`` (no-op for one process)."""


class ProcessGroupComm(LocalComm):
    """Collectives on a ``torch.distributed`` process group (default: WORLD)."""

    def __init__(self, group: Optional[Any] = None):
        import torch.distributed as dist

        self._dist = dist
        self.group = group if group is not None else dist.group.WORLD
        self.world_size = dist.get_world_size(self.group)
        self.rank = dist.get_rank(self.group)
        self._device = torch.device("cpu")
        if dist.get_backend(self.group) == "nccl":
            self._device = torch.device("cuda", torch.cuda.current_device())

    def _reduce(self, t: torch.Tensor, op) -> torch.Tensor:
        buf = t.to(self._device)
        self._dist.all_reduce(buf, op=op, group=self.group)
        if buf is not t:
            t.copy_(buf)
        return t

    def all_reduce_sum_(self, t: torch.Tensor) -> torch.Tensor:
        return self._reduce(t, self._dist.ReduceOp.SUM)

    def all_reduce_max_(self, t: torch.Tensor) -> torch.Tensor:
        return self._reduce(t, self._dist.ReduceOp.MAX)

    def all_gather_object(self, obj: Any) -> List[Any]:
        out: List[Any] = [None] * self.world_size
        self._dist.all_gather_object(out, obj, group=self.group)
        return out

    def check_agreement(self, what: str, payload: bytes) -> None:
        digest = hashlib.sha256(payload).hexdigest()
        digests = self.all_gather_object(digest)
        if len(set(digests)) != 1:
            bad = [r for r, d in enumerate(digests) if d != digests[0]]
            raise RuntimeError(
                f"gefen_dist: ranks disagree about {what} (ranks {bad} differ from rank 0). "
                "Every rank must build Gefen over the same parameters in the same order and see "
                "gradients of the same global tensors; check that the model and param groups are "
                "identical on all ranks."
            )


def comm_for(process_group: Optional[Any]) -> LocalComm:
    """The comm for a process group: local when torch.distributed is not initialised."""
    try:
        import torch.distributed as dist
    except ImportError:  # pragma: no cover - torch without distributed
        return LocalComm()
    if process_group is None and not (dist.is_available() and dist.is_initialized()):
        return LocalComm()
    return ProcessGroupComm(process_group)
