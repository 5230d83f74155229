"""A small GPT-style byte-level decoder (vocab 256) for the training job.

Token + learned positional embeddings, ``n_layer`` pre-LayerNorm blocks (causal self-attention
through ``F.scaled_dot_product_attention(is_causal=True)`` and a 4x GELU MLP), a final
LayerNorm and an LM head tied to the token embedding. GPT-2 initialisation: N(0, 0.02) for
weights, zero biases, residual output projections scaled by 1/sqrt(2*n_layer).
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

VOCAB_SIZE = 256


@dataclass(frozen=True)
class GPTConfig:
    n_layer: int
    n_head: int
    d_model: int
    context: int
    dropout: float = 0.0
    bias: bool = True
    vocab_size: int = VOCAB_SIZE

    def __post_init__(self):
        if self.d_model % self.n_head:
            raise ValueError(f"d_model {self.d_model} not divisible by n_head {self.n_head}")

    def to_dict(self) -> dict:
        return asdict(self)


PRESETS: dict[str, GPTConfig] = {
    # ~0.12M params: unit/smoke tests.
    "tiny": GPTConfig(n_layer=2, n_head=4, d_model=64, context=64),
    # ~1.85M params: the default CPU job.
    "small": GPTConfig(n_layer=4, n_head=6, d_model=192, context=128),
    # ~4.8M params: the "larger LM" of benchmarks/quality.py (2.6x small, deeper and wider).
    "base": GPTConfig(n_layer=6, n_head=8, d_model=256, context=128),
    # ~19M params.
    "medium": GPTConfig(n_layer=6, n_head=8, d_model=512, context=256),
    # GPT-2 (124M) shape; ~86M params with the 256-entry byte vocabulary.
    "gpt2": GPTConfig(n_layer=12, n_head=12, d_model=768, context=1024),
}


def get_config(name: str, **overrides) -> GPTConfig:
    try:
        cfg = PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown model preset {name!r}; choose from {sorted(PRESETS)}") from None
    return GPTConfig(**{**asdict(cfg), **overrides}) if overrides else cfg


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.n_head = cfg.n_head
        self.d_model = cfg.d_model
        self.dropout = cfg.dropout
        self.c_attn = nn.Linear(cfg.d_model, 3 * cfg.d_model, bias=cfg.bias)
        self.c_proj = nn.Linear(cfg.d_model, cfg.d_model, bias=cfg.bias)
        self.c_proj.residual_proj = True
        self.resid_drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(self.d_model, dim=2)
        hs = C // self.n_head
        q = q.view(B, T, self.n_head, hs).transpose(1, 2)
        k = k.view(B, T, self.n_head, hs).transpose(1, 2)
        v = v.view(B, T, self.n_head, hs).transpose(1, 2)
        y = F.scaled_dot_product_attention(
            q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True)
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.resid_drop(self.c_proj(y))


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.c_fc = nn.Linear(cfg.d_model, 4 * cfg.d_model, bias=cfg.bias)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(4 * cfg.d_model, cfg.d_model, bias=cfg.bias)
        self.c_proj.residual_proj = True
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.c_proj(self.gelu(self.c_fc(x))))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.d_model, bias=cfg.bias)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.d_model, bias=cfg.bias)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.config = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.wpe = nn.Embedding(cfg.context, cfg.d_model)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.d_model, bias=cfg.bias)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        self.lm_head.weight = self.wte.weight  # weight tying
        self.apply(self._init_weights)

    def _init_weights(self, m: nn.Module) -> None:
        if isinstance(m, nn.Linear):
            std = 0.02
            if getattr(m, "residual_proj", False):
                std = 0.02 / math.sqrt(2 * self.config.n_layer)
            nn.init.normal_(m.weight, mean=0.0, std=std)
            if m.bias is not None:
                nn.init.zeros_(m.bias)
        elif isinstance(m, nn.Embedding):
            nn.init.normal_(m.weight, mean=0.0, std=0.02)
        elif isinstance(m, nn.LayerNorm):
            nn.init.ones_(m.weight)
            if m.bias is not None:
                nn.init.zeros_(m.bias)

    def num_params(self, non_embedding: bool = False) -> int:
        n = sum(p.numel() for p in self.parameters())  # tied weight counted once
        if non_embedding:
            n -= self.wpe.weight.numel()
        return n

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None):
        B, T = idx.shape
        if T > self.config.context:
            raise ValueError(f"sequence length {T} exceeds context {self.config.context}")
        pos = torch.arange(T, dtype=torch.long, device=idx.device)
        x = self.drop(self.wte(idx) + self.wpe(pos))
        for block in self.blocks:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))
        return logits, loss
