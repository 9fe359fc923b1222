#!/usr/bin/env bash
# Quantization on one GPU, one part per call of a sitting (results under $OUT as res_$PART.tgz):
#   PART=kernels  the GPU tests of the FP8 / AWQ / FP8-KV kernels and the attention kernels,
#                 bench_quant_gemm.py, batch-1 latency of bf16 and AWQ int4 weights
#   PART=tune     the GPU tests of the quantized products, bench_quant_gemm.py --sweep
#   PART=awq      the GPU tests of the weight-only kernels, bench_quant_gemm.py at 1, 2 and 4 rows
#                 with the AWQ tiles swept, batch-1 latency of bf16 and AWQ int4 weights
#   PART=awq16    the GPU tests of the weight-only kernels, bench_quant_gemm.py at 1 and 2
#                 rows in float16 and in bfloat16 (awq_values_ms: X_WORDS off), batch-1 latency
#                 of bf16 and of AWQ int4 in bfloat16 and in float16
#   PART=kvdecode the GPU tests of the attention kernels and the FP8 KV pool;
#                 sweep_decode_ragged.py on an FP8 pool and a bf16 one, and on a 2,048-token
#                 shared prefix in FP8; srt W1 / B1 / W2 with --quantization fp8
#                 --kv-cache-dtype fp8_e4m3, and W2 with --quantization fp8 alone
#   PART=1|2|3    copy that part of the vLLM bundle (scripts/gpu_peer_run.sh), and
#                 1: srt W1 / B1 / W2 with --quantization fp8; B1 of bf16 and of AWQ int4
#                    in float16 (the dtype AWQ checkpoints carry)
#                 2: the same with --kv-cache-dtype fp8_e4m3 as well
#                 3: vLLM 0.26.0 W1 / B1 / W2 with --quantization fp8, then with
#                    --kv-cache-dtype fp8 as well
set -uo pipefail
cd "$(dirname "$0")/.."
DEST=${OUT:-benchmarks/results/latest}
export OUT=/tmp/res_$PART
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
peer() { PART=$COPY bash scripts/gpu_peer_run.sh; }  # COPY: the bundle part to copy
COPY=$PART; case $PART in kernels|tune|awq|awq16|kvdecode) COPY= ;; esac
W="offline:llama3-8b latency:llama3-8b prefix:llama3-8b"
case $PART in
  kernels)
    for t in tests/kernels/test_quant_gemm_triton.py tests/kernels/test_fp8_triton.py \
             tests/kernels/test_kv_fp8.py tests/unit/test_fp8.py tests/kernels/test_fused_triton.py \
             tests/kernels/test_triton_attention.py; do
      echo "== $t" | tee -a "$OUT/tests.log"
      timeout 150 python3 -m pytest -q -rf --tb=short -p no:cacheprovider "$t" 2>&1 | tail -25 \
        | tee -a "$OUT/tests.log"
    done
    SRT=quantgemm QG_ARGS="--rows 1 8 32 512" peer
    for cfg in "bf16:" "awq:--awq-group-size 128"; do
      TAG=${cfg%%:*} SRT_ARGS="${cfg#*:}" SRT="latency:llama3-8b" peer
    done ;;
  tune)
    for t in ${TUNE_TESTS:-tests/kernels/test_quant_gemm_triton.py tests/unit/test_fp8.py \
             tests/kernels/test_fp8_triton.py tests/kernels/test_kv_fp8.py}; do
      echo "== $t" | tee -a "$OUT/tests.log"
      timeout 150 python3 -m pytest -q -rf --tb=short -p no:cacheprovider "$t" 2>&1 | tail -25 \
        | tee -a "$OUT/tests.log"
    done
    SRT=quantgemm QG_ARGS="--sweep ${QG_EXTRA:-}" peer ;;
  awq|awq16)
    TESTS=tests/kernels/test_quant_gemm_triton.py
    [ "$PART" = awq ] && TESTS="$TESTS tests/unit/test_awq.py"
    for t in $TESTS; do
      echo "== $t" | tee -a "$OUT/tests.log"
      timeout 200 python3 -m pytest -q -rf --tb=short -p no:cacheprovider "$t" 2>&1 | tail -25 \
        | tee -a "$OUT/tests.log"
    done
    if [ "$PART" = awq ]; then
      SRT=quantgemm QG_ARGS="${QG_AWQ:---rows 1 2 4 --sweep --sweep-rows 1 2 4 --formats awq}" peer
    else
      for dt in float16 bfloat16; do
        TAG=$dt SRT=quantgemm QG_ARGS="--dtype $dt --rows 1 2 ${QG_AWQ16:-}" peer
      done
    fi
    configs=("bf16:" "awq:--awq-group-size 128")
    [ "$PART" = awq16 ] && configs+=("awq16:--awq-group-size 128 --dtype float16")
    for cfg in "${configs[@]}"; do
      TAG=${cfg%%:*} SRT_ARGS="${cfg#*:}" SRT="latency:llama3-8b" peer
    done ;;
  kvdecode)
    for t in tests/kernels/test_kv_fp8.py tests/kernels/test_triton_attention.py; do
      echo "== $t" | tee -a "$OUT/tests.log"
      timeout 200 python3 -m pytest -q -rf --tb=short -p no:cacheprovider "$t" 2>&1 | tail -25 \
        | tee -a "$OUT/tests.log"
    done
    sweep() {  # NAME ARGS...: one sweep, its table printed
      local name=$1; shift
      timeout 240 python3 benchmarks/sweep_decode_ragged.py --backends triton "$@" \
        --out "$OUT/sweep_$name.json" > "$OUT/sweep_$name.log" 2>&1
      echo "== sweep $name: $*"; grep -v "^{" "$OUT/sweep_$name.log" | tail -12
    }
    one="--splits 1 2 --block-n 64 --warps 4 --stages 3"
    sweep fp8 --kv-dtype fp8 --bs 64 128 256 $one
    sweep bf16 --bs 128 $one
    sweep shared_fp8 --kv-dtype fp8 --shared 2048 --lens 64-96 --bs 512 $one
    TAG=fp8kv SRT_ARGS="--quantization fp8 --kv-cache-dtype fp8_e4m3" SRT=$W peer
    TAG=fp8 SRT_ARGS="--quantization fp8" SRT="prefix:llama3-8b" peer ;;
  1) TAG=fp8 SRT_ARGS="--quantization fp8" SRT=$W peer
     for cfg in "bf16:" "awq16:--awq-group-size 128 --dtype float16"; do
       TAG=${cfg%%:*} SRT_ARGS="${cfg#*:}" SRT="latency:llama3-8b" COPY= peer
     done ;;
  2) TAG=fp8kv SRT_ARGS="--quantization fp8 --kv-cache-dtype fp8_e4m3" SRT=$W peer ;;
  3) mkdir -p /tmp/vllm-parts && cp .peer/3/* /tmp/vllm-parts/
     source /tmp/vllm-parts/install_vllm.sh || exit 1
     for cfg in "fp8:--quantization fp8" "fp8kv:--quantization fp8 --kv-cache-dtype fp8"; do
       # shellcheck disable=SC2086
       timeout 300 env $VLLM_ENV python3 /tmp/vllm-parts/vllm_bench.py llama3-8b ${cfg#*:} \
         --out "$OUT/vllm_llama3-8b_${cfg%%:*}.json" > "$OUT/vllm_${cfg%%:*}.log" 2>&1
       tail -8 "$OUT/vllm_${cfg%%:*}.log"
     done ;;
esac
mkdir -p "$DEST" && tar czf "$DEST/res_$PART.tgz" -C "$OUT" .
