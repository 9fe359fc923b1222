"""Causal attention of a PREFILL step (no request has a cached prefix) over K/V the caller
computed, not read from the pool.

Multi-head latent attention stores one latent vector a token, and decode attends over it with
absorbed weights (576-wide keys). A prefill has every key at hand, so the layer can instead
expand the latents into per-head keys (nope + rope, e.g. 192 values) and values (128) and run
ordinary multi-head attention: about a quarter of the products, in tiles the tensor cores fill
(the absorbed kernel pads 576 to 1024 and runs 32 x 16 tiles). The result is the same.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F


def fresh_prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                            meta: Any, extend_lens: list[int], scale: float) -> torch.Tensor:
    """q, k: [T, H, D]; v: [T, H, Dv] (Dv <= D) for a PREFILL step's T new tokens, packed by
    request (request i has extend_lens[i] of them; its token j attends to its tokens 0..j).
    Returns [T, H, Dv]. `meta`: the step's ForwardBatch.attn_metadata; the triton backend's
    (TritonExtendMetadata) runs its prefill kernel (v zero-padded to D), anything else
    scaled-dot-product attention request by request."""
    from srt.layers.attention.triton_backend import TritonExtendMetadata

    dv = v.shape[-1]
    if isinstance(meta, TritonExtendMetadata):
        from srt.layers.attention.triton_ops.prefill_attention import context_attention_fwd

        if dv < q.shape[-1]:
            v = F.pad(v, (0, q.shape[-1] - dv))
        o = torch.empty_like(q)
        context_attention_fwd(q, k, v, o, meta.extend_start_loc, meta.extend_lens,
                              meta.max_len_extend, scale, block_tables=meta.block_tables)
        return o[..., :dv]
    out = q.new_empty(q.shape[0], q.shape[1], dv)
    start = 0
    for n in extend_lens:
        rows = slice(start, start + n)
        out[rows] = F.scaled_dot_product_attention(
            q[rows].transpose(0, 1), k[rows].transpose(0, 1), v[rows].transpose(0, 1),
            is_causal=True, scale=scale).transpose(0, 1)
        start += n
    return out
