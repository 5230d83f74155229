#!/usr/bin/env bash
# AdamW vs Gefen on 2 data-parallel ranks (DDP), same seed, init and global batch.
#
#   bash launch/run_2ranks.sh                      # CPU/gloo, ~2-4 minutes on 2+ cores
#   STEPS=1000 MODEL=small bash launch/run_2ranks.sh --grad-clip 0.5   # extra args go to train.py
#
# Installs nothing: needs the package's requirements (torch, tqdm, matplotlib) in the current
# Python. Uses NCCL and one GPU per rank when CUDA GPUs are visible, else gloo on CPU.
# Writes runs/$NAME/{metrics.json,loss.png} and prints the AdamW-vs-Gefen table.
set -euo pipefail
cd "$(dirname "$0")/.."

NPROC=${NPROC:-2}
STRATEGY=${STRATEGY:-ddp}
MODEL=${MODEL:-small}
STEPS=${STEPS:-150}
BATCH=${BATCH:-16}          # global batch (sequences); each rank takes BATCH / NPROC
NAME=${NAME:-2ranks-${STRATEGY}-${MODEL}-${STEPS}}
PYTHON=${PYTHON:-python}

if ! "$PYTHON" -c "import torch.cuda as c; raise SystemExit(0 if c.is_available() else 1)"; then
    # CPU: one BLAS thread per rank unless told otherwise (ranks share the cores)
    export OMP_NUM_THREADS=${OMP_NUM_THREADS:-$("$PYTHON" -c "import os; print(max(1, (os.cpu_count() or 1) // $NPROC))")}
fi

exec "$PYTHON" -m torch.distributed.run --standalone --nproc_per_node "$NPROC" launch/train.py \
    --strategy "$STRATEGY" --optimizer both --model "$MODEL" --steps "$STEPS" \
    --batch-size "$BATCH" --warmup 20 --eval-every 50 --eval-batches 8 --name "$NAME" "$@"
