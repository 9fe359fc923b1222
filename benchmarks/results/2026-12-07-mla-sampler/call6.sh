#!/usr/bin/env bash
# A later start: Qwen3-30B-A3B W1 with the MoE default of 8,192-token fills while decoding (TAG m)
# and with the old 4,096 (TAG q), one after the other on the same machine.
set -u
R=$OUT/c6; mkdir -p $R
SRT="offline:qwen3-30b-a3b" TAG=m OUT=$R bash scripts/gpu_peer_run.sh 2>&1 | grep -v "^/" | grep -A14 "where the wall"
SRT="offline:qwen3-30b-a3b" TAG=q SRT_ARGS="--max-fill-tokens-while-decoding 4096" OUT=$R \
  bash scripts/gpu_peer_run.sh 2>&1 | grep -v "^/" | grep -A14 "where the wall"
grep -h "out_tok_per_s" $R/*.json | head -0; for f in $R/*.json; do python3 -c "import json;d=json.load(open('$f'));print('$f'.split('/')[-1],d['wall_s'],d['out_tok_per_s'])"; done
