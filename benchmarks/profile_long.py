"""Where the steps of a long prompt among running requests spend their time, on one model
process stepped in this process (random weights):

    python3 benchmarks/profile_long.py --shape llama3-8b --chunked-prefill-size 2048 \\
        [--enable-mixed-chunk] [--running 64] [--long-len 8192] --out profile.json

`--running` requests (256-token prompts, 1000 tokens out) are admitted and decode; then
one `--long-len`-token prompt arrives and is filled chunk by chunk (alone, or with the running
requests' tokens when mixing). Every round is timed with the device synchronized after it and
classified (decode step, fill, mixed fill); rounds of one kind and token count are averaged.
Then one round of each kind runs under torch.profiler and its top kernels by device time are
printed, so a mixed step's cost can be split into GEMMs, extend attention and the rest.
Any srt.ServerArgs flag passes through. A CPU smoke test: `--shape tiny --device cpu --dtype
float32 --running 4 --long-len 512 --chunked-prefill-size 128`.
"""

from __future__ import annotations

import argparse
import random
import tempfile
import time
from collections import defaultdict
from typing import Any

import torch

from benchmarks.common import add_engine_args, engine_kwargs, hardware, \
    parse_with_server_args, print_table, write_json, write_shape_dir
from srt.managers.io_struct import StepInput, TokenizedGenerateReq


def _round(p: Any, inp: StepInput) -> tuple[str, int, float]:
    """Run one round; (kind, new tokens, seconds with the device synchronized)."""
    fills0, mixed0 = p.counters.timer.snapshot()["fills"]["rounds"], p.counters.mixed_fills
    tokens0 = p.counters.timer.snapshot()["fills"]["tokens"]
    sync = torch.cuda.synchronize if p.runner.device.type == "cuda" else (lambda: None)
    sync()
    t = time.perf_counter()
    p.step(inp)
    sync()
    dt = time.perf_counter() - t
    snap = p.counters.timer.snapshot()["fills"]
    if snap["rounds"] == fills0:
        return "decode", len(p.running), dt
    kind = "mixed fill" if p.counters.mixed_fills > mixed0 else "fill"
    return kind, snap["tokens"] - tokens0, dt


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_engine_args(p)
    p.add_argument("--running", type=int, default=64)
    p.add_argument("--long-len", type=int, default=8192)
    p.add_argument("--context-length", type=int, default=32768)
    p.add_argument("--top", type=int, default=12)
    a = parse_with_server_args(p)
    from srt.model_process.loop import ModelProcess
    from srt.server_args import ServerArgs

    path = write_shape_dir(a.shape, tempfile.mkdtemp(prefix="srt-profile-long-"),
                           max_position_embeddings=a.context_length)
    kw = {**engine_kwargs(a), **a.server_args}
    proc = ModelProcess(ServerArgs(model_path=path, tokenizer_path=path, **kw).resolve(), 0)
    rng = random.Random(0)
    top = min(proc.config.vocab_size, 10000)
    forever = {"temperature": 0, "max_new_tokens": 1000, "ignore_eos": True}
    running = [TokenizedGenerateReq(f"r{i}", [rng.randrange(top) for _ in range(256)], forever)
               for i in range(a.running)]
    proc.step(StepInput(reqs=running))
    while proc.waiting:
        proc.step(StepInput())
    for _ in range(8):
        _round(proc, StepInput())
    long = TokenizedGenerateReq("long", [rng.randrange(top) for _ in range(a.long_len)],
                                {"temperature": 0, "max_new_tokens": 1, "ignore_eos": True})
    rounds = [_round(proc, StepInput(reqs=[long]))]
    while proc.waiting:
        rounds.append(_round(proc, StepInput()))
    rounds += [_round(proc, StepInput()) for _ in range(4)]
    groups: dict[tuple[str, int], list[float]] = defaultdict(list)
    for kind, n, dt in rounds:
        groups[(kind, n)].append(dt)
    rows = [{"round": kind, "tokens_or_batch": n, "count": len(ts),
             "ms_mean": round(1e3 * sum(ts) / len(ts), 3), "ms_max": round(1e3 * max(ts), 3)}
            for (kind, n), ts in sorted(groups.items())]
    long_ms = 1e3 * sum(dt for kind, _, dt in rounds if kind != "decode")

    profiles: dict[str, list[dict[str, Any]]] = {}
    if proc.runner.device.type == "cuda":
        from torch.profiler import ProfilerActivity, profile

        def profiled(inp: StepInput) -> tuple[str, list[dict[str, Any]]]:
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                kind, n, dt = _round(proc, inp)
            events = sorted(prof.key_averages(), key=lambda e: -e.device_time_total)[:a.top]
            return f"{kind} ({n}, {1e3 * dt:.1f} ms)", [
                {"kernel": e.key[:70], "calls": e.count,
                 "ms": round(e.device_time_total / 1e3, 3)} for e in events]

        # A second long prompt, every round profiled: its first chunk, and of each kind of
        # round the last (a fill's last chunk has the longest prefix).
        second = TokenizedGenerateReq("long2", [rng.randrange(top) for _ in range(a.long_len)],
                                      long.sampling_params)
        name, evs = profiled(StepInput(reqs=[second]))
        profiles["first chunk: " + name] = evs
        last: dict[str, tuple[str, list[dict[str, Any]]]] = {}
        while proc.waiting:
            name, evs = profiled(StepInput())
            last[name.split(" (")[0]] = (name, evs)
        name, evs = profiled(StepInput())
        last["decode"] = (name, evs)
        for name, evs in last.values():
            profiles[name] = evs
    print_table(rows, ["round", "tokens_or_batch", "count", "ms_mean", "ms_max"])
    for name, evs in profiles.items():
        print(f"-- {name}: top kernels by device time")
        print_table(evs, ["kernel", "calls", "ms"])
    print(f"long prompt of {a.long_len} tokens among {a.running} running: {long_ms:.1f} ms "
          f"of fill rounds; server args {a.server_args}")
    if a.out:
        write_json(a.out, {"bench": "profile_long", "hardware": hardware(), "shape": a.shape,
                           "server_args": a.server_args, "running": a.running,
                           "long_len": a.long_len, "rounds": rows, "fill_ms": long_ms,
                           "profiles": profiles})


if __name__ == "__main__":
    main()
