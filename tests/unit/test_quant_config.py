"""Which checkpoint `quantization_config`s srt loads, and the refusals naming what it cannot."""

from __future__ import annotations

import json
import os
from typing import Any

import pytest

from srt.layers.quant_config import CheckpointQuant, checkpoint_quant


def _ckpt(tmp_path: Any, qc: dict[str, Any] | None, text: bool = False) -> str:
    cfg: dict[str, Any] = {"architectures": ["LlamaForCausalLM"]}
    if qc is not None:
        (cfg.setdefault("text_config", {}) if text else cfg)["quantization_config"] = qc
    with open(os.path.join(tmp_path, "config.json"), "w") as f:
        json.dump(cfg, f)
    return str(tmp_path)


def _ct(weights: dict[str, Any], fmt: str = "float-quantized", groups: int = 1) -> dict:
    return {"quant_method": "compressed-tensors", "format": fmt, "ignore": ["lm_head"],
            "config_groups": {f"group_{i}": {"weights": weights} for i in range(groups)}}


FP8_CHANNEL = {"num_bits": 8, "type": "float", "strategy": "channel"}


def test_loadable_formats(tmp_path: Any) -> None:
    assert checkpoint_quant(_ckpt(tmp_path, None)) is None
    assert checkpoint_quant(_ckpt(tmp_path, {"quant_method": "fp8"})) == CheckpointQuant("fp8")
    q = checkpoint_quant(_ckpt(tmp_path, _ct(FP8_CHANNEL)))
    assert q == CheckpointQuant("compressed-tensors", ("lm_head",))
    assert checkpoint_quant(_ckpt(tmp_path, {"quant_method": "fp8"}, text=True)) is not None
    block = {"quant_method": "fp8", "weight_block_size": [128, 128],
             "activation_scheme": "dynamic"}
    assert checkpoint_quant(_ckpt(tmp_path, block)) == CheckpointQuant("fp8", block=(128, 128))


@pytest.mark.parametrize("qc,words", [
    ({"quant_method": "awq", "bits": 4}, "quant_method 'awq' with group size None"),
    ({"quant_method": "awq", "bits": 4, "group_size": 100}, "group size 100"),
    ({"quant_method": "awq", "bits": 4, "group_size": 128, "version": "marlin"},
     "version 'marlin'"),
    ({"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": False},
     "no zero point"),
    ({"quant_method": "gptq"}, "quant_method 'gptq'"),
    ({"quant_method": "fp8", "weight_block_size": [128, 100]}, "weight_block_size [128, 100]"),
    (_ct({"num_bits": 4, "type": "int", "strategy": "group"}, fmt="pack-quantized"),
     "format 'pack-quantized'"),
    (_ct({"num_bits": 4, "type": "int", "strategy": "group"}), "weights of 4 bits of type 'int'"),
    (_ct({**FP8_CHANNEL, "strategy": "block"}), "weight strategy 'block'"),
    (_ct(FP8_CHANNEL, groups=2), "2 config groups"),
])
def test_refusals_name_the_reason(tmp_path: Any, qc: dict[str, Any], words: str) -> None:
    with pytest.raises(ValueError) as e:
        checkpoint_quant(_ckpt(tmp_path, qc))
    assert words in str(e.value) and "which srt cannot load" in str(e.value)


def test_awq(tmp_path: Any) -> None:
    qc = {"quant_method": "awq", "zero_point": True, "group_size": 64, "bits": 4,
          "version": "GEMM", "modules_to_not_convert": ["visual"]}
    q = checkpoint_quant(_ckpt(tmp_path, qc))
    assert q == CheckpointQuant("awq", ("visual",), 64) and not q.is_fp8
    assert not q.quantized("visual") and q.quantized("model.layers.0.mlp.down_proj")
    # AutoAWQ's older key names
    old = {"quant_method": "awq", "w_bit": 4, "q_group_size": 128, "zero_point": True}
    assert checkpoint_quant(_ckpt(tmp_path, old)).group_size == 128
    # a mixture of experts: no int4 expert kernel
    with open(os.path.join(tmp_path, "config.json")) as f:
        cfg = json.load(f)
    cfg["num_local_experts"] = 8
    with open(os.path.join(tmp_path, "config.json"), "w") as f:
        json.dump(cfg, f)
    with pytest.raises(ValueError, match="mixture-of-experts"):
        checkpoint_quant(str(tmp_path))


def test_ignore_entries() -> None:
    q = CheckpointQuant("compressed-tensors", ("lm_head", "re:.*mlp\\.gate$"))
    assert not q.quantized("lm_head")
    assert not q.quantized("model.layers.0.mlp.gate")
    assert q.quantized("model.layers.0.mlp.gate_up_proj")
    assert q.quantized("model.layers.0.self_attn.qkv_proj")


def test_ignore_entries_name_the_checkpoint_modules() -> None:
    """Tools name q_proj / gate_proj; srt's layers are qkv_proj / gate_up_proj."""
    q = CheckpointQuant("fp8", ("model.layers.0.self_attn.q_proj", "k_proj", "v_proj"))
    assert not q.quantized("model.layers.0.self_attn.qkv_proj")
    with pytest.raises(ValueError, match="quantizes only some of"):
        q.quantized("model.layers.1.self_attn.qkv_proj")  # k, v ignored, q not
    both = CheckpointQuant("fp8", ("gate_proj", "up_proj"))
    assert not both.quantized("model.layers.3.mlp.gate_up_proj")
    assert both.quantized("model.layers.3.mlp.down_proj")
    # AWQ: substrings, as AutoAWQ matches them
    awq = CheckpointQuant("awq", ("layers.1.",), 128)
    assert not awq.quantized("model.layers.1.mlp.gate_up_proj")
    assert awq.quantized("model.layers.11.mlp.gate_up_proj")


def test_quantization_flag_against_the_checkpoint(tmp_path: Any) -> None:
    from srt.model_config import check_quantization

    awq = _ckpt(tmp_path, {"quant_method": "awq", "bits": 4, "group_size": 128})
    check_quantization(awq, "awq")
    check_quantization(awq, "awq_marlin")  # vLLM's / SGLang's name for the same checkpoint
    with pytest.raises(ValueError, match="--quantization fp8 on an AWQ checkpoint"):
        check_quantization(awq, "fp8")
    for other in ("gptq", "gptq_marlin", "compressed-tensors"):
        with pytest.raises(ValueError, match=f"--quantization {other} needs an .* checkpoint "
                           "\\(quantization_config with quant_method '[a-z-]+'\\); .* is "
                           "quantized with awq"):
            check_quantization(awq, other)
    from srt.server_args import ServerArgs

    for flag in ("awq_marlin", "gptq_marlin", "compressed-tensors"):  # the flag takes them
        assert ServerArgs.from_cli(["--quantization", flag]).quantization == flag
    for sub, qc, flags in [
            ("gptq", {"quant_method": "gptq", "bits": 4, "group_size": 128},
             ("gptq", "gptq_marlin")),
            ("ct", _ct(FP8_CHANNEL), ("compressed-tensors", "fp8"))]:
        os.makedirs(tmp_path / sub)
        path = _ckpt(tmp_path / sub, qc)
        for flag in flags:
            check_quantization(path, flag)

