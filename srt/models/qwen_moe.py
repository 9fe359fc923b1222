"""Qwen2-MoE and Qwen3-MoE: the Qwen2 / Qwen3 decoder whose `mlp` is a top-k mixture of experts
on the sparse layers (`decoder_sparse_step`, `mlp_only_layers`): the router `gate`, experts
`experts.{i}.gate_proj / up_proj / down_proj` loaded into srt.layers.moe.FusedMoE (sharded under
tensor parallelism like Mixtral's), top-k weights renormalized where `norm_topk_prob`; Qwen2-MoE
adds a dense `shared_expert` under a sigmoid `shared_expert_gate`."""

from __future__ import annotations

from typing import Any

from srt.models.llama import ArchOptions, LlamaForCausalLM


class Qwen2MoeForCausalLM(LlamaForCausalLM):
    @classmethod
    def arch_options(cls, config: Any) -> ArchOptions:
        return ArchOptions(qkv_bias=bool(getattr(config, "qkv_bias", True)), qwen_moe=True)


class Qwen3MoeForCausalLM(LlamaForCausalLM):
    @classmethod
    def arch_options(cls, config: Any) -> ArchOptions:
        bias = bool(getattr(config, "attention_bias", False))
        return ArchOptions(qkv_bias=bias, o_bias=bias, qk_norm=True, qwen_moe=True)
