"""ZeRO-1 Gefen for DDP / torchrun users (D8): :class:`~gefen_dist.zero.optimizer.ZeroGefen`, its
partition and wire format (:mod:`.partition`), its step (:mod:`.step`) and its checkpoints
(:mod:`.checkpoint`)."""
from .optimizer import ZeroGefen  # noqa: F401

__all__ = ["ZeroGefen"]
