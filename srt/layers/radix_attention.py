"""The attention layer: writes this step's K/V into the pool, then calls the selected backend.

It never touches the radix tree; where the tokens' slots are is said by `out_cache_loc` and the
`req_to_token` rows of the ForwardBatch.
"""

from __future__ import annotations

import torch
from torch import nn

from srt.layers.forward_batch import get_forward_batch
from srt.layers.fused import kernels, use_fused
from srt.layers.kv_cache_dtype import store_kv
from srt.layers.rotary import RotaryEmbedding


class RadixAttention(nn.Module):
    def __init__(
        self, num_heads: int, head_dim: int, scaling: float, num_kv_heads: int, layer_id: int,
        sliding_window: int | None = None, logit_cap: float = 0.0, kv_shared: bool = False,
        v_head_dim: int | None = None,
    ) -> None:
        """`sliding_window` W: a query at position p sees the keys at p - W + 1 .. p only
        (transformers' sliding-window mask), None: all before it. `logit_cap` c > 0: each
        scaled score s becomes c * tanh(s / c) before the softmax (Gemma 2's soft-capping).
        `kv_shared`: the layer's keys are its values (multi-head latent attention: one latent
        vector a token; the pool keeps one buffer and only k is written). `v_head_dim`: with
        kv_shared, the channels of the output the caller reads (the values are the keys' first
        v_head_dim channels; the decode kernel then reads one tile for both)."""
        super().__init__()
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scaling = scaling
        self.layer_id = layer_id
        self.sliding_window = sliding_window if sliding_window and sliding_window > 0 else None
        self.logit_cap = float(logit_cap or 0.0)
        self.kv_shared = kv_shared
        self.v_head_dim = v_head_dim if kv_shared and v_head_dim else head_dim
        # Per-tensor scales of an FP8 KV cache (srt/layers/kv_cache_dtype.py): stored = k /
        # k_scale. From the checkpoint's k_scale / v_scale when it has them.
        self.k_scale = 1.0
        self.v_scale = 1.0

    @property
    def flashinfer_supported(self) -> bool:
        """FlashInfer's wrappers are planned once a step for every layer alike: no sliding
        window, no logit cap, no shared latent KV (the Triton and torch backends take them)."""
        return not (self.sliding_window or self.logit_cap or self.kv_shared)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                rotary: RotaryEmbedding | None = None,
                positions: torch.Tensor | None = None, kv_stored: bool = False) -> torch.Tensor:
        """q: [T, heads, d] or [T, heads * d], k, v: [T, kv_heads, d] or flat -> [T, heads * d].

        With `rotary`, q and k are rotated at `positions` first (on the GPU in the same kernel
        that writes K/V into the pool). `kv_stored`: the caller wrote k (and v) to the step's
        slots already, as they would be stored (no rotary then)."""
        fb = get_forward_batch()
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        k_buf, v_buf = fb.token_to_kv_pool.get_kv_buffer(self.layer_id)
        if kv_stored:
            assert rotary is None, "stored keys are rotated already"
        elif rotary is not None and use_fused(q) and _fusable(q, k, v, self.head_dim) \
                and rotary.rotary_dim == self.head_dim and not rotary.interleaved:
            q = kernels().rope_and_store(q, k, v, positions, rotary.cos_cache, rotary.sin_cache,
                                         k_buf, v_buf, fb.out_cache_loc,
                                         k_scale=self.k_scale, v_scale=self.v_scale)
        else:
            if rotary is not None:
                q, k = rotary(positions, q, k)
            store_kv(k_buf, fb.out_cache_loc, k, self.k_scale)
            if v_buf is not k_buf:
                store_kv(v_buf, fb.out_cache_loc, v, self.v_scale)
        if fb.forward_mode.is_extend():
            o = fb.attn_backend.forward_extend(q, k, v, self, fb)
        else:
            o = fb.attn_backend.forward_decode(q, k, v, self, fb)
        return o.reshape(-1, self.num_heads * self.head_dim)


def _fusable(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, head_dim: int) -> bool:
    """The fused kernel's layout: heads contiguous per token, a power-of-two half dimension."""
    half = head_dim // 2
    return (head_dim % 2 == 0 and half & (half - 1) == 0
            and all(x.stride(2) == 1 and x.stride(1) == head_dim for x in (q, k, v)))
