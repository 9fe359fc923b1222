"""Fused Triton kernels for the small per-layer operations of a decoder layer.

A decode step at small batch is a few large matmuls and many tiny element-wise operations; in
plain torch each of those is one or more kernels (RMSNorm alone is about eight), and on a GPU each
kernel costs a couple of microseconds even inside a CUDA graph. These kernels do each operation in
one launch:

- `add_rmsnorm`: (x + residual), then RMSNorm, in one pass over the row;
- `silu_and_mul`: silu(gate) * up over a merged gate/up projection;
- `rope_and_store`: rotary embedding of q and k in place, and k and v written into the KV pool.

Contract: each gives the same values as the torch code it replaces (srt/layers/layernorm.py,
activation.py, rotary.py and the KV store of radix_attention.py), including the rounding to the
input dtype between the steps where torch rounds, so the GPU path and the CPU path differ only by
the order of the float32 sum inside the norm. They run wherever Triton runs: on CUDA tensors, and
in Triton's interpreter on the CPU for the tests.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from srt.layers.kv_cache_dtype import fp8_max, is_fp8


@triton.jit
def _add_rmsnorm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, n_cols, x_stride,
                        res_stride, out_stride, res_out_stride, eps,
                        HAS_RES: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0)
    if HAS_RES:
        r = tl.load(res_ptr + row * res_stride + cols, mask=mask, other=0.0)
        # torch adds in float32 and rounds to the input dtype
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)
        tl.store(res_out_ptr + row * res_out_stride + cols, x, mask=mask)
    h = x.to(tl.float32)
    var = tl.sum(h * h, axis=0) / n_cols
    h = (h * tl.rsqrt(var + eps)).to(x.dtype)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0)
    out = (w.to(tl.float32) * h.to(tl.float32)).to(x.dtype)
    tl.store(out_ptr + row * out_stride + cols, out, mask=mask)


def add_rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float,
                residual: torch.Tensor | None = None
                ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Without residual: RMSNorm(x). With residual: (RMSNorm(x + residual), x + residual).

    x, residual: [..., hidden] with a contiguous last dimension; weight: [hidden] of x's dtype.
    """
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    rows, n = x2.shape
    out = torch.empty((rows, n), dtype=x.dtype, device=x.device)
    block = triton.next_power_of_2(n)
    warps = min(max(block // 256, 1), 16)
    if residual is None:
        _add_rmsnorm_kernel[(rows,)](x2, x2, weight, out, out, n, x2.stride(0), 0,
                                     out.stride(0), 0, eps, HAS_RES=False, BLOCK=block,
                                     num_warps=warps)
        return out.view(shape)
    r2 = residual.reshape(-1, n)
    res_out = torch.empty_like(out)
    _add_rmsnorm_kernel[(rows,)](x2, r2, weight, out, res_out, n, x2.stride(0), r2.stride(0),
                                 out.stride(0), res_out.stride(0), eps, HAS_RES=True,
                                 BLOCK=block, num_warps=warps)
    return out.view(shape), res_out.view(shape)


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, n_cols, x_stride, out_stride, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    g = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0)
    u = tl.load(x_ptr + row * x_stride + n_cols + cols, mask=mask, other=0.0)
    gf = g.to(tl.float32)
    s = (gf / (1.0 + tl.exp(-gf))).to(g.dtype)  # torch rounds silu's result to the dtype
    out = (s.to(tl.float32) * u.to(tl.float32)).to(g.dtype)
    tl.store(out_ptr + row * out_stride + cols, out, mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x: [T, 2 * n] (gate then up) -> silu(gate) * up: [T, n]."""
    rows, two_n = x.shape
    n = two_n // 2
    if x.stride(-1) != 1:
        x = x.contiguous()
    out = torch.empty((rows, n), dtype=x.dtype, device=x.device)
    block = min(triton.next_power_of_2(n), 1024)
    _silu_and_mul_kernel[(rows, triton.cdiv(n, block))](x, out, n, x.stride(0), out.stride(0),
                                                        BLOCK=block, num_warps=4)
    return out


@triton.jit
def _rope_and_store_kernel(q_ptr, q_out_ptr, k_ptr, v_ptr, pos_ptr, cos_ptr, sin_ptr, k_buf_ptr,
                           v_buf_ptr, loc_ptr, q_stride, q_out_stride, k_stride, v_stride,
                           cache_stride, k_scale, v_scale,
                           NUM_Q: tl.constexpr, NUM_KV: tl.constexpr, HALF: tl.constexpr,
                           BLOCK_H: tl.constexpr, STORE: tl.constexpr, QUANT: tl.constexpr,
                           QMAX: tl.constexpr):
    tok = tl.program_id(0)
    pos = tl.load(pos_ptr + tok)
    d = tl.arange(0, HALF)
    # torch casts the float32 tables to the activations' dtype before multiplying
    cos = tl.load(cos_ptr + pos * 2 * HALF + d)
    sin = tl.load(sin_ptr + pos * 2 * HALF + d)
    heads = tl.arange(0, BLOCK_H)

    for base in tl.static_range(0, NUM_Q + NUM_KV, BLOCK_H):
        h = base + heads
        is_q = h < NUM_Q
        is_k = (h >= NUM_Q) & (h < NUM_Q + NUM_KV)
        kh = h - NUM_Q
        q_off = tok * q_stride + h[:, None] * (2 * HALF) + d[None, :]
        k_off = tok * k_stride + kh[:, None] * (2 * HALF) + d[None, :]
        mq = is_q[:, None]
        mk = is_k[:, None]
        x1 = tl.where(mq, tl.load(q_ptr + q_off, mask=mq, other=0.0),
                      tl.load(k_ptr + k_off, mask=mk, other=0.0))
        x2 = tl.where(mq, tl.load(q_ptr + q_off + HALF, mask=mq, other=0.0),
                      tl.load(k_ptr + k_off + HALF, mask=mk, other=0.0))
        dt = x1.dtype
        c = cos.to(dt).to(tl.float32)[None, :]
        s = sin.to(dt).to(tl.float32)[None, :]
        f1 = x1.to(tl.float32)
        f2 = x2.to(tl.float32)
        # out1 = x1*cos - x2*sin, out2 = x2*cos + x1*sin, rounded where torch rounds
        a1 = (f1 * c).to(dt).to(tl.float32)
        b1 = (-f2 * s).to(dt).to(tl.float32)
        a2 = (f2 * c).to(dt).to(tl.float32)
        b2 = (f1 * s).to(dt).to(tl.float32)
        o1 = (a1 + b1).to(dt)
        o2 = (a2 + b2).to(dt)
        qo_off = tok * q_out_stride + h[:, None] * (2 * HALF) + d[None, :]
        tl.store(q_out_ptr + qo_off, o1, mask=mq)
        tl.store(q_out_ptr + qo_off + HALF, o2, mask=mq)
        tl.store(k_ptr + k_off, o1, mask=mk)
        tl.store(k_ptr + k_off + HALF, o2, mask=mk)
        if STORE:
            loc = tl.load(loc_ptr + tok).to(tl.int64)
            c_off = loc * cache_stride + kh[:, None] * (2 * HALF) + d[None, :]
            v_off = tok * v_stride + kh[:, None] * (2 * HALF) + d[None, :]
            v1 = tl.load(v_ptr + v_off, mask=mk, other=0.0)
            v2 = tl.load(v_ptr + v_off + HALF, mask=mk, other=0.0)
            if QUANT:  # FP8 cache: x / scale, clamped, rounded (kv_cache_dtype.quantize_kv)
                kd = k_buf_ptr.dtype.element_ty
                tl.store(k_buf_ptr + c_off, _to_fp8(o1, k_scale, QMAX, kd), mask=mk)
                tl.store(k_buf_ptr + c_off + HALF, _to_fp8(o2, k_scale, QMAX, kd), mask=mk)
                tl.store(v_buf_ptr + c_off, _to_fp8(v1, v_scale, QMAX, kd), mask=mk)
                tl.store(v_buf_ptr + c_off + HALF, _to_fp8(v2, v_scale, QMAX, kd), mask=mk)
            else:
                tl.store(k_buf_ptr + c_off, o1, mask=mk)
                tl.store(k_buf_ptr + c_off + HALF, o2, mask=mk)
                tl.store(v_buf_ptr + c_off, v1, mask=mk)
                tl.store(v_buf_ptr + c_off + HALF, v2, mask=mk)


@triton.jit
def _to_fp8(x, scale, QMAX: tl.constexpr, dtype: tl.constexpr):
    # IEEE division (Triton's `/` is approximate on the GPU); torch divides a CUDA tensor by a
    # number through its reciprocal, so the two may round one FP8 step apart
    y = tl.math.div_rn(x.to(tl.float32), scale)
    return tl.minimum(tl.maximum(y, -QMAX), QMAX).to(dtype)


def rope_and_store(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                   cos_cache: torch.Tensor, sin_cache: torch.Tensor,
                   k_buf: torch.Tensor | None = None, v_buf: torch.Tensor | None = None,
                   loc: torch.Tensor | None = None, k_scale: float = 1.0,
                   v_scale: float = 1.0) -> torch.Tensor:
    """The rotated q [T, H, D] (a new contiguous tensor) and k [T, KV, D] rotated in place
    ("rotate half" layout, float32 cos/sin tables [max_pos, D]); with k_buf/v_buf [slots, KV, D]
    and loc [T], the rotated k and v ([T, KV, D]) are also written into the pool rows `loc`.
    Each token's heads must be contiguous (stride(1) == D, stride(2) == 1); tokens may be
    strided (views of a fused qkv output). A pool in FP8 gets k / k_scale and v / v_scale,
    clamped and rounded as srt/layers/kv_cache_dtype.quantize_kv does."""
    t, num_q, dim = q.shape
    num_kv = k.shape[1]
    for x in (q, k, v):
        if x.stride(2) != 1 or x.stride(1) != dim:
            raise ValueError("rope_and_store needs each token's heads contiguous")
    store = k_buf is not None
    if store:
        assert v_buf is not None and loc is not None
        assert k_buf.stride(1) == dim and k_buf.stride(2) == 1 and v_buf.stride() == k_buf.stride()
    quant = store and is_fp8(k_buf.dtype)
    q_out = torch.empty((t, num_q, dim), dtype=q.dtype, device=q.device)
    if t == 0:
        return q_out
    block_h = min(triton.next_power_of_2(num_q + num_kv), 16)
    _rope_and_store_kernel[(t,)](
        q, q_out, k, v, positions, cos_cache, sin_cache,
        k_buf if store else q, v_buf if store else q, loc if store else positions,
        q.stride(0), q_out.stride(0), k.stride(0), v.stride(0), k_buf.stride(0) if store else 0,
        float(k_scale), float(v_scale),
        NUM_Q=num_q, NUM_KV=num_kv, HALF=dim // 2, BLOCK_H=block_h, STORE=store, QUANT=quant,
        QMAX=fp8_max(k_buf.dtype) if quant else 0.0, num_warps=4,
    )
    return q_out
