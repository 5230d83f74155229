"""Checkpoints of Gefen state with ``torch.distributed.checkpoint`` (DCP).

Gefen's state is made of ordinary tensors laid out like the parameter (``idx`` uint8 shaped like
the parameter; ``scale`` and ``v`` fp32 shaped ``(rows, slab // block)``; a shared ``(256,)``
codebook; ints ``step``, ``period``, ``scale_block``, ``learned``). Under FSDP2 the per-row
tensors are DTensors with the parameter's mesh and placements, so DCP saves them as chunks
with global offsets and reshards them on load at any world size, and a DDP checkpoint (plain
tensors) loads into FSDP2 and back.

Two things need help, and this module provides it:

* With ``second_moment="shared"`` (and in factored checkpoints saved before D14) the shapes of
  ``scale`` and ``v`` depend on the period detected at the first step; DCP loads in place, so the
  state must exist with the saved shapes before :func:`torch.distributed.checkpoint.load`.
  :func:`prepare_for_load` reads the periods from the checkpoint metadata and allocates the
  state (this also keeps DCP from running its zero-gradient "init step"). The factored default's
  shapes depend on the parameter shapes only, so the plain DCP flow needs nothing from here.
* A full (consolidated) state dict loaded with ``broadcast_from_rank0`` needs the same, with the
  periods taken from rank 0's dict (:func:`load_full_state_dict`).

Typical use::

    from gefen_dist import checkpoint as gckpt
    gckpt.save(model, opt, "ckpt/step100", extra={"step": 100})
    ...
    extra = gckpt.load(model, opt, "ckpt/step100")     # any world size / parallelism

Writes are atomic (a temporary next to the destination, fsync, rename) and checked on read:
:func:`save` commits a DCP directory with a manifest of SHA-256s, :func:`atomic_save` writes a
``torch.save`` file carrying its SHA-256, and :func:`load` / :func:`load_file` raise
:class:`CheckpointCorruptError` (naming the file and what to do) instead of loading a damaged
checkpoint.

See ``docs/checkpoints.md`` and ``docs/reliability.md``.
"""
from . import dcp, files  # noqa: F401  (the modules: gefen_dist.checkpoint.dcp / .files)
from .dcp import (EXTRA_KEY, MODEL_KEY, OPTIM_KEY, CheckpointMismatchError, check_compatible, full_state_dict, load, load_full_state_dict,
                  param_fqns, prepare_for_load, save, saved_periods)
from .dcp import _find_key  # noqa: F401  (tested directly)
from .files import (CheckpointCorruptError, atomic_save, load_file, recover_interrupted, stale_temporaries,
                    temporary_path, verify_dir, verify_file)
from .files import MANIFEST, _HashingWriter  # noqa: F401  (the manifest's name; patched by the fault tests)

__all__ = ["prepare_for_load", "check_compatible", "CheckpointMismatchError", "saved_periods", "save", "load",
           "full_state_dict", "load_full_state_dict", "param_fqns", "CheckpointCorruptError", "atomic_save",
           "load_file", "verify_file", "verify_dir", "temporary_path", "stale_temporaries", "recover_interrupted"]
