#!/usr/bin/env bash
# Third call: vLLM part 3 over and installed; vLLM 0.26.0 W1, B1, W2 on both MoE shapes
# (experts drawn at random, as srt's random router weights do).
set -u
R=$OUT/c5; mkdir -p $R
PART=3 VLLM="deepseek-v2-lite qwen3-30b-a3b" \
  VLLM_EXTRA_ENV=VLLM_MOE_ROUTING_SIMULATION_STRATEGY=uniform_random TAG=a OUT=$R \
  bash scripts/gpu_peer_run.sh 2>&1 | grep -v "^/" | tail -40
