#!/usr/bin/env bash
# The main job: install into ./.venv, then train the byte-level GPT on the Python standard
# library's sources on 2 local data-parallel ranks (CPU/gloo, NCCL when GPUs exist) with AdamW and
# with Gefen (same seed, init and global batch) and print loss and optimizer-state bytes side by
# side. Extra arguments go to launch/train.py; see docs/training.md for the other strategies.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
exec bash launch/run_2ranks.sh "$@"
