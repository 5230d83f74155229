"""Check research/update_bound/step_bound.diff applied to a copy of gefen_dist:

    rm -rf /tmp/ubpkg && mkdir -p /tmp/ubpkg && cp -r gefen_dist /tmp/ubpkg/ && \
        (cd /tmp/ubpkg && patch -p1 < $OLDPWD/research/update_bound/step_bound.diff) && \
        PYTHONPATH=/tmp/ubpkg python research/update_bound/check_diff.py

bound=None is bitwise the library's step; bound=K_t is bitwise the prototype's clamp (mech.py)."""
import sys, math, torch
import os
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gefen_dist, gefen_dist.core.step as S
assert gefen_dist.__file__.startswith("/tmp/ubpkg"), gefen_dist.__file__
torch.set_num_threads(1)
import mech
from gefen_dist import Gefen
def run(mode, bound_fn, shape=(64, 96), steps=5, patch=None):
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(shape) * 0.02)
    orig = dict(e=gefen_dist.optim.gefen.quantized_step_eager_, f=gefen_dist.optim.gefen.quantized_step_factored_eager_)
    if bound_fn is not None:
        def e(*a, **k): return S.quantized_step_eager_(*a, bound=bound_fn(k), **k)
        def f(*a, **k): return S.quantized_step_factored_eager_(*a, bound=bound_fn(k), **k)
        gefen_dist.optim.gefen.quantized_step_eager_, gefen_dist.optim.gefen.quantized_step_factored_eager_ = e, f
    if patch: mech.use(patch)
    opt = Gefen([p], lr=1e-3, betas=(0.9, 0.999), weight_decay=0.0, second_moment=mode, fused=False, small_threshold=256)
    g = torch.Generator().manual_seed(1)
    for t in range(steps):
        p.grad = torch.randn(shape, generator=g) * (torch.rand(shape, generator=g) < (0.01 if t == 0 else 1.0))
        opt.step()
    mech.use(None)
    gefen_dist.optim.gefen.quantized_step_eager_, gefen_dist.optim.gefen.quantized_step_factored_eager_ = orig["e"], orig["f"]
    return p.detach().clone()
K = lambda k: S.update_bound(k["beta1"], k["beta2"], mech.step_of(k["bc1"], k["bc2"], k["beta1"], k["beta2"]))
for mode in ("factored", "shared", "elementwise"):
    base = run(mode, None)
    none = run(mode, lambda k: None)
    proto_none = run(mode, None, patch="none")
    bnd = run(mode, K)
    proto = run(mode, None, patch="clamp")
    print(mode, "bound=None bitwise:", torch.equal(base, none), "| prototype none bitwise:", torch.equal(base, proto_none),
          "| bound=K vs prototype clamp max|diff|:", float((bnd - proto).abs().max()),
          "| bound changes params:", not torch.equal(base, bnd))
for t in (1, 2, 10, 100, 10**6):
    assert S.update_bound(0.9, 0.999, t) == mech.update_bound(0.9, 0.999, t) or abs(S.update_bound(0.9, 0.999, t) / mech.update_bound(0.9, 0.999, t) - 1) < 1e-14
print("update_bound matches mech.update_bound")
