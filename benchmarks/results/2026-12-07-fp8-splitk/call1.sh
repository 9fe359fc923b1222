#!/usr/bin/env bash
# One call on one GPU: the split-K FP8 product's GPU tests; the 8B layers' products at 17-256 rows
# (srt's FP8 path, _scaled_mm, the split-K kernel's defaults); Llama-3-8B FP8 W1 with the
# split-K kernel (TAG k) and without it (FP8_GEMM_MAX_ROWS = 0 in this copy of the tree: TAG s);
# then the kernel's tile and split sweep at 64-256 rows on the o and down products.
set -u
R=$OUT/c1; mkdir -p $R
TESTS="tests/kernels/test_fp8_gemm_triton.py tests/kernels/test_fp8_triton.py" SRT="tests" \
  TAG=a OUT=$R bash scripts/gpu_peer_run.sh 2>&1 | grep -v "^/" | grep -E "passed|failed|Error" | tail -8
QG_TIMEOUT=90 QG_ARGS="--rows 17 32 64 128 256 --formats fp8" SRT="quantgemm" TAG=a OUT=$R \
  bash scripts/gpu_peer_run.sh 2>&1 | grep -v "^/" | grep -A21 "^layer" | cut -c1-200
W1() { SRT="offline:llama3-8b" SRT_ARGS="--quantization fp8" TAG=$1 OUT=$R \
  bash scripts/gpu_peer_run.sh > /dev/null 2>&1
  python3 -c "import json;d=json.load(open('$R/srt_offline_llama3-8b_$1.json'));print('W1 $1',d['wall_s'],round(d['out_tok_per_s']),round(d['of_floor'],3))" ; }
W1 k
sed -i 's/^FP8_GEMM_MAX_ROWS = 256$/FP8_GEMM_MAX_ROWS = 0/' srt/layers/fp8.py  # (256 when this ran)
W1 s
sed -i 's/^FP8_GEMM_MAX_ROWS = 0$/FP8_GEMM_MAX_ROWS = 256/' srt/layers/fp8.py
QG_TIMEOUT=100 QG_ARGS="--layers o down --rows 128 --sweep --sweep-rows 64 128 256 --formats fp8gemm" \
  SRT="quantgemm" TAG=sw OUT=$R bash scripts/gpu_peer_run.sh > /dev/null 2>&1
[ -f $R/srt_quant_gemm_sw.json ] || { grep fp8gemm $R/srt_quant_gemm_sw.log | cut -c1-260; tail -3 $R/srt_quant_gemm_sw.log; }
python3 - <<PY
import json
d = json.load(open("$R/srt_quant_gemm_sw.json"))
for r in d["sweep"]:
    print(r["layer"], r["M"], "default %.4f" % r["default_ms"], "best %.4f" % r["best_ms"],
          "smm %.4f" % r["smm_ms"], "floor %.4f" % r["floor_ms"], r["best"].replace("Fp8GemmConfig", ""))
PY
