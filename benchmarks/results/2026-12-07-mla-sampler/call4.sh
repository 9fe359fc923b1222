#!/usr/bin/env bash
# Second call: vLLM part 2 over; DeepSeek-V2-Lite B1.
set -u
R=$OUT/c4; mkdir -p $R
PART=2 SRT="latency:deepseek-v2-lite" TAG=a OUT=$R bash scripts/gpu_peer_run.sh 2>&1 | grep -v "^/" | tail -8
