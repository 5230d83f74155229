#!/usr/bin/env bash
# Multi-node launch of launch/train.py with torchrun's static rendezvous. Run it on every node:
#
#   NNODES=2 NODE_RANK=0 MASTER_ADDR=node0 MASTER_PORT=29500 NPROC_PER_NODE=8 \
#       bash launch/torchrun_multinode.sh --strategy fsdp --optimizer gefen --model gpt2
#   NNODES=2 NODE_RANK=1 MASTER_ADDR=node0 MASTER_PORT=29500 NPROC_PER_NODE=8 \
#       bash launch/torchrun_multinode.sh --strategy fsdp --optimizer gefen --model gpt2
#
# All arguments go to launch/train.py (default --strategy ddp). NPROC_PER_NODE defaults to the
# number of visible GPUs (1 on a CPU node). --out must be on a filesystem shared by the nodes
# when checkpointing with --strategy fsdp or deepspeed (every rank writes its shards); rank 0
# writes metrics.json, loss.png and the single/ddp/zero1 checkpoints.
set -euo pipefail
cd "$(dirname "$0")/.."

: "${NNODES:?set NNODES (number of nodes)}"
: "${NODE_RANK:?set NODE_RANK (0..NNODES-1)}"
: "${MASTER_ADDR:?set MASTER_ADDR (host name or IP of node 0)}"
MASTER_PORT=${MASTER_PORT:-29500}
PYTHON=${PYTHON:-python}
NPROC_PER_NODE=${NPROC_PER_NODE:-$("$PYTHON" -c 'import torch; print(max(1, torch.cuda.device_count()))')}

args=("$@")
if [[ " ${args[*]-} " != *" --strategy "* && " ${args[*]-} " != *" --strategy="* ]]; then
    args=(--strategy ddp "${args[@]}")
fi

exec "$PYTHON" -m torch.distributed.run \
    --nnodes "$NNODES" --node_rank "$NODE_RANK" --nproc_per_node "$NPROC_PER_NODE" \
    --master_addr "$MASTER_ADDR" --master_port "$MASTER_PORT" \
    launch/train.py "${args[@]}"
