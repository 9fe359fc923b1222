"""Offline throughput, workload W1: the nano-vllm / mini-sglang offline benchmark.

    python3 benchmarks/bench_offline.py --shape llama3-8b --tp-size 1 --out w1.json

`random.seed(0)`; 256 prompts of `randint(0, 10000)` token ids with lengths `randint(100, 1024)`;
then 256 output lengths `randint(100, 1024)` (sum 133,966); temperature 0.6, ignore_eos; one
warm-up request; all submitted at once through `srt.Engine` (`--load-format dummy`, bf16).
Reports output tokens per second of wall time and the floor of the same run: for a schedule where
every request starts at once, the sum over decode steps of max((weight bytes + KV bytes of all
live contexts) / copy bandwidth, FLOPs / matmul rate), plus prefill FLOPs / matmul rate, with
both rates measured here (per rank for --tp-size > 1: each rank holds 1/tp of weights, KV and
FLOPs). The weight bytes are what the engine holds per rank (int4 / FP8 weights count as
such), the KV bytes per token those of the pool's dtype, and with `--quantization fp8` the
linear layers' FLOPs go at the FP8 `_scaled_mm` rate, also measured here.

Also printed: the host time per decode step by batch-size bucket during the run (rank 0's
phase counters, `srt/model_process/step_timing.py`), and the run's longest model-loop rounds
(`slow_rounds` of `/get_server_info`: a Triton compile inside the run shows as a round of
seconds). `--compare-hf` then runs the first
`--hf-requests` prompts (each `--hf-output-len` tokens out, ignore_eos, temperature 0.6) through
srt and through transformers' continuous batching (`generate_batch`, the same random-weight
shape), and prints the throughput ratio. `--input-len-cap` / `--output-len-cap` shrink the
workload for a CPU smoke test. `--lora N [--lora-rank R]`: N random adapters of rank R on all 7
projections (`write_lora_adapters`, as the peer kit's `vllm_bench.py --lora`), request k under
adapter k mod N (the floor is the base model's).
"""

from __future__ import annotations

import argparse
import random
import sys
import time

import torch

from benchmarks.common import Shape, add_engine_args, copy_bandwidth, decode_step_times, \
    fp8_matmul_rate, hardware, matmul_rate, parse_with_server_args, print_table, \
    slow_rounds_since, start_engine, write_json, write_lora_adapters
from benchmarks.hf_baseline import run_hf_generate_batch
from srt.model_process.step_timing import PHASES, per_step_ms

W1_OUTPUT_TOKENS = 133_966


def w1_workload(num: int = 256) -> tuple[list[list[int]], list[int]]:
    random.seed(0)
    prompts = [[random.randint(0, 10000) for _ in range(random.randint(100, 1024))]
               for _ in range(num)]
    out_lens = [random.randint(100, 1024) for _ in range(num)]
    return prompts, out_lens


def floor_seconds(shape: Shape, in_lens: list[int], out_lens: list[int], bw: float,
                  flops: float, tp: int = 1, *, weight_bytes: float | None = None,
                  kv_itemsize: int = 2, linear_flops: float | None = None) -> float:
    """Lower bound on the wall time (see the module docstring). `weight_bytes`: per rank
    (default: bf16 weights); `kv_itemsize`: bytes per KV element; `linear_flops`: the rate
    of the linear layers' products (default `flops`, which attention always uses)."""
    weight_bytes = shape.params * 2 / tp if weight_bytes is None else weight_bytes
    linear_flops = linear_flops or flops
    kv_tok = shape.kv_bytes_per_token(kv_itemsize) / tp

    def compute_s(tokens: int, attn_flops: float) -> float:
        return (2 * shape.matmul_params * tokens / linear_flops + attn_flops / flops) / tp

    total = sum(compute_s(n, shape.attention_flops(n) * n / 2) for n in in_lens)  # prefill
    for step in range(max(out_lens)):
        live = [(i, o) for i, o in zip(in_lens, out_lens) if o > step]
        ctx = sum(i + step for i, _ in live)
        mem = (weight_bytes + kv_tok * ctx) / bw
        total += max(mem, compute_s(len(live), shape.attention_flops(1) * ctx))
    return total


def print_step_times(steps: dict) -> None:
    """The per-bucket table of `per_step_ms`."""
    cols = ["batch", "steps", "mean_batch", "gpu_idle_ms", "host_ms", "gap_ms", "prepare_ms",
            "forward_ms", "sample_prep_ms", "sample_ms", "wait_ms", "post_ms"]
    rows = [{"batch": f"<={b}", **v} for b, v in steps["by_batch"].items()]
    if steps["total"] is not None:
        rows.append({"batch": "all", **steps["total"]})
    print("decode steps, ms per step (gpu_idle: the device's idle time before a step, from CUDA "
          "events; host = gap + prepare + sample_prep + post):")
    print_table(rows, cols)


def wall_split(wall: float, steps: dict) -> dict:
    """The run's wall time cut into fill rounds, decode steps and the rest (round trips between
    processes, queueing, results)."""
    t = steps["total"]
    decode = t["steps"] * sum(t[f"{p}_ms"] for p in PHASES) / 1e3 if t else 0.0
    f = steps["fills"]
    return {"wall_s": wall, "fill_s": f["seconds"], "fill_rounds": f["rounds"],
            "fill_tokens": f["tokens"], "fill_tok_per_s": f["tokens_per_s"],
            "decode_s": decode, "decode_steps": t["steps"] if t else 0,
            "other_s": wall - f["seconds"] - decode}


def srt_fixed_len(engine: object, prompts: list[list[int]], out_len: int) -> dict:
    """The `--compare-hf` workload through srt: every prompt at once, out_len tokens each."""
    params = {"temperature": 0.6, "ignore_eos": True, "max_new_tokens": out_len}
    t = time.perf_counter()
    outs = engine.generate(input_ids=prompts, sampling_params=params)
    wall = time.perf_counter() - t
    tokens = sum(o["meta_info"]["completion_tokens"] for o in outs)
    return {"requests": len(prompts), "output_tokens": tokens, "wall_s": wall,
            "out_tok_per_s": tokens / wall}


def main() -> None:
    p = argparse.ArgumentParser()
    add_engine_args(p)
    p.add_argument("--num-prompts", type=int, default=256)
    p.add_argument("--input-len-cap", type=int, default=None, help="truncate prompts (smoke)")
    p.add_argument("--output-len-cap", type=int, default=None, help="cap outputs (smoke)")
    p.add_argument("--compare-hf", action="store_true",
                   help="also run the first --hf-requests prompts through transformers")
    p.add_argument("--hf-requests", type=int, default=64)
    p.add_argument("--hf-output-len", type=int, default=520)
    p.add_argument("--lora", type=int, default=0, help="random LoRA adapters over the requests")
    p.add_argument("--lora-rank", type=int, default=16)
    a = parse_with_server_args(p)

    prompts, out_lens = w1_workload(a.num_prompts)
    if a.num_prompts == 256:
        assert sum(out_lens) == W1_OUTPUT_TOKENS, sum(out_lens)
    vocab = Shape.of(a.shape).vocab
    if vocab <= 10000:  # only the test shape: keep W1's ids inside its vocabulary
        prompts = [[t % vocab for t in x] for x in prompts]
    if a.input_len_cap:
        prompts = [x[: a.input_len_cap] for x in prompts]
    if a.output_len_cap:
        out_lens = [min(n, a.output_len_cap) for n in out_lens]
    shape = Shape.of(a.shape)
    hf_prompts = prompts[: a.hf_requests]
    lora: dict = {}
    if a.lora:
        import tempfile

        paths = write_lora_adapters(a.shape, a.lora, a.lora_rank, tempfile.mkdtemp())
        lora = {"lora_paths": tuple(f"adapter{k}={p}" for k, p in enumerate(paths)),
                "max_loras_per_batch": a.lora}
    engine, startup = start_engine(a, **{**a.server_args, **lora})
    with engine:
        info = engine.model_info
        engine.generate(input_ids=[1, 2, 3, 4, 5], sampling_params={"max_new_tokens": 16})
        params = [{"temperature": 0.6, "ignore_eos": True, "max_new_tokens": n}
                  for n in out_lens]
        before = decode_step_times(engine)
        began = time.time()  # (the model loop stamps its slow rounds with the wall clock)
        t = time.perf_counter()
        names = {"lora_path": [f"adapter{k % a.lora}" for k in range(len(prompts))]} \
            if a.lora else {}
        outs = engine.generate(input_ids=prompts, sampling_params=params, **names)
        wall = time.perf_counter() - t
        steps = per_step_ms(before, decode_step_times(engine))
        slow = slow_rounds_since(engine, began)
        fill_waits = engine.get_server_info()["fill_wait_steps"]
        srt_hf = srt_fixed_len(engine, hf_prompts, a.hf_output_len) if a.compare_hf else None
    # The floor's rates, measured once the engine is gone: the engine sizes its KV pool from
    # the device's free memory, and this process's CUDA context and what its measurements
    # left behind took 2.6 GiB of it on one H100 (a fifth of Qwen3-30B-A3B's pool).
    bw, flops = copy_bandwidth(), matmul_rate()
    fp8_flops = (fp8_matmul_rate() if torch.cuda.is_available()
                 and a.server_args.get("quantization") == "fp8" else None)
    produced = sum(o["meta_info"]["completion_tokens"] for o in outs)
    assert produced == sum(out_lens), (produced, sum(out_lens))
    floor = floor_seconds(shape, [len(x) for x in prompts], out_lens, bw, flops, a.tp_size,
                          weight_bytes=info["weight_bytes_per_rank"],
                          kv_itemsize=getattr(torch, info["kv_cache_dtype"]).itemsize,
                          linear_flops=fp8_flops)
    row = {
        "shape": a.shape, "tp": a.tp_size, "backend": info["attention_backend"],
        "quant": info["quantization"] or "-", "kv": info["kv_cache_dtype"],
        "cuda_graph": info["cuda_graph"], "lora": f"{a.lora} x r{a.lora_rank}" if a.lora else "-",
        "requests": len(prompts), "output_tokens": produced,
        "wall_s": wall, "out_tok_per_s": produced / wall, "floor_s": floor,
        "of_floor": floor / wall, "kv_pool_tokens": info["max_total_num_tokens"],
        "startup_s": startup,
        "host_ms_per_step": steps["total"]["host_ms"] if steps["total"] else None,
        "gpu_idle_ms_per_step": steps["total"]["gpu_idle_ms"] if steps["total"] else None,
    }
    print_table([row], list(row))
    print_step_times(steps)
    split = wall_split(wall, steps)
    split["fill_wait_steps"] = fill_waits  # decode steps small fills waited for more requests
    print("where the wall time went:")
    print_table([split], list(split))
    if slow["longest"]:
        print(f"the run's longest rounds ({slow['kept']} of the kept ones over "
              f"{slow['threshold_ms']:.0f} ms):")
        print_table(slow["longest"], ["ms", "kind", "fill_tokens", "running"])
    compare = None
    if srt_hf is not None:
        hf = run_hf_generate_batch(a.shape, hf_prompts, a.hf_output_len, a.dtype)
        compare = {"srt": srt_hf, "hf": hf,
                   "srt_over_hf": srt_hf["out_tok_per_s"] / hf["out_tok_per_s"]}
        print(f"first {len(hf_prompts)} prompts, {a.hf_output_len} tokens out each:")
        print_table([{"runtime": "srt", **srt_hf}, {"runtime": "transformers", **hf}],
                    ["runtime", "requests", "output_tokens", "wall_s", "out_tok_per_s"])
        print(f"srt / transformers generate_batch: {compare['srt_over_hf']:.2f}x")
    write_json(a.out, {"bench": "offline_w1", "argv": sys.argv, "hardware": hardware(),
                       "copy_bandwidth_Bps": bw, "matmul_flops": flops,
                       "fp8_matmul_flops": fp8_flops, **row,
                       "decode_step_ms": steps, "wall_split": split, "slow_rounds": slow,
                       "compare_hf": compare})


if __name__ == "__main__":
    main()
