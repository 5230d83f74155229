"""A dense single-output head whose first gradient has mostly one sign: what the codebook's fit
(D17) and the few-row layout (D15) cost there, against AdamW and 8-bit peers, paired by seed.

    python research/head_regression.py [--seeds 0,1,2] [--out research/results/head_regression.json]

Workload (CPU, 1 thread): ``Linear(1, H) -> ReLU -> Linear(H, 1)`` (H = 4096) fitting a sum of 16
random sinusoids of a scalar in [-2, 2]; MSE, 600 steps of batch 256, lr 1e-3, betas (0.9, 0.999),
no weight decay; held-out MSE on 4,096 evenly spaced points. The head ``(1, 4096)`` is the only
tensor Gefen quantizes in every configuration but ``default_d18`` (the ``(4096, 1)`` input weight and
the biases keep AdamW's state, D2; D18's default keeps the input weight per block of rows), and
its first gradient, error times ReLU features, is mostly of one sign, so the first step's histogram
is too. ``tests/test_codebook_sign.py`` trains the ``elementwise`` rows on seed 0.

Configurations:

* ``adamw``; ``torchao_8bit`` (torchao AdamW8bit), ``bnb_8bit`` (bitsandbytes AdamW8bit,
  ``min_8bit_size=0``): per-element 8-bit first and second moments, blocks of 256 (when installed);
* ``default``: Gefen's defaults before D18 (factored group; the ``(H, 1)`` input weight exact, as
  ``narrow_rows="rows"`` keeps it; the codebook fitted to the histogram and its mirror, D17);
  ``default_d18``: the defaults since D18 (``narrow_rows="auto"``: the input weight, a dense layer
  of one-element rows, kept per block of 1024 rows);
* ``default_paper_cb``: the same with ``symmetric_codebook=False`` (the paper's codebook fit);
* ``elementwise``: the head in a ``second_moment="elementwise"`` group (fp32 ``v`` per element,
  8-bit first moment; ~5 B/param on the head), and ``elementwise_paper_cb`` with the paper's fit;
* ``head_exact``: the head in a group with ``small_threshold`` above its size (AdamW's state).

Prints every seed's held-out MSE, each configuration's ratio to AdamW per seed and its geometric
mean (a diverged run, NaN, makes it NaN), the negative codewords of the learned codebook, and the
head's state bytes per parameter (Gefen's; the 8-bit peers keep about 2). ``--out`` also records the
commit. Run at a commit before D15 was withdrawn, ``default`` is D15's layout (one ``v`` per 2048
elements of the head): ``research/results/head_regression_d15.json``.
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from _workloads import head_regression  # noqa: E402
from gefen_dist import Gefen  # noqa: E402

KW = dict(lr=1e-3, betas=(0.9, 0.999), weight_decay=0.0)


def _gefen(head_group=None, rest_nr="rows", **opt_kw):
    """Gefen with the head in a group of ``head_group``'s options; the other tensors in a group with
    ``narrow_rows=rest_nr``: ``"rows"`` keeps the ``(H, 1)`` input weight exact, as in the stored runs
    before D18; ``"auto"`` (D18's default) keeps it per block of rows."""
    def make(model):
        head = model[2].weight
        rest = [p for p in model.parameters() if p is not head]
        return Gefen([{"params": rest, "narrow_rows": rest_nr}, dict({"params": [head]}, **(head_group or {}))],
                     **KW, **opt_kw)
    return make


def _torchao(model):
    from torchao.optim import AdamW8bit
    return AdamW8bit(model.parameters(), **KW)


def _bnb(model):
    import bitsandbytes as bnb
    return bnb.optim.AdamW8bit(model.parameters(), min_8bit_size=0, **KW)


CONFIGS = {
    "adamw": lambda model: torch.optim.AdamW(model.parameters(), **KW),
    "torchao_8bit": _torchao,
    "bnb_8bit": _bnb,
    "default": _gefen(),
    "default_d18": _gefen(rest_nr="auto"),  # the defaults since D18: the input weight per block of rows
    "default_paper_cb": _gefen(symmetric_codebook=False),
    "elementwise": _gefen({"second_moment": "elementwise"}),
    "elementwise_paper_cb": _gefen({"second_moment": "elementwise"}, symmetric_codebook=False),
    "head_exact": _gefen({"small_threshold": 1 << 30}),
}


def head_state_bytes(opt: Gefen, head: torch.Tensor) -> float:
    """Bytes per parameter of Gefen's state for ``head`` (everything but the step count and the codebook)."""
    st = opt.state[head]
    return sum(t.numel() * t.element_size() for k, t in st.items()
               if isinstance(t, torch.Tensor) and k not in ("step", "codebook")) / head.numel()


def run(make, seed):
    """``tests/_workloads.py``'s ``head_regression`` with the optimizer ``make(model)`` builds: the
    held-out MSE and, for Gefen, the head's state bytes per parameter and negative codewords."""
    loss, opt, model = head_regression(make, seed=seed)
    extra = {}
    if isinstance(opt, Gefen):
        extra["head_bytes_per_param"] = head_state_bytes(opt, model[2].weight)
        extra["negative_codewords"] = int((opt.codebook < 0).sum()) if opt.codebook is not None else None
    return loss, extra


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--configs", default=",".join(CONFIGS))
    ap.add_argument("--out", default=str(ROOT / "research/results/head_regression.json"))
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    seeds = [int(s) for s in args.seeds.split(",")]
    runs, skipped, t0 = {}, {}, time.time()
    for name in args.configs.split(","):
        for seed in seeds:
            try:
                loss, extra = run(CONFIGS[name], seed)
            except ImportError as e:
                skipped[name] = f"{type(e).__name__}: {e}"
                break
            runs.setdefault(name, {})[seed] = dict(loss=loss, **extra)
            print(f"{name:22s} seed {seed}: held-out MSE {loss:.5f} {extra}", flush=True)
    summary = {}
    print(f"\n{'configuration':22s} | held-out MSE per seed | ratio to AdamW per seed | geometric mean | head B/param | negative codewords")
    for name, r in runs.items():
        ratios = [r[s]["loss"] / runs["adamw"][s]["loss"] for s in seeds]
        gm = math.exp(statistics.fmean(math.log(x) for x in ratios))
        summary[name] = dict(losses=[r[s]["loss"] for s in seeds], ratios=ratios, geomean_ratio=gm,
                             head_bytes_per_param=r[seeds[0]].get("head_bytes_per_param"),
                             negative_codewords=r[seeds[0]].get("negative_codewords"))
        print(f"{name:22s} | " + ", ".join(f"{r[s]['loss']:.4f}" for s in seeds) + " | "
              + ", ".join(f"{x:.2f}x" for x in ratios) + f" | {gm:.2f}x | "
              + ("8.000" if name == "adamw" else "-" if summary[name]["head_bytes_per_param"] is None
                 else f"{summary[name]['head_bytes_per_param']:.3f}")
              + f" | {summary[name]['negative_codewords']}")
    import subprocess

    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    out = {"command": "python research/head_regression.py " + " ".join(argv if argv is not None else sys.argv[1:]),
           "commit": commit, "torch": torch.__version__, "seconds": round(time.time() - t0, 1), "seeds": seeds,
           "runs": runs, "summary": summary, "skipped": skipped}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1))
    print("wrote", args.out)


if __name__ == "__main__":
    main()
