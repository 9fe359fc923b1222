#!/usr/bin/env bash
# On a machine with two GPUs: the TP and CUDA graph GPU tests, then batch-1 latency and W1
# offline throughput for the Llama-3-8B shape at TP 1 and TP 2. Results go to $OUT.
#   STAGES="tests latency offline" (default all); TP_SIZES="1 2"; LOG_LEVEL=info for start-up timings
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-benchmarks/results/latest}
STAGES=${STAGES:-tests latency offline}
SHAPE=${SHAPE:-llama3-8b}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH="${PYTHONPATH:-}:$PWD"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"
for stage in $STAGES; do
  case $stage in
    tests)
      timeout 400 python3 -m pytest -q -rA -s -p no:cacheprovider ${TESTS:-tests/gpu} 2>&1 \
        | tee "$OUT/gpu_tests.log" | grep -E "PASSED|FAILED|ERROR|SKIPPED|passed|failed|positions|free-running"
      ;;
    latency)
      for tp in ${TP_SIZES:-1 2}; do
        for g in "" ${NOGRAPH:+--disable-cuda-graph}; do
          timeout ${LAT_TIMEOUT:-200} python3 benchmarks/bench_latency.py --shape "$SHAPE" --tp-size $tp $g \
            ${BACKEND:+--attention-backend $BACKEND} --cuda-graph-max-bs ${LAT_GRAPH_BS:-1} \
            ${LOG_LEVEL:+--log-level $LOG_LEVEL} --out "$OUT/latency_${SHAPE}_tp${tp}${g:+_nograph}.json" 2>&1 \
            | tee "$OUT/latency_${SHAPE}_tp${tp}${g:+_nograph}.log" | tail -4
        done
      done
      ;;
    offline)
      for tp in ${TP_SIZES:-1 2}; do
        timeout ${OFF_TIMEOUT:-300} python3 benchmarks/bench_offline.py --shape "$SHAPE" --tp-size $tp \
          ${BACKEND:+--attention-backend $BACKEND} ${LOG_LEVEL:+--log-level $LOG_LEVEL} \
          --out "$OUT/offline_${SHAPE}_tp${tp}.json" 2>&1 \
          | tee "$OUT/offline_${SHAPE}_tp${tp}.log" | tail -4
      done
      ;;
  esac
done
