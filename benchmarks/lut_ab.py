"""A/B of the fused CPU kernel's nearest-codeword table lookup on the GPT-2-small tensor set.

    python benchmarks/lut_ab.py [THREADS]     # default 1 thread

"two_level" (the default when the table allows it): no gather; the 4096-bucket two-candidate
table is split into 256 groups of 16 (a base index and a 16-bit mask of increments per group, three
256-byte tables looked up with byte permutes in registers, then a 16-bit popcount); "byte": gathers
from a byte copy of the table (4 KB); "int32": gathers from the int32 table (16 KB, the first
version). All give bitwise the same step (tests/test_fused_cpu.py). Whole
``Gefen.step()`` calls, shared and factored, interleaved with torch's fused AdamW; medians of 7
process-CPU times (less sensitive than wall time to other jobs on a shared machine).
"""
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parent.parent)]
import gefen_dist.kernels.cpu as C  # noqa: E402
from gefen_dist import Gefen  # noqa: E402
from step_speed import HP, Bench, demo_codebook  # noqa: E402


def main() -> None:
    torch.set_num_threads(int(sys.argv[1]) if len(sys.argv) > 1 else 1)
    if not C.simd_compiled():
        sys.exit("the AVX-512 VBMI path is not compiled for this CPU: nothing to compare")
    if not C.two_level_table(demo_codebook()):
        print("note: the two-level table is not used here (no AVX-512 BITALG?): two_level == byte")
    b = Bench(torch.float32, demo_codebook())
    adam = torch.optim.AdamW(b.params, lr=1e-3, fused=True)
    adam.step()
    for mode in ("factored", "shared"):
        gef = Gefen(list(zip(b.names, b.params)), lr=HP["lr"], betas=(HP["beta1"], HP["beta2"]), eps=HP["eps"],
                    weight_decay=HP["weight_decay"], fused=True, second_moment=mode)
        gef.step()
        arms = {"two_level": 1, "byte": 3, "int32": 2}
        times = {k: [] for k in [*arms, "adamw"]}
        try:
            for _ in range(7):
                for k, s in arms.items():
                    C._USE_SIMD = s
                    t = time.process_time()
                    gef.step()
                    times[k].append(time.process_time() - t)
                t = time.process_time()
                adam.step()
                times["adamw"].append(time.process_time() - t)
        finally:
            C._USE_SIMD = 1
        med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
        print(f"{mode}, threads {torch.get_num_threads()}: step CPU ms {({k: round(v, 1) for k, v in med.items()})}; "
              f"int32/two_level {med['int32'] / med['two_level']:.3f}x, byte/two_level {med['byte'] / med['two_level']:.3f}x, "
              f"two_level/AdamW {med['two_level'] / med['adamw']:.2f}x",
              flush=True)
        del gef


if __name__ == "__main__":
    main()
