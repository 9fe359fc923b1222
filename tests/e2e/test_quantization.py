"""`--quantization fp8` through the real server on a small random Llama in float32 on the CPU:
greedy ids and prompt / output logprobs equal those of transformers holding the same
dequantized weights (each rank's shard quantized with its own per-channel scales), at --tp-size
1 and 2 (gloo). A checkpoint quantized in a format srt cannot load is refused at start-up,
naming its method."""

from __future__ import annotations

import json
import os
import shutil
from typing import Any

import pytest
import torch

from tests.e2e.test_models import NEW_TOKENS, PROMPTS, SMALL, Reference, _check, _serve, \
    start_fails
from tests.random_models import save_random_model

COLUMN = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")  # split by output rows
ROW = ("o_proj", "down_proj")  # split by input columns


def fp8_reference(path: str, tp: int) -> Reference:
    """transformers' greedy ids and logprobs with every decoder linear weight replaced by its
    FP8 round trip as rank r of `tp` holds it: a row-parallel weight's columns are cut in `tp`
    blocks, each with its own per-row scales."""
    from transformers import AutoModelForCausalLM

    from srt.layers.fp8 import dequantize, quantize_per_channel
    from tests.e2e.test_models import hf_reference

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    changed = 0
    with torch.no_grad():
        for name, mod in model.model.layers.named_modules():
            leaf = name.rsplit(".", 1)[-1]
            if leaf in COLUMN or leaf in ROW:
                w = mod.weight.data
                blocks = w.chunk(tp, dim=1) if leaf in ROW else [w]
                new = torch.cat([dequantize(*quantize_per_channel(b), torch.float32)
                                 for b in blocks], dim=1)
                changed += int(not torch.equal(new, w))
                mod.weight.data.copy_(new)
    assert changed == 2 * 7  # every linear layer of both decoder layers moved
    out = os.path.join(path, f"fp8_tp{tp}")
    model.save_pretrained(out)
    return hf_reference(out, PROMPTS, NEW_TOKENS)


@pytest.fixture(scope="module")
def llama(tmp_path_factory: Any) -> str:
    import transformers

    return save_random_model(str(tmp_path_factory.mktemp("llama_fp8")),
                             transformers.LlamaConfig, transformers.LlamaForCausalLM,
                             random_vectors=True, **SMALL)


@pytest.mark.parametrize("tp", [1, 2])
def test_fp8_weights_equal_the_dequantized_reference(llama: str, tp: int) -> None:
    ref = fp8_reference(llama, tp)
    if tp == 1:  # the comparison can tell: unquantized weights give other logprobs
        from tests.e2e.test_models import hf_reference

        plain = hf_reference(llama, PROMPTS, NEW_TOKENS)
        diff = max(abs(a - b) for x, y in zip(plain.prompt_logprobs, ref.prompt_logprobs)
                   for a, b in zip(x, y))
        assert diff > 100 * 1e-4, diff
    srv = _serve(llama, "--quantization", "fp8", "--tp-size", str(tp))
    try:
        info = srv.server_info()
        assert info["quantization"] == "fp8" and info["kv_cache_dtype"] == "float32"
        # qkv, o, gate_up and down of each of the 2 layers
        assert "quantization fp8: 8 linear layers in FP8 e4m3" in srv.log()
        _check(srv, ref)
        srv.assert_kv_invariant()
    finally:
        srv.stop()


def write_fp8_checkpoint(src: str, dst: str, method: str, strategy: str) -> None:
    """The random Llama at `src` quantized by our own quantizer into the on-disk layout of an
    FP8 checkpoint: `method` "fp8" (AutoFP8 / vLLM: a scalar `weight_scale` and `input_scale`
    per layer, static activations) or "compressed-tensors" (llm-compressor's
    float-quantized format: `weight_scale` [out, 1] per channel, dynamic per-token
    activations), with `quantization_config` as those tools write it."""
    from safetensors.torch import load_file, save_file

    from srt.layers.fp8 import FP8_DTYPE, FP8_MAX, quantize_per_channel

    shutil.copytree(src, dst)
    tensors = load_file(os.path.join(src, "model.safetensors"))
    out: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        leaf = name.rsplit(".", 2)[-2] if name.endswith(".weight") else ""
        if ".layers." not in name or leaf not in COLUMN + ROW:
            out[name] = t
            continue
        base = name[: -len(".weight")]
        if strategy == "tensor":
            scale = t.float().abs().max() / FP8_MAX
            out[name] = (t.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
            out[base + ".weight_scale"] = scale.reshape(())
        else:
            q, sc = quantize_per_channel(t)
            out[name] = q
            out[base + ".weight_scale"] = sc.reshape(-1, 1)
        if method == "fp8":
            out[base + ".input_scale"] = torch.tensor(0.05)
    save_file(out, os.path.join(dst, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(dst, "config.json")) as f:
        cfg = json.load(f)
    if method == "fp8":
        cfg["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "static",
                                      "ignored_layers": ["lm_head"]}
    else:
        cfg["quantization_config"] = {
            "quant_method": "compressed-tensors", "format": "float-quantized",
            "quantization_status": "compressed", "ignore": ["lm_head"],
            "config_groups": {"group_0": {
                "targets": ["Linear"],
                "weights": {"num_bits": 8, "type": "float", "strategy": strategy,
                            "symmetric": True, "dynamic": False},
                "input_activations": {"num_bits": 8, "type": "float", "strategy": "token",
                                      "symmetric": True, "dynamic": True}}}}
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(cfg, f)


def dequantized_reference(ckpt: str) -> Reference:
    """transformers with every FP8 weight of `ckpt` replaced by q * scale (float32)."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from tests.e2e.test_models import hf_reference

    tensors = load_file(os.path.join(ckpt, "model.safetensors"))
    plain = os.path.join(ckpt, "dequantized")
    cfg_path = os.path.join(ckpt, "config.json")
    with open(cfg_path) as f:
        cfg = json.load(f)
    cfg.pop("quantization_config")
    os.makedirs(plain, exist_ok=True)
    with open(os.path.join(plain, "config.json"), "w") as f:
        json.dump(cfg, f)
    model = AutoModelForCausalLM.from_config(
        __import__("transformers").AutoConfig.from_pretrained(plain), dtype=torch.float32)
    state = {}
    for name, t in tensors.items():
        if name.endswith((".weight_scale", ".input_scale")):
            continue
        if t.dtype == torch.float8_e4m3fn:
            sc = tensors[name[: -len(".weight")] + ".weight_scale"].float()
            t = t.float() * (sc.reshape(-1, 1) if sc.numel() > 1 else sc)
        state[name] = t.float()
    model.load_state_dict(state, strict=True)
    model.eval().save_pretrained(plain)
    return hf_reference(plain, PROMPTS, NEW_TOKENS)


@pytest.mark.parametrize("method,strategy,tp", [("fp8", "tensor", 1), ("fp8", "tensor", 2),
                                                 ("compressed-tensors", "channel", 2)])
def test_fp8_checkpoint_equals_its_dequantized_weights(llama: str, tmp_path: Any, method: str,
                                                       strategy: str, tp: int) -> None:
    ckpt = str(tmp_path / f"{method}-{strategy}")
    write_fp8_checkpoint(llama, ckpt, method, strategy)
    ref = dequantized_reference(ckpt)
    srv = _serve(ckpt, "--tp-size", str(tp))
    try:
        info = srv.server_info()
        assert info["quantization"] == f"fp8 ({method} checkpoint)"
        assert f"FP8 checkpoint ({method}): 8 linear layers load in FP8 e4m3" in srv.log()
        _check(srv, ref)
        srv.assert_kv_invariant()
    finally:
        srv.stop()


def test_a_checkpoint_in_an_unloadable_format_is_refused(llama: str, tmp_path: Any) -> None:
    bad = str(tmp_path / "awq")
    shutil.copytree(llama, bad)
    with open(os.path.join(bad, "config.json")) as f:
        cfg = json.load(f)
    cfg["quantization_config"] = {"quant_method": "awq", "bits": 4, "group_size": 128}
    with open(os.path.join(bad, "config.json"), "w") as f:
        json.dump(cfg, f)
    proc = start_fails(bad)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "quantized with quant_method 'awq'" in proc.stderr
    assert "which srt cannot load" in proc.stderr
