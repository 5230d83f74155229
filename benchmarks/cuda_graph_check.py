"""``Gefen(capturable=True)`` on a CUDA GPU: the step captured in a CUDA graph replays bitwise the
eager step, synchronises nothing, and what the graph saves in time (issue 27).

    python benchmarks/cuda_graph_check.py [--size small|xl] [--steps 8] [--iters 50] [--out graph.json]
                                          [--second-moment factored|shared|nibbles]

On GPT-2's tensors (``benchmarks/_gpt2.py``; small by default), float32 and bfloat16:

1. **Agreement.** Two copies of the parameters with the same gradients each step (static gradient
   tensors, refilled in place): copy A steps eagerly with ``capturable=True``, copy B by replaying a
   CUDA graph captured from its third step (two eager warm-up steps learn the state first, as torch's
   CUDA-graph recipe asks). At step 5 one gradient element of a quantized tensor is NaN: both skip
   it on the device. After every step, parameters and every state tensor of B must equal A's
   bitwise; a mismatch exits non-zero.
2. **Host synchronisations** of one eager capturable step (torch's sync debug mode), expected 0, and
   of the default (``nonfinite="raise"``), expected 1.
3. **Time** per step (median of ``--iters`` CUDA-event timings): torch's fused AdamW, the default,
   the capturable step eagerly, and its graph replay; each as a ratio to fused AdamW in the same run.

Needs a CUDA GPU (exits 2 without one). No GPU was at hand when this was written: it is one of the
prepared checks of ``benchmarks/gpu_check.sh``.
"""
from __future__ import annotations

import argparse
import json
import sys
import traceback
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
for _p in (ROOT, ROOT / "benchmarks"):
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))

from _gpt2 import gpt2_shapes  # noqa: E402
from gpu_step import count_host_syncs, cuda_time  # noqa: E402

HP = dict(lr=6e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)


def _params(size: str, dtype, dev, seed: int = 0):
    gen = torch.Generator(device=dev).manual_seed(seed)
    ps = []
    for _, shape in gpt2_shapes(size):
        p = torch.nn.Parameter((torch.randn(shape, generator=gen, device=dev) * 0.02).to(dtype))
        p.grad = torch.zeros_like(p)  # static gradient tensors, refilled in place each step
        ps.append(p)
    return ps


def _fill(params, step: int, poison: bool = False) -> None:
    gen = torch.Generator(device=params[0].device).manual_seed(1000 + step)
    for p in params:
        p.grad.copy_(torch.randn(p.shape, generator=gen, device=p.device) * 1e-3)
    if poison:  # one element of the first 2-D (quantized) gradient
        next(p for p in params if p.dim() == 2).grad.view(-1)[7] = float("nan")


def _state_tensors(opt, params):
    return [(i, k, v) for i, p in enumerate(params) for k, v in sorted(opt.state[p].items())
            if isinstance(v, torch.Tensor)]


def agreement(size: str, dtype, dev, steps: int, second_moment: str = "factored") -> dict:
    from gefen_dist import Gefen

    pa, pb = _params(size, dtype, dev), _params(size, dtype, dev)
    lr = torch.tensor(HP["lr"], device=dev)  # a device lr: read at every replay
    oa = Gefen(pa, **dict(HP, lr=lr), capturable=True, nonfinite="skip", second_moment=second_moment)
    ob = Gefen(pb, **dict(HP, lr=lr.clone()), capturable=True, nonfinite="skip", second_moment=second_moment)
    graph, mismatches = None, []
    for step in range(steps):
        poison = step == 4
        _fill(pa, step, poison)
        _fill(pb, step, poison)
        oa.step()
        if step < 2:  # warm-up (learns periods and the codebook), on a side stream as torch's recipe
            s = torch.cuda.Stream()
            s.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(s):
                ob.step()
            torch.cuda.current_stream().wait_stream(s)
        elif graph is None:
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                ob.step()  # captured, not run
            graph.replay()
        else:
            graph.replay()
        torch.cuda.synchronize()
        for (i, k, va), (_, _, vb) in zip(_state_tensors(oa, pa), _state_tensors(ob, pb)):
            if not torch.equal(va, vb):
                mismatches.append(f"step {step} param {i} state {k}")
        mismatches += [f"step {step} param {i}" for i, (x, y) in enumerate(zip(pa, pb)) if not torch.equal(x, y)]
    return dict(steps=steps, mismatches=mismatches[:20], n_mismatches=len(mismatches),
                skipped_a=float(oa.device_skipped_steps), skipped_b=float(ob.device_skipped_steps))


def timings(size: str, dtype, dev, iters: int, second_moment: str = "factored") -> dict:
    from gefen_dist import Gefen

    sm = dict(second_moment=second_moment)
    out = {}
    for name in ("torch_adamw_fused", "gefen_default", "gefen_capturable", "gefen_capturable_graph"):
        ps = _params(size, dtype, dev, seed=1)
        _fill(ps, 0)
        if name == "torch_adamw_fused":
            opt = torch.optim.AdamW(ps, fused=True, **HP)
        elif name == "gefen_default":
            opt = Gefen(ps, **HP, **sm)
        else:
            opt = Gefen(ps, **dict(HP, lr=torch.tensor(HP["lr"], device=dev)), capturable=True, nonfinite="skip", **sm)
        for _ in range(2):
            opt.step()
        fn = opt.step
        if name == "gefen_capturable_graph":
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                opt.step()
            fn = graph.replay
        r = cuda_time(fn, 3, iters)
        if name != "gefen_capturable_graph":
            r["host_syncs_per_step"] = count_host_syncs(opt.step)
        out[name] = r
        print(f"  {name:24s} {r['median_ms']:8.3f} ms  syncs/step {r.get('host_syncs_per_step', '-')}")
        del opt, ps
        torch.cuda.empty_cache()
    base = out["torch_adamw_fused"]["median_ms"]
    for name, r in out.items():
        r["ratio_to_fused_adamw"] = r["median_ms"] / base
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", default="small", choices=("small", "xl"))
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--out", default="")
    ap.add_argument("--second-moment", default="factored", choices=("factored", "shared", "nibbles"))
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("cuda_graph_check: needs a CUDA GPU")
        return 2
    dev = torch.device("cuda")
    res = dict(device=torch.cuda.get_device_name(dev), torch=torch.__version__, size=args.size,
               second_moment=args.second_moment)
    ok = True
    for key, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        print(f"== GPT-2 {args.size}, {key} ==")
        res[key] = {}
        try:  # a failure is reported with its traceback and the run goes on (one GPU session, many answers)
            a = agreement(args.size, dtype, dev, args.steps, args.second_moment)
            print(f"  graph replay vs eager capturable: {a['n_mismatches']} mismatching tensors over {a['steps']} "
                  f"steps; skipped on the device: {a['skipped_a']} / {a['skipped_b']}")
            ok &= a["n_mismatches"] == 0 and a["skipped_a"] == a["skipped_b"] == 1.0
            res[key]["agreement"] = a
        except Exception:
            ok = False
            res[key]["agreement_error"] = traceback.format_exc()
            print(res[key]["agreement_error"])
        try:
            res[key]["timings"] = timings(args.size, dtype, dev, args.iters, args.second_moment)
        except Exception:
            ok = False
            res[key]["timings_error"] = traceback.format_exc()
            print(res[key]["timings_error"])
    if args.out:
        Path(args.out).write_text(json.dumps(res, indent=1))
    print("cuda_graph_check:", "ok" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
