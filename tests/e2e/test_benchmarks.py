"""The prefix-sharing and serving benchmarks run end to end at tiny sizes on the CPU (the `tiny`
shape, random weights) and write JSON whose figures agree with the workload they ran."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

from tests.conftest import REPO

CPU = ["--shape", "tiny", "--device", "cpu", "--dtype", "float32", "--attention-backend",
       "torch", "--max-total-tokens", "4096"]


def run_bench(script: str, args: list[str], out: str, timeout: float = 240) -> dict[str, Any]:
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, f"benchmarks/{script}", *CPU, *args, "--out", out],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    with open(out) as f:
        return json.load(f)


def test_bench_prefix_cache_and_nocache(tmp_path: Any) -> None:
    # One fill batch holds a single request (100 new tokens), so the 7 later requests find the
    # 64-token prefix in the tree: hit rate 7 * 64 / (8 * 72) = 0.78 with the cache.
    data = run_bench("bench_prefix.py", [
        "--mode", "both", "--num-requests", "8", "--prefix-len", "64", "--suffix-len", "8",
        "--output-len", "4", "--max-prefill-tokens", "100"], str(tmp_path / "w2.json"))
    cache, nocache = data["runs"]
    assert cache["radix_cache"] is True and nocache["radix_cache"] is False
    for run in (cache, nocache):
        assert run["requests"] == 8 and run["output_tokens"] == 32
        assert run["prompt_tokens"] == 8 * 72
        assert run["req_per_s"] > 0 and run["out_tok_per_s"] > 0
    assert cache["cache_hit_rate"] > 0.5
    assert cache["cached_tokens"] <= 7 * 64
    assert nocache["cache_hit_rate"] == 0.0
    assert data["cache_speedup"] == nocache["wall_s"] / cache["wall_s"]


def test_bench_serving_launch_and_engine(tmp_path: Any) -> None:
    data = run_bench("bench_serving.py", [
        "--launch", "--num-prompts", "6", "--input-len", "16", "--output-len", "5",
        "--max-concurrency", "3", "--request-rate", "inf", "--compare-engine", "--no-progress"],
        str(tmp_path / "serving.json"))
    (run,) = data["runs"]
    assert run["max_concurrency"] == 3 and run["endpoint"] == "generate"
    assert run["completed"] == 6 and run["failed"] == 0
    assert run["output_tokens"] == 30 and run["input_tokens"] == 96
    assert 0 < run["ttft_ms_p50"] <= run["e2e_ms_p50"]
    assert run["ttft_ms_p50"] <= run["ttft_ms_p90"] <= run["ttft_ms_p99"]
    assert run["itl_ms_p50"] > 0 and run["tpot_ms_p50"] > 0
    assert run["out_tok_per_s"] > 0 and run["req_per_s"] > 0
    assert run["engine"]["completed"] == 6 and run["engine"]["output_tokens"] == 30
    assert run["http_over_engine"] == run["out_tok_per_s"] / run["engine"]["out_tok_per_s"]
    assert data["server"]["attention_backend"] == "torch"
    assert data["server"]["gc"]["frozen_objects"] > 0  # the model process froze its start-up heap
    assert len(run["client_gc_collections"]) == 3 and run["client_gc_pause_ms_max"] >= 0
