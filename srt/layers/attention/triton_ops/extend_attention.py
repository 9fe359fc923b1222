"""EXTEND attention: the new tokens of each request attend to its cached prefix and to themselves.

Queries are the new tokens only (packed; request i owns rows `extend_start_loc[i] :
extend_start_loc[i] + extend_lens[i]`). Keys/values are the cached prefix, read from the KV pool
through `req_to_token[req_pool_indices[i], :prefix_lens[i]]` (page size 1: one slot per token),
followed by the new tokens' k_extend / v_extend of this step (contiguous rows, causal).

One program = BLOCK_M new tokens of one query head, three key loops sharing one online softmax:
  1. the prefix, gathered through req_to_token (whole tiles unmasked, a masked tail);
  2. the new tokens strictly before the query block (no mask);
  3. the new tokens on the diagonal (causal + length mask).
Query t of a request sits at position prefix_len + t and sees every prefix key and the new keys
0..t, so the causal test inside the new part is the plain `t >= j`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from srt.layers.attention.triton_ops.prefill_attention import (
    LOG2E,
    _dequant,
    _dot,
    _capped,
    _online_softmax_step,
    _online_softmax_step_masked,
    _tile,
    check_heads,
    check_layout,
    check_pool,
    default_blocks,
    dot_precision,
    interpret_upcast,
    pipeline_stages,
)

# Tuned on one H200 (benchmarks/sweep_triton_attention.py: 512 new tokens over a 4096-token
# prefix, 32/8 heads, d 128, bf16): 128x128 tiles, 8 warps, 3 stages were fastest at batch 1;
# also at long contexts (bench_long_attention.py --sweep: 8,192 new tokens over 8k-22k, about
# 410 TFLOP/s, next best 64x64 at 4 warps with 360-384).
EXTEND_HALF_BLOCKS = (128, 128)
EXTEND_NUM_WARPS = 8
EXTEND_NUM_STAGES = 3


@triton.jit
def _extend_fwd_kernel(
    Q_Extend, K_Extend, V_Extend, O_Extend,
    K_Buffer, V_Buffer,
    Req_To_Token, Req_Pool_Indices, Prefix_Lens, Extend_Lens, Extend_Start_Loc,
    qk_scale,  # sm_scale * log2(e)
    k_scale, v_scale,  # of an FP8 pool (KV_FP8)
    window,  # SLIDING: a query at position p sees keys p - window + 1 .. p
    cap2,  # SOFTCAP: the logit cap times log2(e)
    stride_qt, stride_qh,
    stride_kt, stride_kh,
    stride_vt, stride_vh,
    stride_ot, stride_oh,
    stride_kbuf_t, stride_kbuf_h,
    stride_vbuf_t, stride_vbuf_h,
    stride_r2t,
    KV_GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
    KV_FP8: tl.constexpr,
    SLIDING: tl.constexpr,
    SOFTCAP: tl.constexpr,
):
    # grid (heads, bs, query blocks): the heads of one KV group run side by side (K/V reuse in
    # L2), and the last, most expensive query blocks of the causal triangle are launched first
    cur_head = tl.program_id(0)
    cur_batch = tl.program_id(1)
    start_m = (tl.num_programs(2) - 1 - tl.program_id(2)) * BLOCK_M
    cur_kv_head = cur_head // KV_GROUP

    ext_len = tl.load(Extend_Lens + cur_batch).to(tl.int32)
    if start_m >= ext_len:
        return
    prefix_len = tl.load(Prefix_Lens + cur_batch).to(tl.int32)
    tok0 = tl.load(Extend_Start_Loc + cur_batch).to(tl.int64)
    row = tl.load(Req_Pool_Indices + cur_batch).to(tl.int64)

    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    mask_m = offs_m < ext_len

    q_ptrs = (Q_Extend + (tok0 + offs_m)[:, None] * stride_qt + cur_head * stride_qh
              + offs_d[None, :])
    q = _tile(q_ptrs, mask_m, offs_d, HEAD_DIM, BLOCK_D, True)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)

    if SOFTCAP:
        step_scale = 1.0
    else:
        step_scale = qk_scale
    # 1. the cached prefix, one pool slot per token: whole tiles unmasked, then the tail
    slot_row = Req_To_Token + row * stride_r2t
    kbuf_base = K_Buffer + cur_kv_head * stride_kbuf_h
    vbuf_base = V_Buffer + cur_kv_head * stride_vbuf_h
    if SLIDING:
        # from the tile of the first key the block's first query sees; every tile masked
        lo = (tl.maximum(prefix_len + start_m - window + 1, 0) // BLOCK_N) * BLOCK_N
        for start_n in range(lo, prefix_len, BLOCK_N):
            cur_n = start_n + offs_n
            mask_n = cur_n < prefix_len
            slots = tl.load(slot_row + cur_n, mask=mask_n, other=0).to(tl.int64)
            k = _tile(kbuf_base + slots[:, None] * stride_kbuf_t + offs_d[None, :], mask_n,
                      offs_d, HEAD_DIM, BLOCK_D, True)
            k = _dequant(k, k_scale, q.dtype, KV_FP8)
            qk = _capped(_dot(q, tl.trans(k), DOT_PRECISION, UPCAST), qk_scale, cap2, SOFTCAP)
            visible = mask_n[None, :] & (cur_n[None, :] > (prefix_len + offs_m)[:, None] - window)
            qk = tl.where(visible, qk, float("-inf"))
            v = _tile(vbuf_base + slots[:, None] * stride_vbuf_t + offs_d[None, :], mask_n,
                      offs_d, HEAD_DIM, BLOCK_D, True)
            v = _dequant(v, v_scale, q.dtype, KV_FP8)
            m_i, l_i, acc = _online_softmax_step_masked(qk, v, m_i, l_i, acc, step_scale,
                                                        DOT_PRECISION, UPCAST)
    else:
        full_end = (prefix_len // BLOCK_N) * BLOCK_N
        for start_n in range(0, full_end, BLOCK_N):
            slots = tl.load(slot_row + start_n + offs_n).to(tl.int64)
            k = _tile(kbuf_base + slots[:, None] * stride_kbuf_t + offs_d[None, :], offs_n,
                      offs_d, HEAD_DIM, BLOCK_D, False)
            k = _dequant(k, k_scale, q.dtype, KV_FP8)
            qk = _capped(_dot(q, tl.trans(k), DOT_PRECISION, UPCAST), qk_scale, cap2, SOFTCAP)
            v = _tile(vbuf_base + slots[:, None] * stride_vbuf_t + offs_d[None, :], offs_n,
                      offs_d, HEAD_DIM, BLOCK_D, False)
            v = _dequant(v, v_scale, q.dtype, KV_FP8)
            m_i, l_i, acc = _online_softmax_step(qk, v, m_i, l_i, acc, step_scale,
                                                 DOT_PRECISION, UPCAST)
        if full_end < prefix_len:
            cur_n = full_end + offs_n
            mask_n = cur_n < prefix_len
            slots = tl.load(slot_row + cur_n, mask=mask_n, other=0).to(tl.int64)
            k = _tile(kbuf_base + slots[:, None] * stride_kbuf_t + offs_d[None, :], mask_n,
                      offs_d, HEAD_DIM, BLOCK_D, True)
            k = _dequant(k, k_scale, q.dtype, KV_FP8)
            qk = _capped(_dot(q, tl.trans(k), DOT_PRECISION, UPCAST), qk_scale, cap2, SOFTCAP)
            qk = tl.where(mask_n[None, :], qk, float("-inf"))
            v = _tile(vbuf_base + slots[:, None] * stride_vbuf_t + offs_d[None, :], mask_n,
                      offs_d, HEAD_DIM, BLOCK_D, True)
            v = _dequant(v, v_scale, q.dtype, KV_FP8)
            m_i, l_i, acc = _online_softmax_step(qk, v, m_i, l_i, acc, step_scale,
                                                 DOT_PRECISION, UPCAST)

    # 2. new tokens before the query block: all valid, all visible (but for a window)
    k_base = K_Extend + tok0 * stride_kt + cur_kv_head * stride_kh
    v_base = V_Extend + tok0 * stride_vt + cur_kv_head * stride_vh
    if SLIDING:
        lo = (tl.maximum(start_m - window + 1, 0) // BLOCK_N) * BLOCK_N
    else:
        lo = 0
    for start_n in range(lo, start_m, BLOCK_N):
        cur_n = start_n + offs_n
        k = _tile(k_base + cur_n[:, None] * stride_kt + offs_d[None, :], cur_n, offs_d,
                  HEAD_DIM, BLOCK_D, False)
        qk = _capped(_dot(q, tl.trans(k), DOT_PRECISION, UPCAST), qk_scale, cap2, SOFTCAP)
        v = _tile(v_base + cur_n[:, None] * stride_vt + offs_d[None, :], cur_n, offs_d,
                  HEAD_DIM, BLOCK_D, False)
        if SLIDING:
            qk = tl.where(cur_n[None, :] > offs_m[:, None] - window, qk, float("-inf"))
            m_i, l_i, acc = _online_softmax_step_masked(qk, v, m_i, l_i, acc, step_scale,
                                                        DOT_PRECISION, UPCAST)
        else:
            m_i, l_i, acc = _online_softmax_step(qk, v, m_i, l_i, acc, step_scale,
                                                 DOT_PRECISION, UPCAST)

    # 3. the diagonal of the new part: causal + length (+ window)
    end_n = tl.minimum(start_m + BLOCK_M, ext_len)
    for start_n in range(start_m, end_n, BLOCK_N):
        cur_n = start_n + offs_n
        mask_n = cur_n < end_n
        k = _tile(k_base + cur_n[:, None] * stride_kt + offs_d[None, :], mask_n, offs_d,
                  HEAD_DIM, BLOCK_D, True)
        qk = _capped(_dot(q, tl.trans(k), DOT_PRECISION, UPCAST), qk_scale, cap2, SOFTCAP)
        visible = (offs_m[:, None] >= cur_n[None, :]) & mask_n[None, :]
        v = _tile(v_base + cur_n[:, None] * stride_vt + offs_d[None, :], mask_n, offs_d,
                  HEAD_DIM, BLOCK_D, True)
        if SLIDING:
            visible = visible & (cur_n[None, :] > offs_m[:, None] - window)
            qk = tl.where(visible, qk, float("-inf"))
            m_i, l_i, acc = _online_softmax_step_masked(qk, v, m_i, l_i, acc, step_scale,
                                                        DOT_PRECISION, UPCAST)
        else:
            qk = tl.where(visible, qk, float("-inf"))
            m_i, l_i, acc = _online_softmax_step(qk, v, m_i, l_i, acc, step_scale,
                                                 DOT_PRECISION, UPCAST)

    acc = acc / l_i[:, None]
    o_ptrs = (O_Extend + (tok0 + offs_m)[:, None] * stride_ot + cur_head * stride_oh
              + offs_d[None, :])
    if BLOCK_D == HEAD_DIM:
        tl.store(o_ptrs, acc.to(O_Extend.dtype.element_ty), mask=mask_m[:, None])
    else:
        tl.store(o_ptrs, acc.to(O_Extend.dtype.element_ty),
                 mask=mask_m[:, None] & (offs_d < HEAD_DIM)[None, :])


def extend_attention_fwd(
    q_extend: torch.Tensor,
    k_extend: torch.Tensor,
    v_extend: torch.Tensor,
    o_extend: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    prefix_lens: torch.Tensor,
    extend_lens: torch.Tensor,
    extend_start_loc: torch.Tensor,
    max_len_extend: int,
    sm_scale: float,
    *,
    block_m: int | None = None,
    block_n: int | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    sliding_window: int | None = None,
    logit_cap: float = 0.0,
) -> None:
    """Attention of the new tokens over cached prefix + themselves, written into `o_extend`.

    q_extend, o_extend: [T, H, D]; k_extend, v_extend: [T, Hkv, D] (this step's K/V, the same
    values the layer wrote to the pool); k_buffer, v_buffer: [S, Hkv, D] pool of the layer;
    req_to_token: [R, C] int32/int64; req_pool_indices, prefix_lens, extend_lens,
    extend_start_loc: [bs] int32/int64 device tensors; max_len_extend: a host int >=
    max(extend_lens). A pool in FP8 is read as stored * k_scale (v_scale) in q's dtype; this
    step's k_extend / v_extend are used as they are. `sliding_window` W: a query at position p
    sees the keys at p - W + 1 .. p only; `logit_cap` c > 0: scores s become c * tanh(s / c).
    """
    group = check_heads(q_extend, k_extend)
    check_layout(q_extend, k_extend, v_extend, o_extend)
    kv_fp8 = check_pool(q_extend, k_buffer, v_buffer)
    if (k_extend.shape != v_extend.shape or o_extend.shape != q_extend.shape
            or k_buffer.shape != v_buffer.shape or k_buffer.shape[1:] != k_extend.shape[1:]):
        raise ValueError("shape mismatch between q/k/v/o and the KV buffers")
    if req_to_token.stride(1) != 1:
        raise ValueError("req_to_token rows must be contiguous")
    bs = extend_lens.shape[0]
    heads, head_dim = q_extend.shape[1], q_extend.shape[2]
    if bs == 0 or max_len_extend <= 0:
        return
    default_m, default_n = (
        EXTEND_HALF_BLOCKS if q_extend.dtype != torch.float32 and head_dim <= 128
        else default_blocks(q_extend.dtype, head_dim)
    )
    block_m = block_m or default_m
    block_n = block_n or default_n
    if block_m % block_n:
        raise ValueError("block_m must be a multiple of block_n")
    grid = (heads, bs, triton.cdiv(max_len_extend, block_m))
    _extend_fwd_kernel[grid](
        q_extend, k_extend, v_extend, o_extend,
        k_buffer, v_buffer,
        req_to_token, req_pool_indices, prefix_lens, extend_lens, extend_start_loc,
        sm_scale * LOG2E,
        float(k_scale), float(v_scale),
        int(sliding_window or 0), float(logit_cap) * LOG2E if logit_cap else 1.0,
        q_extend.stride(0), q_extend.stride(1),
        k_extend.stride(0), k_extend.stride(1),
        v_extend.stride(0), v_extend.stride(1),
        o_extend.stride(0), o_extend.stride(1),
        k_buffer.stride(0), k_buffer.stride(1),
        v_buffer.stride(0), v_buffer.stride(1),
        req_to_token.stride(0),
        KV_GROUP=group,
        HEAD_DIM=head_dim,
        BLOCK_D=triton.next_power_of_2(head_dim),
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        DOT_PRECISION=dot_precision(q_extend.dtype),
        UPCAST=interpret_upcast(q_extend.dtype),
        KV_FP8=kv_fp8,
        SLIDING=bool(sliding_window),
        SOFTCAP=bool(logit_cap),
        num_warps=EXTEND_NUM_WARPS,
        num_stages=pipeline_stages(q_extend.dtype, head_dim, EXTEND_NUM_STAGES),
    )


__all__ = ["extend_attention_fwd"]
