"""Argument and pre-step checks of :class:`gefen_dist.Gefen`: every bad input answered clearly.

* :func:`validate_hparams`: ``lr``, ``betas``, ``eps``, ``weight_decay`` at construction and in
  every ``add_param_group`` (a string, a wrong-sized tensor or a negative value raises a
  ``TypeError``/``ValueError`` naming the value and the fix, instead of failing later at ``step()``).
* :func:`validate_group_keys`: options that are optimizer-wide (``nonfinite``, ``bound_updates``,
  ``process_group``; for ZeroGefen and the DeepSpeed flat buffers also ``fused`` and
  ``small_threshold``) are rejected in a param group (they would be ignored). ``fused`` and
  ``small_threshold`` in a :class:`~gefen_dist.Gefen` param group apply to that group, as AdamW's
  per-group ``fused`` does.
* :func:`prestep`: called at the start of every ``step()`` (after the closure): refuses
  ``torch.compile`` of the step, parameters still on the meta device, and parameters whose shape
  changed since their state was created; gives zero-size parameters (no elements) an exact, empty
  state; with ``nonfinite="ignore"``, learns periods and the codebook from the finite values of
  the gradients only. :func:`prestep_zero` is its counterpart for ``ZeroGefen``.
"""
from __future__ import annotations

import logging
import math
import numbers
from typing import Any, Dict, List, Tuple

import torch

from ..engine.layout import global_shape, local_tensor, piece_of
from ..engine.state import MODE_EXACT, NIBBLES, SECOND_MOMENT_SETTINGS, quantizes, second_moment_of, tensor_keys
from ..kernels import cpu_build as _cpu_build

NONFINITE = ("raise", "skip", "ignore")  # Gefen's nonfinite policies (re-exported by gefen_dist.optim.gefen)

logger = logging.getLogger(__name__)

__all__ = ["validate_hparams", "validate_group_keys", "validate_param_group", "validate_row_blocks", "validate_col_blocks", "validate_narrow_rows", "prestep", "prestep_zero", "refuse_compile", "require_fused_kernels",
           "GROUP_REJECTED", "GROUP_REJECTED_SHARDED"]

# Constructor options that apply to the whole optimizer; a param group that sets them is refused.
GROUP_REJECTED = ("nonfinite", "bound_updates", "symmetric_codebook", "process_group")
# ZeroGefen and the DeepSpeed integration cut partitions across groups, stepped with one
# implementation and one exactness threshold
GROUP_REJECTED_SHARDED = ("fused", "small_threshold") + GROUP_REJECTED


def _is_number(x) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, bool)


def _number(name: str, value, where: str, example: str) -> float:
    """``value`` as a float when it is a real number (or a 1-element real tensor), else a TypeError."""
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise ValueError(f"Invalid {name}{where}: a tensor must have 1 element, got shape "
                             f"{tuple(value.shape)}; pass a float such as {example}")
        if value.is_complex() or not (value.is_floating_point() or value.dtype in (torch.int32, torch.int64)):
            raise TypeError(f"Invalid {name}{where}: {value!r} (expected a float such as {example})")
        return float(value.item())
    if not _is_number(value):
        raise TypeError(f"Invalid {name}{where}: {value!r} (a {type(value).__name__}; expected a float "
                        f"such as {example})")
    return float(value)


def validate_hparams(lr, betas, eps, weight_decay, where: str = "") -> None:
    """Raise a ``TypeError``/``ValueError`` naming the bad value and the fix."""
    if isinstance(lr, torch.Tensor):
        if lr.numel() != 1:
            raise ValueError(f"Invalid learning rate{where}: Tensor lr must be 1-element, got shape "
                             f"{tuple(lr.shape)}; pass a float or a 1-element tensor such as torch.tensor(1e-3)")
        lr_v = _number("learning rate", lr, where, "1e-3")
    elif not _is_number(lr):
        raise TypeError(f"Invalid learning rate{where}: {lr!r} (a {type(lr).__name__}; expected a float such as "
                        "1e-3 or a 1-element tensor)")
    else:
        lr_v = float(lr)
    if not math.isfinite(lr_v) or lr_v < 0.0:
        raise ValueError(f"Invalid learning rate{where}: {lr!r} (must be a finite number >= 0)")
    if isinstance(betas, (str, bytes)) or not isinstance(betas, (tuple, list)):
        raise TypeError(f"Invalid betas{where}: {betas!r} (expected a pair of floats in [0, 1), e.g. (0.9, 0.999))")
    if len(betas) != 2:
        raise ValueError(f"Invalid betas{where}: {betas!r} (expected a pair of floats in [0, 1), e.g. (0.9, 0.999))")
    if not all(_is_number(b) or isinstance(b, torch.Tensor) for b in betas):
        raise TypeError(f"Invalid betas{where}: {tuple(betas)!r} (expected a pair of floats in [0, 1), e.g. "
                        "(0.9, 0.999))")
    b1, b2 = (_number("betas", b, where, "0.9") for b in betas)
    if not 0.0 <= b1 < 1.0:
        raise ValueError(f"Invalid beta parameter at index 0{where}: {b1} (must be in [0, 1))")
    if not 0.0 <= b2 < 1.0:
        raise ValueError(f"Invalid beta parameter at index 1{where}: {b2} (must be in [0, 1))")
    if not _is_number(eps):
        raise TypeError(f"Invalid epsilon value{where}: {eps!r} (a {type(eps).__name__}; expected a float such "
                        "as 1e-8)")
    if not (math.isfinite(float(eps)) and float(eps) >= 0.0):
        raise ValueError(f"Invalid epsilon value{where}: {eps!r} (must be a finite number >= 0)")
    if not _is_number(weight_decay):
        raise TypeError(f"Invalid weight_decay value{where}: {weight_decay!r} (a {type(weight_decay).__name__}; "
                        "expected a float such as 0.01)")
    if not (math.isfinite(float(weight_decay)) and float(weight_decay) >= 0.0):
        raise ValueError(f"Invalid weight_decay value{where}: {weight_decay!r} (must be a finite number >= 0)")


def validate_group_keys(param_group: Dict[str, Any], index: int, rejected: Tuple[str, ...] = GROUP_REJECTED) -> None:
    """Refuse optimizer-wide options (``rejected``) in a param group: Gefen applies them to every
    group, so a per-group value would be silently ignored. A per-group ``fused`` (where allowed)
    must be None, True or False."""
    if "fused" in param_group and "fused" not in rejected and param_group["fused"] not in (None, True, False):
        raise ValueError(f"Invalid fused in param group {index}: {param_group['fused']!r} (expected None, True or "
                         "False)")
    bad = [k for k in rejected if k in param_group]
    if bad:
        k = bad[0]
        raise ValueError(
            f"Invalid option {k!r} in param group {index}: {param_group[k]!r}. Gefen applies {k!r} to all "
            f"param groups; pass it to the constructor instead (Gefen(params, {k}=...)) and remove it from the "
            "group. Per-group options are lr, betas, eps, weight_decay, second_moment, row_blocks, col_blocks, "
            "narrow_rows"
            + (" and fused, small_threshold." if "fused" not in rejected else ".")
        )


def validate_options(*, second_moment, small_threshold, nonfinite, fused, symmetric_codebook, capturable,
                     row_blocks, narrow_rows, col_blocks=1) -> None:
    """Gefen's constructor options other than the AdamW hyperparameters: each refused with a
    ``ValueError`` naming the value and what is expected."""
    if second_moment not in SECOND_MOMENT_SETTINGS:
        raise ValueError(f"Invalid second_moment: {second_moment!r} (expected one of {SECOND_MOMENT_SETTINGS})")
    if isinstance(small_threshold, bool) or not isinstance(small_threshold, int) or small_threshold < 0:
        raise ValueError(f"Invalid small_threshold: {small_threshold!r} (must be an int >= 0)")
    if nonfinite not in NONFINITE:
        raise ValueError(f"Invalid nonfinite: {nonfinite!r} (expected one of {NONFINITE})")
    if fused not in (None, True, False):
        raise ValueError(f"Invalid fused: {fused!r} (expected None, True or False)")
    if symmetric_codebook not in (True, False):
        raise ValueError(f"Invalid symmetric_codebook: {symmetric_codebook!r} (expected True or False)")
    validate_capturable(capturable, nonfinite, fused)
    validate_row_blocks(row_blocks)
    validate_col_blocks(col_blocks)
    validate_narrow_rows(narrow_rows)


def validate_capturable(capturable, nonfinite: str, fused) -> None:
    """``capturable`` is True or False; True needs a non-finite policy the device can carry out alone
    (``"skip"`` or ``"ignore"``: raising needs the host to know) and the fused kernels."""
    if capturable not in (True, False):
        raise ValueError(f"Invalid capturable: {capturable!r} (expected True or False)")
    if capturable and nonfinite == "raise":
        raise ValueError("Gefen(capturable=True) decides non-finite gradients on the device, so it cannot raise "
                         "(nonfinite='raise', the default, needs a host synchronisation every step): pass "
                         "nonfinite='skip' (a step with a non-finite gradient changes nothing and is counted in "
                         "optimizer.device_skipped_steps) or nonfinite='ignore'")
    if capturable and fused is False:
        raise ValueError("Gefen(capturable=True) needs the fused multi-tensor step; fused=False forces the eager "
                         "per-tensor path, which synchronises. Pass fused=None (default) or True")


def _validate_blocks(name: str, v, one: str, where: str) -> None:
    """``row_blocks`` / ``col_blocks`` is ``"auto"`` (or ``"shape"``, the same rule), None or an int >= 1 (D12,
    D21); ``one``: what 1 means."""
    from ..core.periods import BY_SHAPE

    if not (v is None or v in BY_SHAPE or (isinstance(v, int) and not isinstance(v, bool) and v >= 1)):
        raise ValueError(f"Invalid {name}{where}: {v!r} (expected 'auto' (or 'shape', the same rule), None or an "
                         f"int >= 1; 1 is {one})")


def validate_row_blocks(rb, where: str = "") -> None:
    _validate_blocks("row_blocks", rb, "one column profile per tensor, as Adafactor", where)


def validate_col_blocks(cb, where: str = "") -> None:
    _validate_blocks("col_blocks", cb, "one row statistic per row", where)


def validate_narrow_rows(nr, where: str = "") -> None:
    """``narrow_rows`` is ``"auto"``, ``"rows"``, ``"span"`` or ``"rows8"`` (D16, D18, D19)."""
    from ..engine.state import NARROW_ROWS

    if nr not in NARROW_ROWS:
        raise ValueError(f"Invalid narrow_rows{where}: {nr!r} (expected one of {NARROW_ROWS})")


def validate_nibbles(opt, merged: Dict[str, Any], where: str) -> None:
    """``second_moment="nibbles"`` (D20) in a param group (``merged`` with the optimizer's defaults and the
    group's parameters): :class:`gefen_dist.Gefen`, ``ZeroGefen`` and the DeepSpeed optimizer step it
    (``opt._nibbles_ok``), and the optimizer's one codebook has 16 codewords for it and 256 otherwise, so
    all its groups use it or none."""
    nib = merged["second_moment"] == NIBBLES
    if nib and not getattr(opt, "_nibbles_ok", False):
        raise ValueError(f"{type(opt).__module__}.{type(opt).__name__} does not step second_moment='nibbles'{where} "
                         "yet (gefen_dist.Gefen does, single process, DDP and FSDP2, gefen_dist.ZeroGefen and "
                         "gefen_dist.integrations.deepspeed.Gefen); use "
                         "second_moment='factored'")
    if nib and merged.get("narrow_rows", "auto") in ("span", "rows8"):
        raise ValueError(f"narrow_rows={merged['narrow_rows']!r}{where} is a layout of second_moment='factored'; "
                         "'nibbles' keeps every quantized row's scale and v_row per row: leave narrow_rows at its "
                         "default ('auto') or pass second_moment='factored'")
    th = opt.__dict__.get("small_threshold", 0)
    others = {second_moment_of(g) == NIBBLES for g in opt.param_groups if quantizes(g, th)}
    if others and others != {nib} and quantizes(merged, th):
        raise ValueError(f"second_moment={merged['second_moment']!r}{where}, but the optimizer's other groups "
                         f"{'do not use' if nib else 'use'} 'nibbles': its first-moment codebook is one for all groups "
                         "(16 codewords with 'nibbles', 256 otherwise), so every group that quantizes a tensor must "
                         "use 'nibbles' or none (groups of small and 1-D tensors only may say either)")


def validate_param_group(opt, param_group) -> None:
    """The checks of ``opt.add_param_group(param_group)`` before anything changes: optimizer-wide
    keys (``opt._group_rejected``), hyperparameters, ``second_moment``, ``row_blocks``,
    ``small_threshold`` and parameter dtypes; each error names the value and the fix."""

    where = f" in param group {len(opt.param_groups)}"
    if isinstance(param_group, dict):
        validate_group_keys(param_group, len(opt.param_groups), opt._group_rejected)
        merged = {**opt.defaults, **{k: v for k, v in param_group.items() if k != "params"}}
        validate_hparams(merged["lr"], merged["betas"], merged["eps"], merged["weight_decay"], where)
        if merged["second_moment"] not in SECOND_MOMENT_SETTINGS:
            raise ValueError(f"Invalid second_moment{where}: {merged['second_moment']!r} (expected one of "
                             f"{SECOND_MOMENT_SETTINGS})")
        ps = param_group.get("params")
        ps = [ps] if isinstance(ps, torch.Tensor) else list(ps) if isinstance(ps, (list, tuple)) else []
        validate_nibbles(opt, {**merged, "params": [p[1] if isinstance(p, tuple) else p for p in ps
                                                   if isinstance(p[1] if isinstance(p, tuple) else p, torch.Tensor)]},
                         where)
        validate_row_blocks(merged.get("row_blocks", "auto"), where)
        validate_col_blocks(merged.get("col_blocks", 1), where)
        validate_narrow_rows(merged.get("narrow_rows", "auto"), where)
        st = merged.get("small_threshold", 0)
        if isinstance(st, bool) or not isinstance(st, int) or st < 0:
            raise ValueError(f"Invalid small_threshold{where}: {st!r} (must be an int >= 0)")
    params = param_group.get("params") if isinstance(param_group, dict) else param_group
    for p in (params if isinstance(params, (list, tuple)) else [params]):
        if isinstance(p, tuple):  # (name, param) when a group holds named params
            p = p[1]
        if not isinstance(p, torch.Tensor):
            continue
        if p.is_complex() and not opt._complex_ok:
            raise TypeError(f"{type(opt).__name__} does not support complex parameters (dtype {p.dtype}{where}, "
                            f"shape {tuple(p.shape)}): its partitions are flat real buffers. Use gefen_dist.Gefen, "
                            "which steps a complex parameter as its real view, or register "
                            "torch.view_as_real(param) as the parameter")
        if not (p.is_floating_point() or p.is_complex()):
            raise TypeError(f"Gefen can only optimize floating-point (or complex) parameters, got dtype {p.dtype}"
                            f"{where} (shape {tuple(p.shape)}); pass only float/bf16/fp16 parameters")


# ---------------------------------------------------------------------------------- pre-step
def _compile_refusal() -> RuntimeError:
    return RuntimeError(
        "Gefen.step() cannot be compiled with torch.compile: it learns its periods and codebook with "
        "host-side decisions and data-dependent shapes at the first step. Compile the model, not the "
        "optimizer step (torch.compile(model)), or keep the step out of a compiled region with "
        "torch.compiler.disable(optimizer.step)."
    )


def refuse_compile() -> None:
    """Raise the clear refusal when ``step()`` runs under ``torch.compile``."""
    if _under_torch_compile():
        raise _compile_refusal()


def _under_torch_compile() -> bool:
    """True while TorchDynamo traces this code, or runs it between two compiled graphs (a graph
    break inside a compiled ``step`` runs the rest eagerly with Dynamo's frame callback installed,
    where ``torch.compiler.is_compiling()`` is False). ``torch.compiler.disable`` removes the
    callback, so a disabled step is not refused."""
    if torch.compiler.is_compiling():
        return True
    try:
        from torch._C._dynamo import eval_frame as _ef

        return _ef.get_eval_frame_callback() is not None
    except (ImportError, AttributeError):  # pragma: no cover - other torch builds
        return False


def require_fused_kernels(opt, groups=None) -> None:
    """``fused=True`` (for the optimizer, or for the param groups ``groups``): the kernel of each
    device their parameters are on must be usable (the native CPU kernel for CPU parameters, Triton
    for CUDA float32/bfloat16 ones), else a clear error at construction."""
    from ..kernels import dispatch as _dispatch

    params = [local_tensor(p) for g in (opt.param_groups if groups is None else groups) for p in g["params"]]
    if any(t.device.type == "cpu" for t in params):
        from ..kernels import cpu as _cpu

        if not _cpu.available():
            raise RuntimeError(
                "Gefen(fused=True): the native CPU kernel could not be built (no C compiler?). "
                "Install gcc/clang or set CC, or pass fused=None to fall back to the eager path.")
    cuda = [t for t in params if t.is_cuda and t.dtype in (torch.float32, torch.bfloat16)]
    if cuda and not _dispatch.triton_usable(cuda[0]):
        raise RuntimeError(
            "Gefen(fused=True): CUDA parameters, but the Triton kernels are not usable (is triton "
            "installed and working? python -c 'import triton'). Install triton matching your torch, or "
            "pass fused=None to fall back to the eager path.")


def prestep(opt, entries: List[Tuple[dict, torch.Tensor]]) -> None:
    """The checks and fix-ups that come before any state is read or written in ``step()``."""
    refuse_compile()
    _cpu_build.setting()  # a bad GEFEN_DIST_CPU_ISA raises here, not inside the first kernel call
    names = None
    if not entries:
        _no_entries(opt)
    learn: List[torch.Tensor] = []
    state = opt.state
    for _, p in entries:
        st = state.get(p)
        if st:
            # the state's tensors have the parameter's (global) shape, DTensor or not: one compare
            ref = st.get(tensor_keys(opt._mode(p))[0])  # idx, or exp_avg for an exact tensor
            # (a DTensor's shape is global; ZeRO-3's ds_shape and a complex tensor's real view take the
            # exact comparison)
            if ref is not None and (ref.shape != p.shape or hasattr(p, "ds_shape")) \
                    and tuple(ref.shape) != global_shape(p):
                names = names or opt._names()
                raise _shape_changed(type(opt).__name__, names[id(p)], global_shape(p), ref.shape)
            if not st.get("learned", 1):
                learn.append(p)
            continue
        if local_tensor(p).is_meta or local_tensor(p.grad).is_meta:
            names = names or opt._names()
            raise _on_meta(type(opt).__name__, names[id(p)], global_shape(p))
        shape = global_shape(p)
        if int(math.prod(shape)) == 0:
            # nothing to learn or store: an exact (AdamW) state of zero elements
            opt._alloc(p, piece_of(p, opt._comm.rank, opt._comm.world_size > 1), learned=True)
        elif opt._mode(p) != MODE_EXACT:
            learn.append(p)
    if learn and opt.nonfinite == "ignore":
        _learn_from_finite(opt, entries, learn)


def prestep_zero(opt, entries: List[Tuple[dict, torch.Tensor]], partitioned_shape) -> None:
    """:func:`prestep` for :class:`gefen_dist.ZeroGefen`, whose state holds flat slices of each
    parameter: the shape to compare with is the one its partition was cut for
    (``partitioned_shape(p)``, None before the first partition). Every rank holds every parameter
    and gradient, so every rank raises the same error before any collective."""
    if _under_torch_compile():
        raise _compile_refusal()
    _cpu_build.setting()
    names = None
    if not entries:
        _no_entries(opt)
    for _, p in entries:
        if p.is_meta or p.grad.is_meta:
            names = names or opt._names()
            raise _on_meta(type(opt).__name__, names[id(p)], tuple(p.shape))
        was = partitioned_shape(p)
        if was is not None and tuple(was) != tuple(p.shape):
            names = names or opt._names()
            raise _shape_changed(type(opt).__name__, names[id(p)], p.shape, was)


def _shape_changed(cls: str, name: str, shape, was) -> RuntimeError:
    # ZeroGefen cuts one partition over every parameter, so only a new optimizer re-cuts it
    restart = "" if cls == "ZeroGefen" else " (or `del optimizer.state[param]` to restart that parameter's state)"
    return RuntimeError(
        f"{cls}: parameter {name!r} has shape {tuple(shape)}, but its optimizer state was created for shape "
        f"{tuple(was)}: the parameter changed shape since its state was created. Re-create the optimizer after "
        f"resizing parameters{restart}.")


def _on_meta(cls: str, name: str, shape) -> RuntimeError:
    return RuntimeError(
        f"{cls}: parameter {name!r} (shape {tuple(shape)}) is on the meta device, which holds no data, so it "
        "cannot be stepped. Materialise the model first: model.to_empty(device=...) and initialise the weights "
        "(e.g. reset_parameters() or loading a checkpoint), then compute gradients and call step(); Gefen "
        f"creates its state on that device at the first step. {_META_REBUILD}.")


_META_REBUILD = ("model.to_empty(device=...) replaces meta parameters with new Parameter objects, so an "
                 "optimizer built before it holds the old, empty ones; build Gefen after to_empty() and "
                 "initialising the weights: model.to_empty(device=...); <init>; Gefen(model.parameters())")


def _no_entries(opt) -> None:
    """No parameter has a gradient: fine, unless the optimizer holds meta parameters (it was built
    before ``model.to_empty()``, and would otherwise do nothing, silently, at every step)."""
    for g in opt.param_groups:
        for p in g["params"]:
            if local_tensor(p).is_meta:
                raise RuntimeError(f"Gefen: no parameter has a gradient, and parameter {opt._names()[id(p)]!r} is on "
                                   f"the meta device. {_META_REBUILD}.")


def warn_meta(opt) -> None:
    """At construction: a warning when some parameters are on the meta device."""
    n = sum(1 for g in opt.param_groups for p in g["params"] if local_tensor(p).is_meta)
    if n:
        logger.warning("Gefen: built over %d meta-device parameter(s). %s.", n, _META_REBUILD)


def _learn_from_finite(opt, entries, learn: List[torch.Tensor]) -> None:
    """``nonfinite="ignore"``: the step goes ahead whatever the gradients hold, but periods and the
    codebook, which are learned once and kept for the whole run, are learned from the gradients
    with their non-finite values replaced by 0 (a NaN or inf would make the histogram or period
    score NaN and break every later step). Only at a learning step, and only when some gradient of
    a tensor to learn is not finite."""
    bad = [p for p in learn if not bool(torch.isfinite(local_tensor(p.grad)).all())]
    if not bad:
        return
    names = opt._names()
    logger.warning("Gefen (nonfinite='ignore'): non-finite gradients in %s at a learning step; periods and the "
                   "codebook are learned from their finite values", [names[id(p)] for p in bad[:4]])
    saved = {p: p.grad for p in bad}
    try:
        for p in bad:
            p.grad = torch.nan_to_num(p.grad, nan=0.0, posinf=0.0, neginf=0.0)
        opt._prepare(entries)
    finally:
        for p, g in saved.items():
            p.grad = g
