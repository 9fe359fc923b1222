"""Quantized weights through the real server on a small random Llama in float32 on the CPU:
`--quantization fp8`, FP8 checkpoints (AutoFP8 and compressed-tensors layouts), AWQ int4
checkpoints (AutoAWQ's GEMM layout) and GPTQ int4 checkpoints (GPTQModel's layout, v1 and v2),
each written by our own quantizer. Greedy ids and prompt /
output logprobs equal those of transformers holding the same dequantized weights (for
`--quantization fp8` each rank's shard quantized with its own per-channel scales), at
--tp-size 1 and 2 (gloo). (transformers loads neither AWQ, GPTQ nor these FP8 layouts on the
CPU without extra packages, so the dequantized model is the reference.) A checkpoint quantized in
a format srt cannot load is refused at start-up, naming its method."""

from __future__ import annotations

import json
import os
import shutil
from typing import Any, Callable

import pytest
import torch

from tests.e2e.test_models import NEW_TOKENS, PROMPTS, SMALL, Reference, _check, _serve, \
    start_fails
from tests.random_models import save_random_model

COLUMN = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")  # split by output rows
ROW = ("o_proj", "down_proj")  # split by input columns


EXPERT_COLUMN = ("w1", "w3")  # Mixtral's experts: gate and up, split by output rows
EXPERT_ROW = ("w2",)  # down, split by input columns


def _leaf(name: str) -> str:
    """`q_proj` of `model.layers.0.self_attn.q_proj.weight` (empty for other tensors)."""
    return name.rsplit(".", 2)[-2] if ".layers." in name and name.endswith(".weight") else ""


def fp8_reference(path: str, tp: int) -> Reference:
    """transformers' greedy ids and logprobs with every decoder linear weight and expert
    replaced by its FP8 round trip as rank r of `tp` holds it: a row-parallel weight's columns
    are cut in `tp` blocks, each with its own per-row scales."""
    from safetensors.torch import load_file

    from srt.layers.fp8 import dequantize, quantize_per_channel

    state = load_file(os.path.join(path, "model.safetensors"))
    changed = 0
    for name, w in list(state.items()):
        leaf = _leaf(name)
        if leaf in COLUMN + ROW + EXPERT_COLUMN + EXPERT_ROW:
            blocks = w.chunk(tp, dim=1) if leaf in ROW + EXPERT_ROW else [w]
            new = torch.cat([dequantize(*quantize_per_channel(b), torch.float32)
                             for b in blocks], dim=1)
            changed += int(not torch.equal(new, w))
            state[name] = new
    quantized = COLUMN + ROW + EXPERT_COLUMN + EXPERT_ROW
    assert changed == sum(1 for n in state if _leaf(n) in quantized)  # every one moved
    out = os.path.join(path, f"fp8_tp{tp}")
    shutil.copytree(path, out, ignore=shutil.ignore_patterns("fp8_tp*", "dequantized"))
    return plain_reference(out, state)


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
        assert "quantization fp8: 8 layers in FP8 e4m3" in srv.log()
        _check(srv, ref)
        srv.assert_kv_invariant()
    finally:
        srv.stop()


def rewrite_checkpoint(src: str, dst: str, quantize: Callable[[str, torch.Tensor],
                                                              dict[str, torch.Tensor]],
                       qc: dict[str, Any], select: Callable[[str], bool] | None = None) -> None:
    """A copy of the checkpoint at `src` in `dst` whose decoder linear weights (those of them
    `select(name)` accepts, when given) are replaced by `quantize(name without ".weight",
    weight)`'s tensors, with `quantization_config` qc."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    tensors = load_file(os.path.join(src, "model.safetensors"))
    out: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        if (_leaf(name) in COLUMN + ROW + EXPERT_COLUMN + EXPERT_ROW
                and (select is None or select(name))):
            out.update(quantize(name[: -len(".weight")], t))
        else:
            out[name] = t
    save_file(out, os.path.join(dst, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(dst, "config.json")) as f:
        cfg = json.load(f)
    cfg["quantization_config"] = qc
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(cfg, f)


def write_fp8_checkpoint(src: str, dst: str, method: str, strategy: str) -> None:
    """The random Llama at `src` quantized by our own quantizer into the on-disk layout of an
    FP8 checkpoint: `method` "fp8" (AutoFP8 / vLLM: a scalar `weight_scale` and `input_scale`
    per layer, static activations) or "compressed-tensors" (llm-compressor's
    float-quantized format: `weight_scale` [out, 1] per channel, dynamic per-token
    activations), with `quantization_config` as those tools write it."""
    from srt.layers.fp8 import FP8_DTYPE, FP8_MAX, quantize_per_channel

    def quantize(base: str, t: torch.Tensor) -> dict[str, torch.Tensor]:
        if strategy == "tensor":
            scale = t.float().abs().max() / FP8_MAX
            out = {base + ".weight": (t.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE),
                   base + ".weight_scale": scale.reshape(())}
        else:
            q, sc = quantize_per_channel(t)
            out = {base + ".weight": q, base + ".weight_scale": sc.reshape(-1, 1)}
        if method == "fp8":
            out[base + ".input_scale"] = torch.tensor(0.05)
        return out

    if method == "fp8":
        qc = {"quant_method": "fp8", "activation_scheme": "static", "ignored_layers": ["lm_head"]}
    else:
        qc = {
            "quant_method": "compressed-tensors", "format": "float-quantized",
            "quantization_status": "compressed", "ignore": ["lm_head"],
            "config_groups": {"group_0": {
                "targets": ["Linear"],
                "weights": {"num_bits": 8, "type": "float", "strategy": strategy,
                            "symmetric": True, "dynamic": False},
                "input_activations": {"num_bits": 8, "type": "float", "strategy": "token",
                                      "symmetric": True, "dynamic": True}}}}
    rewrite_checkpoint(src, dst, quantize, qc)


def plain_reference(ckpt: str, state: dict[str, torch.Tensor]) -> Reference:
    """transformers' greedy ids and logprobs for `ckpt`'s config (without its
    quantization_config) holding `state` (checkpoint names, float32)."""
    from safetensors.torch import save_file

    from tests.e2e.test_models import hf_reference

    plain = os.path.join(ckpt, "dequantized")
    os.makedirs(plain, exist_ok=True)
    with open(os.path.join(ckpt, "config.json")) as f:
        cfg = json.load(f)
    cfg.pop("quantization_config", None)
    cfg["torch_dtype"] = "float32"
    with open(os.path.join(plain, "config.json"), "w") as f:
        json.dump(cfg, f)
    save_file({k: v.float().contiguous() for k, v in state.items()},
              os.path.join(plain, "model.safetensors"), metadata={"format": "pt"})
    return hf_reference(plain, PROMPTS, NEW_TOKENS)


def dequantized_reference(ckpt: str) -> Reference:
    """transformers with every FP8 weight of `ckpt` replaced by q * scale (float32)."""
    from safetensors.torch import load_file

    tensors = load_file(os.path.join(ckpt, "model.safetensors"))
    state = {}
    for name, t in tensors.items():
        if name.endswith((".weight_scale", ".input_scale")):
            continue
        if t.dtype == torch.float8_e4m3fn:
            sc = tensors[name[: -len(".weight")] + ".weight_scale"].float()
            t = t.float() * (sc.reshape(-1, 1) if sc.numel() > 1 else sc)
        state[name] = t.float()
    return plain_reference(ckpt, state)


@pytest.mark.parametrize("method,strategy,tp", [("fp8", "tensor", 1), ("fp8", "tensor", 2),
                                                 ("compressed-tensors", "channel", 2)])
def test_fp8_checkpoint_equals_its_dequantized_weights(llama: str, tmp_path: Any, method: str,
                                                       strategy: str, tp: int) -> None:
    ckpt = str(tmp_path / f"{method}-{strategy}")
    write_fp8_checkpoint(llama, ckpt, method, strategy)
    ref = dequantized_reference(ckpt)
    _serve_and_check(ckpt, ref, f"fp8 ({method} checkpoint)",
                     f"FP8 checkpoint ({method}): 8 layers load in FP8 e4m3",
                     "--tp-size", str(tp))


def write_block_fp8_checkpoint(src: str, dst: str, block: tuple[int, int]) -> None:
    """The random Llama at `src` in the block-wise FP8 layout (DeepSeek-V3 / Qwen3-FP8:
    `weight` e4m3 and `weight_scale_inv` [N / Bn, K / Bk], one scale per block of the
    largest magnitude / 448), quantized by our own quantizer."""
    from srt.layers.fp8 import FP8_DTYPE, FP8_MAX

    bn, bk = block

    def quantize(base: str, t: torch.Tensor) -> dict[str, torch.Tensor]:
        n, k = t.shape
        blocks = t.float().reshape(n // bn, bn, k // bk, bk)
        scale = blocks.abs().amax(dim=(1, 3)) / FP8_MAX  # [N / Bn, K / Bk]
        q = (blocks / scale[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).reshape(n, k)
        return {base + ".weight": q.to(FP8_DTYPE), base + ".weight_scale_inv": scale}

    rewrite_checkpoint(src, dst, quantize, {
        "quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3",
        "weight_block_size": list(block)})


@pytest.mark.parametrize("model,tp", [("llama", 1), ("llama", 2), ("mixtral", 2)])
def test_block_fp8_checkpoint_equals_its_dequantized_weights(request: Any, tmp_path: Any,
                                                             model: str, tp: int) -> None:
    """Blocks of 32 x 64 (not square, so swapped axes fail), every shard and every merged
    part a whole number of blocks at tp 2; Mixtral's experts too (dequantized at load)."""
    from safetensors.torch import load_file

    from srt.layers.fp8_block import dequantize_block

    ckpt = str(tmp_path / "block")
    write_block_fp8_checkpoint(request.getfixturevalue(model), ckpt, (32, 64))
    tensors = load_file(os.path.join(ckpt, "model.safetensors"))
    state = {}
    for name, t in tensors.items():
        if name.endswith(".weight_scale_inv"):
            continue
        if t.dtype == torch.float8_e4m3fn:
            t = dequantize_block(t, tensors[name + "_scale_inv"], (32, 64), torch.float32)
        state[name] = t.float()
    layers = 8 if model == "llama" else 6  # (qkv, o, gate_up / experts, down) x 2
    _serve_and_check(ckpt, plain_reference(ckpt, state),
                     "fp8 (fp8 checkpoint, blocks of 32x64)",
                     f"FP8 checkpoint (fp8): {layers} layers load in FP8 e4m3",
                     "--tp-size", str(tp))


@pytest.fixture(scope="module")
def mixtral(tmp_path_factory: Any) -> str:
    import transformers

    from tests.e2e.test_models import MODELS

    cfg, cls, over = MODELS["mixtral"]
    return save_random_model(str(tmp_path_factory.mktemp("mixtral_fp8")),
                             getattr(transformers, cfg), getattr(transformers, cls),
                             random_vectors=True, **{**SMALL, **over})


@pytest.mark.parametrize("tp", [1, 2])
def test_fp8_mixtral_experts_equal_the_dequantized_reference(mixtral: str, tp: int) -> None:
    """`--quantization fp8` on Mixtral: attention and every expert in FP8 (the router and
    embeddings not); at tp 2 each rank quantizes its column block of the experts' w2."""
    ref = fp8_reference(mixtral, tp)
    srv = _serve(mixtral, "--quantization", "fp8", "--tp-size", str(tp))
    try:
        # qkv and o of each of the 2 layers, and the 2 expert layers
        assert "quantization fp8: 6 layers in FP8 e4m3" in srv.log()
        _check(srv, ref)
    finally:
        srv.stop()


def test_fp8_mixtral_checkpoint(mixtral: str, tmp_path: Any) -> None:
    """An AutoFP8 Mixtral checkpoint (per-tensor scales, experts included) at tp 2."""
    ckpt = str(tmp_path / "mixtral-fp8")
    write_fp8_checkpoint(mixtral, ckpt, "fp8", "tensor")
    _serve_and_check(ckpt, dequantized_reference(ckpt), "fp8 (fp8 checkpoint)",
                     "FP8 checkpoint (fp8): 6 layers load in FP8 e4m3", "--tp-size", "2")


def _serve_and_check(ckpt: str, ref: Reference, quantization: str, log_line: str,
                     *flags: str) -> None:
    srv = _serve(ckpt, *flags)
    try:
        assert srv.server_info()["quantization"] == quantization
        assert log_line in srv.log()
        _check(srv, ref)
        srv.assert_kv_invariant()
    finally:
        srv.stop()


def write_awq_checkpoint(src: str, dst: str, group: int) -> None:
    """The random Llama at `src` quantized by our own int4 quantizer into AutoAWQ's GEMM
    layout (`qweight`, `qzeros`, `scales` float16 per decoder linear layer), with the
    `quantization_config` AutoAWQ writes."""
    from srt.layers.awq import quantize_awq

    def quantize(base: str, t: torch.Tensor) -> dict[str, torch.Tensor]:
        return dict(zip((base + ".qweight", base + ".qzeros", base + ".scales"),
                        quantize_awq(t, group)))

    rewrite_checkpoint(src, dst, quantize,
                       {"quant_method": "awq", "zero_point": True, "group_size": group,
                        "bits": 4, "version": "gemm", "modules_to_not_convert": None})


def awq_dequantized_reference(ckpt: str) -> Reference:
    """transformers with every AWQ layer of `ckpt` replaced by its dequantized weight."""
    from safetensors.torch import load_file

    from srt.layers.awq import dequantize_awq

    tensors = load_file(os.path.join(ckpt, "model.safetensors"))
    state = {}
    for name, t in tensors.items():
        if name.endswith((".qzeros", ".scales")):
            continue
        if name.endswith(".qweight"):
            base = name[: -len(".qweight")]
            state[base + ".weight"] = dequantize_awq(t, tensors[base + ".qzeros"],
                                                     tensors[base + ".scales"], torch.float32)
        else:
            state[name] = t.float()
    return plain_reference(ckpt, state)


@pytest.mark.parametrize("group,tp", [(128, 1), (32, 2)])
def test_awq_checkpoint_equals_its_dequantized_weights(llama: str, tmp_path: Any, group: int,
                                                       tp: int) -> None:
    ckpt = str(tmp_path / f"awq-g{group}")
    write_awq_checkpoint(llama, ckpt, group)
    ref = awq_dequantized_reference(ckpt)
    if tp == 1:  # the comparison can tell: unquantized weights give other logprobs
        from tests.e2e.test_models import hf_reference

        plain = hf_reference(llama, PROMPTS, NEW_TOKENS)
        diff = max(abs(a - b) for x, y in zip(plain.prompt_logprobs, ref.prompt_logprobs)
                   for a, b in zip(x, y))
        assert diff > 100 * 1e-4, diff
    _serve_and_check(ckpt, ref, f"awq (int4, group {group})",
                     f"AWQ checkpoint: 8 linear layers load in int4, group size {group}",
                     "--tp-size", str(tp), *(["--quantization", "awq"] if tp == 1 else []))


def test_awq_with_random_weights(llama: str, tmp_path: Any) -> None:
    """`--load-format dummy` on an AWQ config (the benchmarks' int4 runs): the layers take the
    AWQ layout and serve."""
    ckpt = str(tmp_path / "awq-dummy")
    write_awq_checkpoint(llama, ckpt, 64)
    srv = _serve(ckpt, "--load-format", "dummy")
    try:
        assert srv.server_info()["quantization"] == "awq (int4, group 64)"
        res = srv.generate({"input_ids": PROMPTS[:2], "sampling_params": {
            "temperature": 0, "max_new_tokens": 4, "ignore_eos": True}})
        assert [len(r["output_ids"]) for r in res] == [4, 4]
    finally:
        srv.stop()


def write_gptq_checkpoint(src: str, dst: str, group: int, sym: bool, v2: bool,
                          act_order: bool = False,
                          select: Callable[[str], bool] | None = None) -> None:
    """The random Llama at `src` quantized by our own int4 quantizer into GPTQ's layout
    (`qweight`, `qzeros`, `scales` float16, `g_idx` per decoder linear layer; `select` as in
    rewrite_checkpoint), with the `quantization_config` GPTQModel writes. act_order: each
    layer's g_idx a permutation of its groups, as desc_act leaves it (shared by the layers
    that share their input)."""
    from srt.layers.gptq import quantize_gptq

    def quantize(base: str, t: torch.Tensor) -> dict[str, torch.Tensor]:
        tensors = list(quantize_gptq(t, group, sym, v2))
        if act_order:  # q / k / v (gate / up) share their input, hence their order
            seed = sum(map(ord, base.replace("k_proj", "q_proj").replace("v_proj", "q_proj")
                           .replace("up_proj", "gate_proj")))
            perm = torch.randperm(t.shape[1], generator=torch.Generator().manual_seed(seed))
            tensors[3] = tensors[3][perm].contiguous()
        names = ("qweight", "qzeros", "scales", "g_idx")
        return {f"{base}.{n}": x for n, x in zip(names, tensors)}

    fmt = "gptq_v2" if v2 else "gptq"
    rewrite_checkpoint(src, dst, quantize, {
        "quant_method": "gptq", "bits": 4, "group_size": group, "desc_act": act_order,
        "sym": sym, "lm_head": False, "format": fmt, "checkpoint_format": fmt,
        "pack_dtype": "int32", "meta": {"damp_percent": 0.05, "true_sequential": True,
                                        "static_groups": False}}, select)


def gptq_dequantized_reference(ckpt: str, v2: bool) -> Reference:
    """transformers with every GPTQ layer of `ckpt` replaced by its dequantized weight."""
    return plain_reference(ckpt, gptq_dequantized_state(ckpt, v2))


def gptq_dequantized_state(ckpt: str, v2: bool) -> dict[str, torch.Tensor]:
    """`ckpt`'s tensors in float32, each GPTQ layer's as its dequantized `weight`."""
    from safetensors.torch import load_file

    from srt.layers.gptq import dequantize_gptq

    tensors = load_file(os.path.join(ckpt, "model.safetensors"))
    state = {}
    for name, t in tensors.items():
        if name.endswith((".qzeros", ".scales", ".g_idx")):
            continue
        if name.endswith(".qweight"):
            base = name[: -len(".qweight")]
            state[base + ".weight"] = dequantize_gptq(
                t, tensors[base + ".qzeros"], tensors[base + ".scales"], tensors[base + ".g_idx"],
                torch.float32, v2)
        else:
            state[name] = t.float()
    return state


@pytest.mark.parametrize("group,sym,v2,tp", [(64, True, False, 1), (32, False, True, 2)])
def test_gptq_checkpoint_equals_its_dequantized_weights(llama: str, tmp_path: Any, group: int,
                                                        sym: bool, v2: bool, tp: int) -> None:
    """GPTQ in act order (desc_act: each layer's input channels sorted by group at load): v1
    symmetric (GPTQModel's default) at TP 1; v2 asymmetric at TP 2, where each rank's
    row-parallel shard (o_proj, down_proj) reads every group's scales and pads its groups'
    runs to whole blocks."""
    ckpt = str(tmp_path / f"gptq-g{group}")
    write_gptq_checkpoint(llama, ckpt, group, sym, v2, act_order=True)
    ref = gptq_dequantized_reference(ckpt, v2)
    _serve_and_check(ckpt, ref, f"gptq (int4, group {group})",
                     f"GPTQ checkpoint ({'gptq_v2' if v2 else 'gptq'}): 8 linear layers load "
                     f"in int4, group {group}",
                     "--tp-size", str(tp), *(["--quantization", "gptq"] if tp == 1 else []))


def _with_quant_config(src: str, dst: str, qc: dict[str, Any]) -> str:
    shutil.copytree(src, dst)
    with open(os.path.join(dst, "config.json")) as f:
        cfg = json.load(f)
    cfg["quantization_config"] = qc
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(cfg, f)
    return dst


@pytest.mark.parametrize("qc,why", [
    ({"quant_method": "gptq", "bits": 3, "group_size": 128}, "quant_method 'gptq' with 3 bits"),
    ({"quant_method": "gguf"}, "quant_method 'gguf'"),
    ({"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemv"},
     "quant_method 'awq' with version 'gemv'"),
    ({"quant_method": "awq", "bits": 8, "group_size": 128}, "quant_method 'awq' with 8 bits"),
])
def test_a_checkpoint_in_an_unloadable_format_is_refused(llama: str, tmp_path: Any,
                                                          qc: dict, why: str) -> None:
    proc = start_fails(_with_quant_config(llama, str(tmp_path / "bad"), qc))
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert f"quantized with {why}" in proc.stderr
    assert "which srt cannot load" in proc.stderr


@pytest.mark.parametrize("method", ["awq", "gptq"])
def test_quantization_int4_needs_its_checkpoint(llama: str, method: str) -> None:
    proc = start_fails(llama, "--quantization", method)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert f"--quantization {method} needs an {method.upper()} checkpoint" in proc.stderr
