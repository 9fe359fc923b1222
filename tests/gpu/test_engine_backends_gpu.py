"""On a GPU: the model process with each attention backend gives the torch backend's greedy tokens
(small random Llama, 8 prompts x 64 tokens), driven through its real step loop.

Free-running greedy streams diverge for good after one flipped near-tie, and bf16 rounding flips a
few percent of a random model's near-ties whichever kernel is right. So in bf16 the agreement is
measured per position with the reference prefix forced (after a divergence the request is resent
with the reference tokens so far appended, which also exercises EXTEND over cached prefixes); in
float32 (triton only: FlashInfer has no float32) the free-running streams must agree.
"""

from __future__ import annotations

import random
from typing import Any

import pytest

from tests.gpu.driver import NEW_TOKENS, ModelProcessDriver as Engine, first_diff, \
    teacher_forced_agreement
from tests.random_models import save_random_llama

pytestmark = pytest.mark.gpu

VOCAB = 2048


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(2, VOCAB) for _ in range(rng.randrange(8, 300))] for _ in range(8)]


@pytest.fixture(scope="module")
def bf16_model(tmp_path_factory: Any) -> str:
    return save_random_llama(str(tmp_path_factory.mktemp("llama_bf16")), dtype="bfloat16",
                             init_std=0.015, hidden_size=1024, intermediate_size=2048,
                             num_attention_heads=8, num_key_value_heads=2, vocab_size=VOCAB)


@pytest.mark.parametrize("backend", ["triton", "flashinfer"])
def test_bf16_backend_agrees_with_torch(backend: str, bf16_model: str,
                                        prompts: list[list[int]]) -> None:
    if backend == "flashinfer":
        pytest.importorskip("flashinfer")
    ref = Engine(bf16_model, "torch", "bfloat16").greedy(prompts, [NEW_TOKENS] * len(prompts))
    engine = Engine(bf16_model, backend, "bfloat16")
    free = engine.greedy(prompts, [NEW_TOKENS] * len(prompts))
    assert all(len(o) == NEW_TOKENS for o in free)
    free_same = sum(sum(a == b for a, b in zip(o, r)) for o, r in zip(free, ref))
    same, total = teacher_forced_agreement(engine, prompts, ref)
    print(f"{backend} bf16: free-running {free_same}/{total} positions equal (first divergence "
          f"at {[first_diff(o, r) for o, r in zip(free, ref)]}); with the reference prefix "
          f"{same}/{total}")
    assert same / total >= 0.95, f"{backend}: {same}/{total} positions equal"


def test_fp32_triton_free_running_equals_torch(tmp_path: Any, prompts: list[list[int]]) -> None:
    model = save_random_llama(str(tmp_path), dtype="float32", hidden_size=1024,
                              intermediate_size=2048, num_attention_heads=8,
                              num_key_value_heads=2, vocab_size=VOCAB)
    ref = Engine(model, "torch", "float32").greedy(prompts, [NEW_TOKENS] * len(prompts))
    got = Engine(model, "triton", "float32").greedy(prompts, [NEW_TOKENS] * len(prompts))
    same = sum(sum(a == b for a, b in zip(o, r)) for o, r in zip(got, ref))
    print(f"triton fp32: free-running {same}/{NEW_TOKENS * len(prompts)} positions equal")
    assert same / (NEW_TOKENS * len(prompts)) >= 0.95


@pytest.mark.parametrize("kv_dtype", ["fp8_e4m3", "fp8_e5m2"])
@pytest.mark.parametrize("backend,extra", [
    ("flashinfer", {}), ("triton", {"prefill_attention_backend": "flashinfer"})],
    ids=["flashinfer", "flashinfer-prefill"])
def test_fp8_kv_backend_agrees_with_torch(backend: str, extra: dict, kv_dtype: str,
                                          bf16_model: str, prompts: list[list[int]]) -> None:
    """An FP8 KV cache through FlashInfer (alone, graphs on; and its prefill with Triton's
    decode) against the torch backend on the same FP8 cache."""
    pytest.importorskip("flashinfer")
    ref = Engine(bf16_model, "torch", "bfloat16", kv_cache_dtype=kv_dtype).greedy(
        prompts, [NEW_TOKENS] * len(prompts))
    engine = Engine(bf16_model, backend, "bfloat16", kv_cache_dtype=kv_dtype, **extra)
    assert "flashinfer" in engine.server.runner.backend_name
    same, total = teacher_forced_agreement(engine, prompts, ref)
    print(f"{engine.server.runner.backend_name} {kv_dtype}: with the reference prefix "
          f"{same}/{total} positions equal")
    assert same / total >= 0.95, f"{backend} {kv_dtype}: {same}/{total} positions equal"
