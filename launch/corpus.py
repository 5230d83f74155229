"""Byte-level training corpus built from the running Python's standard-library sources.

The stdlib is a real, sizeable (~12 MB) text corpus that is present offline on every machine
that can run this project, so training runs need no download. The corpus is deterministic for a
given Python build: files are taken in sorted (POSIX) relative-path order and joined with a
separator; the last 5% of files form the validation split. ``info["sha256"]`` identifies the
exact bytes so that runs on different machines/Python versions can be told apart.
"""
from __future__ import annotations

import functools
import hashlib
import os
import sys
import sysconfig
from pathlib import Path, PurePosixPath

import numpy as np
import torch

SEPARATOR = b"\n\x00\n"
VAL_FRACTION = 0.05
# Directory names that are skipped anywhere in a relative path: third-party packages, the
# (huge, repetitive) regression-test suites and their data, bytecode caches.
EXCLUDED_DIRS = frozenset(
    {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"}
)


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def list_files(root: Path | None = None) -> list[str]:
    """Sorted POSIX-style relative paths of the ``*.py`` files of the corpus."""
    root = Path(root) if root is not None else stdlib_root()
    rels: list[str] = []
    for dirpath, dirnames, filenames in os.walk(root, followlinks=False):
        dirnames[:] = [d for d in dirnames if d not in EXCLUDED_DIRS]
        rel_dir = Path(dirpath).relative_to(root)
        for fn in filenames:
            if fn.endswith(".py"):
                rels.append(PurePosixPath(*rel_dir.parts, fn).as_posix())
    rels.sort()
    return rels


def _concat(root: Path, rels: list[str]) -> bytes:
    parts = []
    for rel in rels:
        parts.append((root / rel).read_bytes())
    return SEPARATOR.join(parts)


@functools.lru_cache(maxsize=4)
def _load(root_str: str) -> tuple[torch.Tensor, torch.Tensor, tuple]:
    root = Path(root_str)
    rels = list_files(root)
    if len(rels) < 20:
        raise RuntimeError(f"too few stdlib source files under {root} ({len(rels)})")
    n_val = max(1, int(round(len(rels) * VAL_FRACTION)))
    train_rels, val_rels = rels[:-n_val], rels[-n_val:]
    train_bytes = _concat(root, train_rels)
    val_bytes = _concat(root, val_rels)
    h = hashlib.sha256()
    h.update(train_bytes)
    h.update(b"\xff--val--\xff")
    h.update(val_bytes)
    train = torch.from_numpy(np.frombuffer(train_bytes, dtype=np.uint8).copy())
    val = torch.from_numpy(np.frombuffer(val_bytes, dtype=np.uint8).copy())
    info = {
        "source": "python-stdlib",
        "root": str(root),
        "python": sys.version.split()[0],
        "files": len(rels),
        "train_files": len(train_rels),
        "val_files": len(val_rels),
        "bytes": len(train_bytes) + len(val_bytes),
        "train_bytes": len(train_bytes),
        "val_bytes": len(val_bytes),
        "sha256": h.hexdigest(),
    }
    return train, val, tuple(sorted(info.items()))


def load_corpus(root: str | os.PathLike | None = None) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """Return ``(train, val, info)``: uint8 tensors of the concatenated bytes and metadata.

    The result is cached in memory (per root); the returned tensors are shared, do not modify.
    """
    root = Path(root) if root is not None else stdlib_root()
    train, val, info = _load(str(root.resolve()))
    return train, val, dict(info)


def _windows(data: torch.Tensor, offsets: torch.Tensor, context: int) -> tuple[torch.Tensor, torch.Tensor]:
    idx = offsets.view(-1, 1) + torch.arange(context + 1, dtype=torch.int64).view(1, -1)
    chunk = data[idx].to(torch.int64)
    return chunk[:, :-1].contiguous(), chunk[:, 1:].contiguous()


class Batches:
    """Deterministic random-window sampler: ``batch(step)`` depends only on (seed, step).

    Every step draws a *global* batch of ``batch_size * world_size`` windows from a generator
    seeded by (seed, step); rank ``r`` takes the contiguous block of rows
    ``[r*batch_size, (r+1)*batch_size)``. Hence one process with ``batch_size * world_size``
    rows sees exactly the union of what the ranks see, and resuming at step k reproduces the
    batches of an uninterrupted run.
    """

    def __init__(self, data: torch.Tensor, batch_size: int, context: int, seed: int,
                 rank: int = 0, world_size: int = 1):
        if data.dtype != torch.uint8 or data.dim() != 1:
            raise ValueError("data must be a 1-D uint8 tensor")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} out of range for world_size {world_size}")
        if data.numel() < context + 2:
            raise ValueError(f"data ({data.numel()} bytes) shorter than context+2 ({context + 2})")
        if not 0 <= seed < 2**31:
            raise ValueError("seed must be in [0, 2**31)")
        self.data = data
        self.batch_size = int(batch_size)
        self.context = int(context)
        self.seed = int(seed)
        self.rank = int(rank)
        self.world_size = int(world_size)

    @property
    def global_batch_size(self) -> int:
        return self.batch_size * self.world_size

    def _generator(self, step: int) -> torch.Generator:
        if step < 0:
            raise ValueError("step must be >= 0")
        g = torch.Generator(device="cpu")
        g.manual_seed((self.seed << 32) | (int(step) & 0xFFFFFFFF))
        return g

    def global_offsets(self, step: int) -> torch.Tensor:
        high = self.data.numel() - self.context - 1  # exclusive upper bound for a window start
        return torch.randint(0, high, (self.global_batch_size,), generator=self._generator(step),
                             dtype=torch.int64)

    def batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        offs = self.global_offsets(step)
        lo = self.rank * self.batch_size
        return _windows(self.data, offs[lo:lo + self.batch_size], self.context)

    __call__ = batch


def val_batches(n: int, batch_size: int, context: int,
                data: torch.Tensor | None = None) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``n`` fixed validation batches: windows at evenly spaced offsets across the val split."""
    if data is None:
        data = load_corpus()[1]
    total = n * batch_size
    high = data.numel() - context - 1
    if high <= 0:
        raise ValueError("validation data shorter than the context")
    offs = torch.linspace(0, high - 1, total, dtype=torch.float64).floor().to(torch.int64)
    return [_windows(data, offs[i * batch_size:(i + 1) * batch_size], context) for i in range(n)]
