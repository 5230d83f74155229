"""The issue's five workloads, each run with AdamW, the library's Gefen (default, fused None and
False; shared) and the prototype mechanisms of ``mech.py``.

    python research/update_bound/workloads.py [--only posemb,valuehead,elementwise,bag,dead] \
        [--opts adamw,default,...] [--seeds 0] [--json out.json]

Every optimizer gets lr 1e-3, betas (0.9, 0.999), eps 1e-8, weight_decay 0.0. ``max_step``: the
largest |dp| / lr over all parameters and steps.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent.parent))
sys.path.insert(0, str(HERE.parent.parent / "tests"))

import torch
from torch import nn

import mech
from _workloads import dead_first_batch_mlp
from gefen_dist import Gefen

LR = 1e-3


def make(opt_name, params, sm="factored"):
    """Build optimizer ``opt_name`` (second moment ``sm`` for the Gefen variants other than
    "shared") and install its mechanism."""
    kw = dict(lr=LR, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)
    mech.use(None)
    if opt_name == "adamw":
        return torch.optim.AdamW(params, **kw)
    if opt_name == "default":
        return Gefen(params, second_moment=sm, **kw)  # fused=None: the native CPU kernel
    if opt_name == "default_eager":
        return Gefen(params, fused=False, second_moment=sm, **kw)
    if opt_name == "shared":
        return Gefen(params, fused=False, second_moment="shared", **kw)
    if opt_name == "patched_none":  # the re-implemented eager step, no mechanism
        mech.use("none")
        return Gefen(params, fused=False, second_moment=sm, **kw)
    name = opt_name
    for suffix in ("@shared", "@elementwise", "@factored"):
        if name.endswith(suffix):
            name, sm = name[: -len(suffix)], suffix[1:]
    m, mkw = mech.MECHS[name]
    mech.use(m, **mkw)
    return Gefen(params, fused=False, second_moment=sm, **kw)


class Tracker:
    def __init__(self, params):
        self.params = list(params)
        self.max_step = 0.0

    def before(self):
        self.prev = [p.detach().clone() for p in self.params]

    def after(self):
        for p, q in zip(self.params, self.prev):
            d = float((p.detach() - q).abs().max()) / LR
            self.max_step = max(self.max_step, d)


# ------------------------------------------------------------------ one-step workloads
def one_step(shape, opt_name, seed, second_moment=None, steps=1):
    torch.manual_seed(seed)
    p = nn.Parameter(torch.randn(shape) * 0.02)
    opt = make(opt_name, [p], sm=second_moment or "factored")
    tr = Tracker([p])
    for _ in range(steps):
        p.grad = torch.randn(shape)
        tr.before()
        opt.step()
        tr.after()
    worst = dict(mech.STATS["worst"] or {})
    mech.use(None)
    return dict(max_step=tr.max_step, worst=worst)


# ------------------------------------------------------------------ bag of features
def bag(opt_name, seed, steps=400, feats=2000, hidden=64, out=8, batch=64, active=8):
    g = torch.Generator().manual_seed(1000 + seed)
    zipf = 1.0 / torch.arange(1, feats + 1, dtype=torch.float64) ** 1.1
    zipf = (zipf / zipf.sum()).float()
    teacher = torch.randn(feats, out, generator=g) * 1.6

    def batch_at(t):
        gg = torch.Generator().manual_seed(10_000 * (seed + 1) + t)
        ids = torch.multinomial(zipf.expand(batch, feats), active, replacement=False, generator=gg)
        x = torch.zeros(batch, feats).scatter_(1, ids, 1.0)
        return x, x @ teacher

    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(feats, hidden), nn.ReLU(), nn.Linear(hidden, out))
    opt = make(opt_name, model.parameters())
    tr = Tracker(model.parameters())
    xe, ye = zip(*(batch_at(100_000 + i) for i in range(8)))
    xe, ye = torch.cat(xe), torch.cat(ye)

    def evaluate():
        with torch.no_grad():
            return float(nn.functional.mse_loss(model(xe), ye))

    l0 = evaluate()
    for t in range(steps):
        x, y = batch_at(t)
        opt.zero_grad(set_to_none=True)
        nn.functional.mse_loss(model(x), y).backward()
        tr.before()
        opt.step()
        tr.after()
    worst = dict(mech.STATS["worst"] or {})
    mech.use(None)
    wmax = max(float(p.detach().abs().max()) for p in model.parameters())
    return dict(max_step=tr.max_step, loss0=l0, loss=evaluate(), max_w=wmax, worst=worst)


# ------------------------------------------------------------------ dead first batch
def dead(opt_name, seed, steps=300, density=0.01, din=32, h=256, dout=10, batch=128, tscale=10.0):
    """ReLU MLP din-h-h-dout regressing a tanh teacher (MSE); the first gradient is masked to
    ``density`` of its elements (a mostly-dead first batch), then ``steps`` normal steps
    (the workload of tests/_workloads.py, with this script's tracker around each step)."""
    box = {}

    def make_opt(params):
        params = list(params)
        box["tr"] = Tracker(params)
        return make(opt_name, params)

    l0, loss, _ = dead_first_batch_mlp(make_opt, seed=seed, steps=steps, density=density, din=din, h=h,
                                       dout=dout, batch=batch, tscale=tscale,
                                       before=lambda: box["tr"].before(), after=lambda: box["tr"].after())
    worst = dict(mech.STATS["worst"] or {})
    mech.use(None)
    return dict(max_step=box["tr"].max_step, loss0=l0, loss=loss, worst=worst)


WORKLOADS = {
    "posemb": lambda o, s: one_step((1, 197, 768), o, s),
    "valuehead": lambda o, s: one_step((1, 4096), o, s),
    "elementwise": lambda o, s: one_step((1000, 1000), o, s, second_moment="elementwise"),
    "bag": bag,
    "dead": dead,
}

DEFAULT_OPTS = ["adamw", "default", "default_eager", "shared", "patched_none"] + list(mech.MECHS)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--only", default=",".join(WORKLOADS))
    ap.add_argument("--opts", default=",".join(DEFAULT_OPTS))
    ap.add_argument("--seeds", default="0")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    torch.set_num_threads(1)
    rows = []
    for w in a.only.split(","):
        for o in a.opts.split(","):
            for s in (int(x) for x in a.seeds.split(",")):
                t0 = time.perf_counter()
                r = WORKLOADS[w](o, s)
                r.update(workload=w, opt=o, seed=s, seconds=round(time.perf_counter() - t0, 2))
                rows.append(r)
                extra = "" if "loss" not in r else f" loss {r['loss0']:.3f} -> {r['loss']:.4f}"
                if "max_w" in r:
                    extra += f" max|W| {r['max_w']:.2f}"
                print(f"{w:12s} {o:18s} s{s} max|dp|/lr {r['max_step']:10.2f}{extra}  ({r['seconds']}s)", flush=True)
                if r.get("worst"):
                    print("    worst element:", {k: (round(v, 8) if isinstance(v, float) else v) for k, v in r["worst"].items()})
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
