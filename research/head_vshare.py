"""How much per-element second-moment information a dense single-output head needs (issue 26's
"<= 1.1 B/param for every tensor whatever its aspect ratio", D15).

The workload is ``research/head_regression.py``'s (``Linear(1, 4096) -> ReLU -> Linear(4096, 1)``
fitting a sum of sinusoids, 600 steps of batch 256, lr 1e-3, betas (0.9, 0.999), held-out MSE). Its
head ``(1, 4096)`` is a tensor of one row: at about one byte of first moment per parameter, 1.1
B/param leaves under 0.1 B (0.8 bits) per element for the second moment, so every layout of that size
shares ``v`` between elements or codes it in under one bit. Two families are trained, paired by seed
against AdamW:

* ``adamw_share{P}``: torch-free reference AdamW (fp32 ``m`` and ``v``, the same update as
  ``torch.optim.AdamW`` without weight decay) whose head uses the mean of ``v`` over blocks of ``P``
  consecutive elements; ``P = 1`` is AdamW itself (checked against ``torch.optim.AdamW`` below).
  This is the cost of sharing alone, without Gefen's quantized first moment.
* ``gefen_shared{P}``: Gefen with the head in a ``second_moment="shared"`` group and its period forced
  to ``P`` (the paper's layout: one fp32 ``v`` and one scale per ``P`` elements; D15 used ``P = 2048``);
  ``gefen_factored``: the head in the default's factored layout (one row: a fp32 ``v`` per element,
  5.0 B/param).
* ``adamw_code{S}x{L}``: the reference AdamW with the head's ``v`` stored per element as a log code,
  ``v = R_b 2^(-c / S)``, ``c`` in ``0 .. L - 2`` (``L`` levels; the smallest clamps there), ``R_b`` the
  largest ``v`` of each block of 256 elements, rounded stochastically between the two nearest codes
  (unbiased in the code, as ``gefen_dist.core.rows8`` codes a row's ``v``). ``L = 256`` is a byte per
  element (about 2.0 B/param beside an 8-bit first moment), ``L = 16`` half a byte (1.5).

    python research/head_vshare.py [--seeds 0,1,2] [--out research/results/head_vshare.json]   # ~3 min

Prints every configuration's held-out MSE per seed, its ratio to AdamW and the head's bytes per
parameter of second moment (+ first moment for Gefen's configurations).
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests"), str(ROOT / "research")]

from _workloads import head_regression  # noqa: E402
from head_regression import head_state_bytes  # noqa: E402
from gefen_dist import Gefen  # noqa: E402

KW = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8)


class HeadVAdamW(torch.optim.Optimizer):
    """AdamW (no weight decay) whose ``head`` keeps ``v`` shared over blocks of ``share`` elements, or,
    with ``code = (S, L)``, as per-element log codes of ``L`` levels, ``S`` per octave."""

    def __init__(self, params, head, *, share=1, code=None, seed=0, **kw):
        super().__init__(params, dict(KW, **kw))
        self.head, self.share, self.code = head, share, code
        self.gen = torch.Generator().manual_seed(seed)

    def _coded(self, v):
        steps, levels = self.code
        vb = v.reshape(-1, 256)
        ref = vb.amax(1, keepdim=True)
        x = (-steps * torch.log2(vb / ref.clamp_min(1e-38))).clamp(0, levels - 2)
        lo = x.floor()
        c = lo + (torch.rand(x.shape, generator=self.gen) < x - lo).to(x.dtype)
        return torch.where(vb > 0, ref * torch.exp2(-c / steps), torch.zeros_like(vb)).reshape(v.shape)

    @torch.no_grad()
    def step(self):
        for g in self.param_groups:
            b1, b2 = g["betas"]
            for p in g["params"]:
                st = self.state[p]
                if not st:
                    st.update(t=0, m=torch.zeros_like(p), v=torch.zeros_like(p))
                st["t"] += 1
                t = st["t"]
                st["m"].lerp_(p.grad, 1 - b1)
                st["v"].mul_(b2).addcmul_(p.grad, p.grad, value=1 - b2)
                v = st["v"]
                if p is self.head and self.code:
                    v = st["v"] = self._coded(v)
                elif p is self.head and self.share > 1:
                    v = v.reshape(-1, self.share).mean(1, keepdim=True).expand(-1, self.share).reshape(p.shape)
                denom = (v / (1 - b2 ** t)).sqrt().add_(g["eps"])
                p.addcdiv_(st["m"], denom, value=-g["lr"] / (1 - b1 ** t))


def _reference(share=1, code=None):
    return lambda model, seed: HeadVAdamW(model.parameters(), model[2].weight, share=share, code=code, seed=seed)


def _gefen(second_moment, period=None):
    def make(model, seed):
        head = model[2].weight

        class Forced(Gefen):
            def _learn_periods(self, live):
                per = super()._learn_periods(live)
                return [period if period and p is head else x for (p, _), x in zip(live, per)]

        rest = [p for p in model.parameters() if p is not head]
        return Forced([{"params": rest}, {"params": [head], "second_moment": second_moment}],
                      lr=KW["lr"], betas=KW["betas"], weight_decay=0.0)
    return make


CONFIGS = {"adamw": _reference()}
CONFIGS.update({f"adamw_share{P}": _reference(share=P) for P in (2, 4, 16, 128)})
CONFIGS.update({f"gefen_shared{P}": _gefen("shared", P) for P in (1, 2, 16, 128, 2048)})
CONFIGS["gefen_factored"] = _gefen("factored")
CONFIGS.update({f"adamw_code{S}x{L}": _reference(code=(S, L)) for S, L in ((16, 256), (8, 256), (4, 16), (2, 16))})


def head_bytes(opt, head) -> float:
    """Bytes per parameter of the head's state (Gefen: everything but the step and codebook; the
    reference: what its layout would store, ``v`` only)."""
    if isinstance(opt, Gefen):
        return head_state_bytes(opt, head)
    if opt.code:
        return math.log2(opt.code[1]) / 8 + 4 / 256
    return 4 / opt.share


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--configs", default=",".join(CONFIGS))
    ap.add_argument("--out", default=str(ROOT / "research/results/head_vshare.json"))
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    seeds = [int(s) for s in args.seeds.split(",")]
    names = args.configs.split(",")
    if "adamw" not in names:
        names.insert(0, "adamw")
    t0, runs = time.time(), {}
    for seed in seeds:  # the reference at share 1 is AdamW: checked against torch's on every seed
        torch_loss = head_regression(lambda m: torch.optim.AdamW(m.parameters(), weight_decay=0.0, **KW), seed=seed)[0]
        for name in names:
            loss, opt, model = head_regression(lambda m, n=name: CONFIGS[n](m, seed), seed=seed)
            runs.setdefault(name, {})[seed] = dict(loss=loss, head_bytes_per_param=head_bytes(opt, model[2].weight))
            print(f"{name:18s} seed {seed}: held-out MSE {loss:.5f}", flush=True)
        ref = runs["adamw"][seed]["loss"]
        assert abs(ref / torch_loss - 1) < 1e-3, (ref, torch_loss)  # the reference is AdamW
    summary = {}
    print(f"\n{'configuration':18s} | held-out MSE per seed | ratio to AdamW per seed | geometric mean | head state B/param")
    for name in names:
        r = runs[name]
        ratios = [r[s]["loss"] / runs["adamw"][s]["loss"] for s in seeds]
        gm = math.exp(statistics.fmean(math.log(x) for x in ratios))
        summary[name] = dict(losses=[r[s]["loss"] for s in seeds], ratios=ratios, geomean_ratio=gm,
                             head_bytes_per_param=r[seeds[0]]["head_bytes_per_param"])
        print(f"{name:18s} | " + ", ".join(f"{r[s]['loss']:.4f}" for s in seeds) + " | "
              + ", ".join(f"{x:.2f}x" for x in ratios) + f" | {gm:.2f}x | {summary[name]['head_bytes_per_param']:.3f}")
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    out = {"command": "python research/head_vshare.py " + " ".join(argv if argv is not None else sys.argv[1:]),
           "commit": commit, "torch": torch.__version__, "seconds": round(time.time() - t0, 1), "seeds": seeds,
           "note": "head state B/param: Gefen's configurations count their whole state (first moment, scales, v); "
                   "the reference AdamW configurations count only the v layout they test",
           "runs": runs, "summary": summary}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1))
    print("wrote", args.out)


if __name__ == "__main__":
    main()
