#!/usr/bin/env bash
# First call of the sitting: vLLM part 1 over; the fused MoE kernel's tile configurations on
# both MoE shapes; Qwen3-30B-A3B W1 with the floors measured after the engine (KV pool sizing).
set -u
R=$OUT/c1; mkdir -p $R
PART=1 OUT=$R bash scripts/gpu_peer_run.sh > $R/part.log 2>&1; tail -3 $R/part.log
export PYTHONPATH=/tmp/site:$PWD
CFGS="16,64,128,4,4 16,64,64,4,4 16,64,128,4,2 16,128,128,4,2 16,256,128,8,2 32,64,64,4,4
 32,256,128,4,2 64,128,64,4,3 64,256,64,8,4 128,128,64,4,3 128,128,64,8,3 128,128,64,8,4
 128,256,64,8,3 128,256,64,8,4"
TOK="1 8 32 64 128 256 512 1024 2048 4096 8192"
timeout 240 python3 benchmarks/bench_moe.py --experts 128 --top-k 8 --hidden 2048 --inter 768 \
  --tokens $TOK --group-m 1 16 --configs $CFGS --breakdown --out $R/moe_qwen3.json \
  > $R/moe_qwen3.log 2>&1; tail -14 $R/moe_qwen3.log
timeout 200 python3 benchmarks/bench_moe.py --experts 64 --top-k 6 --hidden 2048 --inter 1408 \
  --tokens $TOK --group-m 1 16 --configs $CFGS --breakdown --out $R/moe_dsv2.json \
  > $R/moe_dsv2.log 2>&1; tail -14 $R/moe_dsv2.log
(while sleep 15; do nvidia-smi --query-compute-apps=pid,process_name,used_memory \
  --format=csv,noheader; echo --; done) > $R/smi.log 2>&1 &
SMI=$!
SRT="offline:qwen3-30b-a3b" SRT_ARGS="--log-level info" OUT=$R bash scripts/gpu_peer_run.sh \
  2>&1 | grep -v "^gpu\|^/" | tail -30
kill $SMI; grep -h "KV pool" $R/*.log | head -3; head -12 $R/smi.log
