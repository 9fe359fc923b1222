"""Where a decode step's time goes: the model process of each TP rank driven directly.

    python3 benchmarks/profile_decode.py --shape llama3-8b --batch 1 --steps 200 [--tp-size 2]
        [--awq-group-size 128 | --quantization fp8] [--kv-cache-dtype fp8_e4m3]

Starts a ModelProcess on the shape with random weights, fills `--batch` requests of
`--input-len` tokens, then times `--steps` decode steps: wall time per step, the GPU time per step
(sum of kernel times under torch.profiler), the top host functions (cProfile) and the top GPU
kernels. Host time that the GPU waits on shows up as wall time minus GPU time. With
`--tp-size N`, N processes step their ranks in lockstep and rank 0 reports (all-reduces appear
among its kernels).
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import gc
import io
import logging
import pstats
import random
import tempfile
import time
from typing import Any, Callable

import torch

from benchmarks.common import Shape, awq_config, write_lora_adapters, write_shape_dir


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--shape", default="llama3-8b")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--attention-backend", default="auto")
    p.add_argument("--disable-cuda-graph", action="store_true")
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--awq-group-size", type=int, default=0, metavar="G",
                   help="random AWQ int4 weights with this group size; 0: bf16")
    p.add_argument("--quantization", default=None, choices=["fp8"],
                   help="fp8: the random bf16 weights quantized at load")
    p.add_argument("--kv-cache-dtype", default="auto")
    p.add_argument("--tp-size", type=int, default=1)
    p.add_argument("--w1", action="store_true",
                   help="fill the first --batch prompts of workload W1 (lengths 100-1024), "
                   "sampled at temperature 0.6, instead of --input-len random tokens, greedy")
    p.add_argument("--profile-fill", action="store_true",
                   help="also print the GPU kernels of the fill rounds (torch.profiler)")
    p.add_argument("--lora", type=int, default=0, metavar="N",
                   help="N random LoRA adapters (write_lora_adapters), request k under adapter "
                   "k mod N")
    p.add_argument("--lora-rank", type=int, default=16)
    p.add_argument("--memory", action="store_true",
                   help="print where the device memory went after start-up: weights, KV pool, "
                   "the largest other live tensors, the allocator's cache and the rest")
    p.add_argument("--timed-fills", type=int, default=0, metavar="N",
                   help="before everything else, N fills of --batch other prompts (W1's with "
                   "--w1) that each stop after one token, timed apart without profilers: "
                   "the wall time of a fill once its kernels are compiled")
    p.add_argument("--fills-while-decoding", type=int, default=0, metavar="N",
                   help="at the end, while the --batch requests decode: N fills of "
                   "--fill-batch new prompts (W1's with --w1) that stop after one token, "
                   "plain and then mixed (--enable-mixed-chunk), each followed by a decode "
                   "step; prints each round's wall time and the GPU kernel time of the last")
    p.add_argument("--fill-batch", type=int, default=2)
    p.add_argument("--warm-fills", type=int, default=0, metavar="N",
                   help="before the profiled fill, N one-token requests of other random "
                   "tokens run to the end (so the profiled fill is a warm one)")
    a = p.parse_args()
    model_dir = write_shape_dir(a.shape, tempfile.mkdtemp(prefix="srt-prof-"),
                                **awq_config(a.awq_group_size))
    if a.tp_size == 1:
        run_rank(0, a, model_dir, None)
    else:
        import socket

        import torch.multiprocessing as mp

        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        mp.spawn(run_rank, args=(a, model_dir, port), nprocs=a.tp_size)


def memory_report(server) -> None:
    """Device memory after start-up (pool sized, graphs captured): weights, KV pool, the other
    live tensors grouped by shape and dtype (the largest first), the caching allocator's unused
    blocks, and what no tensor explains (the CUDA context, libraries' workspaces)."""
    if not torch.cuda.is_available():
        return
    gib = 1 << 30
    free, total = torch.cuda.mem_get_info()
    params = {p.data_ptr() for p in server.runner.model.parameters()}
    weights = server.runner.weight_bytes
    groups: dict[tuple, list[int]] = {}
    seen: set[int] = set()
    for obj in gc.get_objects():
        try:
            if not (isinstance(obj, torch.Tensor) and obj.is_cuda):
                continue
            ptr = obj.untyped_storage().data_ptr()
        except Exception:  # noqa: BLE001 - some objects fail isinstance / storage queries
            continue
        if ptr in params or ptr in seen:
            continue
        seen.add(ptr)
        key = (tuple(obj.shape), str(obj.dtype))
        groups.setdefault(key, [0, 0])
        groups[key][0] += 1
        groups[key][1] += obj.untyped_storage().nbytes()
    other = sum(n for _, n in groups.values())
    alloc, reserved = torch.cuda.memory_allocated(), torch.cuda.memory_reserved()
    print(f"memory: total {total / gib:.2f} GiB, used {(total - free) / gib:.2f} GiB = "
          f"weights {weights / gib:.2f} + other live tensors {other / gib:.2f} (KV pool "
          f"{server.runner.max_total_num_tokens} tokens among them) + allocator cache "
          f"{(reserved - alloc) / gib:.2f} + outside torch's allocator "
          f"{(total - free - reserved) / gib:.2f} (allocated {alloc / gib:.2f}, weights and "
          f"tensors found {(weights + other) / gib:.2f}: the rest are graph pools' blocks)")
    top = sorted(groups.items(), key=lambda kv: -kv[1][1])[:15]
    for (shape, dtype), (count, nbytes) in top:
        print(f"  {nbytes / gib:8.3f} GiB  {count:4d} x {shape} {dtype}")


def timed_fills(server: Any, a: argparse.Namespace, rng: random.Random, rank: int) -> None:
    """--timed-fills: fills of --batch prompts each (W1's from prompt 256 on with --w1, else
    random), every request stopping after its first token; prints each fill's wall time."""
    from srt.managers.io_struct import StepInput, TokenizedGenerateReq

    vocab = Shape.of(a.shape).vocab
    if a.w1:
        from benchmarks.bench_offline import w1_workload

        pool = w1_workload(256 + a.batch * a.timed_fills)[0][256:]
    times, tokens = [], []
    for i in range(a.timed_fills):
        prompts = ([[t % vocab for t in x] for x in pool[i * a.batch:(i + 1) * a.batch]]
                   if a.w1 else [[rng.randrange(2, vocab) for _ in range(a.input_len)]
                                 for _ in range(a.batch)])
        reqs = [TokenizedGenerateReq(f"t{i}.{j}", x, {"temperature": 0.0, "max_new_tokens": 1,
                                                       "ignore_eos": True})
                for j, x in enumerate(prompts)]
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        t = time.perf_counter()
        server.step(StepInput(reqs=reqs))
        while server.waiting or server.running:
            server.step(StepInput())
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        times.append((time.perf_counter() - t) * 1e3)
        tokens.append(sum(len(x) for x in prompts))
    if rank == 0:
        print("timed fills (ms, tokens): " + ", ".join(
            f"{t:.1f} ({n})" for t, n in zip(times, tokens)))


def run_rank(rank: int, a: argparse.Namespace, model_dir: str, port: int | None) -> None:
    from srt.managers.io_struct import StepInput, TokenizedGenerateReq
    from srt.model_process.loop import ModelProcess
    from srt.server_args import ServerArgs

    shape = Shape.of(a.shape)
    lora = {}
    if a.lora:
        paths = write_lora_adapters(a.shape, a.lora, a.lora_rank, tempfile.mkdtemp())
        lora = {"lora_paths": tuple(f"adapter{k}={p}" for k, p in enumerate(paths)),
                "max_loras_per_batch": a.lora}
    args = ServerArgs(**lora, model_path=model_dir, tokenizer_path=model_dir, load_format="dummy",
                      dtype="bfloat16", attention_backend=a.attention_backend,
                      disable_cuda_graph=a.disable_cuda_graph,
                      cuda_graph_max_bs=max(a.batch, 1), random_seed=0, tp_size=a.tp_size,
                      quantization=a.quantization, kv_cache_dtype=a.kv_cache_dtype)
    if a.lora:
        args = args.resolve()  # the pool's rank and targets from the adapters
    if rank == 0:
        logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    server = ModelProcess(args, rank, port)
    if rank == 0 and a.memory:
        memory_report(server)
    rng = random.Random(0)
    if a.w1:
        from benchmarks.bench_offline import w1_workload

        prompts = [[t % shape.vocab for t in x] for x in w1_workload(256)[0][: a.batch]]
    else:
        prompts = [[rng.randrange(2, shape.vocab) for _ in range(a.input_len)]
                   for _ in range(a.batch)]
    reqs = [TokenizedGenerateReq(f"p{i}", x,
                                 {"temperature": 0.6 if a.w1 else 0.0,
                                  "max_new_tokens": 3 * a.steps + 100, "ignore_eos": True},
                                 lora_id=1 + i % a.lora if a.lora else 0)
            for i, x in enumerate(prompts)]
    if a.timed_fills:
        timed_fills(server, a, rng, rank)
    for i in range(a.warm_fills):
        warm = [rng.randrange(2, shape.vocab) for _ in range(a.input_len)]
        server.step(StepInput(reqs=[TokenizedGenerateReq(f"w{i}", warm, {
            "temperature": 0.0, "max_new_tokens": 1, "ignore_eos": True},
            lora_id=1 + i % a.lora if a.lora else 0)]))
        while server.waiting or server.running:
            server.step(StepInput())
    from srt.model_process.step_timing import FillSums

    server.counters.timer.fills = FillSums()  # the profiled fill's rounds only
    prof_fill = (torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                    torch.profiler.ProfilerActivity.CUDA])
                 if a.profile_fill else contextlib.nullcontext())
    fill_cprof = cProfile.Profile()
    t_fill = time.perf_counter()
    with prof_fill:
        if a.profile_fill:
            fill_cprof.enable()
        server.step(StepInput(reqs=reqs))
        while server.waiting:
            server.step(StepInput())
        fill_cprof.disable()
    t_fill = time.perf_counter() - t_fill
    assert len(server.running) == a.batch
    if rank == 0:
        fills = server.counters.timer.fills
        print(f"fill: {fills.rounds} rounds, {fills.tokens} tokens in {t_fill:.3f} s "
              f"({fills.tokens / t_fill:.0f} tokens/s; the first round includes warm-up)")
        if a.profile_fill:
            fs = io.StringIO()
            pstats.Stats(fill_cprof, stream=fs).sort_stats("cumtime").print_stats(a.top)
            print(fs.getvalue())
            print(prof_fill.key_averages().table(sort_by="self_device_time_total",
                                                 row_limit=a.top))
    outs: list = []

    def sync() -> None:
        if torch.cuda.is_available():
            torch.cuda.synchronize()

    def decode(n: int) -> float:
        sync()
        t = time.perf_counter()
        for _ in range(n):
            server._decode_step(outs)
        sync()
        outs.clear()
        return (time.perf_counter() - t) / n

    decode(20)  # warm-up
    wall = decode(a.steps)

    prof = cProfile.Profile()
    prof.enable()
    decode(a.steps)
    prof.disable()
    s = io.StringIO()
    pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(a.top)
    if rank == 0:
        print(s.getvalue())

    n_prof = 20
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                            torch.profiler.ProfilerActivity.CUDA]) as tp:
        decode(n_prof)
    events = tp.key_averages()
    gpu_us = sum(e.self_device_time_total for e in events) / n_prof
    if rank != 0:
        return
    print(events.table(sort_by="self_device_time_total", row_limit=a.top))
    print(f"tp {a.tp_size} shape {a.shape} batch {a.batch} backend {server.runner.backend_name} "
          f"graph {server.runner.graph_runner is not None} quantization "
          f"{server.runner.quantization} kv {server.runner.kv_cache_dtype}")
    print(f"wall per decode step {wall * 1e3:.3f} ms; GPU kernel time per step "
          f"{gpu_us / 1e3:.3f} ms; not covered by kernels {wall * 1e3 - gpu_us / 1e3:.3f} ms")
    if a.fills_while_decoding and a.tp_size == 1:
        fills_while_decoding(server, a, decode)


def fills_while_decoding(server: Any, a: argparse.Namespace, decode: Callable[[int], float],
                         ) -> None:
    """--fills-while-decoding: rounds that fill --fill-batch new prompts while the running
    batch decodes, plain (the running requests wait) and mixed (they take their next token in
    the fill), timed with the device synchronized before and after; the last of each kind is
    also profiled (GPU kernel time against wall time). One rank only (--tp-size 1)."""
    from srt.managers.io_struct import StepInput, TokenizedGenerateReq

    vocab = Shape.of(a.shape).vocab
    n = a.fill_batch * a.fills_while_decoding
    if a.w1:
        from benchmarks.bench_offline import w1_workload

        pool = [[t % vocab for t in x] for x in w1_workload(512 + 2 * n)[0][512:]]
    else:
        rng = random.Random(1)
        pool = [[rng.randrange(2, vocab) for _ in range(a.input_len)] for _ in range(2 * n)]

    def sync() -> None:
        if torch.cuda.is_available():
            torch.cuda.synchronize()

    for mixed in (False, True):
        server.mixed = mixed
        times, gpu_ms, tokens = [], 0.0, []
        for i in range(a.fills_while_decoding):
            k = (int(mixed) * a.fills_while_decoding + i) * a.fill_batch
            prompts = pool[k:k + a.fill_batch]
            reqs = [TokenizedGenerateReq(f"m{int(mixed)}.{i}.{j}", x, {
                "temperature": 0.0, "max_new_tokens": 1, "ignore_eos": True})
                for j, x in enumerate(prompts)]
            last = i == a.fills_while_decoding - 1
            prof = (torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA])
                    if last and torch.cuda.is_available() else contextlib.nullcontext())
            # the round before the last: its host functions (cProfile, no device profiler)
            host = cProfile.Profile() if i == a.fills_while_decoding - 2 else None
            decode(1)
            server._decode_turn = False  # the round fills (the decode step just ran)
            sync()
            t = time.perf_counter()
            with prof:
                if host is not None:
                    host.enable()
                server.step(StepInput(reqs=reqs))  # one round: the fill (mixed or not)
                sync()
                if host is not None:
                    host.disable()
            times.append((time.perf_counter() - t) * 1e3)
            if host is not None:
                s = io.StringIO()
                pstats.Stats(host, stream=s).sort_stats("tottime").print_stats(a.top)
                print(f"host functions of a {'mixed' if mixed else 'plain'} round "
                      f"(cProfile, wall {times[-1]:.1f} ms):\n" + s.getvalue())
            tokens.append(sum(len(x) for x in prompts))
            if last and torch.cuda.is_available():
                events = prof.key_averages()
                gpu_ms = sum(e.self_device_time_total for e in events) / 1e3
                print(events.table(sort_by="self_device_time_total", row_limit=12))
            assert not server.waiting, "the fill round left requests waiting"
        print(f"fills while {len(server.running)} decode, {'mixed' if mixed else 'plain'}: "
              f"wall ms (tokens) " + ", ".join(f"{t:.1f} ({k})" for t, k in zip(times, tokens))
              + f"; the last one's GPU kernels {gpu_ms:.1f} ms (profiled wall {times[-1]:.1f})")


if __name__ == "__main__":
    main()
