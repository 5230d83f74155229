"""How well can each low-memory second-moment estimator stand in for AdamW's per-element v?

Trains the byte-level GPT with torch AdamW (the quality benchmark's recipe: ``small`` preset,
batch 32, lr 2e-3 with 50 warm-up steps and the 800-step cosine, betas (0.9, 0.95), weight decay
0.1 on >=2-D tensors) for ``--steps`` steps, then, for every tensor Gefen quantizes (>=2-D, >=4096
elements), compares AdamW's ``exp_avg_sq`` v with estimates built from v itself:

* ``factored`` (Gefen's default, Adafactor's estimator): ``r_i c_j / mean(c)`` with r, c the row
  and column means of v. Row and column means of an EMA are the EMAs of row and column means of
  g^2, so this is exactly what ``second_moment="factored"`` would hold after the same gradients.
* ``row``: one v per dim-0 row (Adam-mini's choice for embeddings); ``col``: one per column.
* ``shared{B}``: one v per block of B consecutive elements of a row (the paper's shared second
  moment with period B).
* ``fac*blk{B}``: the factored estimate times a per-block correction (the block's mean of v over
  the estimate).
* ``grp{K}``: the factored estimate with K column profiles: rows ranked by their mean of v and
  split into K equal quantile groups, each group factored on its own (``r_i c^k_j / mean(c^k)``,
  ``c^k`` the column means over the group's rows): the ``(j)`` variants of research/quality_variants.py.

The number is the mean over elements of ``|log2(sigma_hat / sigma)|`` with ``sigma = 1/sqrt(v)``: how
many doublings the estimator's per-element step size is off, on average (0 = exact; 0.5 = off by
~1.41x). It says which tensors an estimator gets wrong, not how much loss that costs (see the ``h_``
variants of research/quality_variants.py for that).

A second table gives the direction of the ``factored`` estimate's error, per tensor: the signed
mean of ``log2(sigma_hat / sigma)`` (> 0: larger steps than AdamW's), the ratio of the RMS of the
update ``m / sqrt(v_hat)`` to AdamW's ``m / sqrt(v)`` (with AdamW's own m), and the fractions of
elements whose step size is more than 2x too large or too small.

    python research/v_estimators.py [--steps 400] [--seed 0]      # ~3 minutes, 1 thread

Writes research/results/v_estimators_small.json and .md, and splices the table into research/quality-log.md.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent / "benchmarks"), str(HERE.parent)]
import quality as Q  # noqa: E402
from _docs import splice  # noqa: E402

BLOCKS = (8, 32, 64)
GROUPS = (4,)


def estimates(v: torch.Tensor) -> dict:
    """Each estimator's stand-in for v ([rows, cols], float64)."""
    r, c = v.mean(1, keepdim=True), v.mean(0, keepdim=True)
    fac = r * c / c.mean()
    out = {"factored": fac, "row": r.expand_as(v), "col": c.expand_as(v)}
    R, C = v.shape
    for k in GROUPS:
        e = torch.empty_like(v)
        for rows in r.reshape(-1).argsort().chunk(k):  # k quantile groups of rows by their mean v
            ck = v[rows].mean(0, keepdim=True)
            e[rows] = r[rows] * ck / ck.mean()
        out[f"grp{k}"] = e
    for b in BLOCKS:
        if C % b:
            continue
        vb, fb = v.reshape(R, C // b, b), fac.reshape(R, C // b, b)
        out[f"shared{b}"] = vb.mean(-1, keepdim=True).expand_as(vb).reshape(R, C)
        out[f"fac*blk{b}"] = (fb * (vb / fb).mean(-1, keepdim=True)).reshape(R, C)
    return out


def direction(v: torch.Tensor, m: torch.Tensor, e: torch.Tensor) -> dict:
    """Signed error of an estimate ``e`` of ``v`` (all [rows, cols], float64), as step sizes."""
    ratio = (v / e).sqrt()  # sigma_hat / sigma
    return dict(bias=float(ratio.log2().mean()), rms_step=float((m / e.sqrt()).norm() / (m / v.sqrt()).norm()),
                over2x=float((ratio > 2).double().mean()), under2x=float((ratio < 0.5).double().mean()))


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    from launch.corpus import Batches, load_corpus
    from launch.gpt import GPT, get_config

    t0 = time.time()
    train, _, _ = load_corpus()
    cfg = dict(preset="small", batch=32, context=128, steps=800, warmup=50, lr=2e-3, min_lr_frac=0.1)
    torch.manual_seed(args.seed)
    model = GPT(get_config(cfg["preset"], context=cfg["context"]))
    batches = Batches(train, cfg["batch"], cfg["context"], seed=args.seed)
    opt = Q.make_optimizer("adamw", model, 0.1, cfg["lr"], (0.9, 0.95), args.seed)
    for t in range(args.steps):
        Q.set_lr(opt, cfg["lr"] * Q.lr_mult(t, cfg["steps"], cfg["warmup"], cfg["min_lr_frac"]))
        x, y = batches(t)
        opt.zero_grad(set_to_none=True)
        loss = model(x, y)[1]
        loss.backward()
        opt.step()
    rows = []
    for name, p in model.named_parameters():
        if p.ndim < 2 or p.numel() < 4096:
            continue
        v = opt.state[p]["exp_avg_sq"].double().reshape(p.shape[0], -1) + 1e-30
        est = estimates(v)
        errs = {k: float((0.5 * (e / v).log2()).abs().mean()) for k, e in est.items()}
        m = opt.state[p]["exp_avg"].double().reshape(p.shape[0], -1)
        rows.append(dict(tensor=name, shape=list(p.shape), numel=p.numel(), errors=errs,
                         factored_direction=direction(v, m, est["factored"])))
    keys = list(rows[0]["errors"])
    head = (f"<!-- generated by research/v_estimators.py --steps {args.steps} --seed {args.seed}; do not edit -->\n\n"
            f"AdamW's v after {args.steps} steps of the `small` preset (seed {args.seed}, train loss "
            f"{loss.item():.3f}); mean over elements of |log2(sigma_hat / sigma)|, sigma = 1/sqrt(v) "
            "(0 = exact). `wte` is the token embedding tied to the LM head.\n\n")
    md = [head + "| tensor | shape | " + " | ".join(f"`{k}`" for k in keys) + " |",
          "|---|---|" + "---|" * len(keys)]
    for r in rows:
        best = min(r["errors"].values())
        cells = [f"**{x:.2f}**" if x == best else f"{x:.2f}" for x in r["errors"].values()]
        md.append(f"| `{r['tensor']}` | {tuple(r['shape'])} | " + " | ".join(cells) + " |")
    tot = sum(r["numel"] for r in rows)
    md.append("| **all (weighted by elements)** | | " + " | ".join(
        f"{sum(r['errors'][k] * r['numel'] for r in rows) / tot:.2f}" for k in keys) + " |")
    md += ["", "Direction of the `factored` estimate's error (same run): signed mean of log2(sigma_hat / sigma) "
           "(> 0: steps larger than AdamW's), RMS of its update m / sqrt(v_hat) over AdamW's m / sqrt(v), and the "
           "fractions of elements stepped more than 2x too far / too short.", "",
           "| tensor | signed bias | RMS step vs AdamW | > 2x too large | > 2x too small |", "|---|---|---|---|---|"]
    for r in rows:
        d = r["factored_direction"]
        md.append(f"| `{r['tensor']}` | {d['bias']:+.2f} | {d['rms_step']:.2f}x | {d['over2x']:.1%} | {d['under2x']:.1%} |")
    text = "\n".join(md) + "\n"
    res = HERE / "results"
    (res / "v_estimators_small.json").write_text(json.dumps(dict(steps=args.steps, seed=args.seed,
                                                                 train_loss=loss.item(), rows=rows), indent=1))
    (res / "v_estimators_small.md").write_text(text)
    spliced = splice(HERE / "quality-log.md", "v_estimators_small.md", text)
    print(text)
    print(f"wrote research/results/v_estimators_small.json and .md{' (spliced into research/quality-log.md)' if spliced else ''} "
          f"in {time.time() - t0:.0f} s")


if __name__ == "__main__":
    main()
