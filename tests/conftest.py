import os
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
for p in (ROOT, os.path.join(ROOT, "tests")):
    if p not in sys.path:
        sys.path.insert(0, p)


@pytest.fixture(autouse=True)
def _threads():
    torch.set_num_threads(2)
    yield


@pytest.fixture(scope="session")
def ref_vectors():
    import json

    path = os.path.join(os.path.dirname(ROOT), "shared", "data", "reference_test_vectors.json")
    if not os.path.exists(path):
        pytest.skip(f"reference test vectors not found at {path}")
    with open(path) as f:
        return json.load(f)


_DS_SHM = "/dev/shm/deepspeed_allreduce_buffer_*"


@pytest.fixture(autouse=True, scope="session")
def _deepspeed_shm_buffers():
    """DeepSpeed's CPU shared-memory all-reduce leaves its buffers (~69 MB each, 2-3 per 2-rank
    launch) in /dev/shm when the ranks exit; on a machine that runs the suite repeatedly they fill
    the tmpfs, i.e. RAM (313 files, 21 GB, were found here). Remove the ones this session created,
    after every launch has finished."""
    import glob

    before = set(glob.glob(_DS_SHM))
    yield
    for path in set(glob.glob(_DS_SHM)) - before:
        try:
            os.unlink(path)
        except OSError:
            pass
