"""Long context: the workloads of the peer script's `--long` mode (../shared/peer/vllm_bench.py)
through srt.Engine, for a ratio measured on the same GPU in the same lease.

    python3 benchmarks/bench_long.py --shape llama3-8b --out long.json
    python3 benchmarks/bench_long.py --shape llama3-8b --chunked-prefill-size 8192 \\
        --enable-mixed-chunk --out long_chunked.json   # any srt.ServerArgs flag passes through

The shape's config.json gets max_position_embeddings = `--context-length` (32768), weights are
random (`--load-format dummy`, bf16). `random.seed(3)`, then, drawn in this order as the peer
script does:
  W3: 64 prompts of 4096 `randint(0, 10000)` ids, 256 tokens out each (temperature 0.6,
      ignore_eos), all submitted at once: output tokens per second of wall time.
  T30: one prompt of 30,000 `randint(0, 10000)` ids, 1 token out (greedy): time to first token
      (the wall time of that request).
  D30: the same prompt again (now in the radix cache), 257 greedy tokens out: ms per token =
      wall / 257 (the peer script's definition: it includes the first token and the round trip).
One warm-up request ([1, 2, 3], 4 tokens out) comes first, as in the peer script.

Floors of the same run (copy bandwidth and matmul rate measured here; per rank with --tp-size):
  W3: bench_offline's `floor_seconds` (every request starts at once; per decode step
      max(bytes / bandwidth, FLOPs / rate), plus prefill FLOPs / rate);
  T30: max(prefill FLOPs / matmul rate, weight bytes / bandwidth), the prefill FLOPs being the
      weight matmuls of 30,000 tokens (the LM head of the last only) plus causal attention;
  D30: the mean over the 257 steps of (weight bytes + KV bytes of the context) / bandwidth.
`of_floor` is floor / measured time (1.0 = at the floor).

`--w3-prompts`, `--w3-input-len`, `--w3-output-len`, `--t30-len`, `--d30-output-len` shrink the
workload for a CPU smoke test (the ids are still drawn in full, then truncated), e.g.

    python3 benchmarks/bench_long.py --shape tiny --device cpu --dtype float32 \\
        --context-length 4096 --w3-prompts 4 --w3-input-len 128 --w3-output-len 8 \\
        --t30-len 1024 --d30-output-len 9
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from typing import Any

from benchmarks.bench_offline import floor_seconds
from benchmarks.common import Shape, add_engine_args, decode_step_times, device_rates, \
    hardware, parse_with_server_args, print_table, start_engine, write_json
from srt.model_process.step_timing import per_step_ms


def long_workload() -> tuple[list[list[int]], list[int]]:
    """W3's 64 prompts and T30's prompt, drawn exactly as the peer script's `--long` does."""
    random.seed(3)
    w3 = [[random.randint(0, 10000) for _ in range(4096)] for _ in range(64)]
    t30 = [random.randint(0, 10000) for _ in range(30000)]
    return w3, t30


def prefill_flops(shape: Shape, n: int) -> float:
    """FLOPs of one n-token prefill: the weight matmuls of every token but the LM head of only
    the last, plus causal attention (n^2 / 2 query-key pairs)."""
    head = shape.vocab * shape.hidden
    return 2 * (shape.matmul_params - head) * n + 2 * head + shape.attention_flops(n) * n / 2


def main() -> None:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n")[0])
    add_engine_args(p)
    p.add_argument("--context-length", type=int, default=32768,
                   help="max_position_embeddings of the shape's config.json")
    p.add_argument("--w3-prompts", type=int, default=64)
    p.add_argument("--w3-input-len", type=int, default=4096)
    p.add_argument("--w3-output-len", type=int, default=256)
    p.add_argument("--t30-len", type=int, default=30000)
    p.add_argument("--d30-output-len", type=int, default=257)
    p.add_argument("--skip", nargs="*", default=[], choices=["w3", "t30", "d30"],
                   help="workloads to leave out (d30 needs t30 before it to be cached)")
    a = parse_with_server_args(p)

    shape = Shape.of(a.shape)
    w3, t30 = long_workload()
    w3 = [x[: a.w3_input_len] for x in w3[: a.w3_prompts]]
    t30 = t30[: a.t30_len]
    if shape.vocab <= 10000:  # only the test shape: keep the ids inside its vocabulary
        w3 = [[t % shape.vocab for t in x] for x in w3]
        t30 = [t % shape.vocab for t in t30]
    bw, flops, _ = device_rates()  # (in a child: the engine sizes its pool from free memory)
    tp = a.tp_size
    weight_bytes = shape.params * 2 / tp
    kv_tok = shape.kv_bytes_per_token() / tp
    n30, d_out = len(t30), a.d30_output_len
    floors = {
        "w3": floor_seconds(shape, [len(x) for x in w3], [a.w3_output_len] * len(w3), bw, flops,
                            tp),
        "t30": max(prefill_flops(shape, n30) / tp / flops, weight_bytes / bw),
        "d30": sum((weight_bytes + kv_tok * (n30 + i)) / bw for i in range(d_out)) / d_out,
    }

    engine, startup = start_engine(a, shape_config={"max_position_embeddings": a.context_length},
                                   **a.server_args)
    rows: list[dict[str, Any]] = []
    res: dict[str, Any] = {}
    with engine:
        info = engine.model_info
        engine.generate(input_ids=[1, 2, 3], sampling_params={
            "max_new_tokens": 4, "temperature": 0, "ignore_eos": True})

        def gen(prompts: Any, params: Any) -> tuple[Any, float, dict]:
            before = decode_step_times(engine)
            t = time.perf_counter()
            outs = engine.generate(input_ids=prompts, sampling_params=params)
            wall = time.perf_counter() - t
            return outs, wall, per_step_ms(before, decode_step_times(engine))

        if "w3" not in a.skip:
            outs, wall, steps = gen(w3, {"temperature": 0.6, "ignore_eos": True,
                                         "max_new_tokens": a.w3_output_len})
            n = sum(o["meta_info"]["completion_tokens"] for o in outs)
            assert n == len(w3) * a.w3_output_len, n
            res.update(w3_s=wall, w3_out_tok_per_s=n / wall, w3_floor_s=floors["w3"],
                       w3_decode_step_ms=steps)
            rows.append({"workload": "W3", "requests": len(w3), "in_tokens": sum(map(len, w3)),
                         "out_tokens": n, "metric": "out_tok/s", "value": n / wall,
                         "wall_s": wall, "floor_s": floors["w3"], "of_floor": floors["w3"] / wall,
                         "cached": sum(o["meta_info"]["cached_tokens"] for o in outs)})
        if "t30" not in a.skip:
            out, wall, _ = gen(t30, {"temperature": 0, "ignore_eos": True, "max_new_tokens": 1})
            assert out["meta_info"]["completion_tokens"] == 1
            res.update(t30_ttft_s=wall, t30_floor_s=floors["t30"])
            rows.append({"workload": "T30", "requests": 1, "in_tokens": n30, "out_tokens": 1,
                         "metric": "ttft_s", "value": wall, "wall_s": wall,
                         "floor_s": floors["t30"], "of_floor": floors["t30"] / wall,
                         "cached": out["meta_info"]["cached_tokens"]})
        if "d30" not in a.skip:
            out, wall, steps = gen(t30, {"temperature": 0, "ignore_eos": True,
                                         "max_new_tokens": d_out})
            assert out["meta_info"]["completion_tokens"] == d_out
            ms = 1e3 * wall / d_out
            res.update(d30_ms_per_token=ms, d30_floor_ms=floors["d30"] * 1e3,
                       d30_cached_tokens=out["meta_info"]["cached_tokens"],
                       d30_decode_step_ms=steps)
            rows.append({"workload": "D30", "requests": 1, "in_tokens": n30, "out_tokens": d_out,
                         "metric": "ms/token", "value": ms, "wall_s": wall,
                         "floor_s": floors["d30"] * d_out, "of_floor": floors["d30"] * 1e3 / ms,
                         "cached": out["meta_info"]["cached_tokens"]})
    head = {"shape": a.shape, "tp": tp, "backend": info["attention_backend"],
            "cuda_graph": info["cuda_graph"], "kv_pool_tokens": info["max_total_num_tokens"],
            "startup_s": startup, "server_args": a.server_args}
    write_json(a.out, {"bench": "long", "argv": sys.argv, "hardware": hardware(),
                       "copy_bandwidth_Bps": bw, "matmul_flops": flops,
                       "context_length": a.context_length, **head, **res, "rows": rows})
    print(" ".join(f"{k}={v}" for k, v in head.items()))
    print_table(rows, ["workload", "requests", "in_tokens", "out_tokens", "cached", "metric",
                       "value", "wall_s", "floor_s", "of_floor"])


if __name__ == "__main__":
    main()
