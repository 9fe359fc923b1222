"""The Triton device functions of the DECODE attention kernels
(srt/layers/attention/triton_ops/decode_attention.py): split bounds, one split's online softmax
over a range of context positions (half-precision or an FP8 pool read as words of two
channels), and the store of its partial result."""

from __future__ import annotations

import triton
import triton.language as tl

from srt.layers.attention.triton_ops.prefill_attention import (
    _capped,
    _dot,
    _mma,
    _online_softmax_step,
)


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
def _attend_range_latent(q_v, q_r, slot_row, kbuf_base, stride_kbuf_t, start, end, qk_scale,
                         cap2, m_i, l_i, acc, offs_v, offs_r, BLOCK_N: tl.constexpr,
                         DOT_PRECISION: tl.constexpr, UPCAST: tl.constexpr,
                         SOFTCAP: tl.constexpr):
    """`_attend_range` for multi-head latent attention: the values are the keys' first V_DIM
    channels, so one key tile, read as its V_DIM part (offs_v) and the rest (offs_r: the
    rotary part), serves the scores and the values; q_v / q_r the query's parts."""
    if SOFTCAP:
        step_scale = 1.0
    else:
        step_scale = qk_scale
    for start_n in range(start, end, BLOCK_N):
        mask_n, slots = _block_slots(slot_row, start_n, end, BLOCK_N)
        rows = kbuf_base + slots[:, None] * stride_kbuf_t
        kv = tl.load(rows + offs_v[None, :], mask=mask_n[:, None], other=0.0).to(q_v.dtype)
        k_r = tl.load(rows + offs_r[None, :], mask=mask_n[:, None], other=0.0).to(q_v.dtype)
        qk = _dot(q_v, tl.trans(kv), DOT_PRECISION, UPCAST) + \
            _dot(q_r, tl.trans(k_r), DOT_PRECISION, UPCAST)
        qk = tl.where(mask_n[None, :], _capped(qk, qk_scale, cap2, SOFTCAP), float("-inf"))
        m_i, l_i, acc = _online_softmax_step(qk, kv, m_i, l_i, acc, step_scale, DOT_PRECISION,
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
                  SOFTCAP: tl.constexpr, V_DIM: tl.constexpr):
    """Attend ROWS query rows (q_rows: pointers to each row's first channel) over context
    positions start..end-1 and store each row's normalised partial output at o_rows (its first
    channel) and its log2-sum-exp2 at lse_ptrs. PAIRS: an FP8 pool read as int16 words of two
    channels (_attend_range_pairs), the pool's pointers and strides in words. V_DIM below
    HEAD_DIM: the values are the keys' first V_DIM channels (latent attention,
    _attend_range_latent; vbuf_base unused) and the output's other channels are zero."""
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
    elif V_DIM < HEAD_DIM:
        R_DIM: tl.constexpr = HEAD_DIM - V_DIM
        offs_v = tl.arange(0, V_DIM)
        offs_r = V_DIM + tl.arange(0, R_DIM)
        q_v = tl.load(q_rows[:, None] + offs_v[None, :], mask=mask_rows[:, None], other=0.0)
        q_r = tl.load(q_rows[:, None] + offs_r[None, :], mask=mask_rows[:, None], other=0.0)
        qk_scale, out_scale = _fp8_scales(qk_scale, k_scale, v_scale, KV_FP8, PAIRS, E5M2)
        acc = tl.zeros([ROWS, V_DIM], dtype=tl.float32)
        m_i, l_i, acc = _attend_range_latent(
            q_v, q_r, slot_row, kbuf_base, stride_kbuf_t, start, end, qk_scale, cap2, m_i,
            l_i, acc, offs_v, offs_r, BLOCK_N, DOT_PRECISION, UPCAST, SOFTCAP)
        tl.store(o_rows[:, None] + offs_v[None, :], acc * (out_scale / l_i)[:, None],
                 mask=mask_rows[:, None])
        tl.store(o_rows[:, None] + offs_r[None, :], tl.zeros([ROWS, R_DIM], dtype=tl.float32),
                 mask=mask_rows[:, None])
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
