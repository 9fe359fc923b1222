#!/usr/bin/env bash
# Second call (same machine): DeepSeek-V2-Lite's fill rounds profiled (W1's prompts, 8 a fill);
# the latent decode's split count swept at W1's batch sizes; DeepSeek B1.
set -u
R=$OUT/c2; mkdir -p $R
export PYTHONPATH=/tmp/site:$PWD
timeout 200 python3 benchmarks/profile_decode.py --shape deepseek-v2-lite --w1 --batch 8 \
  --steps 20 --timed-fills 4 --profile-fill > $R/profile_fill.log 2>&1
grep -v "^\s*$" $R/profile_fill.log | grep -v "^ .*site-packages\|{built-in\|{method" | tail -75
timeout 100 python3 benchmarks/sweep_decode_ragged.py --mla --bs 128 200 256 --splits 1 2 3 4 6 \
  --warps 4 8 --stages 2 --out $R/sweep_mla.json > $R/sweep_mla.log 2>&1; tail -30 $R/sweep_mla.log
SRT="latency:deepseek-v2-lite" TAG=x OUT=$R bash scripts/gpu_peer_run.sh 2>&1 | grep -v "^/" | tail -8
