"""Gefen's default against torch's fused AdamW on a >= 100M-parameter GPT, on one GPU, in one run.

    python benchmarks/gpu_quality.py [--steps 1000] [--seeds 0,1] [--out docs/results/gpu_quality.json]
    python benchmarks/gpu_quality.py --smoke          # CPU, a tiny model, a few steps: checks the script
    python benchmarks/gpu_quality.py --gefen-second-moment nibbles --out docs/results/gpu_quality_nibbles.json

The byte-level GPT of the training job (``launch/gpt.py``; vocab 256, tied LM head) at the GPT-2
shape with 16 layers (113M parameters), context 512, on the Python standard library corpus
(``launch/corpus.py``; the last 5% held out), bf16 autocast, batch 32 x 512 tokens, lr 6e-4 with 100
warm-up steps and a cosine to 10%, betas (0.9, 0.95), weight decay 0.1 on >= 2-D tensors, 1,000
steps, validation on 20 fixed held-out batches every 100 steps. For each seed both optimizers train
the same model from the same initialisation on the same batches (``Batches(seed)``), one after the
other in this process: torch ``AdamW(fused=True)`` and ``gefen_dist.Gefen`` with its defaults. Every
curve, the final validation losses, the gap per seed (``val(Gefen) / val(AdamW) - 1``), the state
bytes per parameter and the time per step land in the JSON; a table is printed.

Sized for ten minutes on one H200 (4 runs of 1,000 steps, each ~1 min of training plus compilation
of the Triton kernels on the first); ``--max-minutes`` stops a run that would overrun and records
where (the JSON says ``truncated``). Nothing here asserts a result: it measures.
"""
from __future__ import annotations

import argparse
import json
import math
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT)]

from launch.corpus import Batches, load_corpus, val_batches  # noqa: E402
from launch.gpt import GPT, get_config  # noqa: E402


def lr_mult(t: int, steps: int, warmup: int, min_frac: float = 0.1) -> float:
    """Linear warm-up, then a cosine to ``min_frac`` (benchmarks/quality.py's schedule)."""
    if t < warmup:
        return (t + 1) / warmup
    frac = (t - warmup) / max(1, steps - 1 - warmup)
    return min_frac + (1.0 - min_frac) * 0.5 * (1.0 + math.cos(math.pi * min(1.0, frac)))


def make_optimizer(name: str, model: torch.nn.Module, lr: float, fused: bool, second_moment: str = "factored"):
    import gefen_dist

    decay = [p for p in model.parameters() if p.dim() >= 2]
    rest = [p for p in model.parameters() if p.dim() < 2]
    groups = [dict(params=decay, weight_decay=0.1), dict(params=rest, weight_decay=0.0)]
    if name == "adamw":
        return torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95), fused=fused)
    return gefen_dist.Gefen(groups, lr=lr, betas=(0.9, 0.95), second_moment=second_moment)


def state_bytes(opt) -> int:
    if hasattr(opt, "state_bytes"):
        return int(opt.state_bytes())
    return sum(t.numel() * t.element_size() for st in opt.state.values() for t in st.values()
               if torch.is_tensor(t) and t.dim() > 0)


def run(name: str, seed: int, cfg: dict, data, device: torch.device, deadline: float) -> dict:
    train, val = data
    mcfg = get_config(cfg["preset"], context=cfg["context"], n_layer=cfg["n_layer"])
    torch.manual_seed(seed)
    model = GPT(mcfg).to(device)
    nparams = sum(p.numel() for p in model.parameters())
    batches = Batches(train, cfg["batch"], cfg["context"], seed=seed)
    vb = [(x.to(device), y.to(device)) for x, y in val_batches(cfg["val_batches"], cfg["batch"], cfg["context"],
                                                                  data=val)]
    opt = make_optimizer(name, model, cfg["lr"], fused=device.type == "cuda",
                         second_moment=cfg["gefen_second_moment"])
    amp = torch.autocast(device.type, dtype=torch.bfloat16, enabled=cfg["bf16"])

    def evaluate() -> float:
        model.eval()
        with torch.no_grad(), amp:
            out = sum(model(x, y)[1].float().item() for x, y in vb) / len(vb)
        model.train()
        return out

    curve, train_loss, step_ms = [], [], []
    truncated = None
    for t in range(cfg["steps"]):
        if time.perf_counter() > deadline:
            truncated = t
            break
        for g in opt.param_groups:
            g["lr"] = cfg["lr"] * lr_mult(t, cfg["steps"], cfg["warmup"])
        x, y = (a.to(device, non_blocking=True) for a in batches(t))
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        with amp:
            loss = model(x, y)[1]
        loss.backward()
        opt.step()
        if device.type == "cuda":
            torch.cuda.synchronize()
        step_ms.append(1e3 * (time.perf_counter() - t0))
        lv = float(loss.float().item())
        train_loss.append(round(lv, 5))
        if not math.isfinite(lv):
            truncated = t + 1
            break
        if (t + 1) % cfg["eval_every"] == 0 or t + 1 == cfg["steps"]:
            curve.append((t + 1, round(evaluate(), 6)))
    sb = state_bytes(opt)
    done = curve and curve[-1][0] == cfg["steps"]
    return dict(optimizer=name, seed=seed, params=nparams, val_loss=curve[-1][1] if done else None,
                val_curve=curve, train_loss=train_loss, truncated=truncated, state_bytes=sb,
                bytes_per_param=sb / nparams,
                step_ms_median=statistics.median(step_ms[10:] or step_ms) if step_ms else None)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=1000)
    ap.add_argument("--seeds", default="0,1")
    ap.add_argument("--n-layer", type=int, default=16)
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--max-minutes", type=float, default=10.0, help="wall-clock budget for all runs")
    ap.add_argument("--smoke", action="store_true", help="CPU check of the script: tiny model, 12 steps")
    ap.add_argument("--gefen-second-moment", default="factored", choices=("factored", "shared", "nibbles"),
                    help="Gefen's second_moment (the default: factored; nibbles: D20, both moments in one byte)")
    ap.add_argument("--out", default=str(ROOT / "docs" / "results" / "gpu_quality.json"))
    args = ap.parse_args(argv)
    t_start = time.perf_counter()
    if args.smoke:
        device = torch.device("cpu")
        cfg = dict(preset="tiny", n_layer=2, context=32, batch=4, steps=12, warmup=3, eval_every=6, val_batches=2,
                   lr=2e-3, bf16=False, gefen_second_moment=args.gefen_second_moment)
    else:
        if not torch.cuda.is_available():
            raise SystemExit("benchmarks/gpu_quality.py measures on a CUDA GPU (use --smoke to check the script on CPU)")
        device = torch.device("cuda")
        cfg = dict(preset="gpt2", n_layer=args.n_layer, context=args.context, batch=args.batch, steps=args.steps,
                   warmup=100, eval_every=100, val_batches=20, lr=6e-4, bf16=True,
                   gefen_second_moment=args.gefen_second_moment)
    train, val, info = load_corpus()
    seeds = [int(s) for s in args.seeds.split(",")]
    deadline = t_start + 60 * args.max_minutes
    runs = []
    for seed in seeds:
        for name in ("adamw", "gefen"):
            r = run(name, seed, cfg, (train, val), device, deadline)
            runs.append(r)
            print(f"seed {seed} {name:6s}: val {r['val_loss']} after {len(r['train_loss'])} steps, "
                  f"{r['bytes_per_param']:.3f} B/param, {r['step_ms_median']:.1f} ms/step"
                  + (f" (truncated at step {r['truncated']})" if r["truncated"] is not None else ""), flush=True)
    by = {(r["optimizer"], r["seed"]): r for r in runs}
    gaps = {s: 100 * (by[("gefen", s)]["val_loss"] / by[("adamw", s)]["val_loss"] - 1) for s in seeds
            if by[("gefen", s)]["val_loss"] and by[("adamw", s)]["val_loss"]}
    print("| seed | AdamW val | Gefen val | gap |\n|---|---|---|---|")
    for s in seeds:
        a, g = by[("adamw", s)]["val_loss"], by[("gefen", s)]["val_loss"]
        print(f"| {s} | {a} | {g} | " + ("%+.2f%%" % gaps[s] if s in gaps else "n/a") + " |")
    out = dict(config=cfg, seeds=seeds, gaps_pct=gaps, runs=runs, corpus_sha256=info["sha256"][:16],
               device=torch.cuda.get_device_name() if device.type == "cuda" else platform.processor() or "cpu",
               torch=torch.__version__, date=time.strftime("%Y-%m-%d"), smoke=args.smoke,
               seconds=time.perf_counter() - t_start,
               command="python benchmarks/gpu_quality.py " + " ".join(argv if argv is not None else sys.argv[1:]))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {args.out} in {out['seconds']:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
