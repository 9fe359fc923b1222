"""Batch-1 decode latency: time per output token against the weight floor.

    python3 benchmarks/bench_latency.py --shape llama3-8b --tp-size 2 --out lat.json

One request of `--input-len` random token ids and `--output-len` output tokens (ignore_eos) at a
time, through `srt.Engine` with `--load-format dummy` in bf16. Time per output token is
(time of the full request - time of a 1-token request) / (output_len - 1), the median over
`--runs` fresh prompts, so prefill and the round trip are not counted. The floor is the weight
bytes each rank reads per step over the copy bandwidth measured in the same run.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time

from benchmarks.common import Shape, add_engine_args, device_rates, hardware, \
    parse_with_server_args, print_table, start_engine, write_json


def main() -> None:
    p = argparse.ArgumentParser()
    add_engine_args(p)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=512)
    p.add_argument("--runs", type=int, default=3)
    a = parse_with_server_args(p)

    bw, _, _ = device_rates()  # (in a child: the engine sizes its pool from free memory)
    shape = Shape.of(a.shape)
    rng = random.Random(0)
    engine, startup = start_engine(a, **a.server_args)
    with engine:
        info = engine.model_info

        def run(n_out: int) -> float:
            ids = [rng.randrange(2, shape.vocab) for _ in range(a.input_len)]
            t = time.perf_counter()
            out = engine.generate(input_ids=ids, sampling_params={
                "max_new_tokens": n_out, "ignore_eos": True, "temperature": 0})
            assert out["meta_info"]["completion_tokens"] == n_out
            return time.perf_counter() - t

        run(a.output_len)  # warm-up
        per_token = []
        ttft = []
        for _ in range(a.runs):
            t1 = run(1)
            tn = run(a.output_len)
            ttft.append(t1)
            per_token.append((tn - t1) / (a.output_len - 1))
    weight_bytes = info["weight_bytes_per_rank"]
    floor_ms = weight_bytes / bw * 1e3
    ms = statistics.median(per_token) * 1e3
    row = {
        "shape": a.shape, "tp": a.tp_size, "backend": info["attention_backend"],
        "quant": info["quantization"] or "-", "kv": info["kv_cache_dtype"],
        "cuda_graph": info["cuda_graph"], "ms_per_token": ms,
        "tokens_per_s": 1e3 / ms, "floor_ms": floor_ms, "x_floor": ms / floor_ms,
        "ttft_ms": statistics.median(ttft) * 1e3, "startup_s": startup,
    }
    print_table([row], list(row))
    write_json(a.out, {"bench": "latency", "argv": sys.argv, "hardware": hardware(),
                       "copy_bandwidth_Bps": bw, "weight_bytes_per_rank": weight_bytes,
                       "per_token_s_runs": per_token, **row})


if __name__ == "__main__":
    main()
