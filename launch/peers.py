"""Peer optimizers for the training job and the benchmarks: construction and state bytes.

``launch/train.py --optimizer NAME`` accepts every name in :data:`PEERS` (plus ``gefen``,
``adamw`` and ``both``). Each peer is imported only when asked for; a missing package gives an
error naming the pinned version to install (``pip install -e .[peers]``). None of them is needed by
gefen_dist itself.

* ``adafactor``: ``torch.optim.Adafactor`` (factored second moment, no first moment).
* ``torchao_adamw8bit`` / ``torchao_adamw4bit``: ``torchao.optim.AdamW8bit`` / ``AdamW4bit``
  (block-wise quantized m and v; torchao 0.18.0).
* ``bnb_adamw8bit``: ``bitsandbytes.optim.AdamW8bit`` (dynamic 8-bit m and v; bitsandbytes 0.50.2,
  which has a CPU path).
* ``adam_mini``: ``adam_mini.Adam_mini`` (one second moment per head / neuron / token, chosen by
  parameter name; adam-mini 1.1.1).
* ``gefen_reference``: the paper's own code, ``gefen`` 1.2.3 (``fused=False`` on CPU).

gefen-x (a fork of the reference) installs a package also named ``gefen``; it cannot share a
process with the reference, so it is only benchmarked (``benchmarks/_peers.py``, in a subprocess).
"""
from __future__ import annotations

import contextlib
import io
import logging
import warnings
from typing import Callable, Dict, Tuple

import torch
from torch import nn

PEER_VERSIONS = {"torchao": "0.18.0", "bitsandbytes": "0.50.2", "adam-mini": "1.1.1", "gefen": "1.2.3"}


@contextlib.contextmanager
def quiet():
    """Silence peers' import-time and first-step chatter (torchao's optional CUDA libraries,
    bitsandbytes' optional CPU kernels package, Adam-mini's block census, the reference's prints)."""
    lv = logging.root.manager.disable
    logging.disable(logging.WARNING)
    try:
        with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()), \
                contextlib.redirect_stderr(io.StringIO()):
            warnings.simplefilter("ignore")
            yield
    finally:
        logging.disable(lv)


def _need(module: str, package: str):
    try:
        with quiet():
            return __import__(module, fromlist=["_"])
    except ImportError as e:
        raise RuntimeError(f"optimizer needs {package}=={PEER_VERSIONS[package]} ({e}); install it with "
                           f"`pip install {package}=={PEER_VERSIONS[package]}` or `pip install -e .[peers]`") from e


def _adafactor(model, groups, lr, betas, eps, weight_decay):
    return torch.optim.Adafactor(groups, lr=lr, weight_decay=weight_decay)


def _torchao(cls_name):
    def make(model, groups, lr, betas, eps, weight_decay):
        tao = _need("torchao.optim", "torchao")
        return getattr(tao, cls_name)(groups, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
    return make


def _bnb(model, groups, lr, betas, eps, weight_decay):
    bnb = _need("bitsandbytes", "bitsandbytes")
    return bnb.optim.AdamW8bit(groups, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)


def adam_mini(named, lr, betas, eps, weight_decay, dim, n_heads):
    """Adam-mini on nanoGPT-style names. ``c_attn`` (fused q, k, v) is registered as a query/key
    name, so it gets one v per head (of ``dim * dim / n_heads`` elements) over q, k *and* v;
    ``c_proj`` (attention and MLP output projections) one v per output neuron; ``wte``/``wpe``
    are embeddings (one v per token/position); 1-D tensors (``bias``/``ln``) plain Adam."""
    am = _need("adam_mini", "adam-mini")
    with quiet():
        opt = am.Adam_mini(named, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, dim=dim,
                           n_heads=n_heads, verbose=False)
    opt.wqk_names.add("c_attn")
    opt.attn_proj_names.add("c_proj")
    opt.embd_names.add("wpe")
    return opt


def _adam_mini(model, groups, lr, betas, eps, weight_decay):
    cfg = getattr(model, "cfg", None) or getattr(model, "config", None)
    dim, heads = getattr(cfg, "d_model", None), getattr(cfg, "n_head", None)
    if dim is None or heads is None:
        raise RuntimeError("adam_mini needs the model's d_model and n_head (model.cfg); it assigns its "
                           "blocks by parameter name and head size")
    return adam_mini(list(model.named_parameters()), lr, betas, eps, weight_decay, dim, heads)


def _reference(model, groups, lr, betas, eps, weight_decay):
    gefen = _need("gefen", "gefen")
    if getattr(gefen, "__version__", None) is not None:  # gefen-x defines __version__, 1.2.3 does not
        raise RuntimeError("the `gefen` package in this environment is gefen-x, not the reference gefen 1.2.3; "
                           "install gefen==1.2.3 (gefen-x must live in its own environment)")
    from gefen.gefen import Gefen as RefGefen
    with quiet():
        return RefGefen(groups, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, fused=False)


Builder = Callable[..., torch.optim.Optimizer]
PEERS: Dict[str, Tuple[str, Builder]] = {
    "adafactor": ("torch.optim.Adafactor", _adafactor),
    "torchao_adamw8bit": ("torchao.optim.AdamW8bit", _torchao("AdamW8bit")),
    "torchao_adamw4bit": ("torchao.optim.AdamW4bit", _torchao("AdamW4bit")),
    "bnb_adamw8bit": ("bitsandbytes.optim.AdamW8bit", _bnb),
    "adam_mini": ("adam_mini.Adam_mini", _adam_mini),
    "gefen_reference": ("gefen 1.2.3 (the paper's code, fused=False)", _reference),
}


def build_peer(name: str, model: nn.Module, groups: list, *, lr: float, betas, eps: float,
               weight_decay: float) -> torch.optim.Optimizer:
    """The peer optimizer ``name`` over ``groups`` (``model`` for name-based optimizers)."""
    if name not in PEERS:
        raise ValueError(f"unknown peer optimizer {name!r}; choose from {sorted(PEERS)}")
    return PEERS[name][1](model, groups, lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay)


def step_quietly(opt: torch.optim.Optimizer, closure=None):
    """``opt.step()``; Adam-mini and the reference print on their first step."""
    if type(opt).__module__.split(".")[0] in ("adam_mini", "gefen"):
        with contextlib.redirect_stdout(io.StringIO()):
            return opt.step(closure)
    return opt.step(closure)


def _tensor_leaves(t: torch.Tensor):
    """The plain tensors holding ``t``'s data (torchao's quantized states are tensor subclasses
    whose ``numel() * element_size()`` would report the dense fp32 size)."""
    if hasattr(t, "__tensor_flatten__") and type(t) is not torch.Tensor and not isinstance(t, torch.nn.Parameter):
        names, _ = t.__tensor_flatten__()
        for n in names:
            yield from _tensor_leaves(getattr(t, n))
    else:
        yield t


def state_bytes(opt, local: Callable[[torch.Tensor], torch.Tensor] = lambda t: t) -> int:
    """Bytes of optimizer state: ``opt.state_bytes()`` when the optimizer defines it (gefen_dist);
    else every tensor in ``opt.state`` (``local`` maps a DTensor to this rank's shard; tensor
    subclasses flattened to their inner tensors, a tensor seen twice counted once), plus a Gefen
    codebook kept outside ``state`` (the reference)."""
    if callable(getattr(opt, "state_bytes", None)):
        return int(opt.state_bytes())
    seen, total = set(), 0

    def add(t):
        nonlocal total
        for leaf in _tensor_leaves(local(t)):
            key = (leaf.data_ptr(), leaf.numel(), leaf.dtype)
            if key in seen or leaf.numel() == 0:
                continue
            seen.add(key)
            total += leaf.numel() * leaf.element_size()

    for st in opt.state.values():
        for v in st.values():
            if isinstance(v, torch.Tensor):
                add(v)
    cb = getattr(opt, "_gefen_codebook", None)
    if isinstance(cb, torch.Tensor):
        add(cb)
    return total
