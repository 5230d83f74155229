"""Make triton 3.9.0's interpreter (``TRITON_INTERPRET=1``) patch ``triton.language`` once per launch.

The interpreter runs a kernel by swapping ``triton.language``'s builtins for interpreted ones
(``_patch_lang``: ``inspect.getmembers`` over ``tl``, ``tl.tensor``, ``tl.math`` and ``tl.core``)
around each launch, and again at *every* call of a ``@triton.jit`` device function (ours, and
triton's own ``tl.zeros``, ``tl.sum``, ...), where nothing has changed since the launch patched it.
Our kernels call device functions thousands of times per step, so those repeats were about a
quarter of the interpreter tests' time (``test_capturable_warns_of_a_float_lr_under_capture`` and
``test_cuda_batch_through_interpreter``: 70.6 s -> 51.3 s). :func:`install` keeps the launch's
patching as it is and repeats a device function's only for language modules (``tl``,
``tl.core``) that this launch has not patched yet. The emulated operations, and so every number
the kernels compute, are unchanged; only the test processes install it (never the library).

Tied to the interpreter's internals, so it installs only on the triton version it was written
against and is a no-op (the tests just run slower) on any other.
"""
from __future__ import annotations

import inspect

_VERSION = "3.9.0"
_installed = False


def install() -> bool:
    """Install the once-per-launch patching; True when installed (now or before)."""
    global _installed
    if _installed:
        return True
    import triton

    if triton.__version__ != _VERSION:
        return False
    import triton.language as tl
    import triton.runtime.interpreter as interp

    if not all(hasattr(interp, n) for n in ("GridExecutor", "InterpretedFunction", "_patch_lang",
                                            "InterpreterError")):
        return False
    launch_call = interp.GridExecutor.__call__
    patched: set = set()  # ids of the language modules patched in the launch that is running
    langs_of: dict = {}

    def _langs(fn) -> frozenset:
        key = id(fn)
        if key not in langs_of:
            langs_of[key] = frozenset(id(v) for v in fn.__globals__.values()
                                      if inspect.ismodule(v) and v in (tl, tl.core))
        return langs_of[key]

    def launch(self, *args, **kwargs):
        patched.clear()
        patched.update(_langs(self.fn))  # GridExecutor.__call__ patches these itself
        try:
            return launch_call(self, *args, **kwargs)
        finally:
            patched.clear()

    def device_call(self, *args, **kwargs):  # InterpretedFunction.__call__ less its repeated patching
        langs = _langs(self.fn)
        if not langs <= patched:
            interp._patch_lang(self.fn)
            patched.update(langs)
        fn = self.rewrite()
        try:
            return fn(*args, **kwargs)
        except Exception as e:
            raise interp.InterpreterError(repr(e)) from e

    interp.GridExecutor.__call__ = launch
    interp.InterpretedFunction.__call__ = device_call
    interp._get_np_dtype = _np_dtype_memo(interp._get_np_dtype, tl)
    _installed = True
    return True


def _np_dtype_memo(get_np_dtype, tl):
    """``_get_np_dtype`` builds a 19-entry dict of triton dtypes at every call (every emulated load,
    store and cast). Its answer depends only on the scalar type, and triton's scalar types are equal
    exactly when their names are, so it is memoised by name (pointers, and blocks of pointers, are
    uint64 as in the original)."""
    import numpy as np

    u64 = np.dtype(np.uint64)
    memo: dict = {}

    def np_dtype(tt_dtype):
        e = tt_dtype.element_ty if isinstance(tt_dtype, tl.block_type) else tt_dtype
        if isinstance(e, tl.pointer_type):
            return u64
        r = memo.get(e.name)
        if r is None:
            r = memo[e.name] = get_np_dtype(e)
        return r

    return np_dtype
