"""A/B of the fused CPU kernel's nearest-codeword table lookup on the GPT-2-small tensor set.

    python benchmarks/lut_ab.py [THREADS]     # default 1 thread

"byte": the AVX-512 path gathers from a byte copy of the two-candidate table (4 KB for 4096
buckets, the default since it was measured here); "int32": it gathers from the int32 table
(16 KB, the path before). Both give bitwise the same step (tests/test_fused_cpu.py). Whole
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
    b = Bench(torch.float32, demo_codebook())
    adam = torch.optim.AdamW(b.params, lr=1e-3, fused=True)
    adam.step()
    for mode in ("factored", "shared"):
        gef = Gefen(list(zip(b.names, b.params)), lr=HP["lr"], betas=(HP["beta1"], HP["beta2"]), eps=HP["eps"],
                    weight_decay=HP["weight_decay"], fused=True, second_moment=mode)
        gef.step()
        arms = {"byte": 1, "int32": 2}
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
              f"int32/byte {med['int32'] / med['byte']:.3f}x, byte/AdamW {med['byte'] / med['adamw']:.2f}x",
              flush=True)
        del gef


if __name__ == "__main__":
    main()
