"""Gefen's ``OptimizerInfo`` for torch's optimizer conformance machinery.

``torch.testing._internal.common_optimizers`` (shipped in the torch wheel) describes every
``torch.optim`` optimizer with an ``OptimizerInfo``: the constructor configurations to try
(``optim_inputs_func``), the inputs that must raise (``optim_error_inputs_func``), which
implementation flags exist (``supported_impls``) and which upstream tests do not apply (``skips``).
:data:`GEFEN_OPTIM_INFO` is Gefen's, modelled on AdamW's entry. It drives

* ``tests/test_conformance.py``: the in-tree conformance tests (torch's ``optims`` decorator and
  ``instantiate_device_type_tests``), run by CI;
* ``scripts/run_upstream_optim_suite.py``: PyTorch's own ``test/test_optim.py::TestOptimRenewed``
  with ``optim_db`` replaced by ``[GEFEN_OPTIM_INFO]``.

The upstream tests use tiny parameters (a ``(10, 5)`` weight), which Gefen keeps in exact AdamW
state by default (D2); the configurations with ``small_threshold=0`` make every >= 2-D tensor take
the quantized path (periods, codebook, uint8 indices).
"""
from __future__ import annotations

import unittest

import torch

try:  # torch.testing._internal.common_utils imports expecttest at import time
    import expecttest  # noqa: F401
except ImportError:  # pragma: no cover - the test extra installs it
    import sys
    import types

    _stub = types.ModuleType("expecttest")
    _stub.TestCase = unittest.TestCase
    _stub.ACCEPT = False
    sys.modules["expecttest"] = _stub

from torch.nn import Parameter  # noqa: E402
from torch.testing._internal.common_optimizers import (  # noqa: E402
    ErrorOptimizerInput,
    OptimizerInfo,
    OptimizerInput,
    get_error_inputs_for_all_optims,
)

from gefen_dist import Gefen  # noqa: E402

# Importing torch.testing._internal.common_utils freezes torch.backends' global flags
# (torch.backends.disable_global_flags(), for torch's own suite); the rest of this project's
# test session may set them as usual, so they are unfrozen again.
if torch.backends.flags_frozen():
    torch.backends.flags_frozen.__globals__["__allow_nonbracketed_mutation_flag"] = True
    assert not torch.backends.flags_frozen()

__all__ = ["GEFEN_OPTIM_INFO", "optim_inputs_func_gefen", "optim_error_inputs_func_gefen"]


def optim_inputs_func_gefen(device, dtype=None):
    # Every configuration states its weight_decay: Gefen's default is AdamW's 0.01, which moves a
    # parameter whose gradient is zero. Upstream's test_step_is_noop_for_zero_grads skips the
    # configurations that state a nonzero weight_decay and special-cases a class *named* AdamW for
    # the default, so the default is written out ("default" is still every default value).
    q = {"small_threshold": 0}  # quantize every >= 2-D tensor, however small
    return [
        OptimizerInput(params=None, kwargs={"weight_decay": 0.01}, desc="default"),
        OptimizerInput(params=None, kwargs={"lr": 0.01, "betas": (0.8, 0.95), "eps": 1e-6, "weight_decay": 0.0},
                       desc="non-default lr, betas, eps; no weight decay"),
        OptimizerInput(params=None, kwargs={"lr": torch.tensor(0.001), "weight_decay": 0.1},
                       desc="Tensor lr, nonzero weight_decay"),
        OptimizerInput(params=None, kwargs={**q, "weight_decay": 0.01}, desc="quantized factored"),
        OptimizerInput(params=None, kwargs={**q, "weight_decay": 0.0}, desc="quantized factored, no weight decay"),
        OptimizerInput(params=None, kwargs={**q, "second_moment": "shared", "weight_decay": 0.1},
                       desc="quantized shared"),
        OptimizerInput(params=None, kwargs={**q, "second_moment": "elementwise", "lr": 0.01, "weight_decay": 0.0},
                       desc="quantized elementwise"),
        OptimizerInput(params=None, kwargs={**q, "lr": torch.tensor(0.001), "row_blocks": 1, "weight_decay": 0.01},
                       desc="quantized, Tensor lr, one row block"),
        OptimizerInput(params=None, kwargs={**q, "narrow_rows": "span", "weight_decay": 0.01},
                       desc="quantized, narrow rows in blocks of rows (D16)"),
        OptimizerInput(params=None, kwargs={**q, "second_moment": "nibbles", "weight_decay": 0.01},
                       desc="quantized, both moments in one byte (D20)"),
        OptimizerInput(params=None, kwargs={**q, "col_blocks": "auto", "weight_decay": 0.01},
                       desc="quantized, column blocks where a row holds 2-8 times the rows (D21)"),
    ]


def optim_error_inputs_func_gefen(device, dtype):
    error_inputs = get_error_inputs_for_all_optims(device, dtype)
    if torch.device(device).type != "cpu":
        return error_inputs

    def err(kwargs, desc, regex, error_type=ValueError, params=None):
        return ErrorOptimizerInput(OptimizerInput(params=params, kwargs=kwargs, desc=desc),
                                   error_type=error_type, error_regex=regex)

    sample = Parameter(torch.randn(4, 4, device=device, dtype=dtype))
    return error_inputs + [
        err(dict(lr=1e-2, betas=(1.0, 0.0)), "beta1 in [0, 1)", "Invalid beta parameter at index 0: 1.0"),
        err(dict(lr=1e-2, weight_decay=-1), "weight_decay >= 0", "Invalid weight_decay value: -1"),
        err(dict(lr=-1e-2), "lr >= 0", "Invalid learning rate: -0.01"),
        err(dict(eps=-1e-8), "eps >= 0", "Invalid epsilon value: -1e-08"),
        err(dict(lr="1e-3"), "string lr", r"Invalid learning rate: '1e-3'.*float", TypeError),
        err(dict(eps="1e-8"), "string eps", r"Invalid epsilon value: '1e-8'.*float", TypeError),
        err(dict(weight_decay="0.1"), "string weight_decay", r"Invalid weight_decay value: '0.1'.*float", TypeError),
        err(dict(betas=("0.9", "0.999")), "string betas", r"Invalid betas: \('0.9', '0.999'\).*float", TypeError),
        err(dict(betas=(0.9,)), "one beta", r"Invalid betas: \(0.9,\).*pair"),
        err(dict(second_moment="rowwise"), "unknown second_moment", "Invalid second_moment: 'rowwise'"),
        err(dict(small_threshold=-1), "small_threshold >= 0", "Invalid small_threshold: -1"),
        err(dict(narrow_rows="blocks"), "unknown narrow_rows", "Invalid narrow_rows: 'blocks'"),
        err(dict(col_blocks=0), "col_blocks >= 1", r"Invalid col_blocks: 0 \(expected 'auto' \(or 'shape', the same rule\), None or an int >= 1"),
        err(dict(nonfinite="warn"), "unknown nonfinite", "Invalid nonfinite: 'warn'"),
        err(dict(fused="yes"), "fused not a bool", "Invalid fused: 'yes'"),
        err({}, "fused in a param group not a bool", r"Invalid fused in param group 0: 'yes'", ValueError,
            params=[{"params": [sample], "fused": "yes"}]),
        err({}, "small_threshold in a param group negative", r"Invalid small_threshold in param group 0: -1",
            ValueError, params=[{"params": [sample], "small_threshold": -1}]),
        err({}, "nonfinite in a param group", r"'nonfinite'.*param group 0.*constructor", ValueError,
            params=[{"params": [sample], "nonfinite": "skip"}]),
        err(dict(capturable="yes"), "capturable not a bool", "Invalid capturable: 'yes'"),
        err(dict(capturable=True), "capturable with nonfinite='raise'",
            r"capturable=True.*cannot raise.*nonfinite='skip'"),
        err(dict(capturable=True, nonfinite="skip", fused=False), "capturable with fused=False",
            r"capturable=True.*fused=False.*fused=None"),
        err({}, "capturable in a param group", r"'capturable'.*param group 0.*constructor", ValueError,
            params=[{"params": [sample], "capturable": True}]),
        err({}, "integer parameter", "floating-point", TypeError,
            params=[torch.zeros(4, dtype=torch.int64)]),
    ]


GEFEN_OPTIM_INFO = OptimizerInfo(
    Gefen,
    optim_inputs_func=optim_inputs_func_gefen,
    optim_error_inputs_func=optim_error_inputs_func_gefen,
    # Gefen has no `foreach` or `differentiable` flag; `fused` selects the native CPU kernel
    # (None: when available, True: required, False: the eager torch path).
    supported_impls=("fused",),
    not_og_supported_flags=("fused",),
    supports_fused_on=("cpu",),
    supports_complex=True,  # stepped as torch.view_as_real, as AdamW does
    supports_sparse=False,
    # no skips: the only upstream tests that do not run on CPU are torch's own device guards
)
