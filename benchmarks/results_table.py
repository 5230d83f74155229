"""The README's results table, from the stored results in docs/results/ (nothing is measured here).

    python benchmarks/results_table.py            # print the table
    python benchmarks/results_table.py --write    # and splice it into README.md (results_table markers)

Each row names what was measured, the figure, and the hardware, torch version and date that the
stored JSON records for it ("not recorded" where the file does not say); ``--commands`` also
prints the command that wrote each file. tests/test_readme.py checks that README.md holds exactly this table.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "docs" / "results"
if str(ROOT / "benchmarks") not in sys.path:
    sys.path.insert(0, str(ROOT / "benchmarks"))

from _docs import splice  # noqa: E402
from seed_gaps import load_finals, seed_gaps  # noqa: E402

NR = "not recorded"
MARKER = "results_table"


def _load(name: str) -> dict:
    return json.loads((RESULTS / name).read_text())


def _day(ts) -> str:
    """A run's date (YYYY-MM-DD) from a unix time or an ISO timestamp."""
    return time.strftime("%Y-%m-%d", time.gmtime(ts)) if isinstance(ts, (int, float)) else str(ts)[:10]


def _span(days) -> str:
    days = sorted(set(days))
    return days[0] if len(days) == 1 else f"{days[0]} to {days[-1]}"


def _runs(*files: str):
    """(records, their dates) of the quality runs files."""
    recs = [json.loads(line) for f in files for line in (RESULTS / f).read_text().splitlines() if line.strip()]
    return recs, [_day(r["time"]) for r in recs if "time" in r]


def _params(recs, preset: str) -> str:
    n = next(r["result"]["params"] for r in recs if r["workload"] == "lm" and r["config"].get("preset") == preset)
    return f"{n / 1e6:.2f}M" if n >= 1e6 else f"{n:,}"


def _torch(recs) -> str:
    """The torch versions the records name (quality runs record ``torch`` from 2026-12-04 on)."""
    vs = sorted({r["torch"] for r in recs if r.get("torch")})
    if not vs:
        return NR
    return ", ".join(vs) + ("" if all(r.get("torch") for r in recs) else f" ({NR} for some runs)")


def _pct(x: float) -> str:
    return f"{x:+.2f}%"


def rows() -> list:
    """(what, result, hardware, torch, date, command) per row."""
    out = []
    mem = _load("memory.json")
    out.append((f"optimizer state, GPT-2 small ({mem['params']:,} params)",
                f"**{mem['gefen_bytes_per_param']:.4f} B/param** (default) vs AdamW {mem['adamw_bytes_per_param']:.4f} "
                f"({mem['ratio_adamw_over_gefen']:.2f}x less)", "any (counted bytes)", mem.get("torch", NR),
                mem.get("date", NR), "python benchmarks/memory.py"))

    # the shipped default (research/quality_variants.py's v_default_fused: the library's defaults, native step)
    # paired by seed with AdamW, from the runs files benchmarks/peers_table.py reads
    from peers_table import STALL_FRAC, files_of, finals

    variant, kind = "v_default_fused", "d17"  # the shipped default's runs (peers_table.py's first row)
    for preset in ("small", "base"):
        try:
            res = seed_gaps(finals(preset, variant, kind), variant, stall_frac=STALL_FRAC[preset])
        except ValueError:
            continue
        mine = [json.loads(line) for f in files_of(preset, kind) for line in f.read_text().splitlines()
                if line.strip()]
        mine = [r for r in mine if r["workload"] == "lm" and r["variant"] == variant
                and r["config"].get("preset") == preset and r["config"].get("steps") == 800]
        tw = res["trains_well"]
        behind = sum(r["gap_pct"] > 0 for r in res["seeds"] if r["base_trains_well"])
        stalled = [r for r in res["seeds"] if not r["base_trains_well"]]
        if tw["n"] >= 3:
            result = (f"**{_pct(tw['mean'])}** mean over {tw['n']} seeds (95% interval {_pct(tw['ci95'][0])} to "
                      f"{_pct(tw['ci95'][1])}), behind on {behind}, worst {_pct(tw['max'])}")
        else:
            result = ", ".join(f"{_pct(r['gap_pct'])} (seed {r['seed']})" for r in res["seeds"] if r["base_trains_well"])
        if stalled:
            result += "; AdamW stalls on seed " + ", ".join(f"{r['seed']} ({_pct(r['gap_pct'])})" for r in stalled)
        alone = [r for r in res["seeds"] if r["base_trains_well"] and not r["variant_trains_well"]]
        bw = res["both_train_well"]
        if alone and bw.get("n", 0) >= 2:  # the default stays on base's early plateau where AdamW leaves it
            result += (f"; it stays on the early plateau on seed{'s' if len(alone) > 1 else ''} "
                        + ", ".join(str(r["seed"]) for r in alone) + f"; where both leave it {_pct(bw['mean'])} "
                        f"({bw['n']} seeds, {_pct(bw['ci95'][0])} to {_pct(bw['ci95'][1])})")
        al = res["all"]
        if stalled and al["n"] >= 3:  # AdamW's stalls counted too (peers_table._unconditional)
            result += (f"; over all {al['n']} seeds run {_pct(al['mean'])} ({_pct(al['ci95'][0])} to "
                       f"{_pct(al['ci95'][1])})")
        hosts = sorted({r.get("host") for r in mine if r.get("host")})
        out.append((f"val loss vs AdamW, `{preset}` LM ({_params(mine, preset)} params, 800 steps), the default",
                    result, "; ".join(hosts) or NR, _torch(mine), _span(_day(r["time"]) for r in mine),
                    "python benchmarks/peers_table.py"))

    # the shipped default on `tiny` (gefen_auto: the library's defaults named explicitly, after D17)
    tiny = ROOT / "research" / "results" / "tiny_rows8_ab" / "runs.jsonl"
    if tiny.exists():
        fin = {k: v for k, v in load_finals([RESULTS / "quality_runs.jsonl"], preset="tiny", steps=3000).items()
               if k[0] == "adamw"}
        fin.update({k: v for k, v in load_finals([tiny], preset="tiny", steps=3000).items() if k[0] == "gefen_auto"})
        try:
            res = seed_gaps(fin, "gefen_auto")
            gaps = [r["gap_pct"] for r in res["seeds"]]
            mine = [r for r in (json.loads(line) for line in tiny.read_text().splitlines() if line.strip())
                    if r["variant"] == "gefen_auto"]
            out.append(("val loss vs AdamW, `tiny` LM (120,576 params, 3,000 steps), the default",
                        ", ".join(_pct(g) for g in gaps) + f" (seeds {', '.join(str(r['seed']) for r in res['seeds'])}; "
                        f"mean {_pct(statistics.fmean(gaps))})", "; ".join(sorted({r.get('host') for r in mine})) or NR,
                        _torch(mine), _span(_day(r["time"]) for r in mine), "python benchmarks/quality.py --lm-preset tiny ..."))
        except ValueError:
            pass

    soak = _load("soak.json")
    g, a = soak["runs"]["gefen"], soak["runs"]["adamw"]
    out.append((f"soak: `tiny` LM, {g['steps']:,} steps",
                f"{g['nonfinite_losses']} non-finite losses, constant state, RSS {g['rss_growth_end_bytes'] / 2**20:+.1f} MiB; "
                f"final val loss {_pct(100 * (g['final_val_loss'] / a['final_val_loss'] - 1))} vs AdamW (1 seed, "
                f"{g['state_bytes_per_param']:.3f} B/param; the library's default of that date)",
                soak["machine"], soak["torch"], soak["date"], "python benchmarks/soak.py"))

    for fname, isa in (("step_speed_peers_avx2.json", "AVX2 path"), ("step_speed_peers.json", "AVX-512 VBMI path")):
        sp = _load(fname)
        m = sp["results"]["fp32"]["methods"]
        dsm = m.get("deepspeed_cpu_adam", {})
        ds = dsm.get("ratio_to_torch_adamw_fused")
        ds_where = "" if dsm.get("params") == m["Gefen_e2e_fused"].get("params") else " (transformer block 0)"
        e2e = m["Gefen_e2e_fused"]
        out.append((f"CPU step, GPT-2 small fp32, 1 thread, C kernel's {isa}",
                    f"**slower** than fused AdamW: `Gefen.step()` {e2e['ratio_to_torch_adamw_fused']:.2f}x "
                    f"its time (at {e2e['state_bytes_per_param']:.4f} B/param), kernel "
                    f"{m['gefen_fused']['ratio_to_torch_adamw_fused']:.2f}x"
                    + (f"; DeepSpeed's CPU Adam {ds:.2f}x{ds_where}" if ds else ""),
                    f"{sp['meta']['cpu']} ({sp['meta'].get('capability', NR)})", sp["meta"]["torch"],
                    sp["meta"].get("date", NR), f"python benchmarks/step_speed.py --threads 1 --out docs/results/{fname} ..."))

    fl = _load("flat_step.json")["ms"]
    fm = _load("flat_step.json")
    out.append(("DeepSpeed flat-buffer step, GPT-2 small, 1 thread",
                f"{fl['flat_fused']['cpu_median_ms'] / 1e3:.2f} s CPU time vs fused AdamW "
                f"{fl['torch_adamw_fused']['cpu_median_ms'] / 1e3:.2f} s",
                fm["cpu"], fm["torch"], _day(fm["timestamp"]), "python benchmarks/flat_step.py"))

    gp = _load("gpu_step.json")
    o = gp["optimizers"]

    def ratio(k):
        return o[k]["ms"]["gefen_default"]["median_ms"] / o[k]["ms"]["torch_adamw_fused"]["median_ms"]

    out.append(("GPU step, `Gefen.step()` vs fused AdamW",
                f"**slower**: {ratio('small_fp32'):.1f}x (GPT-2 small fp32), {ratio('xl_fp32'):.1f}x (GPT-2 XL), "
                f"{ratio('small_bf16'):.1f}x / {ratio('xl_bf16'):.1f}x in bf16",
                gp["gpu"], gp["torch"], _day(gp["timestamp"]), "bash benchmarks/gpu_check.sh"))

    th = _load("throughput.json")
    fs = th["results"]["fsdp"]
    out.append((f"FSDP2 under AdamW's memory budget, {th['settings']['nproc']} CPU ranks",
                f"largest micro-batch {fs['adamw']['fit_micro_batch']} -> {fs['gefen']['fit_micro_batch']}, tokens/s "
                f"{fs['gefen']['tokens_per_s'] / fs['adamw']['tokens_per_s']:.2f}x",
                f"{th['env']['machine']}, {th['env']['cpus']} CPUs", th["env"]["torch"], NR, "python benchmarks/throughput.py"))

    fst = _load("first_step.json")
    gs = fst["gefen_step"]
    out.append(("first step (periods + codebook), GPT-2 small",
                f"{gs['first_step_s']:.2f} s vs an ordinary step's {gs['ordinary_step_s']:.2f} s",
                fst["cpu"], fst.get("torch", NR), fst.get("date", NR), "python benchmarks/first_step.py"))

    zw = _load("zero_wire.json")
    out.append((f"ZeroGefen all-gather bytes, GPT-2 small, {zw['analytic_gpt2_small'][0]['world_size']} ranks",
                f"{zw['analytic_gpt2_small'][0]['ratio_fp32_over_zero']:.2f}x fewer than an fp32 parameter all-gather",
                "any (counted bytes)", zw["torch"], zw.get("date", NR), "python benchmarks/zero_wire.py"))
    return out


def table_md() -> str:
    lines = ["<!-- generated by `python benchmarks/results_table.py --write`; do not edit -->", "",
             "| measured | result | hardware | torch | date |", "|---|---|---|---|---|"]
    lines += ["| " + " | ".join(r[:5]) + " |" for r in rows()]
    return "\n".join(lines) + "\n"


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--write", action="store_true", help="splice the table into README.md")
    ap.add_argument("--commands", action="store_true", help="also print the command behind each row")
    args = ap.parse_args(argv)
    md = table_md()
    print(md, end="")
    if args.commands:
        print("\n".join(f"{r[0]}: {r[5]}" for r in rows()))
    if args.write and not splice(ROOT / "README.md", MARKER, md):
        raise SystemExit(f"README.md has no {MARKER} markers")


if __name__ == "__main__":
    main()
