"""The CLIP vision encoder (ViT) that LLaVA uses as its vision tower, in plain torch.

It is small next to the language model and runs once per image, so every tensor-parallel rank
holds a full copy and computes the same features (no collectives). Only the layers up to the
one LLaVA reads (`vision_feature_layer`) are built; the checkpoint's later layers and the
post-layernorm are skipped by the loader.

Checkpoint names are those of transformers' `CLIPVisionModel` without the `vision_model.`
prefix of older versions: `embeddings.*`, `pre_layrnorm.*`, `encoder.layers.{i}.*`.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn


def activation(name: str) -> Any:
    """The few activations CLIP and the LLaVA projector use, by their config names."""
    acts = {
        "quick_gelu": lambda x: x * torch.sigmoid(1.702 * x),
        "gelu": F.gelu,
        "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
        "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
        "relu": F.relu,
        "silu": F.silu,
    }
    if name not in acts:
        raise ValueError(f"activation {name!r} is not supported ({', '.join(sorted(acts))})")
    return acts[name]


class ClipVisionEmbeddings(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        d = config.hidden_size
        self.image_size, self.patch_size = config.image_size, config.patch_size
        self.class_embedding = nn.Parameter(torch.empty(d), requires_grad=False)
        self.patch_embedding = nn.Conv2d(config.num_channels, d, kernel_size=config.patch_size,
                                         stride=config.patch_size, bias=False)
        positions = (config.image_size // config.patch_size) ** 2 + 1
        self.position_embedding = nn.Embedding(positions, d)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """[batch, channels, size, size] -> [batch, 1 + patches, hidden] (CLS first)."""
        b, _, h, w = pixel_values.shape
        if h != self.image_size or w != self.image_size:
            raise ValueError(f"image of {h}x{w} pixels; the vision tower takes "
                             f"{self.image_size}x{self.image_size}")
        patches = self.patch_embedding(pixel_values).flatten(2).transpose(1, 2)
        cls = self.class_embedding.expand(b, 1, -1)
        return torch.cat([cls, patches], dim=1) + self.position_embedding.weight


class ClipAttention(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        d = config.hidden_size
        self.num_heads = config.num_attention_heads
        self.head_dim = d // self.num_heads
        self.q_proj, self.k_proj = nn.Linear(d, d), nn.Linear(d, d)
        self.v_proj, self.out_proj = nn.Linear(d, d), nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, d = x.shape

        def heads(t: torch.Tensor) -> torch.Tensor:
            return t.view(b, n, self.num_heads, self.head_dim).transpose(1, 2)

        # Every patch sees every patch: no mask.
        o = F.scaled_dot_product_attention(heads(self.q_proj(x)), heads(self.k_proj(x)),
                                           heads(self.v_proj(x)))
        return self.out_proj(o.transpose(1, 2).reshape(b, n, d))


class ClipMLP(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        self.fc1 = nn.Linear(config.hidden_size, config.intermediate_size)
        self.fc2 = nn.Linear(config.intermediate_size, config.hidden_size)
        self.act = activation(config.hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class ClipEncoderLayer(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        self.layer_norm1 = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.self_attn = ClipAttention(config)
        self.layer_norm2 = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.mlp = ClipMLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.layer_norm1(x))
        return x + self.mlp(self.layer_norm2(x))


class ClipEncoder(nn.Module):
    def __init__(self, config: Any, num_layers: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(ClipEncoderLayer(config) for _ in range(num_layers))


class ClipVisionTower(nn.Module):
    """CLIP's vision transformer, returning the hidden states LLaVA selects.

    Hidden state 0 is the embeddings after `pre_layrnorm`, hidden state i the output of
    encoder layer i (transformers' `hidden_states` numbering); `feature_layers` are indices
    into that list, negative ones counted from its end (`-2`: the input of the last layer).
    """

    def __init__(self, config: Any, feature_layers: list[int]) -> None:
        super().__init__()
        total = config.num_hidden_layers + 1
        self.feature_layers = [i % total if -total <= i < total else _bad_layer(i, total)
                               for i in feature_layers]
        self.embeddings = ClipVisionEmbeddings(config)
        self.pre_layrnorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.encoder = ClipEncoder(config, max(self.feature_layers))
        self.requires_grad_(False)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """[batch, channels, size, size] -> the selected hidden states, concatenated on the
        last dimension: [batch, 1 + patches, hidden * len(feature_layers)]."""
        x = self.pre_layrnorm(self.embeddings(pixel_values))
        states = [x]
        for layer in self.encoder.layers:
            x = layer(x)
            states.append(x)
        return torch.cat([states[i] for i in self.feature_layers], dim=-1)

    def wants(self, name: str) -> bool:
        """Whether a checkpoint tensor (name relative to the tower) belongs to a built part."""
        if name.startswith("post_layernorm."):
            return False
        if name.startswith("encoder.layers."):
            return int(name.split(".")[2]) < len(self.encoder.layers)
        return True


def _bad_layer(index: int, total: int) -> int:
    raise ValueError(f"vision_feature_layer {index} is outside the {total} hidden states")
