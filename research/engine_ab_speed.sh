#!/bin/bash
# Interleaved before/after runs of benchmarks/step_speed.py --threads 1 and benchmarks/flat_step.py (issue "One engine").
# Usage: git worktree add /tmp/before <rev>; bash research/engine_ab_speed.sh  (writes /tmp/ab/)
AFTER=$(cd "$(dirname "$0")/.." && pwd)
PY=$AFTER/.venv/bin/python
mkdir -p /tmp/ab
for round in 1 2; do
  for tree in /tmp/before "$AFTER"; do
    tag=$(basename $tree)_r$round
    (cd $tree && PYTHONPATH=$tree timeout 1500 $PY benchmarks/step_speed.py --threads 1 --peers none --eager-rounds 0 --dtypes fp32 --rounds 5 --out /tmp/ab/ss_$tag.json --png /tmp/ab/ss_$tag.png --md /tmp/ab/ss_$tag.md > /tmp/ab/ss_$tag.log 2>&1)
    (cd $tree && PYTHONPATH=$tree timeout 900 $PY benchmarks/flat_step.py --threads 1 --out /tmp/ab/fs_$tag.json > /tmp/ab/fs_$tag.log 2>&1)
    echo "$tag done $(date +%T)"
  done
done
