"""How a multi-rank test worker leaves (imported by the scripts in tests/dist).

gloo aborts a rank ("terminate called without an active exception", SIGABRT after the checks have
passed) when a peer tears down a group it still uses, or when C++ destructors at interpreter exit
race gloo's threads. So: free what holds gloo work objects (DDP reducers, FSDP state), meet on
every given group and then on WORLD, destroy, flush, and leave without running static destructors.
"""
import gc
import os
import sys

import torch.distributed as dist


def leave(*groups) -> None:
    gc.collect()
    for g in groups:
        dist.barrier(group=g)
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
