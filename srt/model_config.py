"""ModelConfig: the few facts about a checkpoint the runtime needs, read from its config.json."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any


# Architectures whose vision tower srt runs (their prompts take images).
IMAGE_ARCHITECTURES = ("LlavaForConditionalGeneration",)


@dataclass(frozen=True)
class ModelConfig:
    path: str
    hf_config: Any  # transformers.PretrainedConfig
    architecture: str
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    context_len: int
    torch_dtype: str | None
    eos_token_ids: tuple[int, ...]
    sliding_window: int | None = None
    # Image input (LLaVA): the prompt's image token and how many positions one image fills.
    image_token_id: int | None = None
    image_tokens: int = 0
    image_size: int = 0  # side of the square pixel input the vision tower takes

    @classmethod
    def load(cls, path: str, context_length: int | None = None) -> "ModelConfig":
        from transformers import AutoConfig, GenerationConfig

        cfg = AutoConfig.from_pretrained(path)
        archs = getattr(cfg, "architectures", None) or []
        if not archs:
            raise ValueError(f"{path}/config.json names no architecture")
        # A multimodal config keeps the language model's facts in its text config.
        text = cfg.get_text_config()
        heads = text.num_attention_heads
        head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
        ctx = context_length or getattr(text, "max_position_embeddings", None) or 2048
        window = sliding_window(text)
        eos: set[int] = set()
        for src in (cfg, text, _generation_config(path, GenerationConfig)):
            value = getattr(src, "eos_token_id", None) if src is not None else None
            if isinstance(value, int):
                eos.add(value)
            elif isinstance(value, (list, tuple)):
                eos.update(int(v) for v in value)
        dtype = getattr(cfg, "dtype", None) or getattr(cfg, "torch_dtype", None)
        # (Gemma 3's multimodal checkpoints are served for text only: no image facts)
        image = image_input_facts(cfg) if archs[0] in IMAGE_ARCHITECTURES else None
        return cls(
            path=path,
            hf_config=cfg,
            architecture=archs[0],
            hidden_size=text.hidden_size,
            num_layers=text.num_hidden_layers,
            num_heads=heads,
            num_kv_heads=getattr(text, "num_key_value_heads", None) or heads,
            head_dim=head_dim,
            vocab_size=text.vocab_size,
            context_len=int(ctx),
            torch_dtype=str(dtype).replace("torch.", "") if dtype is not None else None,
            eos_token_ids=tuple(sorted(eos)),
            sliding_window=window,
            image_token_id=image[0] if image else None,
            image_tokens=image[1] if image else 0,
            image_size=image[2] if image else 0,
        )


def image_input_facts(hf_config: Any) -> tuple[int, int, int] | None:
    """(image token id, positions per image, input side in pixels) of a LLaVA config, else
    None. Positions per image: one per patch, plus the CLS position under the "full" feature
    strategy ("default" drops it)."""
    vision = getattr(hf_config, "vision_config", None)
    if vision is None:
        return None
    token = getattr(hf_config, "image_token_id", None)
    if token is None:
        token = getattr(hf_config, "image_token_index", None)
    if token is None:
        raise ValueError("the model has a vision tower but its config names no image token")
    patches = (vision.image_size // vision.patch_size) ** 2
    strategy = getattr(hf_config, "vision_feature_select_strategy", "default")
    if strategy not in ("default", "full"):
        raise ValueError(f"vision_feature_select_strategy {strategy!r} is not supported "
                         "(default, full)")
    n = patches + (1 if strategy == "full" else 0)
    if n < 2:
        # Pad ids start with the image token itself; with one position every image would
        # get the same ids and share KV in the prefix cache.
        raise ValueError(f"an image fills {n} position(s); at least 2 are needed")
    return int(token), n, int(vision.image_size)


def _generation_config(path: str, gen_cls: Any) -> Any:
    try:
        return gen_cls.from_pretrained(path)
    except OSError:  # no generation_config.json: the model config's eos is all there is
        return None


def sliding_window(hf_config: Any) -> int | None:
    """The attention window of a config that uses one (Mistral, Mixtral, Gemma 2/3; Qwen2/3
    only when `use_sliding_window` is set), else None. Which layers use it:
    `layer_window`."""
    window = getattr(hf_config, "sliding_window", None)
    if not window or getattr(hf_config, "use_sliding_window", True) is False:
        return None
    return int(window)


def layer_window(hf_config: Any, layer_id: int) -> int | None:
    """The window of one layer: the config's, on the layers `layer_types` marks
    "sliding_attention" (every layer of a config without `layer_types`, as Mistral's)."""
    window = sliding_window(hf_config)
    types = getattr(hf_config, "layer_types", None)
    if window is None or (types and types[layer_id] != "sliding_attention"):
        return None
    return window


def rope_params(hf_config: Any) -> tuple[float, dict[str, Any] | None]:
    """(theta, scaling) from either the transformers 5 `rope_parameters` or the older fields.
    A LongRoPE scaling also carries the config's `original_max_position_embeddings` and
    `max_position_embeddings` where it lacks them."""
    params = getattr(hf_config, "rope_parameters", None)
    if isinstance(params, dict) and "rope_theta" in params:
        scaling = params if params.get("rope_type", "default") != "default" else None
        theta = float(params["rope_theta"])
    else:
        theta = float(getattr(hf_config, "rope_theta", 10000.0))
        scaling = getattr(hf_config, "rope_scaling", None)
    if scaling and scaling.get("rope_type", scaling.get("type")) in ("longrope", "su"):
        scaling = dict(scaling)
        for key in ("original_max_position_embeddings", "max_position_embeddings"):
            if key not in scaling and getattr(hf_config, key, None) is not None:
                scaling[key] = getattr(hf_config, key)
    return theta, scaling


def rotary_dim(hf_config: Any, head_dim: int) -> int:
    """The rotating dimensions of a head: head_dim x `partial_rotary_factor` (transformers 5's
    `rope_parameters` or the older field; 1 if neither)."""
    params = getattr(hf_config, "rope_parameters", None)
    factor = params.get("partial_rotary_factor") if isinstance(params, dict) else None
    if factor is None:
        factor = getattr(hf_config, "partial_rotary_factor", None) or 1.0
    return int(head_dim * float(factor))


def check_tp_size(path: str, tp_size: int) -> None:
    """Refuse a --tp-size that cannot split the model's heads (read from config.json alone, so
    the launcher can say so before starting any process)."""
    with open(os.path.join(path, "config.json")) as f:
        cfg = json.load(f)
    cfg = cfg.get("text_config") or cfg  # multimodal: the language model's heads
    heads = cfg.get("num_attention_heads")
    if heads is None:
        return
    kv_heads = cfg.get("num_key_value_heads") or heads
    if heads % tp_size:
        raise ValueError(
            f"--tp-size {tp_size} does not divide the model's {heads} attention heads; "
            f"use a divisor of {heads}"
        )
    if kv_heads % tp_size and tp_size % kv_heads:
        raise ValueError(
            f"--tp-size {tp_size} and the model's {kv_heads} KV heads: one must divide the other"
        )


# --quantization values that name a checkpoint format srt reads as it is -> its quant_method
# (the Marlin names are vLLM's / SGLang's kernel choices for the same AWQ / GPTQ checkpoints)
CHECKPOINT_METHODS = {"awq": "awq", "gptq": "gptq", "awq_marlin": "awq",
                      "gptq_marlin": "gptq", "compressed-tensors": "compressed-tensors"}


def check_quantization(path: str, asked: str | None = None) -> None:
    """Refuse a pre-quantized checkpoint srt cannot load, naming its method (from config.json
    alone, before any process starts; srt/layers/quant_config.py); and a `--quantization`
    naming a checkpoint format (CHECKPOINT_METHODS) for a checkpoint that is not in it (srt
    quantizes to int4 only offline)."""
    from srt.layers.quant_config import checkpoint_quant

    ckpt = checkpoint_quant(path)
    if asked == "fp8" and ckpt is not None and ckpt.is_int4:
        name = ckpt.method.upper()
        raise ValueError(f"--quantization fp8 on an {name} checkpoint: its int4 weights load "
                         f"as they are; drop --quantization (or pass --quantization "
                         f"{ckpt.method})")
    method = CHECKPOINT_METHODS.get(asked or "")
    if method is not None and (ckpt is None or ckpt.method != method):
        name = method.upper() if method != "compressed-tensors" else "FP8 compressed-tensors"
        raise ValueError(f"--quantization {asked} needs an {name} checkpoint "
                         f"(quantization_config with quant_method '{method}'); {path} is "
                         f"{'not quantized' if ckpt is None else 'quantized with ' + ckpt.method}")
