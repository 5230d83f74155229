"""How far `second_moment="nibbles"`'s stored second moment is from AdamW's on the same gradients,
tensor by tensor, in the first steps of the `base` LM (where some seeds sit on the early plateau).

    python research/nibble_v_ratio.py --seed 3 --steps 150 --every 25 [--json out.json] [--variant v_nibbles_qr]

Trains `benchmarks/quality.py`'s `base` run (its recipe and batches) with the library variant
``v_nibbles`` and keeps beside it, per quantized tensor, AdamW's per-element second moment of the
*same* gradients (``v <- beta2 v + (1 - beta2) g^2``, float32, no quantisation). Every ``--every``
steps it decodes the optimizer's ``v`` (the low nibble against the factored estimate, D20) and
prints per tensor class: the share of codes at the lowest and highest level (clamped there or
rounded into them), and quantiles of ``sqrt(v_adamw / v_nibbles)``: the factor by which this
step's update of an element is smaller (< 1) or larger (> 1) than AdamW's with the same first
moment. Also the same for the factored estimate alone (the default's ``v``), for comparison.
Diagnostic only: the run is `research/early_stall.py`'s (same seed, same losses).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
for _p in (ROOT / "benchmarks", ROOT / "research", ROOT):
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))

import torch  # noqa: E402

from gefen_dist.core.nibbles import V_LEVELS  # noqa: E402
from gefen_dist.core.step import column_ratios, row_factors  # noqa: E402

QS = (0.05, 0.25, 0.5, 0.75, 0.95)


def _class(name: str) -> str:
    for k in ("wte", "wpe", "c_attn", "attn.c_proj", "c_fc", "mlp.c_proj", "lm_head"):
        if k in name:
            return k
    return name


def decoded_v(st) -> tuple:
    """(v of the stored codes, the factored estimate) of one nibbles tensor, ``[rows, slab]``."""
    vc = st["v_col"]
    slab = vc.shape[-1]
    rows = st["v_row"].numel()
    G = vc.shape[0] if vc.dim() > 1 else 1
    fac = st["v_row"].view(-1, 1) * row_factors(column_ratios(vc), 0, 0, rows, rows // G)
    code = st["idx"].view(rows, slab).long() & 15
    lv = torch.tensor(V_LEVELS, dtype=torch.float32)
    return fac * lv[code], fac.expand(rows, slab), code


def snapshot(model, opt, v_adam) -> dict:
    out = {}
    for name, p in model.named_parameters():
        st = opt.state.get(p, {})
        if "v_row" not in st or name not in v_adam:
            continue
        v_nib, fac, code = decoded_v(st)
        va = v_adam[name].view_as(v_nib)
        keep = va > 0
        r = (va[keep] / v_nib[keep].clamp_min(1e-38)).sqrt()
        rf = (va[keep] / fac[keep].clamp_min(1e-38)).sqrt()
        out[name] = dict(cls=_class(name), n=int(code.numel()), low=float((code == 0).float().mean()),
                         high=float((code == 15).float().mean()),
                         ratio=[float(x) for x in torch.quantile(r[:2_000_000].float(), torch.tensor(QS))],
                         ratio_fac=[float(x) for x in torch.quantile(rf[:2_000_000].float(), torch.tensor(QS))])
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seed", type=int, default=3)
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--every", type=int, default=25)
    ap.add_argument("--preset", default="base")
    ap.add_argument("--json", default=None)
    ap.add_argument("--variant", default="v_nibbles", help="a research/quality_variants.py variant of the one-byte "
                    "layout (e.g. v_nibbles_qr: the eager emulation of quasi-random draws)")
    a = ap.parse_args(argv)
    torch.set_num_threads(1)
    import quality
    import quality_variants  # noqa: F401  (registers v_nibbles)
    from launch.corpus import Batches, load_corpus
    from launch.gpt import GPT, get_config

    cfg = quality.lm_config(argparse.Namespace(quick=False, lm_preset=a.preset, lm_batch=None, lm_context=None,
                                               lm_steps=None))
    train, _, _ = load_corpus()
    mcfg = get_config(cfg["preset"], context=cfg["context"])
    torch.manual_seed(a.seed)
    model = GPT(mcfg)
    batches = Batches(train, cfg["batch"], cfg["context"], seed=a.seed)
    lr0 = cfg["lr"]
    opt = quality.make_optimizer(a.variant, model, cfg["weight_decay"], lr0, cfg["betas"], a.seed,
                                 dim=mcfg.d_model, n_heads=mcfg.n_head)
    beta2 = cfg["betas"][1]
    v_adam = {}
    records = []
    for t in range(a.steps):
        quality.set_lr(opt, lr0 * quality.lr_mult(t, cfg["steps"], cfg["warmup"], cfg["min_lr_frac"]))
        x, y = batches(t)
        opt.zero_grad(set_to_none=True)
        loss = model(x, y)[1]
        loss.backward()
        for name, p in model.named_parameters():
            if p.grad is not None and p.dim() >= 2:
                g2 = p.grad.detach().float() ** 2
                v = v_adam.setdefault(name, torch.zeros_like(g2))
                v.mul_(beta2).add_(g2, alpha=1 - beta2)
        quality._step(opt)
        if (t + 1) % a.every == 0:
            snap = snapshot(model, opt, v_adam)
            records.append(dict(step=t + 1, loss=float(loss), tensors=snap))
            by = {}
            for s in snap.values():
                by.setdefault(s["cls"], []).append(s)
            print(f"step {t + 1}: train loss {float(loss):.3f}")
            for cls, ss in by.items():
                n = sum(s["n"] for s in ss)
                low = sum(s["low"] * s["n"] for s in ss) / n
                high = sum(s["high"] * s["n"] for s in ss) / n
                med = sorted(s["ratio"][2] for s in ss)[len(ss) // 2]
                q05 = min(s["ratio"][0] for s in ss)
                q95 = max(s["ratio"][4] for s in ss)
                fmed = sorted(s["ratio_fac"][2] for s in ss)[len(ss) // 2]
                print(f"  {cls:12s} codes at lowest {100 * low:5.1f}%  highest {100 * high:5.1f}%   "
                      f"sqrt(v_adamw/v) q05 {q05:.2f} median {med:.2f} q95 {q95:.2f}   (factored estimate: median {fmed:.2f})",
                      flush=True)
    if a.json:
        Path(a.json).write_text(json.dumps(dict(seed=a.seed, preset=a.preset, variant=a.variant, records=records),
                                            indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
