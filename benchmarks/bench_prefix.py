"""Prefix sharing, workload W2: many requests behind one long shared prefix.

    python3 benchmarks/bench_prefix.py --shape llama3-8b --mode both --out w2.json

`random.Random(0)`: one prefix of `--prefix-len` (2048) random token ids, then `--num-requests`
(512) requests, each the prefix followed by `--suffix-len` (64) random ids of its own, each
asking for `--output-len` (32) tokens with ignore_eos and temperature 0. One warm-up request
(an unrelated prompt), then all requests are submitted at once through `srt.Engine` (one
`generate` call with the list of input_ids; random bf16 weights).

Reported per run: wall time, requests/s, output and input tokens/s, and the cache hit rate:
the sum of `meta_info.cached_tokens` over the sum of `prompt_tokens`. `--mode both` runs a fresh
engine with the radix cache, then one with `--disable-radix-cache`, and prints the speedup.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from typing import Any

from benchmarks.common import Shape, add_engine_args, hardware, parse_with_server_args, \
    print_table, start_engine, write_json


def w2_workload(num: int, prefix_len: int, suffix_len: int, vocab: int,
                seed: int = 0) -> list[list[int]]:
    """num prompts: one shared random prefix, each with its own random suffix."""
    rng = random.Random(seed)
    prefix = [rng.randrange(2, vocab) for _ in range(prefix_len)]
    return [prefix + [rng.randrange(2, vocab) for _ in range(suffix_len)] for _ in range(num)]


def run_once(a: Any, prompts: list[list[int]], cache: bool) -> dict[str, Any]:
    """One fresh engine (radix cache on or off), the warm-up, then the timed batch."""
    engine, startup = start_engine(a, **{**a.server_args, "disable_radix_cache": not cache})
    rng = random.Random(1)
    with engine:
        info = engine.model_info
        warm = [rng.randrange(2, Shape.of(a.shape).vocab) for _ in range(32)]
        engine.generate(input_ids=warm, sampling_params={"max_new_tokens": 8, "ignore_eos": True})
        params = {"max_new_tokens": a.output_len, "ignore_eos": True, "temperature": 0}
        t = time.perf_counter()
        outs = engine.generate(input_ids=prompts, sampling_params=params)
        wall = time.perf_counter() - t
    meta = [o["meta_info"] for o in outs]
    produced = sum(m["completion_tokens"] for m in meta)
    assert produced == a.output_len * len(prompts), produced
    prompt_tokens = sum(m["prompt_tokens"] for m in meta)
    cached = sum(m["cached_tokens"] for m in meta)
    return {
        "radix_cache": cache, "shape": a.shape, "tp": a.tp_size,
        "backend": info["attention_backend"], "quant": info["quantization"] or "-",
        "kv": info["kv_cache_dtype"], "cuda_graph": info["cuda_graph"],
        "requests": len(prompts), "wall_s": wall, "req_per_s": len(prompts) / wall,
        "out_tok_per_s": produced / wall, "in_tok_per_s": prompt_tokens / wall,
        "cache_hit_rate": cached / prompt_tokens, "cached_tokens": cached,
        "prompt_tokens": prompt_tokens, "output_tokens": produced,
        "kv_pool_tokens": info["max_total_num_tokens"], "startup_s": startup,
    }


def main() -> None:
    p = argparse.ArgumentParser()
    add_engine_args(p)
    p.add_argument("--mode", default="both", choices=["both", "cache", "nocache"])
    p.add_argument("--num-requests", type=int, default=512)
    p.add_argument("--prefix-len", type=int, default=2048)
    p.add_argument("--suffix-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=32)
    a = parse_with_server_args(p)

    prompts = w2_workload(a.num_requests, a.prefix_len, a.suffix_len, Shape.of(a.shape).vocab)
    runs = [run_once(a, prompts, cache) for cache in
            {"both": (True, False), "cache": (True,), "nocache": (False,)}[a.mode]]
    cols = ["radix_cache", "shape", "tp", "backend", "requests", "wall_s", "req_per_s",
            "out_tok_per_s", "in_tok_per_s", "cache_hit_rate", "startup_s"]
    print_table(runs, cols)
    speedup = None
    if len(runs) == 2:
        speedup = runs[1]["wall_s"] / runs[0]["wall_s"]
        print(f"radix cache speedup (wall without / wall with): {speedup:.2f}x")
    write_json(a.out, {"bench": "prefix_w2", "argv": sys.argv, "hardware": hardware(),
                       "num_requests": a.num_requests, "prefix_len": a.prefix_len,
                       "suffix_len": a.suffix_len, "output_len": a.output_len,
                       "runs": runs, "cache_speedup": speedup})


if __name__ == "__main__":
    main()
