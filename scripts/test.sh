#!/usr/bin/env bash
# Run the whole test suite from nothing: installs into ./.venv, then pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
exec python -m pytest -q "$@"
