"""Rotary position embedding (the "rotate half" layout of Hugging Face Llama checkpoints).

cos/sin are precomputed once for every position up to the context length, in float32, the same way
the reference computes them, and gathered by position each step.
"""

from __future__ import annotations

import json
import math
import weakref
from typing import Any

import torch
from torch import nn


def _inv_freq(head_dim: int, theta: float, scaling: dict[str, Any] | None) -> torch.Tensor:
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    rope_type = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if rope_type == "default":
        return inv_freq
    if rope_type == "linear":
        return inv_freq / float(scaling["factor"])
    if rope_type == "llama3":
        factor = float(scaling["factor"])
        low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
        old_ctx = float(scaling["original_max_position_embeddings"])
        low_wavelen, high_wavelen = old_ctx / low, old_ctx / high
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_ctx / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return torch.where(medium, smoothed, scaled)
    raise ValueError(f"unsupported rope scaling type {rope_type!r} (default, linear, llama3, "
                     "longrope, yarn)")


def _longrope(dim: int, theta: float, scaling: dict[str, Any],
              positions: torch.Tensor) -> tuple[torch.Tensor, float]:
    """LongRoPE (Phi-3 `longrope` / `su`): the angles of each position, from `short_factor`
    below `original_max_position_embeddings` and `long_factor` from there on, and the factor
    cos and sin are scaled by (`attention_factor`, or sqrt(1 + ln s / ln original) for the
    extension s = max_position_embeddings / original)."""
    original = int(scaling["original_max_position_embeddings"])
    factor = scaling.get("factor") or scaling.get("max_position_embeddings", original) / original
    attention = scaling.get("attention_factor")
    if attention is None:
        attention = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    base = theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim)
    short = 1.0 / (torch.tensor(scaling["short_factor"], dtype=torch.float32) * base)
    long = 1.0 / (torch.tensor(scaling["long_factor"], dtype=torch.float32) * base)
    freqs = torch.where((positions >= original).unsqueeze(1), torch.outer(positions, long),
                        torch.outer(positions, short))
    return freqs, float(attention)


def _yarn(dim: int, theta: float, scaling: dict[str, Any],
          max_position: int) -> tuple[torch.Tensor, float]:
    """YaRN (`yarn`, DeepSeek's scaling): (inverse frequencies, the factor cos and sin are
    scaled by). Dimensions that rotate fewer than `beta_slow` times over the original context
    are interpolated by `factor`, those rotating more than `beta_fast` times kept, a linear
    ramp between; the factor is the paper's 0.1 ln(s) + 1 (as mscale / mscale_all_dim when
    both are given)."""
    if "original_max_position_embeddings" not in scaling:
        raise ValueError("yarn rope scaling needs original_max_position_embeddings")
    original = int(scaling["original_max_position_embeddings"])
    factor = scaling.get("factor") or max_position / original
    attention = scaling.get("attention_factor")
    if attention is None:
        m, m_all = scaling.get("mscale"), scaling.get("mscale_all_dim")
        attention = (yarn_mscale(factor, m) / yarn_mscale(factor, m_all) if m and m_all
                     else yarn_mscale(factor))
    fast, slow = scaling.get("beta_fast") or 32, scaling.get("beta_slow") or 1

    def dim_of(rotations: float) -> float:  # the dimension that rotates that many times
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = dim_of(fast), dim_of(slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    base = theta ** (torch.arange(0, dim, 2).float() / dim)
    keep = 1 - ramp  # the share of the original frequency
    return (1.0 / (factor * base)) * (1 - keep) + (1.0 / base) * keep, float(attention)


# (rotary settings, device, "cos" | "sin") -> the cache, while a model holds it
_CACHES: weakref.WeakValueDictionary[tuple, torch.Tensor] = weakref.WeakValueDictionary()


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN's 0.1 * mscale * ln(scale) + 1 (1 for scale <= 1)."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


class RotaryEmbedding(nn.Module):
    """`rotary_dim` (default head_dim): the leading dimensions of each head that rotate (a
    partial rotary factor below 1); the others pass through unchanged. `interleaved`: the
    pairs rotated together are adjacent channels (2i, 2i + 1), as DeepSeek's checkpoints
    take them, instead of the two halves."""

    def __init__(
        self,
        head_dim: int,
        max_position: int,
        theta: float,
        scaling: dict[str, Any] | None = None,
        rotary_dim: int | None = None,
        interleaved: bool = False,
    ) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.rotary_dim = rotary_dim or head_dim
        self.interleaved = interleaved
        # every layer of a model takes the same caches (on Qwen3-30B-A3B's 48 layers and 40,960
        # positions a cache each was 2 GB, about 20,000 tokens of KV pool)
        key = (self.rotary_dim, max_position, float(theta),
               json.dumps(scaling, sort_keys=True, default=str), interleaved,
               str(torch.empty(0).device))
        cos, sin = _CACHES.get(key + ("cos",)), _CACHES.get(key + ("sin",))
        if cos is None or sin is None:
            cos, sin = self._caches(max_position, theta, scaling)
            _CACHES[key + ("cos",)], _CACHES[key + ("sin",)] = cos, sin
        self.register_buffer("cos_cache", cos, persistent=False)
        self.register_buffer("sin_cache", sin, persistent=False)

    def _caches(self, max_position: int, theta: float,
                scaling: dict[str, Any] | None) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin [max_position, rotary_dim] in float32 (times the scaling's factor)."""
        interleaved = self.interleaved
        t = torch.arange(max_position, dtype=torch.int64).float()
        rope_type = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
        if rope_type in ("longrope", "su"):
            # (each position takes the short or the long factors by itself, so a step's angles
            # do not depend on the rest of its batch; transformers takes the long ones for the
            # whole sequence once it is longer than the original context)
            freqs, mscale = _longrope(self.rotary_dim, theta, scaling or {}, t)
        elif rope_type == "yarn":
            inv_freq, mscale = _yarn(self.rotary_dim, theta, scaling or {}, max_position)
            freqs = torch.outer(t, inv_freq)
        else:
            freqs, mscale = torch.outer(t, _inv_freq(self.rotary_dim, theta, scaling)), 1.0
        emb = freqs.repeat_interleave(2, dim=-1) if interleaved else torch.cat((freqs, freqs),
                                                                               dim=-1)
        return emb.cos() * mscale, emb.sin() * mscale

    def _rotate_half(self, x: torch.Tensor) -> torch.Tensor:
        if self.interleaved:  # (x0, x1, ...) -> (-x1, x0, ...)
            pairs = x.unflatten(-1, (-1, 2))
            return torch.stack((-pairs[..., 1], pairs[..., 0]), dim=-1).flatten(-2)
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat((-x2, x1), dim=-1)

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """q: [T, heads, head_dim], k: [T, kv_heads, head_dim]; positions: [T]."""
        cos = self.cos_cache[positions].unsqueeze(1).to(q.dtype)
        sin = self.sin_cache[positions].unsqueeze(1).to(q.dtype)
        r = self.rotary_dim
        if r < self.head_dim:
            q = torch.cat((q[..., :r] * cos + self._rotate_half(q[..., :r]) * sin, q[..., r:]),
                          dim=-1)
            k = torch.cat((k[..., :r] * cos + self._rotate_half(k[..., :r]) * sin, k[..., r:]),
                          dim=-1)
            return q, k
        q = q * cos + self._rotate_half(q) * sin
        k = k * cos + self._rotate_half(k) * sin
        return q, k
