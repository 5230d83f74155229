#!/usr/bin/env bash
# Create ./.venv (if needed) and install gefen_dist with its test/benchmark extras.
# torch is pinned to the 2.13.0 CPU wheel on CPU machines: an unpinned `torch` would pull a
# multi-GB CUDA build. Override with TORCH_SPEC (e.g. TORCH_SPEC="torch==2.13.0" on GPU hosts
# with a matching index) if you need another build.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
. .venv/bin/activate
stamp=.venv/.gefen_dist_installed
want="$(cat pyproject.toml scripts/setup.sh | sha256sum | cut -c1-16)"
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  python -m pip install -q --upgrade pip
  python -m pip install -q "${TORCH_SPEC:-torch==2.13.0}"
  # DeepSpeed (a test dependency) must not try to compile its CUDA ops on a CPU machine
  DS_BUILD_OPS=0 python -m pip install -q -e ".[test,bench]"
  # torchtitan's CheckpointManager is a real client of the plain DCP flow (tests/test_torchtitan.py).
  # Its own dependencies (datasets, wandb, tensorboard, torchdata, ...) are not needed for that:
  # the package and the few modules its checkpoint/optimizer components import, without deps.
  python -m pip install -q --no-deps torchtitan==0.3.0 spmd_types==0.2.3 tyro==1.0.17 \
      docstring-parser==0.18.0 typeguard==4.6.1
  echo "$want" > "$stamp"
fi
# DeepSpeed JIT-builds its CPU shared-memory collective (deepspeed_shm_comm: ~55 s, both cores) at the
# first init_distributed of a checkout, and every DeepSpeed launch of the tests waits for that build.
# Build it here, once, in the directory the tests use (tests/conftest.py: build/torch_extensions).
ext="$PWD/build/torch_extensions"
if [ -z "${TORCH_EXTENSIONS_DIR:-}" ] && [ ! -f "$ext/deepspeed_shm_comm/deepspeed_shm_comm.so" ]; then
  mkdir -p "$ext"
  TORCH_EXTENSIONS_DIR="$ext" python -c "
from deepspeed.accelerator import get_accelerator
get_accelerator().create_op_builder('ShareMemCommBuilder').load()" > build/deepspeed_shm_comm.log 2>&1 \
    || echo "setup: deepspeed_shm_comm was not built here (build/deepspeed_shm_comm.log); the first DeepSpeed test builds it"
fi
# The native CPU kernels compile on first use (the step kernel in ~20 s) into $GEFEN_DIST_CACHE (default
# ~/.cache/gefen_dist). Build them here, once, so that the tests (and their launches' ranks) do not.
mkdir -p build
gefen-dist build-kernels > build/native_kernels.log 2>&1 \
    || echo "setup: the native kernels were not all built (build/native_kernels.log); the tests build them"
