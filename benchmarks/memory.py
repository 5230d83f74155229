"""Optimizer-state bytes per parameter on GPT-2 small (124M), Gefen vs AdamW.

Builds the GPT-2-small layout (nanoGPT: nn.Linear weights, tied wte/lm_head, 124,439,808
parameters, vocab 50257), takes one real forward/backward on Zipf-distributed random tokens
(batch 4x256), steps Gefen (which learns periods and the codebook from these gradients) and
torch AdamW, and prints the exact state bytes of each. Writes docs/results/memory.json.

    python benchmarks/memory.py            # ~1-2 minutes on 2 CPU cores
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from collections import Counter

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from _docs import run_meta  # noqa: E402
from gefen_dist import Gefen  # noqa: E402
from launch.gpt import GPT, get_config  # noqa: E402


def zipf_tokens(batch, ctx, vocab, seed=0):
    g = torch.Generator().manual_seed(seed)
    ranks = torch.arange(1, vocab + 1, dtype=torch.float64)
    probs = 1.0 / ranks
    probs /= probs.sum()
    return torch.multinomial(probs, batch * (ctx + 1), replacement=True, generator=g).view(batch, ctx + 1)


def adamw_state_bytes(opt) -> int:
    return sum(t.numel() * t.element_size() for st in opt.state.values() for t in st.values()
               if isinstance(t, torch.Tensor))


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="gpt2")
    ap.add_argument("--vocab", type=int, default=50257)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--ctx", type=int, default=256)
    ap.add_argument("--out", default=os.path.join(ROOT, "docs", "results", "memory.json"))
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    torch.manual_seed(0)
    model = GPT(get_config(args.model, vocab_size=args.vocab))
    n_params = sum(p.numel() for p in model.parameters())
    tok = zipf_tokens(args.batch, args.ctx, args.vocab)
    t0 = time.perf_counter()
    _, loss = model(tok[:, :-1].contiguous(), tok[:, 1:].contiguous())
    loss.backward()
    t_fb = time.perf_counter() - t0

    gefen = Gefen(model.named_parameters(), lr=0.0)
    t0 = time.perf_counter()
    gefen.step()
    t_first = time.perf_counter() - t0
    rep = gefen.report()
    g_bytes = gefen.state_bytes()

    adamw = torch.optim.AdamW(model.parameters(), lr=0.0)
    adamw.step()
    a_bytes = adamw_state_bytes(adamw)

    periods = Counter()
    for r in rep:
        if r["kind"] == "quantized":
            periods[r["period"]] += r["numel"]
    exact = sum(r["numel"] for r in rep if r["kind"] == "exact")
    res = {
        "model": f"GPT-2 layout ({args.model}, vocab {args.vocab})",
        "params": n_params,
        "data": f"Zipf tokens, batch {args.batch}x{args.ctx}, one forward/backward",
        "gefen_state_bytes": g_bytes,
        "gefen_bytes_per_param": g_bytes / n_params,
        "adamw_state_bytes": a_bytes,
        "adamw_bytes_per_param": a_bytes / n_params,
        "ratio_adamw_over_gefen": a_bytes / g_bytes,
        "saved_gib_per_billion_params": (a_bytes - g_bytes) / n_params * 1e9 / 2**30,
        "exact_fraction_of_params": exact / n_params,
        "params_by_period": {str(k): v for k, v in sorted(periods.items())},
        "seconds_forward_backward": t_fb,
        "seconds_first_gefen_step": t_first,
        "codebook_info": gefen.codebook_info,
        **run_meta(),
        "per_tensor": [{k: (list(v) if isinstance(v, tuple) else v) for k, v in r.items()} for r in rep],
    }
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(res, f, indent=1)
    print(f"parameters: {n_params:,}")
    print(f"Gefen state: {g_bytes:,} B = {g_bytes / n_params:.4f} B/param "
          f"(exact AdamW state for {exact / n_params:.3%} of params)")
    print(f"AdamW state: {a_bytes:,} B = {a_bytes / n_params:.4f} B/param")
    print(f"ratio {a_bytes / g_bytes:.2f}x, saved {res['saved_gib_per_billion_params']:.2f} GiB per billion params")
    print("params by period: " + ", ".join(f"P={k}: {v:,}" for k, v in sorted(periods.items())))
    print(f"first Gefen step (periods + codebook + update): {t_first:.2f} s; forward/backward {t_fb:.2f} s")


if __name__ == "__main__":
    main()
