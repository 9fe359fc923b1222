"""Qwen2: the Llama decoder with biases on q, k and v (none on o); embeddings tied or not."""

from __future__ import annotations

from typing import Any

from srt.models.llama import ArchOptions, LlamaForCausalLM


class Qwen2ForCausalLM(LlamaForCausalLM):
    @classmethod
    def arch_options(cls, config: Any) -> ArchOptions:
        return ArchOptions(qkv_bias=True)
