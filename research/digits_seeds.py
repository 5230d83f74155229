"""Digits MLP, 300 steps: the training-loss gap of Gefen (default, and bound_updates=False) to AdamW,
paired by seed. Usage: python research/digits_seeds.py N_SEEDS (from the project root)."""
import sys, torch, statistics
sys.path.insert(0, "tests"); sys.path.insert(0, ".")
from torch import nn
import test_quality as tq
from gefen_dist import Gefen
torch.set_num_threads(1)
def run(opt_fn, seed):
    (xt, yt), (xv, yv) = tq._digits()
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 256), nn.GELU(), nn.Linear(256, 10))
    opt = opt_fn(model.parameters())
    g = torch.Generator().manual_seed(seed + 1)
    steps, tail, tl = 300, 50, 0.0
    for s in range(steps):
        i = torch.randint(0, len(yt), (64,), generator=g)
        opt.zero_grad(); loss = nn.functional.cross_entropy(model(xt[i]), yt[i]); loss.backward(); opt.step()
        if s >= steps - tail: tl += loss.item() / tail
    return tl
kw = dict(lr=2e-3, betas=(0.9, 0.999), weight_decay=0.01)
cfgs = {"adamw": lambda p: torch.optim.AdamW(p, **kw), "gefen": lambda p: Gefen(p, **kw),
        "gefen_nobound": lambda p: Gefen(p, bound_updates=False, **kw)}
res = {k: [] for k in cfgs}
for seed in range(int(sys.argv[1])):
    for k, f in cfgs.items():
        res[k].append(run(f, seed))
    print(seed, {k: round(v[-1], 5) for k, v in res.items()}, flush=True)
for k in ("gefen", "gefen_nobound"):
    gaps = [100 * (g / a - 1) for g, a in zip(res[k], res["adamw"])]
    m = statistics.mean(gaps); s = statistics.stdev(gaps) / len(gaps) ** 0.5
    print(k, "gap % per seed", [round(x, 2) for x in gaps], f"mean {m:+.2f} +- {1.96*s:.2f}")
