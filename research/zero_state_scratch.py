"""The owner's state-only factored update of ZeroGefen (kernels/cpu.py::factored_state_) on one
41M-element range, 1 thread: peak RSS and ms per call. An ad hoc before/after of the chunked
scratch parameter (kernels/state_only.py), run against a worktree of an earlier commit:

    git worktree add /tmp/before 6e91b37   # the scratch spanned the owner's whole range
    for i in 1 2; do PYTHONPATH=/tmp/before python research/zero_state_scratch.py before; \\
        python research/zero_state_scratch.py after; done
"""
import resource
import sys
import time

import torch

torch.set_num_threads(1)
from gefen_dist.kernels import cpu  # noqa: E402

rows, S = 40000, 1024  # a 41M-element owner range (164 MB of fp32 gradient)
g = torch.randn(rows * S) * 1e-3
idx = torch.zeros(rows * S, dtype=torch.uint8)
scale, vr = torch.zeros(rows), torch.zeros(rows)
cb = torch.linspace(-1, 1, 256)
kw = dict(slab=S, beta1=0.9, beta2=0.999, eps=1e-8, bc1=0.1, bc2=0.001, scale_block=S)
cpu.factored_state_(g, idx, scale, vr, cb, **kw)
t = time.perf_counter()
for _ in range(3):
    cpu.factored_state_(g, idx, scale, vr, cb, **kw)
dt = (time.perf_counter() - t) / 3
print(sys.argv[1] if len(sys.argv) > 1 else "", "peak RSS MiB",
      resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024,
      "ms/call", round(dt * 1e3, 1))
