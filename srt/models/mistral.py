"""Mistral: the Llama decoder. Its `sliding_window` is honoured by capping the context length at
the window (see `srt.model_config.sliding_window`): within the window, sliding-window attention
equals full attention, and longer requests are refused with a 400."""

from __future__ import annotations

from srt.models.llama import LlamaForCausalLM


class MistralForCausalLM(LlamaForCausalLM):
    pass
