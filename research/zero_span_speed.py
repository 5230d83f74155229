"""ZeroGefen's step with a narrow_rows="span" tensor (D16), 2 ranks: ms per step and this rank's state
bytes (the figure in docs/zero.md). An ad hoc timing, run against earlier commits, interleaved:

    git worktree add /tmp/whole 716e771    # every rank kept and stepped span tensors whole
    git worktree add /tmp/before 6e91b37   # partitioned, the other ranks' rows applied with torch operations
    for i in 1 2 3; do for root in /tmp/whole /tmp/before .; do TAG=$root OMP_NUM_THREADS=1 PYTHONPATH=$root \
        python -m torch.distributed.run --standalone --nproc_per_node 2 research/zero_span_speed.py; done; done

A (500000, 4) span tensor beside a 512 x 512 factored one, 1 thread per rank, 3 untimed steps, then the
median of 5 rounds of 5 steps (wall time between barriers), printed by rank 0.
"""
import os, time, torch, torch.distributed as dist
torch.set_num_threads(1)
dist.init_process_group("gloo")
from gefen_dist import ZeroGefen
torch.manual_seed(0)
p = torch.nn.Parameter(torch.randn(500_000, 4) * 0.1)
q = torch.nn.Parameter(torch.randn(512, 512) * 0.02)
opt = ZeroGefen([{"params": [p], "narrow_rows": "span"}, {"params": [q]}], lr=1e-3)
g = torch.Generator().manual_seed(1)
grads = [(torch.randn(500_000, 4, generator=g), torch.randn(512, 512, generator=g)) for _ in range(3)]
for i in range(3):
    p.grad, q.grad = grads[i % 3]; opt.step()
ts = []
for r in range(5):
    dist.barrier(); t0 = time.perf_counter()
    for i in range(5):
        p.grad, q.grad = grads[i % 3]; opt.step()
    dist.barrier(); ts.append((time.perf_counter() - t0) / 5 * 1e3)
if dist.get_rank() == 0:
    print(os.environ.get("TAG"), "ms/step median", sorted(ts)[2], "state bytes rank0", opt.state_bytes())
dist.destroy_process_group()
