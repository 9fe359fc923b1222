"""The overlapped loop on a GPU (GPU only): float32, Triton attention, CUDA graphs. The same
greedy ids, finish reasons, token counts and logprobs as the plain loop for a mixed workload,
and for a stress of the staging buffers and the in-flight bookkeeping: hundreds of short
requests, several finishing at every step, many launched into a step after the one that
finished them."""

from __future__ import annotations

import random
from typing import Any

import pytest

from srt.managers.io_struct import TokenizedGenerateReq
from tests.overlap_cases import assert_same, late_stops, mixed_requests, serve
from tests.random_models import save_random_llama

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: Any) -> str:
    return save_random_llama(str(tmp_path_factory.mktemp("overlap_gpu")), num_hidden_layers=4,
                             hidden_size=256, intermediate_size=512, num_attention_heads=8,
                             num_key_value_heads=4, vocab_size=6000)


def _server(model_dir: str, overlap: bool) -> Any:
    from srt.model_process.loop import ModelProcess
    from srt.server_args import ServerArgs

    args = ServerArgs(model_path=model_dir, tokenizer_path=model_dir, device="cuda",
                      dtype="float32", attention_backend="triton", max_total_tokens=65536,
                      cuda_graph_max_bs=64, random_seed=0, disable_overlap_schedule=not overlap)
    return ModelProcess(args, 0)


@pytest.fixture(scope="module")
def servers(model_dir: str) -> tuple[Any, Any]:
    return _server(model_dir, False), _server(model_dir, True)


def _free(s: Any) -> bool:
    return s.kv.is_free() and not s.running and not s.waiting and s.inflight is None


def test_mixed_workload_equal(servers: tuple[Any, Any]) -> None:
    plain, overlap = servers
    vocab = plain.config.vocab_size
    stops = late_stops(serve(plain, mixed_requests(vocab, 24, 3)))
    want = serve(plain, mixed_requests(vocab, 24, 3, stops))
    before = overlap.stats()["overlapped_decode_steps"]
    got = serve(overlap, mixed_requests(vocab, 24, 3, stops))
    assert_same(got, want)
    assert overlap.stats()["overlapped_decode_steps"] > before
    assert _free(plain) and _free(overlap)


def _short_requests(vocab: int, n: int, stops: dict[str, int] | None) -> list:
    rng = random.Random(11)
    reqs = []
    for i in range(n):
        ids = [rng.randrange(vocab) for _ in range(rng.randrange(2, 24))]
        params: dict[str, Any] = {"temperature": 0, "ignore_eos": True,
                                  "max_new_tokens": rng.randrange(1, 9)}
        if stops and f"r{i}" in stops:
            params["stop_token_ids"] = [stops[f"r{i}"]]
        reqs.append(TokenizedGenerateReq(f"r{i}", ids, params, stream=i % 4 == 0))
    return reqs


def test_many_short_requests_finishing_every_step(servers: tuple[Any, Any]) -> None:
    plain, overlap = servers
    vocab = plain.config.vocab_size
    stops = late_stops(serve(plain, _short_requests(vocab, 400, None)))
    want = serve(plain, _short_requests(vocab, 400, stops))
    got = serve(overlap, _short_requests(vocab, 400, stops))
    assert_same(got, want)
    assert _free(plain) and _free(overlap)
    assert overlap.executor.inputs.builds >= 20  # each staging buffer refilled ten times or more
