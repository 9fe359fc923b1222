"""Where the time of constrained decoding goes: the model process driven directly.

    python3 benchmarks/profile_constrained.py --shape smollm2-135m --tokenizer-dir DIR \
        --batch 1 16 [--cases free regex json json-nojf]

Starts a ModelProcess on the shape with random bf16 weights and SmolLM2's tokenizer (as in
`bench_constrained.py`) and runs, per batch size, each case to completion: `free` (greedy,
ignore_eos), `regex` (the never-forcing regex of bench_constrained, min_new_tokens =
max_new_tokens), `json` (greedy under the long-keyed schema, jump-forward on) and `json-nojf`
(the same with jump-forward off). A warm-up run of each case comes first (pattern compiles,
mask rows, Triton variants). Per case: wall time, forward passes (DECODE and mixed EXTEND
steps), the decode-step phases of `step_timing`, the GPU kernel time under torch.profiler
(host time the device waits on is wall minus that), then the top host functions (cProfile) and
the top kernels. Runs on the CPU too (a smoke check with `--shape tiny`).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import time
from typing import Any

import torch

from benchmarks.bench_constrained import FREE_REGEX, LONG_KEYS_SCHEMA, PROMPT, _model_dir
from benchmarks.common import print_table, write_json
from srt.model_process.step_timing import per_step_ms

CASES = ("free", "regex", "json", "json-nojf")


def _params(case: str, n: int) -> dict[str, Any]:
    if case == "free":
        return {"temperature": 0, "ignore_eos": True, "max_new_tokens": n}
    if case == "regex":
        return {"temperature": 0, "regex": FREE_REGEX, "max_new_tokens": n, "min_new_tokens": n}
    return {"temperature": 0, "json_schema": json.dumps(LONG_KEYS_SCHEMA),
            "max_new_tokens": 256}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--shape", default="smollm2-135m")
    p.add_argument("--tokenizer-dir", default=None)
    p.add_argument("--batch", type=int, nargs="+", default=[1, 16])
    p.add_argument("--cases", nargs="+", default=list(CASES), choices=CASES)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--top", type=int, default=20)
    p.add_argument("--disable-cuda-graph", action="store_true")
    p.add_argument("--cuda-graph-max-bs", type=int, default=None,
                   help="largest captured decode batch (default: the server's; the step after "
                   "a jump has a row per new id)")
    p.add_argument("--grammar-backend", default="xgrammar",
                   choices=["xgrammar", "llguidance", "outlines"])
    p.add_argument("--xgrammar-batch-fill-min-rows", type=int, default=None,
                   help="xgrammar fills the rows of a step on its threads from this many rows "
                   "(default: the backend's; a large value fills row by row)")
    p.add_argument("--xgrammar-threads", type=int, default=None,
                   help="threads of xgrammar's batched fill (default: the backend's)")
    p.add_argument("--out", default=None)
    a = p.parse_args()
    from srt.constrained.xgrammar_backend import XGrammarMatcher

    if a.xgrammar_batch_fill_min_rows is not None:
        XGrammarMatcher.BATCH_FILL_MIN_ROWS = a.xgrammar_batch_fill_min_rows
    if a.xgrammar_threads is not None:
        XGrammarMatcher.BATCH_FILL_THREADS = a.xgrammar_threads

    from srt.managers.io_struct import StepInput, TokenizedGenerateReq
    from srt.model_process.loop import ModelProcess
    from srt.server_args import ServerArgs

    path, extra = _model_dir(a.shape, a.tokenizer_dir)
    dtype = "bfloat16" if torch.cuda.is_available() else "float32"
    args = ServerArgs(model_path=path, tokenizer_path=path, load_format="dummy", dtype=dtype,
                      disable_cuda_graph=a.disable_cuda_graph, random_seed=0,
                      grammar_backend=a.grammar_backend,
                      **({"cuda_graph_max_bs": a.cuda_graph_max_bs}
                         if a.cuda_graph_max_bs else {}))
    server = ModelProcess(args, 0, None)
    prompt = list(server.tokenizer.encode(PROMPT))
    serial = iter(range(10**9))

    def sync() -> None:
        if torch.cuda.is_available():
            torch.cuda.synchronize()

    def run(case: str, bs: int) -> tuple[float, int, int]:
        """(wall seconds, decode steps, mixed steps) of one batch run to completion."""
        reqs = [TokenizedGenerateReq(f"r{next(serial)}", prompt, _params(case, a.output_len))
                for _ in range(bs)]
        d0, m0 = server.counters.timer.snapshot()["total"]["steps"], server.counters.mixed_steps
        sync()
        t = time.perf_counter()
        server.step(StepInput(reqs=reqs))
        while server.running or server.waiting:
            server.step(StepInput())
        sync()
        wall = time.perf_counter() - t
        return (wall, server.counters.timer.snapshot()["total"]["steps"] - d0,
                server.counters.mixed_steps - m0)

    mixed_s: list[float] = []
    real_launch = server.executor.launch

    def timed_launch(plan: Any, before_sample: Any = None) -> Any:  # the steps after in-batch
        if plan.sample_rows is None:  # jumps, timed one by one
            return real_launch(plan, before_sample)
        t = time.perf_counter()
        step = real_launch(plan, before_sample)
        step.wait()  # ends with the ids on the host (a later wait returns the same result)
        mixed_s.append(time.perf_counter() - t)
        return step

    server.executor.launch = timed_launch
    run("regex", 1)  # builds the FSM cache and jump-forward (at the first constrained request)
    jump = server.constraints.jump
    rows: list[dict[str, Any]] = []
    reports: list[str] = []
    for bs in a.batch:
        for case in a.cases:
            server.constraints.jump = None if case == "json-nojf" else jump
            run(case, bs)  # warm-up
            before = server.counters.timer.snapshot()
            mixed_s.clear()
            wall, steps, mixed = run(case, bs)
            mixed_ms = 1e3 * sum(mixed_s) / max(1, len(mixed_s))
            phases = per_step_ms(before, server.counters.timer.snapshot())["total"]
            phases = {k: v for k, v in phases.items() if k.endswith("_ms")}
            prof = cProfile.Profile()
            prof.enable()
            run(case, bs)
            prof.disable()
            s = io.StringIO()
            pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(a.top)
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]
                                        + ([torch.profiler.ProfilerActivity.CUDA]
                                           if torch.cuda.is_available() else [])) as tp:
                run(case, bs)
            events = tp.key_averages()
            gpu_ms = sum(e.self_device_time_total for e in events) / 1e3
            row = {"batch": bs, "case": case, "wall_ms": wall * 1e3, "steps": steps,
                   "mixed": mixed, "mixed_ms": mixed_ms, "ms_per_step": wall * 1e3 / max(1, steps),
                   "gpu_ms": gpu_ms, **phases}
            rows.append(row)
            print(f"measured {row}", flush=True)
            reports.append(f"==== batch {bs} case {case}: host functions (tottime)\n"
                           + s.getvalue() + f"==== batch {bs} case {case}: kernels\n"
                           + events.table(sort_by="self_device_time_total"
                                          if torch.cuda.is_available()
                                          else "self_cpu_time_total", row_limit=a.top))
    server.constraints.jump = jump
    for r in reports:
        print(r)
    print(f"shape {a.shape} device {server.runner.device} backend {server.runner.backend_name} "
          f"graph {server.runner.graph_runner is not None}")
    print_table(rows, list(rows[0]))
    write_json(a.out, {"bench": "profile_constrained", "rows": rows})


if __name__ == "__main__":
    main()
