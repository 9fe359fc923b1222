"""One streamed request against a running server (aiohttp), timed token by token.

`/generate` streams cumulative `output_ids`, so each chunk's new token count is exact;
`/v1/completions` streams text deltas, and the token counts come from its final usage chunk.
An inter-token latency is the gap between two consecutive chunks that brought new output (with
`--stream-interval 1`, one token each).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any, AsyncIterator


@dataclass(frozen=True)
class RequestSpec:
    """What to send: a prompt (token ids or text) and how many tokens to ask for."""

    prompt: list[int] | str
    output_len: int


@dataclass
class RequestResult:
    """What came back. Times are seconds from the request's send (`start`, perf_counter)."""

    ok: bool = False
    error: str = ""
    start: float = 0.0
    ttft: float = 0.0
    e2e: float = 0.0
    prompt_tokens: int = 0
    output_tokens: int = 0
    cached_tokens: int = 0
    itl: list[float] = field(default_factory=list)


async def _sse_events(resp: Any) -> AsyncIterator[tuple[float, Any]]:
    """(arrival time, parsed JSON) per `data:` event until `[DONE]`."""
    async for raw in resp.content:
        line = raw.strip()
        if not line.startswith(b"data:"):
            continue
        data = line[5:].strip()
        if data == b"[DONE]":
            return
        yield time.perf_counter(), json.loads(data)


def _body(endpoint: str, spec: RequestSpec, model: str) -> dict[str, Any]:
    if endpoint == "generate":
        key = "input_ids" if isinstance(spec.prompt, list) else "text"
        return {key: spec.prompt, "stream": True, "sampling_params": {
            "max_new_tokens": spec.output_len, "temperature": 0, "ignore_eos": True}}
    return {"model": model, "prompt": spec.prompt, "max_tokens": spec.output_len,
            "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}


async def send_request(session: Any, base_url: str, endpoint: str, spec: RequestSpec,
                       model: str = "default") -> RequestResult:
    """POST one streamed request; never raises for a failed request (ok=False, error set)."""
    path = "/generate" if endpoint == "generate" else "/v1/completions"
    res = RequestResult(start=time.perf_counter())
    last = res.start
    seen = 0  # output tokens so far (generate) / chunks with text (completions)
    try:
        async with session.post(base_url + path, json=_body(endpoint, spec, model)) as resp:
            if resp.status != 200:
                res.error = f"HTTP {resp.status}: {(await resp.text())[:200]}"
                return res
            async for now, ev in _sse_events(resp):
                if "error" in ev:
                    res.error = str(ev["error"])
                    return res
                if endpoint == "generate":
                    n = len(ev["output_ids"])
                    meta = ev["meta_info"]
                    res.prompt_tokens = meta["prompt_tokens"]
                    res.cached_tokens = meta["cached_tokens"]
                    res.output_tokens = meta["completion_tokens"]
                    new = n > seen
                    seen = max(seen, n)
                else:
                    if ev.get("usage"):
                        res.prompt_tokens = ev["usage"]["prompt_tokens"]
                        res.output_tokens = ev["usage"]["completion_tokens"]
                    choices = ev.get("choices") or []
                    new = bool(choices and choices[0].get("text"))
                if new:
                    if res.ttft == 0.0:
                        res.ttft = now - res.start
                    else:
                        res.itl.append(now - last)
                    last = now
        res.e2e = time.perf_counter() - res.start
        res.ok = res.output_tokens > 0
        if not res.ok:
            res.error = "no output tokens"
    except Exception as e:  # a benchmark reports failures rather than dying on the first
        res.error = f"{type(e).__name__}: {e}"
    return res
