"""Online serving: TTFT, inter-token latency and throughput of a running HTTP server.

    # against a server that is already up
    python3 benchmarks/bench_serving.py --base-url http://127.0.0.1:30000 --request-rate 4 16 inf
    # start the server itself (random weights of a shape), at fixed concurrency, and compare
    # with srt.Engine on the same requests
    python3 benchmarks/bench_serving.py --launch --shape smollm2-135m --max-concurrency 64 \\
        --compare-engine --out serving.json

Workload (`random.Random(--seed)`): `--num-prompts` prompts of `--input-len` random token ids
below `--max-token-id` (or, with `--prompt-kind text`, those ids decoded by the model's
tokenizer), each asking for `--output-len` tokens (temperature 0, ignore_eos); with
`--range-ratio r < 1` each length is drawn uniformly from [r * len, len].

Each configuration (every `--request-rate` x every `--max-concurrency`) sends the same requests:
arrivals are a Poisson process at the rate (`inf`: all at once), and at most the concurrency
are in flight (none: no limit). Every request streams (`--endpoint generate` or
`completions`). The radix cache is flushed before each configuration so they all start cold.
Reported: request and token throughput over the configuration's wall time, and mean / p50 / p90 /
p99 of TTFT, inter-token latency (gap between chunks), TPOT ((e2e - ttft) / (tokens - 1)) and
end-to-end latency, in ms.

`--compare-engine` then runs the same configurations through `srt.Engine` in this process
(one blocking `generate` per request on a thread pool of the concurrency, no streaming) and
prints HTTP throughput over the Engine's; the target is >= 0.8 at concurrency 64.

`--workload long-mix`: what long prompts do to the streams around them. For `--duration`
seconds, short streamed requests (`--input-len` 256 ids, `--output-len` 256 out, ignore_eos)
arrive as a Poisson process at each `--request-rate` (default 4/s; at most `--max-concurrency`
in flight, counting the short ones only), and one `--long-input-len` (8192) -token prompt with
`--long-output-len` (32) tokens out, its own stream, is sent every `--long-interval` (3) seconds,
the first at one interval in. Every prompt is unique (no prefix hits). One short and one long
warm-up request come first, then the cache is flushed. Reported for the short streams: TTFT
p50/p99, inter-token gap p50/p99/max and the number of gaps over `--gap-threshold-ms` (150);
for the long requests: TTFT p50/max; the largest gaps with their times go into the JSON next to
the long requests' send and first-token times. The launched server gets a context of
max(the shape's, 32768) when the long prompt needs more than the shape's.

    python3 benchmarks/bench_serving.py --launch --shape llama3-8b --workload long-mix \
        --request-rate 8 --duration 60 --chunked-prefill-size 8192 --out long_mix.json

Any srt.ServerArgs flag this script does not define passes through to the launched server (and
to `--compare-engine`'s Engine), e.g. `--chunked-prefill-size 8192 --enable-mixed-chunk`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import sys
import tempfile
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from benchmarks.common import SHAPES, Shape, add_engine_args, engine_kwargs, hardware, \
    parse_with_server_args, print_table, start_engine, write_json, write_shape_dir
from benchmarks.progress import Progress
from benchmarks.serving_client import RequestResult, RequestSpec, send_request


@dataclass(frozen=True)
class RunConfig:
    request_rate: float  # requests per second; inf: all at once
    max_concurrency: int | None  # None: no limit

    @property
    def label(self) -> str:
        rate = "inf" if self.request_rate == float("inf") else f"{self.request_rate:g}"
        return f"rate={rate} conc={self.max_concurrency or '-'}"


def make_requests(a: Any, tokenizer_path: str | None) -> list[RequestSpec]:
    rng = random.Random(a.seed)

    def length(n: int) -> int:
        return n if a.range_ratio >= 1.0 else rng.randint(max(1, int(n * a.range_ratio)), n)

    tok = None
    if a.prompt_kind == "text":
        if tokenizer_path is None:
            raise SystemExit("--prompt-kind text needs --tokenizer (or --launch)")
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(tokenizer_path)
    specs = []
    for _ in range(a.num_prompts):
        ids = [rng.randrange(2, a.max_token_id) for _ in range(length(a.input_len))]
        prompt: list[int] | str = ids if tok is None else tok.decode(ids)
        specs.append(RequestSpec(prompt, length(a.output_len)))
    return specs


def arrival_times(n: int, rate: float, seed: int) -> list[float]:
    """Send offsets (s) of a Poisson process at `rate` (all zero for inf)."""
    if rate == float("inf"):
        return [0.0] * n
    rng = random.Random(seed)
    t, out = 0.0, []
    for _ in range(n):
        out.append(t)
        t += rng.expovariate(rate)
    return out


def _pcts(xs: list[float], name: str) -> dict[str, float]:
    """mean/p50/p90/p99 of seconds `xs`, in ms."""
    if not xs:
        return {f"{name}_{k}": float("nan") for k in ("mean", "p50", "p90", "p99")}
    arr = np.asarray(xs) * 1e3
    return {f"{name}_mean": float(arr.mean()), f"{name}_p50": float(np.percentile(arr, 50)),
            f"{name}_p90": float(np.percentile(arr, 90)),
            f"{name}_p99": float(np.percentile(arr, 99))}


def summarize(results: list[RequestResult], wall: float) -> dict[str, Any]:
    ok = [r for r in results if r.ok]
    out_tokens = sum(r.output_tokens for r in ok)
    in_tokens = sum(r.prompt_tokens for r in ok)
    tpot = [(r.e2e - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    row: dict[str, Any] = {
        "completed": len(ok), "failed": len(results) - len(ok), "wall_s": wall,
        "req_per_s": len(ok) / wall, "in_tok_per_s": in_tokens / wall,
        "out_tok_per_s": out_tokens / wall, "output_tokens": out_tokens,
        "input_tokens": in_tokens, "cached_tokens": sum(r.cached_tokens for r in ok),
    }
    row.update(_pcts([r.ttft for r in ok], "ttft_ms"))
    row.update(_pcts([x for r in ok for x in r.itl], "itl_ms"))
    row.update(_pcts(tpot, "tpot_ms"))
    row.update(_pcts([r.e2e for r in ok], "e2e_ms"))
    errors = sorted({r.error for r in results if not r.ok})
    if errors:
        row["errors"] = errors[:5]
    return row


class ClientGc:
    """This client's own garbage-collector pauses during a run (they stall every stream it
    reads at once, like a server pause would): the heap is frozen first, then each collection
    is timed (srt/gc_watch.py)."""

    def __enter__(self) -> "ClientGc":
        from srt.gc_watch import GcWatch, freeze_heap

        freeze_heap()
        self.watch = GcWatch().install()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.watch.uninstall()

    def figures(self) -> dict[str, Any]:
        st = self.watch.stats()
        return {"client_gc_collections": st["collections"],
                "client_gc_pause_ms_max": st["pause_ms_max"]}


async def run_http(base_url: str, endpoint: str, specs: list[RequestSpec], cfg: RunConfig,
                   seed: int, progress: bool, timeout: float) -> dict[str, Any]:
    with ClientGc() as cgc:
        row = await _run_http(base_url, endpoint, specs, cfg, seed, progress, timeout)
    return {**row, **cgc.figures()}


async def _run_http(base_url: str, endpoint: str, specs: list[RequestSpec], cfg: RunConfig,
                    seed: int, progress: bool, timeout: float) -> dict[str, Any]:
    import aiohttp

    sem = asyncio.Semaphore(cfg.max_concurrency or len(specs))
    bar = Progress(len(specs), cfg.label, enabled=progress)
    conn = aiohttp.TCPConnector(limit=0)  # the semaphore is the only limit
    async with aiohttp.ClientSession(connector=conn,
                                     timeout=aiohttp.ClientTimeout(total=timeout)) as session:
        start = time.perf_counter()

        async def one(spec: RequestSpec, at: float) -> RequestResult:
            await asyncio.sleep(max(0.0, start + at - time.perf_counter()))
            async with sem:
                res = await send_request(session, base_url, endpoint, spec)
            bar.update()
            return res

        times = arrival_times(len(specs), cfg.request_rate, seed)
        results = await asyncio.gather(*(one(s, t) for s, t in zip(specs, times)))
        wall = time.perf_counter() - start
    bar.close()
    return summarize(list(results), wall)


def run_engine(engine: Any, specs: list[RequestSpec], cfg: RunConfig, seed: int,
               progress: bool) -> dict[str, Any]:
    """The same requests through srt.Engine: one blocking generate per request, at most the
    concurrency at once (a pool of that many threads), sent at the same arrival times."""
    bar = Progress(len(specs), "engine " + cfg.label, enabled=progress)
    lock = threading.Lock()

    def one(spec: RequestSpec) -> RequestResult:
        res = RequestResult(start=time.perf_counter())
        key = {"input_ids": spec.prompt} if isinstance(spec.prompt, list) else {
            "prompt": spec.prompt}
        out = engine.generate(**key, sampling_params={
            "max_new_tokens": spec.output_len, "temperature": 0, "ignore_eos": True})
        res.e2e = time.perf_counter() - res.start
        meta = out["meta_info"]
        res.prompt_tokens, res.output_tokens = meta["prompt_tokens"], meta["completion_tokens"]
        res.cached_tokens = meta["cached_tokens"]
        res.ok = res.output_tokens > 0
        with lock:
            bar.update()
        return res

    times = arrival_times(len(specs), cfg.request_rate, seed)
    with ThreadPoolExecutor(max_workers=cfg.max_concurrency or len(specs)) as pool:
        start = time.perf_counter()
        futs = []
        for spec, at in zip(specs, times):
            time.sleep(max(0.0, start + at - time.perf_counter()))
            futs.append(pool.submit(one, spec))
        results = [f.result() for f in futs]
        wall = time.perf_counter() - start
    bar.close()
    row = summarize(results, wall)
    return {k: v for k, v in row.items() if not k.startswith(("ttft", "itl", "tpot"))}


@dataclass(frozen=True)
class MixItem:
    spec: RequestSpec
    at: float  # send offset, s
    long: bool


def make_long_mix(a: Any, rate: float) -> list[MixItem]:
    """The long-mix requests for one short-request rate, sorted by send time."""
    if not 0 < rate < float("inf"):
        raise SystemExit("--workload long-mix needs a finite --request-rate > 0")
    rng = random.Random(a.seed)
    items: list[MixItem] = []
    t = rng.expovariate(rate)
    while t < a.duration:
        ids = [rng.randrange(2, a.max_token_id) for _ in range(a.input_len)]
        items.append(MixItem(RequestSpec(ids, a.output_len), t, False))
        t += rng.expovariate(rate)
    t = a.long_interval
    while t < a.duration:
        ids = [rng.randrange(2, a.max_token_id) for _ in range(a.long_input_len)]
        items.append(MixItem(RequestSpec(ids, a.long_output_len), t, True))
        t += a.long_interval
    return sorted(items, key=lambda x: x.at)


def stall_events(big: list[tuple[float, float]], window_s: float = 0.05) -> list[dict[str, Any]]:
    """Group the long gaps (end time s, length ms) whose ends lie within `window_s` of the
    previous one: one group is one moment when many streams stopped together (a long step, a
    pause of a server process or of this client), rather than one slow stream. Longest first."""
    groups: list[list[tuple[float, float]]] = []
    for end, ms in sorted(big):
        if groups and end - groups[-1][-1][0] <= window_s:
            groups[-1].append((end, ms))
        else:
            groups.append([(end, ms)])
    out = [{"end_s": g[0][0], "streams": len(g), "max_ms": max(ms for _, ms in g),
            "start_s": round(min(e - ms / 1e3 for e, ms in g), 4)} for g in groups]
    return sorted(out, key=lambda x: -x["max_ms"])


def summarize_long_mix(items: list[MixItem], results: list[RequestResult], start: float,
                       wall: float, gap_ms: float) -> dict[str, Any]:
    """Short streams: throughput, TTFT and inter-token gaps; long requests: TTFT. Times in the
    `gaps` / `long` lists are seconds from the run's start."""
    short = [r for it, r in zip(items, results) if not it.long]
    long_ = [(it, r) for it, r in zip(items, results) if it.long]
    row = summarize(short, wall)
    row = {k: v for k, v in row.items() if not k.startswith(("tpot", "e2e"))}
    gaps = np.asarray([x for r in short if r.ok for x in r.itl]) * 1e3
    row["itl_ms_max"] = float(gaps.max()) if gaps.size else float("nan")
    row["gaps"] = int(gaps.size)
    row[f"gaps_over_{gap_ms:g}ms"] = int((gaps > gap_ms).sum())
    big = []  # (when the gap ended, its length): the largest, to line up with the long prefills
    for r in short:
        if r.ok:
            t = r.start - start + r.ttft
            for x in r.itl:
                t += x
                if x * 1e3 > gap_ms:
                    big.append((round(t, 4), round(x * 1e3, 2)))
    row["big_gaps"] = sorted(big, key=lambda g: -g[1])[:100]
    stalls = stall_events(big)
    row["stall_events"] = len(stalls)
    row["stalls"] = stalls[:50]
    ok_long = [r for _, r in long_ if r.ok]
    lt = np.asarray([r.ttft for r in ok_long]) * 1e3
    row.update({
        "long_sent": len(long_), "long_completed": len(ok_long),
        "long_ttft_ms_p50": float(np.percentile(lt, 50)) if lt.size else float("nan"),
        "long_ttft_ms_max": float(lt.max()) if lt.size else float("nan"),
        "long": [{"sent_s": round(r.start - start, 4), "ttft_ms": round(r.ttft * 1e3, 2),
                  "e2e_ms": round(r.e2e * 1e3, 2), "cached_tokens": r.cached_tokens,
                  "ok": r.ok, "error": r.error} for _, r in long_],
    })
    errors = sorted({r.error for _, r in long_ if not r.ok} | set(row.get("errors", [])))
    if errors:
        row["errors"] = errors[:5]
    return row


async def run_long_mix_http(base_url: str, endpoint: str, items: list[MixItem],
                            max_concurrency: int | None, progress: bool, timeout: float,
                            label: str, gap_ms: float) -> dict[str, Any]:
    with ClientGc() as cgc:
        row = await _run_long_mix_http(base_url, endpoint, items, max_concurrency, progress,
                                       timeout, label, gap_ms)
    return {**row, **cgc.figures()}


async def _run_long_mix_http(base_url: str, endpoint: str, items: list[MixItem],
                             max_concurrency: int | None, progress: bool, timeout: float,
                             label: str, gap_ms: float) -> dict[str, Any]:
    import aiohttp

    n_short = sum(not it.long for it in items)
    sem = asyncio.Semaphore(max_concurrency or max(n_short, 1))
    bar = Progress(len(items), label, enabled=progress)
    conn = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=conn,
                                     timeout=aiohttp.ClientTimeout(total=timeout)) as session:
        start = time.perf_counter()

        async def one(it: MixItem) -> RequestResult:
            await asyncio.sleep(max(0.0, start + it.at - time.perf_counter()))
            if it.long:  # the long requests ignore the concurrency limit
                res = await send_request(session, base_url, endpoint, it.spec)
            else:
                async with sem:
                    res = await send_request(session, base_url, endpoint, it.spec)
            bar.update()
            return res

        wall_clock = time.time() - (time.perf_counter() - start)  # when `start` was
        results = await asyncio.gather(*(one(it) for it in items))
        wall = time.perf_counter() - start
    bar.close()
    return {**summarize_long_mix(items, list(results), start, wall, gap_ms),
            "start_wall_time": round(wall_clock, 4)}


def _post(url: str, body: dict[str, Any] | None = None, timeout: float = 600) -> Any:
    req = urllib.request.Request(url, data=json.dumps(body or {}).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


def warm_up(base_url: str, endpoint: str, spec: RequestSpec) -> None:
    """One short request (kernel compilation, first allocations), then an empty cache."""
    res = asyncio.run(_warm(base_url, endpoint, RequestSpec(spec.prompt, min(spec.output_len, 8))))
    if not res.ok:
        raise RuntimeError(f"warm-up request failed: {res.error}")


async def _warm(base_url: str, endpoint: str, spec: RequestSpec) -> RequestResult:
    import aiohttp

    async with aiohttp.ClientSession() as session:
        return await send_request(session, base_url, endpoint, spec)


def flush(base_url: str, timeout: float = 30.0, path: str = "/flush_cache") -> None:
    """POST `path` (srt's /flush_cache; vLLM's /reset_prefix_cache), retrying while the server
    still finishes earlier requests (409); an empty path flushes nothing."""
    import urllib.error

    if not path:
        return
    deadline = time.monotonic() + timeout
    while True:
        try:
            _post(base_url + path)
            return
        except urllib.error.HTTPError as e:
            if e.code != 409 or time.monotonic() > deadline:
                raise
            time.sleep(0.2)


def _server_info(base_url: str) -> dict[str, Any]:
    """srt's /get_server_info, or {} from a server without it (another engine's)."""
    import urllib.error

    try:
        return json.loads(urllib.request.urlopen(base_url + "/get_server_info", timeout=60).read())
    except urllib.error.HTTPError:
        return {}


def parse_rates(values: list[str]) -> list[float]:
    return [float("inf") if v == "inf" else float(v) for v in values]


def main() -> None:
    p = argparse.ArgumentParser(allow_abbrev=False)  # unknown flags go to ServerArgs, whole
    add_engine_args(p)
    p.add_argument("--workload", default="fixed", choices=["fixed", "long-mix"],
                   help="fixed: --num-prompts requests per configuration; long-mix: short "
                        "streams at --request-rate plus a long prompt every --long-interval s")
    p.add_argument("--base-url", default="http://127.0.0.1:30000")
    p.add_argument("--launch", action="store_true",
                   help="start the server (random weights of --shape) on a free port, stop it")
    p.add_argument("--launch-timeout", type=float, default=900.0)
    p.add_argument("--endpoint", default="generate", choices=["generate", "completions"])
    p.add_argument("--flush-path", default="/flush_cache",
                   help="POSTed before each configuration to empty the prefix cache (vLLM: "
                   "/reset_prefix_cache, with VLLM_SERVER_DEV_MODE=1); '' for none")
    p.add_argument("--request-rate", nargs="+", default=None,
                   help="requests/s (Poisson), 'inf' for all at once; several allowed "
                        "(long-mix: of the short requests, default 4)")
    p.add_argument("--max-concurrency", nargs="+", type=int, default=None,
                   help="most requests in flight; several allowed")
    p.add_argument("--num-prompts", type=int, default=256)
    p.add_argument("--input-len", type=int, default=None,
                   help="prompt tokens (default 1024; long-mix: of the short requests, 256)")
    p.add_argument("--output-len", type=int, default=256)
    p.add_argument("--range-ratio", type=float, default=1.0)
    p.add_argument("--prompt-kind", default="ids", choices=["ids", "text"])
    p.add_argument("--tokenizer", default=None, help="for --prompt-kind text without --launch")
    p.add_argument("--max-token-id", type=int, default=None,
                   help="prompt ids are drawn below this (default: min(10000, the shape's vocab))")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=3600.0, help="per request, seconds")
    p.add_argument("--compare-engine", action="store_true",
                   help="run the same configurations through srt.Engine and compare")
    p.add_argument("--no-progress", action="store_true")
    g = p.add_argument_group("long-mix")
    g.add_argument("--duration", type=float, default=60.0,
                   help="seconds over which requests are sent")
    g.add_argument("--long-input-len", type=int, default=8192)
    g.add_argument("--long-output-len", type=int, default=32)
    g.add_argument("--long-interval", type=float, default=3.0,
                   help="seconds between long prompts")
    g.add_argument("--gap-threshold-ms", type=float, default=150.0,
                   help="inter-token gaps over this are counted")
    a = parse_with_server_args(p)

    long_mix = a.workload == "long-mix"
    if a.input_len is None:
        a.input_len = 256 if long_mix else 1024
    if long_mix and a.compare_engine:
        raise SystemExit("--compare-engine is for --workload fixed")
    if long_mix and a.prompt_kind != "ids":
        raise SystemExit("--workload long-mix sends token ids (--prompt-kind ids)")
    if a.max_token_id is None:
        a.max_token_id = min(10000, Shape.of(a.shape).vocab)
    rates = parse_rates(a.request_rate or ["4" if long_mix else "inf"])
    concs: list[int | None] = list(a.max_concurrency or [None])
    configs = [RunConfig(r, c) for r in rates for c in concs]
    # `timeout` stops a benchmark with SIGTERM: unwind, so that a launched server is stopped too.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    srv = None
    base_url = a.base_url
    model_dir = a.tokenizer
    shape_config: dict[str, Any] = {}
    if long_mix:  # room for the long prompt and its output
        ctx = SHAPES[a.shape]["max_position_embeddings"]
        if a.long_input_len + a.long_output_len > ctx:
            shape_config["max_position_embeddings"] = max(
                32768, a.long_input_len + a.long_output_len)
    server_kwargs = {**engine_kwargs(a), **a.server_args}
    if a.launch:
        from benchmarks.launch import launch_server
        from srt.utils import free_port

        model_dir = write_shape_dir(a.shape, tempfile.mkdtemp(prefix=f"srt-{a.shape}-"),
                                    **shape_config)
        log_path = os.path.join(os.path.dirname(os.path.abspath(a.out)) if a.out
                                else tempfile.gettempdir(), f"server_{a.shape}.log")
        t = time.perf_counter()
        srv = launch_server(model_dir, server_kwargs, free_port(), log_path, a.launch_timeout)
        print(f"server up in {time.perf_counter() - t:.1f} s at {srv.url} (log {log_path})",
              file=sys.stderr)
        base_url = srv.url
    specs = make_requests(a, model_dir) if not long_mix else []
    rows: list[dict[str, Any]] = []
    try:
        if long_mix:
            rng = random.Random(a.seed + 1)  # warm-up prompts unlike the measured ones
            warm_up(base_url, a.endpoint, RequestSpec(
                [rng.randrange(2, a.max_token_id) for _ in range(a.input_len)], a.output_len))
            warm_up(base_url, a.endpoint, RequestSpec(
                [rng.randrange(2, a.max_token_id) for _ in range(a.long_input_len)],
                a.long_output_len))
            for cfg in configs:
                flush(base_url, path=a.flush_path)
                items = make_long_mix(a, cfg.request_rate)
                row = asyncio.run(run_long_mix_http(
                    base_url, a.endpoint, items, cfg.max_concurrency, not a.no_progress,
                    a.timeout, "long-mix " + cfg.label, a.gap_threshold_ms))
                rows.append({**asdict(cfg), "endpoint": a.endpoint, **row})
        else:
            warm_up(base_url, a.endpoint, specs[0])
            for cfg in configs:
                flush(base_url, path=a.flush_path)
                row = asyncio.run(run_http(base_url, a.endpoint, specs, cfg, a.seed,
                                           not a.no_progress, a.timeout))
                rows.append({**asdict(cfg), "endpoint": a.endpoint, **row})
        server_info = _server_info(base_url)
    finally:
        if srv is not None:
            srv.stop()
    if a.compare_engine:
        engine, _ = start_engine(a, **a.server_args)
        with engine:
            engine.generate(input_ids=[2, 3, 4, 5], sampling_params={"max_new_tokens": 8})
            for row, cfg in zip(rows, configs):
                engine.flush_cache()
                eng = run_engine(engine, specs, cfg, a.seed, not a.no_progress)
                row["engine"] = eng
                row["engine_out_tok_per_s"] = eng["out_tok_per_s"]
                row["http_over_engine"] = row["out_tok_per_s"] / eng["out_tok_per_s"]
    if long_mix:
        cols = ["request_rate", "max_concurrency", "completed", "failed", "wall_s",
                "out_tok_per_s", "ttft_ms_p50", "ttft_ms_p99", "itl_ms_p50", "itl_ms_p99",
                "itl_ms_max", "gaps", f"gaps_over_{a.gap_threshold_ms:g}ms", "stall_events",
                "client_gc_pause_ms_max", "long_sent",
                "long_completed", "long_ttft_ms_p50", "long_ttft_ms_max"]
    else:
        cols = ["request_rate", "max_concurrency", "completed", "failed", "wall_s", "req_per_s",
                "out_tok_per_s", "ttft_ms_p50", "ttft_ms_p99", "itl_ms_p50", "itl_ms_p99",
                "tpot_ms_p50", "e2e_ms_p50", "e2e_ms_p99"]
    if a.compare_engine:
        cols += ["engine_out_tok_per_s", "http_over_engine"]
    for r in rows:
        for e in r.get("errors", []):
            print(f"error ({r['request_rate']}, {r['max_concurrency']}): {e}", file=sys.stderr)
    write_json(a.out, {
        "bench": "serving_long_mix" if long_mix else "serving", "argv": sys.argv,
        "hardware": hardware(), "shape": a.shape if a.launch else None,
        "endpoint": a.endpoint, "workload": a.workload,
        "num_prompts": None if long_mix else a.num_prompts, "input_len": a.input_len,
        "output_len": a.output_len, "range_ratio": a.range_ratio, "prompt_kind": a.prompt_kind,
        **({"duration_s": a.duration, "long_input_len": a.long_input_len,
            "long_output_len": a.long_output_len, "long_interval_s": a.long_interval,
            "gap_threshold_ms": a.gap_threshold_ms, "shape_config": shape_config}
           if long_mix else {}),
        "server_args": a.server_args,
        "server": {k: server_info.get(k) for k in ("attention_backend", "device", "dtype",
                                                   "tp_size", "max_total_num_tokens",
                                                   "gc", "heap", "slow_rounds")},
        "runs": rows,
    })
    print_table(rows, cols)


if __name__ == "__main__":
    main()
