"""Step time of Gefen on a DeepSpeed-style flat buffer (``gefen_dist.engine.flat.FlatSegments``), CPU.

    python benchmarks/flat_step.py [--threads 1] [--rounds 5] [--second-moment factored|shared|nibbles]
                                   [--device cpu|cuda] [--no-eager] [--out docs/results/flat_step.json]

DeepSpeed ZeRO hands the optimizer one flat fp32 buffer of many tensors' pieces; Gefen steps it
through ``FlatSegments.step`` (the path of ``gefen_dist.integrations.deepspeed.Gefen``). Here the
buffer holds every GPT-2-small tensor whole (124,439,808 parameters; one process, so no piece is
cut: the whole-row / whole-block path that carries almost all elements under ZeRO), with
synthetic gradients. Timed side by side, interleaved in rounds (medians; the machine is shared):

* ``flat_fused``: whole blocks / rows and the column sums through the native CPU kernels (the
  Triton kernels with ``--device cuda``), every segment's in one call each (``engine/flat_batch.py``:
  what the integration runs);
* ``flat_per_segment``: the same kernels called segment by segment (the integration's step before
  2026-12-06; the same bits);
* ``flat_eager``: the same step with the eager torch path (what the integration ran for the
  factored default before: only the shared mode's whole blocks were fused);
* ``torch_adamw_fused``: ``torch.optim.AdamW(fused=True)`` over the same tensors, the baseline.

Prints ms per step and ratios; writes JSON (default docs/results/flat_step.json). With ``--device
cuda`` every step is bracketed by ``torch.cuda.synchronize()`` (the times are wall times).
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
sys.path.insert(0, str(ROOT / "benchmarks"))

from _gpt2 import GPT2_PARAMS, gpt2_shapes  # noqa: E402
from gefen_dist.engine.comm import LocalComm  # noqa: E402
from gefen_dist.core.step import hyperparameters  # noqa: E402
from gefen_dist.kernels import dispatch  # noqa: E402
from gefen_dist.engine import flat_step as _flat_step  # noqa: E402
from gefen_dist.engine.flat import FlatSegments, Segment, counts_to_codebook  # noqa: E402
from gefen_dist.engine.learning import learn_codebook  # noqa: E402

HP = dict(lr=6e-4, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1)


def build(second_moment: str, seed: int = 0, device: str = "cpu"):
    gen = torch.Generator().manual_seed(seed)
    segs, off = [], 0
    for name, shape in gpt2_shapes():
        n = 1
        for s in shape:
            n *= s
        segs.append(Segment(name, name, tuple(shape), 0, off, n))
        off += n
    flat = torch.randn(off, generator=gen) * 0.02
    grad = torch.empty(off)
    for s in segs:  # row-structured gradients (log-normal row scales), as the step benchmarks use
        rows = s.shape[0] if len(s.shape) == 2 else 1
        scale = torch.exp(0.5 * torch.randn(rows, 1, generator=gen))
        grad[s.flat_offset:s.flat_offset + s.numel] = (
            torch.randn(rows, s.numel // rows, generator=gen) * 1e-3 * scale).reshape(-1)
    flat, grad = flat.to(device), grad.to(device)
    fs = FlatSegments(segs, LocalComm(), 4096, "benchmark buffer")
    nib = second_moment == "nibbles"  # D20: 16 codewords, draws keyed by each tensor's place
    if nib:
        fs.second_moment, fs.tensor_index = "nibbles", {s.key: i for i, s in enumerate(segs)}
    st = fs.new_state(flat, torch.zeros(16 if nib else 256, device=device), factored=second_moment != "shared")
    counts = fs.learn(st, grad, codebook_needed=True, second_moment=second_moment)
    cb = learn_codebook(counts, True, 16) if nib else counts_to_codebook(counts)
    st["codebook"] = cb.codebook.float().to(device)
    return fs, flat, grad, st


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--second-moment", default="factored", choices=("factored", "shared", "nibbles"))
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    ap.add_argument("--no-eager", action="store_true", help="leave out the eager step (tens of seconds a round on CPU)")
    ap.add_argument("--out", default=str(ROOT / "docs" / "results" / "flat_step.json"))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    dev = args.device
    if dev == "cpu":
        from gefen_dist.kernels import cpu as _cpu

        if not _cpu.available():
            print("flat_step.py: the native CPU kernel is not available (no C compiler?)", file=sys.stderr)
            return 2
    elif not torch.cuda.is_available() or dispatch.select(torch.zeros(1, device=dev)).name != "triton":
        print("flat_step.py: --device cuda needs a GPU and the Triton kernels", file=sys.stderr)
        return 2
    fs, flat, grad, st = build(args.second_moment, device=dev)
    fs3, flat3, grad3, st3 = build(args.second_moment, device=dev)
    fs2, flat2, grad2, st2 = build(args.second_moment, device=dev) if not args.no_eager else (None,) * 4
    params = [torch.nn.Parameter(flat[s.flat_offset:s.flat_offset + s.numel].clone().view(s.shape))
              for s in fs.segments]
    for p, s in zip(params, fs.segments):
        p.grad = grad[s.flat_offset:s.flat_offset + s.numel].clone().view(s.shape)
    adam = torch.optim.AdamW(params, lr=HP["lr"], betas=(HP["beta1"], HP["beta2"]), eps=HP["eps"],
                             weight_decay=HP["weight_decay"], fused=True)
    group = dict(lr=HP["lr"], betas=(HP["beta1"], HP["beta2"]), eps=HP["eps"], weight_decay=HP["weight_decay"])

    def fused():
        st["step"] += 1
        fs.step(flat, grad, st, impl=dispatch.select(flat), second_moment=args.second_moment,
                hp=hyperparameters(group, int(st["step"]), bounded=False), step=int(st["step"]))

    def eager():
        st2["step"] += 1
        fs2.step(flat2, grad2, st2, second_moment=args.second_moment,
                 hp=hyperparameters(group, int(st2["step"]), bounded=False), step=int(st2["step"]))

    kernels_of = _flat_step.batch_kernels

    def per_segment():
        _flat_step.batch_kernels = lambda *a: None
        try:
            st3["step"] += 1
            fs3.step(flat3, grad3, st3, impl=dispatch.select(flat3), second_moment=args.second_moment,
                     hp=hyperparameters(group, int(st3["step"]), bounded=False), step=int(st3["step"]))
        finally:
            _flat_step.batch_kernels = kernels_of

    methods = {"flat_fused": fused, "flat_per_segment": per_segment}
    if not args.no_eager:
        methods["flat_eager"] = eager
    methods["torch_adamw_fused"] = adam.step
    sync = torch.cuda.synchronize if dev == "cuda" else (lambda: None)
    for fn in methods.values():  # warm-up (first calls build tables, allocate AdamW state)
        fn()
    times = {k: [] for k in methods}
    cpu = {k: [] for k in methods}
    for _ in range(args.rounds):
        for k, fn in methods.items():
            sync()
            t0, c0 = time.perf_counter(), time.process_time()
            fn()
            sync()
            times[k].append(time.perf_counter() - t0)
            cpu[k].append(time.process_time() - c0)
    res = {k: dict(median_ms=statistics.median(v) * 1e3, min_ms=min(v) * 1e3,
                   cpu_median_ms=statistics.median(cpu[k]) * 1e3) for k, v in times.items()}
    base = res["torch_adamw_fused"]
    out = dict(command="python benchmarks/flat_step.py " + " ".join(sys.argv[1:]), params=GPT2_PARAMS,
               second_moment=args.second_moment, threads=args.threads, rounds=args.rounds, device=dev,
               cpu=platform.processor() or platform.machine(), torch=torch.__version__,
               gpu=torch.cuda.get_device_name() if dev == "cuda" else None,
               timestamp=time.strftime("%Y-%m-%dT%H:%M:%S"), ms=res,
               ratios={k: dict(wall=res[k]["median_ms"] / base["median_ms"],
                               cpu_time=res[k]["cpu_median_ms"] / base["cpu_median_ms"])
                       for k in res if k != "torch_adamw_fused"})
    for k, r in res.items():
        print(f"  {k:18s} {r['median_ms']:9.1f} ms (cpu {r['cpu_median_ms']:9.1f} ms)")
    for k, r in out["ratios"].items():
        print(f"  ratio {k} / torch_adamw_fused: wall {r['wall']:.2f}, cpu time {r['cpu_time']:.2f}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
