"""--enable-overlap-schedule: decode steps launched with the previous step's ids still on the
device give the plain loop's greedy tokens, finish reasons and KV accounting."""

from __future__ import annotations

import random
import tempfile
from typing import Any

import pytest

import srt.managers.router.model_rpc as model_rpc
from benchmarks.common import write_shape_dir
from srt.managers.io_struct import TokenizedGenerateReq
from srt.managers.router.model_rpc import ModelRpcServer
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


def _server(path: str, overlap: bool, dummy: bool = False) -> ModelRpcServer:
    return cpu_model_server(path, dummy, enable_overlap_schedule=overlap)


def _serve(server: ModelRpcServer, reqs: list[TokenizedGenerateReq]) -> dict[str, Any]:
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
    calls: list[int] = []
    real = ModelRpcServer._decode_overlapped

    def spy(self, outs, steps):
        calls.append(steps)
        return real(self, outs, steps)

    monkeypatch.setattr(model_rpc.ModelRpcServer, "_decode_overlapped", spy)
    want = _serve(plain, _requests(vocab, stops, stream))
    assert not calls  # the plain server never overlaps
    got = _serve(overlap, _requests(vocab, stops, stream))
    assert calls, "the overlapped loop did not run"
    assert got == want
    assert any(r[1]["type"] == "stop" for r in got.values())
    assert kv_is_free(plain) and kv_is_free(overlap)


def test_ineligible_batches_take_the_plain_loop(tiny_dir: str, monkeypatch: Any) -> None:
    overlap = _server(tiny_dir, True, dummy=True)
    calls: list[int] = []
    monkeypatch.setattr(model_rpc.ModelRpcServer, "_decode_overlapped",
                        lambda self, outs, steps: calls.append(steps))
    vocab = overlap.config.vocab_size
    for extra in ({"min_new_tokens": 10}, {"frequency_penalty": 0.5}, {"seed": 3}):
        reqs = _requests(vocab, None, False)[:3]
        for r in reqs:
            r.sampling_params.update(extra, max_new_tokens=12)
        _serve(overlap, reqs)
    assert not calls
    assert kv_is_free(overlap)
