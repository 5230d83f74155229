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
