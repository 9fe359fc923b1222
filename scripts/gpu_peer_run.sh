#!/usr/bin/env bash
# On one GPU: srt's benchmarks and, side by side in the same sitting, vLLM 0.26.0's (the peer kit
# of ../shared/peer, whose three parts arrive one per call). Results as JSON and logs in $OUT.
#   PART=1|2|3      copy that part of the vLLM bundle from .peer/$PART to /tmp/vllm-parts
#   SRT="..."       srt stages, each "bench:shape": offline (W1), latency (B1), prefix (W2),
#                   long (W3, T30, D30 at a 32k context: bench_long.py), serving-long (HTTP
#                   short streams + an 8k prompt every 3 s: bench_serving.py --workload long-mix,
#                   knobs in MIX_ARGS, default "--request-rate 8 --duration 60"),
#                   serving (streamed 256 in / 256 out at rising Poisson rates: the curve
#                   benchmarks/capacity.py reads; knobs in SWEEP_ARGS, default "--request-rate
#                   8 16 24 32 48 --num-prompts 240"), constrained (bench_constrained.py per
#                   grammar backend in GRAMMAR_BACKENDS, default all three, with SmolLM2's
#                   tokenizer from .whlgr/tok or .whlgr/tok.tgz),
#                   tests (the gpu-marked tests in TESTS), offline-lora (W1 with LoRA
#                   adapters over the requests: LORA_ARGS, default "--lora 8 --lora-rank 16");
#                   profile (benchmarks/profile_decode.py: PROF_ARGS, the log's last PROF_TAIL
#                   lines shown); e.g. SRT="offline:llama3-8b tests"
#   BUDGET=S        skip the stages that would start after S seconds of this call
#   SRT_ARGS="..."  extra flags of every srt stage: the benchmark's own or any srt.ServerArgs
#                   flag, e.g. "--chunked-prefill-size 8192 --enable-mixed-chunk"
#   quantgemm       (an SRT stage, no shape) bf16 / FP8 / AWQ products at the 8B layer sizes
#                   (bench_quant_gemm.py; QG_ARGS, e.g. "--sweep")
#   VLLM="..."      shapes to run vLLM on (needs all three parts copied; installs once)
#   VLLM_ARGS="..." extra flags of vllm_bench.py, e.g. "--quantization fp8 --kv-cache-dtype fp8"
#   VLLM_EXTRA_ENV="K=V ..." extra environment of the vLLM runs, e.g.
#                   VLLM_MOE_ROUTING_SIMULATION_STRATEGY=uniform_random (experts drawn at random)
#   VLLM_LONG="..." shapes to run vLLM's --long mode on (W3, T30, D30; same install)
#   VLLM_CONSTRAINED=1  vLLM's per-token cost of the regex of bench_constrained.py (SmolLM2
#                   shape, tokenizer from .whlgr/tok: benchmarks/vllm_constrained.py; needs
#                   .whlvx carried: lm-format-enforcer and interegular, which the kit lacks)
#   VLLM_SERVING="..." shapes to serve with vLLM's OpenAI server (random weights, the shape's
#                   word tokenizer) and measure with bench_serving.py --endpoint completions at
#                   SWEEP_ARGS (as the srt stage `serving` does); needs .whlvs carried: uvicorn,
#                   watchfiles, prometheus-fastapi-instrumentator, python-multipart, which the
#                   kit lacks. Give the srt stage `SRT_ARGS=--endpoint completions` to compare.
#   TAG=a           suffix of the result files (runs A and B of one sitting)
# Wheels srt needs that the machine lacks travel in .whl (installed to /tmp/site): for Python
# 3.12, pyzmq, and for the HTTP stages fastapi 0.136.3 (newer ones import opentelemetry),
# starlette 1.3.1, uvicorn, pydantic, pydantic-core, annotated-types, typing-inspection; and in
# .whlfi, when carried, flashinfer-python 0.6.1 and apache-tvm-ffi 0.1.15.post2 (then `auto`
# attention computes EXTEND steps with FlashInfer).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-benchmarks/results/latest}
TAG=${TAG:-a}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
# .whlfi: flashinfer-python; .whlgr: xgrammar, llguidance, outlines-core, apache-tvm-ffi (both
# FlashInfer and xgrammar need it: carry .whlgr with .whlfi)
wheels=$(ls .whl/*.whl .whlfi/*.whl .whlgr/*.whl 2>/dev/null)
# installed once per machine start and wheel set (later calls of a sitting skip it)
if [ -n "$wheels" ] && [ "$(cat /tmp/site/.wheels 2>/dev/null)" != "$(echo $wheels)" ]; then
  # shellcheck disable=SC2086
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site $wheels || exit 1
  echo $wheels > /tmp/site/.wheels
fi
export PYTHONPATH=/tmp/site:$PWD
# SmolLM2's tokenizer travels packed (the calls' size limit)
if [ -f .whlgr/tok.tgz ] && [ ! -d .whlgr/tok ]; then tar -C .whlgr -xzf .whlgr/tok.tgz; fi
if [ -n "${PART:-}" ]; then
  mkdir -p /tmp/vllm-parts && cp .peer/"$PART"/* /tmp/vllm-parts/
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"

start_s=$(date +%s)
run() {  # run NAME TIMEOUT CMD...
  local name=$1 limit=$2; shift 2
  if [ -n "${BUDGET:-}" ] && [ $(( $(date +%s) - start_s )) -gt "$BUDGET" ]; then
    echo "== $name skipped (past BUDGET=$BUDGET s)"; return
  fi
  echo "== $name"
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  grep -v "^\(rate\|engine rate\)=" "$OUT/$name.log" | tail -${TAIL:-12}
  [ "$rc" = 0 ] || echo "!! $name exited $rc"
}

for stage in ${SRT:-}; do
  bench=${stage%%:*}; shape=${stage#*:}
  case $bench in
    offline) run "srt_offline_${shape}_$TAG" 300 python3 benchmarks/bench_offline.py \
               --shape "$shape" ${SRT_ARGS:-} --out "$OUT/srt_offline_${shape}_$TAG.json" ;;
    offline-lora) run "srt_offline_lora_${shape}_$TAG" 300 python3 benchmarks/bench_offline.py \
               --shape "$shape" ${LORA_ARGS:---lora 8 --lora-rank 16} ${SRT_ARGS:-} \
               --out "$OUT/srt_offline_lora_${shape}_$TAG.json" ;;
    latency) run "srt_latency_${shape}_$TAG" 240 python3 benchmarks/bench_latency.py \
               --shape "$shape" --cuda-graph-max-bs 1 --runs 2 ${SRT_ARGS:-} \
               --out "$OUT/srt_latency_${shape}_$TAG.json" ;;
    prefix) run "srt_prefix_${shape}_$TAG" 240 python3 benchmarks/bench_prefix.py \
              --shape "$shape" --mode cache ${SRT_ARGS:-} \
              --out "$OUT/srt_prefix_${shape}_$TAG.json" ;;
    long) run "srt_long_${shape}_$TAG" 480 python3 benchmarks/bench_long.py \
            --shape "$shape" ${SRT_ARGS:-} --out "$OUT/srt_long_${shape}_$TAG.json" ;;
    serving-long) run "srt_serving_long_${shape}_$TAG" 480 python3 benchmarks/bench_serving.py \
                    --launch --shape "$shape" --workload long-mix --no-progress \
                    ${MIX_ARGS:---request-rate 8 --duration 60} ${SRT_ARGS:-} \
                    --out "$OUT/srt_serving_long_${shape}_$TAG.json" ;;
    serving) run "srt_serving_${shape}_$TAG" 540 python3 benchmarks/bench_serving.py \
               --launch --shape "$shape" --input-len 256 --output-len 256 --no-progress \
               ${SWEEP_ARGS:---request-rate 8 16 24 32 48 --num-prompts 240} ${SRT_ARGS:-} \
               --out "$OUT/srt_serving_${shape}_$TAG.json" ;;
    constrained) run "srt_constrained_${shape}_$TAG" 540 python3 benchmarks/bench_constrained.py \
                   --shape "$shape" --tokenizer-dir .whlgr/tok \
                   --grammar-backend ${GRAMMAR_BACKENDS:-xgrammar llguidance outlines} ${SRT_ARGS:-} \
                   --out "$OUT/srt_constrained_${shape}_$TAG.json" ;;
    quantgemm) run "srt_quant_gemm_$TAG" ${QG_TIMEOUT:-400} python3 benchmarks/bench_quant_gemm.py ${QG_ARGS:-} \
                 --out "$OUT/srt_quant_gemm_$TAG.json" ;;
    profile) TAIL=${PROF_TAIL:-80} run "srt_profile_${shape}_$TAG" 300 python3 benchmarks/profile_decode.py \
               --shape "$shape" ${PROF_ARGS:-} ;;
    tests) TAIL=25 run "gpu_tests_$TAG" ${TEST_TIMEOUT:-240} python3 -m pytest -q -rA -p no:cacheprovider \
             ${TESTS:-tests/gpu/test_overlap_gpu.py} ;;
    *) echo "unknown stage $stage" ;;
  esac
done

if [ -n "${VLLM:-}${VLLM_LONG:-}${VLLM_CONSTRAINED:-}${VLLM_SERVING:-}" ]; then
  source /tmp/vllm-parts/install_vllm.sh || { echo "!! vLLM install failed"; exit 1; }
  # vLLM validates structured-output requests by importing every grammar backend, and the kit
  # lacks lm-format-enforcer: its wheels (lm-format-enforcer, interegular) travel in .whlvx
  if ls .whlvx/*.whl > /dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/vllm-peer/site \
      --upgrade .whlvx/*.whl || echo "!! .whlvx install failed"
  fi
  for shape in ${VLLM:-}; do
    run "vllm_${shape}_$TAG" 300 env $VLLM_ENV ${VLLM_EXTRA_ENV:-} python3 /tmp/vllm-parts/vllm_bench.py "$shape" \
      ${VLLM_ARGS:-} --out "$OUT/vllm_${shape}_$TAG.json"
  done
  for shape in ${VLLM_LONG:-}; do
    run "vllm_long_${shape}_$TAG" 480 env $VLLM_ENV python3 /tmp/vllm-parts/vllm_bench.py \
      "$shape" --long --out "$OUT/vllm_long_${shape}_$TAG.json"
  done
  if [ -n "${VLLM_SERVING:-}" ] && ls .whlvs/*.whl > /dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/vllm-peer/site \
      --upgrade .whlvs/*.whl || echo "!! .whlvs install failed"
  fi
  for shape in ${VLLM_SERVING:-}; do
    vdir=$(python3 -c "import sys, tempfile; from benchmarks.common import write_shape_dir
print(write_shape_dir(sys.argv[1], tempfile.mkdtemp(prefix='vllm-serve-')))" "$shape")
    # /reset_prefix_cache (bench_serving's flush between rates) needs the dev mode
    env $VLLM_ENV VLLM_SERVER_DEV_MODE=1 python3 -m vllm.entrypoints.openai.api_server \
      --model "$vdir" --load-format dummy --served-model-name default --port 8123 \
      > "$OUT/vllm_server_${shape}_$TAG.log" 2>&1 &
    vpid=$!
    if python3 -c "import time, urllib.request
for _ in range(400):
    try:
        urllib.request.urlopen('http://127.0.0.1:8123/health', timeout=2); break
    except Exception:
        time.sleep(1)
else:
    raise SystemExit(1)"; then
      run "vllm_serving_${shape}_$TAG" 540 python3 benchmarks/bench_serving.py \
        --base-url http://127.0.0.1:8123 --shape "$shape" --endpoint completions \
        --flush-path /reset_prefix_cache --input-len 256 --output-len 256 --no-progress \
        ${SWEEP_ARGS:---request-rate 8 16 24 32 48 --num-prompts 240} \
        --out "$OUT/vllm_serving_${shape}_$TAG.json"
    else
      echo "!! vLLM's server did not come up"; tail -20 "$OUT/vllm_server_${shape}_$TAG.log"
    fi
    kill $vpid 2> /dev/null; wait $vpid 2> /dev/null
  done
  if [ -n "${VLLM_CONSTRAINED:-}" ]; then
    run "vllm_constrained_$TAG" 400 env $VLLM_ENV python3 benchmarks/vllm_constrained.py \
      --tokenizer-dir .whlgr/tok --out "$OUT/vllm_constrained_$TAG.json"
  fi
fi
ls "$OUT"
