"""Small training workloads shared by the tests and the research scripts that measured them."""
from __future__ import annotations

from typing import Callable, Optional

import torch
from torch import nn


def dead_first_batch_mlp(make_opt: Callable, *, seed: int = 0, steps: int = 300, density: float = 0.01,
                         din: int = 32, h: int = 256, dout: int = 10, batch: int = 128, tscale: float = 10.0,
                         before: Optional[Callable] = None, after: Optional[Callable] = None):
    """ReLU MLP din-h-h-dout regressing a tanh teacher (MSE); the first gradient is masked to
    ``density`` of its elements (a mostly-dead first batch; 1.0 leaves it whole), then ``steps``
    normal steps. ``make_opt(params)`` builds the optimizer; ``before``/``after`` run around each
    ``step()``. Returns ``(loss before training, loss after, model)`` on a fixed held-out set."""
    torch.manual_seed(12345)
    teacher = nn.Sequential(nn.Linear(din, 256), nn.Tanh(), nn.Linear(256, dout))
    with torch.no_grad():
        teacher[2].weight.mul_(tscale)
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(din, h), nn.ReLU(), nn.Linear(h, h), nn.ReLU(), nn.Linear(h, dout))
    opt = make_opt(model.parameters())
    g = torch.Generator().manual_seed(2000 + seed)
    xe = torch.randn(1024, din, generator=g)
    with torch.no_grad():
        ye = teacher(xe)

    def held_out() -> float:
        with torch.no_grad():
            return float(nn.functional.mse_loss(model(xe), ye))

    loss0 = held_out()
    for t in range(steps + 1):
        x = torch.randn(batch, din, generator=g)
        with torch.no_grad():
            y = teacher(x)
        opt.zero_grad(set_to_none=True)
        nn.functional.mse_loss(model(x), y).backward()
        if t == 0 and density < 1.0:
            for q in model.parameters():
                q.grad.mul_((torch.rand(q.shape, generator=g) < density).float())
        if before is not None:
            before()
        opt.step()
        if after is not None:
            after()
    return loss0, held_out(), model


def head_regression(make_opt: Callable, *, seed: int = 0, hidden: int = 4096, steps: int = 600, batch: int = 256):
    """``Linear(1, hidden) -> ReLU -> Linear(hidden, 1)`` fitting a sum of 16 random sinusoids of a
    scalar in [-2, 2] (MSE): a dense single-output head whose first gradient (error x ReLU features)
    is mostly of one sign. ``make_opt(model)`` builds the optimizer (the model, so that it can put the
    head ``model[2].weight`` in a group of its own). Returns ``(held-out MSE on 4,096 evenly spaced
    points, optimizer, model)``. ``tests/test_codebook_sign.py`` and ``research/head_regression.py``
    (D15, D17) train it."""
    g = torch.Generator().manual_seed(4321)  # the task: the same for every seed and optimizer
    w, b, a = torch.randn(16, generator=g) * 3, torch.rand(16, generator=g) * 6.283, torch.randn(16, generator=g)

    def f(x):
        return (a * torch.sin(x * w + b)).sum(-1, keepdim=True)

    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(1, hidden), nn.ReLU(), nn.Linear(hidden, 1))
    opt = make_opt(model)
    gen = torch.Generator().manual_seed(10_000 + seed)
    for _ in range(steps):
        x = torch.rand(batch, 1, generator=gen) * 4 - 2
        opt.zero_grad(set_to_none=True)
        nn.functional.mse_loss(model(x), f(x)).backward()
        opt.step()
    ex = torch.linspace(-2, 2, 4096).unsqueeze(1)
    with torch.no_grad():
        return float(nn.functional.mse_loss(model(ex), f(ex))), opt, model
