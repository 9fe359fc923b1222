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


@pytest.mark.parametrize("qc,words", [
    ({"quant_method": "awq", "bits": 4}, "quant_method 'awq'"),
    ({"quant_method": "gptq"}, "quant_method 'gptq'"),
    ({"quant_method": "fp8", "weight_block_size": [128, 128]}, "block-wise scales"),
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


def test_ignore_entries() -> None:
    q = CheckpointQuant("compressed-tensors", ("lm_head", "re:.*mlp\\.gate$"))
    assert not q.quantized("lm_head")
    assert not q.quantized("model.layers.0.mlp.gate")
    assert q.quantized("model.layers.0.mlp.gate_up_proj")
    assert q.quantized("model.layers.0.self_attn.qkv_proj")
