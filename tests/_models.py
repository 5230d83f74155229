"""Small deterministic models and data shared by the tests (not a test module)."""
from __future__ import annotations

import torch
from torch import nn


class TinyLM(nn.Module):
    """The reference test vectors' TinyLM (vocab 256, 64-token context, 2 encoder layers), with
    switches to make it bias-free and to freeze norms / drop the positional embedding."""

    def __init__(self, d=256, heads=4, ff=1024, layers=2, ctx=64, bias=True, pos=True):
        super().__init__()
        self.tok = nn.Embedding(256, d)
        self.pos = nn.Embedding(ctx, d) if pos else None
        self.blocks = nn.ModuleList(
            nn.TransformerEncoderLayer(d, heads, ff, dropout=0.0, batch_first=True, bias=bias)
            for _ in range(layers)
        )
        self.norm = nn.LayerNorm(d, bias=bias)
        self.head = nn.Linear(d, 256, bias=bias)
        self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(ctx), persistent=False)

    def forward(self, x):
        h = self.tok(x)
        if self.pos is not None:
            h = h + self.pos(torch.arange(x.shape[1]))
        for b in self.blocks:
            h = b(h, src_mask=self.mask[: x.shape[1], : x.shape[1]], is_causal=True)
        return self.head(self.norm(h))


def markov_batches(n, batch=16, ctx=64, seed=0):
    """Causal next-token batches from a sparse random Markov chain over 256 tokens."""
    g = torch.Generator().manual_seed(seed)
    nxt = torch.randint(0, 256, (256, 4), generator=g)
    out = []
    for _ in range(n):
        cur = torch.randint(0, 256, (batch,), generator=g)
        seq = [cur]
        for _ in range(ctx):
            choice = torch.randint(0, 4, (batch,), generator=g)
            cur = nxt[cur, choice]
            seq.append(cur)
        s = torch.stack(seq, 1)
        out.append((s[:, :-1], s[:, 1:]))
    return out


def lm_loss(model, x, y):
    return nn.functional.cross_entropy(model(x).reshape(-1, 256), y.reshape(-1))
