"""Causal attention of a PREFILL step (no request has a cached prefix) over K/V the caller
computed, not read from the pool; and of an EXTEND step over K/V the caller computed for its
cached prefixes as well as its new tokens.

Multi-head latent attention stores one latent vector a token, and decode attends over it with
absorbed weights (576-wide keys). A prefill has every key at hand, so the layer can instead
expand the latents into per-head keys (nope + rope, e.g. 192 values) and values (128) and run
ordinary multi-head attention: about a quarter of the products, in tiles the tensor cores fill
(the absorbed kernel pads 576 to 1024 and runs 32 x 16 tiles). The result is the same. An
EXTEND step can do the same once the layer expands its requests' cached latents too.
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


def expanded_extend_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                              k_prefix: torch.Tensor, v_prefix: torch.Tensor, meta: Any,
                              prefix_lens: list[int], extend_lens: list[int],
                              scale: float) -> torch.Tensor:
    """An EXTEND step's attention over K/V the caller computed for both parts: q, k: [T, H, D]
    and v: [T, H, Dv] of the step's new tokens, packed by request as in
    `fresh_prefill_attention`; k_prefix [P, H, D] and v_prefix [P, H, Dv] of the requests'
    cached prefixes, packed the same way (request i's prefix_lens[i] rows, in position
    order). New token j of request i sees the request's whole prefix and its new tokens
    0..j. Returns [T, H, Dv]. The triton backend's metadata (TritonExtendMetadata) runs its
    extend kernel, the prefix read through a token table of the packed rows; anything else
    scaled-dot-product attention request by request."""
    from srt.layers.attention.triton_backend import TritonExtendMetadata

    dv = v.shape[-1]
    if isinstance(meta, TritonExtendMetadata):
        from srt.layers.attention.triton_ops.extend_attention import extend_attention_fwd

        if dv < q.shape[-1]:
            v = F.pad(v, (0, q.shape[-1] - dv))
            v_prefix = F.pad(v_prefix, (0, q.shape[-1] - dv))
        bs = len(prefix_lens)
        # row b of the table: request b's prefix rows of k_prefix / v_prefix (built on the
        # device from the metadata's lengths: no copy that waits for the device); its width a
        # multiple of 16, so that its row stride, which Triton specializes on, takes one
        # compiled variant of the kernel (the warm-up's), not a compile inside serving
        lens = meta.prefix_lens.long()
        width = -(-max(1, max(prefix_lens)) // 16) * 16
        table = (torch.cumsum(lens, 0) - lens).unsqueeze(1) + torch.arange(
            width, dtype=torch.int64, device=q.device)
        o = torch.empty_like(q)
        extend_attention_fwd(q, k, v, o, k_prefix, v_prefix, table,
                             torch.arange(bs, device=q.device), meta.prefix_lens,
                             meta.extend_lens, meta.extend_start_loc, meta.max_len_extend,
                             scale)
        return o[..., :dv]
    out = q.new_empty(q.shape[0], q.shape[1], dv)
    start = pstart = 0
    for p, n in zip(prefix_lens, extend_lens):
        rows, prows = slice(start, start + n), slice(pstart, pstart + p)
        keys = torch.cat((k_prefix[prows], k[rows])).transpose(0, 1)
        values = torch.cat((v_prefix[prows], v[rows])).transpose(0, 1)
        # new token j sees positions 0 .. p + j
        visible = (torch.arange(p + n, device=q.device).unsqueeze(0)
                   <= p + torch.arange(n, device=q.device).unsqueeze(1))
        out[rows] = F.scaled_dot_product_attention(
            q[rows].transpose(0, 1), keys, values, attn_mask=visible,
            scale=scale).transpose(0, 1)
        start += n
        pstart += p
    return out
