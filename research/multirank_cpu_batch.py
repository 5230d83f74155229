"""The native multi-tensor CPU step with several ranks (DDP, FSDP2 on gloo), against the per-tensor path.

    torchrun --nproc_per_node 2 research/multirank_cpu_batch.py [--rounds 5] [--steps 30] [--layers 8] [--width 256]

Before 2026-12-05 only a single process stepped its CPU tensors through the native kernel's
multi-tensor entry points (``kernels/cpu_multi.py`` via ``engine/cuda_batch.py``); several ranks took
the per-tensor path (~0.2 ms of Python per quantized tensor). Each round builds, for each wrapper (DDP
of the model; FSDP2 ``fully_shard`` of each layer and the model) and each path (``_NATIVE_CPU``
False: the per-tensor path; True: the batch), a fresh model and ``Gefen``, and times ``opt.step()``
(median over ``--steps`` steps after 5, rank 0's clock, ranks in step through the collectives); the
paths alternate within a round, so host noise falls on both. Prints per round the two medians and
their ratio, then the median ratio over the rounds.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from gefen_dist import Gefen  # noqa: E402
from gefen_dist.engine import cuda_batch  # noqa: E402


def step_ms(wrapper: str, native: bool, args) -> float:
    cuda_batch._NATIVE_CPU = native
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(args.width, args.width) for _ in range(args.layers)])
    if wrapper == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP

        model = DDP(model)
    else:
        from torch.distributed.fsdp import fully_shard

        for layer in model:
            fully_shard(layer)
        fully_shard(model)
    opt = Gefen(model.parameters(), lr=1e-3, weight_decay=0.1)
    x = torch.randn(32, args.width, generator=torch.Generator().manual_seed(dist.get_rank()))
    times = []
    for i in range(args.steps + 5):
        opt.zero_grad()
        model(x).pow(2).mean().backward()
        t0 = time.perf_counter()
        opt.step()
        if i >= 5:
            times.append(time.perf_counter() - t0)
    batch = getattr(opt, "_cuda_batch", None)
    assert (batch is not None and batch.native_cpu) == native, (wrapper, native, batch)
    return statistics.median(times) * 1e3


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--width", type=int, default=256)
    args = ap.parse_args(argv)
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    rank, ws = dist.get_rank(), dist.get_world_size()
    for wrapper in ("ddp", "fsdp2"):
        ratios = []
        for r in range(args.rounds):
            per = step_ms(wrapper, False, args)
            bat = step_ms(wrapper, True, args)
            ratios.append(bat / per)
            if rank == 0:
                print(f"{wrapper} ws={ws} round {r}: per-tensor {per:.2f} ms, batch {bat:.2f} ms, ratio {bat / per:.3f}",
                      flush=True)
        if rank == 0:
            print(f"{wrapper} ws={ws} ({args.layers} x Linear({args.width}, {args.width})): batch / per-tensor median "
                  f"{statistics.median(ratios):.3f} over {args.rounds} rounds (min {min(ratios):.3f}, max "
                  f"{max(ratios):.3f})", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
