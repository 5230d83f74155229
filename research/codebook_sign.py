"""How sign-balanced the first step's histogram is on the byte-level GPT presets, and what fitting
the codebook to the histogram and its mirror image (D17) changes there.

    python research/codebook_sign.py [--seeds 0,1] [--out research/results/codebook_sign.json]

For each preset (``tiny``, ``small``, ``base``: ``benchmarks/quality.py``'s recipe and batches) and
seed: one forward/backward from the initialisation and the default Gefen's first step; the global
histogram it learns from is captured, and both codebooks are fitted to it (the paper's fit of the
histogram itself, and D17's of the histogram plus its mirror). Printed: the share of negative
values, the mean normalised value, the negative codewords of each fit, and the mean squared
quantization error of each codebook on the histogram and on its mirror image (a first moment of the
opposite sign balance). Where the histogram is balanced the two fits nearly coincide, so D17 changes
these models' runs by no more than a codebook's tie-breaking does.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]

import quality as Q  # noqa: E402
from gefen_dist.core.codebook import bin_centres, mirrored_counts  # noqa: E402
from gefen_dist.engine import learning  # noqa: E402
from gefen_dist.kernels import dispatch  # noqa: E402

PRESETS = (("tiny", 64), ("small", 128), ("base", 128))


def first_histogram(preset, ctx, seed):
    from launch.corpus import Batches, load_corpus
    from launch.gpt import GPT, get_config

    got = {}
    orig = learning.learn_codebook

    def grab(counts, symmetric=True):
        got["counts"] = counts.clone()
        return orig(counts, symmetric)

    learning.learn_codebook = grab
    try:
        train, _, _ = load_corpus()
        torch.manual_seed(seed)
        model = GPT(get_config(preset, context=ctx))
        opt = Q.make_optimizer("gefen_default", model, 0.1, 2e-3, (0.9, 0.95), seed, dim=1, n_heads=1)
        x, y = Batches(train, 32, ctx, seed=seed)(0)
        model(x, y)[1].backward()
        opt.step()
    finally:
        learning.learn_codebook = orig
    return got["counts"].numpy().astype(np.int64)


def mse(cb, z, w):
    q = cb[np.abs(z[:, None] - cb[None, :]).argmin(1)]
    return float((w * (z - q) ** 2).sum() / w.sum())


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", default="0,1")
    ap.add_argument("--out", default=str(ROOT / "research/results/codebook_sign.json"))
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    z = bin_centres().astype(np.float64)
    rows = []
    for preset, ctx in PRESETS:
        for seed in (int(s) for s in args.seeds.split(",")):
            c = first_histogram(preset, ctx, seed)
            w, mir = c.astype(np.float64), c[::-1].astype(np.float64)
            paper = dispatch.solve_codebook(c).codebook.double().numpy()
            sym = dispatch.solve_codebook(mirrored_counts(c)).codebook.double().numpy()
            r = dict(preset=preset, seed=seed, values=int(c.sum()), share_negative=float(w[z < 0].sum() / w.sum()),
                     mean=float((w * z).sum() / w.sum()), negative_codewords_paper=int((paper < 0).sum()),
                     negative_codewords_symmetric=int((sym < 0).sum()),
                     mse_paper=mse(paper, z, w), mse_symmetric=mse(sym, z, w),
                     mse_paper_on_mirror=mse(paper, z, mir), mse_symmetric_on_mirror=mse(sym, z, mir),
                     max_codeword_change=float(np.abs(paper - sym).max()))
            rows.append(r)
            print(f"{preset} seed {seed}: {r['values']:,} values, {100 * r['share_negative']:.1f}% negative, mean "
                  f"{r['mean']:+.4f}; negative codewords {r['negative_codewords_paper']} (paper) / "
                  f"{r['negative_codewords_symmetric']} (D17); MSE on the histogram {r['mse_paper']:.3g} / "
                  f"{r['mse_symmetric']:.3g}, on its mirror {r['mse_paper_on_mirror']:.3g} / "
                  f"{r['mse_symmetric_on_mirror']:.3g}; largest codeword change {r['max_codeword_change']:.2g}", flush=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"command": "python research/codebook_sign.py "
                                          + " ".join(argv if argv is not None else sys.argv[1:]),
                                          "torch": torch.__version__, "rows": rows}, indent=1))
    print("wrote", args.out)


if __name__ == "__main__":
    main()
