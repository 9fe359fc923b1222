"""Mixtral: the Mistral decoder whose MLP is a top-2 mixture of experts (`block_sparse_moe`:
the router `gate` and `experts.{i}.w1/w2/w3`, loaded into srt.layers.moe.FusedMoE)."""

from __future__ import annotations

from typing import Any

from srt.models.llama import ArchOptions, LlamaForCausalLM


class MixtralForCausalLM(LlamaForCausalLM):
    @classmethod
    def arch_options(cls, config: Any) -> ArchOptions:
        return ArchOptions(moe=True)
