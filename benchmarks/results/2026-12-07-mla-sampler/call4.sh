#!/usr/bin/env bash
# Second call of that start: vLLM part 2 over; DeepSeek-V2-Lite B1 and Qwen3-30B-A3B W1 and B1.
set -u
R=$OUT/c4; mkdir -p $R
PART=2 SRT="latency:deepseek-v2-lite offline:qwen3-30b-a3b latency:qwen3-30b-a3b" TAG=a OUT=$R \
  bash scripts/gpu_peer_run.sh 2>&1 | grep -v "^/" | tail -40
