"""Why the update bound is relaxed in the first steps (D13): the `base` LM's first steps under each clamp.

    python research/bound_early_steps.py [--steps 40] [--seed 0]     # ~10 minutes, 1 thread

Trains the quality benchmark's `base` byte-level GPT (4.84M parameters, batch 32 x 128, lr 2e-3 with
the 50-step warm-up, betas (0.9, 0.95), weight decay 0.1 on >= 2-D tensors) for ``--steps`` steps from
the same initialisation on the same batches with: torch AdamW; Gefen unclamped
(``bound_updates=False``); Gefen clamped at ``2 K_t`` from the first step (the unrelaxed factor 2);
the same clamp applied only after step 10, and only up to step 10; and the library default (the
clamp at ``2 (1 + beta1^(t-1)) K_t``). Records every training loss and, for the unrelaxed clamp, the
fraction of quantized elements it binds on at each step. Writes
``research/results/bound_early_steps.json`` and the plot ``docs/img/bound_early_steps.png``.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT)]

from launch.corpus import Batches, load_corpus  # noqa: E402
from launch.gpt import GPT, get_config  # noqa: E402


def run(name: str, seed: int, steps: int, train) -> dict:
    import gefen_dist
    import gefen_dist.core.step as S
    import gefen_dist.engine.tensor_step as TS

    torch.manual_seed(seed)
    model = GPT(get_config("base", context=128))
    decay = [p for p in model.parameters() if p.dim() >= 2]
    rest = [p for p in model.parameters() if p.dim() < 2]
    groups = [dict(params=decay, weight_decay=0.1), dict(params=rest, weight_decay=0.0)]
    if name == "adamw":
        opt = torch.optim.AdamW(groups, lr=2e-3, betas=(0.9, 0.95), foreach=False)
    else:
        bound = {"unclamped": False}.get(name, 2.0)
        opt = gefen_dist.Gefen(groups, lr=2e-3, betas=(0.9, 0.95), fused=False, bound_updates=bound)
    window = {"2 K_t from step 1": (0, 10 ** 9), "2 K_t after step 10": (10, 10 ** 9),
              "2 K_t up to step 10": (0, 10)}.get(name)
    binds = []
    orig_hp, orig_apply = TS.hyperparameters, S.apply_

    def hp(group, step, bounded=S.DEFAULT_BOUND_UPDATES):  # the unrelaxed clamp, in a window of steps
        out = orig_hp(group, step, bounded)
        if window is not None and out["bound"] is not None:
            lo, hi = window
            b1, b2 = group["betas"]
            out["bound"] = 2.0 * S.update_bound(b1, b2, step) if lo < step <= hi else None
        return out

    def apply_(p, qa, sigma, lr, weight_decay, bound=None):
        if bound is not None:
            r = (qa * sigma).abs()
            binds.append((int(r.numel()), int((r > bound).sum())))
        return orig_apply(p, qa, sigma, lr, weight_decay, bound)

    TS.hyperparameters, S.apply_ = hp, apply_
    batches = Batches(train, 32, 128, seed=seed)
    losses, bind_frac = [], []
    try:
        for t in range(steps):
            for g in opt.param_groups:
                g["lr"] = 2e-3 * (t + 1) / 50
            x, y = batches(t)
            opt.zero_grad(set_to_none=True)
            loss = model(x, y)[1]
            loss.backward()
            binds.clear()
            opt.step()
            losses.append(round(loss.item(), 5))
            n = sum(a for a, _ in binds)
            bind_frac.append(sum(b for _, b in binds) / n if n else 0.0)
    finally:
        TS.hyperparameters, S.apply_ = orig_hp, orig_apply
    return dict(losses=losses, bind_frac=bind_frac)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=str(ROOT / "research" / "results" / "bound_early_steps.json"))
    ap.add_argument("--plot", default=str(ROOT / "docs" / "img" / "bound_early_steps.png"))
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    train, _, _ = load_corpus()
    names = ["adamw", "unclamped", "2 K_t from step 1", "2 K_t after step 10", "2 K_t up to step 10", "default"]
    res = {}
    for n in names:
        t0 = time.time()
        res[n] = run(n, args.seed, args.steps, train)
        l = res[n]["losses"]
        print(f"{n:22s} loss at steps 10, 20, 30: {l[9]:.3f} {l[19]:.3f} {l[min(29, len(l) - 1)]:.3f} "
              f"({time.time() - t0:.0f} s)", flush=True)
    Path(args.out).write_text(json.dumps(dict(seed=args.seed, steps=args.steps, runs=res, date=time.strftime("%Y-%m-%d"),
                                              torch=torch.__version__), indent=1) + "\n")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib missing: no plot")
        return 0
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    for n in names:
        a.plot(range(1, args.steps + 1), res[n]["losses"], label=n, lw=1.4 if n in ("adamw", "default") else 1.0)
    a.set_xlabel("step")
    a.set_ylabel("training loss")
    a.set_ylim(2.4, 4.5)
    a.set_title(f"base LM, seed {args.seed}: the first {args.steps} steps")
    a.legend(fontsize=8)
    b.plot(range(1, args.steps + 1), [100 * f for f in res["2 K_t from step 1"]["bind_frac"]], label="clamp at 2 K_t")
    b.plot(range(1, args.steps + 1), [100 * f for f in res["default"]["bind_frac"]], label="default (relaxed)")
    b.set_xlabel("step")
    b.set_ylabel("% of quantized elements clamped")
    b.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(args.plot, dpi=110)
    print(f"wrote {args.out} and {args.plot}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
