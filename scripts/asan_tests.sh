#!/usr/bin/env bash
# The test suite (or the tests named as arguments) with gefen_dist's native CPU libraries built with
# AddressSanitizer: GEFEN_DIST_CFLAGS adds the flags (gefen_dist/kernels/native.py; such builds are cached
# apart from the default ones), libasan is preloaded into every process, the torchrun and DeepSpeed
# workers the multi-rank tests start included, and a report from any of them fails the run.
# Needs the venv of scripts/setup.sh and gcc's libasan. About 16 minutes for the whole suite on 2 cores.
#
#   bash scripts/asan_tests.sh                          # every test (the offline sm_90 compile aside)
#   bash scripts/asan_tests.sh tests/test_fsdp2.py      # some of them
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
CC=${CC:-gcc}
asan=$("$CC" -print-file-name=libasan.so)
cxx=$("$CC" -print-file-name=libstdc++.so.6)  # (preloaded too: ASan must see C++ throws, torch raises through them)
if [ ! -e "$asan" ]; then
    echo "asan_tests.sh: $CC has no libasan.so ($asan); install gcc's sanitizer runtime (e.g. libasan8)" >&2
    exit 2
fi
logs=$(mktemp -d /tmp/gefen_asan_logs.XXXXXX)
export GEFEN_DIST_CFLAGS="-fsanitize=address -fno-omit-frame-pointer -g -O1"
export GEFEN_DIST_CACHE=${GEFEN_DIST_ASAN_CACHE:-${TMPDIR:-/tmp}/gefen_dist_asan_cache}
export GEFEN_DIST_CPU_ISA=native  # (no timing of the two builds: the sanitized ones would decide it)
export ASAN_OPTIONS="detect_leaks=0:halt_on_error=1:log_path=$logs/asan"
if [ $# -eq 0 ]; then set -- tests --deselect tests/test_triton_sm90.py; fi
rc=0
LD_PRELOAD="$asan $cxx" "$PY" -m pytest -q -p no:cacheprovider -o addopts= "$@" || rc=$?
if compgen -G "$logs/asan*" > /dev/null; then
    echo "asan_tests.sh: AddressSanitizer reports in $logs:" >&2
    head -n 40 "$logs"/asan* >&2
    exit 1
fi
rmdir "$logs"
echo "asan_tests.sh: no AddressSanitizer report (pytest rc $rc)"
exit "$rc"
