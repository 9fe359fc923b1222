"""Reference attention in plain torch, reading K/V from the pool through `req_to_token`.

Runs on the CPU and the GPU. Extend: one scaled-dot-product call per request over its whole
context (cached prefix + new tokens), causal with the prefix offset. Decode: all requests at once,
padded to the longest context and masked. An FP8 pool is read back as stored * scale. A layer's
sliding window masks the keys before it; its logit cap (soft-capping) computes the scores
explicitly, as scaled-dot-product attention has no such option.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from srt.layers.attention import AttentionBackend
from srt.layers.forward_batch import ForwardBatch
from srt.layers.kv_cache_dtype import dequantize_kv
from srt.layers.radix_attention import RadixAttention


class TorchAttnBackend(AttentionBackend):
    def __init__(self, **_: object) -> None:
        pass

    def init_forward_metadata(self, fb: ForwardBatch) -> None:
        if fb.forward_mode.is_extend():
            fb.attn_metadata = None
            return
        # DECODE: the slots of every context, padded to the longest; padded columns are masked.
        max_len = max(fb.seq_lens_cpu)
        rows = fb.req_to_token_pool.req_to_token[fb.req_pool_indices, :max_len].long()
        cols = torch.arange(max_len, device=rows.device)
        valid = cols.unsqueeze(0) < fb.seq_lens.unsqueeze(1)
        # Padded columns read the request's first slot (always written) rather than whatever a
        # stale entry points at: masked scores get zero weight, but 0 * NaN would still be NaN.
        rows = torch.where(valid, rows, rows[:, :1])
        fb.attn_metadata = (rows, valid)

    def forward_extend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: RadixAttention,
        fb: ForwardBatch,
    ) -> torch.Tensor:
        k_buf, v_buf = fb.token_to_kv_pool.get_kv_buffer(layer.layer_id)
        out = torch.empty_like(q)
        req_to_token = fb.req_to_token_pool.req_to_token
        start = 0
        for i in range(fb.batch_size):
            ext, seq, pre = fb.extend_lens_cpu[i], fb.seq_lens_cpu[i], fb.prefix_lens_cpu[i]
            slots = req_to_token[fb.req_pool_indices[i], :seq].long()
            qi = q[start : start + ext].transpose(0, 1)  # [heads, ext, d]
            ki = dequantize_kv(k_buf[slots], layer.k_scale, q.dtype).transpose(0, 1)
            vi = dequantize_kv(v_buf[slots], layer.v_scale, q.dtype).transpose(0, 1)
            # query t sits at position pre + t and sees keys 0..pre + t (and, with a window W,
            # none before pre + t - W + 1)
            ones = torch.ones(ext, seq, dtype=torch.bool, device=q.device)
            mask = ones.tril(diagonal=pre)
            if layer.sliding_window:
                mask &= ones.triu(diagonal=pre - layer.sliding_window + 1)
            if layer.logit_cap:
                oi = _capped_attention(qi, ki, vi, mask, layer)
            else:
                oi = F.scaled_dot_product_attention(
                    qi, ki, vi, attn_mask=mask, scale=layer.scaling,
                    enable_gqa=layer.num_heads != layer.num_kv_heads,
                )
            out[start : start + ext] = oi.transpose(0, 1)
            start += ext
        return out

    def forward_decode(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: RadixAttention,
        fb: ForwardBatch,
    ) -> torch.Tensor:
        k_buf, v_buf = fb.token_to_kv_pool.get_kv_buffer(layer.layer_id)
        rows, valid = fb.attn_metadata
        bs = fb.batch_size
        group = layer.num_heads // layer.num_kv_heads
        keys = dequantize_kv(k_buf[rows], layer.k_scale, q.dtype)  # [bs, L, kv_heads, d]
        values = dequantize_kv(v_buf[rows], layer.v_scale, q.dtype)
        qg = q.view(bs, layer.num_kv_heads, group, layer.head_dim)
        scores = torch.einsum("bkgd,blkd->bkgl", qg.float(), keys.float()) * layer.scaling
        if layer.logit_cap:
            scores = layer.logit_cap * torch.tanh(scores / layer.logit_cap)
        if layer.sliding_window:  # the query sits at seq_len - 1
            first = (fb.seq_lens - layer.sliding_window).unsqueeze(1)
            valid = valid & (torch.arange(valid.shape[1], device=valid.device) >= first)
        scores = scores.masked_fill(~valid[:, None, None, :], float("-inf"))
        probs = scores.softmax(dim=-1)
        out = torch.einsum("bkgl,blkd->bkgd", probs, values.float())
        return out.reshape(bs, layer.num_heads, layer.head_dim).to(q.dtype)


def _capped_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                      layer: RadixAttention) -> torch.Tensor:
    """Soft-capped attention of one request: q [heads, T, d], k / v [kv_heads, S, d], mask
    [T, S] (True: visible) -> [heads, T, d]; scores in float32."""
    group = layer.num_heads // layer.num_kv_heads
    k = k.repeat_interleave(group, dim=0)
    v = v.repeat_interleave(group, dim=0)
    scores = torch.matmul(q.float(), k.float().transpose(1, 2)) * layer.scaling
    scores = layer.logit_cap * torch.tanh(scores / layer.logit_cap)
    probs = scores.masked_fill(~mask, float("-inf")).softmax(dim=-1)
    return torch.matmul(probs, v.float()).to(q.dtype)
