"""Small fills wait for more requests while others decode (--min-fill-tokens-while-decoding):
the rule, the default for MoE models, and a model process stepped in this process (small random
models, float32 on the CPU) whose outputs do not change while its fill rounds get fewer."""

from __future__ import annotations

import random
from typing import Any

import pytest

from srt.managers.io_struct import TokenizedGenerateReq
from srt.model_process.policy import (DENSE_MAX_FILL_TOKENS, MOE_MAX_FILL_TOKENS,
                                      MOE_MIN_FILL_TOKENS, FillWait)
from tests.model_process import cpu_model_server, kv_is_free, serve_all
from tests.random_models import save_random_llama, save_random_model


def test_hold_rule() -> None:
    w = FillWait(min_tokens=100, max_steps=3)
    small = dict(fill_tokens=40, budget=4096, takes_queue=False, decoding=True,
                 continues_prompt=False)
    assert [w.hold(**small) for _ in range(5)] == [True, True, True, False, True]
    w.waited = 0
    # never: enough tokens, the budget reached, the whole queue, nothing decoding, a chunk
    for change in (dict(fill_tokens=100), dict(budget=40), dict(takes_queue=True),
                   dict(decoding=False), dict(continues_prompt=True)):
        assert not w.hold(**{**small, **change}), change
    assert w.waited == 0
    # a fill that runs resets the count
    assert w.hold(**small) and w.hold(**small)
    assert not w.hold(**{**small, "fill_tokens": 500}) and w.waited == 0
    assert not FillWait(min_tokens=0, max_steps=8).hold(**small)


def _requests(n: int) -> list[TokenizedGenerateReq]:
    rng = random.Random(3)
    return [TokenizedGenerateReq(f"r{i}", [rng.randrange(5, 250) for _ in range(rng.randrange(8, 40))],
                                 {"temperature": 0, "max_new_tokens": rng.randrange(4, 24),
                                  "ignore_eos": True})
            for i in range(n)]


def _serve(path: str, **args: Any) -> tuple[dict[str, list[int]], dict[str, Any], int]:
    """Every request's ids, the server's stats and its fills' token threshold (24 requests
    through a pool of 400 tokens: most wait for room while others decode)."""
    server = cpu_model_server(path, max_total_tokens=400, **args)
    outs = serve_all(server, _requests(24))
    ids = {rid: [i for t in o for i in t.new_ids] for rid, o in outs.items()}
    assert kv_is_free(server)
    return ids, server.stats(), server.fill_wait.min_tokens


@pytest.fixture(scope="module")
def llama(tmp_path_factory: Any) -> str:
    return save_random_llama(str(tmp_path_factory.mktemp("fill-wait")), vocab_size=256)


def test_waiting_fills_keep_outputs_and_take_fewer_rounds(llama: str) -> None:
    base, base_stats, base_min = _serve(llama)
    waited, stats, min_tokens = _serve(llama, min_fill_tokens_while_decoding=64,
                                       max_fill_wait_steps=4)
    assert base_min == 0 and base_stats["fill_wait_steps"] == 0  # a dense model: off
    assert min_tokens == 64 and stats["min_fill_tokens_while_decoding"] == 64
    assert waited == base
    fills = stats["decode_step_times"]["fills"]["rounds"]
    base_fills = base_stats["decode_step_times"]["fills"]["rounds"]
    assert stats["fill_wait_steps"] > 0
    assert fills < base_fills, (fills, base_fills)
    # no steps to wait: the fills of the default
    never, never_stats, _ = _serve(llama, min_fill_tokens_while_decoding=64,
                                   max_fill_wait_steps=0)
    assert never == base and never_stats["fill_wait_steps"] == 0
    assert never_stats["decode_step_times"]["fills"]["rounds"] == base_fills


def test_moe_models_wait_by_default(tmp_path: Any) -> None:
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    path = save_random_model(str(tmp_path), Qwen3MoeConfig, Qwen3MoeForCausalLM,
                             head_dim=24, num_experts=4, num_experts_per_tok=2,
                             moe_intermediate_size=64, num_hidden_layers=2, vocab_size=256)
    server = cpu_model_server(path, max_total_tokens=400)
    assert server.fill_wait.min_tokens == MOE_MIN_FILL_TOKENS
    assert cpu_model_server(path, max_total_tokens=400, min_fill_tokens_while_decoding=0
                            ).fill_wait.min_tokens == 0
    # and fill larger while requests decode (each fill reads every expert)
    assert server.fill_cap == MOE_MAX_FILL_TOKENS == server.decoding_chunk_size
    capped = cpu_model_server(path, max_total_tokens=400, max_fill_tokens_while_decoding=1024)
    assert capped.fill_cap == capped.decoding_chunk_size == 1024


def test_dense_models_cap_fills_while_decoding(llama: str) -> None:
    server = cpu_model_server(llama, max_total_tokens=400)
    assert server.fill_cap == DENSE_MAX_FILL_TOKENS == server.decoding_chunk_size
    assert server.fill_wait.min_tokens == 0
    uncapped = cpu_model_server(llama, max_total_tokens=400, max_fill_tokens_while_decoding=-1)
    assert uncapped.decoding_chunk_size == uncapped.chunk_size
