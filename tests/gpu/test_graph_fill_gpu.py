"""Short fills as decode rows through the decode CUDA graphs (GPU only): float32, the overlapped
loop, Triton and FlashInfer attention. The varied requests of the overlap tests, served two at a
time (each pair one fill within the limit), then a prompt behind a cached prefix and one longer
than the limit, give the ids, finish reasons, token counts and logprobs of the server that fills
every prompt with an extend; the graphs ran the fills, and the KV pool is whole after."""

from __future__ import annotations

from typing import Any

import pytest

from srt.managers.io_struct import TokenizedGenerateReq
from tests.overlap_cases import assert_same, mixed_requests, serve
from tests.random_models import save_random_llama

pytestmark = pytest.mark.gpu

LIMIT = 64


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: Any) -> str:
    return save_random_llama(str(tmp_path_factory.mktemp("graph_fill_gpu")), num_hidden_layers=4,
                             hidden_size=256, intermediate_size=512, num_attention_heads=8,
                             num_key_value_heads=4, vocab_size=6000)


def _server(model_dir: str, backend: str, limit: int) -> Any:
    from srt.model_process.loop import ModelProcess
    from srt.server_args import ServerArgs

    args = ServerArgs(model_path=model_dir, tokenizer_path=model_dir, device="cuda",
                      dtype="float32", attention_backend=backend, max_total_tokens=65536,
                      cuda_graph_max_bs=LIMIT, random_seed=0, graph_fill_max_tokens=limit)
    return ModelProcess(args, 0)


def _rounds(vocab: int) -> list[list[TokenizedGenerateReq]]:
    reqs = mixed_requests(vocab, 12, 5)
    rounds = [reqs[i : i + 2] for i in range(0, len(reqs), 2)]  # (g-0, g-1 together)
    shared = list(range(400, 440))
    params = {"temperature": 0, "max_new_tokens": 12, "ignore_eos": True}
    rounds.append([TokenizedGenerateReq("pre-1", shared + [7, 8, 9], dict(params))])
    rounds.append([TokenizedGenerateReq("pre-2", shared + [17, 18], dict(params))])
    rounds.append([TokenizedGenerateReq("long", list(range(500, 500 + LIMIT + 30)),
                                        dict(params))])
    return rounds


def _serve(server: Any) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for reqs in _rounds(server.config.vocab_size):
        out.update(serve(server, reqs))
    assert server.kv.is_free() and not server.running and server.inflight is None
    return out


@pytest.mark.parametrize("backend", ["triton", "flashinfer"])
def test_graph_fills_equal_extend_fills(model_dir: str, backend: str) -> None:
    if backend == "flashinfer":
        pytest.importorskip("flashinfer")
    want = _serve(_server(model_dir, backend, 0))
    server = _server(model_dir, backend, LIMIT)
    got = _serve(server)
    assert_same(got, want)
    stats = server.stats()
    # every round but the long prompt's and those with a logprob request
    assert stats["graph_fill_steps"] >= 6, stats["graph_fill_steps"]
    assert stats["graph_fill_max_tokens"] == LIMIT
