"""Optimizer step time on the GPT-2-small tensor set (124,439,808 parameters), one CUDA GPU.

    python benchmarks/gpu_step.py [--iters 20] [--warmup 5] [--dtypes fp32,bf16]
                                  [--no-eager] [--no-sweep] [--out docs/results/gpu_step.json]

Needs a CUDA GPU and triton (exits with a message otherwise).

Tensors: wte 50257x768, wpe 1024x768, 12 blocks of c_attn (2304,768), attn c_proj (768,768),
c_fc (3072,768), mlp c_proj (768,3072), their biases, and the LayerNorm vectors. Matrices are
quantized with period = row length, capped as the library caps it (a period > 1024 becomes its
smallest divisor > 1024, so 3072 -> 1536), scale block = period; 1-D tensors take the exact
AdamW update (``adamw_step_``, eager, as ``Gefen`` does). Gradients are random
(``randn * 1e-3 * row_scale``, log-normal per row), the same tensors for every method.

Timed per step with CUDA events (``--warmup`` untimed steps, then the median of ``--iters``):

* ``gefen_triton``: ``triton_step.quantized_step_`` over the matrices + ``adamw_step_`` over the
  1-D tensors (the whole step); ``gefen_triton_matrices``: the matrices only;
* ``gefen_triton_matrices_P1``: the matrices with period 1 (v per element) and scale block 256;
* ``gefen_eager_matrices``: ``quantized_step_eager_`` on the GPU over the matrices (reference);
* ``torch_adamw_fused`` / ``torch_adamw_fused_matrices``: ``torch.optim.AdamW(fused=True)``
  over all tensors / the matrices only; ``torch_adamw_foreach``: ``foreach=True``.

Also: a correctness check of the kernel against the eager path on two tensors (idx mismatch
fraction, parameter difference), the effective memory bandwidth of the Triton step, and
(unless ``--no-sweep``) the time per shape for every chunk size (the kernel's
``BLOCK_SIZE``), to tune :func:`gefen_dist.kernels.triton_step._config`.

Prints ratios to torch's fused AdamW and the GPU name; writes ``docs/results/gpu_step.json``.
"""
from __future__ import annotations

import argparse
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
    def __init__(self, dtype: torch.dtype, cb: torch.Tensor, dev: torch.device, seed: int = 0):
        self.dtype, self.cb, self.dev = dtype, cb, dev
        gen = torch.Generator(device=dev).manual_seed(seed)
        self.names, self.params = [], []
        for name, shape in gpt2_shapes():
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
    return dict(ms=res, ratios=ratios)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--dtypes", default="fp32,bf16")
    ap.add_argument("--no-eager", dest="eager", action="store_false")
    ap.add_argument("--no-sweep", dest="sweep", action="store_false")
    ap.add_argument("--out", default=str(ROOT / "docs" / "results" / "gpu_step.json"))
    args = ap.parse_args()

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

    results = {}
    for key in args.dtypes.split(","):
        dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[key.strip()]
        results[key] = run_dtype(key, dtype, cb, dev, triton_step, args)
        torch.cuda.empty_cache()
    info["results"] = results

    if args.sweep:
        print("\nchunk-size sweep (fp32, ms per tensor step):")
        info["block_size_sweep"] = sweep_block_sizes(triton_step, cb, dev, args.warmup, args.iters)
        for r in info["block_size_sweep"]:
            ms = " ".join(f"{k}:{v:.3f}" for k, v in r["ms"].items())
            print(f"  {str(r['shape']):14s} P={r['period']:5d} default {r['default_block_size']:5d} "
                  f"best {r['best_block_size']:5d} | {ms}")

    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(info, indent=1) + "\n")
    print(f"\nwrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
