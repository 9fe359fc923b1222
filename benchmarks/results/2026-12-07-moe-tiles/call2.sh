#!/usr/bin/env bash
# Second call: vLLM part 2 over; srt W1 and B1 on both MoE shapes (tiles as patched by the
# caller, if at all: the command line shows the patch).
set -u
R=$OUT/c2; mkdir -p $R
git diff --stat; git diff srt/ | head -40
PART=2 SRT="offline:qwen3-30b-a3b offline:deepseek-v2-lite latency:qwen3-30b-a3b latency:deepseek-v2-lite" \
  TAG=${TAG:-b} OUT=$R bash scripts/gpu_peer_run.sh 2>&1 | grep -v "^/" | tail -80
