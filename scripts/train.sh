#!/usr/bin/env bash
# The main job: install into ./.venv, then train the byte-level GPT on the Python standard
# library's sources with AdamW and with Gefen (same seed, init and data) and compare.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
exec python launch/train.py --optimizer both "$@"
