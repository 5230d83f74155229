"""The row blocks of the factored second moment on the `small` LM: finer blocks (D12's column profile per
block of rows, down to blocks of 64 or 32 rows: research/quality_variants.py's ``y_rb64_fused``,
``y_rb32_fused``), and the default on the model with its blocks' linear layers in Hugging Face GPT-2's Conv1D
layout, where the row blocks do not apply (``z_conv1d_default_fused``, paired with AdamW on the same model,
``z_conv1d_adamw``). Every stored run, paired by seed with AdamW and with the shipped default on the native
step (``v_default_fused``, research/results/d17_small), and the state each layout holds on this model and on
GPT-2 small (``gefen_dist.plan`` with the blocks the variant asks for). Column blocks (D21): the research emulation
``z_conv1d_colblocks`` (``ColBlockGefen``), the library's ``col_blocks="auto"`` in the Conv1D layout
(``z_conv1d_colblocks_lib``, also paired with the Conv1D default) and in the nn.Linear layout (``y_colblocks_lib``).

    python research/row_blocks_table.py [--md]      # reads research/results/{rb,conv1d,colblocks}_small/*.jsonl
    python research/row_blocks_table.py --preset base --md   # the base LM: research/results/colblocks_base, d17_base
"""
from __future__ import annotations

import argparse
import glob
import math
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks"), str(ROOT / "research")]
from peers_table import finals as peer_finals  # noqa: E402
from seed_gaps import load_finals, summarize  # noqa: E402

R = ROOT / "research" / "results"
VARIANTS = {"y_rb64_fused": 64, "y_rb32_fused": 32, "z_conv1d_default_fused": None,  # rows per block (None: auto)
            "z_conv1d_colblocks": None, "z_conv1d_colblocks_sb": None, "z_conv1d_colblocks_lib": None,
            "y_colblocks": None, "y_colblocks_lib": None}
PAIRED_ADAMW = {"z_conv1d_default_fused": "z_conv1d_adamw",  # AdamW on the same (Conv1D-layout) model
                "z_conv1d_colblocks": "z_conv1d_adamw", "z_conv1d_colblocks_sb": "z_conv1d_adamw",
                "z_conv1d_colblocks_lib": "z_conv1d_adamw"}
# column blocks (D21: D12 transposed on (R, k x R) weights): research/_variants.py's ColBlockGefen, or the library's
COLBLOCKS = {"z_conv1d_colblocks", "z_conv1d_colblocks_sb", "z_conv1d_colblocks_lib", "y_colblocks", "y_colblocks_lib"}
SCALE_IN_BLOCKS = {"z_conv1d_colblocks_sb", "z_conv1d_colblocks_lib", "y_colblocks_lib"}  # scale blocks inside them


def runs(variant: str, preset: str = "small") -> dict:
    files = sorted(Path(p) for d in ("rb", "conv1d", "colblocks") for p in glob.glob(str(R / f"{d}_{preset}" / "runs_*.jsonl")))
    return {s: r["val"] for (v, s), r in load_finals(files, preset=preset).items() if v == variant}


def default_runs(preset: str = "small") -> dict:
    files = sorted(Path(p) for p in glob.glob(str(R / f"d17_{preset}" / "runs_v_default_fused*.jsonl")))
    return {s: r["val"] for (v, s), r in load_finals(files, preset=preset).items() if v == "v_default_fused"}


def adamw_runs(preset: str = "small") -> dict:
    return {s: r["val"] for (v, s), r in peer_finals(preset, "gefen_default", "default").items() if v == "adamw"}


def state_bytes(shapes, rows, colblocks: bool = False, scale_in_blocks: bool = False) -> float:
    """Bytes per parameter of the default with blocks of ``rows`` rows where they divide (None: the default);
    ``colblocks``: and a row EMA per block of R columns on every (R, k x R) tensor, 2 <= k <= 8."""
    from gefen_dist.core.periods import factored_row_blocks, row_slab, shape_period
    from gefen_dist.plan import tensor_state

    total = n_all = 0
    for _, shape in shapes:
        n = math.prod(shape)
        n_all += n
        st = tensor_state(shape)
        b = st["gefen_bytes"]
        if rows and st["kind"] != "exact" and len(shape) >= 2:
            R, S = shape[0], row_slab(shape)
            if R >= 2 * rows and R % rows == 0:
                b += 4 * S * (R // rows - factored_row_blocks(shape, "auto"))
        if colblocks and st["kind"] != "exact" and len(shape) == 2 and shape[1] % shape[0] == 0 \
                and 2 <= shape[1] // shape[0] <= 8:
            b += 4 * shape[0] * (shape[1] // shape[0] - 1)
            if scale_in_blocks:  # absmax scales per block of the column block (the period rule on R columns)
                b += 4 * n // shape_period((shape[0], shape[0])) - 4 * n // st["scale_block"]
        total += b
    return total / n_all


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--md", action="store_true")
    ap.add_argument("--preset", default="small", choices=("small", "base"), help="the LM preset of the runs")
    a = ap.parse_args(argv)
    from launch.gpt import GPT, PRESETS
    from _gpt2 import gpt2_shapes

    small = [(n, tuple(p.shape)) for n, p in GPT(PRESETS[a.preset]).named_parameters()]
    gpt2 = list(gpt2_shapes("small"))
    ad, dflt = adamw_runs(a.preset), default_runs(a.preset)
    head = (f"| variant | B/param, `{a.preset}` / GPT-2 small | seeds | vs AdamW per seed | mean [95%] | the default on those "
            "seeds | paired with the default [95%], better on |")
    print(head if a.md else head.replace("|", " ").strip())
    if a.md:
        print("|---|---|---|---|---|---|---|")
    rows_out = [("the default (`v_default_fused`), every stored seed", None, dflt)] + [
        (k, v, runs(k, a.preset)) for k, v in VARIANTS.items()]
    for name, rows, got in rows_out:
        base = runs(PAIRED_ADAMW[name], a.preset) if name in PAIRED_ADAMW else ad
        seeds = sorted(s for s in got if s in base and s in dflt and s in ad)
        if not seeds:
            continue
        gaps = [100 * (got[s] / base[s] - 1) for s in seeds]
        dg = [100 * (dflt[s] / ad[s] - 1) for s in seeds]
        sg, sp = summarize(gaps), summarize([x - y for x, y in zip(gaps, dg)])
        ci = lambda s: (" [%+.2f, %+.2f]" % tuple(s["ci95"])) if len(seeds) > 1 else ""  # noqa: E731
        mine = name in VARIANTS  # (the (in, out) weights of the Conv1D layout: the blocks' 2-D shapes reversed)
        conv1d = [[(n, s[::-1] if len(s) == 2 and ".c_" in n else s) for n, s in shapes] for shapes in (small, gpt2)]
        sizes = "%.3f / %.3f" % tuple(state_bytes(sh, rows, name in COLBLOCKS, name in SCALE_IN_BLOCKS)
                                      for sh in (conv1d if name in PAIRED_ADAMW else (small, gpt2)))
        cells = [f"`{name}`" if mine else name, sizes,
                 ", ".join(map(str, seeds)), ", ".join("%+.2f%%" % g for g in gaps),
                 "%+.2f%%%s" % (sg["mean"], ci(sg)), "%+.2f%%" % statistics.fmean(dg),
                 ("%+.2f%s, %d of %d" % (sp["mean"], ci(sp), sum(x < y for x, y in zip(gaps, dg)), len(seeds)))
                 if mine else ""]
        print(("| " + " | ".join(cells) + " |") if a.md else "  ".join(cells))
    conv = runs("z_conv1d_default_fused", a.preset)
    for name in ("z_conv1d_colblocks", "z_conv1d_colblocks_lib"):
        cb = runs(name, a.preset)
        seeds = sorted(s for s in cb if s in conv)
        if not seeds:
            continue
        # column blocks against the Conv1D layout's default, paired by seed (the same AdamW divides both)
        d = [100 * (cb[s] / conv[s] - 1) for s in seeds]
        sd = summarize(d)
        ci = (" [%+.2f, %+.2f]" % tuple(sd["ci95"])) if len(seeds) > 1 else ""
        print(f"\n`{name}` against `z_conv1d_default_fused` (final validation loss, paired by seed): "
              + ", ".join("%+.2f%%" % x for x in d) + f" on seeds {', '.join(map(str, seeds))}; mean "
              + "%+.2f%%%s, lower on %d of %d" % (sd["mean"], ci, sum(x < 0 for x in d), len(seeds)))


if __name__ == "__main__":
    main()
