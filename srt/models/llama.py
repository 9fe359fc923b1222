"""Llama (Llama 2/3, SmolLM2) from our tensor-parallel layers."""

from __future__ import annotations

from typing import Any, Iterable

import torch
from torch import nn

from srt.layers.activation import SiluAndMul
from srt.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from srt.layers.forward_batch import ForwardBatch
from srt.layers.layernorm import RMSNorm
from srt.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from srt.layers.logits_processor import LogitsProcessor
from srt.layers.radix_attention import RadixAttention
from srt.layers.rotary import RotaryEmbedding
from srt.model_config import rope_params


class LlamaMLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int, bias: bool = False) -> None:
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(hidden, [intermediate] * 2, bias=bias)
        self.down_proj = RowParallelLinear(intermediate, hidden, bias=bias)
        self.act = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_up_proj(x)))


class LlamaAttention(nn.Module):
    def __init__(self, config: Any, layer_id: int, max_position: int) -> None:
        super().__init__()
        heads = config.num_attention_heads
        kv_heads = getattr(config, "num_key_value_heads", None) or heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        bias = bool(getattr(config, "attention_bias", False))
        self.qkv_proj = QKVParallelLinear(config.hidden_size, head_dim, heads, kv_heads, bias=bias)
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.q_size = self.num_heads * head_dim
        self.kv_size = self.num_kv_heads * head_dim
        self.head_dim = head_dim
        self.o_proj = RowParallelLinear(heads * head_dim, config.hidden_size, bias=bias)
        theta, scaling = rope_params(config)
        self.rotary_emb = RotaryEmbedding(head_dim, max_position, theta, scaling)
        self.attn = RadixAttention(
            self.num_heads, head_dim, head_dim**-0.5, self.num_kv_heads, layer_id
        )

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        qkv = self.qkv_proj(x)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q, k = self.rotary_emb(
            positions,
            q.reshape(-1, self.num_heads, self.head_dim),
            k.reshape(-1, self.num_kv_heads, self.head_dim),
        )
        o = self.attn(q.reshape(-1, self.q_size), k.reshape(-1, self.kv_size), v)
        return self.o_proj(o)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: Any, layer_id: int, max_position: int) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(config, layer_id, max_position)
        self.mlp = LlamaMLP(
            config.hidden_size, config.intermediate_size, bool(getattr(config, "mlp_bias", False))
        )
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self, positions: torch.Tensor, x: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual = x
            x = self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(positions, x)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


class LlamaModel(nn.Module):
    def __init__(self, config: Any, max_position: int) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, i, max_position) for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        residual = None
        for layer in self.layers:
            x, residual = layer(positions, x, residual)
        x, _ = self.norm(x, residual)
        return x


class LlamaForCausalLM(nn.Module):
    # checkpoint name fragment -> (our fragment, shard id)
    stacked_params = [
        (".q_proj", ".qkv_proj", "q"),
        (".k_proj", ".qkv_proj", "k"),
        (".v_proj", ".qkv_proj", "v"),
        (".gate_proj", ".gate_up_proj", 0),
        (".up_proj", ".gate_up_proj", 1),
    ]

    def __init__(self, config: Any, max_position: int) -> None:
        super().__init__()
        self.config = config
        self.model = LlamaModel(config, max_position)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        if not self.tie_word_embeddings:
            self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size)
        self.logits_processor = LogitsProcessor(config.vocab_size)

    def lm_head_weight(self) -> torch.Tensor:
        if self.tie_word_embeddings:
            return self.model.embed_tokens.weight
        return self.lm_head.weight

    def forward(self, fb: ForwardBatch) -> torch.Tensor:
        """Float32 logits [batch, vocab] for each request's next token."""
        hidden = self.model(fb.input_ids, fb.positions)
        return self.logits_processor(hidden, self.lm_head_weight(), fb)

    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> None:
        """weights: (checkpoint name, tensor or CheckpointTensor); each layer's loader reads
        only its rank's shard."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for name, tensor in weights:
            if "rotary_emb.inv_freq" in name:
                continue
            if self.tie_word_embeddings and name == "lm_head.weight":
                continue
            for src, dst, shard in self.stacked_params:
                if src in name:
                    target = name.replace(src, dst)
                    module = self.get_submodule(target.rsplit(".", 1)[0])
                    module.weight_loader(params[target], tensor, shard)
                    loaded.add(target)
                    break
            else:
                if name not in params:
                    raise ValueError(f"unexpected weight {name!r} in the checkpoint")
                module = self.get_submodule(name.rsplit(".", 1)[0])
                loader = getattr(module, "weight_loader", None)
                if loader is None:
                    params[name].data.copy_(tensor[:])
                else:
                    loader(params[name], tensor)
                loaded.add(name)
        missing = set(params) - loaded
        if missing:
            raise ValueError(f"weights missing from the checkpoint: {sorted(missing)[:5]}")
