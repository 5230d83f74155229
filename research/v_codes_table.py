"""The per-element second moment in one byte or half a byte on the `small` LM (research/quality-log.md,
"A per-element v in a byte"): every stored run of the ``v_*`` variants of research/quality_variants.py
that emulate coded per-element ``v`` on the library's elementwise path, paired by seed with the stored
AdamW runs and with the shipped default (``v_default_fused``) on the same seeds, plus the state each
layout would hold (bytes per parameter on this model and on GPT-2 small).

    python research/v_codes_table.py [--md] [--paired] [--tiny]   # reads research/results/{v8_small,nibbles_*,...}

The emulation stores fp32 ``v`` (its runs record ~5 B/param); the bytes printed here are the layout's:
per element one byte of first moment plus the code (8 or 4 bits), an fp32 reference per 256 elements
(block-maximum codes) or an fp32 row and column mean (codes relative to the factored estimate), and
the default's scale blocks; tensors outside the coded set keep the default's layout.
"""
from __future__ import annotations

import argparse
import glob
import json
import math
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]
from seed_gaps import load_finals, summarize  # noqa: E402

R = ROOT / "research" / "results"
RUNS = ([ROOT / "docs/results/quality_runs.jsonl", ROOT / "docs/results/quality_runs_r15.jsonl"] + sorted(Path(p) for p in glob.glob(str(R / "d17_small/runs_v_default_fused*.jsonl")))
        + sorted(Path(p) for p in glob.glob(str(R / "v8_small/runs_*.jsonl")))
        + sorted(Path(p) for p in glob.glob(str(R / "m4v4_small/runs_*.jsonl")))
        + sorted(Path(p) for p in glob.glob(str(R / "nonemb_elementwise_small/runs_*.jsonl")))
        + [R / "emb_elementwise_small/runs.jsonl"]
        + [R / "default_base/runs_adamw.jsonl", R / "d17_base/runs_v_default_fused.jsonl", R / "emb_elementwise_base/runs.jsonl"]
        + sorted(Path(p) for p in glob.glob(str(R / "v8_base/runs_*.jsonl")))
        + sorted(Path(p) for p in glob.glob(str(R / "m4v4_base/runs_*.jsonl")))
        + sorted(Path(p) for p in glob.glob(str(R / "nibbles_*/runs_*.jsonl")) if "/nibbles_qr_" not in p))
# the library's "nibbles" while its draws were quasi-random in time (2026-12-07 to 2026-12-08): its runs record
# the variant v_nibbles too, so they are read apart and named v_nibbles_quasi here
QUASI_RUNS = sorted(Path(p) for p in glob.glob(str(R / "nibbles_qr_*/runs_*.jsonl")))
# variant -> (which weights are coded: name substrings, code bits, "block" | "minmax" | "fac" | None for fp32[,
# the first moment's bits when not 8])
LAYOUTS = {
    "v_all_elementwise_fused": (("weight",), 32, None),
    "v_all_v8_fused": (("weight",), 8, "block"),
    "v_all_v4_fused": (("weight",), 4, "block"),
    "v_all_v4fac_fused": (("weight",), 4, "fac"),
    "v_all_v4mm_fused": (("weight",), 4, "minmax"),
    "v_all_m4v4_fused": (("weight",), 4, "block", 4),
    "v_all_m4sv4_fused": (("weight",), 4, "block", 4),
    "v_all_m4v4mm_fused": (("weight",), 4, "minmax", 4),
    "v_all_m6v2fac_fused": (("weight",), 2, "fac", 6),
    "v_all_m6sv2fac_fused": (("weight",), 2, "fac", 6),
    "v_all_m5sv3fac_fused": (("weight",), 3, "fac", 5),
    "v_all_m4sv4fac_fused": (("weight",), 4, "fac", 4),
    "v_bytes_fac_proto": (("weight",), 4, "fac", 4),
    "v_bytes_block_proto": (("weight",), 4, "block", 4),
    "v_bytes_fac_dec_proto": (("weight",), 4, "fac", 4),
    "v_nib_core": (("weight",), 4, "fac", 4),
    "v_nibbles": ("library", 4, "fac", 4),  # the library's own layout (plan.tensor_state, "nibbles"), i.i.d. draws
    "v_nibbles_quasi": ("library", 4, "fac", 4),  # the same with the draws quasi-random in time (QUASI_RUNS)
    "v_nib_core_dec": (("weight",), 4, "fac", 4),
    "v_bytes_m8_nearest_proto": (("weight",), 0, "fac", 8),
    "v_bytes_m8_stoch_proto": (("weight",), 0, "fac", 8),
    "v_embattn_v8_fused": (("wte", "wpe", "attn.c_attn"), 8, "block"),
    "v_emb_elementwise_fused": (("wte", "wpe"), 32, None),
    "v_attn_elementwise_fused": (("attn.c_attn",), 32, None),
    "v_mlp_elementwise_fused": (("mlp.c_fc", "mlp.c_proj"), 32, None),
}


def finals(variant, preset="small"):
    """``{seed: final validation loss}`` of ``variant``'s stored runs (benchmarks/seed_gaps.load_finals)."""
    if variant == "v_nibbles_quasi":
        runs = load_finals([f for f in QUASI_RUNS if f.exists()], preset)
        return {seed: r["val"] for (v, seed), r in runs.items() if v == "v_nibbles"}
    runs = load_finals([f for f in RUNS if f.exists()], preset)
    return {seed: r["val"] for (v, seed), r in runs.items() if v == variant}


def layout_bytes(shapes, coded, bits, ref, m_bits=8):
    """Bytes per parameter of the layout over ``shapes`` ((name, shape) pairs)."""
    from gefen_dist.plan import tensor_state

    total = n_all = 0
    if coded == "library":  # the library's second_moment="nibbles" (D20): gefen_dist.plan counts its state
        n_all = sum(math.prod(s) for _, s in shapes)
        return sum(tensor_state(s, second_moment="nibbles")["gefen_bytes"] for _, s in shapes) / n_all
    for name, shape in shapes:
        n = math.prod(shape)
        n_all += n
        if len(shape) >= 2 and any(s in name for s in coded):
            st = tensor_state(shape, second_moment="elementwise")
            if st["kind"] == "exact":
                total += st["gefen_bytes"]
                continue
            b = st["gefen_bytes"] - 4 * n + bits / 8 * n - (8 - m_bits) / 8 * n  # the scale blocks stay
            b += 0 if ref is None else {"block": 4 * n / 256, "minmax": 8 * n / 256}.get(
                ref, 4 * (shape[0] + n // shape[0]))
            total += b
        else:
            total += tensor_state(shape)["gefen_bytes"]
    return total / n_all


def small_shapes():
    from launch.gpt import GPT, PRESETS
    return [(n, tuple(p.shape)) for n, p in GPT(PRESETS["small"]).named_parameters()]


def gpt2_small_shapes():
    from _gpt2 import gpt2_shapes
    return [(n if n not in ("wte", "wpe") else n + ".weight", s) for n, s in gpt2_shapes("small")]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--md", action="store_true", help="print a markdown table")
    ap.add_argument("--paired", action="store_true",
                    help="also each variant's gap minus the default's, per seed, with its mean and 95%% interval")
    ap.add_argument("--tiny", action="store_true",
                    help="also the `tiny` preset at 3,000 steps (context 64): v_nibbles and the default (gefen_auto) "
                         "against the stored AdamW runs of the same seeds")
    ap.add_argument("--digits-adamw", default=None, metavar="RUNS_JSONL",
                    help="AdamW's digits runs from this file instead (e.g. research/results/default_digits/runs.jsonl)")
    ap.add_argument("--digits", default=None, metavar="RUNS_JSONL",
                    help="also the digits runs of this file: each variant's held-out loss against AdamW's in it")
    args = ap.parse_args(argv)
    for preset in ("small", "base"):
        table(preset, args)
    if args.tiny:
        tiny3000()
    if args.digits:
        digits(Path(args.digits), Path(args.digits_adamw) if args.digits_adamw else None)


TINY_RUNS = ["docs/results/quality_runs.jsonl", "research/results/tiny_rows8_ab/runs_a.jsonl",
             "research/results/tiny_rows8_ab/runs.jsonl", "research/results/nibbles_tiny/runs_v_nibbles_0-3.jsonl"]


TINY_QUASI = "research/results/nibbles_qr_tiny/runs_v_nibbles_0-3.jsonl"  # its v_nibbles read as v_nibbles_quasi


def tiny3000():
    """`tiny` at 3,000 steps, context 64 (the issue's long tiny run): final validation against AdamW's."""
    runs = {}
    for f in TINY_RUNS + [TINY_QUASI]:
        for line in (ROOT / f).read_text().splitlines():
            r = json.loads(line)
            c = r.get("config", {})
            if c.get("preset") == "tiny" and c.get("steps") == 3000 and c.get("context") == 64:
                v = "v_nibbles_quasi" if f == TINY_QUASI else r["variant"]
                runs.setdefault(v, {})[r["seed"]] = r["result"]["val_loss"]
    adamw = runs["adamw"]
    print("\n`tiny` preset, 3,000 steps, context 64, against AdamW's final validation:\n")
    for v in ("v_nibbles", "v_nibbles_quasi", "gefen_auto"):
        seeds = sorted(s for s in runs.get(v, {}) if s in adamw and s in runs["v_nibbles"])
        gaps = [100 * (runs[v][s] / adamw[s] - 1) for s in seeds]
        sg = summarize(gaps)
        print(f"* `{v}`{' (the default)' if v == 'gefen_auto' else ''}, seeds {', '.join(map(str, seeds))}: "
              + ", ".join(f"{g:+.2f}%" for g in gaps)
              + f"; mean {sg['mean']:+.2f}% [{sg['ci95'][0]:+.2f}, {sg['ci95'][1]:+.2f}]")


def digits(path, adamw_path=None):
    """Each variant's held-out loss on digits against the AdamW run of the same seed in ``path`` (or in
    ``adamw_path``, for a file of one variant's runs)."""
    runs = {}
    for f in [path] + ([adamw_path] if adamw_path else []):
        for line in f.read_text().splitlines():
            r = json.loads(line)
            if r.get("workload") == "digits" and (f == path or r["variant"] == "adamw"):
                runs.setdefault(r["variant"], {})[r["seed"]] = r["result"]["val_loss"]
    adamw = runs.pop("adamw")
    print(f"\ndigits ({path.name}), held-out loss against AdamW's in {adamw_path or 'the same file'}:\n")
    for v, f in runs.items():
        gaps = [100 * (f[s] / adamw[s] - 1) for s in sorted(f) if s in adamw]
        print(f"* `{v}`: " + ", ".join(f"{g:+.2f}%" for g in gaps) + f" (mean {statistics.fmean(gaps):+.2f}%)")


def table(preset, args):
    adamw, default = finals("adamw", preset), finals("v_default_fused", preset)
    sm, g2 = small_shapes(), gpt2_small_shapes()  # the bytes column: the `small` model and GPT-2 small
    rows = []
    for v, (coded, bits, ref, *m_bits) in LAYOUTS.items():
        f = finals(v, preset)
        seeds = sorted(s for s in f if s in adamw)
        if not seeds:
            continue
        gaps = [100 * (f[s] / adamw[s] - 1) for s in seeds]
        dgaps = [100 * (default[s] / adamw[s] - 1) for s in seeds if s in default]
        sg = summarize(gaps)
        rows.append(dict(variant=v, seeds=seeds, gaps=gaps, mean=sg["mean"], ci=sg.get("ci95"),
                         default_gaps=dgaps, default_mean=statistics.fmean(dgaps) if dgaps else float("nan"),
                         bpp_small=layout_bytes(sm, coded, bits, ref, *m_bits),
                         bpp_gpt2=layout_bytes(g2, coded, bits, ref, *m_bits)))
    print(f"\n`{preset}` preset, 800 steps:\n")
    head = ("| variant | v of the coded weights | B/param, `small` / GPT-2 small | seeds | vs AdamW per seed | mean [95%] "
            "| the default on those seeds (mean) |")
    print(head)
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        coded, bits, ref, *m_bits = LAYOUTS[r["variant"]]
        what = "library: 4-bit codes vs factored; 4-bit first moment" if coded == "library" else (
            "prototype: " if r["variant"].endswith("_proto") else "") + (
            "fp32" if ref is None else "the factored estimate" if not bits else f"{bits}-bit codes, "
            + {"block": "per-256 maxima", "minmax": "per-256 ranges"}.get(ref, "vs factored")) + (
            f"; {m_bits[0]}-bit first moment" if m_bits else "")
        print(f"| `{r['variant']}` | {what} ({'every weight' if coded == 'library' else ', '.join(coded)}) | {r['bpp_small']:.2f} / {r['bpp_gpt2']:.2f} | "
              f"{', '.join(map(str, r['seeds']))} | " + ", ".join(f"{g:+.2f}%" for g in r["gaps"])
              + f" | {r['mean']:+.2f}% " + (f"[{r['ci'][0]:+.2f}, {r['ci'][1]:+.2f}]" if len(r["gaps"]) > 1 else "(one seed)")
              + " | "
              + ", ".join(f"{g:+.2f}%" for g in r["default_gaps"]) + f" ({r['default_mean']:+.2f}%) |")
    if args.paired:
        print("\nPaired with the default (the variant's gap minus the default's, points):\n")
        for r in rows:
            same = len(r["default_gaps"]) == len(r["gaps"])  # the default ran on every one of the seeds
            d = [g - dg for g, dg in zip(r["gaps"], r["default_gaps"])] if same else []
            if len(d) > 1:
                sd = summarize(d)
                print(f"* `{r['variant']}`: {sd['mean']:+.2f} [{sd['ci95'][0]:+.2f}, {sd['ci95'][1]:+.2f}], "
                      f"better on {sum(x < 0 for x in d)} of {len(d)}")
        q, i = finals("v_nibbles_quasi", preset), finals("v_nibbles", preset)
        both = sorted(s for s in q if s in i)
        if both:  # the two draw rules of "nibbles" on the same seeds (final validation loss, %)
            d = [100 * (q[s] / i[s] - 1) for s in both]
            sd = summarize(d)
            print(f"\n`v_nibbles_quasi` against `v_nibbles` (i.i.d. draws), final validation loss, seeds "
                  f"{', '.join(map(str, both))}: " + ", ".join(f"{x:+.2f}%" for x in d)
                  + (f"; mean {sd['mean']:+.2f}% [{sd['ci95'][0]:+.2f}, {sd['ci95'][1]:+.2f}]" if len(d) > 1 else "")
                  + f", lower on {sum(x < 0 for x in d)} of {len(d)}")
    if not args.md and preset == "small":
        print(json.dumps({"default_bpp_gpt2": layout_bytes(g2, (), 0, None)}, indent=None))


if __name__ == "__main__":
    main()
