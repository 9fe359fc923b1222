"""Multi-head latent attention's inputs in one kernel (GPU; tested on the CPU in Triton's
interpreter against the torch code of srt/models/deepseek_v2.py's MLAttention).

From the projections of a step it builds what the attention backends take:
  query [T, heads, rank + rope]: each head's absorbed query (q_lat, rank values) followed by its
      rotated q_pe (the last `rope` values of the head in q);
  latent [T, 1, rank + rope]: RMSNorm(c) (the first `rank` values of kv_a's output, with the
      norm's weight) followed by the rotated k_pe (its last `rope` values).
Rotation at each token's position from the cos / sin caches of srt.layers.rotary (interleaved
pairs or the two halves), computed in float32 and rounded once. Given the layer's KV pool (in the
model dtype), the latent is also written to the token's slot there, which saves the attention
layer its store. The torch code it replaces is about 20 launches a layer (rotary, two
concatenations, a copy and the norm).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rotate(x_ptr, cos_ptr, sin_ptr, ROPE: tl.constexpr, INTERLEAVED: tl.constexpr):
    """x * cos + rotate(x) * sin over ROPE values at x_ptr, in float32."""
    i = tl.arange(0, ROPE)
    if INTERLEAVED:  # pairs (2j, 2j + 1): (x0, x1) -> (-x1, x0)
        partner = i ^ 1
        sign = tl.where(i % 2 == 0, -1.0, 1.0)
    else:  # halves: (a, b) -> (-b, a)
        partner = (i + ROPE // 2) % ROPE
        sign = tl.where(i < ROPE // 2, -1.0, 1.0)
    x = tl.load(x_ptr + i).to(tl.float32)
    xp = tl.load(x_ptr + partner).to(tl.float32)
    return x * tl.load(cos_ptr + i) + sign * xp * tl.load(sin_ptr + i)


@triton.jit
def _mla_prep_kernel(q_ptr, q_lat_ptr, kv_ptr, norm_w_ptr, pos_ptr, cos_ptr, sin_ptr,
                     query_ptr, latent_ptr, pool_ptr, loc_ptr, eps,
                     stride_qt, stride_qh, stride_lt, stride_lh, stride_kv, stride_cos,
                     stride_pool,
                     NOPE: tl.constexpr, ROPE: tl.constexpr, RANK: tl.constexpr,
                     RANK_PAD: tl.constexpr, INTERLEAVED: tl.constexpr,
                     STORE_POOL: tl.constexpr, HAS_QLAT: tl.constexpr):
    t = tl.program_id(0)
    h = tl.program_id(1)
    heads = tl.num_programs(1)
    pos = tl.load(pos_ptr + t)
    cos_row, sin_row = cos_ptr + pos * stride_cos, sin_ptr + pos * stride_cos
    r = tl.arange(0, RANK_PAD)
    rmask = r < RANK
    out = query_ptr + (t * heads + h) * (RANK + ROPE)
    if HAS_QLAT:
        ql = tl.load(q_lat_ptr + t * stride_lt + h * stride_lh + r, mask=rmask)
        tl.store(out + r, ql.to(query_ptr.dtype.element_ty), mask=rmask)
    q_pe = _rotate(q_ptr + t * stride_qt + h * stride_qh + NOPE, cos_row, sin_row, ROPE,
                   INTERLEAVED)
    tl.store(out + RANK + tl.arange(0, ROPE), q_pe.to(query_ptr.dtype.element_ty))
    if h == 0:
        c = tl.load(kv_ptr + t * stride_kv + r, mask=rmask, other=0.0)
        hc = c.to(tl.float32)
        var = tl.sum(hc * hc, axis=0) / RANK
        # as RMSNorm rounds: normalized to the dtype, then times the weight
        hc = (hc * tl.rsqrt(var + eps)).to(c.dtype).to(tl.float32)
        w = tl.load(norm_w_ptr + r, mask=rmask, other=0.0).to(tl.float32)
        c_out = (w * hc).to(latent_ptr.dtype.element_ty)
        k_pe = _rotate(kv_ptr + t * stride_kv + RANK, cos_row, sin_row, ROPE, INTERLEAVED)
        k_pe = k_pe.to(latent_ptr.dtype.element_ty)
        dst = latent_ptr + t * (RANK + ROPE)
        tl.store(dst + r, c_out, mask=rmask)
        tl.store(dst + RANK + tl.arange(0, ROPE), k_pe)
        if STORE_POOL:
            slot = pool_ptr + tl.load(loc_ptr + t).to(tl.int64) * stride_pool
            tl.store(slot + r, c_out, mask=rmask)
            tl.store(slot + RANK + tl.arange(0, ROPE), k_pe)


def mla_prep(q: torch.Tensor, q_lat: torch.Tensor | None, kv: torch.Tensor,
             norm_weight: torch.Tensor,
             eps: float, positions: torch.Tensor, cos_cache: torch.Tensor,
             sin_cache: torch.Tensor, nope: int, interleaved: bool,
             pool: torch.Tensor | None = None, loc: torch.Tensor | None = None,
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """(query [T, heads, rank + rope], latent [T, 1, rank + rope]) as the module docstring says.

    q: [T, heads, nope + rope] (any token / head strides, unit last stride); q_lat: [T, heads,
    rank], or None when only the rotated q_pe is wanted (query's first `rank` values are then
    left unwritten: the expanded prefill needs no absorbed query); kv: kv_a's output
    [T, rank + rope]; cos_cache / sin_cache: [positions, rope] float32; `rope` a power of two.
    `pool` [slots, 1, rank + rope] in q's dtype and `loc` [T]: token t's latent is also written
    to pool[loc[t]]."""
    t, heads, _ = q.shape
    rope = cos_cache.shape[-1]
    rank = kv.shape[-1] - rope
    if rope & (rope - 1) or q.stride(-1) != 1 or kv.stride(-1) != 1 or (
            q_lat is not None and (q_lat.stride(-1) != 1 or q_lat.shape[-1] != rank)):
        raise ValueError("mla_prep needs a power-of-two rope dimension and unit last strides")
    if pool is not None and (pool.dtype != q.dtype or pool.shape[1:] != (1, rank + rope)
                             or pool.stride(-1) != 1 or loc is None):
        raise ValueError("mla_prep writes the latent only to a [slots, 1, rank + rope] pool "
                         "of q's dtype, given the slots")
    query = torch.empty(t, heads, rank + rope, dtype=q.dtype, device=q.device)
    latent = torch.empty(t, 1, rank + rope, dtype=q.dtype, device=q.device)
    if t == 0:
        return query, latent
    _mla_prep_kernel[(t, heads)](
        q, q_lat if q_lat is not None else q, kv, norm_weight, positions, cos_cache, sin_cache,
        query, latent,
        pool if pool is not None else latent, loc if loc is not None else positions, float(eps),
        q.stride(0), q.stride(1), q_lat.stride(0) if q_lat is not None else 0,
        q_lat.stride(1) if q_lat is not None else 0, kv.stride(0),
        cos_cache.stride(0), pool.stride(0) if pool is not None else 0,
        NOPE=nope, ROPE=rope, RANK=rank, RANK_PAD=triton.next_power_of_2(rank),
        INTERLEAVED=interleaved, STORE_POOL=pool is not None, HAS_QLAT=q_lat is not None,
        num_warps=4)
    return query, latent
