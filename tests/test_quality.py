"""Gefen against torch AdamW on real workloads with identical hyperparameters, seeds and data.

Target (issue: core): Gefen's loss after a fixed budget is within 2% of AdamW's. Budgets are
small so CI stays fast; benchmarks/quality.py runs the long versions.
"""
import pytest
import torch
from torch import nn

from gefen_dist import Gefen


def _digits():
    datasets = pytest.importorskip("sklearn.datasets", reason="scikit-learn ships the digits data")
    d = datasets.load_digits()
    x = torch.tensor(d.data, dtype=torch.float32) / 16.0
    y = torch.tensor(d.target)
    g = torch.Generator().manual_seed(0)
    perm = torch.randperm(len(y), generator=g)
    x, y = x[perm], y[perm]
    n_val = 360
    return (x[n_val:], y[n_val:]), (x[:n_val], y[:n_val])


def _train_digits(opt_cls):
    (xt, yt), (xv, yv) = _digits()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 256), nn.GELU(), nn.Linear(256, 10))
    opt = opt_cls(model.parameters(), lr=2e-3, betas=(0.9, 0.999), weight_decay=0.01)
    g = torch.Generator().manual_seed(1)
    steps, tail, train_loss = 300, 50, 0.0
    for s in range(steps):
        i = torch.randint(0, len(yt), (64,), generator=g)
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model(xt[i]), yt[i])
        loss.backward()
        opt.step()
        if s >= steps - tail:
            train_loss += loss.item() / tail
    with torch.no_grad():
        logits = model(xv)
        return train_loss, (logits.argmax(1) == yv).float().mean().item()


def test_digits_classifier_close_to_adamw():
    """Training loss (what the optimizer minimises, mean of the last 50 steps) within 2% of AdamW's
    and held-out accuracy within one point. The held-out *loss* is not asserted: at ~0.1 it is
    dominated by a few over-confident mistakes, and Gefen's is measurably higher there
    (docs/quality.md reports it: +8% with the default factored second moment, +14% with the
    paper's shared one)."""
    loss_a, acc_a = _train_digits(torch.optim.AdamW)
    loss_g, acc_g = _train_digits(Gefen)
    assert loss_g <= loss_a * 1.02, (loss_g, loss_a)
    assert acc_g >= acc_a - 0.01, (acc_g, acc_a)


def test_byte_lm_close_to_adamw():
    from launch.corpus import load_corpus
    from launch.gpt import GPT, get_config

    train, val, _ = load_corpus()
    cfg = get_config("tiny")
    ctx, bs, steps = cfg.context, 16, 200

    def batch(data, gen):
        i = torch.randint(0, len(data) - ctx - 1, (bs,), generator=gen)
        x = torch.stack([data[j:j + ctx] for j in i.tolist()]).long()
        y = torch.stack([data[j + 1:j + ctx + 1] for j in i.tolist()]).long()
        return x, y

    def run(opt_cls):
        torch.manual_seed(0)
        model = GPT(cfg)
        decay = [p for p in model.parameters() if p.ndim >= 2]
        no_decay = [p for p in model.parameters() if p.ndim < 2]
        opt = opt_cls([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                      lr=3e-3, betas=(0.9, 0.95))
        g = torch.Generator().manual_seed(1)
        for _ in range(steps):
            x, y = batch(train, g)
            opt.zero_grad()
            model(x, y)[1].backward()
            opt.step()
        gv = torch.Generator().manual_seed(2)
        with torch.no_grad():
            return sum(model(*batch(val, gv))[1].item() for _ in range(10)) / 10

    la, lg = run(torch.optim.AdamW), run(Gefen)
    assert lg <= la * 1.02, (lg, la)
