#!/usr/bin/env bash
# On a GPU machine: the kernel and engine tests (the `gpu` ones included), then the attention
# benchmark. Results go to $OUT (default benchmarks/results/latest).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-benchmarks/results/latest}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH="${PYTHONPATH:-}:$PWD"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" \
  | tee -a "$OUT/gpu.txt"
timeout 420 python3 -m pytest -q -rA -p no:cacheprovider tests/kernels tests/gpu ${PYTEST_ARGS:-} \
  2>&1 | tee "$OUT/gpu_tests.log" | grep -E "PASSED|FAILED|ERROR|SKIPPED|passed|failed|positions" 
timeout 300 python3 benchmarks/bench_attention.py --out "$OUT/bench_attention.json" \
  2>&1 | tee "$OUT/bench_attention.log"
