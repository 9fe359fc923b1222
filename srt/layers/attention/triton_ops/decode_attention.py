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

import functools

import torch
import triton
import triton.language as tl

from srt.layers.attention.triton_ops.prefill_attention import (
    LOG2E,
    _capped,
    _dot,
    _mma,
    _online_softmax_step,
    check_heads,
    check_layout,
    check_pool,
    dot_precision,
    interpret_upcast,
)

# Tuned on one H200 with benchmarks/sweep_triton_attention.py (32/8 heads, d 128, bf16):
# batch 64 x 2048 went from 71% to 87% of copy bandwidth with 64-token blocks.
DECODE_BLOCK_N = 64  # tokens per inner step of stage 1
DECODE_MIN_BLOCK_H = 16  # tl.dot needs M >= 16: the query-head group is padded to this
DECODE_NUM_WARPS = 4
# Batches of unequal contexts (benchmarks/sweep_decode_ragged.py, 100-1124 tokens, one H200):
# 3 stages against 2 took batch 64 from 75.6 to 59.7 us, 128 from 141.5 to 101.2 us and 256
# from 231 to 178 us per layer; 4 stages equal 3 with a third more shared memory.
DECODE_NUM_STAGES = 3
# SmolLM2's heads (9 / 3, d 64) at batch 256 x 768: 4 stages 0.059 ms, 2 stages 0.065 ms.
DECODE_NUM_STAGES_SMALL_HEAD = 4
# Split rule: aim at PROGRAMS_PER_SM stage-1 programs per SM, never splits shorter than
# MIN_TOKENS_PER_SPLIT, never more than MAX_KV_SPLITS splits. 8 (was 4) from the H200 sweeps of
# unequal contexts (100-1124 tokens): batch 128 gets 2 splits (bf16 pool 96.6-98.2 us a layer
# against 101.2-110.8 with 1; FP8 pool 95.0 against 101.1), batch 64 3 (59.4 us, 2: 59.7),
# batch 256 still 1. The shared-prefix stage keeps 4 (DECODE_SHARED_PROGRAMS_PER_SM).
DECODE_PROGRAMS_PER_SM = 8
DECODE_SHARED_PROGRAMS_PER_SM = 4
DECODE_MIN_TOKENS_PER_SPLIT = 128
DECODE_MAX_KV_SPLITS = 64
DECODE_SHARED_BLOCK_M = 64  # query rows (request x head) per program of the shared stage
_DEFAULT_NUM_SMS = 132  # H100 / H200


@functools.lru_cache(maxsize=None)
def _cuda_properties(index: int) -> tuple[int, int | None]:
    """(streaming multiprocessors, shared memory per block opt-in, None where torch lacks it)"""
    props = torch.cuda.get_device_properties(index)
    return props.multi_processor_count, getattr(props, "shared_memory_per_block_optin", None)


def _cuda_index(device: torch.device | str | None) -> int | None:
    """CUDA index of `device` (the current CUDA device if None); None without CUDA."""
    if device is not None:
        device = torch.device(device)
        if device.type != "cuda":
            return None
    if not torch.cuda.is_available():
        return None
    if device is not None and device.index is not None:
        return device.index
    return torch.cuda.current_device()


def device_num_sms(device: torch.device | str | None = None) -> int:
    """Streaming multiprocessors of `device` (the current CUDA device if None); 132 without CUDA."""
    index = _cuda_index(device)
    return _DEFAULT_NUM_SMS if index is None else _cuda_properties(index)[0]


def device_shared_memory(device: torch.device | str | None = None) -> int | None:
    """Shared memory per block (opt-in) of `device` in bytes; None without CUDA or unknown."""
    index = _cuda_index(device)
    return None if index is None else _cuda_properties(index)[1]


def decode_num_stages(head_dim: int, block_n: int, kv_itemsize: int,
                      shared_memory: int | None) -> int:
    """Stage 1's pipeline depth: DECODE_NUM_STAGES (DECODE_NUM_STAGES_SMALL_HEAD for head_dim
    <= 64), less where `shared_memory` bytes per block (None: unknown, no limit) would not hold
    that many K and V tiles with 16 KiB to spare (e.g. 99 KiB GPUs at d 128 get 2); never
    below 2."""
    stages = DECODE_NUM_STAGES_SMALL_HEAD if head_dim <= 64 else DECODE_NUM_STAGES
    tiles = 2 * block_n * triton.next_power_of_2(head_dim) * kv_itemsize  # one K and one V
    while (shared_memory is not None and stages > 2
           and stages * tiles + (16 << 10) > shared_memory):
        stages -= 1
    return stages


def fp8_pairs(q_dtype: torch.dtype, kv_dtype: torch.dtype, head_dim: int) -> bool:
    """Whether the decode kernels read an FP8 pool as int16 words of two channels and compute
    in float16 (_attend_range_pairs): half-precision queries, an even head_dim of at least 32
    (each half a tl.dot operand of >= 16). Else FP8 tiles are converted to q's dtype as read,
    which on a GPU reads them from shared memory a byte at a time (on one H200 at batch 128,
    contexts of 100-1124: 110-116 us a layer, slower than a bf16 pool's 101 us for twice the
    bytes)."""
    return (kv_dtype in (torch.float8_e4m3fn, torch.float8_e5m2)
            and q_dtype in (torch.bfloat16, torch.float16)
            and head_dim % 2 == 0 and triton.next_power_of_2(head_dim) >= 32)


def choose_shared_splits(bs: int, group: int, kv_heads: int, shared_len: int, *,
                         num_sms: int | None = None,
                         max_splits: int = DECODE_MAX_KV_SPLITS) -> int:
    """Splits of the shared-prefix stage: about DECODE_SHARED_PROGRAMS_PER_SM programs per SM over
    its (kv_heads x row blocks) grid, at least 256 prefix tokens a split. Host ints only."""
    row_blocks = triton.cdiv(bs * group, DECODE_SHARED_BLOCK_M)
    target = (num_sms if num_sms is not None else device_num_sms()) * DECODE_SHARED_PROGRAMS_PER_SM
    want = triton.cdiv(target, max(1, kv_heads * row_blocks))
    return max(1, min(want, triton.cdiv(max(1, shared_len), 256), max_splits))


def choose_num_kv_splits(
    bs: int,
    kv_heads: int,
    max_seq_len: int,
    *,
    num_sms: int | None = None,
    max_splits: int = DECODE_MAX_KV_SPLITS,
) -> int:
    """splits = clamp(ceil(num_sms * DECODE_PROGRAMS_PER_SM / (bs * kv_heads)), 1, max_splits),
    further limited so a split of the longest context holds at least
    DECODE_MIN_TOKENS_PER_SPLIT tokens. Host ints only; deterministic."""
    target = (num_sms if num_sms is not None else device_num_sms()) * DECODE_PROGRAMS_PER_SM
    splits = triton.cdiv(target, max(1, bs * kv_heads))
    splits = min(splits, triton.cdiv(max(1, max_seq_len), DECODE_MIN_TOKENS_PER_SPLIT))
    return max(1, min(splits, max_splits))


def decode_workspace_numel(bs: int, num_heads: int, head_dim: int, num_kv_splits: int) -> int:
    return bs * num_heads * num_kv_splits * (head_dim + 1)


def decode_workspace(
    max_bs: int, num_heads: int, head_dim: int, num_kv_splits: int,
    device: torch.device | str,
) -> torch.Tensor:
    """Flat float32 workspace big enough for any call with bs * splits <= max_bs * num_kv_splits
    (same heads and head_dim)."""
    numel = decode_workspace_numel(max_bs, num_heads, head_dim, num_kv_splits)
    return torch.empty(numel, dtype=torch.float32, device=device)


@triton.jit
def _decode_split_len(seq_len, num_splits, BLOCK_N: tl.constexpr):
    return tl.cdiv(tl.cdiv(seq_len, num_splits), BLOCK_N) * BLOCK_N


@triton.jit
def _first_position(seq_len, shared_len, window):
    """The first context position stage 1 reads: after the shared prefix, and within a
    sliding window (the query sits at seq_len - 1 and sees seq_len - window on)."""
    lo = shared_len
    if window > 0:
        lo = tl.maximum(lo, seq_len - window)
    return lo


@triton.jit
def _block_slots(slot_row, start_n, end, BLOCK_N: tl.constexpr):
    """(mask, pool slots as int64) of context positions start_n .. start_n + BLOCK_N - 1
    (those at or past `end` masked, slot 0)."""
    cur_n = start_n + tl.arange(0, BLOCK_N)
    mask_n = cur_n < end
    return mask_n, tl.load(slot_row + cur_n, mask=mask_n, other=0).to(tl.int64)


@triton.jit
def _attend_range(q, slot_row, kbuf_base, vbuf_base, stride_kbuf_t, stride_vbuf_t, start, end,
                  qk_scale, cap2, m_i, l_i, acc, offs_d, mask_d,
                  BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr, UPCAST: tl.constexpr,
                  SOFTCAP: tl.constexpr):
    """The online softmax of q's rows over context positions start..end-1, whose pool slots are
    slot_row[start:end]; returns the updated (m_i, l_i, acc). K and V tiles are taken in q's
    dtype as stored (an FP8 pool's values are exact in every float dtype): the caller folds an
    FP8 pool's k_scale into qk_scale and multiplies the result by v_scale (_fp8_scales).
    SOFTCAP: the scores are soft-capped (`_capped`, cap2 = the cap times log2(e))."""
    if SOFTCAP:
        step_scale = 1.0
    else:
        step_scale = qk_scale
    for start_n in range(start, end, BLOCK_N):
        mask_n, slots = _block_slots(slot_row, start_n, end, BLOCK_N)
        kv_mask = mask_n[:, None] & mask_d[None, :]
        k = tl.load(kbuf_base + slots[:, None] * stride_kbuf_t + offs_d[None, :], mask=kv_mask,
                    other=0.0).to(q.dtype)
        qk = _dot(q, tl.trans(k), DOT_PRECISION, UPCAST)  # [rows, BLOCK_N], scaled below
        qk = tl.where(mask_n[None, :], _capped(qk, qk_scale, cap2, SOFTCAP), float("-inf"))
        v = tl.load(vbuf_base + slots[:, None] * stride_vbuf_t + offs_d[None, :], mask=kv_mask,
                    other=0.0).to(q.dtype)
        m_i, l_i, acc = _online_softmax_step(qk, v, m_i, l_i, acc, step_scale, DOT_PRECISION,
                                             UPCAST)
    return m_i, l_i, acc


@triton.jit
def _fp8_pair_halves(words, E5M2: tl.constexpr):
    """int16 words that each hold two FP8 values of consecutive channels (the even channel in
    the low byte) as two float16 tiles, (even channels, odd channels), with integer operations
    only: an e5m2 byte is the top byte of a float16 (exact); e4m3's sign, exponent and mantissa
    moved into a float16's fields unchanged give the value times 2^-8 (exact, subnormals too;
    _fp8_scales undoes it)."""
    u = words.to(tl.uint16, bitcast=True).to(tl.uint32)
    if E5M2:
        lo = u << 8
        hi = u & 0xFF00
    else:
        lo = ((u & 0x80) << 8) | ((u & 0x7F) << 7)
        hi = (u & 0x8000) | ((u & 0x7F00) >> 1)
    return (lo.to(tl.uint16).to(tl.float16, bitcast=True),
            hi.to(tl.uint16).to(tl.float16, bitcast=True))


@triton.jit
def _attend_range_pairs(q_lo, q_hi, slot_row, kbuf_base, vbuf_base, stride_kbuf_t,
                        stride_vbuf_t, start, end, qk_scale, cap2, m_i, l_i, acc_lo, acc_hi,
                        offs_p, mask_p, BLOCK_N: tl.constexpr, E5M2: tl.constexpr,
                        DOT_PRECISION: tl.constexpr, UPCAST: tl.constexpr,
                        SOFTCAP: tl.constexpr):
    """_attend_range over an FP8 pool read as int16 words of two channels (kbuf_base,
    vbuf_base and their strides in words; offs_p: word columns): the even and odd channels
    are separate float16 tiles, so q (q_lo, q_hi) and the output (acc_lo, acc_hi) are split
    the same way. Reading words keeps the tiles' shared-memory traffic 16-bit (FP8 tiles are
    read byte by byte); float16 holds e4m3 and e5m2 values exactly."""
    if SOFTCAP:
        step_scale = 1.0
    else:
        step_scale = qk_scale
    for start_n in range(start, end, BLOCK_N):
        mask_n, slots = _block_slots(slot_row, start_n, end, BLOCK_N)
        kv_mask = mask_n[:, None] & mask_p[None, :]
        k_lo, k_hi = _fp8_pair_halves(
            tl.load(kbuf_base + slots[:, None] * stride_kbuf_t + offs_p[None, :], mask=kv_mask,
                    other=0), E5M2)
        qk = _mma(q_hi, tl.trans(k_hi), _dot(q_lo, tl.trans(k_lo), DOT_PRECISION, UPCAST),
                  DOT_PRECISION, UPCAST)
        qk = tl.where(mask_n[None, :], _capped(qk, qk_scale, cap2, SOFTCAP), float("-inf"))
        v_lo, v_hi = _fp8_pair_halves(
            tl.load(vbuf_base + slots[:, None] * stride_vbuf_t + offs_p[None, :], mask=kv_mask,
                    other=0), E5M2)
        # _online_softmax_step with the values in two halves
        m_new = tl.maximum(m_i, tl.max(qk, 1) * step_scale)
        alpha = tl.math.exp2(m_i - m_new)
        p = tl.math.exp2(qk * step_scale - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        p16 = p.to(tl.float16)
        acc_lo = _mma(p16, v_lo, acc_lo * alpha[:, None], DOT_PRECISION, UPCAST)
        acc_hi = _mma(p16, v_hi, acc_hi * alpha[:, None], DOT_PRECISION, UPCAST)
        m_i = m_new
    return m_i, l_i, acc_lo, acc_hi


@triton.jit
def _fp8_scales(qk_scale, k_scale, v_scale, KV_FP8: tl.constexpr, PAIRS: tl.constexpr,
                E5M2: tl.constexpr):
    """(the score scale, the output scale) of the attend loops. An FP8 pool's stored values
    times k_scale / v_scale are the keys / values, so q.(s k) = s (q.k) and sum p (s v) =
    s sum p v: the scales cost one multiply per row instead of one per K/V element; e4m3
    words read as pairs come out 2^-8 small (_fp8_pair_halves), undone here as well."""
    if KV_FP8:
        qk_scale = qk_scale * k_scale
        out_scale = v_scale
        if PAIRS and not E5M2:
            qk_scale = qk_scale * 256.0
            out_scale = out_scale * 256.0
    else:
        out_scale = 1.0
    return qk_scale, out_scale


@triton.jit
def _attend_store(q_rows, mask_rows, slot_row, kbuf_base, vbuf_base, stride_kbuf_t,
                  stride_vbuf_t, start, end, qk_scale, k_scale, v_scale, cap2, o_rows, lse_ptrs,
                  ROWS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                  BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr, UPCAST: tl.constexpr,
                  KV_FP8: tl.constexpr, PAIRS: tl.constexpr, E5M2: tl.constexpr,
                  SOFTCAP: tl.constexpr):
    """Attend ROWS query rows (q_rows: pointers to each row's first channel) over context
    positions start..end-1 and store each row's normalised partial output at o_rows (its first
    channel) and its log2-sum-exp2 at lse_ptrs. PAIRS: an FP8 pool read as int16 words of two
    channels (_attend_range_pairs), the pool's pointers and strides in words."""
    m_i = tl.full([ROWS], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([ROWS], dtype=tl.float32)
    if PAIRS:
        BLOCK_P: tl.constexpr = BLOCK_D // 2
        offs_p = tl.arange(0, BLOCK_P)
        mask_p = offs_p < HEAD_DIM // 2
        q_mask = mask_rows[:, None] & mask_p[None, :]
        q_ptrs = q_rows[:, None] + 2 * offs_p[None, :]
        # float16 queries; bf16 ones beyond float16's range (|q| > 65504) are clamped to it
        q_lo = tl.load(q_ptrs, mask=q_mask, other=0.0).to(tl.float32)
        q_hi = tl.load(q_ptrs + 1, mask=q_mask, other=0.0).to(tl.float32)
        q_lo = tl.minimum(tl.maximum(q_lo, -65504.0), 65504.0).to(tl.float16)
        q_hi = tl.minimum(tl.maximum(q_hi, -65504.0), 65504.0).to(tl.float16)
        qk_scale, out_scale = _fp8_scales(qk_scale, k_scale, v_scale, KV_FP8, PAIRS, E5M2)
        acc_lo = tl.zeros([ROWS, BLOCK_P], dtype=tl.float32)
        acc_hi = tl.zeros([ROWS, BLOCK_P], dtype=tl.float32)
        m_i, l_i, acc_lo, acc_hi = _attend_range_pairs(
            q_lo, q_hi, slot_row, kbuf_base, vbuf_base, stride_kbuf_t, stride_vbuf_t, start,
            end, qk_scale, cap2, m_i, l_i, acc_lo, acc_hi, offs_p, mask_p, BLOCK_N, E5M2,
            DOT_PRECISION, UPCAST, SOFTCAP)
        w = (out_scale / l_i)[:, None]
        o_ptrs = o_rows[:, None] + 2 * offs_p[None, :]
        tl.store(o_ptrs, acc_lo * w, mask=q_mask)
        tl.store(o_ptrs + 1, acc_hi * w, mask=q_mask)
    else:
        offs_d = tl.arange(0, BLOCK_D)
        mask_d = offs_d < HEAD_DIM
        mask = mask_rows[:, None] & mask_d[None, :]
        q = tl.load(q_rows[:, None] + offs_d[None, :], mask=mask, other=0.0)
        qk_scale, out_scale = _fp8_scales(qk_scale, k_scale, v_scale, KV_FP8, PAIRS, E5M2)
        acc = tl.zeros([ROWS, BLOCK_D], dtype=tl.float32)
        m_i, l_i, acc = _attend_range(
            q, slot_row, kbuf_base, vbuf_base, stride_kbuf_t, stride_vbuf_t, start, end,
            qk_scale, cap2, m_i, l_i, acc, offs_d, mask_d, BLOCK_N, DOT_PRECISION, UPCAST,
            SOFTCAP)
        tl.store(o_rows[:, None] + offs_d[None, :], acc * (out_scale / l_i)[:, None],
                 mask=mask)
    tl.store(lse_ptrs, m_i + tl.math.log2(l_i), mask=mask_rows)


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
        BLOCK_H, HEAD_DIM, BLOCK_D, BLOCK_N, DOT_PRECISION, UPCAST, KV_FP8, PAIRS, E5M2, SOFTCAP)


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
        BLOCK_M, HEAD_DIM, BLOCK_D, BLOCK_N, DOT_PRECISION, UPCAST, KV_FP8, PAIRS, E5M2, SOFTCAP)


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
    offs_s = tl.arange(0, BLOCK_S)
    valid = (offs_s < num_splits) & (offs_s * split_len < own_len)
    # the shared stage's splits follow stage 1's (none when shared_splits == 0)
    shared_split_len = _decode_split_len(shared_len, tl.maximum(shared_splits, 1), BLOCK_N)
    j = offs_s - num_splits
    valid = valid | ((j >= 0) & (j < shared_splits) & (j * shared_split_len < shared_len))
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < HEAD_DIM

    base = (cur_batch.to(tl.int64) * num_heads + cur_head) * total_splits + offs_s  # [BLOCK_S]
    lse = tl.load(Mid_Lse + base, mask=valid, other=float("-inf"))
    m = tl.max(lse, 0)
    w = tl.where(valid, tl.math.exp2(lse - m), 0.0)
    parts = tl.load(Mid_O + base[:, None] * HEAD_DIM + offs_d[None, :],
                    mask=valid[:, None] & mask_d[None, :], other=0.0)
    total = tl.sum(w, 0)
    out = tl.sum(w[:, None] * parts, 0) / tl.where(total > 0, total, 1.0)
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
    c * tanh(s / c).
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

    block_n = block_n or DECODE_BLOCK_N
    block_d = triton.next_power_of_2(head_dim)
    stages = decode_num_stages(head_dim, block_n, k_buffer.element_size(),
                               device_shared_memory(q.device))
    pairs = fp8_pairs(q.dtype, k_buffer.dtype, head_dim)
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
        BLOCK_S=triton.next_power_of_2(total_splits),
        BLOCK_N=block_n,
        num_warps=4,
        num_stages=1,
    )


__all__ = [
    "choose_num_kv_splits",
    "choose_shared_splits",
    "decode_attention_fwd",
    "decode_num_stages",
    "decode_workspace",
    "decode_workspace_numel",
    "device_num_sms",
    "fp8_pairs",
]
