"""`--kv-cache-dtype fp8_e4m3 / fp8_e5m2` through the real server on a small random Llama in
float32 on the CPU.

Stated tolerance: on the same token sequences (prompt logprobs of each prompt followed by the
model-dtype run's greedy tokens: 106 logprobs between -8.5 and -2.9), the FP8-KV run's
logprobs differ from the model-dtype-KV run's by at most MAX_TOL and on average by at most
MEAN_TOL, and some by more than 1e-6 (the cache really is in FP8). e4m3 keeps 3 mantissa bits
(each K/V value moves by up to 1/16 of itself), e5m2 keeps 2. Measured on this model (scales
1.0, K/V values of mean magnitude 0.7): e4m3 max 0.149, mean 0.037; e5m2 max 0.232, mean
0.070. The pool holds 4x the tokens of a float32 cache (2x of bfloat16) in the same memory.
The checkpoint's per-layer `k_scale` / `v_scale` are read.
"""

from __future__ import annotations

import json
import os
import shutil
from typing import Any

import pytest
import torch

from tests.conftest import ServerProcess
from tests.e2e.test_models import GREEDY, PROMPTS, SMALL
from tests.random_models import save_random_model

MAX_TOL = {"fp8_e4m3": 0.25, "fp8_e5m2": 0.4}
MEAN_TOL = {"fp8_e4m3": 0.06, "fp8_e5m2": 0.12}


@pytest.fixture(scope="module")
def llama(tmp_path_factory: Any) -> str:
    import transformers

    return save_random_model(str(tmp_path_factory.mktemp("llama_kv8")),
                             transformers.LlamaConfig, transformers.LlamaForCausalLM,
                             random_vectors=True, **SMALL)


def _serve(path: str, *extra: str) -> ServerProcess:
    # no --max-total-tokens: the pool is sized from memory (capped on the CPU)
    return ServerProcess(["--model-path", path, "--device", "cpu", "--dtype", "float32",
                          "--random-seed", "0", *extra]).start()


def _sequences(srv: ServerProcess) -> list[list[int]]:
    res = srv.generate({"input_ids": PROMPTS, "sampling_params": GREEDY})
    return [p + r["output_ids"] for p, r in zip(PROMPTS, res)]


def _prompt_logprobs(srv: ServerProcess, seqs: list[list[int]]) -> list[list[float]]:
    res = srv.generate({"input_ids": seqs, "sampling_params": {"max_new_tokens": 1},
                        "return_logprob": True, "logprob_start_len": 0})
    return [[x[0] for x in r["meta_info"]["input_token_logprobs"][1:]] for r in res]


@pytest.fixture(scope="module")
def baseline(llama: str) -> dict[str, Any]:
    srv = _serve(llama)
    try:
        seqs = _sequences(srv)
        info = srv.server_info()
        return {"seqs": seqs, "logprobs": _prompt_logprobs(srv, seqs),
                "tokens": info["max_total_num_tokens"], "kv_dtype": info["kv_cache_dtype"]}
    finally:
        srv.stop()


def _diffs(a: list[list[float]], b: list[list[float]]) -> list[float]:
    return [abs(x - y) for ra, rb in zip(a, b, strict=True) for x, y in zip(ra, rb, strict=True)]


def _assert_close(got: list[list[float]], want: list[list[float]], kv: str) -> float:
    """The stated tolerance; returns the largest difference."""
    d = _diffs(got, want)
    assert max(d) < MAX_TOL[kv] and sum(d) / len(d) < MEAN_TOL[kv], (max(d), sum(d) / len(d))
    return max(d)


@pytest.mark.parametrize("kv", ["fp8_e4m3", "fp8_e5m2"])
def test_fp8_kv_cache_is_within_tolerance_and_holds_more_tokens(llama: str, baseline: dict,
                                                                kv: str) -> None:
    srv = _serve(llama, "--kv-cache-dtype", kv)
    try:
        info = srv.server_info()
        assert baseline["kv_dtype"] == "float32"
        assert info["kv_cache_dtype"] == {"fp8_e4m3": "float8_e4m3fn",
                                          "fp8_e5m2": "float8_e5m2"}[kv]
        assert info["max_total_num_tokens"] == 4 * baseline["tokens"]
        got = _prompt_logprobs(srv, baseline["seqs"])
        # a second pass reads the prompts' KV back from the radix cache (FP8 prefix)
        again = _prompt_logprobs(srv, baseline["seqs"])
        srv.assert_kv_invariant()
    finally:
        srv.stop()
    assert _assert_close(got, baseline["logprobs"], kv) > 1e-6
    _assert_close(again, baseline["logprobs"], kv)


def test_fp8_kv_cache_on_the_triton_backend(llama: str, baseline: dict) -> None:
    """The Triton kernels (interpreted on the CPU) read the FP8 pool: decode steps and a
    cached prefix, within the same tolerance of the float32 cache."""
    srv = _serve(llama, "--kv-cache-dtype", "fp8_e4m3", "--attention-backend", "triton")
    try:
        seqs = baseline["seqs"][:3]
        res = srv.generate({"input_ids": PROMPTS[:3], "sampling_params": GREEDY,
                            "return_logprob": True})
        got = _prompt_logprobs(srv, seqs)
    finally:
        srv.stop()
    assert _assert_close(got, baseline["logprobs"][:3], "fp8_e4m3") > 1e-6
    # decode steps read the FP8 pool: the output logprobs agree with the prompt logprobs of
    # the same tokens in the float32 run
    for r, seq, want in zip(res, seqs, baseline["logprobs"]):
        n = len(r["output_ids"])
        out = [x[0] for x in r["meta_info"]["output_token_logprobs"]]
        if r["output_ids"] == seq[-n:]:
            assert out == pytest.approx(want[-n:], abs=MAX_TOL["fp8_e4m3"])


def test_checkpoint_kv_scales_are_read(llama: str, tmp_path: Any, baseline: dict) -> None:
    """`self_attn.k_scale` / `v_scale` in the checkpoint: loaded onto the layers, and the
    server serves within tolerance with them."""
    from safetensors.torch import load_file, save_file

    from srt.models.llama import LlamaForCausalLM

    ckpt = str(tmp_path / "kv_scales")
    shutil.copytree(llama, ckpt)
    tensors = load_file(os.path.join(llama, "model.safetensors"))
    scales = {}
    for i in range(SMALL["num_hidden_layers"]):
        scales[f"model.layers.{i}.self_attn.k_scale"] = torch.tensor(0.021 + i / 100)
        scales[f"model.layers.{i}.self_attn.v_scale"] = torch.tensor(0.013 + i / 100)
    save_file({**tensors, **scales}, os.path.join(ckpt, "model.safetensors"),
              metadata={"format": "pt"})

    from transformers import AutoConfig

    model = LlamaForCausalLM(AutoConfig.from_pretrained(ckpt), 256)
    model.load_weights(load_file(os.path.join(ckpt, "model.safetensors")).items())
    for i, layer in enumerate(model.model.layers):
        assert layer.self_attn.attn.k_scale == pytest.approx(0.021 + i / 100)
        assert layer.self_attn.attn.v_scale == pytest.approx(0.013 + i / 100)

    srv = _serve(ckpt, "--kv-cache-dtype", "fp8_e4m3")
    try:
        got = _prompt_logprobs(srv, baseline["seqs"])
    finally:
        srv.stop()
    _assert_close(got, baseline["logprobs"], "fp8_e4m3")


def test_output_scale_names_are_kv_scales(llama: str) -> None:
    """Older llm-compressor checkpoints: `k_proj.output_scale` / `v_proj.output_scale`."""
    from safetensors.torch import load_file
    from transformers import AutoConfig

    from srt.models.llama import LlamaForCausalLM

    model = LlamaForCausalLM(AutoConfig.from_pretrained(llama), 256)
    state = load_file(os.path.join(llama, "model.safetensors"))
    state["model.layers.1.self_attn.k_proj.output_scale"] = torch.tensor([0.5])
    state["model.layers.1.self_attn.v_proj.output_scale"] = torch.tensor([0.25])
    model.load_weights(state.items())
    attn = model.model.layers[1].self_attn.attn
    assert (attn.k_scale, attn.v_scale) == (0.5, 0.25)
    assert model.model.layers[0].self_attn.attn.k_scale == 1.0


def test_a_non_positive_kv_scale_is_refused(llama: str) -> None:
    from safetensors.torch import load_file
    from transformers import AutoConfig

    from srt.models.llama import LlamaForCausalLM

    model = LlamaForCausalLM(AutoConfig.from_pretrained(llama), 256)
    state = load_file(os.path.join(llama, "model.safetensors"))
    state["model.layers.0.self_attn.k_scale"] = torch.tensor(0.0)
    with pytest.raises(ValueError, match="must be positive"):
        model.load_weights(state.items())


def test_cli_choices() -> None:
    from srt.server_args import ServerArgs

    with pytest.raises(SystemExit):
        ServerArgs.from_cli(["--kv-cache-dtype", "int8"])
    assert ServerArgs.from_cli(["--kv-cache-dtype", "fp8_e4m3"]).kv_cache_dtype == "fp8_e4m3"
    from srt.layers.kv_cache_dtype import resolve_kv_cache_dtype

    assert resolve_kv_cache_dtype("fp8", torch.bfloat16) == torch.float8_e4m3fn
    assert resolve_kv_cache_dtype("auto", torch.bfloat16) == torch.bfloat16
    assert json.loads(json.dumps(ServerArgs().kv_cache_dtype)) == "auto"
