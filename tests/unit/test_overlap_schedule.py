"""--enable-overlap-schedule: decode steps launched with the previous step's ids still on the
device give the plain loop's greedy tokens, finish reasons and KV accounting."""

from __future__ import annotations

import random
import tempfile
from typing import Any

import pytest

import srt.managers.router.model_rpc as model_rpc
from benchmarks.common import write_shape_dir
from srt.managers.io_struct import StepInput, TokenizedGenerateReq
from srt.managers.router.model_rpc import ModelRpcServer
from srt.server_args import ServerArgs

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
    return ModelRpcServer(ServerArgs(
        model_path=path, tokenizer_path=path, load_format="dummy" if dummy else "auto",
        dtype="float32", device="cpu", attention_backend="torch", random_seed=0,
        enable_overlap_schedule=overlap, skip_warmup=True), 0, None)


def _serve(server: ModelRpcServer, reqs: list[TokenizedGenerateReq]) -> dict[str, Any]:
    """rid -> (all ids, finish reason, forward passes) once every request is done."""
    got: dict[str, list[int]] = {r.rid: [] for r in reqs}
    end: dict[str, Any] = {}
    out = server.step(StepInput(reqs=reqs))
    for _ in range(10_000):
        if out.token_out is not None:
            for t in out.token_out.outs:
                got[t.rid].extend(t.new_ids)
                if t.finish_reason is not None:
                    end[t.rid] = (t.finish_reason, t.forward_passes, t.completion_tokens)
        if not out.has_work:
            break
        out = server.step(StepInput())
    assert set(end) == set(got)
    return {rid: (got[rid], *end[rid]) for rid in got}


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


def _kv_is_free(server: ModelRpcServer) -> bool:
    return (server.pool.available_size() + server.tree.evictable_size() == server.pool.size
            and server.req_pool.available_size() == server.req_pool.size)


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
    assert _kv_is_free(plain) and _kv_is_free(overlap)


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
    assert _kv_is_free(overlap)
