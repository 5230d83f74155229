"""Memory planning for ``gefen-dist plan``: per-rank bytes of AdamW vs Gefen from tensor shapes.

Pure functions (no ``torch.distributed``; torch is imported only to instantiate a model on the
meta device). The Gefen estimate follows the optimizer's own rules:

* exact AdamW state (8 B/element: fp32 ``exp_avg`` + ``exp_avg_sq``) for 0-D/1-D tensors and tensors
  with fewer than ``small_threshold`` (4096) elements (D2);
* otherwise ``1 + 4/B + 4/P`` B/element (uint8 index, fp32 absmax scale per block of ``B``, fp32
  shared second moment per period ``P``) with ``P`` estimated as the row length
  ``prod(shape[1:])`` under the paper's cap (a period above 1024 becomes its smallest divisor above
  1024) and ``B = P`` (``gefen_dist.engine.layout.Geometry``); plus the 1 KiB codebook once.

Learned periods can be *smaller* than the row (more bytes per parameter): the estimate is the
common case for transformer weights (GPT-2 small: every matrix learns its row, see
``docs/results/memory.json``), not a bound.
"""
from __future__ import annotations

import importlib
import json
import math
import re
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Tuple

from .core.periods import row_slab, shape_period
from .core.span import span_blocks, span_period
from .engine.layout import KIND_EXACT, KIND_QUANTIZED, Geometry, is_exact
from .engine.state import (DEFAULT_NARROW_ROWS, MODE_FACTORED, MODE_ROWS8, factored_blocks, fixed_period, narrow_layout,
                           quantized_mode)

__all__ = [
    "TensorSpec", "ModelEstimate", "STRATEGIES", "PRECISIONS", "GPT2_SMALL_GEFEN_BYTES_PER_PARAM",
    "estimated_period", "tensor_state", "estimate_from_shapes", "estimate_from_param_count",
    "shapes_from_hf_config", "shapes_from_factory", "per_rank", "max_micro_batch", "parse_bytes",
    "format_bytes", "plan", "render_plan",
]

CODEBOOK_BYTES = 256 * 4
ADAMW_BYTES_PER_PARAM = 8  # fp32 exp_avg + exp_avg_sq
ADAMW_STEP_BYTES = 4  # torch.optim.AdamW keeps a float32 ``step`` tensor per parameter tensor
# Measured on GPT-2 small (124,439,808 parameters, learned periods 768/1536, 0.1% exact):
# docs/results/memory.json (benchmarks/memory.py), gefen_state_bytes / params.
GPT2_SMALL_GEFEN_STATE_BYTES = 126_849_416  # docs/results/memory.json (factored default, row blocks D12)
GPT2_SMALL_PARAMS = 124_439_808
GPT2_SMALL_GEFEN_BYTES_PER_PARAM = GPT2_SMALL_GEFEN_STATE_BYTES / GPT2_SMALL_PARAMS

STRATEGIES = ("ddp", "zero1", "zero2", "zero3", "fsdp2", "offload")
PRECISIONS = ("fp32", "bf16-mixed")

STRATEGY_HELP = {
    "ddp": "DDP / single process: everything replicated",
    "zero1": "ZeRO-1 (gefen_dist.ZeroGefen or DeepSpeed stage 1): optimizer state (and master) sharded",
    "zero2": "ZeRO-2 (DeepSpeed stage 2): + gradients sharded",
    "zero3": "ZeRO-3 (DeepSpeed stage 3): + parameters sharded",
    "fsdp2": "FSDP2 fully_shard: parameters (the fp32 master), gradients and state sharded",
    "offload": "DeepSpeed ZeRO-2 + CPU optimizer offload: master and state on the host",
}


# ----------------------------------------------------------------------------- per tensor
@dataclass(frozen=True)
class TensorSpec:
    name: str
    shape: Tuple[int, ...]

    @property
    def numel(self) -> int:
        return int(math.prod(self.shape))


def estimated_period(shape: Sequence[int]) -> int:
    """The period assumed from a shape (:func:`gefen_dist.core.periods.shape_period`: the row
    length, capped as the paper does); exactly the factored default's period (D14)."""
    return shape_period(shape)


def tensor_state(shape: Sequence[int], small_threshold: int = 4096,
                 second_moment: str = "factored", narrow_rows: str = DEFAULT_NARROW_ROWS, col_blocks=1) -> Dict[str, Any]:
    """Kind, period, scale block and exact state bytes of one tensor (Gefen) and AdamW's bytes.
    ``second_moment``: ``"factored"`` (default: fp32 per row and per column), ``"shared"``
    (fp32 per period of each row), ``"elementwise"`` (fp32 per element) or ``"nibbles"`` (the factored
    state with scale blocks of at most 256, both moments in the one byte, D20); a factored tensor of
    few rows pays ``4 / rows`` B/param for its ``v_col`` (5.0 B/param in all for ``(1, N)``).
    ``narrow_rows``: a factored tensor of narrow rows kept per block of rows (D16, D18) holds a
    scale and a ``v`` per block and a ``v_col`` per column; under ``"rows8"`` (D19) rows of 22-79
    elements add two one-byte codes per row. ``col_blocks`` (D21; ``"auto"``, an int or 1): a factored tensor's
    column blocks, each with its own ``v_row`` entry per row and its scale blocks inside it."""
    shape = tuple(int(s) for s in shape)
    n = int(math.prod(shape))
    adamw = ADAMW_BYTES_PER_PARAM * n
    narrow = narrow_layout(shape, second_moment, narrow_rows, small_threshold)
    if narrow is not None:  # blocks of rows (D16), and two one-byte codes per row (D19)
        L = span_period(shape)
        codes = 2 * shape[0] if narrow == MODE_ROWS8 else 0
        return dict(kind=KIND_QUANTIZED, period=L, scale_block=L,
                    gefen_bytes=n + codes + 8 * span_blocks(shape) + 4 * row_slab(shape), adamw_bytes=adamw)
    if is_exact(shape, small_threshold):
        return dict(kind=KIND_EXACT, period=0, scale_block=0, gefen_bytes=8 * n, adamw_bytes=adamw)
    fac = quantized_mode(shape, second_moment) == MODE_FACTORED
    G, K = factored_blocks(shape, "auto", col_blocks, second_moment) if fac else (1, 1)
    per = 1 if second_moment == "elementwise" else (fixed_period(shape, second_moment, K) or estimated_period(shape))
    geo = Geometry.quantized(shape, per)
    rows = shape[0]
    s = geo.state_shapes(rows)
    if fac:
        # v_row: K per row (D21); v_col: one profile per row block (D12, row_blocks="auto")
        nbytes = n + 4 * math.prod(s["scale"]) + 4 * rows * K + 4 * geo.slab * G
    else:
        nbytes = n + 4 * math.prod(s["scale"]) + 4 * math.prod(s["v"])
    return dict(kind=KIND_QUANTIZED, period=geo.period, scale_block=geo.scale_block, gefen_bytes=int(nbytes),
                adamw_bytes=adamw)


# ----------------------------------------------------------------------------- whole model
@dataclass
class ModelEstimate:
    source: str
    n_params: int
    n_tensors: int  # 0 when only a parameter count is known
    gefen_state_bytes: int  # whole model, codebook included
    adamw_state_bytes: int
    tensors: List[Dict[str, Any]] = field(default_factory=list)
    from_shapes: bool = True

    @property
    def gefen_bytes_per_param(self) -> float:
        return self.gefen_state_bytes / max(1, self.n_params)

    @property
    def adamw_bytes_per_param(self) -> float:
        return self.adamw_state_bytes / max(1, self.n_params)

    def params_by_period(self) -> Dict[int, int]:
        c: Counter = Counter()
        for t in self.tensors:
            c[t["period"]] += t["numel"]
        return dict(sorted(c.items()))


def estimate_from_shapes(specs: Sequence[TensorSpec], source: str = "shapes", small_threshold: int = 4096,
                         adamw_step_tensors: bool = True, second_moment: str = "factored",
                         col_blocks=1) -> ModelEstimate:
    """Whole-model state bytes from tensor shapes. AdamW counts torch's float32 ``step`` tensor
    per parameter tensor (as ``torch.optim.AdamW`` allocates) unless ``adamw_step_tensors=False``."""
    rows = []
    for sp in specs:
        rec = dict(name=sp.name, shape=tuple(sp.shape), numel=sp.numel,
                   **tensor_state(sp.shape, small_threshold, second_moment, col_blocks=col_blocks))
        if adamw_step_tensors:
            rec["adamw_bytes"] += ADAMW_STEP_BYTES
        rows.append(rec)
    gefen = sum(r["gefen_bytes"] for r in rows)
    if any(r["kind"] == KIND_QUANTIZED for r in rows):
        gefen += CODEBOOK_BYTES
    return ModelEstimate(source=source, n_params=sum(r["numel"] for r in rows), n_tensors=len(rows),
                         gefen_state_bytes=gefen, adamw_state_bytes=sum(r["adamw_bytes"] for r in rows),
                         tensors=rows)


def estimate_from_param_count(n_params: float) -> ModelEstimate:
    """A transformer-like model known only by its parameter count: Gefen at GPT-2 small's measured
    bytes per parameter, AdamW at 8."""
    n = int(round(float(n_params)))
    if n <= 0:
        raise ValueError(f"--params must be a positive number of parameters, got {n_params!r}")
    return ModelEstimate(source=f"{n:,} parameters (transformer-like; Gefen at GPT-2 small's measured "
                                f"{GPT2_SMALL_GEFEN_BYTES_PER_PARAM:.4f} B/param)",
                         n_params=n, n_tensors=0,
                         gefen_state_bytes=int(math.ceil(n * GPT2_SMALL_GEFEN_BYTES_PER_PARAM)),
                         adamw_state_bytes=ADAMW_BYTES_PER_PARAM * n, from_shapes=False)


# ----------------------------------------------------------------------------- model sources
def _get(cfg: Dict[str, Any], *keys, default=None):
    for k in keys:
        if cfg.get(k) is not None:
            return cfg[k]
    return default


def shapes_from_hf_config(cfg: Dict[str, Any]) -> List[TensorSpec]:
    """Parameter shapes of a Hugging Face causal LM from its ``config.json`` dict, named as
    ``AutoModelForCausalLM.from_config`` names them. GPT-2 (``n_embd``/``n_layer``; Conv1D
    weights are ``(in, out)``) and Llama-style decoders (``hidden_size``/``intermediate_size``:
    llama, mistral, qwen2, qwen3, ...; GQA via ``num_key_value_heads``, ``head_dim``,
    ``attention_bias``, ``mlp_bias``, ``tie_word_embeddings``)."""
    if isinstance(cfg.get("text_config"), dict):  # multimodal wrappers: plan the language model
        cfg = {**cfg["text_config"], "tie_word_embeddings": cfg.get("tie_word_embeddings",
                                                                     cfg["text_config"].get("tie_word_embeddings"))}
    mtype = str(cfg.get("model_type", "")).lower()
    if _get(cfg, "num_local_experts", "num_experts", "n_routed_experts"):
        raise ValueError(f"config.json describes a mixture-of-experts model ({mtype or 'unknown type'}); the plan "
                         "only builds dense GPT-2/Llama-style shapes: pass --model pkg.mod:factory instead")
    if mtype == "gpt2" or ("n_embd" in cfg and "n_layer" in cfg):
        return _gpt2_shapes(cfg)
    if all(k in cfg for k in ("hidden_size", "intermediate_size", "num_hidden_layers")):
        return _llama_shapes(cfg, mtype)
    raise ValueError(
        f"config.json with model_type={mtype or None!r} is not understood: expected GPT-2 keys (n_embd, n_layer, "
        "vocab_size) or Llama-style keys (hidden_size, intermediate_size, num_hidden_layers, num_attention_heads, "
        "vocab_size). Pass --model pkg.mod:factory to instantiate the model on the meta device instead")


def _need(cfg, *keys):
    v = _get(cfg, *keys)
    if v is None:
        raise ValueError(f"config.json lacks {keys[0]!r}")
    return int(v)


def _gpt2_shapes(cfg) -> List[TensorSpec]:
    e = _need(cfg, "n_embd", "hidden_size")
    L = _need(cfg, "n_layer", "num_hidden_layers")
    V = _need(cfg, "vocab_size")
    ctx = _need(cfg, "n_positions", "n_ctx", "max_position_embeddings")
    inner = int(_get(cfg, "n_inner", default=None) or 4 * e)
    out = [TensorSpec("transformer.wte.weight", (V, e)), TensorSpec("transformer.wpe.weight", (ctx, e))]
    for i in range(L):
        h = f"transformer.h.{i}."
        out += [
            TensorSpec(h + "ln_1.weight", (e,)), TensorSpec(h + "ln_1.bias", (e,)),
            TensorSpec(h + "attn.c_attn.weight", (e, 3 * e)), TensorSpec(h + "attn.c_attn.bias", (3 * e,)),
            TensorSpec(h + "attn.c_proj.weight", (e, e)), TensorSpec(h + "attn.c_proj.bias", (e,)),
            TensorSpec(h + "ln_2.weight", (e,)), TensorSpec(h + "ln_2.bias", (e,)),
            TensorSpec(h + "mlp.c_fc.weight", (e, inner)), TensorSpec(h + "mlp.c_fc.bias", (inner,)),
            TensorSpec(h + "mlp.c_proj.weight", (inner, e)), TensorSpec(h + "mlp.c_proj.bias", (e,)),
        ]
    out += [TensorSpec("transformer.ln_f.weight", (e,)), TensorSpec("transformer.ln_f.bias", (e,))]
    if not cfg.get("tie_word_embeddings", True):
        out.append(TensorSpec("lm_head.weight", (V, e)))
    return out


def _llama_shapes(cfg, mtype: str) -> List[TensorSpec]:
    H = _need(cfg, "hidden_size")
    inter = _need(cfg, "intermediate_size")
    L = _need(cfg, "num_hidden_layers")
    V = _need(cfg, "vocab_size")
    nh = _need(cfg, "num_attention_heads")
    nkv = int(_get(cfg, "num_key_value_heads", default=nh))
    hd = int(_get(cfg, "head_dim", default=None) or H // nh)
    qkv_bias = bool(cfg.get("attention_bias", mtype == "qwen2"))
    o_bias = bool(cfg.get("attention_bias", False))
    mlp_bias = bool(cfg.get("mlp_bias", False))
    tied = cfg.get("tie_word_embeddings")
    if tied is None:
        tied = mtype not in ("llama", "mistral", "qwen2", "qwen3", "mixtral", "olmo", "olmo2")
    out = [TensorSpec("model.embed_tokens.weight", (V, H))]
    for i in range(L):
        p = f"model.layers.{i}."
        out += [TensorSpec(p + "self_attn.q_proj.weight", (nh * hd, H))]
        if qkv_bias:
            out.append(TensorSpec(p + "self_attn.q_proj.bias", (nh * hd,)))
        out.append(TensorSpec(p + "self_attn.k_proj.weight", (nkv * hd, H)))
        if qkv_bias:
            out.append(TensorSpec(p + "self_attn.k_proj.bias", (nkv * hd,)))
        out.append(TensorSpec(p + "self_attn.v_proj.weight", (nkv * hd, H)))
        if qkv_bias:
            out.append(TensorSpec(p + "self_attn.v_proj.bias", (nkv * hd,)))
        out.append(TensorSpec(p + "self_attn.o_proj.weight", (H, nh * hd)))
        if o_bias:
            out.append(TensorSpec(p + "self_attn.o_proj.bias", (H,)))
        if mtype == "qwen3":
            out += [TensorSpec(p + "self_attn.q_norm.weight", (hd,)), TensorSpec(p + "self_attn.k_norm.weight", (hd,))]
        for nm, shp, b in (("gate_proj", (inter, H), inter), ("up_proj", (inter, H), inter),
                           ("down_proj", (H, inter), H)):
            out.append(TensorSpec(p + f"mlp.{nm}.weight", shp))
            if mlp_bias:
                out.append(TensorSpec(p + f"mlp.{nm}.bias", (b,)))
        out += [TensorSpec(p + "input_layernorm.weight", (H,)), TensorSpec(p + "post_attention_layernorm.weight", (H,))]
    out.append(TensorSpec("model.norm.weight", (H,)))
    if not tied:
        out.append(TensorSpec("lm_head.weight", (V, H)))
    return out


def shapes_from_factory(spec: str, kwargs: Optional[Dict[str, Any]] = None) -> List[TensorSpec]:
    """Instantiate ``pkg.mod:factory`` (a module class or a function returning one, called with
    ``kwargs``) on the meta device (no memory, no initialisation) and list its trainable
    parameters (tied parameters once)."""
    if ":" not in spec:
        raise ValueError(f"--model {spec!r}: expected 'pkg.module:factory'")
    mod_name, attr = spec.split(":", 1)
    try:
        mod = importlib.import_module(mod_name)
    except ImportError as e:
        raise ValueError(f"--model {spec!r}: cannot import {mod_name!r} ({e}); is it on PYTHONPATH?") from None
    obj = mod
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ValueError(f"--model {spec!r}: {mod_name} has no attribute {attr!r}")
        obj = getattr(obj, part)
    import torch

    with torch.device("meta"):
        model = obj(**(kwargs or {}))
    if not isinstance(model, torch.nn.Module):
        raise ValueError(f"--model {spec!r} returned {type(model).__name__}, not a torch.nn.Module")
    return [TensorSpec(n, tuple(p.shape)) for n, p in model.named_parameters() if p.requires_grad]


# ----------------------------------------------------------------------------- per rank
def _shard(x: float, n: int) -> int:
    return int(math.ceil(x / n))


def per_rank(est: ModelEstimate, strategy: str, world_size: int, precision: str = "fp32") -> Dict[str, Dict[str, int]]:
    """Per-rank bytes for AdamW and Gefen: ``{"adamw"|"gefen": {parameters, gradients, master,
    state, device, host}}``. ``bf16-mixed`` means bf16 parameters and gradients with an fp32
    master copy (DeepSpeed convention); under FSDP2 the sharded fp32 parameter *is* the master
    and gradients are fp32 shards (MixedPrecisionPolicy), so precision changes nothing static
    there (transient unsharded bf16 layers are activations-like and not counted)."""
    if strategy not in STRATEGIES:
        raise ValueError(f"unknown strategy {strategy!r} (expected one of {', '.join(STRATEGIES)})")
    if precision not in PRECISIONS:
        raise ValueError(f"unknown precision {precision!r} (expected one of {', '.join(PRECISIONS)})")
    if world_size < 1:
        raise ValueError(f"--world-size must be >= 1, got {world_size}")
    n, N = est.n_params, world_size
    b = 2 if precision == "bf16-mixed" else 4
    master = 4 * n if precision == "bf16-mixed" else 0
    out = {}
    for opt, state in (("adamw", est.adamw_state_bytes), ("gefen", est.gefen_state_bytes)):
        if opt == "gefen" and N > 1 and strategy != "ddp" and est.gefen_state_bytes:
            # the 1 KiB codebook is replicated on every rank, the rest is sharded
            st_rank = _shard(state - CODEBOOK_BYTES, N) + CODEBOOK_BYTES
        else:
            st_rank = state if strategy == "ddp" else _shard(state, N)
        if strategy == "ddp":
            r = dict(parameters=b * n, gradients=b * n, master=master, state=state)
        elif strategy == "zero1":
            r = dict(parameters=b * n, gradients=b * n, master=_shard(master, N), state=st_rank)
        elif strategy in ("zero2", "offload"):
            r = dict(parameters=b * n, gradients=_shard(b * n, N), master=_shard(master, N), state=st_rank)
        elif strategy == "zero3":
            r = dict(parameters=_shard(b * n, N), gradients=_shard(b * n, N), master=_shard(master, N), state=st_rank)
        else:  # fsdp2
            r = dict(parameters=_shard(4 * n, N), gradients=_shard(4 * n, N), master=0, state=st_rank)
        if strategy == "offload":
            r["device"] = r["parameters"] + r["gradients"]
            r["host"] = r["master"] + r["state"]
        else:
            r["device"] = r["parameters"] + r["gradients"] + r["master"] + r["state"]
            r["host"] = 0
        out[opt] = r
    return out


def max_micro_batch(device_memory: int, device_bytes: int, activation_bytes_per_sample: int, reserve: int = 0) -> int:
    """Largest micro-batch whose activations fit next to the static bytes (0: none fits)."""
    if activation_bytes_per_sample <= 0:
        raise ValueError("--activation-bytes-per-sample must be > 0")
    free = device_memory - reserve - device_bytes
    return max(0, free // activation_bytes_per_sample)


# ----------------------------------------------------------------------------- units
_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9, "t": 10**12,
          "tb": 10**12, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_bytes(text: Any) -> int:
    """``"80GiB"``, ``"80 GB"``, ``"1.5e9"``, ``512`` -> bytes."""
    if isinstance(text, (int, float)):
        return int(text)
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z]*)\s*", str(text))
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(f"cannot parse a byte size from {text!r} (examples: 80GiB, 40GB, 512MiB, 1.5e9)")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def format_bytes(n: float) -> str:
    n = float(n)
    for unit, f in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= f:
            return f"{n / f:,.2f} {unit}"
    return f"{int(n):,} B"


# ----------------------------------------------------------------------------- the plan
def load_model_estimate(*, params: Optional[float] = None, config: Optional[str] = None, model: Optional[str] = None,
                        model_kwargs: Optional[Dict[str, Any]] = None, small_threshold: int = 4096,
                        second_moment: str = "factored", col_blocks=1) -> ModelEstimate:
    given = [x is not None for x in (params, config, model)]
    if sum(given) != 1:
        raise ValueError("give exactly one of --params, --config, --model")
    if params is not None:
        return estimate_from_param_count(params)
    if config is not None:
        try:
            with open(config) as f:
                cfg = json.load(f)
        except (OSError, json.JSONDecodeError) as e:
            raise ValueError(f"cannot read config.json {config!r}: {e}") from None
        specs = shapes_from_hf_config(cfg)
        return estimate_from_shapes(specs, f"{cfg.get('model_type', 'model')} from {config}", small_threshold,
                                    second_moment=second_moment, col_blocks=col_blocks)
    specs = shapes_from_factory(model, model_kwargs)
    return estimate_from_shapes(specs, f"{model} (meta device)", small_threshold, second_moment=second_moment,
                                col_blocks=col_blocks)


def plan(est: ModelEstimate, strategy: str, world_size: int, precision: str = "fp32",
         device_memory: Optional[int] = None, activation_bytes_per_sample: Optional[int] = None,
         reserve: int = 0) -> Dict[str, Any]:
    """Everything ``gefen-dist plan`` prints, as a JSON-able dict."""
    ranks = per_rank(est, strategy, world_size, precision)
    out: Dict[str, Any] = dict(
        model=est.source, params=est.n_params, tensors=est.n_tensors, strategy=strategy, world_size=world_size,
        precision=precision, per_rank=ranks,
        state=dict(adamw_bytes=est.adamw_state_bytes, gefen_bytes=est.gefen_state_bytes,
                   adamw_bytes_per_param=est.adamw_bytes_per_param, gefen_bytes_per_param=est.gefen_bytes_per_param,
                   saved_gib_per_billion_params=(8.0 - est.gefen_bytes_per_param) * 1e9 / 2**30,
                   ratio=est.adamw_state_bytes / max(1, est.gefen_state_bytes)),
        period_source="shapes" if est.from_shapes else "measured GPT-2 small bytes/param",
    )
    if est.from_shapes:
        out["params_by_period"] = {str(k): v for k, v in est.params_by_period().items()}
        out["exact_params"] = sum(t["numel"] for t in est.tensors if t["kind"] == KIND_EXACT)
    if device_memory is not None:
        out["device_memory"] = device_memory
        out["fits"] = {k: r["device"] + reserve <= device_memory for k, r in ranks.items()}
        if activation_bytes_per_sample:
            out["activation_bytes_per_sample"] = activation_bytes_per_sample
            out["max_micro_batch"] = {k: max_micro_batch(device_memory, r["device"], activation_bytes_per_sample,
                                                         reserve) for k, r in ranks.items()}
    return out


def render_plan(p: Dict[str, Any], est: Optional[ModelEstimate] = None, per_tensor: bool = False) -> str:
    L = []
    L.append(f"model: {p['model']}")
    L.append(f"       {p['params']:,} parameters" + (f" in {p['tensors']} tensors" if p["tensors"] else ""))
    L.append(f"strategy: {p['strategy']} ({STRATEGY_HELP[p['strategy']]}), world size {p['world_size']}, "
             f"precision {p['precision']}")
    a, g = p["per_rank"]["adamw"], p["per_rank"]["gefen"]
    pdt = "bf16" if p["precision"] == "bf16-mixed" and p["strategy"] != "fsdp2" else "fp32"
    L.append("")
    L.append(f"{'per rank':<28} {'AdamW':>14} {'Gefen':>14}")
    rows = [(f"parameters ({pdt})", "parameters"), (f"gradients ({pdt})", "gradients")]
    if a["master"]:
        rows.append(("master weights (fp32)", "master"))
    rows.append(("optimizer state", "state"))
    where = " (host)" if p["strategy"] == "offload" else ""
    for label, k in rows:
        lab = label + (where if k in ("master", "state") else "")
        L.append(f"  {lab:<26} {format_bytes(a[k]):>14} {format_bytes(g[k]):>14}")
    L.append(f"  {'total on device':<26} {format_bytes(a['device']):>14} {format_bytes(g['device']):>14}")
    if p["strategy"] == "offload":
        L.append(f"  {'total on host (CPU)':<26} {format_bytes(a['host']):>14} {format_bytes(g['host']):>14}")
    saved = a["device"] + a["host"] - g["device"] - g["host"]
    L.append(f"  {'saved by Gefen':<26} {'':>14} {format_bytes(saved):>14}")
    if "device_memory" in p:
        L.append(f"  {'fits in ' + format_bytes(p['device_memory']):<26} "
                 f"{'yes' if p['fits']['adamw'] else 'NO':>14} {'yes' if p['fits']['gefen'] else 'NO':>14}")
        if "max_micro_batch" in p:
            m = p["max_micro_batch"]
            L.append(f"  {'largest micro-batch':<26} {m['adamw']:>14,} {m['gefen']:>14,}")
    s = p["state"]
    L.append("")
    L.append(f"optimizer state, whole model: AdamW {format_bytes(s['adamw_bytes'])} ({s['adamw_bytes_per_param']:.4f} "
             f"B/param), Gefen {format_bytes(s['gefen_bytes'])} ({s['gefen_bytes_per_param']:.4f} B/param): "
             f"{s['ratio']:.2f}x less, {s['saved_gib_per_billion_params']:.2f} GiB saved per billion parameters")
    if p["period_source"] == "shapes":
        per = ", ".join(f"P={k}: {v:,}" for k, v in sorted(p["params_by_period"].items(), key=lambda kv: -kv[1])
                        if k != "0")
        L.append(f"Gefen periods are ESTIMATED FROM SHAPES (P = row length prod(shape[1:]), above 1024 its smallest "
                 f"divisor > 1024; B = P); learned periods can be smaller, costing more bytes. Params by period: "
                 f"{per or 'none'}; exact AdamW state (1-D / < 4096 elements): {p['exact_params']:,}.")
    else:
        L.append("Gefen state uses the bytes/param measured on GPT-2 small (docs/results/memory.json); pass --config "
                 "or --model for a per-tensor estimate.")
    if p["precision"] == "bf16-mixed":
        L.append("bf16-mixed: bf16 parameters and gradients plus an fp32 master copy (DeepSpeed convention); FSDP2 "
                 "keeps fp32 shards as the master. Use --precision fp32 for torch.autocast with fp32 parameters.")
    L.append("Activations, temporary buffers and the allocator's fragmentation are not included"
             + (" (--reserve covers a fixed overhead)." if "device_memory" in p else "."))
    if per_tensor and est is not None and est.tensors:
        L.append("")
        L.append(f"{'name':<44} {'shape':<18} {'kind':<9} {'period':>6} {'Gefen B':>12} {'AdamW B':>12}")
        for t in est.tensors:
            L.append(f"{t['name'][:44]:<44} {str(t['shape']):<18} {t['kind']:<9} {t['period']:>6} "
                     f"{t['gefen_bytes']:>12,} {t['adamw_bytes']:>12,}")
    return "\n".join(L)
