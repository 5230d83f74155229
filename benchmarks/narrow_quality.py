"""Training quality with tensors of narrow rows: AdamW and Gefen with ``narrow_rows="rows"`` (per-row
state), ``"span"`` (D16, blocks of rows), the default ``"auto"`` (D18: blocks of rows for rows of
fewer than 22 elements, per row above) and ``"rows8"`` (D19: as ``"auto"``, with rows of 22-79 elements
keeping their scale and second moment in one-byte codes), paired by seed.

    python benchmarks/narrow_quality.py [--seeds 0,1,2,3,4] [--out docs/results/narrow_quality.json] [--write]

Workloads (CPU, 1 thread; every one has quantized tensors whose rows hold fewer than 80 elements):

* ``recsys``: rating prediction by matrix factorisation, the shape of a recommender: user and item
  embeddings ``(8000, 16)`` and ``(6000, 16)``, per-user and per-item biases ``(8000, 1)`` and
  ``(6000, 1)``, users and items drawn with Zipf popularity (most rows see few gradients), ratings
  from a rank-8 teacher with biases and noise; MSE, 1,500 steps of batch 256, lr 3e-3, betas (0.9, 0.999),
  no weight decay; held-out MSE on 20,000 fixed pairs.
* ``bag``: sparse Zipf features through an ``EmbeddingBag(3000, 4)`` and a ``Linear(4, 8)`` (the test
  of ``tests/test_span.py``), 300 steps, lr 1e-2; held-out MSE.
* ``narrow_mlp``: an MLP whose first weight is ``(256, 32)`` (a narrow input layer) regressing a tanh
  teacher, 300 steps, lr 1e-3 (``tests/_workloads.py``'s ``dead_first_batch_mlp`` with a whole first
  batch); held-out MSE.
* ``dense4_mlp``, ``dense8_mlp``, ``dense16_mlp``: the ``narrow_mlp`` regression with inputs of 4, 8
  and 16 features into hidden layers of 1024, 1024 and 512 units: first weights ``(1024, 4)``,
  ``(1024, 8)`` and ``(512, 16)``, dense layers of rows too narrow for one byte per row within 1.1
  B/param (docs/algorithm.md, D16); not in the default ``--workloads``.
* ``digits``: ``tests/test_quality.py``'s classifier of scikit-learn's 8x8 digits (``Linear(64, 256)``
  first: a dense layer whose weight has rows of 64 elements), 300 steps of batch 64, lr 2e-3,
  weight decay 0.01; the *training* loss of the last 50 steps, the test's measure (its held-out
  loss, ~0.1, is dominated by a few over-confident mistakes).

Reported per workload: every seed's held-out loss per optimizer, each Gefen setting's gap to AdamW
per seed and its mean with a 95% t-interval, and the state bytes per parameter. ``--write`` splices
the table into docs/algorithm.md (``narrow_quality`` markers).
"""
from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from pathlib import Path

import torch
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks"), str(ROOT / "tests")]

from _docs import output_args, run_meta, run_or_load  # noqa: E402
from gefen_dist import Gefen  # noqa: E402

OPTS = ("adamw", "gefen_rows", "gefen_span", "gefen_auto", "gefen_rows8")
T95 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262}


def make_opt(name, params, **kw):
    if name == "adamw":
        return torch.optim.AdamW(params, **kw)
    if name == "gefen_auto":  # the default (D18): span below 22 elements per row, per row above
        return Gefen(params, **kw)
    if name == "gefen_rows8":  # D19: span below 22 elements, one-byte row codes for 22-79
        return Gefen(params, narrow_rows="rows8", **kw)
    return Gefen(params, narrow_rows="span" if name == "gefen_span" else "rows", **kw)


def state_bytes(opt, params) -> float:
    n = sum(p.numel() for p in params)
    b = sum(t.numel() * t.element_size() for st in opt.state.values() for k, t in st.items()
            if isinstance(t, torch.Tensor) and k not in ("step", "codebook"))
    return b / n


class MF(nn.Module):
    def __init__(self, users=8000, items=6000, d=16):
        super().__init__()
        self.u, self.v = nn.Embedding(users, d), nn.Embedding(items, d)
        self.ub, self.ib = nn.Embedding(users, 1), nn.Embedding(items, 1)
        for e in (self.u, self.v):
            nn.init.normal_(e.weight, std=0.1)
        for e in (self.ub, self.ib):
            nn.init.zeros_(e.weight)
        self.mu = nn.Parameter(torch.zeros(()))

    def forward(self, uid, iid):
        return (self.u(uid) * self.v(iid)).sum(-1) + self.ub(uid)[:, 0] + self.ib(iid)[:, 0] + self.mu


def recsys(name, seed, steps=1500, batch=256, users=8000, items=6000):
    g = torch.Generator().manual_seed(1234)  # the task: the same for every seed and optimizer
    pu = 1.0 / torch.arange(1, users + 1, dtype=torch.float64) ** 0.9
    pi = 1.0 / torch.arange(1, items + 1, dtype=torch.float64) ** 0.9
    pu, pi = (pu / pu.sum()).float(), (pi / pi.sum()).float()
    tu, tv = torch.randn(users, 8, generator=g) * 0.5, torch.randn(items, 8, generator=g) * 0.5
    tub, tib = torch.randn(users, generator=g), torch.randn(items, generator=g)

    def pairs(n, gen):
        uid = torch.multinomial(pu, n, replacement=True, generator=gen)
        iid = torch.multinomial(pi, n, replacement=True, generator=gen)
        r = (tu[uid] * tv[iid]).sum(-1) + tub[uid] + tib[iid] + 0.3 * torch.randn(n, generator=gen)
        return uid, iid, r

    eu, ei, er = pairs(20_000, torch.Generator().manual_seed(99))
    torch.manual_seed(seed)
    model = MF(users, items)
    params = list(model.parameters())
    opt = make_opt(name, params, lr=3e-3, betas=(0.9, 0.999), weight_decay=0.0)
    gen = torch.Generator().manual_seed(10_000 + seed)
    for _ in range(steps):
        uid, iid, r = pairs(batch, gen)
        opt.zero_grad(set_to_none=True)
        nn.functional.mse_loss(model(uid, iid), r).backward()
        opt.step()
    with torch.no_grad():
        return float(nn.functional.mse_loss(model(eu, ei), er)), state_bytes(opt, params)


def bag(name, seed):
    from test_span import _embedding_bag

    seen = {}

    def mk(ps):
        seen["opt"] = make_opt(name, ps, lr=1e-2, betas=(0.9, 0.999), weight_decay=0.0)
        seen["params"] = list(ps)
        return seen["opt"]

    loss = _embedding_bag(mk, seed=seed)
    return loss, state_bytes(seen["opt"], seen["params"])


def _dense_narrow(din: int, h: int):
    """The ``narrow_mlp`` regression with a first weight ``(h, din)``: every row is a hidden unit
    (dense gradients)."""
    def workload(name, seed):
        from _workloads import dead_first_batch_mlp

        seen = {}

        def mk(ps):
            ps = list(ps)
            seen["opt"], seen["params"] = make_opt(name, ps, lr=1e-3, betas=(0.9, 0.999), weight_decay=0.0), ps
            return seen["opt"]

        loss = dead_first_batch_mlp(mk, seed=seed, density=1.0, din=din, h=h)[1]
        return loss, state_bytes(seen["opt"], seen["params"])

    return workload


narrow_mlp = _dense_narrow(32, 256)


def digits(name, seed):
    from test_quality import _train_digits

    seen = {}

    def mk(ps, **kw):
        ps = list(ps)
        seen["opt"], seen["params"] = make_opt(name, ps, **kw), ps
        return seen["opt"]

    loss, _ = _train_digits(mk, seed)
    return loss, state_bytes(seen["opt"], seen["params"])


WORKLOADS = {"recsys": recsys, "bag": bag, "narrow_mlp": narrow_mlp, "digits": digits}
# dense layers of rows of 4-16 elements (run with --workloads)
EXTRA = {"dense4_mlp": _dense_narrow(4, 1024), "dense8_mlp": _dense_narrow(8, 1024),
         "dense16_mlp": _dense_narrow(16, 512)}


def summary(res: dict) -> dict:
    out = {}
    for wl, runs in res["runs"].items():
        seeds = sorted(runs, key=int)
        row = {}
        for name in [o for o in OPTS[1:] if all(o in runs[s] for s in seeds)]:
            gaps = [100.0 * (runs[s][name]["loss"] / runs[s]["adamw"]["loss"] - 1.0) for s in seeds]
            m = statistics.fmean(gaps)
            half = T95.get(len(gaps) - 1, 2.0) * statistics.stdev(gaps) / math.sqrt(len(gaps)) if len(gaps) > 1 else float("nan")
            row[name] = dict(gaps=gaps, mean=m, lo=m - half, hi=m + half,
                             bytes=statistics.fmean(runs[s][name]["bytes"] for s in seeds))
        row["adamw_bytes"] = statistics.fmean(runs[s]["adamw"]["bytes"] for s in seeds)
        out[wl] = row
    return out


def table(res: dict) -> str:
    cmd = "python benchmarks/narrow_quality.py --from-json docs/results/narrow_quality.json --write"
    lines = [f"<!-- generated by `{cmd}`; do not edit -->", "",
             f"{res['cpu']}, torch {res['torch']}, {res['date']}; held-out loss (`digits`: training loss) against AdamW, "
             "paired by seed "
             f"(seeds {', '.join(map(str, res['seeds']))}), mean and 95% t-interval; state bytes per parameter "
             "of the whole model (exact 1-D tensors included).", "",
             "| workload | AdamW B/param | `rows` gap, per seed | B/param | `span` gap, per seed | B/param "
             "| default (`auto`) gap, per seed | B/param | `rows8` gap, per seed | B/param |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for wl, row in res["summary"].items():
        cells = []
        for name in OPTS[1:]:
            r = row.get(name)
            if r is None:  # a stored run from before the option
                cells += ["(not run)", ""]
                continue
            cells.append(f"**{r['mean']:+.2f}%** [{r['lo']:+.2f}%, {r['hi']:+.2f}%]; "
                         + ", ".join(f"{g:+.2f}%" for g in r["gaps"]))
            cells.append(f"{r['bytes']:.3f}")
        lines.append(f"| `{wl}` | {row['adamw_bytes']:.2f} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def run(args, argv) -> dict:
    torch.set_num_threads(1)
    seeds = [int(s) for s in args.seeds.split(",")]
    res = dict(command="python benchmarks/narrow_quality.py " + " ".join(sys.argv[1:] if argv is None else argv),
               seeds=seeds, **run_meta(), runs={})
    for wl in args.workloads.split(","):
        res["runs"][wl] = {}
        for seed in seeds:
            res["runs"][wl][str(seed)] = {}
            for name in OPTS:
                t0 = time.perf_counter()
                loss, b = {**WORKLOADS, **EXTRA}[wl](name, seed)
                res["runs"][wl][str(seed)][name] = dict(loss=loss, bytes=b, seconds=time.perf_counter() - t0)
                print(f"{wl} seed {seed} {name}: loss {loss:.5f}, {b:.3f} B/param", flush=True)
    res["summary"] = summary(res)
    return res


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", default="0,1,2,3,4")
    ap.add_argument("--workloads", default=",".join(WORKLOADS))
    output_args(ap, "docs/algorithm.md")
    args = ap.parse_args(argv)
    run_or_load(args, lambda: run(args, argv), table, ROOT / "docs" / "algorithm.md", "narrow_quality")


if __name__ == "__main__":
    main()
