"""Optimizer step time on GPT-2 tensor sets, one CUDA GPU.

    python benchmarks/gpu_step.py [--iters 20] [--warmup 5] [--dtypes fp32,bf16] [--sizes small,xl]
                                  [--no-optimizers] [--no-span] [--no-eager] [--no-sweep]
                                  [--out docs/results/gpu_step.json]
    python benchmarks/gpu_step.py --plot docs/img/gpu_step.png [--before OLD.json]   # no GPU needed
    bash benchmarks/gpu_check.sh      # the CUDA tests, then this script (one prepared GPU run)

Needs a CUDA GPU and triton (exits with a message otherwise).

**Optimizer classes** (first, the numbers a user sees): ``Gefen(params).step()`` with its
defaults (factored second moment with row blocks, the multi-tensor CUDA plan of
``gefen_dist/engine/cuda_batch.py``), the default with ``nonfinite="ignore"`` (no non-finite check:
the batch's host synchronisation for the check's verdict is not taken), ``second_moment="shared"``,
``second_moment="nibbles"`` (D20, ``gefen_nibbles``, its multi-tensor kernel),
the default with the plan disabled
(``gefen_default_per_tensor``: one Triton launch per tensor), the eager path (``fused=False``),
and ``torch.optim.AdamW(fused=True)``, over every tensor of GPT-2 small (124,439,808
parameters) and XL (1,557,611,200), the same parameters and random gradients for each. Per
optimizer: median ms per step (CUDA events), the first Gefen step (periods + codebook) in
seconds, host synchronisations per step (torch's sync debug mode) and, from torch.profiler,
kernel launches and summed kernel time of one step.

**Kernel level** (GPT-2 small): matrices are quantized with period = row length, capped as the
library caps it (a period > 1024 becomes its smallest divisor > 1024, so 3072 -> 1536), scale
block = period; 1-D tensors take the exact AdamW update (``adamw_step_``). Gradients are random
(``randn * 1e-3 * row_scale``, log-normal per row). Timed with CUDA events (``--warmup`` untimed
steps, then the median of ``--iters``):

* ``gefen_triton``: ``triton_step.quantized_step_`` over the matrices + ``adamw_step_`` over the
  1-D tensors; ``gefen_triton_matrices``: the matrices only;
* ``gefen_triton_matrices_P1``: the matrices with period 1 (v per element) and scale block 256;
* ``gefen_eager_matrices``: ``quantized_step_eager_`` on the GPU over the matrices (reference);
* ``torch_adamw_fused`` / ``torch_adamw_fused_matrices``: ``torch.optim.AdamW(fused=True)``
  over all tensors / the matrices only; ``torch_adamw_foreach``: ``foreach=True``.

**Span** (``--no-span`` skips it): a ``(4,000,000, 16)`` embedding kept per block of rows
(``narrow_rows="span"``, D16): ``Gefen(...).step()`` with the Triton span kernels, with the span
phases as torch operations, and torch's fused AdamW on the same tensor; then a ``(1,000,000, 64)``
one per row in float32 (the default) and in one-byte row codes (``narrow_rows="rows8"``, D19).

Also: a correctness check of the kernel against the eager path on three tensors (idx mismatch
fraction, parameter difference; any index mismatch makes the script exit 1 after writing the
JSON), an in-process copy-bandwidth probe (1 GiB ``copy_``) and the effective memory bandwidth of
the Triton step and of fused AdamW as a percentage of it (modelled bytes / time), and
(unless ``--no-sweep``) the time per shape for every chunk size (the kernel's ``BLOCK_SIZE``),
to tune :func:`gefen_dist.kernels.triton_step._config`.

Prints ratios to torch's fused AdamW and the GPU name; writes the JSON after every section (a
time-out keeps what was measured).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from _gpt2 import GPT2_PARAMS, gpt2_shapes, capped_period  # noqa: E402,F401
from gefen_dist.core.periods import divisors  # noqa: E402
from gefen_dist.core.step import adamw_step_, bias_corrections, quantized_step_eager_  # noqa: E402

HP = dict(lr=6e-4, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1)






def p1_block(row: int) -> int:
    return max(d for d in divisors(row) if d <= 256)


def demo_codebook() -> torch.Tensor:
    """The optimal codebook of a bell-shaped histogram (what training produces, roughly)."""
    import numpy as np

    from gefen_dist.core.codebook import NUM_BINS, solve_codebook

    c = (np.arange(NUM_BINS) + 0.5) / NUM_BINS * 2 - 1
    counts = np.round(1e6 * np.exp(-0.5 * (c / 0.15) ** 2)).astype(np.int64) + 1
    return solve_codebook(counts).codebook.float()


def cuda_time(fn, warmup: int, iters: int) -> dict:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        a = torch.cuda.Event(enable_timing=True)
        b = torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return dict(median_ms=statistics.median(times), min_ms=min(times), max_ms=max(times))


class Bench:
    def __init__(self, dtype: torch.dtype, cb: torch.Tensor, dev: torch.device, seed: int = 0,
                 size: str = "small"):
        self.dtype, self.cb, self.dev = dtype, cb, dev
        gen = torch.Generator(device=dev).manual_seed(seed)
        self.names, self.params = [], []
        for name, shape in gpt2_shapes(size):
            p = torch.nn.Parameter((torch.randn(shape, generator=gen, device=dev) * 0.02).to(dtype))
            rows = shape[0] if len(shape) == 2 else 1
            row_scale = torch.exp(0.5 * torch.randn(rows, 1, generator=gen, device=dev))
            g = (torch.randn(shape, generator=gen, device=dev).view(rows, -1) * 1e-3 * row_scale)
            p.grad = g.view(shape).to(dtype)
            self.names.append(name)
            self.params.append(p)
        self.mats = [p for p in self.params if p.dim() >= 2]
        self.vecs = [(p, torch.zeros(p.shape, device=dev), torch.zeros(p.shape, device=dev))
                     for p in self.params if p.dim() < 2]
        self.states = {}
        self.step_no = 0

    def state(self, variant: str):
        if variant not in self.states:
            sts = []
            for p in self.mats:
                row = p.shape[-1]
                P = capped_period(row) if variant == "row" else 1
                B = P if variant == "row" else p1_block(row)
                n = p.numel()
                sts.append(dict(idx=torch.full((n,), 127, dtype=torch.uint8, device=self.dev),
                                scale=torch.zeros(n // B, device=self.dev),
                                v=torch.zeros(n // P, device=self.dev), period=P, block=B))
            self.states[variant] = sts
        return self.states[variant]

    def _hp(self):
        self.step_no += 1
        bc1, bc2 = bias_corrections(self.step_no, HP["beta1"], HP["beta2"])
        return dict(HP, bc1=bc1, bc2=bc2)

    def gefen(self, fn, variant: str = "row", vectors: bool = True) -> None:
        hp = self._hp()
        with torch.no_grad():
            for p, st in zip(self.mats, self.state(variant)):
                fn(p.view(-1), p.grad.view(-1), st["idx"], st["scale"], st["v"], self.cb,
                   period=st["period"], scale_block=st["block"], **hp)
            if vectors:
                for p, m, v in self.vecs:
                    adamw_step_(p, p.grad, m, v, **hp)


AGREEMENT_CASES = (((2304, 768), torch.float32, "row"),
                   ((768, 3072), torch.bfloat16, "row"),
                   ((768, 3072), torch.float32, "P1"))


def check_agreement(triton_step, cb, dev) -> list:
    """Kernel vs eager on the GPU, five steps on a few shapes and dtypes."""
    out = []
    for (rows, row), dtype, variant in AGREEMENT_CASES:
        gen = torch.Generator(device=dev).manual_seed(1)
        n = rows * row
        P = capped_period(row) if variant == "row" else 1
        B = P if variant == "row" else p1_block(row)
        p0 = (torch.randn(n, generator=gen, device=dev) * 0.02).to(dtype)
        st0 = [torch.full((n,), 127, dtype=torch.uint8, device=dev), torch.zeros(n // B, device=dev),
               torch.zeros(n // P, device=dev)]
        a = [p0.clone()] + [t.clone() for t in st0]
        b = [p0.clone()] + [t.clone() for t in st0]
        for s in range(1, 6):
            g = (torch.randn(n, generator=gen, device=dev) * 1e-3).to(dtype)
            bc1, bc2 = bias_corrections(s, HP["beta1"], HP["beta2"])
            kw = dict(HP, bc1=bc1, bc2=bc2, period=P, scale_block=B)
            quantized_step_eager_(a[0], g, a[1], a[2], a[3], cb, **kw)
            triton_step.quantized_step_(b[0], g, b[1], b[2], b[3], cb, **kw)
        pa, pb = a[0].float(), b[0].float()
        rel = ((pa - pb).abs() / pa.abs().clamp_min(1e-30)).max().item()
        out.append(dict(shape=[rows, row], dtype=str(dtype).replace("torch.", ""), period=P,
                        scale_block=B, steps=5,
                        idx_mismatch_frac=(a[1] != b[1]).float().mean().item(),
                        scale_max_rel=((a[2] - b[2]).abs() / a[2].abs().clamp_min(1e-30)).max().item(),
                        v_max_rel=((a[3] - b[3]).abs() / a[3].abs().clamp_min(1e-30)).max().item(),
                        param_max_rel=rel,
                        param_max_diff_over_max_abs=((pa - pb).abs().max() / pa.abs().max()).item(),
                        param_neq_frac=(pa != pb).float().mean().item()))
    return out


def sweep_shape(triton_step, cb, dev, shape, warmup, iters) -> dict:
    rows, row = shape
    P = capped_period(row)
    n = rows * row
    p = torch.randn(n, device=dev) * 0.02
    g = torch.randn(n, device=dev) * 1e-3
    idx = torch.full((n,), 127, dtype=torch.uint8, device=dev)
    scale = torch.zeros(n // P, device=dev)
    v = torch.zeros(n // P, device=dev)
    bc1, bc2 = bias_corrections(10, HP["beta1"], HP["beta2"])
    kw = dict(HP, bc1=bc1, bc2=bc2, period=P, scale_block=P)
    default = triton_step._config(P, n // P)
    res = dict(shape=list(shape), period=P, default_block_size=default[1], ms={})
    bs = 64
    while bs <= 4096:
        def f(bs=bs):
            triton_step._launch(p, g, idx, scale, v, cb, block_size=bs, **kw)
        res["ms"][str(bs)] = cuda_time(f, warmup, iters)["median_ms"]
        bs *= 2
    res["best_block_size"] = int(min(res["ms"], key=res["ms"].get))
    res["gbps_default"] = n * 14 / (res["ms"][str(default[1])] * 1e-3) / 1e9
    return res


def sweep_block_sizes(triton_step, cb, dev, warmup, iters) -> list:
    """ms per step of each matrix shape (fp32, period = row) for every chunk size."""
    shapes = []
    for _, shape in gpt2_shapes():
        if len(shape) == 2 and shape not in shapes:
            shapes.append(shape)
    return [sweep_shape(triton_step, cb, dev, s, warmup, iters) for s in shapes]


def run_dtype(key: str, dtype: torch.dtype, cb, dev, triton_step, args) -> dict:
    b = Bench(dtype, cb, dev)
    adam_all = torch.optim.AdamW(b.params, lr=HP["lr"], betas=(HP["beta1"], HP["beta2"]),
                                 eps=HP["eps"], weight_decay=HP["weight_decay"], fused=True)
    adam_mat = torch.optim.AdamW(b.mats, lr=HP["lr"], betas=(HP["beta1"], HP["beta2"]),
                                 eps=HP["eps"], weight_decay=HP["weight_decay"], fused=True)
    adam_fe = torch.optim.AdamW(b.params, lr=HP["lr"], betas=(HP["beta1"], HP["beta2"]),
                                eps=HP["eps"], weight_decay=HP["weight_decay"], foreach=True)
    tq = triton_step.quantized_step_
    methods = {
        "gefen_triton": lambda: b.gefen(tq),
        "gefen_triton_matrices": lambda: b.gefen(tq, vectors=False),
        "gefen_triton_matrices_P1": lambda: b.gefen(tq, variant="P1", vectors=False),
        "torch_adamw_fused": adam_all.step,
        "torch_adamw_fused_matrices": adam_mat.step,
        "torch_adamw_foreach": adam_fe.step,
    }
    if args.eager:
        methods["gefen_eager_matrices"] = lambda: b.gefen(quantized_step_eager_, vectors=False)
    res = {}
    print(f"\n== {key} ==")
    for name, fn in methods.items():
        res[name] = cuda_time(fn, args.warmup, args.iters)
        print(f"  {name:28s} {res[name]['median_ms']:8.3f} ms  (min {res[name]['min_ms']:.3f})")
    base = res["torch_adamw_fused"]["median_ms"]
    base_m = res["torch_adamw_fused_matrices"]["median_ms"]
    ratios = {
        "gefen_triton / torch_adamw_fused": res["gefen_triton"]["median_ms"] / base,
        "gefen_triton_matrices / torch_adamw_fused_matrices":
            res["gefen_triton_matrices"]["median_ms"] / base_m,
        "gefen_triton_matrices_P1 / torch_adamw_fused_matrices":
            res["gefen_triton_matrices_P1"]["median_ms"] / base_m,
    }
    if "gefen_eager_matrices" in res:
        ratios["gefen_eager_matrices / gefen_triton_matrices"] = (
            res["gefen_eager_matrices"]["median_ms"] / res["gefen_triton_matrices"]["median_ms"])
    n_mat = sum(p.numel() for p in b.mats)
    eb = 2 if dtype == torch.bfloat16 else 4
    # DRAM bytes of the Triton step if sweep 2 re-reads g and idx from L2: g, idx, p read;
    # p, idx written (+ scale and v, negligible)
    res["triton_matrices_effective_gbps"] = (
        n_mat * (3 * eb + 2) / (res["gefen_triton_matrices"]["median_ms"] * 1e-3) / 1e9)
    for k, r in ratios.items():
        print(f"  ratio {k:55s} {r:6.3f}")
    print(f"  Triton matrices effective bandwidth: {res['triton_matrices_effective_gbps']:.0f} GB/s")
    if getattr(args, "probe_gbps", None):
        res["triton_matrices_pct_of_copy_probe"] = 100 * res["triton_matrices_effective_gbps"] / args.probe_gbps
        # AdamW moves p, g, m, v read and p, m, v written: 7 element-sized streams
        res["adamw_matrices_effective_gbps"] = n_mat * 7 * eb / (base_m * 1e-3) / 1e9
        res["adamw_matrices_pct_of_copy_probe"] = 100 * res["adamw_matrices_effective_gbps"] / args.probe_gbps
        print(f"  % of the copy probe ({args.probe_gbps:.0f} GB/s): Triton matrices "
              f"{res['triton_matrices_pct_of_copy_probe']:.0f}%, fused AdamW matrices "
              f"{res['adamw_matrices_pct_of_copy_probe']:.0f}% (modelled bytes / time)")
    return dict(ms=res, ratios=ratios)


def copy_probe_gbps(dev, warmup: int, iters: int, nbytes: int = 1 << 30) -> dict:
    """In-process copy bandwidth: ``dst.copy_(src)`` of ``nbytes`` (read + write counted), CUDA
    events, median of ``iters`` after ``warmup``; the ceiling the kernels' GB/s are compared with."""
    src = torch.empty(nbytes // 4, dtype=torch.float32, device=dev).uniform_()
    dst = torch.empty_like(src)
    r = cuda_time(lambda: dst.copy_(src), warmup, iters)
    gbps = 2 * nbytes / (r["median_ms"] * 1e-3) / 1e9
    return dict(bytes=nbytes, median_ms=r["median_ms"], gbps=gbps)


def count_host_syncs(fn) -> int:
    """Host synchronisations in one call of ``fn`` (torch's sync debug mode, as warnings)."""
    import warnings

    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return sum("synchroniz" in str(x.message) for x in w)


OPTIMIZERS = (
    # name, Gefen keyword arguments (None: torch's fused AdamW), timed iterations (None: --iters);
    # "_per_tensor": the multi-tensor plan (gefen_dist/engine/cuda_batch.py) disabled, one launch per tensor
    ("torch_adamw_fused", None, None),
    ("gefen_default", {}, None),
    # no non-finite check: the batch's one host synchronisation (the check's verdict) is not taken
    ("gefen_default_nonfinite_ignore", dict(nonfinite="ignore"), None),
    # capturable=True: the verdict, the step counts and the scalars on the device (0 syncs expected)
    ("gefen_default_capturable", dict(capturable=True, nonfinite="skip"), None),
    ("gefen_shared", dict(second_moment="shared"), None),
    # second_moment="nibbles" (D20): its multi-tensor kernel
    ("gefen_nibbles", dict(second_moment="nibbles"), None),
    ("gefen_default_per_tensor", {}, None),
    # ZeroGefen (ZeRO-1) in one process: owners' state-only steps per tensor, the appliers in one launch
    ("zerogefen_one_rank", dict(_zero=True), None),
    ("gefen_default_eager", dict(fused=False), 5),
)


class _no_plan:
    """Within the block, Gefen steps tensor by tensor (CudaBatch.plan returns None)."""

    def __enter__(self):
        from gefen_dist.engine import cuda_batch as cuda_path

        self._mod, self._orig = cuda_path, cuda_path.CudaBatch.__dict__["plan"]
        cuda_path.CudaBatch.plan = classmethod(lambda cls, opt, entries: None)

    def __exit__(self, *exc):
        self._mod.CudaBatch.plan = self._orig


def profile_step(fn) -> dict:
    """Kernel launches and summed kernel time of one call (torch.profiler), to tell launch- and
    host-bound steps from memory-bound ones."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    t0 = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    kernels, kernel_us = 0, 0.0
    for e in prof.events():
        if str(getattr(e, "device_type", "")).endswith("CUDA"):
            kernels += 1
            kernel_us += float(getattr(e, "device_time", None) or getattr(e, "cuda_time", 0.0) or 0.0)
    return dict(kernels=kernels, kernel_ms=kernel_us / 1e3, profiled_wall_ms=wall * 1e3)


def run_optimizers(key: str, dtype: torch.dtype, dev, args, size: str = "small") -> dict:
    """The real optimizer classes over all GPT-2-small tensors: ``Gefen(...).step()`` (defaults:
    factored second moment with row blocks, Triton kernels, batched exact tensors) and torch's
    fused AdamW, the same parameters and gradients; the first Gefen step (periods + codebook)
    timed on its own; host synchronisations per step counted."""
    from gefen_dist import Gefen, ZeroGefen

    b = Bench(dtype, None, dev, seed=1, size=size)
    res = {}
    print(f"\n== optimizer classes, GPT-2 {size} ({sum(p.numel() for p in b.params):,} parameters), {key} ==")
    for name, kw, iters in OPTIMIZERS:
        params = [torch.nn.Parameter(p.detach().clone()) for p in b.params]
        for p, q in zip(params, b.params):
            p.grad = q.grad.clone()
        hp = dict(lr=HP["lr"], betas=(HP["beta1"], HP["beta2"]), eps=HP["eps"],
                  weight_decay=HP["weight_decay"])
        opt = (torch.optim.AdamW(params, fused=True, **hp) if kw is None
               else ZeroGefen(params, **hp) if kw.get("_zero") else Gefen(params, **hp, **kw))
        with (_no_plan() if name.endswith("_per_tensor") else contextlib.nullcontext()):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            opt.step()
            torch.cuda.synchronize()
            first = time.perf_counter() - t0
            r = cuda_time(opt.step, min(args.warmup, 2), iters or args.iters)
            r["first_step_s"] = first
            r["host_syncs_per_step"] = count_host_syncs(opt.step)
            try:
                r.update(profile_step(opt.step))
            except Exception as e:  # the profiler is a diagnostic; never lose the timings for it
                r["profile_error"] = repr(e)
        if kw is not None:
            r["state_bytes"] = sum(x["state_bytes"] for x in opt.report())
        res[name] = r
        print(f"  {name:22s} {r['median_ms']:8.3f} ms  (min {r['min_ms']:.3f}); first step {first:.3f} s; "
              f"host syncs/step {r['host_syncs_per_step']}; kernels {r.get('kernels')}, "
              f"kernel time {r.get('kernel_ms', float('nan')):.3f} ms")
        del opt, params
        torch.cuda.empty_cache()
    return dict(ms=res, ratios=_ratios(res))


def _ratios(res: dict) -> dict:
    """Each timing's median over torch's fused AdamW's (printed)."""
    base = res["torch_adamw_fused"]["median_ms"]
    ratios = {f"{n} / torch_adamw_fused": res[n]["median_ms"] / base for n in res if n != "torch_adamw_fused"}
    for k, r in ratios.items():
        print(f"  ratio {k:40s} {r:6.3f}")
    return ratios


def run_span(dev, args, rows: int = 4_000_000, width: int = 16) -> dict:
    """A recommender's embedding kept per block of rows (D16, ``narrow_rows="span"``): ``(rows,
    width)`` fp32, a fifth of the rows in the gradient (the kernels read every element anyway):
    ``Gefen(...).step()`` on the
    Triton span kernels, the same with the span phases as torch operations (the CUDA path before
    2026-12-05), and torch's fused AdamW on the same tensor; ms per step and ratios."""
    from gefen_dist import Gefen
    from gefen_dist.core import span as ref
    from gefen_dist.kernels import dispatch

    gen = torch.Generator(device=dev).manual_seed(3)
    w0 = torch.randn(rows, width, device=dev, generator=gen) * 0.02
    grad = torch.randn(rows, width, device=dev, generator=gen) * 1e-3
    grad *= (torch.rand(rows, 1, device=dev, generator=gen) < 0.2)  # a sparse embedding's gradient
    hp = dict(lr=HP["lr"], betas=(HP["beta1"], HP["beta2"]), eps=HP["eps"], weight_decay=HP["weight_decay"])
    print(f"\n== span tensor ({rows:,} x {width}, fp32) ==")

    def make(name, p):
        if name == "torch_adamw_fused":
            return torch.optim.AdamW([p], fused=True, **hp)
        opt = Gefen([{"params": [p], "narrow_rows": "span"}], **hp)
        if name == "gefen_span_torch_ops":
            impl = dispatch._triton()
            opt._impl = lambda t, q=None, group=None, _i=dispatch.StepImpl(
                impl.name, impl.quantized_step_, impl.quantized_step_factored_, impl.column_sumsq,
                span_statistics=ref.span_statistics, span_update_=ref.span_update_): _i
        return opt

    res = _time_steps(args, w0, grad, ("torch_adamw_fused", "gefen_span_triton", "gefen_span_torch_ops"), make)
    ok = {k: v for k, v in res.items() if "median_ms" in v}
    return dict(shape=[rows, width], ms=res, ratios=_ratios(ok) if "torch_adamw_fused" in ok else {})


def _time_steps(args, w0, grad, names, make) -> dict:
    """ms per step of ``make(name, p)`` for each name, each on a fresh parameter ``w0`` with gradient
    ``grad`` (the first step, which learns, untimed); a failure is recorded and the others go on."""
    res = {}
    for name in names:
        p = torch.nn.Parameter(w0.clone())
        p.grad = grad.clone()
        opt = make(name, p)
        try:
            opt.step()
            res[name] = cuda_time(opt.step, min(args.warmup, 2), args.iters)
            print(f"  {name:22s} {res[name]['median_ms']:8.3f} ms  (min {res[name]['min_ms']:.3f})")
        except Exception as e:  # recorded, the rest of the run goes on
            res[name] = dict(error=repr(e)[:300])
            print(f"  {name:22s} failed: {res[name]['error']}")
        del opt, p
        torch.cuda.empty_cache()
    return res


def run_rows8(dev, args, rows: int = 1_000_000, width: int = 64) -> dict:
    """A ``(rows, width)`` fp32 embedding with rows of 64 elements: per row in float32 (the default,
    ``narrow_rows="auto"``, stepped by the multi-tensor batch), in one-byte row codes
    (``narrow_rows="rows8"``, D19: the Triton span kernels with blocks of one row and the codes' torch
    operations) and torch's fused AdamW; ms per step and ratios (not yet run on a GPU)."""
    from gefen_dist import Gefen

    gen = torch.Generator(device=dev).manual_seed(4)
    w0 = torch.randn(rows, width, device=dev, generator=gen) * 0.02
    grad = torch.randn(rows, width, device=dev, generator=gen) * 1e-3
    hp = dict(lr=HP["lr"], betas=(HP["beta1"], HP["beta2"]), eps=HP["eps"], weight_decay=HP["weight_decay"])
    print(f"\n== rows8 tensor ({rows:,} x {width}, fp32) ==")
    res = _time_steps(args, w0, grad, ("torch_adamw_fused", "gefen_auto", "gefen_rows8"),
                      lambda name, p: torch.optim.AdamW([p], fused=True, **hp) if name == "torch_adamw_fused" else
                      Gefen([{"params": [p], "narrow_rows": "rows8" if name == "gefen_rows8" else "auto"}], **hp))
    ok = {k: v for k, v in res.items() if "median_ms" in v}
    return dict(shape=[rows, width], ms=res, ratios=_ratios(ok) if "torch_adamw_fused" in ok else {})


TUNE_CONFIGS = [(r, bs, w) for bs in (128, 256, 512, 1024) for r in (1, 2, 4, 8, 16)
                for w in (4, 8) if 512 <= r * bs <= 4096]


def tune(dev, args) -> dict:
    """ms per ``Gefen(...).step()`` (the multi-tensor plan) for each (ROWS, BLOCK_SIZE, num_warps)
    forced on every launch, against _config's choice (``None``), on GPT-2 ``--tune-size`` fp32."""
    from gefen_dist import Gefen
    from gefen_dist.kernels import triton_step

    b = Bench(torch.float32, None, dev, seed=1, size=args.tune_size)
    out = {}
    for cfg in [None] + TUNE_CONFIGS:
        params = [torch.nn.Parameter(p.detach().clone()) for p in b.params]
        for p, q in zip(params, b.params):
            p.grad = q.grad.clone()
        try:
            opt = Gefen(params, lr=HP["lr"], betas=(HP["beta1"], HP["beta2"]), eps=HP["eps"],
                        weight_decay=HP["weight_decay"])
            opt.step()  # builds the plan with _config's choice
            if cfg is not None:  # the same plan with every launch forced to cfg
                for gi in opt._cuda_batch.groups:
                    if gi["items"]:
                        gi["multi"] = triton_step.MultiStep(gi["items"], dev, config=cfg)
            r = cuda_time(opt.step, 2, max(5, args.iters // 2))
        except Exception as e:  # a config that does not compile or run: record and go on
            r = dict(error=repr(e)[:200])
        out[str(cfg)] = r
        print(f"  tune {str(cfg):16s} {r.get('median_ms', float('nan')):8.3f} ms {r.get('error', '')}", flush=True)
        del params
        torch.cuda.empty_cache()
    return out


def plot(json_path: str, png: str, before: str = "") -> None:
    """Bar chart of the optimizer-class step times in ``json_path`` (and, from ``before``, the
    Gefen default of an earlier run, e.g. the per-tensor path), ms per step, log scale."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    info = json.loads(Path(json_path).read_text())
    old = json.loads(Path(before).read_text()).get("optimizers", {}) if before else {}
    cases = list(info["optimizers"])
    series = [("torch_adamw_fused", "torch AdamW (fused)", None), ("gefen_default", "Gefen default", None),
              ("gefen_shared", "Gefen shared v", None)]
    if old:
        series.append(("gefen_default", "Gefen default, one launch per tensor (earlier run)", old))
    width = 0.8 / len(series)
    fig, ax = plt.subplots(figsize=(8, 4.2))
    for k, (key, label, src) in enumerate(series):
        src = src or info["optimizers"]
        ys = [src.get(c, {}).get("ms", {}).get(key, {}).get("median_ms", float("nan")) for c in cases]
        xs = [i + (k - (len(series) - 1) / 2) * width for i in range(len(cases))]
        bars = ax.bar(xs, ys, width, label=label)
        ax.bar_label(bars, fmt="%.1f", fontsize=7)
    ax.set_xticks(range(len(cases)))
    ax.set_xticklabels([c.replace("_", " ") for c in cases])
    ax.set_yscale("log")
    ax.set_ylabel("ms per optimizer step (median)")
    ax.set_title(f"Optimizer step on {info['gpu']}, GPT-2 tensor sets (torch {info['torch']}, "
                 f"triton {info['triton']})", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    print(f"wrote {png}")


def table(json_path: str, before: str = "") -> str:
    """Markdown of the optimizer-class results in ``json_path`` (ratios to torch's fused AdamW in
    the same run; ``before``: an earlier run's JSON, whose Gefen default is listed beside)."""
    info = json.loads((ROOT / json_path).read_text())
    old = json.loads(Path(before).read_text()).get("optimizers", {}) if before else {}
    cmd = "python benchmarks/gpu_step.py --plot docs/img/gpu_step.png --md docs/results/gpu_step_table.md"
    if before:
        cmd += f" --before {before}"
    lines = [f"<!-- generated by `{cmd}` from `{json_path}`; do not edit -->", "",
             f"{info['gpu']} (sm_{info['capability'][0]}{info['capability'][1]}), torch {info['torch']}, CUDA "
             f"{info['cuda']}, triton {info['triton']}; {info['timestamp']}; median of {info['iters']} steps "
             f"after {info['warmup']} (`{info['command']}`). Ratio: time / torch fused AdamW's in the same run "
             "(below 1 is faster). Syncs: host synchronisations per step; kernels: launches in one step "
             "(torch.profiler).", "",
             "| tensors | optimizer | ms / step | ratio | first step (s) | syncs | kernels | state B/param |",
             "|---|---|---:|---:|---:|---:|---:|---:|"]
    for case, res in info.get("optimizers", {}).items():
        ms = res["ms"]
        base = ms["torch_adamw_fused"]["median_ms"]
        nparam = 1_557_611_200 if case.startswith("xl") else GPT2_PARAMS
        rows = [(k, ms[k]) for k in ms]
        if case in old:
            r = dict(old[case]["ms"]["gefen_default"])
            r["note"] = " (earlier run: one launch per tensor; ratio to that run's AdamW)"
            r["base"] = old[case]["ms"]["torch_adamw_fused"]["median_ms"]
            rows.append(("gefen_default", r))
        for name, r in rows:
            sb = f"{r['state_bytes'] / nparam:.3f}" if "state_bytes" in r else ("8" if "adamw" in name else "")
            lines.append(f"| {case.replace('_', ' ')} | {name}{r.get('note', '')} | {r['median_ms']:.2f} | "
                         f"{r['median_ms'] / r.get('base', base):.2f} | {r['first_step_s']:.2f} | {r['host_syncs_per_step']} | "
                         f"{r.get('kernels', '')} | {sb} |")
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--dtypes", default="fp32,bf16")
    ap.add_argument("--no-eager", dest="eager", action="store_false")
    ap.add_argument("--no-sweep", dest="sweep", action="store_false")
    ap.add_argument("--sizes", default="small,xl",
                    help="GPT-2 sizes for the optimizer-class timings (small, medium, large, xl)")
    ap.add_argument("--tune", action="store_true", help="also time the plan's step for every forced "
                    "(ROWS, BLOCK_SIZE, num_warps) in TUNE_CONFIGS (one compile each: minutes)")
    ap.add_argument("--tune-size", default="xl")
    ap.add_argument("--no-span", dest="span", action="store_false",
                    help="skip the span-tensor timing (D16: Triton span kernels vs torch operations vs fused AdamW)")
    ap.add_argument("--no-optimizers", dest="optimizers", action="store_false",
                    help="skip the optimizer-class timings (Gefen(...).step() vs torch AdamW)")
    ap.add_argument("--out", default=str(ROOT / "docs" / "results" / "gpu_step.json"))
    ap.add_argument("--plot", metavar="PNG", default="",
                    help="no GPU needed: draw the optimizer-class times of --out's JSON into PNG and exit")
    ap.add_argument("--before", default="", help="with --plot: an earlier run's JSON whose Gefen default is "
                    "drawn beside (e.g. docs/results/gpu_step_per_tensor.json)")
    ap.add_argument("--md", default="", help="with --plot: also write the markdown table there and into "
                    "docs/benchmarks.md (between its gpu_step_table.md markers)")
    args = ap.parse_args()
    if args.plot:
        plot(args.out, args.plot, args.before)
        if args.md:
            from _docs import splice

            shown = Path(args.out).resolve()
            md = table(str(shown.relative_to(ROOT)) if shown.is_relative_to(ROOT) else args.out, args.before)
            Path(args.md).write_text(md)
            print(f"wrote {args.md}" + (" and docs/benchmarks.md" if splice(
                ROOT / "docs" / "benchmarks.md", "gpu_step_table.md", md) else ""))
        return 0

    if not torch.cuda.is_available():
        print("gpu_step.py: CUDA is not available (torch %s); this benchmark needs an NVIDIA GPU. "
              "Nothing was measured." % torch.__version__, file=sys.stderr)
        return 2
    from gefen_dist.kernels import triton_step

    if not triton_step.available("cuda"):
        print("gpu_step.py: triton is not importable; install it (pip install triton) to run the "
              "Triton kernel. Nothing was measured.", file=sys.stderr)
        return 2
    import triton

    dev = torch.device("cuda")
    props = torch.cuda.get_device_properties(dev)
    info = dict(
        command="python benchmarks/gpu_step.py " + " ".join(sys.argv[1:]),
        gpu=torch.cuda.get_device_name(dev),
        capability=list(torch.cuda.get_device_capability(dev)),
        gpu_memory_gib=round(props.total_memory / 2 ** 30, 1),
        torch=torch.__version__, cuda=torch.version.cuda, triton=triton.__version__,
        python=platform.python_version(), iters=args.iters, warmup=args.warmup,
        params=GPT2_PARAMS, hyperparameters=HP,
        timestamp=time.strftime("%Y-%m-%dT%H:%M:%S"),
    )
    print(f"GPU: {info['gpu']} (sm_{info['capability'][0]}{info['capability'][1]}), torch "
          f"{info['torch']}, CUDA {info['cuda']}, triton {info['triton']}")

    cb = demo_codebook().to(dev)
    t0 = time.perf_counter()
    tab = triton_step._device_table(cb, dev)
    info["codebook_table"] = dict(fast=tab.fast, buckets=tab.nb,
                                  build_s=round(time.perf_counter() - t0, 3))

    print("checking the kernel against the eager path ...")
    info["agreement"] = check_agreement(triton_step, cb, dev)
    for r in info["agreement"]:
        print(f"  {r['shape']} {r['dtype']} P={r['period']}: idx mismatch {r['idx_mismatch_frac']:.2e}, "
              f"param max |diff|/max|p| {r['param_max_diff_over_max_abs']:.2e}, "
              f"differing {r['param_neq_frac']:.2e}")

    info["copy_probe"] = copy_probe_gbps(dev, args.warmup, args.iters)
    torch.cuda.empty_cache()  # the probe's 2 GiB
    args.probe_gbps = info["copy_probe"]["gbps"]
    print(f"copy probe: {args.probe_gbps:.0f} GB/s (1 GiB dst.copy_(src), read + write)")
    mismatched = [r for r in info["agreement"] if r["idx_mismatch_frac"] > 0]

    out = Path(args.out)

    def save() -> None:  # after every section: a later failure or time-out keeps what was measured
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(info, indent=1) + "\n")

    if args.optimizers:
        info["optimizers"] = {}
        for size in args.sizes.split(","):
            for key in args.dtypes.split(","):
                dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[key.strip()]
                info["optimizers"][f"{size}_{key}"] = run_optimizers(key, dtype, dev, args, size)
                save()

    if args.span:
        info["span"] = run_span(dev, args)
        save()
        info["rows8"] = run_rows8(dev, args)
        save()

    if args.tune:
        print(f"\nlaunch-configuration sweep of the plan (GPT-2 {args.tune_size}, fp32):")
        info["tune"] = dict(size=args.tune_size, ms=tune(dev, args))
        save()

    info["results"] = {}
    for key in args.dtypes.split(","):
        dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[key.strip()]
        info["results"][key] = run_dtype(key, dtype, cb, dev, triton_step, args)
        torch.cuda.empty_cache()
        save()

    if args.sweep:
        print("\nchunk-size sweep (fp32, ms per tensor step):")
        info["block_size_sweep"] = sweep_block_sizes(triton_step, cb, dev, args.warmup, args.iters)
        for r in info["block_size_sweep"]:
            ms = " ".join(f"{k}:{v:.3f}" for k, v in r["ms"].items())
            print(f"  {str(r['shape']):14s} P={r['period']:5d} default {r['default_block_size']:5d} "
                  f"best {r['best_block_size']:5d} | {ms}")

    save()
    print(f"\nwrote {out}")
    if mismatched:
        print(f"FAIL: the Triton kernel's indices differ from the eager path's on {len(mismatched)} of "
              f"{len(info['agreement'])} checked tensors: {[r['shape'] for r in mismatched]}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
