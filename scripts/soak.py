"""Soak test: a mixed load against a server for a given time, then the health of what is left.

    # start the default model on the CPU (float32) and soak it for 10 minutes
    python scripts/soak.py --duration 600 --out soak.json
    # a server that is already up (give its pid to sample the memory of its processes)
    python scripts/soak.py --base-url http://127.0.0.1:30000 --server-pid 1234 --duration 3600

The load: `--concurrency` client threads, each sending one request after another, drawn by weight
from: short and long /generate requests, streams read to the end, streams dropped after a few
chunks (client disconnects), requests stopped with /abort_request, invalid bodies, regex- and
JSON-schema-constrained requests, OpenAI chat completions and n > 1 samples.

Every request is classified: `ok`, `expected_error` (the documented 400 envelope for an invalid
body), `disconnected` (dropped on purpose), `unexpected` (a wrong but well-formed answer: a 4xx
for a valid request, output outside its constraint, a missing finish_reason), `server_error`
(any 5xx) or `lost` (no answer: a timeout, a dropped connection, an answer that does not parse,
a stream that stops before its end).

Reported (JSON with --out, a summary on stdout): counts per kind and outcome, latency
percentiles per kind, the resident memory of every server process over time and its growth
from the end of the warm-up (--warmup, and not before every kind ran once) to the end, and the
KV invariant once the server is idle
(available + evictable == total, nothing locked), then after a flush (available == total).
Exit status 0 only when there is no server_error, no lost and no unexpected request, the KV
invariant holds and the memory growth is below --max-rss-growth.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shlex
import sys
import tempfile
import threading
import time
from collections import defaultdict
from dataclasses import asdict, dataclass
from typing import Any, Callable

import psutil
import requests

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

TIMEOUT_S = 300.0  # per request: far above any answer the mix asks for
PROMPTS = [
    "The capital of France is", "Write a haiku about the sea.", "def fibonacci(n):",
    "List three primary colors:", "Translate 'good morning' into Spanish:",
    "Once upon a time, in a small village,", "The three laws of thermodynamics are",
    "Q: What is 17 + 25?\nA:",
]
# Shared by the long prompts, so that the radix cache holds and shares a long prefix.
LONG_PREFIX = ("You are a careful assistant. Answer briefly and precisely. " * 24).strip()
REGEX = r"(yes|no), because [a-z ]{1,30}\."
SCHEMA = {"type": "object", "properties": {"answer": {"type": "boolean"},
                                           "color": {"enum": ["red", "green", "blue"]}},
          "required": ["answer", "color"], "additionalProperties": False}
BAD_BODIES: list[tuple[str, Any]] = [
    ("/generate", {"text": ""}),
    ("/generate", {"text": "hi", "sampling_params": {"temperature": -1}}),
    ("/generate", {"text": "hi", "sampling_params": {"max_new_tokens": 10**9}}),
    ("/generate", {"input_ids": [10**9]}),
    ("/generate", {"text": "hi", "sampling_params": {"regex": "("}}),
    ("/generate", {"text": "hi", "no_such_field": 1}),
    ("/generate", b"{not json"),
    ("/v1/chat/completions", {"model": "default", "messages": "not a list"}),
    ("/v1/completions", {"model": "default", "prompt": "hi", "logprobs": 99}),
]


@dataclass
class Record:
    kind: str
    outcome: str  # ok | expected_error | disconnected | unexpected | server_error | lost
    start: float  # seconds since the soak began
    latency: float  # seconds
    status: int | None = None
    detail: str = ""


class Client:
    """One request of each kind; each returns (outcome, status, detail)."""

    def __init__(self, url: str, rng: random.Random) -> None:
        self.url = url
        self.rng = rng
        self.http = requests.Session()

    def _post(self, path: str, body: Any, **kw: Any) -> requests.Response:
        if isinstance(body, bytes):
            return self.http.post(self.url + path, data=body, timeout=TIMEOUT_S, **kw)
        return self.http.post(self.url + path, json=body, timeout=TIMEOUT_S, **kw)

    @staticmethod
    def _status(r: requests.Response) -> tuple[str, int, str] | None:
        """The outcome of a non-200 answer (None for a 200)."""
        if r.status_code == 200:
            return None
        kind = "server_error" if r.status_code >= 500 else "unexpected"
        return kind, r.status_code, r.text[:300]

    def _final(self, r: requests.Response,
               check: Callable[[dict[str, Any]], str | None] | None = None) -> tuple[str, int, str]:
        bad = self._status(r)
        if bad:
            return bad
        try:
            data = r.json()
        except ValueError:
            return "lost", r.status_code, "the answer is not JSON"
        for item in data if isinstance(data, list) else [data]:
            reason = item.get("meta_info", {}).get("finish_reason")
            if not isinstance(reason, dict) or reason.get("type") not in (
                    "length", "stop", "abort"):
                return "unexpected", 200, f"finish_reason {reason!r}"
            problem = check(item) if check else None
            if problem:
                return "unexpected", 200, problem
        return "ok", 200, ""

    def _params(self, lo: int, hi: int, **extra: Any) -> dict[str, Any]:
        return {"max_new_tokens": self.rng.randint(lo, hi),
                "temperature": self.rng.choice([0.0, 0.7]), **extra}

    def short(self) -> tuple[str, int | None, str]:
        return self._final(self._post("/generate", {
            "text": self.rng.choice(PROMPTS), "sampling_params": self._params(1, 8)}))

    def long(self) -> tuple[str, int | None, str]:
        text = f"{LONG_PREFIX}\n{self.rng.choice(PROMPTS)}"
        return self._final(self._post("/generate", {
            "text": text, "sampling_params": self._params(16, 32)}))

    def batch(self) -> tuple[str, int | None, str]:
        return self._final(self._post("/generate", {
            "text": self.rng.choice(PROMPTS),
            "sampling_params": self._params(4, 12, n=2, temperature=0.8)}))

    def stream(self, drop_after: int | None = None) -> tuple[str, int | None, str]:
        body = {"text": self.rng.choice(PROMPTS), "stream": True,
                "sampling_params": self._params(8, 24)}
        with self._post("/generate", body, stream=True) as r:
            bad = self._status(r)
            if bad:
                return bad
            chunks, finished = 0, False
            for line in r.iter_lines():
                if not line.startswith(b"data: "):
                    continue
                data = line[len(b"data: "):]
                if data == b"[DONE]":
                    return ("ok", 200, "") if finished else (
                        "unexpected", 200, "[DONE] before a finish_reason")
                event = json.loads(data)
                if "error" in event:
                    return "unexpected", 200, f"error event {event['error']}"
                chunks += 1
                finished = event["meta_info"]["finish_reason"] is not None
                if drop_after is not None and chunks >= drop_after:
                    r.close()  # the client goes away mid-stream
                    return "disconnected", 200, ""
            return "lost", 200, "the stream ended without [DONE]"

    def disconnect(self) -> tuple[str, int | None, str]:
        return self.stream(drop_after=self.rng.randint(1, 3))

    def abort(self) -> tuple[str, int | None, str]:
        rid = f"soak-abort-{self.rng.getrandbits(64):x}"
        result: dict[str, Any] = {}

        def generate() -> None:
            try:
                result["r"] = self._post("/generate", {
                    "text": f"{LONG_PREFIX}\n{self.rng.choice(PROMPTS)}", "rid": rid,
                    "sampling_params": {"max_new_tokens": 48, "ignore_eos": True}})
            except requests.RequestException as e:
                result["e"] = e

        t = threading.Thread(target=generate)
        t.start()
        time.sleep(self.rng.uniform(0.2, 1.5))
        a = requests.post(self.url + "/abort_request", json={"rid": rid}, timeout=TIMEOUT_S)
        t.join(TIMEOUT_S)
        if a.status_code not in (200, 404):  # 404: it was not running (yet, or any more)
            return ("server_error" if a.status_code >= 500 else "unexpected", a.status_code,
                    f"/abort_request: {a.text[:200]}")
        if "e" in result:
            raise result["e"]
        outcome, status, detail = self._final(result["r"])
        if outcome == "ok":  # did the abort land, or had the request finished already?
            reason = result["r"].json()["meta_info"]["finish_reason"]["type"]
            detail = "aborted" if reason == "abort" else "finished first"
        return outcome, status, detail

    def bad(self) -> tuple[str, int | None, str]:
        path, body = self.rng.choice(BAD_BODIES)
        r = self._post(path, body)
        if r.status_code >= 500:
            return "server_error", r.status_code, r.text[:300]
        try:
            err = r.json()["error"]
            ok = r.status_code == 400 and {"message", "type", "param", "code"} <= set(err)
        except (ValueError, KeyError, TypeError):
            ok = False
        if ok:
            return "expected_error", r.status_code, ""
        return "unexpected", r.status_code, f"{path} {body!r}: {r.text[:200]}"

    def regex(self) -> tuple[str, int | None, str]:
        def check(item: dict[str, Any]) -> str | None:
            done = item["meta_info"]["finish_reason"]["type"] == "stop"
            if done and not re.fullmatch(REGEX, item["text"]):
                return f"output {item['text']!r} does not match {REGEX!r}"
            return None

        return self._final(self._post("/generate", {
            "text": "Is the sky blue? Answer:",
            "sampling_params": {"max_new_tokens": 40, "regex": REGEX}}), check)

    def json_schema(self) -> tuple[str, int | None, str]:
        def check(item: dict[str, Any]) -> str | None:
            if item["meta_info"]["finish_reason"]["type"] != "stop":
                return None
            try:
                value = json.loads(item["text"])
            except ValueError:
                return f"output {item['text']!r} is not JSON"
            if set(value) != {"answer", "color"} or value["color"] not in (
                    "red", "green", "blue") or not isinstance(value["answer"], bool):
                return f"output {value!r} is outside the schema"
            return None

        return self._final(self._post("/generate", {
            "text": "Describe the sky as JSON:",
            "sampling_params": {"max_new_tokens": 40, "json_schema": SCHEMA}}), check)

    def chat(self) -> tuple[str, int | None, str]:
        r = self._post("/v1/chat/completions", {
            "model": "default", "max_tokens": self.rng.randint(4, 16),
            "messages": [{"role": "user", "content": self.rng.choice(PROMPTS)}]})
        bad = self._status(r)
        if bad:
            return bad
        try:
            reason = r.json()["choices"][0]["finish_reason"]
        except (ValueError, KeyError, IndexError):
            return "lost", 200, f"not a chat completion: {r.text[:200]}"
        return ("ok", 200, "") if reason in ("length", "stop") else (
            "unexpected", 200, f"finish_reason {reason!r}")


# kind -> weight
MIX: dict[str, int] = {"short": 6, "long": 3, "stream": 5, "disconnect": 2, "abort": 2,
                       "bad": 4, "regex": 2, "json_schema": 2, "chat": 2, "batch": 1}


def server_tree_rss(pid: int) -> dict[str, int]:
    """Resident bytes of the server process and every descendant, by 'name[pid]'."""
    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return {}
    out = {}
    for p in procs:
        try:
            out[f"{p.name()}[{p.pid}]"] = p.memory_info().rss
        except psutil.NoSuchProcess:
            pass
    return out


def percentiles(values: list[float]) -> dict[str, float]:
    if not values:
        return {}
    s = sorted(values)

    def q(f: float) -> float:
        return round(s[min(len(s) - 1, int(f * len(s)))], 4)

    return {"n": len(s), "p50": q(0.5), "p90": q(0.9), "p99": q(0.99), "max": round(s[-1], 4)}


def kv_check(url: str, idle_timeout: float = 120.0) -> dict[str, Any]:
    """The KV invariant once nothing runs or waits, and after a flush."""
    deadline = time.monotonic() + idle_timeout
    while True:
        info = requests.get(url + "/get_server_info", timeout=60).json()
        if info["num_running_reqs"] == 0 and info["num_waiting_reqs"] == 0:
            break
        if time.monotonic() > deadline:
            return {"ok": False, "reason": "still busy", "info": _kv_fields(info)}
        time.sleep(0.2)
    idle_ok = (info["available_kv_tokens"] + info["evictable_kv_tokens"]
               == info["max_total_num_tokens"] and info["locked_kv_tokens"] == 0)
    flush = requests.post(url + "/flush_cache", timeout=60)
    after = requests.get(url + "/get_server_info", timeout=60).json()
    flush_ok = flush.status_code == 200 and (
        after["available_kv_tokens"] == after["max_total_num_tokens"])
    return {"ok": idle_ok and flush_ok, "idle": _kv_fields(info),
            "after_flush": _kv_fields(after), "flush_status": flush.status_code}


def _kv_fields(info: dict[str, Any]) -> dict[str, Any]:
    keys = ("max_total_num_tokens", "available_kv_tokens", "evictable_kv_tokens",
            "locked_kv_tokens", "num_running_reqs", "num_waiting_reqs")
    return {k: info.get(k) for k in keys}


class Soak:
    def __init__(self, url: str, server_pid: int | None, duration: float, warmup: float,
                 concurrency: int, seed: int, rss_interval: float) -> None:
        self.url = url
        self.server_pid = server_pid
        self.duration = duration
        self.warmup = warmup
        self.concurrency = concurrency
        self.seed = seed
        self.rss_interval = rss_interval
        self.records: list[Record] = []
        self.rss: list[dict[str, Any]] = []
        self.lock = threading.Lock()
        self.t0 = 0.0
        self.kinds_done: set[str] = set()
        self.all_kinds_at: float | None = None  # seconds in, when every kind had run once

    def _worker(self, index: int) -> None:
        rng = random.Random(self.seed * 1000 + index)
        client = Client(self.url, rng)
        kinds, weights = list(MIX), list(MIX.values())
        # Every kind once first (spread over the workers), so that what is built on first use
        # (constraint compilers and their worker processes, caches) is built in the warm-up.
        first = kinds[index::self.concurrency]
        while time.monotonic() - self.t0 < self.duration:
            kind = first.pop(0) if first else rng.choices(kinds, weights)[0]
            start = time.monotonic()
            try:
                outcome, status, detail = getattr(client, kind)()
            except (requests.RequestException, ValueError) as e:  # no answer, or garbage
                outcome, status, detail = "lost", None, f"{type(e).__name__}: {e}"[:300]
            rec = Record(kind, outcome, round(start - self.t0, 3),
                         round(time.monotonic() - start, 4), status, detail)
            with self.lock:
                self.records.append(rec)
                self.kinds_done.add(kind)
                if self.all_kinds_at is None and self.kinds_done == set(MIX):
                    self.all_kinds_at = rec.start + rec.latency

    def _sample_rss(self, stop: threading.Event) -> None:
        while not stop.is_set():
            by_proc = server_tree_rss(self.server_pid) if self.server_pid else {}
            if by_proc:
                try:  # what malloc holds in the model process (free_mb: pages not given back)
                    heap = requests.get(self.url + "/get_server_info", timeout=30).json()["heap"]
                except (requests.RequestException, ValueError, KeyError):
                    heap = None
                self.rss.append({"t": round(time.monotonic() - self.t0, 1),
                                 "total_mb": round(sum(by_proc.values()) / 2**20, 1),
                                 "by_process_mb": {k: round(v / 2**20, 1)
                                                   for k, v in by_proc.items()},
                                 "model_heap": heap})
            stop.wait(self.rss_interval)

    def run(self) -> dict[str, Any]:
        self.t0 = time.monotonic()
        stop = threading.Event()
        sampler = threading.Thread(target=self._sample_rss, args=(stop,), daemon=True)
        sampler.start()
        workers = [threading.Thread(target=self._worker, args=(i,))
                   for i in range(self.concurrency)]
        for w in workers:
            w.start()
        for w in workers:
            w.join()
        elapsed = time.monotonic() - self.t0
        kv = kv_check(self.url)
        stop.set()
        sampler.join()
        return self.report(elapsed, kv)

    def report(self, elapsed: float, kv: dict[str, Any]) -> dict[str, Any]:
        counts: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
        latency: dict[str, list[float]] = defaultdict(list)
        for r in self.records:
            counts[r.kind][r.outcome] += 1
            if r.outcome in ("ok", "expected_error"):
                latency[r.kind].append(r.latency)
        outcomes: dict[str, int] = defaultdict(int)
        for r in self.records:
            outcomes[r.outcome] += 1
        problems = [asdict(r) for r in self.records
                    if r.outcome in ("unexpected", "server_error", "lost")]
        rss = self._rss_summary()
        return {
            "url": self.url, "duration_s": round(elapsed, 1), "concurrency": self.concurrency,
            "seed": self.seed, "requests": len(self.records), "outcomes": dict(outcomes),
            "server_errors": outcomes["server_error"], "lost": outcomes["lost"],
            "unexpected": outcomes["unexpected"],
            "by_kind": {k: dict(v) for k, v in counts.items()},
            "aborts_landed": sum(r.detail == "aborted" for r in self.records),
            "latency_s": {k: percentiles(v) for k, v in latency.items()},
            "problems": problems[:50], "kv": kv, "rss": rss,
        }

    def _rss_summary(self) -> dict[str, Any]:
        samples = [s for s in self.rss if s["total_mb"] > 0]
        if not samples:
            return {"samples": [], "growth": None}
        # The baseline: the first sample after the warm-up and after every kind ran once.
        warmup = max(self.warmup, self.all_kinds_at or self.duration)
        after = [s for s in samples if s["t"] >= warmup] or samples[-1:]
        base, end = after[0]["total_mb"], samples[-1]["total_mb"]
        return {"samples": samples, "warmup_s": round(warmup, 1), "after_warmup_mb": base,
                "end_mb": end, "growth": round(end / base - 1.0, 4)}


def cli_kwargs(text: str) -> dict[str, Any]:
    """'--device cpu --disable-radix-cache' -> {"device": "cpu", "disable_radix_cache": True}."""
    tokens = shlex.split(text)
    out: dict[str, Any] = {}
    for i, tok in enumerate(tokens):
        if not tok.startswith("--"):
            continue
        value = tokens[i + 1] if i + 1 < len(tokens) and not tokens[i + 1].startswith("--") \
            else True
        out[tok[2:].replace("-", "_")] = value
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base-url", default=None, help="a running server (default: launch one)")
    p.add_argument("--server-pid", type=int, default=None,
                   help="pid of the --base-url server, to sample its processes' memory")
    p.add_argument("--model-path", default=None, help="launched server's model (default: "
                   "SmolLM2-135M-Instruct)")
    p.add_argument("--server-args", default="--device cpu --dtype float32 --max-total-tokens "
                   "8192", help="extra arguments of the launched server")
    p.add_argument("--duration", type=float, default=120.0, help="seconds of load")
    p.add_argument("--warmup", type=float, default=None,
                   help="seconds before the memory baseline (default: a quarter of --duration)")
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--rss-interval", type=float, default=5.0)
    p.add_argument("--max-rss-growth", type=float, default=0.10)
    p.add_argument("--out", default=None, help="write the report here as JSON")
    a = p.parse_args(argv)

    server = None
    url, pid = a.base_url, a.server_pid
    if url is None:
        from benchmarks.launch import launch_server
        from srt.default_model import ensure_default_model
        from srt.utils import free_port

        model = a.model_path or ensure_default_model()
        log_path = os.path.join(tempfile.mkdtemp(prefix="srt-soak-"), "server.log")
        server = launch_server(model, cli_kwargs(a.server_args), free_port(), log_path)
        url, pid = server.url, server.proc.pid
    try:
        soak = Soak(url, pid, a.duration, a.warmup if a.warmup is not None else a.duration / 4,
                    a.concurrency, a.seed, a.rss_interval)
        report = soak.run()
    finally:
        if server is not None:
            server.stop()
    if server is not None:
        report["server_exit_code"] = server.proc.returncode
        report["server_log"] = server.log_path
    growth = report["rss"]["growth"]
    report["passed"] = bool(
        report["server_errors"] == 0 and report["lost"] == 0 and report["unexpected"] == 0
        and report["kv"]["ok"] and (growth is None or growth < a.max_rss_growth)
        and report.get("server_exit_code", 0) == 0)
    if a.out:
        with open(a.out, "w") as f:
            json.dump(report, f, indent=1)
    print(json.dumps({k: v for k, v in report.items()
                      if k not in ("problems", "rss")}, indent=1))
    print(f"rss: {report['rss'].get('after_warmup_mb')} MB after warm-up -> "
          f"{report['rss'].get('end_mb')} MB at the end (growth {growth})")
    for prob in report["problems"][:10]:
        print("problem:", prob)
    return 0 if report["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
