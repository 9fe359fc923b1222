"""On a GPU: the model process with each attention backend gives the torch backend's greedy tokens
(bf16, small random Llama, 8 prompts x 64 tokens), driven through its real step loop."""

from __future__ import annotations

import random
from typing import Any

import pytest

from tests.random_models import save_random_llama

pytestmark = pytest.mark.gpu

NEW_TOKENS = 64


def _greedy(model_dir: str, backend: str, prompts: list[list[int]]) -> dict[str, list[int]]:
    from srt.layers import parallel_state
    from srt.managers.io_struct import StepInput, TokenizedGenerateReq
    from srt.managers.router.model_rpc import ModelRpcServer
    from srt.server_args import ServerArgs

    parallel_state.init_tp_group(0, 1)
    args = ServerArgs(model_path=model_dir, tokenizer_path=model_dir, device="cuda",
                      dtype="bfloat16", attention_backend=backend, max_total_tokens=16384,
                      random_seed=0)
    server = ModelRpcServer(args, 0)
    params = {"temperature": 0.0, "max_new_tokens": NEW_TOKENS, "ignore_eos": True}
    step = StepInput(reqs=[TokenizedGenerateReq(f"r{i}", ids, params)
                           for i, ids in enumerate(prompts)])
    out: dict[str, list[int]] = {f"r{i}": [] for i in range(len(prompts))}
    while True:
        res = server.step(step)
        step = StepInput()
        if res.token_out is not None:
            for o in res.token_out.outs:
                out[o.rid].extend(o.new_ids)
        if not res.has_work:
            break
    assert server.pool.available_size() + server.tree.evictable_size() == \
        server.runner.max_total_num_tokens
    return out


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: Any) -> str:
    path = str(tmp_path_factory.mktemp("llama_gpu"))
    return save_random_llama(path, dtype="bfloat16", hidden_size=1024, intermediate_size=2048,
                             num_attention_heads=8, num_key_value_heads=2, vocab_size=2048)


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(2, 2048) for _ in range(rng.randrange(8, 300))] for _ in range(8)]


@pytest.fixture(scope="module")
def reference(model_dir: str, prompts: list[list[int]]) -> dict[str, list[int]]:
    return _greedy(model_dir, "torch", prompts)


@pytest.mark.parametrize("backend", ["triton", "flashinfer"])
def test_backend_greedy_matches_torch(backend: str, model_dir: str, prompts: list[list[int]],
                                      reference: dict[str, list[int]]) -> None:
    if backend == "flashinfer":
        pytest.importorskip("flashinfer")
    got = _greedy(model_dir, backend, prompts)
    same = total = 0
    for rid, ref in reference.items():
        assert len(got[rid]) == NEW_TOKENS
        same += sum(a == b for a, b in zip(got[rid], ref))
        total += NEW_TOKENS
    print(f"{backend}: {same}/{total} positions equal to torch")
    assert same / total >= 0.95, f"{backend}: only {same}/{total} positions equal"
