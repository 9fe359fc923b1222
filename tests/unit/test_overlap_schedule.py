"""The overlapped loop (the default; --disable-overlap-schedule turns it off): decode steps
launched with the previous step's ids still on the device give the plain loop's greedy tokens,
finish reasons and KV accounting."""

from __future__ import annotations

import random
import tempfile
from typing import Any

import pytest

from benchmarks.common import write_shape_dir
from srt.managers.io_struct import TokenizedGenerateReq
from srt.model_process.loop import ModelProcess
from tests.model_process import cpu_model_server, kv_is_free, serve_all

N = 8  # requests


@pytest.fixture(scope="module")
def model_dir(smollm2_dir: str) -> str:
    """The real SmolLM2 (a random tiny model repeats one token forever, so stops never fire
    mid-way)."""
    return smollm2_dir


@pytest.fixture(scope="module")
def tiny_dir() -> str:
    return write_shape_dir("tiny", tempfile.mkdtemp(prefix="srt-overlap-"))


def _server(path: str, overlap: bool, dummy: bool = False) -> ModelProcess:
    return cpu_model_server(path, dummy, disable_overlap_schedule=not overlap)


def _serve(server: ModelProcess, reqs: list[TokenizedGenerateReq]) -> dict[str, Any]:
    """rid -> (all ids, finish reason, forward passes) once every request is done."""
    return {rid: ([i for t in outs for i in t.new_ids], outs[-1].finish_reason,
                  outs[-1].forward_passes, outs[-1].completion_tokens)
            for rid, outs in serve_all(server, reqs).items()}


def _requests(vocab: int, stops: dict[int, int] | None, stream: bool) -> list:
    rng = random.Random(5)
    reqs = []
    for i in range(N):
        # English-like prompts from a small id range of common tokens keep outputs varied
        ids = [rng.randrange(300, min(vocab, 5000)) for _ in range(rng.randrange(3, 40))]
        params: dict[str, Any] = {"temperature": 0, "max_new_tokens": [1, 2, 3, 5, 9, 17][i % 6]
                                  + (8 if stops is None or i in stops else 0),
                                  "ignore_eos": True}
        if stops and i in stops:
            params["stop_token_ids"] = [stops[i]]
        reqs.append(TokenizedGenerateReq(f"r{i}", ids, params, stream=stream and i % 2 == 0))
    return reqs


def test_overlap_equals_plain_loop(model_dir: str, monkeypatch: Any) -> None:
    stream = True  # every other request streams
    plain, overlap = _server(model_dir, False), _server(model_dir, True)
    vocab = plain.config.vocab_size
    # Stop ids taken from the plain run's own output, so that stops fire mid-way.
    first = _serve(plain, _requests(vocab, None, stream))
    stops: dict[int, int] = {}
    for i in range(N):
        ids = first[f"r{i}"][0]
        # a token the output first writes at index 2 or later: the stop fires in a decode step
        late = [t for j, t in enumerate(ids) if j >= 2 and t not in ids[:j]]
        if late:
            stops[i] = late[0]
    assert len(stops) >= 3, first
    want = _serve(plain, _requests(vocab, stops, stream))
    assert plain.stats()["overlapped_decode_steps"] == 0  # the plain server never overlaps
    got = _serve(overlap, _requests(vocab, stops, stream))
    assert overlap.stats()["overlapped_decode_steps"] > 0, "the overlapped loop did not run"
    assert got == want
    assert any(r[1]["type"] == "stop" for r in got.values())
    assert kv_is_free(plain) and kv_is_free(overlap)


def test_penalties_wait_for_the_host(tiny_dir: str) -> None:
    """Penalties read the output so far: such a batch is never launched before the previous
    step's ids are on the host. Seeds and min_new_tokens are (their positions count the step
    in flight), with the plain loop's tokens."""
    overlap, plain = _server(tiny_dir, True, dummy=True), _server(tiny_dir, False, dummy=True)
    vocab = overlap.config.vocab_size
    for extra, chained in (({"frequency_penalty": 0.5}, False), ({"min_new_tokens": 10}, True),
                           ({"seed": 3, "temperature": 0.8}, True)):
        before = overlap.stats()["overlapped_decode_steps"]
        results = []
        for server in (overlap, plain):
            reqs = _requests(vocab, None, False)[:3]
            for r in reqs:
                r.sampling_params.update(extra, max_new_tokens=12)
            results.append(_serve(server, reqs))
        assert results[0] == results[1], extra
        assert (overlap.stats()["overlapped_decode_steps"] > before) == chained, extra
    assert kv_is_free(overlap) and kv_is_free(plain)


def test_mixed_batches_equal(model_dir: str, smollm2_tokenizer: Any) -> None:
    """A mixed workload (finishing requests at every length, stop ids, n = 2, logprobs, seeds,
    a regex with jump-forward, a stop string): the same ids, finish reasons, token counts and
    logprobs with and without overlap. (Retraction under overlap: tests/e2e/test_retraction.py
    on the default server.)"""
    from tests.overlap_cases import assert_same, late_stops, mixed_requests, serve

    plain = cpu_model_server(model_dir, disable_overlap_schedule=True)
    vocab = plain.config.vocab_size
    stops = late_stops(serve(plain, mixed_requests(vocab, 16, 7)))
    assert len(stops) >= 4
    want = serve(plain, mixed_requests(vocab, 16, 7, stops, smollm2_tokenizer))
    overlap = cpu_model_server(model_dir)
    got = serve(overlap, mixed_requests(vocab, 16, 7, stops, smollm2_tokenizer))
    assert_same(got, want)
    assert kv_is_free(plain) and kv_is_free(overlap)
    assert overlap.stats()["overlapped_decode_steps"] > 0
    assert overlap.stats()["jump_forwards"] > 0
    assert any(w[1]["type"] == "stop" and isinstance(w[1]["matched"], int)
               for rid, w in want.items() if rid in stops)
