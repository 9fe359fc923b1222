#!/usr/bin/env bash
# Second call (same machine): DeepSeek-V2-Lite's fill rounds profiled (W1's prompts, 8 a fill);
# the latent decode's split count swept at W1's batch sizes; the MoE pair layout's chunk of
# large fills (Qwen3-30B-A3B's experts, ALIGN_LARGE_CHUNK 2048 as committed, 1024, 256 as
# before); DeepSeek B1.
set -u
R=$OUT/c2; mkdir -p $R
export PYTHONPATH=/tmp/site:$PWD
timeout 200 python3 benchmarks/profile_decode.py --shape deepseek-v2-lite --w1 --batch 8 \
  --steps 20 --timed-fills 4 --profile-fill > $R/profile_fill.log 2>&1
grep -v "^\s*$" $R/profile_fill.log | grep -v "^ .*site-packages\|{built-in\|{method\|^---" \
  | sed -E 's/ +/ /g' | cut -c1-150 | tail -60
timeout 100 python3 benchmarks/sweep_decode_ragged.py --mla --bs 128 200 256 --splits 1 2 3 4 6 \
  --warps 4 8 --stages 2 --block-n 32 --out $R/sweep_mla.json > $R/sweep_mla.log 2>&1; tail -30 $R/sweep_mla.log
SRT="latency:deepseek-v2-lite" TAG=x OUT=$R bash scripts/gpu_peer_run.sh 2>&1 | grep -v "^/" | tail -8
F=srt/layers/moe_triton.py
for c in 2048 1024 256; do
  sed -i "s/^ALIGN_LARGE_CHUNK = .*/ALIGN_LARGE_CHUNK = $c/" $F; grep "^ALIGN_LARGE_CHUNK" $F
  timeout 90 python3 benchmarks/bench_moe.py --experts 128 --top-k 8 --hidden 2048 --inter 768 \
    --tokens 64 512 1024 4096 8192 --breakdown --out $R/moe_align_$c.json > $R/moe_align_$c.log 2>&1
  tail -7 $R/moe_align_$c.log
done
sed -i "s/^ALIGN_LARGE_CHUNK = .*/ALIGN_LARGE_CHUNK = 2048/" $F
