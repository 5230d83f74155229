#!/bin/bash
# The checks for a session that is lent a CUDA GPU, as one prepared run (a few minutes on an H200):
#   1. the CUDA tests: the compiled Triton kernels (shared, per-element, factored second moment and
#      second_moment="nibbles") against the eager path, and Gefen on a CUDA model against the eager path on CPU;
#   2. benchmarks/cuda_graph_check.py: Gefen(capturable=True) captured in a CUDA graph replays bitwise the
#      eager step (exit 1 otherwise), with no host synchronisation, and its time against fused AdamW;
#      with NIBBLES_GRAPH=1 also for second_moment="nibbles", last (graph_nibbles.log / .json; the
#      default timeouts add up to 600 s without it);
#   3. benchmarks/gpu_step.py: Gefen(...).step() against torch's fused AdamW on GPT-2 small and XL,
#      then the kernel-level timings and the chunk-size sweep;
#   4. benchmarks/flat_step.py --device cuda: DeepSpeed's flat-buffer step (GPT-2 small in one buffer),
#      its segments batched and one by one, against fused AdamW.
# Everything lands under $OUT (default /tmp/gpu_check): gpu.txt, pytest.log, graph.log, graph.json,
# graph_nibbles.log, graph_nibbles.json, gpu_step.log, gpu_step.json, flat_step.log, flat_step.json.
#   usage: bash benchmarks/gpu_check.sh [extra gpu_step.py arguments]
set -o pipefail
OUT=${OUT:-/tmp/gpu_check}
mkdir -p "$OUT"
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
PY=${PYTHON:-python3}
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv 2>&1 | tee "$OUT/gpu.txt"
$PY -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__)" \
  2>&1 | tee -a "$OUT/gpu.txt"
timeout "${TEST_TIMEOUT:-200}" $PY -m pytest -q -p no:cacheprovider -o addopts=-ra \
  tests/test_triton_step.py tests/test_triton_nibbles.py tests/test_optimizer.py -k cuda 2>&1 | tee "$OUT/pytest.log"
echo "pytest rc ${PIPESTATUS[0]}" | tee -a "$OUT/pytest.log"
timeout "${GRAPH_TIMEOUT:-90}" $PY benchmarks/cuda_graph_check.py --out "$OUT/graph.json" 2>&1 | tee "$OUT/graph.log"
echo "cuda_graph_check rc ${PIPESTATUS[0]}" | tee -a "$OUT/graph.log"
timeout "${BENCH_TIMEOUT:-260}" $PY benchmarks/gpu_step.py --out "$OUT/gpu_step.json" "$@" 2>&1 | tee "$OUT/gpu_step.log"
echo "gpu_step rc ${PIPESTATUS[0]}" | tee -a "$OUT/gpu_step.log"
timeout "${FLAT_TIMEOUT:-50}" $PY benchmarks/flat_step.py --device cuda --no-eager --rounds 10 \
  --out "$OUT/flat_step.json" 2>&1 | tee "$OUT/flat_step.log"
echo "flat_step rc ${PIPESTATUS[0]}" | tee -a "$OUT/flat_step.log"
if [ -n "${NIBBLES_GRAPH:-}" ]; then
  timeout "${GRAPH_TIMEOUT:-90}" $PY benchmarks/cuda_graph_check.py --second-moment nibbles --out "$OUT/graph_nibbles.json" \
    2>&1 | tee "$OUT/graph_nibbles.log"
  echo "cuda_graph_check nibbles rc ${PIPESTATUS[0]}" | tee -a "$OUT/graph_nibbles.log"
fi
