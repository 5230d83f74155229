import os
import sys

# Idle OpenMP threads sleep instead of spinning. Two xdist workers of two torch threads each share the
# CI's two cores; with the default (spinning) wait policy a thread waiting at a parallel region's
# barrier for a descheduled sibling burns its core: the single-process test files took 791 CPU-s
# (404 s) that way, 174 CPU-s (98 s) with this (docs/index.md, "Tests"). Read when torch loads
# OpenMP, so before the import below (and inherited by the xdist workers and every launched rank).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
# The CPU kernels' -march=native build, with no timing at first use (gefen_dist/kernels/cpu_build.py): the
# AVX-512 path stays under test on hosts that have it; tests/test_cpu_build.py checks the AVX2 build and
# the measured choice
os.environ.setdefault("GEFEN_DIST_CPU_ISA", "native")

import pytest  # noqa: E402
import torch  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
for p in (ROOT, os.path.join(ROOT, "tests")):
    if p not in sys.path:
        sys.path.insert(0, p)


def _own_extension_dir() -> None:
    """DeepSpeed JIT-builds ``deepspeed_shm_comm`` at every CPU ``init_distributed`` under torch's
    extension root, guarded by a ``lock`` file that torch waits on forever. A build killed there
    (a timed-out test, an interrupted run: it happened, and every DeepSpeed test of the next CI
    run then hung to its timeout) poisons every later launch that shares the directory. The
    suite therefore builds in its own directory (``build/torch_extensions`` of this checkout,
    inherited by every launched rank) and, holding an ``flock`` for the session so that a
    concurrent session in the same checkout is never disturbed, removes the locks a killed
    session left there. A ``TORCH_EXTENSIONS_DIR`` set by the caller is used as it is and never
    cleaned (other programs may build there)."""
    import fcntl
    import glob

    if os.environ.get("TORCH_EXTENSIONS_DIR"):
        return
    root = os.environ["TORCH_EXTENSIONS_DIR"] = os.path.join(ROOT, "build", "torch_extensions")
    os.makedirs(root, exist_ok=True)
    fd = os.open(os.path.join(root, ".pytest-session"), os.O_CREAT | os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:  # another session of this checkout is running: its locks are live
        os.close(fd)
        return
    globals()["_SESSION_FD"] = fd  # held (and the flock with it) until this process exits
    for lock in glob.glob(os.path.join(root, "*", "lock")):  # torch builds in $TORCH_EXTENSIONS_DIR/<op>
        sys.stderr.write(f"conftest: removing {lock}, left by a killed extension build\n")
        os.unlink(lock)


_own_extension_dir()


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


def _controller(session) -> bool:
    """Whether this process runs the session as a whole: the only process without pytest-xdist, its
    controller with it (``scripts/test.sh`` runs the suite in two workers)."""
    return not hasattr(session.config, "workerinput")


def pytest_sessionstart(session):
    if _controller(session):
        import glob

        session.config._gefen_ds_shm = set(glob.glob(_DS_SHM))


def pytest_sessionfinish(session, exitstatus):
    """DeepSpeed's CPU shared-memory all-reduce leaves its buffers (~69 MB each, 2-3 per 2-rank
    launch) in /dev/shm when the ranks exit; on a machine that runs the suite repeatedly they fill
    the tmpfs, i.e. RAM (313 files, 21 GB, were found here). The controller removes the ones this
    session created, after every worker's last launch has finished (a worker must not: another
    worker's ranks may still be opening theirs by name)."""
    before = getattr(session.config, "_gefen_ds_shm", None)
    if before is None or not _controller(session):
        return
    import glob

    for path in set(glob.glob(_DS_SHM)) - before:
        try:
            os.unlink(path)
        except OSError:
            pass


# The files that take longest, slowest first (seconds in one worker of `pytest -n 2 --durations=0`,
# 2026-12-06: 331, 247, 165, 157, 122, 120, and test_fsdp2.py ~60 since its launches were merged).
# scripts/test.sh runs the suite with `--dist loadfile --no-loadscope-reorder`, so xdist hands out
# files in collection order and these start first, while the many short files fill the gaps (xdist's
# default order, most tests first, puts them last). The suite is CPU-bound on two cores, so this
# made no measurable difference there (901 s before, 916 s after); where cores idle, it should keep
# one of them from running alone at the end (not measured).
_SLOW_FIRST = ("test_triton_step.py", "test_hf_multirank.py", "test_train_strategies.py", "test_distributed.py",
               "test_deepspeed.py", "test_triton_sm90.py", "test_fsdp2.py")


def pytest_collection_modifyitems(session, config, items):
    def rank(item):
        name = os.path.basename(str(item.fspath))
        return _SLOW_FIRST.index(name) if name in _SLOW_FIRST else len(_SLOW_FIRST)

    items.sort(key=rank)  # stable: the order within a file, and among the other files, is kept
