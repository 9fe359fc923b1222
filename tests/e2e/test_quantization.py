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
