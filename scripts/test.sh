#!/usr/bin/env bash
# Run the whole test suite from nothing: installs into ./.venv, then pytest.
# The suite runs in GEFEN_TEST_WORKERS pytest-xdist workers (default 2; 0 runs it in one process),
# one test file per worker at a time (--dist loadfile: a file's module fixtures run once). Most tests
# keep one core busy (the multi-rank launches wait on each other), so two workers on a 2-core machine
# finish well before one process does (docs/index.md, "Tests").
# --no-loadscope-reorder: files go out in collection order, which tests/conftest.py starts with the
# slowest ones.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
exec python -m pytest -q -n "${GEFEN_TEST_WORKERS:-2}" --dist loadfile --no-loadscope-reorder "$@"
