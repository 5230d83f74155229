"""Atomic, checksummed checkpoint files and directories (what :func:`gefen_dist.checkpoint.save`
commits and :func:`~gefen_dist.checkpoint.load` verifies; also used for single ``torch.save`` files)."""
from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import pickle
import shutil
import sys
from typing import Any, List, Optional

import torch

logger = logging.getLogger(__name__)

# ----------------------------------------------------------------------------- atomic files
# Every checkpoint gefen_dist writes is first written under a temporary name in the destination's
# directory (``.<name>.tmp-<pid>``), flushed and fsynced, then renamed over the destination
# (``os.replace``, atomic on POSIX), and the directory is fsynced. A process killed mid-save
# leaves the previous checkpoint as it was plus, at worst, a temporary that no reader looks at.
#
# Single files carry a SHA-256 of their bytes in the zip comment (torch.save files are zip
# archives; a comment is part of the format, and torch.load ignores it): :func:`load_file`
# checks it, so a truncated or corrupted file is reported instead of loading wrong numbers
# (torch.load alone loads a file with a flipped byte in tensor data silently). Directories (DCP)
# carry a manifest, ``gefen_manifest.json``, with the size and SHA-256 of every file.

CHECKSUM_TAG = b"gefen_dist-sha256:"
MANIFEST = "gefen_manifest.json"
_EOCD = b"PK\x05\x06"
_CHUNK = 1 << 22

__all__ = ["CheckpointCorruptError", "atomic_save", "load_file", "verify_file", "verify_dir",
            "temporary_path", "stale_temporaries", "recover_interrupted"]


class CheckpointCorruptError(ValueError):
    """A checkpoint file or directory is truncated, corrupted or incomplete; the message names
    the file and says what to do."""


def _what_to_do(path) -> str:
    return (f"Delete {os.fspath(path)!r} (or move it aside) and resume from an earlier checkpoint, or copy it "
            "again if it was transferred. gefen_dist only ever replaces a checkpoint by a complete one (write to a "
            "temporary, fsync, rename), so the damage happened after writing (disk, copy, truncation, or a "
            "writer that does not save atomically).")


def temporary_path(path, pid: Optional[int] = None) -> str:
    """The temporary name a writer of ``path`` uses: ``.<name>.tmp-<pid>`` in the same directory."""
    path = os.fspath(path).rstrip(os.sep)
    d, name = os.path.split(path)
    return os.path.join(d, f".{name}.tmp-{os.getpid() if pid is None else int(pid)}")


def stale_temporaries(path) -> List[str]:
    """Temporaries (files or directories) that interrupted writers of ``path`` left behind
    (``.<name>.tmp-*`` and ``.<name>.old-*`` siblings); nothing ever reads them."""
    path = os.fspath(path).rstrip(os.sep)
    d, name = os.path.split(path)
    d = d or "."
    try:
        entries = os.listdir(d)
    except FileNotFoundError:
        return []
    pre = (f".{name}.tmp-", f".{name}.old-")
    return sorted(os.path.join(d, e) for e in entries if e.startswith(pre))


def _fsync_dir(d) -> None:
    try:
        fd = os.open(os.fspath(d) or ".", os.O_RDONLY)
    except OSError:  # pragma: no cover - platforms without directory fds
        return
    try:
        os.fsync(fd)
    except OSError:  # pragma: no cover
        pass
    finally:
        os.close(fd)


class _HashingWriter:
    """File-like object for ``torch.save``: writes through to ``f`` and hashes what passes."""

    def __init__(self, f):
        self.f = f
        self.h = hashlib.sha256()
        self.n = 0

    def write(self, b) -> int:
        mv = memoryview(b).cast("B")
        self.h.update(mv)
        self.n += len(mv)
        return self.f.write(mv)

    def flush(self) -> None:
        self.f.flush()


def atomic_save(obj: Any, path, *, checksum: bool = True) -> None:
    """``torch.save(obj, path)`` atomically: write ``.<name>.tmp-<pid>`` next to ``path``, fsync it,
    rename it over ``path`` and fsync the directory. With ``checksum`` (default) the file's SHA-256
    is stored in its zip comment, checked by :func:`load_file`. Plain ``torch.load`` reads the file."""
    path = os.fspath(path)
    tmp = temporary_path(path)
    try:
        with open(tmp, "w+b") as f:
            w = _HashingWriter(f)
            torch.save(obj, w)
            f.flush()
            if checksum:
                _append_checksum(f, tmp, w)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    _fsync_dir(os.path.dirname(path))


def _append_checksum(f, tmp: str, w: _HashingWriter) -> None:
    f.flush()
    f.seek(w.n - 22)
    eocd = f.read(22)
    if len(eocd) != 22 or eocd[:4] != _EOCD or eocd[20:22] != b"\x00\x00":
        logger.warning("%s: unexpected torch.save layout (no plain zip end record); written without a checksum", tmp)
        f.seek(0, os.SEEK_END)
        return
    comment = CHECKSUM_TAG + w.h.hexdigest().encode()
    f.seek(w.n - 2)
    f.write(len(comment).to_bytes(2, "little"))
    f.seek(0, os.SEEK_END)
    f.write(comment)


def verify_file(path) -> bool:
    """Check a file written by :func:`atomic_save`: ``True`` when its checksum matches, ``False``
    when it has none (written by something else: nothing to check). Raises
    :class:`CheckpointCorruptError` when it is truncated or its bytes changed."""
    path = os.fspath(path)
    size = os.path.getsize(path)
    n = len(CHECKSUM_TAG) + 64
    with open(path, "rb") as f:
        f.seek(max(0, size - n - 22))
        tail = f.read()
        if not tail[-n:].startswith(CHECKSUM_TAG):
            at = tail.rfind(_EOCD)
            if at >= 0 and at + 22 <= len(tail) and int.from_bytes(tail[at + 20:at + 22], "little") == n:
                raise CheckpointCorruptError(  # our zip comment, cut short
                    f"checkpoint file {path!r} is truncated (its checksum record is incomplete). " + _what_to_do(path))
            return False  # no checksum (or a damaged end, which torch.load reports)
        want = tail[-64:].decode("ascii", "replace")
        body = size - n  # bytes before the comment; the last 2 are the comment length (0 when hashed)
        f.seek(0)
        h = hashlib.sha256()
        left = body - 2
        while left > 0:
            b = f.read(min(_CHUNK, left))
            if not b:
                break
            h.update(b)
            left -= len(b)
        h.update(b"\x00\x00")
    if h.hexdigest() != want:
        raise CheckpointCorruptError(
            f"checkpoint file {path!r} is corrupted: its SHA-256 does not match the one written with it. "
            + _what_to_do(path))
    return True


def load_file(path, *, map_location: Any = "cpu", weights_only: bool = True, verify: bool = True) -> Any:
    """``torch.load`` a checkpoint file after :func:`verify_file` (when ``verify``); any failure to
    read it becomes a :class:`CheckpointCorruptError` naming the file and what to do.
    ``weights_only=False`` unpickles arbitrary objects: only for files you trust."""
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"no checkpoint file {path!r}")
    if verify:
        verify_file(path)
    try:
        return torch.load(path, map_location=map_location, weights_only=weights_only)
    except (RuntimeError, EOFError, pickle.UnpicklingError, ValueError, KeyError, IndexError,
            ModuleNotFoundError, AttributeError, OSError) as e:
        if isinstance(e, (PermissionError, FileNotFoundError, IsADirectoryError)):
            raise
        if isinstance(e, pickle.UnpicklingError) and "weights_only" in str(e).lower() and "unsupported" in str(e).lower():
            raise  # a policy refusal (weights_only=True and a non-tensor global), not damage
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise CheckpointCorruptError(f"cannot load checkpoint file {path!r} ({type(e).__name__}: {first[:200]}): "
                                     "it is truncated or corrupted. " + _what_to_do(path)) from e


# ----------------------------------------------------------------------------- atomic directories
def _hash_file(p: str) -> str:
    h = hashlib.sha256()
    with open(p, "rb") as f:
        for b in iter(lambda: f.read(_CHUNK), b""):
            h.update(b)
    return h.hexdigest()


def _write_manifest(d: str) -> None:
    """Size and SHA-256 of every file under ``d`` (written last, fsynced with the files)."""
    files = {}
    for root, _, names in os.walk(d):
        for n in sorted(names):
            p = os.path.join(root, n)
            rel = os.path.relpath(p, d)
            if rel == MANIFEST:
                continue
            with open(p, "rb") as f:
                os.fsync(f.fileno())
            files[rel] = {"bytes": os.path.getsize(p), "sha256": _hash_file(p)}
    with open(os.path.join(d, MANIFEST), "w") as f:
        json.dump({"format": "gefen_dist checkpoint manifest v1", "files": files}, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    _fsync_dir(d)


def verify_dir(path) -> bool:
    """Check a checkpoint directory against its manifest: ``True`` when every listed file is
    present with its size and SHA-256, ``False`` when there is no manifest (written by something
    else). Raises :class:`CheckpointCorruptError` naming the first bad file."""
    path = os.fspath(path)
    mpath = os.path.join(path, MANIFEST)
    if not os.path.isfile(mpath):
        return False
    try:
        with open(mpath) as f:
            files = json.load(f)["files"]
    except (ValueError, KeyError) as e:
        raise CheckpointCorruptError(f"checkpoint manifest {mpath!r} is unreadable ({e}). " + _what_to_do(path)) from e
    for rel, want in files.items():
        p = os.path.join(path, rel)
        if not os.path.isfile(p):
            raise CheckpointCorruptError(f"checkpoint file {p!r} is missing (listed in {MANIFEST}). " + _what_to_do(path))
        size = os.path.getsize(p)
        if size != want["bytes"]:
            raise CheckpointCorruptError(f"checkpoint file {p!r} is truncated or altered: {size} bytes, "
                                         f"{want['bytes']} when written. " + _what_to_do(path))
        if _hash_file(p) != want["sha256"]:
            raise CheckpointCorruptError(f"checkpoint file {p!r} is corrupted: its SHA-256 differs from the one in "
                                         f"{MANIFEST}. " + _what_to_do(path))
    return True


_RENAME_EXCHANGE = 2


def _exchange(a: str, b: str) -> bool:
    """Atomically swap two paths (Linux ``renameat2(RENAME_EXCHANGE)``); False when unsupported."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        import ctypes
        libc = ctypes.CDLL(None, use_errno=True)
        fn = libc.renameat2
    except (OSError, AttributeError):
        return False
    AT_FDCWD = -100
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    rc = fn(AT_FDCWD, os.fsencode(a), AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE)
    return rc == 0


def _commit_dir(tmp: str, path: str) -> None:
    """Put the complete directory ``tmp`` in place of ``path`` (rank 0 only). Atomic when ``path``
    does not exist (rename) or on Linux (exchange). Elsewhere ``path`` is first renamed to
    ``.<name>.old-<pid>``; :func:`_recover_dir` puts that back if the process dies in between."""
    parent = os.path.dirname(path) or "."
    if not os.path.exists(path):
        os.replace(tmp, path)
    elif _exchange(tmp, path):
        shutil.rmtree(tmp, ignore_errors=True)  # now the old checkpoint
    else:
        old = os.path.join(parent, f".{os.path.basename(path)}.old-{os.getpid()}")
        os.replace(path, old)
        os.replace(tmp, path)
        shutil.rmtree(old, ignore_errors=True)
    _fsync_dir(parent)


def recover_interrupted(path) -> None:
    """Call on one rank before looking for directory checkpoint ``path``: when a writer died between
    the two renames of the non-Linux fallback of :func:`save`, put the previous checkpoint
    (``.<name>.old-<pid>``) back. A no-op when ``path`` exists."""
    path = os.fspath(path).rstrip(os.sep)
    if os.path.exists(path):
        return
    olds = [p for p in stale_temporaries(path) if ".old-" in os.path.basename(p) and os.path.isdir(p)]
    if olds:
        logger.warning("checkpoint %s: restoring %s left by an interrupted save", path, olds[-1])
        os.replace(olds[-1], path)

