"""PREFILL graphs (GPU only): a small random Qwen3-MoE of fine-grained experts in float32 on the
Triton backend, with prefill graphs up to 4,096 and 768 tokens. Rounds of several prompts padded to a
captured size, a prompt of a captured size exactly, one longer than the largest (eager), one
behind a cached prefix (EXTEND: eager) and one asking for output logprobs give the ids, finish
reasons, token counts and logprobs of the server with the graphs off (and the decode-row fills
off in both, so that every fill is a PREFILL step); the graphs ran the fills they could, and the
KV pool is whole after."""

from __future__ import annotations

import random
from typing import Any

import pytest

from srt.managers.io_struct import LogprobOptions, TokenizedGenerateReq
from tests.overlap_cases import assert_same, serve

pytestmark = pytest.mark.gpu

LIMIT = 768  # graphs of 512 and 768 tokens


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: Any) -> str:
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    from tests.random_models import save_random_model

    return save_random_model(str(tmp_path_factory.mktemp("prefill_graphs_gpu")), Qwen3MoeConfig,
                             Qwen3MoeForCausalLM, head_dim=64, num_experts=32,
                             num_experts_per_tok=4, moe_intermediate_size=128,
                             hidden_size=256, num_attention_heads=8, num_key_value_heads=2,
                             num_hidden_layers=3, vocab_size=2000)


def _server(model_dir: str, limit: int) -> Any:
    from srt.model_process.loop import ModelProcess
    from srt.server_args import ServerArgs

    args = ServerArgs(model_path=model_dir, tokenizer_path=model_dir, device="cuda",
                      dtype="float32", attention_backend="triton", max_total_tokens=32768,
                      cuda_graph_max_bs=16, random_seed=0, graph_fill_max_tokens=0,
                      prefill_graph_max_tokens=limit, min_fill_tokens_while_decoding=0)
    return ModelProcess(args, 0)


def _ids(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 1990) for _ in range(n)]


def _rounds() -> list[list[TokenizedGenerateReq]]:
    params = {"temperature": 0, "max_new_tokens": 8, "ignore_eos": True}

    def req(rid: str, ids: list[int], **kw: Any) -> TokenizedGenerateReq:
        return TokenizedGenerateReq(rid, ids, dict(params), **kw)

    shared = _ids(300, 1)
    return [
        [req("a", _ids(100, 2)), req("b", _ids(333, 3)), req("c", _ids(7, 4))],  # 440 -> 512
        [req(f"m{i}", _ids(9 + 11 * i, 10 + i)) for i in range(12)],  # 834: past LIMIT
        [req("exact", _ids(768, 5))],
        [req("long", _ids(900, 6))],  # past LIMIT
        [req("pre-1", shared + _ids(20, 7))],  # 320 -> 512
        [req("pre-2", shared + _ids(30, 8))],  # EXTEND: eager
        [req("lp", _ids(600, 9), logprob=LogprobOptions(top_logprobs_num=3))],  # -> 768
    ]


def _serve(server: Any) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for reqs in _rounds():
        out.update(serve(server, reqs))
    assert server.kv.is_free() and not server.running and server.inflight is None
    return out


@pytest.fixture(scope="module")
def eager(model_dir: str) -> dict[str, Any]:
    return _serve(_server(model_dir, 0))


def test_prefill_graphs_equal_eager_fills(model_dir: str, eager: dict[str, Any]) -> None:
    server = _server(model_dir, 4096)
    graphs = server.runner.prefill_graphs
    assert graphs is not None and graphs.replay and graphs.max_tokens == 4096
    assert graphs.replays == 0  # (the start-up's warm-up fills ran eagerly)
    assert_same(_serve(server), eager, tol=2e-3)
    assert graphs.replays == 6, graphs.replays  # every round but pre-2's (EXTEND)
    assert server.stats()["prefill_graph_max_tokens"] == 4096


def test_prefill_graphs_at_the_flag(model_dir: str, eager: dict[str, Any]) -> None:
    server = _server(model_dir, LIMIT)
    graphs = server.runner.prefill_graphs
    assert graphs.sizes == [512, LIMIT]
    assert_same(_serve(server), eager, tol=2e-3)
    assert graphs.replays == 4, graphs.replays  # a-b-c, exact, pre-1, lp
