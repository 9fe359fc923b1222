"""Mistral: the Llama decoder. Its `sliding_window` W is kept by every attention backend: a
query sees the W keys up to and including its own (`srt.model_config.layer_window`)."""

from __future__ import annotations

from srt.models.llama import LlamaForCausalLM


class MistralForCausalLM(LlamaForCausalLM):
    pass
