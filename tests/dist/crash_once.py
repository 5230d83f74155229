"""A launch whose rank 1 dies of a signal, for tests/test_launch.py's check of the relaunch rule
(tests/dist/_launch.py): ``crash_once.py MARKER SIGNAL`` kills rank 1 with SIGNAL (SEGV, BUS, ...) on
the first launch that finds no MARKER file (it writes it first), and on every launch with ``always`` as
the third argument; the other ranks and later launches meet at a barrier and print OK."""
import os
import signal
import sys

import torch.distributed as dist

from _teardown import leave

marker, sig = sys.argv[1], getattr(signal, "SIG" + sys.argv[2])
always = len(sys.argv) > 3 and sys.argv[3] == "always"
dist.init_process_group("gloo")
rank = dist.get_rank()
first = not os.path.exists(marker)
dist.barrier()  # every rank has looked before rank 1 writes it
if rank == 1 and (first or always):
    open(marker, "w").close()
    sys.stdout.flush()
    os.kill(os.getpid(), sig)
dist.barrier()
print(f"OK rank {rank}", flush=True)
leave()
