"""DECODE attention: one query per request over its whole context in the KV pool, split-K style.

Stage 1, grid (bs, kv_heads, num_kv_splits): one program takes one KV head and one contiguous
range of the request's context (a "split"), and computes for ALL query heads of that KV head's
group at once (the group's queries are the M dimension of a tl.dot, padded to 16 rows), so every
K/V byte is read from memory once per group. It writes per (request, head, split) the normalised
partial output and its log-sum-exp (base 2) into a float32 workspace.
Stage 2, grid (bs, heads): merges the splits of one (request, head) with the usual LSE weights.

Split boundaries are `split_len = round_up(cdiv(seq_len, num_kv_splits), BLOCK_N)` so every split
but the last starts on a block boundary; splits past the end of a short context are empty:
stage 1 skips them and stage 2 masks them out (so more splits than tokens is fine).

Shared prefix (`shared_len` P > 0): the first P context positions of every request in the batch
map to the same pool slots (one cached prefix, e.g. a system prompt). Stage 1 then covers only
each request's own positions P..seq_len-1, and the shared stage, grid (kv_heads, row blocks,
shared_splits), reads the prefix's K/V once for BLOCK_M query rows of all requests at a time
(rows = request x head of the KV group) instead of once per request; its partial results are
extra splits that stage 2 merges like the others.

An FP8 pool (`k_scale`, `v_scale` per layer) is read, for half-precision queries, as int16
words of two channels and computed in float16 (`fp8_pairs`, `_attend_range_pairs`): the even
and odd channels are separate tiles, so that the tiles' shared-memory traffic stays 16-bit
(FP8 tiles converted as read reach the tensor cores through byte loads); the scales are folded
into the score and output scales (`_fp8_scales`).

The workspace (see `decode_workspace`) is one flat float32 buffer: per call the first
bs * H * S * D floats hold the partial outputs [bs, H, S, D] and the next bs * H * S the LSEs
[bs, H, S], where S = num_kv_splits + shared_splits. Allocate it once and reuse it: the call does no
allocation, no host sync and is CUDA-graph capturable when a workspace is given.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from srt.layers.attention.triton_ops.decode_config import (
    DECODE_BLOCK_N,
    DECODE_MAX_KV_SPLITS,
    DECODE_MIN_BLOCK_H,
    DECODE_MIN_TOKENS_PER_SPLIT,
    DECODE_NUM_STAGES,
    DECODE_NUM_STAGES_SMALL_HEAD,
    DECODE_NUM_WARPS,
    DECODE_SHARED_BLOCK_M,
    choose_num_kv_splits,
    choose_shared_splits,
    decode_num_stages,
    decode_workspace,
    decode_workspace_numel,
    device_num_sms,
    device_shared_memory,
    fp8_pairs,
)
from srt.layers.attention.triton_ops.decode_tiles import (
    _attend_store,
    _decode_split_len,
    _first_position,
)
from srt.layers.attention.triton_ops.prefill_attention import (
    LOG2E,
    check_heads,
    check_layout,
    check_pool,
    dot_precision,
    interpret_upcast,
)


# Integer arguments that vary between steps are not specialized on (Triton would otherwise
# compile a new variant when one of them is 1 or a multiple of 16: mid-serving compiles).
@triton.jit(do_not_specialize=["num_splits", "total_splits", "shared_len"])
def _decode_stage1_kernel(
    Q, K_Buffer, V_Buffer,
    Req_To_Token, Req_Pool_Indices, Seq_Lens,
    Mid_O, Mid_Lse,
    qk_scale,  # sm_scale * log2(e)
    k_scale, v_scale,  # of an FP8 pool (KV_FP8)
    window,  # > 0: only the last `window` positions are read (a sliding window)
    cap2,  # SOFTCAP: the logit cap times log2(e)
    stride_qb, stride_qh,
    stride_kbuf_t, stride_kbuf_h,
    stride_vbuf_t, stride_vbuf_h,
    stride_r2t,
    num_heads,
    num_splits,
    total_splits,  # num_splits + the shared stage's splits (the workspace's split axis)
    shared_len,  # positions 0..shared_len-1 are the shared stage's
    KV_GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
    KV_FP8: tl.constexpr,
    PAIRS: tl.constexpr,  # an FP8 pool read as int16 words (K_Buffer/V_Buffer and strides)
    E5M2: tl.constexpr,
    SOFTCAP: tl.constexpr,
    V_DIM: tl.constexpr,  # below HEAD_DIM: latent attention's values (_attend_store)
):
    cur_batch = tl.program_id(0)
    cur_kv_head = tl.program_id(1)
    split = tl.program_id(2)

    seq_len = tl.load(Seq_Lens + cur_batch).to(tl.int32)
    lo = _first_position(seq_len, shared_len, window)
    split_len = _decode_split_len(seq_len - lo, num_splits, BLOCK_N)
    split_start = lo + split * split_len
    split_end = tl.minimum(split_start + split_len, seq_len)
    if split_start >= split_end:
        return  # an empty split (short context): stage 2 ignores it
    row = tl.load(Req_Pool_Indices + cur_batch).to(tl.int64)

    offs_h = tl.arange(0, BLOCK_H)
    mask_h = offs_h < KV_GROUP
    cur_heads = cur_kv_head * KV_GROUP + offs_h
    # partial result of this split, normalised, and its log2-sum-exp2
    base = (cur_batch.to(tl.int64) * num_heads + cur_heads) * total_splits + split  # [BLOCK_H]
    _attend_store(
        Q + cur_batch.to(tl.int64) * stride_qb + cur_heads * stride_qh, mask_h,
        Req_To_Token + row * stride_r2t, K_Buffer + cur_kv_head * stride_kbuf_h,
        V_Buffer + cur_kv_head * stride_vbuf_h, stride_kbuf_t, stride_vbuf_t, split_start,
        split_end, qk_scale, k_scale, v_scale, cap2, Mid_O + base * HEAD_DIM, Mid_Lse + base,
        BLOCK_H, HEAD_DIM, BLOCK_D, BLOCK_N, DOT_PRECISION, UPCAST, KV_FP8, PAIRS, E5M2, SOFTCAP,
        V_DIM)


@triton.jit(do_not_specialize=["bs", "num_splits", "total_splits", "shared_len",
                               "shared_splits"])
def _decode_shared_kernel(
    Q, K_Buffer, V_Buffer,
    Req_To_Token, Req_Pool_Indices,
    Mid_O, Mid_Lse,
    qk_scale,  # sm_scale * log2(e)
    k_scale, v_scale,  # of an FP8 pool (KV_FP8)
    cap2,  # SOFTCAP: the logit cap times log2(e)
    stride_qb, stride_qh,
    stride_kbuf_t, stride_kbuf_h,
    stride_vbuf_t, stride_vbuf_h,
    stride_r2t,
    bs,
    num_heads,
    num_splits,  # stage 1's splits: this stage writes splits num_splits.. of the workspace
    total_splits,
    shared_len,
    shared_splits,
    KV_GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
    KV_FP8: tl.constexpr,
    PAIRS: tl.constexpr,
    E5M2: tl.constexpr,
    SOFTCAP: tl.constexpr,
    V_DIM: tl.constexpr,
):
    cur_kv_head = tl.program_id(0)
    block_m = tl.program_id(1)
    split = tl.program_id(2)

    split_len = _decode_split_len(shared_len, shared_splits, BLOCK_N)
    split_start = split * split_len
    split_end = tl.minimum(split_start + split_len, shared_len)
    if split_start >= split_end:
        return  # stage 2 ignores it
    # the shared positions have the same slots in every request's row: read the first one's
    row = tl.load(Req_Pool_Indices).to(tl.int64)

    offs_m = block_m * BLOCK_M + tl.arange(0, BLOCK_M)  # query rows: request x head of group
    mask_m = offs_m < bs * KV_GROUP
    batch = offs_m // KV_GROUP
    heads = cur_kv_head * KV_GROUP + offs_m % KV_GROUP
    base = (batch.to(tl.int64) * num_heads + heads) * total_splits + num_splits + split
    _attend_store(
        Q + batch.to(tl.int64) * stride_qb + heads * stride_qh, mask_m,
        Req_To_Token + row * stride_r2t, K_Buffer + cur_kv_head * stride_kbuf_h,
        V_Buffer + cur_kv_head * stride_vbuf_h, stride_kbuf_t, stride_vbuf_t, split_start,
        split_end, qk_scale, k_scale, v_scale, cap2, Mid_O + base * HEAD_DIM, Mid_Lse + base,
        BLOCK_M, HEAD_DIM, BLOCK_D, BLOCK_N, DOT_PRECISION, UPCAST, KV_FP8, PAIRS, E5M2, SOFTCAP,
        V_DIM)


@triton.jit(do_not_specialize=["num_splits", "total_splits", "shared_len", "shared_splits"])
def _decode_stage2_kernel(
    Mid_O, Mid_Lse, O, Seq_Lens,
    window,
    stride_ob, stride_oh,
    num_heads,
    num_splits,
    total_splits,
    shared_len,
    shared_splits,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    cur_batch = tl.program_id(0)
    cur_head = tl.program_id(1)

    seq_len = tl.load(Seq_Lens + cur_batch).to(tl.int32)
    own_len = seq_len - _first_position(seq_len, shared_len, window)
    split_len = _decode_split_len(own_len, num_splits, BLOCK_N)
    # the shared stage's splits follow stage 1's (none when shared_splits == 0)
    shared_split_len = _decode_split_len(shared_len, tl.maximum(shared_splits, 1), BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < HEAD_DIM
    # BLOCK_S splits at a time, rescaled as the running maximum grows: a [BLOCK_S, BLOCK_D]
    # tile of every split at once spills registers for wide heads (MLA's 512: 38 us a call at
    # batch 1 on an H100). With one chunk this is the plain weighted sum.
    m = tl.full((), float("-inf"), tl.float32)
    acc = tl.zeros((BLOCK_D,), dtype=tl.float32)
    total = tl.zeros((), dtype=tl.float32)
    for s0 in range(0, total_splits, BLOCK_S):
        offs_s = s0 + tl.arange(0, BLOCK_S)
        j = offs_s - num_splits
        valid = ((offs_s < num_splits) & (offs_s * split_len < own_len)) | (
            (j >= 0) & (j < shared_splits) & (j * shared_split_len < shared_len))
        base = (cur_batch.to(tl.int64) * num_heads + cur_head) * total_splits + offs_s
        lse = tl.load(Mid_Lse + base, mask=valid, other=float("-inf"))
        m_new = tl.maximum(m, tl.max(lse, 0))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        w = tl.where(valid, tl.math.exp2(lse - m_safe), 0.0)
        parts = tl.load(Mid_O + base[:, None] * HEAD_DIM + offs_d[None, :],
                        mask=valid[:, None] & mask_d[None, :], other=0.0)
        rescale = tl.math.exp2(m - m_safe)
        acc = acc * rescale + tl.sum(w[:, None] * parts, 0)
        total = total * rescale + tl.sum(w, 0)
        m = m_new
    out = acc / tl.where(total > 0, total, 1.0)
    o_ptrs = O + cur_batch.to(tl.int64) * stride_ob + cur_head * stride_oh + offs_d
    tl.store(o_ptrs, out.to(O.dtype.element_ty), mask=mask_d)


def decode_attention_fwd(
    q: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    o: torch.Tensor,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    sm_scale: float,
    num_kv_splits: int,
    workspace: torch.Tensor | None = None,
    *,
    block_n: int | None = None,
    shared_len: int = 0,
    shared_splits: int = 0,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    sliding_window: int | None = None,
    logit_cap: float = 0.0,
    v_head_dim: int | None = None,
) -> None:
    """One query per request over the whole context `req_to_token[req_pool_indices[i],
    :seq_lens[i]]` (the current token's K/V already in the pool), written into `o`.

    q, o: [bs, H, D]; k_buffer, v_buffer: [S, Hkv, D] pool of the layer; req_to_token: [R, C]
    int32/int64; req_pool_indices, seq_lens: [bs] int32/int64 device tensors (seq_lens >= 1);
    num_kv_splits: host int >= 1 (see choose_num_kv_splits); workspace: float32 with at least
    decode_workspace_numel(bs, H, D, num_kv_splits + shared_splits) elements (allocated here
    if None). shared_len > 0 (with shared_splits >= 1) promises that the first shared_len
    entries of every request's req_to_token row are the same slots and that every
    seq_lens[i] > shared_len; those positions are then read once for the whole batch.
    A pool in FP8 is read as stored * k_scale (v_scale) in q's dtype. `sliding_window` W: only
    the last W positions are read (no shared prefix then); `logit_cap` c > 0: scores s become
    c * tanh(s / c). `v_head_dim` below D (multi-head latent attention: 512 of 576): the values
    are the keys' first v_head_dim channels (v_buffer is not read; a pool in FP8 reads v_buffer
    as usual, where it holds the same latent) and o's channels from v_head_dim on are only
    defined where the pool is not FP8 (zero); both parts' widths must be powers of two.
    """
    check_heads(q, k_buffer)
    check_layout(q, o)
    kv_fp8 = check_pool(q, k_buffer, v_buffer)
    group = q.shape[1] // k_buffer.shape[1]
    if k_buffer.shape != v_buffer.shape or o.shape != q.shape:
        raise ValueError("k/v buffer or q/o shape mismatch")
    if req_to_token.stride(1) != 1:
        raise ValueError("req_to_token rows must be contiguous")
    if num_kv_splits < 1:
        raise ValueError("num_kv_splits must be >= 1")
    if shared_len < 0 or (shared_len > 0) != (shared_splits > 0):
        raise ValueError("shared_len > 0 needs shared_splits >= 1, and the reverse")
    window = int(sliding_window or 0)
    if window and shared_len:
        raise ValueError("a sliding window reads no shared prefix (shared_len must be 0)")
    cap2 = float(logit_cap) * LOG2E if logit_cap else 1.0
    bs, heads, head_dim = q.shape
    kv_heads = k_buffer.shape[1]
    if bs == 0:
        return
    total_splits = num_kv_splits + shared_splits
    need = decode_workspace_numel(bs, heads, head_dim, total_splits)
    if workspace is None:
        workspace = torch.empty(need, dtype=torch.float32, device=q.device)
    elif (workspace.dtype != torch.float32 or not workspace.is_contiguous()
          or workspace.numel() < need):
        raise ValueError(
            f"decode workspace too small or not contiguous float32: need {need} floats for "
            f"bs={bs}, heads={heads}, head_dim={head_dim}, splits={total_splits}"
        )
    flat = workspace.view(-1)
    n_o = bs * heads * total_splits * head_dim
    mid_o = flat[:n_o]
    mid_lse = flat[n_o:need]

    pairs = fp8_pairs(q.dtype, k_buffer.dtype, head_dim)
    # latent attention's values are its keys' first v_head_dim channels: one tile serves both
    # (FP8 pools keep the general path: a V tile of the whole width, the same values first)
    v_dim = v_head_dim if v_head_dim and v_head_dim < head_dim and not kv_fp8 else head_dim
    if v_dim < head_dim and (v_dim & (v_dim - 1) or (head_dim - v_dim) & (head_dim - v_dim - 1)):
        raise ValueError(f"v_head_dim {v_dim} and the rest of {head_dim} must be powers of two")
    # (heads wider than 256, as multi-head latent attention's 576, take 16-token blocks: 64
    # would need over 256 KiB of shared memory for one K and one V tile; the latent path reads
    # one 576-wide tile, 32 tokens of it)
    block_n = block_n or (DECODE_BLOCK_N if head_dim <= 256 else 32 if v_dim < head_dim else 16)
    block_d = triton.next_power_of_2(head_dim)
    stages = decode_num_stages(head_dim, block_n, k_buffer.element_size(),
                               device_shared_memory(q.device), latent=v_dim < head_dim)
    kbuf, vbuf = (k_buffer.view(torch.int16), v_buffer.view(torch.int16)) if pairs else (
        k_buffer, v_buffer)
    e5m2 = k_buffer.dtype == torch.float8_e5m2
    _decode_stage1_kernel[(bs, kv_heads, num_kv_splits)](
        q, kbuf, vbuf,
        req_to_token, req_pool_indices, seq_lens,
        mid_o, mid_lse,
        sm_scale * LOG2E,
        float(k_scale), float(v_scale),
        window, cap2,
        q.stride(0), q.stride(1),
        kbuf.stride(0), kbuf.stride(1),
        vbuf.stride(0), vbuf.stride(1),
        req_to_token.stride(0),
        heads,
        num_kv_splits,
        total_splits,
        shared_len,
        KV_GROUP=group,
        HEAD_DIM=head_dim,
        BLOCK_D=block_d,
        BLOCK_H=max(DECODE_MIN_BLOCK_H, triton.next_power_of_2(group)),
        BLOCK_N=block_n,
        DOT_PRECISION=dot_precision(q.dtype),
        UPCAST=interpret_upcast(q.dtype),
        KV_FP8=kv_fp8,
        PAIRS=pairs,
        E5M2=e5m2,
        SOFTCAP=bool(logit_cap),
        V_DIM=v_dim,
        num_warps=DECODE_NUM_WARPS,
        num_stages=stages,
    )
    if shared_len > 0:
        block_m = DECODE_SHARED_BLOCK_M
        _decode_shared_kernel[(kv_heads, triton.cdiv(bs * group, block_m), shared_splits)](
            q, kbuf, vbuf,
            req_to_token, req_pool_indices,
            mid_o, mid_lse,
            sm_scale * LOG2E,
            float(k_scale), float(v_scale),
            cap2,
            q.stride(0), q.stride(1),
            kbuf.stride(0), kbuf.stride(1),
            vbuf.stride(0), vbuf.stride(1),
            req_to_token.stride(0),
            bs,
            heads,
            num_kv_splits,
            total_splits,
            shared_len,
            shared_splits,
            KV_GROUP=group,
            HEAD_DIM=head_dim,
            BLOCK_D=block_d,
            BLOCK_M=block_m,
            BLOCK_N=block_n,
            DOT_PRECISION=dot_precision(q.dtype),
            UPCAST=interpret_upcast(q.dtype),
            KV_FP8=kv_fp8,
            PAIRS=pairs,
            E5M2=e5m2,
            SOFTCAP=bool(logit_cap),
            V_DIM=v_dim,
            num_warps=DECODE_NUM_WARPS,
            num_stages=stages,
        )
    _decode_stage2_kernel[(bs, heads)](
        mid_o, mid_lse, o, seq_lens,
        window,
        o.stride(0), o.stride(1),
        heads,
        num_kv_splits,
        total_splits,
        shared_len,
        shared_splits,
        HEAD_DIM=head_dim,
        BLOCK_D=block_d,
        BLOCK_S=min(triton.next_power_of_2(total_splits), max(1, 8192 // block_d)),
        BLOCK_N=block_n,
        num_warps=4,
        num_stages=1,
    )


__all__ = [
    "DECODE_MAX_KV_SPLITS",
    "DECODE_MIN_TOKENS_PER_SPLIT",
    "DECODE_NUM_STAGES",
    "DECODE_NUM_STAGES_SMALL_HEAD",
    "choose_num_kv_splits",
    "choose_shared_splits",
    "decode_attention_fwd",
    "decode_num_stages",
    "decode_workspace",
    "decode_workspace_numel",
    "device_num_sms",
    "device_shared_memory",
    "fp8_pairs",
]
