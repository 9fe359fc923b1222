"""ModelConfig: the few facts about a checkpoint the runtime needs, read from its config.json."""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger(__name__)


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

    @classmethod
    def load(cls, path: str, context_length: int | None = None) -> "ModelConfig":
        from transformers import AutoConfig, GenerationConfig

        cfg = AutoConfig.from_pretrained(path)
        archs = getattr(cfg, "architectures", None) or []
        if not archs:
            raise ValueError(f"{path}/config.json names no architecture")
        heads = cfg.num_attention_heads
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
        ctx = context_length or getattr(cfg, "max_position_embeddings", None) or 2048
        window = sliding_window(cfg)
        if window is not None and ctx > window:
            # No backend restricts attention to a window; within the window full attention is
            # the same thing, so the context is capped there and longer requests get a 400.
            logger.warning(
                "the model uses sliding-window attention (window %d), which srt does not "
                "implement: the context length is capped at %d tokens (was %d); longer "
                "requests are refused", window, window, ctx,
            )
            ctx = window
        eos: set[int] = set()
        for src in (cfg, _generation_config(path, GenerationConfig)):
            value = getattr(src, "eos_token_id", None) if src is not None else None
            if isinstance(value, int):
                eos.add(value)
            elif isinstance(value, (list, tuple)):
                eos.update(int(v) for v in value)
        dtype = getattr(cfg, "dtype", None) or getattr(cfg, "torch_dtype", None)
        return cls(
            path=path,
            hf_config=cfg,
            architecture=archs[0],
            hidden_size=cfg.hidden_size,
            num_layers=cfg.num_hidden_layers,
            num_heads=heads,
            num_kv_heads=getattr(cfg, "num_key_value_heads", None) or heads,
            head_dim=head_dim,
            vocab_size=cfg.vocab_size,
            context_len=int(ctx),
            torch_dtype=str(dtype).replace("torch.", "") if dtype is not None else None,
            eos_token_ids=tuple(sorted(eos)),
            sliding_window=window,
        )


def _generation_config(path: str, gen_cls: Any) -> Any:
    try:
        return gen_cls.from_pretrained(path)
    except OSError:  # no generation_config.json: the model config's eos is all there is
        return None


def sliding_window(hf_config: Any) -> int | None:
    """The attention window of a config that uses one (Mistral, Mixtral; Qwen2/3 only when
    `use_sliding_window` is set), else None."""
    window = getattr(hf_config, "sliding_window", None)
    if not window or getattr(hf_config, "use_sliding_window", True) is False:
        return None
    return int(window)


def rope_params(hf_config: Any) -> tuple[float, dict[str, Any] | None]:
    """(theta, scaling) from either the transformers 5 `rope_parameters` or the older fields."""
    params = getattr(hf_config, "rope_parameters", None)
    if isinstance(params, dict) and "rope_theta" in params:
        scaling = params if params.get("rope_type", "default") != "default" else None
        return float(params["rope_theta"]), scaling
    theta = float(getattr(hf_config, "rope_theta", 10000.0))
    return theta, getattr(hf_config, "rope_scaling", None)


def check_tp_size(path: str, tp_size: int) -> None:
    """Refuse a --tp-size that cannot split the model's heads (read from config.json alone, so
    the launcher can say so before starting any process)."""
    with open(os.path.join(path, "config.json")) as f:
        cfg = json.load(f)
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
