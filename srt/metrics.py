"""Prometheus metrics of the HTTP process, served on `/metrics`.

prometheus-client is imported lazily: without it the server runs and `/metrics` answers 503.

- `srt_http_requests_total{endpoint, status}`: every answer, errors included (401, 413, ...);
  `endpoint` is a route path, or `other` for paths with no route (bounded label values).
- `srt_time_to_first_token_seconds`, `srt_inter_token_latency_seconds`: streamed requests only
  (a non-streamed request's tokens reach this process all at once when it finishes).
- `srt_e2e_request_latency_seconds`, `srt_prompt_tokens_total`, `srt_generation_tokens_total`:
  every finished request (per sample).
- `srt_num_running_reqs`, `srt_num_waiting_reqs`, `srt_kv_cache_usage_ratio` (KV tokens held
  by requests, neither free nor evictable cache, over the pool) and `srt_cache_hit_rate`
  (cached / prompt tokens since start): read from the model process (the `/get_server_info`
  stats) when `/metrics` is scraped.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from srt.managers.io_struct import StrOut

_LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0,
                    120.0, 300.0)


@dataclass
class _Timing:
    start: float
    last: float
    stream: bool
    tokens_seen: bool = False


class ServerMetrics:
    """The metric objects, on a registry of their own, and the request observer that feeds them
    (TokenizerManager calls on_submit / on_output / on_done)."""

    def __init__(self, prom: Any) -> None:
        self.prom = prom
        self.registry = prom.CollectorRegistry()
        reg = self.registry
        self.requests = prom.Counter("srt_http_requests", "HTTP answers by route and status.",
                                     ["endpoint", "status"], registry=reg)
        self.ttft = prom.Histogram("srt_time_to_first_token_seconds",
                                   "Time to the first token (streamed requests).",
                                   buckets=_LATENCY_BUCKETS, registry=reg)
        self.itl = prom.Histogram("srt_inter_token_latency_seconds",
                                  "Time between tokens (streamed requests).",
                                  buckets=_LATENCY_BUCKETS, registry=reg)
        self.e2e = prom.Histogram("srt_e2e_request_latency_seconds",
                                  "Submission to finish, per sample.", buckets=_LATENCY_BUCKETS,
                                  registry=reg)
        self.prompt_tokens = prom.Counter("srt_prompt_tokens", "Prompt tokens of finished "
                                          "requests.", registry=reg)
        self.generation_tokens = prom.Counter("srt_generation_tokens", "Generated tokens of "
                                              "finished requests.", registry=reg)
        self.running = prom.Gauge("srt_num_running_reqs", "Requests running in the model "
                                  "process.", registry=reg)
        self.waiting = prom.Gauge("srt_num_waiting_reqs", "Requests waiting in the model "
                                  "process.", registry=reg)
        self.kv_usage = prom.Gauge("srt_kv_cache_usage_ratio", "KV tokens held by requests "
                                   "over the pool size.", registry=reg)
        self.hit_rate = prom.Gauge("srt_cache_hit_rate", "Prompt tokens found in the prefix "
                                   "cache over all prompt tokens, since start.", registry=reg)
        # Speculative decoding (0 while it is off): SGLang's names.
        self.spec_accept_length = prom.Gauge(
            "srt_spec_accept_length", "Output tokens per request and verification step, the "
            "token after the accepted drafts included, since start.", registry=reg)
        self.spec_accept_rate = prom.Gauge(
            "srt_spec_accept_rate", "Accepted over proposed draft tokens, since start.",
            registry=reg)
        self.spec_verify_steps = prom.Gauge(
            "srt_spec_verify_steps", "Verification steps run since start.", registry=reg)
        self._timings: dict[str, _Timing] = {}

    @classmethod
    def create(cls) -> "ServerMetrics | None":
        """None when prometheus-client is not installed."""
        try:
            import prometheus_client
        except ImportError:
            return None
        return cls(prometheus_client)

    # ------------------------------------------------------------- request observer

    def on_submit(self, rid: str, stream: bool) -> None:
        now = time.monotonic()
        self._timings[rid] = _Timing(now, now, stream)

    def on_output(self, rid: str, out: StrOut, text: str) -> None:
        t = self._timings.get(rid)
        if t is None:
            return
        now = time.monotonic()
        if t.stream and out.new_ids:
            if not t.tokens_seen:
                self.ttft.observe(now - t.start)
                rest = len(out.new_ids) - 1
            else:
                rest = len(out.new_ids)
            for _ in range(rest):  # a chunk of k tokens: k gaps of equal share
                self.itl.observe((now - t.last) / len(out.new_ids))
            t.tokens_seen = True
            t.last = now
        if out.finish_reason is not None:
            self.e2e.observe(now - t.start)
            self.prompt_tokens.inc(out.prompt_tokens)
            self.generation_tokens.inc(out.completion_tokens)
            del self._timings[rid]

    def on_done(self, rid: str) -> None:
        self._timings.pop(rid, None)

    # ------------------------------------------------------------- scrape

    def observe_answer(self, endpoint: str, status: int) -> None:
        self.requests.labels(endpoint, str(status)).inc()

    def update_model_stats(self, stats: dict[str, Any]) -> None:
        self.running.set(stats["num_running_reqs"])
        self.waiting.set(stats["num_waiting_reqs"])
        total = max(1, stats["max_total_num_tokens"])
        free = stats["available_kv_tokens"] + stats["evictable_kv_tokens"]
        self.kv_usage.set(max(0.0, (total - free) / total))
        self.hit_rate.set(stats["cache_hit_rate"])
        spec = stats.get("speculative") or {}
        self.spec_accept_length.set(spec.get("accept_length", 0.0))
        self.spec_accept_rate.set(spec.get("accept_rate", 0.0))
        self.spec_verify_steps.set(spec.get("verify_steps", 0))

    def render(self) -> tuple[bytes, str]:
        return self.prom.generate_latest(self.registry), self.prom.CONTENT_TYPE_LATEST


class MetricsMiddleware:
    """Counts every answer by route and status (outermost, so refused requests count too)."""

    def __init__(self, app: Any, metrics: ServerMetrics, routes: Any) -> None:
        self.app = app
        self.metrics = metrics
        self.routes = routes  # () -> the app's route paths; read at each request (routes grow)

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        from srt.http.auth import normalize_path

        path = normalize_path(scope["path"])
        endpoint = path if path in self.routes() else "other"
        status = 500

        async def record(message: dict[str, Any]) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, record)
        finally:
            self.metrics.observe_answer(endpoint, status)
