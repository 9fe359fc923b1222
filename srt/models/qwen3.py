"""Qwen3: the Llama decoder with an RMSNorm over each q and k head before rotary, and an explicit
`head_dim` that may differ from hidden_size / heads (handled by the shared attention)."""

from __future__ import annotations

from typing import Any

from srt.models.llama import ArchOptions, LlamaForCausalLM


class Qwen3ForCausalLM(LlamaForCausalLM):
    @classmethod
    def arch_options(cls, config: Any) -> ArchOptions:
        bias = bool(getattr(config, "attention_bias", False))
        return ArchOptions(qkv_bias=bias, o_bias=bias, qk_norm=True)
