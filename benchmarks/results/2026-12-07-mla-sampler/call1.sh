#!/usr/bin/env bash
# One call (srt alone): the one-pass sampler's and the expanded MLA EXTEND's kernel tests on the
# GPU; DeepSeek-V2-Lite W1 as committed (the expanded EXTEND on: TAG x) and without it (TAG n:
# EXPAND_MAX_PREFIX_TOKENS = 0); W1 with fills of up to 8,192 tokens while requests decode
# (TAG f); bench_sampler.
set -u
R=$OUT/c1; mkdir -p $R
OUT=$R bash scripts/gpu_peer_run.sh > $R/part.log 2>&1; tail -2 $R/part.log
export PYTHONPATH=/tmp/site:$PWD
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_sample_triton.py \
  tests/kernels/test_fresh_prefill.py > $R/tests.log 2>&1; tail -4 $R/tests.log
SRT="offline:deepseek-v2-lite" TAG=x OUT=$R bash scripts/gpu_peer_run.sh 2>&1 | grep -v "^/" | tail -14
F=srt/models/deepseek_v2.py
sed -i 's/^EXPAND_MAX_PREFIX_TOKENS = 32768$/EXPAND_MAX_PREFIX_TOKENS = 0/' $F; grep -n "^EXPAND_MAX" $F
SRT="offline:deepseek-v2-lite" TAG=n OUT=$R bash scripts/gpu_peer_run.sh 2>&1 | grep -v "^/" | tail -14
sed -i 's/^EXPAND_MAX_PREFIX_TOKENS = 0$/EXPAND_MAX_PREFIX_TOKENS = 32768/' $F; grep -n "^EXPAND_MAX" $F
SRT="offline:deepseek-v2-lite" TAG=f SRT_ARGS="--max-fill-tokens-while-decoding 8192" OUT=$R \
  bash scripts/gpu_peer_run.sh 2>&1 | grep -v "^/" | tail -14
timeout 60 python3 benchmarks/bench_sampler.py --out $R/sampler.json > $R/sampler.log 2>&1
tail -22 $R/sampler.log
