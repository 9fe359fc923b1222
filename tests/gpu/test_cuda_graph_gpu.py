"""CUDA graphs for decode (GPU only): greedy tokens with graphs equal those without, for batch
sizes that hit a captured size exactly, need padding, and exceed the largest captured size."""

from __future__ import annotations

import random
from typing import Any

import pytest

from tests.gpu.driver import NEW_TOKENS, ModelProcessDriver, teacher_forced_agreement
from tests.random_models import save_random_llama

pytestmark = pytest.mark.gpu
VOCAB = 2048


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    rng = random.Random(1)
    return [[rng.randrange(2, VOCAB) for _ in range(rng.randrange(8, 200))] for _ in range(11)]


def _model(tmp: Any, dtype: str) -> str:
    return save_random_llama(str(tmp), dtype=dtype, hidden_size=512, intermediate_size=1024,
                             num_attention_heads=8, num_key_value_heads=2, vocab_size=VOCAB)


@pytest.mark.parametrize("n", [1, 3, 11])
def test_triton_fp32_graphs_equal_eager(n: int, tmp_path_factory: Any,
                                        prompts: list[list[int]]) -> None:
    model = _model(tmp_path_factory.mktemp("g32"), "float32")
    # cuda_graph_max_bs 8: with 11 prompts the first steps run eagerly, the rest from graphs
    graphs = ModelProcessDriver(model, "triton", "float32", cuda_graph_max_bs=8)
    assert graphs.server.runner.graph_runner is not None
    eager = ModelProcessDriver(model, "triton", "float32", disable_cuda_graph=True)
    assert eager.server.runner.graph_runner is None
    lens = [NEW_TOKENS - 5 * i for i in range(n)]  # the batch shrinks as requests finish
    want = eager.greedy(prompts[:n], lens)
    got = graphs.greedy(prompts[:n], lens)
    assert got == want


def test_flashinfer_bf16_graphs_agree_with_eager(tmp_path: Any,
                                                 prompts: list[list[int]]) -> None:
    pytest.importorskip("flashinfer")
    model = _model(tmp_path, "bfloat16")
    eager = ModelProcessDriver(model, "flashinfer", "bfloat16", disable_cuda_graph=True)
    ref = eager.greedy(prompts, [NEW_TOKENS] * len(prompts))
    graphs = ModelProcessDriver(model, "flashinfer", "bfloat16", cuda_graph_max_bs=16)
    free = graphs.greedy(prompts, [NEW_TOKENS] * len(prompts))
    same, total = teacher_forced_agreement(graphs, prompts, ref)
    exact = sum(a == b for o, r in zip(free, ref) for a, b in zip(o, r))
    print(f"flashinfer bf16 graphs vs eager: free-running {exact}/{total}, teacher-forced "
          f"{same}/{total}")
    assert same / total >= 0.98
