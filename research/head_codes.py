"""The dense one-row head of D15 with per-element codes for both moments (emulated): does one byte per
element (a 4-bit first moment and a 4-bit ``v``) train it as AdamW does?

    python research/head_codes.py [--seeds 0,1,2] [--out research/results/head_codes.json]   # ~1-2 min

Workload: ``tests/_workloads.py``'s ``head_regression`` (``Linear(1, 4096) -> ReLU -> Linear(4096, 1)``,
600 steps, lr 1e-3, betas (0.9, 0.999), no weight decay; held-out MSE), as research/head_regression.py
and research/head_vshare.py run it. The head ``(1, 4096)`` (``2.weight``) goes in a param group with
``second_moment="elementwise"`` through research/quality_variants.py's ``_gefen_named`` /
``_gefen_named_v8`` (its ``v`` and, for the ``m4`` rows, its first-moment indices re-coded after each
step); every other tensor as the library's default. Configurations:

* ``adamw``: ``torch.optim.AdamW``;
* ``fp32_v``: per-element fp32 ``v``, 8-bit first moment (~5 B/param on the head);
* ``v8`` / ``v4``: ``v`` as one-byte (16 per octave) / half-byte (16 levels, one per octave) log codes
  against each 256-block's largest ``v``, stochastic; 8-bit first moment (~2.0 / ~1.5 B/param);
* ``m4v4``: ``v4`` with a 4-bit first moment (16 of the learned codewords by the DP on their use after
  the first step), nearest rounding; ``m4sv4``: the same rounded stochastically between the two nearest
  of those codewords (unbiased in the value): one byte per element for both moments (~1.03 B/param);
* ``proto_fac`` / ``proto_block``: research/byte_moments.py's prototype of that layout on the head, every
  other tensor with AdamW's state (the rows above keep the library's default there: the input weight's
  ``v`` per block of 1,024 rows, D18); ``v``'s codes against the factored estimate, whose ``v_col`` keeps
  the head at ~5 B/param, or against per-256 maxima, ~1.03 B/param;
* ``proto_fac_qr`` / ``proto_block_qr``: the same with the quasi-random draws that D20's library kernels
  took from 2026-12-07 to 2026-12-08 (``ByteMoments(draws="quasi")``).

Prints each configuration's held-out MSE per seed and the geometric mean of its ratio to AdamW's. Read
the emulation rows against ``fp32_v`` (the same input layer: the library's, which alone puts the head
at 0.86x AdamW), the prototype rows against ``adamw`` (the same input layer: AdamW's).
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests"), str(ROOT / "research")]

from _workloads import head_regression  # noqa: E402
import quality_variants as qv  # noqa: E402

LR, BETAS = 1e-3, (0.9, 0.999)
HEAD = ("2.weight",)
DEFAULT = dict(second_moment="factored", row_blocks="auto")


def _library(factory):
    """A ``seed -> make(model)`` from a quality_variants factory ``(groups, lr, betas, seed, model=)``."""
    def per_seed(seed):
        return lambda model: factory([{"params": list(model.parameters()), "weight_decay": 0.0}], LR, BETAS, seed,
                                     model=model)
    return per_seed


def _proto(seed, ref, draws="iid"):
    """research/byte_moments.py's prototype coding the head only (the other tensors AdamW's state)."""
    from byte_moments import ByteMoments
    return lambda model: ByteMoments(model.parameters(), lr=LR, betas=BETAS, eps=1e-8, weight_decay=0.0, ref=ref,
                                     seed=seed, only=[model[2].weight], draws=draws)


CONFIGS = {
    "adamw": lambda seed: (lambda model: torch.optim.AdamW(model.parameters(), lr=LR, betas=BETAS, weight_decay=0.0)),
    "fp32_v": _library(qv._gefen_named("elementwise", HEAD, **DEFAULT)),
    "v8": _library(qv._gefen_named_v8(HEAD, 16, 256, **DEFAULT)),
    "v4": _library(qv._gefen_named_v8(HEAD, 1, 16, **DEFAULT)),
    "m4v4": _library(qv._gefen_named_v8(HEAD, 1, 16, m_levels=16, **DEFAULT)),
    "m4sv4": _library(qv._gefen_named_v8(HEAD, 1, 16, m_levels=16, m_stochastic=True, **DEFAULT)),
    "proto_fac": lambda seed: _proto(seed, "fac"),
    "proto_block": lambda seed: _proto(seed, "block"),
    "proto_fac_qr": lambda seed: _proto(seed, "fac", "quasi"),
    "proto_block_qr": lambda seed: _proto(seed, "block", "quasi"),
}


def _head_bytes(name):
    """The head's state bytes per parameter in the layout ``name`` stands for (counted, not measured: the
    emulations hold float32 ``v``)."""
    n, nb = 4096, 16  # (1, 4096): 16 scale blocks of 256
    name = name.replace("_qr", "")  # (the quasi-random draws: the same layout)
    first = {"m4v4": 0.5, "m4sv4": 0.5, "proto_fac": 0.5, "proto_block": 0.5}.get(name, 1.0) * n + 4 * nb
    v = {"adamw": None, "fp32_v": 4 * n, "v8": n + 4 * nb, "v4": n / 2 + 4 * nb, "m4v4": n / 2 + 4 * nb,
         "m4sv4": n / 2 + 4 * nb, "proto_fac": n / 2 + 4 + 4 * n, "proto_block": n / 2 + 4 * nb}[name]
    return 8.0 if v is None else (first + v) / n


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--out", default=str(ROOT / "research/results/head_codes.json"))
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    seeds = [int(s) for s in args.seeds.split(",")]
    losses, summary = {}, {}
    for name, per_seed in CONFIGS.items():
        losses[name] = [head_regression(per_seed(seed), seed=seed)[0] for seed in seeds]
        ratios = [x / a for x, a in zip(losses[name], losses["adamw"])]
        summary[name] = dict(losses=losses[name], ratios=ratios, head_bytes_per_param=_head_bytes(name),
                             geomean_ratio=math.exp(statistics.fmean(math.log(r) for r in ratios)))
        print(f"{name:8s} held-out MSE " + ", ".join(f"{x:.5f}" for x in losses[name])
              + f" | ratio to AdamW " + ", ".join(f"{r:.2f}x" for r in ratios)
              + f" | geometric mean {summary[name]['geomean_ratio']:.2f}x | {summary[name]['head_bytes_per_param']:.2f} B/param",
              flush=True)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                            text=True).stdout.strip()
    Path(args.out).write_text(json.dumps(dict(seeds=seeds, commit=commit, results=summary), indent=1) + "\n")


if __name__ == "__main__":
    main()
