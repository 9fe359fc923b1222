"""Maps a checkpoint's `architectures` name to our model class, imported lazily."""

from __future__ import annotations

import importlib

_MODELS: dict[str, str] = {
    "DeepseekV2ForCausalLM": "srt.models.deepseek_v2:DeepseekV2ForCausalLM",
    "DeepseekV3ForCausalLM": "srt.models.deepseek_v2:DeepseekV3ForCausalLM",
    "Gemma2ForCausalLM": "srt.models.gemma:Gemma2ForCausalLM",
    "Gemma3ForCausalLM": "srt.models.gemma:Gemma3ForCausalLM",
    "Gemma3ForConditionalGeneration": "srt.models.gemma:Gemma3ForConditionalGeneration",
    "LlamaForCausalLM": "srt.models.llama:LlamaForCausalLM",
    "LlavaForConditionalGeneration": "srt.models.llava:LlavaForConditionalGeneration",
    "MistralForCausalLM": "srt.models.mistral:MistralForCausalLM",
    "MixtralForCausalLM": "srt.models.mixtral:MixtralForCausalLM",
    "Phi3ForCausalLM": "srt.models.phi3:Phi3ForCausalLM",
    "Qwen2ForCausalLM": "srt.models.qwen2:Qwen2ForCausalLM",
    "Qwen2MoeForCausalLM": "srt.models.qwen_moe:Qwen2MoeForCausalLM",
    "Qwen3ForCausalLM": "srt.models.qwen3:Qwen3ForCausalLM",
    "Qwen3MoeForCausalLM": "srt.models.qwen_moe:Qwen3MoeForCausalLM",
}


def supported_architectures() -> list[str]:
    return sorted(_MODELS)


def get_model_class(architecture: str) -> type:
    if architecture not in _MODELS:
        raise ValueError(
            f"unsupported architecture {architecture!r}; supported: "
            f"{', '.join(supported_architectures())}"
        )
    module, cls = _MODELS[architecture].split(":")
    return getattr(importlib.import_module(module), cls)
