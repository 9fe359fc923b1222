"""PREFILL graphs (`--prefill-graph-max-tokens`) on a model process stepped in this process,
float32 on the CPU with the Triton attention kernels in Triton's interpreter. The CPU captures no
graph: there the flag runs the same padded static batch eagerly (the dummy request over the
padding rows, the block-table grid, the sampled rows from a static buffer), which is what a
graph replays on a GPU. Every output, output logprobs included, equals the eager server's.

Covered: several prompts padded to the graph's size, a prompt of exactly that size (no
padding), a prompt longer than it (eager), a prompt behind a cached prefix (EXTEND: eager), a
prompt asking for prompt logprobs (eager) and one asking for output logprobs (graph).
"""

from __future__ import annotations

import random
from typing import Any

import pytest

from srt.managers.io_struct import LogprobOptions, TokenizedGenerateReq
from srt.model_process.prefill_graph_runner import capture_token_counts
from tests.model_process import cpu_model_server, kv_is_free
from tests.overlap_cases import assert_same, serve
from tests.random_models import save_random_model

SIZE = 48  # the one graph size of the tests


def _ids(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 250) for _ in range(n)]


def _req(rid: str, ids: list[int], logprob: LogprobOptions | None = None
         ) -> TokenizedGenerateReq:
    return TokenizedGenerateReq(rid, ids, {"temperature": 0, "max_new_tokens": 4,
                                           "ignore_eos": True}, logprob=logprob)


def _rounds() -> list[list[TokenizedGenerateReq]]:
    shared = _ids(20, 1)
    return [
        [_req("a", _ids(9, 2)), _req("b", _ids(17, 3)), _req("c", _ids(5, 4))],  # 31 of 48
        [_req("exact", _ids(SIZE, 5))],
        [_req("long", _ids(SIZE + 9, 6))],  # eager
        [_req("prefix-1", shared + _ids(4, 7))],
        [_req("prefix-2", shared + _ids(6, 8))],  # EXTEND: eager
        [_req("out-lp", _ids(12, 9), LogprobOptions(top_logprobs_num=2))],
        [_req("in-lp", _ids(10, 10), LogprobOptions(logprob_start_len=0))],  # eager
    ]


@pytest.fixture(scope="module")
def moe(tmp_path_factory: Any) -> str:
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    return save_random_model(str(tmp_path_factory.mktemp("moe")), Qwen3MoeConfig,
                             Qwen3MoeForCausalLM, head_dim=16, num_experts=20,
                             num_experts_per_tok=2, moe_intermediate_size=32,
                             num_hidden_layers=2, vocab_size=256)


def _serve(path: str, **args: Any) -> tuple[dict[str, Any], Any]:
    server = cpu_model_server(path, attention_backend="triton", max_total_tokens=600,
                              min_fill_tokens_while_decoding=0, **args)
    out: dict[str, Any] = {}
    for reqs in _rounds():
        out.update(serve(server, reqs))
    assert kv_is_free(server)
    return out, server


def test_padded_prefill_steps_equal_eager_ones(moe: str) -> None:
    want, eager = _serve(moe, prefill_graph_max_tokens=0)
    assert eager.runner.prefill_graphs is None
    got, server = _serve(moe, prefill_graph_max_tokens=SIZE)
    graphs = server.runner.prefill_graphs
    assert graphs is not None and graphs.sizes == [SIZE] and not graphs.replay
    assert_same(got, want, tol=1e-5)
    # a, b, c together; exact; prefix-1; out-lp (not long, prefix-2 or in-lp)
    assert graphs.replays == 4
    assert server.stats()["prefill_graph_steps"] == 4


def test_off_by_default(moe: str) -> None:
    server = cpu_model_server(moe, attention_backend="triton")
    assert server.runner.prefill_graphs is None
    assert server.stats()["prefill_graph_max_tokens"] == 0


def test_not_for_the_torch_backend(moe: str) -> None:
    """The torch backend has no block-table kernel: the flag leaves its fills eager."""
    server = cpu_model_server(moe, prefill_graph_max_tokens=SIZE)
    assert server.runner.prefill_graphs is None


def test_capture_token_counts() -> None:
    assert capture_token_counts(4096) == [512, 768, 1024, 1280, 1536, 1792, 2048, 2560, 3072,
                                          3584, 4096]
    assert capture_token_counts(1000) == [512, 768, 1000]
    assert capture_token_counts(100) == [100]
    with pytest.raises(ValueError):
        capture_token_counts(0)
