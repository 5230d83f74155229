"""Optimizer step time on the GPT-2-small tensor set (124,439,808 parameters), CPU, with peers.

    python benchmarks/step_speed.py [--threads N] [--rounds 5] [--eager-rounds 1] [--peer-rounds 3]
                                    [--dtypes fp32,bf16] [--peers all|none|a,b,...] [--no-e2e]

Tensors: wte 50257x768, wpe 1024x768, 12 blocks of c_attn (2304,768), attn c_proj (768,768),
c_fc (3072,768), mlp c_proj (768,3072), their biases, and the LayerNorm vectors (ln_1, ln_2,
ln_f). Matrices are quantized with period = row length capped the paper's way (a period
> 1024 becomes its smallest divisor > 1024, so 3072 -> 1536), scale block = period; 1-D
tensors take the exact AdamW update (``adamw_step_``). Gradients are synthetic,
``randn * 1e-3 * row_scale`` with a log-normal scale per row, the same tensors for every
method; all full-set methods update the same parameter tensors (each its own state).

Timed per step, interleaved in one process (round r runs every method once, in order), median
over rounds:

* ``gefen_fused``: ``gefen_dist.kernels.cpu.quantized_step_`` over the quantized tensors plus
  ``adamw_step_`` over the 1-D tensors (the whole step);
* ``gefen_eager``: the same with ``quantized_step_eager_`` (only in the first
  ``--eager-rounds`` rounds, default 1: a step takes tens of seconds);
* ``torch_adamw_fused`` / ``torch_adamw_foreach``: ``torch.optim.AdamW(fused=True)`` /
  ``(foreach=True)`` over all tensors;
* ``Gefen_e2e_fused`` / ``Gefen_e2e_eager``: ``gefen_dist.Gefen(...).step()`` end to end
  (one optimizer, ``fused`` toggled between steps; its first step, which learns periods and
  the codebook, is not timed), when ``gefen_dist.Gefen`` is importable;
* peers (``benchmarks/_peers.py``; only in the first ``--peer-rounds`` rounds, default 3; the first
  step of each, which allocates state, compiles or learns periods, is not timed but reported):
  on the whole set: ``adam_mini`` (Adam-mini 1.1.1), ``deepspeed_cpu_adam`` (DeepSpeedCPUAdam,
  deepspeed 0.19.8, its op JIT-built on first use: minutes, once), ``torch_adafactor``; on
  transformer block 0 only (7,087,872 parameters; too slow on this CPU for the whole set within the
  run budget), each against ``torch_adamw_fused@block0`` (torch fused AdamW on a copy of the same
  tensors, in the same rounds): ``torchao_adamw8bit`` / ``torchao_adamw4bit`` (torchao 0.18.0;
  torch.compile'd, so their first step compiles), ``bnb_adamw8bit`` (bitsandbytes 0.50.2, its CPU
  path), ``gefen_reference`` (gefen 1.2.3, fused=False) and ``gefen_x`` (gefen-x 0.5.0, in a child
  process with ``PYTHONPATH=$GEFENX_PATH``, timed there against its own block-0 torch AdamW; its
  package ``gefen`` collides with the reference). A peer that fails to build or run is listed in
  the JSON's ``skipped`` with the reason.

Reported per method: ms per step (median over rounds and, as the machine may be shared, the
minimum), the ratio to torch's fused AdamW (block-0 peers: to the block-0 baseline; also scaled
per parameter to 124M), ns/param, optimizer state bytes, and the peak RSS growth during one more
(untimed) step (``_peers.rss_peak_growth``: reset VmHWM through ``/proc/self/clear_refs``, step,
VmHWM minus the RSS before); plus a load-robust single-thread compute comparison (CPU time of one
4096x768 tensor step, fused Gefen kernel vs torch fused AdamW). Writes
``docs/results/step_speed.json``, ``docs/img/step_speed.png`` and ``docs/results/step_speed_table.md``
(spliced into ``docs/benchmarks.md`` between its markers).
"""
from __future__ import annotations

import argparse
import gc
import json
import logging
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from _gpt2 import GPT2_PARAMS, gpt2_shapes, capped_period  # noqa: E402,F401
from gefen_dist.core.step import adamw_step_, bias_corrections, quantized_step_eager_  # noqa: E402
from gefen_dist.kernels import cpu  # noqa: E402
from _docs import splice  # noqa: E402  (benchmarks/ is on sys.path when run as a script)

HP = dict(lr=6e-4, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1)


def demo_codebook() -> torch.Tensor:
    """The optimal codebook of a bell-shaped histogram (what training produces, roughly)."""
    import numpy as np

    from gefen_dist.core.codebook import NUM_BINS, solve_codebook

    c = (np.arange(NUM_BINS) + 0.5) / NUM_BINS * 2 - 1
    counts = np.round(1e6 * np.exp(-0.5 * (c / 0.15) ** 2)).astype(np.int64) + 1
    return solve_codebook(counts).codebook.float()


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


class Bench:
    def __init__(self, dtype: torch.dtype, cb: torch.Tensor, seed: int = 0):
        self.dtype = dtype
        self.cb = cb
        gen = torch.Generator().manual_seed(seed)
        self.names, self.params, self.grads = [], [], []
        for name, shape in gpt2_shapes():
            p = torch.nn.Parameter((torch.randn(shape, generator=gen) * 0.02).to(dtype))
            rows = shape[0] if len(shape) == 2 else 1
            row_scale = torch.exp(0.5 * torch.randn(rows, 1, generator=gen))
            g = (torch.randn(shape, generator=gen).view(rows, -1) * 1e-3 * row_scale).view(shape)
            p.grad = g.to(dtype)
            self.names.append(name)
            self.params.append(p)
        self.quant, self.vec = [], []
        for name, p in zip(self.names, self.params):
            if p.dim() >= 2:
                P = capped_period(p.shape[-1])
                n = p.numel()
                st = dict(idx=torch.full((n,), 127, dtype=torch.uint8), scale=torch.zeros(n // P),
                          v=torch.zeros(n // P), period=P)
                self.quant.append((p, st))
            else:
                self.vec.append((p, torch.zeros(p.shape), torch.zeros(p.shape)))
        self.step_no = 0

    def _hp(self):
        self.step_no += 1
        bc1, bc2 = bias_corrections(self.step_no, HP["beta1"], HP["beta2"])
        return dict(HP, bc1=bc1, bc2=bc2)

    def gefen(self, fused: bool) -> None:
        hp = self._hp()
        fn = cpu.quantized_step_ if fused else quantized_step_eager_
        with torch.no_grad():
            for p, st in self.quant:
                fn(p.view(-1), p.grad.view(-1), st["idx"], st["scale"], st["v"], self.cb,
                   period=st["period"], scale_block=st["period"], **hp)
            for p, m, v in self.vec:
                adamw_step_(p, p.grad, m, v, **hp)


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e3


SUBSET_PREFIX = "h.0."  # transformer block 0: 7,087,872 parameters
PEERS = ["adam_mini", "deepspeed_cpu_adam", "torch_adafactor", "torchao_adamw8bit", "torchao_adamw4bit",
         "bnb_adamw8bit", "gefen_reference", "gefen_x"]
# peers too slow on CPU for the whole 124M set within the run budget: timed on block 0, next to
# torch AdamW (fused) on the same tensors (the ratio is between the two)
SUBSET_PEERS = {"torchao_adamw8bit", "torchao_adamw4bit", "bnb_adamw8bit", "gefen_reference", "gefen_x"}
PEER_DESC = {
    "adam_mini": "adam-mini 1.1.1 Adam_mini(named tensors, dim=768, n_heads=12; c_attn as query/key: one v per "
                 "head; c_proj per neuron; wte/wpe per token)",
    "deepspeed_cpu_adam": "deepspeed 0.19.8 DeepSpeedCPUAdam(adamw_mode=True), JIT-built cpu_adam op (DS_BUILD_OPS=0)",
    "torch_adafactor": "torch.optim.Adafactor (defaults; factored v, no first moment)",
    "torchao_adamw8bit": "torchao 0.18.0 optim.AdamW8bit (torch.compile'd step; Inductor C++ on CPU)",
    "torchao_adamw4bit": "torchao 0.18.0 optim.AdamW4bit (torch.compile'd step; Inductor C++ on CPU)",
    "bnb_adamw8bit": "bitsandbytes 0.50.2 optim.AdamW8bit, CPU path",
    "gefen_reference": "reference gefen 1.2.3 Gefen(fused=False) (its CPU path)",
    "gefen_x": "gefen-x 0.5.0 Gefen (defaults; fused=False on CPU), in a subprocess with PYTHONPATH=<gefen-x dir>",
}


def _hp_kw():
    return dict(lr=HP["lr"], betas=(HP["beta1"], HP["beta2"]), eps=HP["eps"], weight_decay=HP["weight_decay"])


def build_peer(name, named):
    """(optimizer, step function) for peer ``name`` over ``named`` [(name, param)]; raises if the
    peer cannot run here."""
    from _peers import (adam_mini, adam_mini_step_quiet, import_bnb, import_ds_cpu_adam,
                        import_torchao_optim, require_gefen)

    params = [p for _, p in named]
    if name == "adam_mini":
        opt = adam_mini(named, dim=768, n_heads=12, **_hp_kw())
        return opt, lambda: adam_mini_step_quiet(opt)
    if name == "deepspeed_cpu_adam":
        opt = import_ds_cpu_adam()(params, adamw_mode=True, **_hp_kw())
        return opt, opt.step
    if name == "torch_adafactor":
        opt = torch.optim.Adafactor(params, lr=HP["lr"], weight_decay=HP["weight_decay"])
        return opt, opt.step
    if name in ("torchao_adamw8bit", "torchao_adamw4bit"):
        tao = import_torchao_optim()
        opt = (tao.AdamW8bit if name.endswith("8bit") else tao.AdamW4bit)(params, **_hp_kw())
        return opt, opt.step
    if name == "bnb_adamw8bit":
        opt = import_bnb().optim.AdamW8bit(params, **_hp_kw())
        return opt, opt.step
    if name == "gefen_reference":
        import contextlib
        import io

        require_gefen("reference")
        from gefen import Gefen as RefGefen

        with contextlib.redirect_stdout(io.StringIO()):
            opt = RefGefen(params, fused=False, **_hp_kw())

        def step():
            with contextlib.redirect_stdout(io.StringIO()):
                opt.step()
        return opt, step
    raise ValueError(name)


def clone_named(named):
    out = []
    for n, p in named:
        q = torch.nn.Parameter(p.detach().clone())
        q.grad = p.grad.clone()
        out.append((n, q))
    return out


def bench_state_bytes(b) -> int:
    n = b.cb.numel() * b.cb.element_size()
    for p, st in b.quant:
        n += sum(st[k].numel() * st[k].element_size() for k in ("idx", "scale", "v"))
    for p, m, v in b.vec:
        n += m.numel() * m.element_size() + v.numel() * v.element_size()
    return n


def time_rounds(methods, rounds_of, rounds, log, label=""):
    """Interleaved timing: round r runs every method (that has rounds left) once, in order.
    Returns (wall-clock ms, process CPU ms) samples per method; process CPU time (all threads of
    this process, ``time.process_time``) does not count time spent descheduled, so on a shared
    machine it is the steadier measure of the work a step does."""
    samples = {k: [] for k in methods}
    cpu_samples = {k: [] for k in methods}
    for r in range(rounds):
        for name, fn in methods.items():
            if r >= rounds_of.get(name, rounds):
                continue
            gc.collect()
            c0 = time.process_time()
            samples[name].append(timed(fn))
            cpu_samples[name].append((time.process_time() - c0) * 1e3)
        log(f"{label}round {r + 1}/{rounds}: " + ", ".join(
            f"{k} {v[-1]:.0f}/{cpu_samples[k][-1]:.0f}" for k, v in samples.items() if v and len(v) == r + 1)
            + " ms (wall/CPU)")
    return samples, cpu_samples


def gefenx_child(args):
    """``--gefenx-child``: time gefen-x on block 0 next to torch AdamW (fused) on a copy of the same
    tensors, in this (child) process, whose ``gefen`` is gefen-x; write a JSON result."""
    from _peers import rss_peak_growth, make_gefenx, state_bytes

    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtypes]
    named = subset_named(dtype)
    n = sum(p.numel() for _, p in named)
    gx = make_gefenx(clone_named(named), **_hp_kw())
    tw_named = clone_named(named)
    tw = torch.optim.AdamW([p for _, p in tw_named], fused=True, **_hp_kw())
    t0 = time.perf_counter()
    gx.step()
    first = time.perf_counter() - t0
    tw.step()
    methods = {"gefen_x": gx.step, "torch_adamw_fused@block0": tw.step}
    samples, cpu_samples = time_rounds(methods, {}, args.peer_rounds, lambda m: print(m, flush=True),
                                       "gefen-x child ")
    out = dict(params=n, first_step_s=first, samples_ms=samples, cpu_samples_ms=cpu_samples,
               peak_rss_growth_bytes={k: rss_peak_growth(f) for k, f in methods.items()},
               state_bytes={"gefen_x": state_bytes(gx), "torch_adamw_fused@block0": state_bytes(tw)})
    Path(args.gefenx_child).write_text(json.dumps(out))


def subset_named(dtype, seed: int = 0):
    """Block 0's tensors, exactly as ``Bench`` builds them (the same generator stream)."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for name, shape in gpt2_shapes():
        p = (torch.randn(shape, generator=gen) * 0.02).to(dtype)
        rows = shape[0] if len(shape) == 2 else 1
        row_scale = torch.exp(0.5 * torch.randn(rows, 1, generator=gen))
        g = (torch.randn(shape, generator=gen).view(rows, -1) * 1e-3 * row_scale).view(shape)
        if name.startswith(SUBSET_PREFIX):
            q = torch.nn.Parameter(p)
            q.grad = g.to(dtype)
            out.append((name, q))
        elif out:
            break
    return out


def run_gefenx(key, args, log):
    """gefen-x in a child process (its package ``gefen`` collides with the reference)."""
    import subprocess
    import tempfile

    from _peers import gefenx_available, gefenx_env, gefenx_install_hint, gefenx_path

    path = Path(args.gefenx_path) if args.gefenx_path else gefenx_path()
    if not gefenx_available(path):
        return None, f"not found at {path}; install: {gefenx_install_hint(path)}"
    with tempfile.TemporaryDirectory() as td:
        out = Path(td) / "gx.json"
        cmd = [sys.executable, str(Path(__file__).resolve()), "--gefenx-child", str(out), "--dtypes", key,
               "--peer-rounds", str(args.peer_rounds)] + (["--threads", str(args.threads)] if args.threads else [])
        t0 = time.perf_counter()
        r = subprocess.run(cmd, env=gefenx_env(path), capture_output=True, text=True)
        if r.returncode != 0 or not out.exists():
            return None, f"child failed (rc {r.returncode}): " + (r.stderr.strip().splitlines() or [""])[-1][:300]
        res = json.loads(out.read_text())
    log(f"gefen-x child (block 0, {key}): first step {res['first_step_s']:.1f} s, whole child "
        f"{time.perf_counter() - t0:.0f} s")
    return res, None


def run_dtype(dtype, args, cb, log):
    from _peers import rss_peak_growth, state_bytes

    key = {torch.float32: "fp32", torch.bfloat16: "bf16"}[dtype]
    log(f"\n== {key}: building the GPT-2-small tensor set ==")
    b = Bench(dtype, cb)
    methods, rounds_of, skipped, opts, subset = {}, {}, {}, {}, {}
    sbytes = {}

    methods["gefen_fused"] = lambda: b.gefen(True)
    sbytes["gefen_fused"] = bench_state_bytes(b)
    if args.eager_rounds > 0:
        methods["gefen_eager"] = lambda: b.gefen(False)
        rounds_of["gefen_eager"] = args.eager_rounds
        sbytes["gefen_eager"] = bench_state_bytes(b)
    else:
        skipped["gefen_eager"] = "disabled (--eager-rounds 0)"
    opt_fused = torch.optim.AdamW(b.params, fused=True, **_hp_kw())
    opt_foreach = torch.optim.AdamW(b.params, foreach=True, **_hp_kw())
    methods["torch_adamw_fused"] = opt_fused.step
    methods["torch_adamw_foreach"] = opt_foreach.step
    opts.update(torch_adamw_fused=opt_fused, torch_adamw_foreach=opt_foreach)

    gef = None
    if args.e2e:
        try:
            from gefen_dist import Gefen

            named = list(zip(b.names, b.params))
            gef = Gefen(named, fused=True, **_hp_kw())
            t0 = time.perf_counter()
            gef.step()  # learns periods and the codebook
            log(f"Gefen first step (periods + codebook): {time.perf_counter() - t0:.1f} s")

            def e2e(fused):
                def f():
                    gef.fused = fused
                    gef.step()
                return f

            methods["Gefen_e2e_fused"] = e2e(True)
            opts["Gefen_e2e_fused"] = gef
            if args.eager_rounds > 0:
                methods["Gefen_e2e_eager"] = e2e(False)
                rounds_of["Gefen_e2e_eager"] = args.eager_rounds
                opts["Gefen_e2e_eager"] = gef
        except Exception as e:  # the optimizer is optional here
            skipped["gefen_dist.Gefen end to end"] = f"{type(e).__name__}: {e}"[:200]
    else:
        skipped["gefen_dist.Gefen end to end"] = "disabled (--no-e2e)"

    # ---- peers
    want = [p for p in PEERS if p in args.peer_list]
    for p in PEERS:
        if p not in want:
            skipped[p] = "not selected (--peers)"
    blk = [(n, p) for n, p in zip(b.names, b.params) if n.startswith(SUBSET_PREFIX)]
    blk_n = sum(p.numel() for _, p in blk)
    if any(p in SUBSET_PEERS for p in want):
        tw_named = clone_named(blk)
        tw = torch.optim.AdamW([p for _, p in tw_named], fused=True, **_hp_kw())
        methods["torch_adamw_fused@block0"] = tw.step
        opts["torch_adamw_fused@block0"] = tw
        subset["torch_adamw_fused@block0"] = blk_n
        rounds_of["torch_adamw_fused@block0"] = args.peer_rounds  # the same rounds as the block-0 peers
    first_steps = {}
    for p in want:
        if p == "gefen_x":
            continue
        on_subset = p in SUBSET_PEERS
        try:
            named = clone_named(blk) if on_subset else list(zip(b.names, b.params))
            opt, fn = build_peer(p, named)
            t0 = time.perf_counter()
            fn()  # state allocation, torch.compile, period/codebook learning: not timed
            first_steps[p] = time.perf_counter() - t0
            log(f"{p}: first step {first_steps[p]:.1f} s" + (" (block 0)" if on_subset else ""))
        except Exception as e:
            skipped[p] = f"{type(e).__name__}: {e}"[:300]
            log(f"{p}: skipped: {skipped[p]}")
            continue
        methods[p] = fn
        opts[p] = opt
        rounds_of[p] = args.peer_rounds
        if on_subset:
            subset[p] = blk_n

    eager_like = {"gefen_eager", "Gefen_e2e_eager"}
    # warm-up (not timed): allocations, AdamW state, the codebook table, torch's probes
    for name, fn in methods.items():
        if name not in eager_like and name not in first_steps:
            fn()
    samples, cpu_samples = time_rounds(methods, rounds_of, args.rounds, log)
    # peak RSS growth of one more step of each method (not timed)
    peaks = {name: rss_peak_growth(fn) for name, fn in methods.items() if name not in eager_like}
    for name in methods:
        if name in opts:
            sbytes[name] = state_bytes(opts[name])

    gx = None
    if "gefen_x" in want:
        gx, why = run_gefenx(key, args, log)
        if gx is None:
            skipped["gefen_x"] = why
        else:
            for d, k in ((samples, "samples_ms"), (cpu_samples, "cpu_samples_ms")):
                d["gefen_x"] = gx[k]["gefen_x"]
                d["torch_adamw_fused@block0(gefen_x child)"] = gx[k]["torch_adamw_fused@block0"]
            subset["gefen_x"] = subset["torch_adamw_fused@block0(gefen_x child)"] = gx["params"]
            first_steps["gefen_x"] = gx["first_step_s"]
            peaks["gefen_x"] = gx["peak_rss_growth_bytes"]["gefen_x"]
            peaks["torch_adamw_fused@block0(gefen_x child)"] = gx["peak_rss_growth_bytes"]["torch_adamw_fused@block0"]
            sbytes["gefen_x"] = gx["state_bytes"]["gefen_x"]
            sbytes["torch_adamw_fused@block0(gefen_x child)"] = gx["state_bytes"]["torch_adamw_fused@block0"]

    res = {}
    base = statistics.median(samples["torch_adamw_fused"])
    base_min = min(samples["torch_adamw_fused"])
    for name, s in samples.items():
        if not s:
            continue
        med = statistics.median(s)
        n = subset.get(name, GPT2_PARAMS)
        if name == "gefen_x":
            bname = "torch_adamw_fused@block0(gefen_x child)"
        elif name.startswith("torch_adamw_fused@block0"):
            bname = name
        elif name in subset:
            bname = "torch_adamw_fused@block0"
        else:
            bname = "torch_adamw_fused"
        # the baseline over the same rounds as this method (peers and eager paths run fewer rounds)
        bs = samples[bname][:len(s)]
        cs, cb_ = cpu_samples[name], cpu_samples[bname][:len(s)]
        r = dict(median_ms=med, min_ms=min(s), samples_ms=s, params=n,
                 ns_per_param=med * 1e6 / n,
                 ratio_to_torch_adamw_fused=med / statistics.median(bs),
                 min_ratio_to_torch_adamw_fused=min(s) / min(bs),
                 cpu_median_ms=statistics.median(cs), cpu_samples_ms=cs,
                 cpu_ratio_to_torch_adamw_fused=statistics.median(cs) / statistics.median(cb_),
                 ratio_baseline=f"{bname}, its first {len(bs)} rounds (the rounds this method ran)")
        if name in subset:
            r["note"] = (f"timed on transformer block 0 only ({n:,} params), next to torch AdamW (fused) on a copy "
                         "of the same tensors: the ratio is between the two")
            r["scaled_to_124M_ms"] = med * GPT2_PARAMS / n
            r["scaled_ratio_to_full_torch_adamw_fused"] = r["scaled_to_124M_ms"] / base
        if name in first_steps:
            r["first_step_s"] = first_steps[name]
        if name in sbytes:
            r["state_bytes"] = sbytes[name]
            r["state_bytes_per_param"] = sbytes[name] / n
        if name in peaks:
            r["peak_rss_growth_bytes"] = peaks[name]
            r["peak_rss_growth_bytes_per_param"] = None if peaks[name] is None else peaks[name] / n
        if name in PEER_DESC:
            r["description"] = PEER_DESC[name]
        res[name] = r
    del base_min
    quant_n = sum(p.numel() for p, _ in b.quant)
    out = dict(params=GPT2_PARAMS, quantized_params=quant_n, subset=dict(prefix=SUBSET_PREFIX, params=blk_n),
               methods=res, skipped=skipped)
    del b, opt_fused, opt_foreach, gef, methods, opts
    gc.collect()
    return key, out


def micro(dtype, cb, reps: int = 20):
    """Load-robust compute comparison: one 4096x768 tensor (period 768), one thread, CPU time
    of the calling thread (time.thread_time, so time spent descheduled on a shared machine is
    not counted), minimum over ``reps`` steps. Data mostly in cache: this is the compute cost."""
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        n, P = 4096 * 768, 768
        gen = torch.Generator().manual_seed(1)
        p = torch.nn.Parameter((torch.randn(n, generator=gen) * 0.02).to(dtype))
        p.grad = (torch.randn(n, generator=gen) * 1e-3).to(dtype)
        idx = torch.full((n,), 127, dtype=torch.uint8)
        sc, v = torch.zeros(n // P), torch.zeros(n // P)
        hp = dict(HP, bc1=0.1, bc2=0.05)

        def gef():
            with torch.no_grad():
                cpu.quantized_step_(p, p.grad, idx, sc, v, cb, period=P, scale_block=P, **hp)

        opt = torch.optim.AdamW([p], lr=HP["lr"], weight_decay=HP["weight_decay"], fused=True)
        out = {}
        for name, fn in (("gefen_fused_kernel", gef), ("torch_adamw_fused", opt.step)):
            fn()
            ts = []
            for _ in range(reps):
                t0 = time.thread_time()
                fn()
                ts.append(time.thread_time() - t0)
            out[name] = min(ts) / n * 1e9
        return dict(ns_per_param=out, ratio=out["gefen_fused_kernel"] / out["torch_adamw_fused"],
                    setup="4096x768 tensor, P=B=768, 1 thread, thread CPU time, min of %d" % reps)
    finally:
        torch.set_num_threads(old)


def _label(name):
    return name.replace("@block0", "\n(block 0)") + ("\n(block 0)" if name in SUBSET_PEERS else "")


def plot(results, path: Path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = list(results)
    names = []
    for k in keys:
        for n in results[k]["methods"]:
            if n not in names and not n.startswith("torch_adamw_fused@block0"):
                names.append(n)
    fig, axes = plt.subplots(2, 1, figsize=(11, 7.5), sharex=True)
    w = 0.8 / max(1, len(keys))
    for i, k in enumerate(keys):
        m = results[k]["methods"]
        xs = [j + (i - (len(keys) - 1) / 2) * w for j in range(len(names))]
        rt = [m.get(n, {}).get("cpu_ratio_to_torch_adamw_fused", float("nan")) for n in names]
        bars = axes[0].bar(xs, rt, w, label=k)
        for bar, n in zip(bars, names):
            if n in SUBSET_PEERS:
                bar.set_hatch("//")
        for x, r in zip(xs, rt):
            if r == r:
                axes[0].text(x, r, f"{r:.2g}", ha="center", va="bottom", fontsize=6)
        bp = [m.get(n, {}).get("state_bytes_per_param", float("nan")) for n in names]
        axes[1].bar(xs, bp, w, label=k)
        for x, v in zip(xs, bp):
            if v == v:
                axes[1].text(x, v, f"{v:.2f}", ha="center", va="bottom", fontsize=6)
    axes[0].axhline(1.0, color="k", lw=0.6)
    axes[0].set_yscale("log")
    axes[0].set_ylabel("step CPU time / torch AdamW fused\n(medians, process CPU time; log)")
    axes[0].set_title("Optimizer step on the GPT-2-small tensor set (124M params), CPU "
                      f"{torch.get_num_threads()} threads. Hatched: timed on transformer block 0 "
                      "(7.1M params) against torch AdamW fused on the same block", fontsize=8)
    axes[1].set_ylabel("optimizer state, bytes/param")
    axes[1].axhline(8.0, color="k", lw=0.6, ls=":")
    axes[1].set_xticks(range(len(names)))
    axes[1].set_xticklabels([_label(n) for n in names], rotation=30, ha="right", fontsize=7)
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _mib(x):
    return "n/a" if x is None else f"{x / 2**20:,.0f}"


def table_md(out: dict, command: str) -> str:
    meta = out["meta"]
    md = [f"<!-- generated by `{command.strip()}`; do not edit -->", "",
          f"Machine: {meta['cpu']}, {meta['logical_cpus']} logical CPUs, torch {meta['torch']} "
          f"({meta['capability']}), {meta['threads']} threads; load average {meta['load_average_start'][0]:.1f} "
          f"at the start, {meta['load_average_end'][0]:.1f} at the end (a shared machine: the ratios come from "
          f"interleaved rounds). {meta['rounds']} rounds ({meta['peer_rounds']} for peers), "
          f"{meta['seconds']:.0f} s in all. Ratios are of medians over the same rounds; the CPU-time ratio "
          "(process CPU time, all threads) does not count time spent descheduled, so on a loaded machine it is "
          "the steadier one.", ""]
    for key, res in out["results"].items():
        md.append(f"#### {key} parameters and gradients\n")
        md.append("| method | params timed | wall ms/step (median) | wall ratio to torch AdamW fused | min wall ratio | "
                  "CPU-time ratio | state B/param | peak RSS growth in step (MiB) | first step (s) |")
        md.append("|---|---|---|---|---|---|---|---|---|")
        for name, r in res["methods"].items():
            sub = name in SUBSET_PEERS or name.startswith("torch_adamw_fused@block0")
            cells = [f"`{name}`", ("block 0: " if sub else "") + f"{r['params']:,}", f"{r['median_ms']:.1f}",
                     f"**{r['ratio_to_torch_adamw_fused']:.2f}x**" + (" †" if sub else ""),
                     f"{r['min_ratio_to_torch_adamw_fused']:.2f}x",
                     f"**{r['cpu_ratio_to_torch_adamw_fused']:.2f}x**" if "cpu_ratio_to_torch_adamw_fused" in r else "—",
                     f"{r['state_bytes_per_param']:.3f}" if "state_bytes_per_param" in r else "—",
                     _mib(r.get("peak_rss_growth_bytes")) if "peak_rss_growth_bytes" in r else "—",
                     f"{r['first_step_s']:.1f}" if "first_step_s" in r else "—"]
            md.append("| " + " | ".join(cells) + " |")
        if res["skipped"]:
            md.append("")
            md.append("Not run: " + "; ".join(f"`{k}`: {v}" for k, v in res["skipped"].items()) + ".")
        mc = res.get("single_thread_compute")
        if mc:
            md.append(f"\nSingle-thread compute ({mc['setup']}): fused Gefen kernel / torch AdamW fused = "
                      f"{mc['ratio']:.2f}x.")
        md.append("")
    md.append("† timed on transformer block 0 (7,087,872 parameters) against torch AdamW (fused) on a copy of "
              "the same tensors in the same rounds (gefen-x: in its own subprocess, against its own torch "
              "AdamW); the ratio is between the two. The `torch_adamw_fused@block0` rows are those baselines.")
    return "\n".join(md) + "\n"




def _git_commit() -> str:
    """The commit of the measured code ("+dirty" with uncommitted changes), or "unknown"."""
    import subprocess

    root = Path(__file__).resolve().parent.parent
    try:
        rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True,
                             check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                               capture_output=True, text=True, check=True).stdout.strip()
        return rev + ("+dirty" if dirty else "")
    except Exception:
        return "unknown"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--eager-rounds", type=int, default=1,
                    help="rounds that include the (slow) eager paths")
    ap.add_argument("--peer-rounds", type=int, default=3, help="rounds that include the peers")
    ap.add_argument("--dtypes", default="fp32,bf16")
    ap.add_argument("--peers", nargs="?", const="all", default="all",
                    help=f"comma-separated peers to time, 'all' (default) or 'none'; from {PEERS}")
    ap.add_argument("--gefenx-path", default=None,
                    help="gefen-x target dir (default $GEFENX_PATH or ~/.cache/gefen_dist/peers/gefenx)")
    ap.add_argument("--gefenx-child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--from-json", default=None,
                    help="measure nothing: regenerate the plot and the markdown table from this JSON")
    ap.add_argument("--threads", type=int, default=None,
                    help="torch intra-op threads (default: torch's default, one per core). On a loaded shared "
                         "machine use 1: a multi-threaded step stalls at every barrier on a descheduled thread")
    ap.add_argument("--no-e2e", dest="e2e", action="store_false")
    ap.add_argument("--out", default=str(ROOT / "docs" / "results" / "step_speed.json"))
    ap.add_argument("--png", default=str(ROOT / "docs" / "img" / "step_speed.png"))
    ap.add_argument("--md", default=str(ROOT / "docs" / "results" / "step_speed_table.md"),
                    help="markdown table (also spliced into docs/benchmarks.md between its markers)")
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING)
    if args.threads:
        torch.set_num_threads(args.threads)
        os.environ["OMP_NUM_THREADS"] = str(args.threads)  # for the gefen-x child too
    if args.gefenx_child:
        return gefenx_child(args)
    args.peer_list = (PEERS if args.peers == "all" else [] if args.peers == "none"
                      else [p.strip() for p in args.peers.split(",")])
    bad = [p for p in args.peer_list if p not in PEERS]
    if bad:
        ap.error(f"unknown peers {bad}; choose from {PEERS}")
    command = " ".join(["python benchmarks/step_speed.py"] + sys.argv[1:])
    if args.from_json:
        doc = json.loads(Path(args.from_json).read_text())
        return write_outputs(doc, args, doc["meta"]["command"], print)

    def log(msg):
        print(msg, flush=True)

    t_start = time.perf_counter()
    load_start = os.getloadavg() if hasattr(os, "getloadavg") else None
    if not cpu.available():
        log("native kernel unavailable: gefen_fused falls back to the eager path")
    cb = demo_codebook()
    num = cpu.numerics()
    dts = {"fp32": torch.float32, "bf16": torch.bfloat16}
    results = {}
    for k in args.dtypes.split(","):
        key, res = run_dtype(dts[k.strip()], args, cb, log)
        res["single_thread_compute"] = micro(dts[k.strip()], cb)
        log(f"{key} single-thread compute (CPU time, in cache): "
            + ", ".join(f"{n} {x:.2f} ns/param" for n, x in res["single_thread_compute"]["ns_per_param"].items())
            + f" -> ratio {res['single_thread_compute']['ratio']:.2f}x")
        results[key] = res

    log("\nms per step: median (ratio to torch AdamW fused's median), min (ratio of minima):")
    for key, res in results.items():
        for name, r in res["methods"].items():
            extra = " [block 0]" if "note" in r else ""
            log(f"  {key} {name:<40} {r['median_ms']:10.1f} ms  {r['ratio_to_torch_adamw_fused']:7.2f}x"
                f"   min {r['min_ms']:8.1f} ms {r['min_ratio_to_torch_adamw_fused']:6.2f}x"
                f"  cpu {r.get('cpu_ratio_to_torch_adamw_fused', float('nan')):6.2f}x"
                f"  {r.get('state_bytes_per_param', float('nan')):6.3f} B/param"
                f"  peak {_mib(r.get('peak_rss_growth_bytes'))} MiB  (n={len(r['samples_ms'])}){extra}")
        for name, why in res["skipped"].items():
            log(f"  {key} skipped: {name}: {why}")
        mc = res["single_thread_compute"]
        log(f"  {key} single-thread compute: fused Gefen kernel / torch AdamW fused = {mc['ratio']:.2f}x "
            f"({mc['ns_per_param']['gefen_fused_kernel']:.2f} vs {mc['ns_per_param']['torch_adamw_fused']:.2f} ns/param)")

    from _peers import rss_peak_method_ok

    meta = dict(
        cpu=cpu_name(), logical_cpus=os.cpu_count(), threads=torch.get_num_threads(),
        torch=torch.__version__, capability=torch.backends.cpu.get_cpu_capability(),
        python=platform.python_version(), native_kernel=cpu.available(),
        kernel_numerics=(num.__dict__ if num is not None else None),
        rounds=args.rounds, eager_rounds=args.eager_rounds, peer_rounds=args.peer_rounds, hyperparameters=HP,
        periods="row length, >1024 -> smallest divisor >1024; scale block = period",
        timing=("wall clock and process CPU time (time.process_time: all threads) per step, methods interleaved "
                "per round, median over rounds; a method that runs fewer rounds (eager paths, peers) is compared "
                "with its baseline's median over the same rounds"),
        subset_note=("peers in SUBSET_PEERS are timed on transformer block 0 only (7,087,872 params) next to "
                     "torch AdamW (fused) on a copy of the same tensors, in the same rounds (gefen-x: in a "
                     "child process with its own torch AdamW baseline); their ratio_to_torch_adamw_fused is "
                     "against that block-0 baseline; scaled_to_124M_ms = median_ms * 124439808 / params "
                     "(per-parameter time scaled, an estimate)"),
        peak_memory_method=("peak_rss_growth_bytes: one extra (untimed) step per method after the timed rounds: "
                            "gc + malloc_trim(0), reset VmHWM via /proc/self/clear_refs ('5'), step, then "
                            "VmHWM - VmRSS(before); counts every temporary the step touches (torch allocator, "
                            "native kernels), page granularity; optimizer state already allocated is not counted"
                            if rss_peak_method_ok() else "unavailable (/proc/self/clear_refs not writable)"),
        state_bytes_method=("every tensor in optimizer.state (tensor subclasses such as torchao's quantized "
                            "states flattened to their inner tensors, a tensor seen twice counted once) plus a "
                            "Gefen codebook; gefen_dist: Gefen.state_bytes(); gefen_fused/eager: idx + scale + "
                            "v + the 1-D tensors' fp32 m and v + codebook"),
        load_average_start=load_start,
        load_average_end=os.getloadavg() if hasattr(os, "getloadavg") else None,
        simd_path=cpu.simd_isa(),
        command=command,
        seconds=time.perf_counter() - t_start,
        date=time.strftime("%Y-%m-%d"),
        git_commit=_git_commit(),
    )
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    doc = dict(meta=meta, results=results)
    out.write_text(json.dumps(doc, indent=1))
    write_outputs(doc, args, command, log)
    log(f"wrote {out} in {meta['seconds']:.0f} s")


def write_outputs(doc, args, command, log):
    plot(doc["results"], Path(args.png))
    md = table_md(doc, command)
    if args.png:
        rel = os.path.relpath(args.png, ROOT / "docs")
        md += f"\n![step speed]({rel})\n"
    Path(args.md).write_text(md)
    spliced = splice(ROOT / "docs" / "benchmarks.md", Path(args.md).name, md)
    log(f"\nwrote {args.png} and {args.md}{' (spliced into docs/benchmarks.md)' if spliced else ''}")


if __name__ == "__main__":
    main()
