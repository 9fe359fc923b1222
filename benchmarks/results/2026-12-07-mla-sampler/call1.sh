#!/usr/bin/env bash
# First call of the sitting: vLLM part 1 over; the one-pass sampler's and the expanded MLA
# EXTEND's kernel tests on the GPU; bench_sampler; DeepSeek-V2-Lite W1 as committed (the
# expanded EXTEND on: TAG x); the latent decode's split count at W1's batch sizes.
set -u
R=$OUT/c1; mkdir -p $R
PART=1 OUT=$R bash scripts/gpu_peer_run.sh > $R/part.log 2>&1; tail -2 $R/part.log
export PYTHONPATH=/tmp/site:$PWD
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_sample_triton.py \
  tests/kernels/test_fresh_prefill.py > $R/tests.log 2>&1; tail -4 $R/tests.log
timeout 90 python3 benchmarks/bench_sampler.py --out $R/sampler.json > $R/sampler.log 2>&1
tail -22 $R/sampler.log
SRT="offline:deepseek-v2-lite" TAG=x OUT=$R bash scripts/gpu_peer_run.sh 2>&1 | grep -v "^/" | tail -14
timeout 120 python3 benchmarks/sweep_decode_ragged.py --mla --bs 128 200 256 --splits 1 2 3 4 6 \
  --warps 4 8 --stages 2 --out $R/sweep_mla.json > $R/sweep_mla.log 2>&1; tail -30 $R/sweep_mla.log
