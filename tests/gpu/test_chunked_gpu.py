"""Chunked prefill and mixed fill steps on a GPU (GPU only): float32, Triton attention, CUDA
graphs, the overlapped loop. With chunks of 64 tokens (mixed steps on and off) the mixed
workload of the overlap tests plus long prompts (1x to 12x the chunk) gives the unchunked
server's greedy ids, finish reasons, token counts and logprobs, and the KV pool is whole after."""

from __future__ import annotations

import random
from typing import Any

import pytest

from srt.managers.io_struct import LogprobOptions, TokenizedGenerateReq
from tests.overlap_cases import assert_same, late_stops, mixed_requests, serve
from tests.random_models import save_random_llama

pytestmark = pytest.mark.gpu

CHUNK = 64


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: Any) -> str:
    return save_random_llama(str(tmp_path_factory.mktemp("chunked_gpu")), num_hidden_layers=4,
                             hidden_size=256, intermediate_size=512, num_attention_heads=8,
                             num_key_value_heads=4, vocab_size=6000)


def _server(model_dir: str, chunk: int, mixed: bool) -> Any:
    from srt.model_process.loop import ModelProcess
    from srt.server_args import ServerArgs

    args = ServerArgs(model_path=model_dir, tokenizer_path=model_dir, device="cuda",
                      dtype="float32", attention_backend="triton", max_total_tokens=65536,
                      cuda_graph_max_bs=64, random_seed=0, chunked_prefill_size=chunk,
                      enable_mixed_chunk=mixed)
    return ModelProcess(args, 0)


def _requests(vocab: int, stops: dict[str, int] | None) -> list[TokenizedGenerateReq]:
    reqs = mixed_requests(vocab, 24, 3, stops, long=4)
    rng = random.Random(8)
    for k, n in enumerate([CHUNK, 3 * CHUNK, 7 * CHUNK + 5, 12 * CHUNK]):
        lp = LogprobOptions(logprob_start_len=0, top_logprobs_num=2) if k % 2 else None
        reqs.append(TokenizedGenerateReq(f"p{k}", [rng.randrange(vocab) for _ in range(n)],
                                         {"temperature": 0, "max_new_tokens": 16,
                                          "ignore_eos": True}, logprob=lp))
    return reqs


@pytest.mark.parametrize("mixed", [False, True])
def test_chunked_equals_unchunked(model_dir: str, mixed: bool) -> None:
    plain = _server(model_dir, -1, False)
    vocab = plain.config.vocab_size
    stops = late_stops(serve(plain, _requests(vocab, None)))
    want = serve(plain, _requests(vocab, stops))
    chunked = _server(model_dir, CHUNK, mixed)
    got = serve(chunked, _requests(vocab, stops))
    assert_same(got, want)
    stats = chunked.stats()
    assert stats["prefill_chunks"] >= 15
    assert (stats["mixed_fill_steps"] > 0) == mixed
    for s in (plain, chunked):
        assert s.kv.is_free() and not s.running and not s.waiting and s.inflight is None
