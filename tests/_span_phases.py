"""One check for every implementation of D16's span phases (native CPU, Triton) against
``core/span.py``: the pieces, and the comparison (used by tests/test_span.py and
tests/test_triton_step.py)."""
from __future__ import annotations

import math

import torch

# (global shape, first element, elements): whole rows as an FSDP2 shard holds them, or rows cut at
# either end as at a DeepSpeed partition edge; blocks cut at both ends
PIECES = [((5000, 1), 0, 5000), ((4999, 2), 0, 9998), ((3001, 10), 2050, 13330), ((1000, 79), 237, 39500),
          ((700, 3, 3), 0, 6300), ((999, 40), 1040, 40), ((3001, 10), 2047, 13339), ((1000, 79), 5, 70),
          ((4999, 2), 2047, 3)]
# blocks of one row (D19, narrow_rows="rows8": the span kernels with a scale and v per row): whole
# rows, and rows cut at both ends
PIECES_ROWS = [((1000, 40), 0, 40000), ((999, 22), 1043, 4000), ((300, 79), 0, 23700)]
DTYPES = [torch.float32, torch.bfloat16]
BOUND_WD = [(None, 0.0), (1.5, 0.1), (0.01, 0.0)]


def check_phases_equal_the_reference(impl, shape, start, n, dtype, bound, wd, rows: bool = False) -> None:
    """``impl``'s ``span_statistics`` / ``span_update_`` against the reference's on one piece: the
    first moment, the block maxima, indices, scales, ``v`` and the parameter bitwise (some blocks
    with a zero scale); the float64 sums of ``g^2`` to 1e-13 (added in another order). On whole rows,
    the update alone from the new indices and state (``span_apply_indices_``, ZeroGefen's other
    ranks) of both gives the phase's parameter bitwise. ``rows``: blocks of one row (D19)."""
    from gefen_dist.core import rows8
    from gefen_dist.core import span as ref

    gen = torch.Generator().manual_seed(n + start)
    S = math.prod(shape[1:])
    sp = ref.SpanPiece.of(shape, start, n)
    sp = rows8.kernel_piece(sp) if rows else sp
    nrows = -(-n // S)
    cb = torch.sort(torch.cat([torch.tensor([-1.0, 0.0, 1.0]), torch.rand(253, generator=gen) * 2 - 1]))[0]
    g = (torch.randn(nrows, S, generator=gen) * torch.exp(torch.randn(nrows, 1, generator=gen))).to(dtype).view(-1)[:n]
    idx = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=gen)
    scale = torch.rand(sp.nb, generator=gen) * 1e-2
    scale[::3] = 0.0
    out = [i.span_statistics(g, idx, scale, cb, sp, 0.9) for i in (ref, impl)]
    for name, a, b in zip(("m", "col", "blk", "amax"), *out):
        if a.dtype == torch.float64:
            torch.testing.assert_close(b, a, rtol=1e-13, atol=0, msg=name)
        else:
            assert torch.equal(a.reshape(-1), b.reshape(-1)), name
    m, col, blk, amax = out[0]
    amax = amax.clone()
    amax[1::4] = 0.0  # blocks whose new scale is zero: z = 0
    p0 = (torch.randn(n, generator=gen) * 0.02).to(dtype)
    vb0, vc0 = torch.rand(sp.nb, generator=gen) * 1e-6, torch.rand(S, generator=gen) * 1e-6
    res = []
    for i in (ref, impl):
        st = [p0.clone(), idx.clone(), scale.clone(), vb0.clone(), vc0.clone()]
        i.span_update_(*st, m, col, blk, amax, cb, sp, lr=1e-3, beta2=0.999, eps=1e-8, weight_decay=wd,
                       bc1=0.19, bc2=0.002, bound=bound, beta1=0.9)
        res.append(st)
    for name, a, b in zip(("param", "idx", "scale", "v_blk", "v_col"), *res):
        assert torch.equal(a, b), (name, int((a != b).sum()))
    if sp.whole_rows:
        _, new_idx, new_scale, vb, vc = res[0]
        for i in (ref, impl):
            p = p0.clone()
            i.span_apply_indices_(p, new_idx, new_scale, vb, vc, cb, sp, lr=1e-3, eps=1e-8, weight_decay=wd,
                                  bc1=0.19, bc2=0.002, bound=bound)
            assert torch.equal(p, res[0][0]), (i.__name__, int((p != res[0][0]).sum()))
