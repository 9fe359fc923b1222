"""End to end on the real server: greedy equals transformers, prefix caching, concurrency,
streaming and aborts on disconnect."""

from __future__ import annotations

import concurrent.futures as cf
import json
import os
import re
import socket
import time
from typing import Any

import pytest
import requests

PLAIN_PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village by the sea,",
    "The three primary colors are",
]
CHAT_MESSAGES = [
    "What is the boiling point of water?",
    "Write a haiku about the moon.",
    "List three fruits.",
    "Explain gravity in one sentence.",
]
NEW_TOKENS = 48


def _chat_ids(tokenizer: Any, content: str) -> list[int]:
    ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": content}], add_generation_prompt=True
    )
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


@pytest.fixture(scope="module")
def prompt_ids(smollm2_tokenizer: Any) -> list[list[int]]:
    plain = [smollm2_tokenizer.encode(p) for p in PLAIN_PROMPTS]
    chat = [_chat_ids(smollm2_tokenizer, m) for m in CHAT_MESSAGES]
    return plain + chat


@pytest.fixture(scope="module")
def transformers_greedy(prompt_ids: list[list[int]]) -> list[list[int]]:
    """The oracle: transformers' own greedy generation on the same GGUF, EOS ignored."""
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig

    from srt.default_model import gguf_path

    path = gguf_path()
    model = AutoModelForCausalLM.from_pretrained(
        os.path.dirname(path), gguf_file=os.path.basename(path), dtype=torch.float32
    )
    model.generation_config.eos_token_id = None
    model.config.eos_token_id = None
    config = GenerationConfig(max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None,
                              pad_token_id=0)
    out = []
    with torch.no_grad():
        for ids in prompt_ids:
            x = torch.tensor([ids])
            y = model.generate(x, attention_mask=torch.ones_like(x), generation_config=config)
            out.append(y[0, len(ids):].tolist())
    return out


GREEDY = {"temperature": 0, "max_new_tokens": NEW_TOKENS, "ignore_eos": True}


def test_greedy_matches_transformers(server: Any, prompt_ids: list[list[int]],
                                     transformers_greedy: list[list[int]],
                                     smollm2_tokenizer: Any) -> None:
    # one batch request with all eight prompts
    results = server.generate({"input_ids": prompt_ids, "sampling_params": GREEDY})
    assert [r["output_ids"] for r in results] == transformers_greedy
    for r, ref in zip(results, transformers_greedy):
        assert r["meta_info"]["finish_reason"] == {"type": "length", "length": NEW_TOKENS}
        assert r["meta_info"]["completion_tokens"] == NEW_TOKENS
        assert r["text"] == smollm2_tokenizer.decode(ref, skip_special_tokens=True)
    # and the plain prompts once more as text, one request each
    for text, ref in zip(PLAIN_PROMPTS, transformers_greedy):
        r = server.generate({"text": text, "sampling_params": GREEDY})
        assert r["output_ids"] == ref


def test_same_prompt_twice_is_cached(server: Any) -> None:
    body = {"text": "Tell me a story about a brave little robot who learns to paint.",
            "sampling_params": {"temperature": 0, "max_new_tokens": 16}}
    first = server.generate(body)
    second = server.generate(body)
    assert second["text"] == first["text"]
    assert second["output_ids"] == first["output_ids"]
    meta = second["meta_info"]
    assert meta["cached_tokens"] >= meta["prompt_tokens"] - 1


def test_shared_prefix_is_reused(server: Any, smollm2_tokenizer: Any) -> None:
    words = " ".join(f"item{i}" for i in range(200))
    prefix_ids = smollm2_tokenizer.encode(words)[:120]
    assert len(prefix_ids) == 120
    a = prefix_ids + smollm2_tokenizer.encode(" and so the first list ends.")
    b = prefix_ids + smollm2_tokenizer.encode(" but the second one goes on.")
    params = {"temperature": 0, "max_new_tokens": 4}
    server.generate({"input_ids": a, "sampling_params": params})
    second = server.generate({"input_ids": b, "sampling_params": params})
    assert second["meta_info"]["cached_tokens"] >= 100


def test_radix_cache_disabled_still_correct(smollm2_dir: str) -> None:
    from tests.conftest import BASE_ARGS, ServerProcess

    srv = ServerProcess([*BASE_ARGS, "--max-total-tokens", "4096", "--disable-radix-cache"])
    srv.start()
    try:
        body = {"text": "The capital of France is", "sampling_params": GREEDY}
        first, second = srv.generate(body), srv.generate(body)
        assert first["output_ids"] == second["output_ids"]
        assert second["meta_info"]["cached_tokens"] == 0
        # jump-forward needs no cache: the jumping request keeps its KV in the decode batch
        rx = r"The answer is (yes|no)\. It is (red|green|blue)\."
        con = srv.generate({"text": "Is the sky blue?", "sampling_params": {
            "temperature": 0, "max_new_tokens": 32, "regex": rx}})
        assert re.fullmatch(rx, con["text"]), con["text"]
        assert con["meta_info"]["forward_passes"] < con["meta_info"]["completion_tokens"]
        assert srv.server_info()["jump_forwards"] >= 2
        info = srv.wait_idle()
        assert info["evictable_kv_tokens"] == 0
        assert info["available_kv_tokens"] == info["max_total_num_tokens"]
    finally:
        srv.stop()


def _mixed_requests(tokenizer: Any) -> list[dict[str, Any]]:
    topics = ["cats", "the ocean", "mountains", "coffee", "trains", "music", "rain", "stars"]
    reqs = []
    for i in range(32):
        words = " ".join(f"{topics[(i + k) % len(topics)]}" for k in range(1 + (i * 7) % 40))
        reqs.append({
            "text": f"Request {i}: write about {words}.",
            "sampling_params": {"temperature": 0, "max_new_tokens": 4 + (i * 5) % 21,
                                "ignore_eos": True},
        })
    return reqs


def test_32_concurrent_requests_match_alone(server: Any, smollm2_tokenizer: Any) -> None:
    reqs = _mixed_requests(smollm2_tokenizer)
    requests.post(server.url + "/flush_cache", timeout=30)
    alone = [server.generate(r)["output_ids"] for r in reqs]
    requests.post(server.url + "/flush_cache", timeout=30)
    with cf.ThreadPoolExecutor(32) as pool:
        together = list(pool.map(lambda r: server.generate(r)["output_ids"], reqs))
    for i, (a, t) in enumerate(zip(alone, together)):
        assert t == a, f"request {i} differs when batched"
        assert len(t) == reqs[i]["sampling_params"]["max_new_tokens"]


def _sse_events(resp: requests.Response) -> list[Any]:
    events = []
    for line in resp.iter_lines():
        if not line:
            continue
        assert line.startswith(b"data: "), line
        payload = line[len(b"data: "):]
        events.append("[DONE]" if payload == b"[DONE]" else json.loads(payload))
    return events


def test_stream_last_chunk_equals_non_streamed(server: Any) -> None:
    body = {"text": "Write a short poem about autumn leaves.",
            "sampling_params": {"temperature": 0, "max_new_tokens": 24, "ignore_eos": True}}
    full = server.generate(body)
    with requests.post(server.url + "/generate", json={**body, "stream": True}, stream=True,
                       timeout=120) as resp:
        assert resp.status_code == 200
        assert resp.headers["content-type"].startswith("text/event-stream")
        events = _sse_events(resp)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert len(chunks) == 24  # stream_interval 1: one chunk per token
    for prev, cur in zip(chunks, chunks[1:]):  # cumulative
        assert cur["output_ids"][: len(prev["output_ids"])] == prev["output_ids"]
    assert chunks[-1]["text"] == full["text"]
    assert chunks[-1]["output_ids"] == full["output_ids"]
    assert chunks[-1]["meta_info"]["finish_reason"] == {"type": "length", "length": 24}


def _wait_released(server: Any, timeout: float) -> float:
    start = time.monotonic()
    while time.monotonic() - start < timeout:
        info = server.server_info()
        if (info["num_running_reqs"] == 0 and info["num_waiting_reqs"] == 0
                and info["locked_kv_tokens"] == 0
                and info["available_kv_tokens"] + info["evictable_kv_tokens"]
                == info["max_total_num_tokens"]):
            return time.monotonic() - start
        time.sleep(0.05)
    raise AssertionError(f"request not released within {timeout} s: {server.server_info()}")


def test_stream_disconnect_aborts_and_releases(server: Any) -> None:
    body = {"text": "Count from one to one thousand in words:", "stream": True,
            "sampling_params": {"temperature": 0, "max_new_tokens": 2000, "ignore_eos": True}}
    resp = requests.post(server.url + "/generate", json=body, stream=True, timeout=60)
    lines = resp.iter_lines()
    got = 0
    for line in lines:
        if line:
            got += 1
        if got >= 3:
            break
    assert server.server_info()["num_running_reqs"] == 1
    resp.close()  # the client goes away mid-stream
    assert _wait_released(server, timeout=2.0) <= 2.0


def test_non_stream_disconnect_aborts_and_releases(server: Any) -> None:
    body = json.dumps({"text": "Count from one to one thousand in words:",
                       "sampling_params": {"temperature": 0, "max_new_tokens": 2000,
                                           "ignore_eos": True}}).encode()
    sock = socket.create_connection(("127.0.0.1", server.port))
    sock.sendall(
        b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        + f"Content-Length: {len(body)}\r\n\r\n".encode() + body
    )
    deadline = time.monotonic() + 30
    while server.server_info()["num_running_reqs"] == 0:
        assert time.monotonic() < deadline, "request never started"
        time.sleep(0.05)
    sock.close()
    assert _wait_released(server, timeout=2.0) <= 2.0
