"""Tests of ``research/narrow_variants.py`` (not collected by CI: ``python -m pytest research/tests``)."""
import importlib.util
from pathlib import Path

import torch

from gefen_dist import Gefen


def _mod():
    path = Path(__file__).resolve().parents[1] / "narrow_variants.py"
    spec = importlib.util.spec_from_file_location("narrow_variants", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _run(make, steps=6, shape=(700, 24)):
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(shape))
    opt = make([p])
    g = torch.Generator().manual_seed(1)
    for t in range(steps):
        grad = torch.randn(shape, generator=g) * torch.logspace(-3, 0, shape[0]).unsqueeze(1)
        grad[torch.arange(t, shape[0], 5)] = 0.0  # some rows without gradient
        p.grad = grad
        opt.step()
    return p.detach().clone()


def test_the_block_variant_is_the_library_span_step():
    """With both quantities per block the variant's replacement of the span phases is the library's
    eager span step bitwise (so the per-row variants differ from it only where they say)."""
    m = _mod()
    kw = dict(lr=1e-2, betas=(0.9, 0.999), weight_decay=0.01)
    ref = _run(lambda ps: Gefen(ps, narrow_rows="span", fused=False, **kw))
    var = _run(lambda ps: m.SpanVariant(ps, row_v=False, row_scale=False, **kw))
    assert torch.equal(ref, var)


def test_codes_keep_the_scale_above_the_row_maximum():
    """The one-byte scale of a row is at or above the row's maximum and within one code (2^(1/8))
    of it; the coded v is within one code of the value, zero stays zero."""
    m = _mod()
    v = m.SpanVariant([torch.nn.Parameter(torch.zeros(64, 8))], row_v=True, row_scale=True,
                      codes=m.CODES["span_rows8"])
    a = torch.rand(64, 1) * torch.logspace(-6, 0, 64).unsqueeze(1)
    a[3] = 0.0
    bid = torch.arange(64) // 16
    s = v._code_scale(a, bid, 4)
    assert bool((s >= a).all()) and bool((s[a > 0] <= a[a > 0] * 2 ** (1 / 8) * (1 + 1e-6)).all())
    x = torch.rand(64) * torch.logspace(-4, 0, 64)
    x[5] = 0.0
    c = v._code_v(x, bid, 4)
    ratio = c[x > 0] / x[x > 0]
    assert c[5] == 0 and bool((ratio >= 2 ** (-1 / 16) - 1e-6).all()) and bool((ratio <= 2 ** (1 / 16) + 1e-6).all())
