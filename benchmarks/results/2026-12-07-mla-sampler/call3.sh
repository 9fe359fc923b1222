#!/usr/bin/env bash
# A later start, first call (vLLM part 1 over): DeepSeek-V2-Lite W1 as committed (the warm-up now compiles the
# expanded EXTEND kernels; latent decode at 3 programs an SM: TAG a) and with fills of up to
# 8,192 tokens while requests decode (TAG f).
set -u
R=$OUT/c3; mkdir -p $R
PART=1 SRT="offline:deepseek-v2-lite" TAG=a OUT=$R bash scripts/gpu_peer_run.sh 2>&1 | grep -v "^/" | tail -13
SRT="offline:deepseek-v2-lite" TAG=f SRT_ARGS="--max-fill-tokens-while-decoding 8192" OUT=$R \
  bash scripts/gpu_peer_run.sh 2>&1 | grep -v "^/" | tail -13
grep -h "warm-up requests served" $R/*.log | head -2
