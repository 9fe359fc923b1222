"""The server with --attention-backend triton (Triton's interpreter on the CPU) gives the torch
backend's greedy tokens on a small random Llama, so do the per-step pairs of
--prefill-attention-backend / --decode-attention-backend, and an unusable backend fails at
start-up; DeepSeek-V2's latent attention on Triton gives transformers' tokens."""

from __future__ import annotations

import os
import subprocess
import sys
from typing import Any

import pytest

from tests.conftest import REPO, ServerProcess
from tests.random_models import save_random_llama

PROMPTS = [[5, 17, 99, 3, 42, 7, 250, 31], [400, 12, 9, 9, 81, 77, 2, 300, 150, 6, 61]]
PARAMS = {"temperature": 0, "max_new_tokens": 6, "ignore_eos": True}


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory: Any) -> str:
    return save_random_llama(str(tmp_path_factory.mktemp("tiny_llama")), num_hidden_layers=2,
                             hidden_size=256, intermediate_size=256, num_attention_heads=4,
                             num_key_value_heads=2)


def _serve_greedy(model: str, backend: str, *extra: str,
                  expect_backend: str | None = None) -> list[list[int]]:
    pytest.importorskip("triton")
    srv = ServerProcess(["--model-path", model, "--device", "cpu", "--dtype", "float32",
                         "--attention-backend", backend, "--max-total-tokens", "256",
                         "--random-seed", "0", *extra]).start()
    try:
        if expect_backend is not None:
            info = srv.server_info()
            assert info["attention_backend"] == expect_backend
        outs = []
        for ids in PROMPTS:
            # twice: the second run goes through EXTEND with a cached prefix
            first = srv.generate({"input_ids": ids, "sampling_params": PARAMS})
            second = srv.generate({"input_ids": ids, "sampling_params": PARAMS})
            assert second["meta_info"]["cached_tokens"] == len(ids) - 1
            assert first["output_ids"] == second["output_ids"]
            outs.append(first["output_ids"])
        srv.assert_kv_invariant()
        return outs
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def torch_greedy(tiny_llama: str) -> list[list[int]]:
    """The torch backend's tokens: the reference of the tests below (served once)."""
    return _serve_greedy(tiny_llama, "torch")


def test_triton_backend_matches_torch(tiny_llama: str, torch_greedy: list[list[int]]) -> None:
    assert _serve_greedy(tiny_llama, "triton") == torch_greedy


def test_prefill_and_decode_backends_apart_match_torch(
        tiny_llama: str, torch_greedy: list[list[int]]) -> None:
    want = torch_greedy
    assert _serve_greedy(tiny_llama, "torch", "--decode-attention-backend", "triton",
                         expect_backend="torch (prefill) + triton (decode)") == want
    assert _serve_greedy(tiny_llama, "torch", "--prefill-attention-backend", "triton",
                         expect_backend="triton (prefill) + torch (decode)") == want


def test_step_backend_resolution() -> None:
    from srt.layers.attention import resolve_step_backends

    assert resolve_step_backends("auto", None, None, "cpu") == ("torch", "torch")
    assert resolve_step_backends("torch", "triton", None, "cpu") == ("triton", "torch")
    assert resolve_step_backends("triton", None, "torch", "cpu") == ("triton", "torch")
    with pytest.raises(ValueError, match="needs a CUDA GPU"):
        resolve_step_backends("torch", "flashinfer", None, "cpu")
    # an FP8 KV cache: auto stays on Triton for every step
    assert resolve_step_backends("auto", None, None, "cuda", fp8_kv=True) == ("triton", "triton")
    assert resolve_step_backends("triton", None, None, "cuda", fp8_kv=True) == ("triton", "triton")
    # sliding windows / soft-capped scores (Mistral, Gemma 2): the same
    assert resolve_step_backends("auto", None, None, "cuda", triton_only=True) == ("triton", "triton")
    # and the flashinfer backend itself refuses such layers
    from srt.layers.attention.flashinfer_backend import refuse_windows_and_caps
    from srt.layers.radix_attention import RadixAttention

    refuse_windows_and_caps("LlamaForCausalLM", [RadixAttention(4, 8, 0.3, 2, 0)])
    for layer in (RadixAttention(4, 8, 0.3, 2, 0, sliding_window=16),
                  RadixAttention(4, 8, 0.3, 2, 0, logit_cap=50.0)):
        with pytest.raises(ValueError, match="use --attention-backend triton"):
            refuse_windows_and_caps("Gemma2ForCausalLM", [layer])


def test_flashinfer_on_cpu_is_a_clear_startup_error(tiny_llama: str) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "srt.server", "--model-path", tiny_llama, "--device", "cpu",
         "--attention-backend", "flashinfer", "--port", "0"],
        cwd=REPO, capture_output=True, text=True, timeout=120,
        env=dict(os.environ, PYTHONPATH=REPO),
    )
    assert proc.returncode != 0
    assert "--attention-backend flashinfer needs a CUDA GPU" in proc.stderr


def test_triton_latent_attention_matches_transformers(tmp_path: Any) -> None:
    """DeepSeek-V2's latent attention (one 48-value latent a token: 32 values + 16 rotary) on
    the Triton kernels, whose decode reads one tile of it as keys and values, gives
    transformers' greedy tokens."""
    import transformers

    from tests.e2e.test_models import MODELS, SMALL, hf_reference
    from tests.random_models import save_random_model

    cfg_cls, model_cls, overrides = MODELS["deepseek_v2"]
    path = save_random_model(str(tmp_path / "dsv2"), getattr(transformers, cfg_cls),
                             getattr(transformers, model_cls), random_vectors=True,
                             **{**SMALL, **overrides})
    want = hf_reference(path, PROMPTS, PARAMS["max_new_tokens"]).greedy
    assert _serve_greedy(path, "triton") == want
