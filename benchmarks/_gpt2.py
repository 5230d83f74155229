"""The GPT-2-small tensor set shared by the benchmarks (nanoGPT layout, 124,439,808 parameters)."""
from __future__ import annotations

import math
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from gefen_dist.core.periods import PERIOD_CAP, divisors  # noqa: E402

GPT2_PARAMS = 124_439_808


GPT2_CONFIGS = {"small": (768, 12), "medium": (1024, 24), "large": (1280, 36), "xl": (1600, 48)}


def gpt2_shapes(size: str = "small"):
    """(name, shape) of every GPT-2 parameter (nn.Linear weights as (out, in); wte tied); ``size``
    one of ``GPT2_CONFIGS`` (small: 124,439,808 parameters; xl: 1,557,611,200)."""
    (d, L), V, T = GPT2_CONFIGS[size], 50257, 1024
    out = [("wte", (V, d)), ("wpe", (T, d))]
    for i in range(L):
        b = f"h.{i}."
        out += [
            (b + "ln_1.weight", (d,)), (b + "ln_1.bias", (d,)),
            (b + "attn.c_attn.weight", (3 * d, d)), (b + "attn.c_attn.bias", (3 * d,)),
            (b + "attn.c_proj.weight", (d, d)), (b + "attn.c_proj.bias", (d,)),
            (b + "ln_2.weight", (d,)), (b + "ln_2.bias", (d,)),
            (b + "mlp.c_fc.weight", (4 * d, d)), (b + "mlp.c_fc.bias", (4 * d,)),
            (b + "mlp.c_proj.weight", (d, 4 * d)), (b + "mlp.c_proj.bias", (d,)),
        ]
    out += [("ln_f.weight", (d,)), ("ln_f.bias", (d,))]
    assert size != "small" or sum(math.prod(s) for _, s in out) == GPT2_PARAMS
    return out


def capped_period(row: int) -> int:
    """The paper's cap applied to a row length (a period above 1024 becomes its smallest divisor
    above 1024)."""
    return row if row <= PERIOD_CAP else next(x for x in divisors(row) if x > PERIOD_CAP)
