"""A/B of the fused CPU kernel's nearest-codeword table lookup on the GPT-2-small tensor set.

    python research/lut_ab.py [THREADS]     # default 1 thread

"two_level" (the default when the table allows it): no gather; the 4096-bucket two-candidate
table is split into 256 groups of 16 (a base index and a 16-bit mask of increments per group, three
256-byte tables looked up with byte permutes in registers, then a 16-bit popcount); "byte": gathers
from a byte copy of the table (4 KB); "int32": gathers from the int32 table (16 KB, the first
version). The arms are the ``simd=`` argument of ``gefen_dist.kernels.cpu.quantized_step_`` /
``quantized_step_factored_`` (1, 3, 2); all give bitwise the same step (tests/test_fused_cpu.py).
Each arm runs the kernel over every quantized tensor of the set (shared: period = scale block;
factored: one row per dim-0 row, column statistics precomputed), interleaved with torch's fused
AdamW on all the tensors; medians of 7 process-CPU times (less sensitive than wall time to other
jobs on a shared machine).
"""
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "benchmarks"), str(ROOT)]
import gefen_dist.kernels.cpu as C  # noqa: E402
from gefen_dist.core.step import column_sumsq  # noqa: E402
from step_speed import Bench, demo_codebook  # noqa: E402


def main() -> None:
    torch.set_num_threads(int(sys.argv[1]) if len(sys.argv) > 1 else 1)
    if C.simd_isa() != "avx512vbmi":
        sys.exit("the AVX-512 VBMI path is not compiled for this CPU: nothing to compare")
    if not C.two_level_table(demo_codebook()):
        print("note: the two-level table is not used here (no AVX-512 BITALG?): two_level == byte")
    b = Bench(torch.float32, demo_codebook())
    adam = torch.optim.AdamW(b.params, lr=1e-3, fused=True)
    adam.step()
    cms = {id(p): (column_sumsq(p.grad.view(-1), p[0].numel()) / p.shape[0]).float()
           for p, _ in b.quant}
    fstate = {id(p): (torch.zeros(p.shape[0]), torch.zeros(p[0].numel())) for p, _ in b.quant}

    def kernels(mode: str, simd: int) -> None:
        hp = b._hp()
        for p, st in b.quant:
            if mode == "shared":
                C.quantized_step_(p.view(-1), p.grad.view(-1), st["idx"], st["scale"], st["v"], b.cb,
                                  period=st["period"], scale_block=st["period"], simd=simd, **hp)
            else:
                v_row, v_col = fstate[id(p)]
                C.quantized_step_factored_(p.view(-1), p.grad.view(-1), st["idx"], st["scale"], v_row, v_col, b.cb,
                                           cms[id(p)], scale_block=st["period"], simd=simd, **hp)

    arms = {"two_level": 1, "byte": 3, "int32": 2}
    with torch.no_grad():
        for mode in ("factored", "shared"):
            kernels(mode, 1)
            times = {k: [] for k in [*arms, "adamw"]}
            for _ in range(7):
                for k, s in arms.items():
                    t = time.process_time()
                    kernels(mode, s)
                    times[k].append(time.process_time() - t)
                t = time.process_time()
                adam.step()
                times["adamw"].append(time.process_time() - t)
            med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
            print(f"{mode}, threads {torch.get_num_threads()}: kernel CPU ms {({k: round(v, 1) for k, v in med.items()})}; "
                  f"int32/two_level {med['int32'] / med['two_level']:.3f}x, byte/two_level {med['byte'] / med['two_level']:.3f}x, "
                  f"two_level/AdamW {med['two_level'] / med['adamw']:.2f}x", flush=True)


if __name__ == "__main__":
    main()
