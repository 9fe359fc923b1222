#!/usr/bin/env bash
# Second call: vLLM part 2 over; DeepSeek-V2-Lite W1 without the expanded EXTEND (TAG n:
# EXPAND_MAX_PREFIX_TOKENS = 0), then as committed: DeepSeek B1, Qwen3-30B-A3B W1 and B1.
set -u
R=$OUT/c2; mkdir -p $R
F=srt/models/deepseek_v2.py
sed -i 's/^EXPAND_MAX_PREFIX_TOKENS = 32768$/EXPAND_MAX_PREFIX_TOKENS = 0/' $F; grep -n "^EXPAND_MAX" $F
PART=2 SRT="offline:deepseek-v2-lite" TAG=n OUT=$R bash scripts/gpu_peer_run.sh 2>&1 | grep -v "^/" | tail -14
sed -i 's/^EXPAND_MAX_PREFIX_TOKENS = 0$/EXPAND_MAX_PREFIX_TOKENS = 32768/' $F; grep -n "^EXPAND_MAX" $F
BUDGET=300 SRT="latency:deepseek-v2-lite offline:qwen3-30b-a3b latency:qwen3-30b-a3b" TAG=x OUT=$R \
  bash scripts/gpu_peer_run.sh 2>&1 | grep -v "^/" | tail -40
