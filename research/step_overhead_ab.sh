#!/bin/bash
# Interleaved before/after runs of benchmarks/step_overhead.py (the per-tensor cost of Gefen.step()).
# Usage: git worktree add /tmp/before <rev>; bash research/step_overhead_ab.sh [rounds] (writes /tmp/ab_overhead/)
# The "before" tree runs this tree's benchmark script (copied in) against its own gefen_dist.
AFTER=$(cd "$(dirname "$0")/.." && pwd)
PY=$AFTER/.venv/bin/python
OUT=/tmp/ab_overhead
mkdir -p $OUT
cp "$AFTER/benchmarks/step_overhead.py" /tmp/before/benchmarks/step_overhead.py
cp "$AFTER/benchmarks/_docs.py" /tmp/before/benchmarks/_docs.py
for round in $(seq 1 ${1:-4}); do
  for tree in /tmp/before "$AFTER"; do
    tag=$([ "$tree" = /tmp/before ] && echo before || echo after)_r$round
    (cd $tree && PYTHONPATH=$tree $PY benchmarks/step_overhead.py --rounds 15 --out $OUT/$tag.json > $OUT/$tag.log 2>&1)
    echo "$tag $(grep -h ratio $OUT/$tag.log | sed 's/.*tensors (//' | tr '\n' ' ')"
  done
done
