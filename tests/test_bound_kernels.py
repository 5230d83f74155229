"""The update bound (D13) in every implementation: the native CPU kernel and the Triton kernels
(through the interpreter) clamp the normalised update exactly where the eager reference does, and
the clamp binds on the gradients that made the unbounded update blow up (sparse gradients,
1-row tensors), so these tests fail if an implementation forgets it."""
import math
import os
import subprocess
import sys

import pytest
import torch

from gefen_dist.core.step import (bias_corrections, quantized_step_eager_, quantized_step_factored_eager_,
                                  update_bound)
from gefen_dist.kernels import cpu

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HP = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0)


def _codebook():
    from gefen_dist.kernels.dispatch import solve_codebook

    counts = torch.randint(1, 50, (4096,), generator=torch.Generator().manual_seed(0))
    return solve_codebook(counts).codebook.float()


def _sparse_grads(shape, steps, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=g) * (torch.rand(shape, generator=g) < 0.02) for _ in range(steps)]


def _run(step_fn, shape, mode, steps=4, bound=True, device="cpu"):
    rows, slab = shape
    n = rows * slab
    cb = _codebook().to(device)
    p = (torch.randn(n, generator=torch.Generator().manual_seed(1)) * 0.02).to(device)
    idx = torch.zeros(n, dtype=torch.uint8, device=device)
    moves = []
    if mode == "factored":
        B = 128 if slab % 128 == 0 else slab
        scale = torch.zeros(n // B, device=device)
        v_row, v_col = torch.zeros(rows, 1, device=device), torch.zeros(slab, device=device)
    else:
        P = slab if mode == "shared" else 1
        B = slab if mode == "shared" else (128 if slab % 128 == 0 else slab)
        scale, v = torch.zeros(n // B, device=device), torch.zeros(n // P, device=device)
    for t, gg in enumerate(_sparse_grads(shape, steps), start=1):
        g = gg.reshape(-1).to(device)
        bc1, bc2 = bias_corrections(t, HP["beta1"], HP["beta2"])
        kw = dict(HP, bc1=bc1, bc2=bc2, bound=update_bound(HP["beta1"], HP["beta2"], t) if bound else None)
        before = p.clone()
        if mode == "factored":
            cms = (gg * gg).mean(dim=0).to(device)
            step_fn[1](p, g, idx, scale, v_row, v_col, cb, cms, scale_block=B, **kw)
        else:
            step_fn[0](p, g, idx, scale, v, cb, period=P, scale_block=B, **kw)
        moves.append(float((p - before).abs().max()) / (HP["lr"] * update_bound(HP["beta1"], HP["beta2"], t)))
    return p.cpu(), idx.cpu(), scale.cpu(), moves


EAGER = (quantized_step_eager_, quantized_step_factored_eager_)
SHAPES = [(1, 4096), (64, 768), (197, 256)]
MODES = ["shared", "elementwise", "factored"]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("shape", SHAPES)
def test_eager_reference_binds_and_respects_the_bound(shape, mode):
    _, _, _, bounded = _run(EAGER, shape, mode)
    _, _, _, free = _run(EAGER, shape, mode, bound=False)
    assert max(bounded) <= 1.0 + 1e-5, bounded
    assert max(free) > 1.5, f"these gradients should exceed the bound without it: {free}"


@pytest.mark.skipif(not cpu.available(), reason="native CPU kernel unavailable (no C compiler)")
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("shape", SHAPES)
def test_native_kernel_clamps_as_the_reference(shape, mode):
    ref = _run(EAGER, shape, mode)
    out = _run((cpu.quantized_step_, cpu.quantized_step_factored_), shape, mode)
    assert max(out[3]) <= 1.0 + 1e-5, out[3]
    assert (ref[1] != out[1]).float().mean() <= 1e-3  # indices: same up to rounding-level ties
    torch.testing.assert_close(out[0], ref[0], rtol=0, atol=2e-6)


def test_triton_kernels_clamp_as_the_reference():
    """The Triton kernels through the interpreter (a subprocess: the interpreter is chosen when
    triton is imported)."""
    pytest.importorskip("triton")
    code = f"""
import sys, torch
sys.path.insert(0, {ROOT!r}); sys.path.insert(0, {os.path.join(ROOT, "tests")!r})
import _fast_interpreter; _fast_interpreter.install()
import test_bound_kernels as T
from gefen_dist.kernels import triton_step as tri
for shape in [(1, 512), (8, 256)]:
    for mode in T.MODES:
        ref = T._run(T.EAGER, shape, mode, steps=3)
        out = T._run((tri.quantized_step_, tri.quantized_step_factored_), shape, mode, steps=3)
        assert max(out[3]) <= 1.0 + 1e-5, (shape, mode, out[3])
        assert (ref[1] != out[1]).float().mean() <= 1e-3, (shape, mode)
        torch.testing.assert_close(out[0], ref[0], rtol=0, atol=2e-6)
print("OK triton bound")
"""
    env = dict(os.environ, TRITON_INTERPRET="1")
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0 and "OK triton bound" in r.stdout, r.stdout[-2000:] + r.stderr[-4000:]


def test_update_bound_values():
    assert update_bound(0.9, 0.999, 1) == pytest.approx(1.0)
    assert update_bound(0.9, 0.999, 10 ** 6) == pytest.approx(0.1 / math.sqrt(0.001 * (1 - 0.81 / 0.999)), rel=1e-9)
    assert update_bound(0.9, 0.95, 10 ** 6) == pytest.approx(1.1650, abs=1e-4)
    with pytest.raises(ValueError, match="step must be >= 1"):
        update_bound(0.9, 0.999, 0)
