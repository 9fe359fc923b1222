#!/usr/bin/env bash
# On a machine with one GPU: the performance benchmarks, random weights, results as JSON (and
# each run's log) in $OUT. Charts are drawn elsewhere: python3 benchmarks/plot_results.py $OUT
#   STAGES="latency offline prefix serving" (default these; each stage is under its own timeout,
#   so a runner that limits one command to 10 minutes can take one or two stages per call)
#   SHAPES="smollm2-135m llama3-8b"   BACKEND=triton|flashinfer   LOG_LEVEL=info
#   HF=1 (default; HF= turns it off): the offline stage also runs transformers' generate_batch
#   SERVING_SHAPE=smollm2-135m  SERVING_CONC="16 64"  SERVING_RATES="8 32"
#   SMOKE=1: tiny sizes on the same code paths (a few seconds each after start-up)
# More stages, on request: tests (the gpu-marked tests in TESTS), moe (bench_moe.py --sweep),
#   constrained (bench_constrained.py on the SmolLM2 shape; TOKENIZER_DIR holds SmolLM2's
#   tokenizer files), profile_fill (W1's fill rounds under the profilers, per shape)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-benchmarks/results/latest}
STAGES=${STAGES:-latency offline prefix serving}
HF=${HF-1}
SHAPES=${SHAPES:-smollm2-135m llama3-8b}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH="${PYTHONPATH:-}:$PWD"
COMMON=(${BACKEND:+--attention-backend $BACKEND} ${LOG_LEVEL:+--log-level $LOG_LEVEL}
        ${DEVICE_ARGS:-})
if [ -n "${SMOKE:-}" ]; then
  LAT_ARGS=(--input-len 16 --output-len 16 --runs 1)
  OFF_ARGS=(--num-prompts 8 --input-len-cap 64 --output-len-cap 16 --hf-requests 4 --hf-output-len 8)
  PRE_ARGS=(--num-requests 8 --prefix-len 64 --suffix-len 8 --output-len 4 --max-prefill-tokens 100)
  SRV_ARGS=(--num-prompts 8 --input-len 32 --output-len 8)
  SERVING_CONC=${SERVING_CONC:-4}; SERVING_RATES=${SERVING_RATES:-20}
else
  LAT_ARGS=(); OFF_ARGS=(); PRE_ARGS=()
  SRV_ARGS=(--num-prompts 256 --input-len 1024 --output-len 256 --range-ratio 0.5)
fi
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version \
  --format=csv | tee "$OUT/gpu.txt"

run() {  # run NAME TIMEOUT CMD...: the command's output in $OUT/NAME.log, its table on screen
  local name=$1 limit=$2; shift 2
  echo "== $name"
  timeout "$limit" "$@" 2>&1 | tee "$OUT/$name.log" | grep -v "^\(rate\|engine rate\)=" | tail -14
  local rc=${PIPESTATUS[0]}
  if [ "$rc" = 124 ]; then echo "!! $name timed out after $limit s"
  elif [ "$rc" != 0 ]; then echo "!! $name exited $rc (see $OUT/$name.log)"; fi
}

for stage in $STAGES; do
  case $stage in
    latency)
      for shape in $SHAPES; do
        run "latency_$shape" "${LAT_TIMEOUT:-240}" python3 benchmarks/bench_latency.py \
          --shape "$shape" --cuda-graph-max-bs "${LAT_GRAPH_BS:-1}" "${COMMON[@]}" \
          "${LAT_ARGS[@]}" --out "$OUT/latency_$shape.json"
      done
      ;;
    offline)  # W1, host ms per decode step, and transformers' generate_batch on 64 requests
      for shape in $SHAPES; do
        run "offline_$shape" "${OFF_TIMEOUT:-480}" python3 benchmarks/bench_offline.py \
          --shape "$shape" ${HF:+--compare-hf} "${COMMON[@]}" "${OFF_ARGS[@]}" \
          --out "$OUT/offline_$shape.json"
      done
      ;;
    prefix)  # W2 with and without the radix cache
      for shape in $SHAPES; do
        run "prefix_$shape" "${PRE_TIMEOUT:-480}" python3 benchmarks/bench_prefix.py \
          --shape "$shape" --mode both "${COMMON[@]}" "${PRE_ARGS[@]}" \
          --out "$OUT/prefix_$shape.json"
      done
      ;;
    serving)  # HTTP at fixed concurrency (against srt.Engine), then Poisson arrivals
      shape=${SERVING_SHAPE:-smollm2-135m}
      run "serving_conc_$shape" "${SRV_TIMEOUT:-540}" python3 benchmarks/bench_serving.py \
        --launch --shape "$shape" --max-concurrency ${SERVING_CONC:-16 64} --compare-engine \
        "${COMMON[@]}" "${SRV_ARGS[@]}" --out "$OUT/serving_conc_$shape.json"
      run "serving_rate_$shape" "${SRV_TIMEOUT:-540}" python3 benchmarks/bench_serving.py \
        --launch --shape "$shape" --request-rate ${SERVING_RATES:-8 32} \
        "${COMMON[@]}" "${SRV_ARGS[@]}" --out "$OUT/serving_rate_$shape.json"
      ;;
    tests)
      run gpu_tests "${TEST_TIMEOUT:-300}" python3 -m pytest -q -x -m gpu -p no:cacheprovider \
        ${TESTS:-tests/kernels tests/gpu}
      ;;
    moe)
      run moe "${MOE_TIMEOUT:-300}" python3 benchmarks/bench_moe.py --sweep --out "$OUT/moe.json"
      ;;
    constrained)
      run constrained "${CON_TIMEOUT:-300}" python3 benchmarks/bench_constrained.py \
        --shape smollm2-135m --tokenizer-dir "${TOKENIZER_DIR:?}" "${COMMON[@]}" \
        --out "$OUT/constrained_smollm2-135m.json"
      ;;
    profile_fill)
      for shape in $SHAPES; do
        run "profile_fill_$shape" "${PROF_TIMEOUT:-240}" python3 benchmarks/profile_decode.py \
          --shape "$shape" --w1 --batch 256 --steps 5 --profile-fill "${COMMON[@]}"
      done
      ;;
    *) echo "unknown stage $stage" ;;
  esac
done
ls -l "$OUT"
