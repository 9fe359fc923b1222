"""Gemma 2 (`Gemma2ForCausalLM`) and Gemma 3's text model (`Gemma3ForCausalLM`).

What differs from the Llama decoder: sliding-window layers interleaved with global ones
(`layer_types`; the window's keys only, see RadixAttention), attention scores scaled by
`query_pre_attn_scalar`^-0.5, four norms a layer (after attention and around the MLP too), each
scaling by 1 + weight, embeddings times sqrt(hidden_size), a GELU (tanh) gated MLP, tied
embeddings. Gemma 2 soft-caps the attention scores and the final logits; Gemma 3 instead
normalizes each q and k head, and its sliding layers take their own rotary base.

The KV pool keeps every token of every layer (page size 1, one slot per token for all layers):
a sliding layer reads only the window's keys but its older entries are not freed.
"""

from __future__ import annotations

import copy
from typing import Any, Iterable, Iterator

import torch
from torch import nn

from srt.layers.activation import GeluAndMul
from srt.layers.embedding import VocabParallelEmbedding
from srt.layers.layernorm import GemmaRMSNorm
from srt.layers.linear import QKVParallelLinear, RowParallelLinear
from srt.layers.radix_attention import RadixAttention
from srt.layers.rotary import RotaryEmbedding
from srt.model_config import layer_window, rope_params
from srt.models.llama import LlamaForCausalLM, LlamaMLP, LlamaModel


def layer_types(config: Any) -> list[str]:
    """Each layer's "sliding_attention" or "full_attention" (transformers fills `layer_types`
    from the older `sliding_window_pattern` configs)."""
    types = getattr(config, "layer_types", None)
    if types:
        return list(types)
    pattern = int(getattr(config, "sliding_window_pattern", 2) or 2)
    return ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention"
            for i in range(config.num_hidden_layers)]


def layer_rope(config: Any, kind: str) -> tuple[float, dict[str, Any] | None]:
    """(theta, scaling) of a layer of `kind`: Gemma 3's `rope_parameters` per layer type (or
    its older `rope_local_base_freq` for sliding layers), else the config's own."""
    params = getattr(config, "rope_parameters", None)
    if isinstance(params, dict) and isinstance(params.get(kind), dict):
        p = params[kind]
        return float(p["rope_theta"]), (p if p.get("rope_type", "default") != "default" else None)
    local = getattr(config, "rope_local_base_freq", None)
    if kind == "sliding_attention" and local:
        return float(local), None
    return rope_params(config)


def gemma_mlp(hidden: int, intermediate: int, activation: str) -> LlamaMLP:
    """The gated MLP with GELU (tanh approximation), Gemma's `gelu_pytorch_tanh`."""
    if activation not in ("gelu_pytorch_tanh", "gelu_tanh"):
        raise ValueError(f"unsupported Gemma hidden_activation {activation!r} "
                         "(gelu_pytorch_tanh)")
    return LlamaMLP(hidden, intermediate, act=GeluAndMul())


class GemmaAttention(nn.Module):
    def __init__(self, config: Any, layer_id: int, max_position: int, qk_norm: bool) -> None:
        super().__init__()
        heads = config.num_attention_heads
        kv_heads = config.num_key_value_heads
        head_dim = config.head_dim
        bias = bool(getattr(config, "attention_bias", False))
        self.qkv_proj = QKVParallelLinear(config.hidden_size, head_dim, heads, kv_heads, bias=bias)
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.head_dim = head_dim
        self.q_size, self.kv_size = self.num_heads * head_dim, self.num_kv_heads * head_dim
        self.o_proj = RowParallelLinear(heads * head_dim, config.hidden_size, bias=bias)
        self.qk_norm = qk_norm
        if qk_norm:
            self.q_norm = GemmaRMSNorm(head_dim, config.rms_norm_eps)
            self.k_norm = GemmaRMSNorm(head_dim, config.rms_norm_eps)
        kind = layer_types(config)[layer_id]
        theta, scaling = layer_rope(config, kind)
        self.rotary_emb = RotaryEmbedding(head_dim, max_position, theta, scaling)
        self.attn = RadixAttention(
            self.num_heads, head_dim, float(config.query_pre_attn_scalar) ** -0.5,
            self.num_kv_heads, layer_id, sliding_window=layer_window(config, layer_id),
            logit_cap=getattr(config, "attn_logit_softcapping", None) or 0.0)

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.reshape(-1, self.num_heads, self.head_dim)
        k = k.reshape(-1, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        return self.o_proj(self.attn(q, k, v, self.rotary_emb, positions))


class GemmaDecoderLayer(nn.Module):
    def __init__(self, config: Any, layer_id: int, max_position: int, qk_norm: bool) -> None:
        super().__init__()
        h, eps = config.hidden_size, config.rms_norm_eps
        self.self_attn = GemmaAttention(config, layer_id, max_position, qk_norm)
        self.mlp = gemma_mlp(h, config.intermediate_size, config.hidden_activation)
        self.input_layernorm = GemmaRMSNorm(h, eps)
        self.post_attention_layernorm = GemmaRMSNorm(h, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(h, eps)
        self.post_feedforward_layernorm = GemmaRMSNorm(h, eps)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, residual: torch.Tensor | None
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """(x, residual) in, (this layer's MLP output after its norm, the residual stream
        before it) out: the next norm adds them, as the reference's residual additions do."""
        if residual is None:
            residual, x = x, self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.post_attention_layernorm(self.self_attn(positions, x))
        x, residual = self.pre_feedforward_layernorm(x, residual)
        return self.post_feedforward_layernorm(self.mlp(x)), residual


class GemmaModel(LlamaModel):
    def __init__(self, config: Any, max_position: int, qk_norm: bool) -> None:
        nn.Module.__init__(self)
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        self.embed_scale = float(config.hidden_size) ** 0.5
        self.layers = nn.ModuleList(GemmaDecoderLayer(config, i, max_position, qk_norm)
                                    for i in range(config.num_hidden_layers))
        self.norm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Scaled by sqrt(hidden_size), in the embeddings' dtype as the reference does."""
        x = self.embed_tokens(input_ids)
        return x * torch.tensor(self.embed_scale, dtype=x.dtype)


class Gemma2ForCausalLM(LlamaForCausalLM):
    qk_norm = False

    def build_model(self, config: Any, max_position: int) -> nn.Module:
        return GemmaModel(config, max_position, self.qk_norm)


class Gemma3ForCausalLM(Gemma2ForCausalLM):
    qk_norm = True


class Gemma3ForConditionalGeneration(Gemma3ForCausalLM):
    """Gemma 3's multimodal checkpoints (4B, 12B, 27B) served for text: the language model
    (`language_model.model.*`, or `model.language_model.*` as newer transformers write it);
    the vision tower and projector are not read, and the prompts take no images."""

    _SKIP = ("vision_tower.", "multi_modal_projector.", "model.vision_tower.",
             "model.multi_modal_projector.")
    _RENAME = (("language_model.model.", "model."), ("model.language_model.", "model."),
               ("language_model.lm_head.", "lm_head."))

    def __init__(self, config: Any, max_position: int) -> None:
        # the top-level config says whether the LM head is the embedding
        text = copy.copy(config.get_text_config())
        text.tie_word_embeddings = getattr(config, "tie_word_embeddings",
                                           text.tie_word_embeddings)
        super().__init__(text, max_position)

    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> None:
        def text_weights() -> Iterator[tuple[str, Any]]:
            for name, t in weights:
                if name.startswith(self._SKIP):
                    continue
                for old, new in self._RENAME:
                    if name.startswith(old):
                        name = new + name[len(old):]
                        break
                yield name, t

        super().load_weights(text_weights())
