"""Long prompts without stalls, over HTTP on the real server (SmolLM2, float32, CPU):

- with chunked prefill (chunks of 32 tokens, mixed steps), a long prompt arriving while 4
  streams decode keeps them moving: while it is prefilled their mean gap stays within a few of
  their median gaps, no gap comes near the whole prefill's length, and their outputs equal
  those of the same requests run alone; with chunking off, the same run stalls the streams for
  the whole prefill (the contrast that shows the measure can fail). The mean is the tight
  bound because a 2-core machine can pause every process at once for a fraction of a second;
  one such pause is a single gap of several steps, which the max bound tolerates;
- with --stream-interval 1, a stream of 64 tokens arrives as 64 separate events spread over the
  decode (not in bursts of a round's steps), then [DONE].
"""

from __future__ import annotations

import json
import random
import statistics
import threading
import time
from typing import Any

import requests

from tests.conftest import BASE_ARGS, ServerProcess

STREAMS = 4
STREAM_TOKENS = 96
LONG_PROMPT = 1200
GAP_FACTOR = 4.0  # "a few decode steps": bound on the mean gap during the long prefill
STALL_FACTOR = 10.0  # bound on any gap; unchunked, the 1200-token prefill is ~35 median gaps


def _stream(url: str, body: dict[str, Any]) -> tuple[list[float], list[int]]:
    """Arrival time of every SSE event with new tokens, and the final output ids."""
    times: list[float] = []
    ids: list[int] = []
    with requests.post(url + "/generate", json={**body, "stream": True}, stream=True,
                       timeout=600) as resp:
        assert resp.status_code == 200
        for line in resp.iter_lines():
            if not line or line == b"data: [DONE]":
                continue
            event = json.loads(line[len(b"data: "):])
            if len(event["output_ids"]) > len(ids):
                times.append(time.monotonic())
                ids = event["output_ids"]
    return times, ids


def _bodies() -> tuple[list[dict[str, Any]], dict[str, Any]]:
    rng = random.Random(3)
    greedy = {"temperature": 0, "max_new_tokens": STREAM_TOKENS, "ignore_eos": True}
    streams = [{"input_ids": [rng.randrange(300, 5000) for _ in range(20)],
                "sampling_params": greedy} for _ in range(STREAMS)]
    long = {"input_ids": [rng.randrange(300, 5000) for _ in range(LONG_PROMPT)],
            "sampling_params": {"temperature": 0, "max_new_tokens": 4, "ignore_eos": True}}
    return streams, long


def _run(server: ServerProcess
         ) -> tuple[list[float], list[float], list[float], list[list[int]]]:
    """Each stream's max gap, median gap and mean gap while the long prompt was in the
    server (from the first event after it was sent to the first after it returned), and
    their outputs."""
    streams, long = _bodies()
    results: list[Any] = [None] * STREAMS

    def run(i: int) -> None:
        results[i] = _stream(server.url, streams[i])

    threads = [threading.Thread(target=run, args=(i,)) for i in range(STREAMS)]
    for t in threads:
        t.start()
    time.sleep(1.5)  # the streams are decoding
    sent = time.monotonic()
    assert server.generate(long)["meta_info"]["completion_tokens"] == 4
    returned = time.monotonic()
    for t in threads:
        t.join()
    maxima, medians, during = [], [], []
    for times, ids in results:
        gaps = [b - a for a, b in zip(times, times[1:])]
        assert len(ids) == STREAM_TOKENS
        maxima.append(max(gaps))
        medians.append(statistics.median(gaps))
        first = next(i for i, t in enumerate(times) if t >= sent)
        # (or the stream's last event, should it end first)
        last = next((i for i, t in enumerate(times) if t >= returned), len(times) - 1)
        assert last > first, "the stream ended before the long prompt was served"
        during.append((times[last] - times[first]) / (last - first))
    return maxima, medians, during, [ids for _, ids in results]


def test_long_prompt_does_not_stall_streams(smollm2_dir: str) -> None:
    streams, _ = _bodies()
    chunked = ServerProcess([*BASE_ARGS, "--chunked-prefill-size", "32",
                             "--enable-mixed-chunk"]).start()
    try:
        alone = [chunked.generate(b)["output_ids"] for b in streams]
        maxima, medians, during, outputs = _run(chunked)
        info = chunked.server_info()
        chunked.assert_kv_invariant()
    finally:
        chunked.stop()
    assert info["prefill_chunks"] >= LONG_PROMPT // 32 - 1, info["prefill_chunks"]
    assert info["mixed_fill_steps"] > 0
    assert outputs == alone
    for m, med, mean in zip(maxima, medians, during):
        assert mean <= GAP_FACTOR * med, (during, medians)
        assert m <= STALL_FACTOR * med, (maxima, medians)

    plain = ServerProcess([*BASE_ARGS, "--chunked-prefill-size", "-1"]).start()
    try:
        maxima, medians, during, outputs = _run(plain)
    finally:
        plain.stop()
    assert outputs == alone
    assert max(m / med for m, med in zip(maxima, medians)) > STALL_FACTOR, (maxima, medians)
    assert max(mean / med for mean, med in zip(during, medians)) > GAP_FACTOR, (during, medians)


def test_stream_interval_one_sends_every_token_on_its_own(server: ServerProcess) -> None:
    body = {"input_ids": [random.Random(9).randrange(300, 5000) for _ in range(12)],
            "sampling_params": {"temperature": 0, "max_new_tokens": 64, "ignore_eos": True}}
    events: list[tuple[float, int]] = []
    done = False
    with requests.post(server.url + "/generate", json={**body, "stream": True}, stream=True,
                       timeout=600) as resp:
        for line in resp.iter_lines():
            if not line:
                continue
            if line == b"data: [DONE]":
                done = True
                continue
            events.append((time.monotonic(),
                           len(json.loads(line[len(b"data: "):])["output_ids"])))
    assert done
    assert [n for _, n in events] == list(range(1, 65))  # one event per token
    # Each arrives when its step is read: no bursts of several steps' tokens at once (a CPU
    # decode step takes tens of milliseconds).
    gaps = [b - a for (a, _), (b, _) in zip(events, events[1:])]
    bursts = sum(g < 0.005 for g in gaps)
    assert bursts <= len(gaps) // 10, sorted(gaps)[:20]
