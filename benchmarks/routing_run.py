"""SGLang's gateway (`smg`) in front of two srt servers under a multi-tenant workload: the
measured prefix-cache hit rate and TTFT with `--policy cache_aware` against `round_robin`, next
to what `benchmarks/capacity.py` predicts for the same workload.

    python3 benchmarks/routing_run.py --out routing.json

Each tenant has its own long system prompt (`--system-tokens`), each request is a tenant's system
prompt plus a question of its own (`--user-tokens`), asking for `--output-len` tokens; tenants
are drawn uniformly, arrivals are Poisson at `--rate` per second over `--requests` requests (the
same sequence for every policy). The two workers (`python -m srt.server`, the default model, so
on a CPU SmolLM2-135M in float32, `--threads` torch threads each) get a KV pool of
`--max-total-tokens`, chosen so that one worker's cache holds about half of the tenants'
prompts: then round robin keeps evicting them and cache-aware routing, which pins each tenant to
one worker, should not.

Before the routed runs one worker is measured alone, to give the model its inputs: the fixed
cost of a prefill (the TTFT of a prompt sent a second time, all cached but its last token), the
prefill speed (prompt tokens over the rest of the TTFT of unique prompts, one at a time), the
decode step with one and with four streams, and the pool size as the cache capacity. Then, per policy: the gateway is
started (`python -m sglang_router launch --policy P --worker-urls ...`, from the folder
scripts/sglang_clients.sh fills), both workers' caches are flushed, the workload goes through the
gateway, and the gateway is stopped.

Reported per policy: the requests whose system prompt was found in the worker's cache (cached
tokens >= 90% of it; the first request of each tenant on each worker cannot hit), the share of
prompt tokens served from the cache, TTFT mean / p50 / p99, the requests per worker; and the
model's predicted hit rate and TTFT for the same workload, the same two replicas and policy.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import subprocess
import sys
import tempfile
import time
import urllib.request
from typing import Any

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
if REPO not in sys.path:
    sys.path.insert(0, REPO)

from benchmarks.capacity import (  # noqa: E402
    MixClass,
    SimConfig,
    Workload,
    curve_from_docs,
    simulate,
)
from benchmarks.common import hardware, print_table, write_json  # noqa: E402
from benchmarks.launch import launch_server, stop_process  # noqa: E402
from benchmarks.serving_client import RequestResult, RequestSpec, send_request  # noqa: E402

POLICIES = ("cache_aware", "round_robin")


def _post(url: str, body: dict[str, Any] | None = None, timeout: float = 120) -> Any:
    req = urllib.request.Request(url, data=json.dumps(body or {}).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read() or b"null")


def _get(url: str, timeout: float = 60) -> Any:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return json.loads(r.read())


def word_pieces(tokenizer: Any) -> list[str]:
    """Vocabulary entries that are one lower-case word after a space: text made of them
    tokenizes to about one token per word."""
    out = []
    for piece, _ in sorted(tokenizer.get_vocab().items(), key=lambda kv: kv[1]):
        if piece.startswith("\u0120") and piece[1:].isalpha() and piece[1:].islower() \
                and 3 <= len(piece) - 1 <= 8:
            out.append(piece[1:])
    return out


def make_text(rng: random.Random, words: list[str], tokenizer: Any, tokens: int) -> str:
    """Random words making `tokens` tokens (within a few)."""
    text = " ".join(rng.choice(words) for _ in range(tokens))
    ids = tokenizer.encode(text, add_special_tokens=False)[:tokens]
    return tokenizer.decode(ids)


def poisson_times(n: int, rate: float, seed: int) -> list[float]:
    rng = random.Random(seed)
    t, out = 0.0, []
    for _ in range(n):
        t += rng.expovariate(rate)
        out.append(t)
    return out


async def run_workload(base_url: str, specs: list[RequestSpec], times: list[float]
                       ) -> list[RequestResult]:
    import aiohttp

    conn = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=conn,
                                     timeout=aiohttp.ClientTimeout(total=900)) as session:
        start = time.perf_counter()

        async def one(spec: RequestSpec, at: float) -> RequestResult:
            await asyncio.sleep(max(0.0, start + at - time.perf_counter()))
            return await send_request(session, base_url, "generate", spec)

        return list(await asyncio.gather(*(one(s, t) for s, t in zip(specs, times))))


def calibrate(url: str, prompts: list[str], output_len: int) -> dict[str, Any]:
    """One worker alone: prefill speed from unique prompts one at a time, the decode step with
    one stream and with four."""
    def one(p: str) -> RequestResult:
        return asyncio.run(run_workload(url, [RequestSpec(p, output_len)], [0.0]))[0]

    singles = [one(p) for p in prompts[:3]]
    repeats = [one(p) for p in prompts[:3]]  # the same prompts again: all but one token cached
    four = asyncio.run(run_workload(url, [RequestSpec(p, output_len) for p in prompts[3:7]],
                                    [0.0] * 4))
    for r in singles + repeats + four:
        if not r.ok:
            raise RuntimeError(f"calibration request failed: {r.error}")
    overhead = float(np.median([r.ttft for r in repeats]))  # a prefill of (almost) nothing
    prefill = float(np.median([r.prompt_tokens / max(r.ttft - overhead, 1e-6)
                               for r in singles]))
    step1 = float(np.median([x for r in singles for x in r.itl])) * 1e3
    step4 = float(np.median([x for r in four for x in r.itl])) * 1e3
    return {"prompt_tokens": singles[0].prompt_tokens,
            "ttft_ms": [r.ttft * 1e3 for r in singles],
            "cached_ttft_ms": [r.ttft * 1e3 for r in repeats],
            "prefill_overhead_ms": overhead * 1e3, "prefill_tok_per_s": prefill,
            "step_ms_1": step1, "step_ms_4": step4}


def curve_doc(cal: dict[str, Any], cache_tokens: int) -> dict[str, Any]:
    """The calibration as a plain curve file for capacity.py (two points: 1 and 4 streams)."""
    def point(streams: int, step: float) -> dict[str, Any]:
        tok_s = streams * 1e3 / step
        return {"rate": tok_s / 64, "out_tok_per_s": tok_s, "ttft_p50_ms": cal["ttft_ms"][0],
                "ttft_p99_ms": max(cal["ttft_ms"]), "itl_p50_ms": step, "itl_p99_ms": step,
                "step_ms": step, "itl_mean_ms": step}
    return {"points": [point(1, cal["step_ms_1"]), point(4, max(cal["step_ms_4"],
                                                                 cal["step_ms_1"]))],
            "prefill_tok_per_s": cal["prefill_tok_per_s"],
            "prefill_overhead_ms": cal["prefill_overhead_ms"], "cache_tokens": cache_tokens}


class Gateway:
    """`python -m sglang_router launch` over the workers, with one routing policy."""

    def __init__(self, clients: str, workers: list[str], policy: str, port: int,
                 log_path: str) -> None:
        from srt.utils import free_port

        self.url = f"http://127.0.0.1:{port}"
        with open(log_path, "w") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "sglang_router", "launch", "--host", "127.0.0.1",
                 "--port", str(port), "--policy", policy, "--prometheus-host", "127.0.0.1",
                 "--prometheus-port", str(free_port()), "--worker-urls", *workers],
                stdout=log, stderr=subprocess.STDOUT, cwd=tempfile.gettempdir(),
                env=dict(os.environ, PYTHONPATH=clients, PYTHONUNBUFFERED="1"),
                start_new_session=True)
        self.log_path = log_path

    def wait_ready(self, timeout: float = 120.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"gateway exited; log {self.log_path}")
            try:
                if _get(self.url + "/workers", timeout=5)["workers"]:
                    return
            except Exception:  # not listening yet
                pass
            time.sleep(0.5)
        raise RuntimeError(f"gateway not up after {timeout} s; log {self.log_path}")

    def stop(self) -> None:
        stop_process(self.proc)


def measured_row(policy: str, results: list[RequestResult], system_tokens: int,
                 per_worker: list[int], wall: float) -> dict[str, Any]:
    ok = [r for r in results if r.ok]
    ttft = np.asarray([r.ttft for r in ok]) * 1e3
    hits = sum(r.cached_tokens >= 0.9 * system_tokens for r in ok)
    return {
        "policy": policy, "source": "measured", "completed": len(ok),
        "failed": len(results) - len(ok), "wall_s": wall,
        "hit_rate": hits / max(1, len(ok)),
        "cached_token_share": sum(r.cached_tokens for r in ok) / max(1, sum(
            r.prompt_tokens for r in ok)),
        "ttft_mean_ms": float(ttft.mean()) if ttft.size else float("nan"),
        "ttft_p50_ms": float(np.percentile(ttft, 50)) if ttft.size else float("nan"),
        "ttft_p99_ms": float(np.percentile(ttft, 99)) if ttft.size else float("nan"),
        "requests_per_worker": per_worker,
        "errors": sorted({r.error for r in results if not r.ok})[:5],
    }


def main() -> None:
    p = argparse.ArgumentParser(allow_abbrev=False)
    p.add_argument("--tenants", type=int, default=8)
    p.add_argument("--system-tokens", type=int, default=384)
    p.add_argument("--user-tokens", type=int, default=32)
    p.add_argument("--output-len", type=int, default=8)
    p.add_argument("--rate", type=float, default=1.0, help="requests/s over both workers")
    p.add_argument("--requests", type=int, default=120)
    p.add_argument("--max-total-tokens", type=int, default=2400,
                   help="each worker's KV pool (its prefix cache's capacity)")
    p.add_argument("--threads", type=int, default=1, help="torch threads per worker")
    p.add_argument("--policies", nargs="+", default=list(POLICIES), choices=POLICIES)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None)
    a = p.parse_args()

    from transformers import AutoTokenizer

    from srt.default_model import ensure_default_model
    from srt.utils import free_port

    model = ensure_default_model()
    tok = AutoTokenizer.from_pretrained(model)
    words = word_pieces(tok)
    rng = random.Random(a.seed)
    systems = [make_text(rng, words, tok, a.system_tokens) for _ in range(a.tenants)]
    tenants = [rng.randrange(a.tenants) for _ in range(a.requests)]
    specs = [RequestSpec(systems[t] + "\n" + make_text(rng, words, tok, a.user_tokens),
                         a.output_len) for t in tenants]
    times = poisson_times(a.requests, a.rate, a.seed + 1)
    calib_prompts = [make_text(rng, words, tok, a.system_tokens + a.user_tokens)
                     for _ in range(7)]

    clients = subprocess.run(["bash", os.path.join(REPO, "scripts", "sglang_clients.sh")],
                             check=True, capture_output=True, text=True).stdout.strip()
    logdir = os.path.dirname(os.path.abspath(a.out)) if a.out else tempfile.gettempdir()
    os.environ["OMP_NUM_THREADS"] = str(a.threads)  # the workers inherit it
    kwargs = {"max_total_tokens": a.max_total_tokens, "log_level": "warning",
              "device": "cpu", "dtype": "float32"}
    workers = []
    try:
        for i in range(2):
            workers.append(launch_server(model, kwargs, free_port(),
                                         os.path.join(logdir, f"routing_worker{i}.log")))
        urls = [w.url for w in workers]
        cal = calibrate(urls[0], calib_prompts, max(a.output_len, 16))
        print(f"worker alone: {cal}", file=sys.stderr)
        rows: list[dict[str, Any]] = []
        for policy in a.policies:
            for u in urls:
                _post(u + "/flush_cache")
            before = [_get(u + "/get_server_info")["num_requests_total"] for u in urls]
            gw = Gateway(clients, urls, policy, free_port(),
                         os.path.join(logdir, f"routing_smg_{policy}.log"))
            try:
                gw.wait_ready()
                t = time.perf_counter()
                results = asyncio.run(run_workload(gw.url, specs, times))
                wall = time.perf_counter() - t
            finally:
                gw.stop()
            per_worker = _per_worker(urls, before)
            rows.append(measured_row(policy, results, a.system_tokens, per_worker, wall))
            print(f"{policy}: {rows[-1]}", file=sys.stderr)
    finally:
        for w in workers:
            w.stop()

    prompt_len = a.system_tokens + a.user_tokens
    workload = Workload(rate=a.rate, mix=(MixClass(1.0, prompt_len, a.output_len),),
                        prefix_share=a.system_tokens / prompt_len, tenants=a.tenants,
                        num_requests=a.requests, seed=a.seed)
    doc = curve_doc(cal, a.max_total_tokens)
    curve = curve_from_docs([("calibration", doc)])
    model_rows = []
    for policy in a.policies:
        sims = [simulate(curve, Workload(**{**workload.__dict__, "seed": s}), policy, 2,
                         SimConfig()) for s in range(a.seed, a.seed + 5)]
        model_rows.append({
            "policy": policy, "source": "model (5 seeds)",
            "hit_rate": float(np.mean([s.hit_rate for s in sims])),
            "ttft_mean_ms": float(np.mean([s.ttft_mean_ms for s in sims])),
            "ttft_p50_ms": float(np.mean([s.ttft_p50_ms for s in sims])),
            "ttft_p99_ms": float(np.mean([s.ttft_p99_ms for s in sims]))})
    table = rows + model_rows
    write_json(a.out, {"bench": "routing_run", "argv": sys.argv, "hardware": hardware(),
                       "workload": vars(a), "calibration": cal, "curve": doc,
                       "runs": rows, "model": model_rows})
    print_table(table, ["policy", "source", "completed", "hit_rate", "cached_token_share",
                        "ttft_mean_ms", "ttft_p50_ms", "ttft_p99_ms", "requests_per_worker"])


def _per_worker(urls: list[str], before: list[int]) -> list[int]:
    """Requests each worker received since `before` (its counts then)."""
    return [_get(u + "/get_server_info")["num_requests_total"] - b
            for u, b in zip(urls, before)]


if __name__ == "__main__":
    main()
