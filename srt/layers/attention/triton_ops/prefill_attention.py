"""Causal attention over a batch of variable-length prompts with no cached prefix (PREFILL).

q, k and v are this step's tokens, packed: request i owns rows
`b_start_loc[i] : b_start_loc[i] + b_seq_len[i]`. One program computes a block of BLOCK_M queries
of one head with a flash-attention style online softmax (base 2, fp32 accumulators). The key loop
is split in two: the blocks strictly before the query block need no mask at all, only the blocks on
the diagonal are masked (causal and length).

Also home of the helpers the extend kernel shares (`_online_softmax_step`, `dot_precision`, ...).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

LOG2E = 1.4426950408889634

# Tile sizes and launch shape for H100/H200 class GPUs (BLOCK_M must be a multiple of BLOCK_N).
# fp16/bf16: 128x128 tiles, 8 warps, 3 stages: on one H200 (8,192-token prompt, 32/8 heads, d 128,
# bf16; benchmarks/bench_long_attention.py --sweep) 414 TFLOP/s against 282 for 128x64 at 2
# stages. fp32 runs its dots as 3xTF32 and needs smaller tiles to stay within registers and
# shared memory; so does a head_dim above 128 (three stages of 128x256 K and V tiles would not
# fit in shared memory).
PREFILL_BLOCKS = {"half": (128, 128), "fp32": (64, 32), "wide": (64, 64)}
PREFILL_NUM_WARPS = 8
PREFILL_NUM_STAGES = 3


def default_blocks(dtype: torch.dtype, head_dim: int = 128) -> tuple[int, int]:
    """(BLOCK_M, BLOCK_N) of the prefill / extend kernels for `dtype` and `head_dim`. Heads
    wider than 256 (multi-head latent attention's 576, padded to 1024) take 32 x 16 tiles:
    larger ones do not fit in shared memory."""
    if head_dim > 256:
        return (32, 16)
    if dtype == torch.float32:
        return PREFILL_BLOCKS["fp32"]
    return PREFILL_BLOCKS["half" if head_dim <= 128 else "wide"]


def pipeline_stages(dtype: torch.dtype, head_dim: int, stages: int) -> int:
    """`stages` for the tuned case (fp16/bf16, head_dim <= 128), else 2: larger tiles per key
    block leave shared memory for two stages only."""
    return stages if dtype != torch.float32 and head_dim <= 128 else 2


def dot_precision(dtype: torch.dtype) -> str:
    """fp32 inputs: 3xTF32 (fp32-grade products on the tensor cores; plain tl.dot would use
    TF32 and lose ~3 digits). fp16/bf16: the tensor cores' native path."""
    return "tf32x3" if dtype == torch.float32 else "tf32"


def interpret_upcast(dtype: torch.dtype) -> bool:
    """True when running under TRITON_INTERPRET with bf16 inputs: the interpreter's tl.dot
    multiplies the raw uint16 storage of bf16 (triton 3.9), so the kernels upcast the operands to
    fp32 there (after the same bf16 rounding of p). Always False on a GPU."""
    return dtype == torch.bfloat16 and os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def check_heads(q: torch.Tensor, k: torch.Tensor) -> int:
    """Validate [*, H, D] against [*, Hkv, D]; returns the GQA group size H // Hkv."""
    if q.dim() != 3 or k.dim() != 3:
        raise ValueError(f"expected [tokens, heads, head_dim] tensors, got {q.shape} / {k.shape}")
    heads, kv_heads = q.shape[1], k.shape[1]
    if q.shape[2] != k.shape[2]:
        raise ValueError(f"head_dim mismatch: q {q.shape[2]} vs k/v {k.shape[2]}")
    if kv_heads == 0 or heads % kv_heads:
        raise ValueError(f"kv heads ({kv_heads}) must divide query heads ({heads})")
    return heads // kv_heads


def check_layout(*tensors: torch.Tensor) -> None:
    for t in tensors:
        if t.dtype != tensors[0].dtype:
            raise ValueError(f"dtype mismatch: {t.dtype} vs {tensors[0].dtype}")
        if t.stride(-1) != 1:
            raise ValueError("the head_dim axis must be contiguous (stride 1)")


@triton.jit
def _tile(ptrs, rows_ok, offs_d, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
          ROWS_MASKED: tl.constexpr):
    """Load a [rows, BLOCK_D] tile; masks only what can be out of range (rows when ROWS_MASKED,
    the head_dim padding when BLOCK_D > HEAD_DIM), so full tiles load unmasked and vectorized."""
    if BLOCK_D == HEAD_DIM:
        if ROWS_MASKED:
            return tl.load(ptrs, mask=rows_ok[:, None], other=0.0)
        else:
            return tl.load(ptrs)
    else:
        if ROWS_MASKED:
            return tl.load(ptrs, mask=rows_ok[:, None] & (offs_d < HEAD_DIM)[None, :], other=0.0)
        else:
            return tl.load(ptrs, mask=(offs_d < HEAD_DIM)[None, :], other=0.0)


@triton.jit
def _dequant(x, scale, dtype: tl.constexpr, KV_FP8: tl.constexpr):
    """A tile read from the KV pool in the compute dtype: stored * scale when the pool holds
    FP8 (srt/layers/kv_cache_dtype.py), else as it is."""
    if KV_FP8:
        return (x.to(tl.float32) * scale).to(dtype)
    else:
        return x


def check_pool(q: torch.Tensor, k_buffer: torch.Tensor, v_buffer: torch.Tensor) -> bool:
    """The pool's buffers against the queries: the same dtype, or both FP8 (then returns
    True: the kernels dequantize what they read)."""
    check_layout(k_buffer, v_buffer)
    if k_buffer.dtype == q.dtype:
        return False
    if k_buffer.dtype not in (torch.float8_e4m3fn, torch.float8_e5m2):
        raise ValueError(f"dtype mismatch: pool {k_buffer.dtype} vs queries {q.dtype}")
    return True


@triton.jit
def _dot(a, b, DOT_PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    """a @ b in fp32. UPCAST only under the interpreter (see interpret_upcast)."""
    if UPCAST:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        return tl.dot(a, b, input_precision=DOT_PRECISION)


@triton.jit
def _mma(a, b, acc, DOT_PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    """acc + a @ b, acc fp32. UPCAST only under the interpreter (see interpret_upcast)."""
    if UPCAST:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    else:
        return tl.dot(a, b, acc, input_precision=DOT_PRECISION)


@triton.jit
def _online_softmax_step(qk, v, m_i, l_i, acc, qk_scale, DOT_PRECISION: tl.constexpr,
                         UPCAST: tl.constexpr):
    """One key block of the online softmax. qk: [M, N] fp32 raw scores q.k, masked with -inf;
    qk_scale: sm_scale * log2(e) > 0; v: [N, D]; m_i, l_i: [M] running max / sum of the scaled
    (base 2) scores; acc: [M, D] fp32. The scale is applied inside the exponent (one fused
    multiply-add per score) and to the row maxima, not as a separate pass over the tile."""
    m_new = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
    alpha = tl.math.exp2(m_i - m_new)
    p = tl.math.exp2(qk * qk_scale - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None]
    acc = _mma(p.to(v.dtype), v, acc, DOT_PRECISION, UPCAST)
    return m_new, l_i, acc


@triton.jit
def _capped(qk, qk_scale, cap2, SOFTCAP: tl.constexpr):
    """Raw scores q.k as the online softmax takes them: unchanged, or with SOFTCAP soft-capped
    and already scaled (the step then takes a scale of 1): c * tanh(s / c) for the scaled
    score s, in base-2 units (cap2 = c * log2(e)). Apply before any -inf mask."""
    if SOFTCAP:
        x = qk * (qk_scale / cap2)
        return cap2 * (2.0 * tl.sigmoid(2.0 * x) - 1.0)  # cap2 * tanh(x)
    else:
        return qk


@triton.jit
def _online_softmax_step_masked(qk, v, m_i, l_i, acc, qk_scale, DOT_PRECISION: tl.constexpr,
                                UPCAST: tl.constexpr):
    """_online_softmax_step for tiles where a row may see no key yet (sliding windows): a row
    whose scores so far are all -inf keeps l_i = 0 and acc = 0 instead of NaN."""
    m_new = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.math.exp2(m_i - m_use)
    p = tl.math.exp2(qk * qk_scale - m_use[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None]
    acc = _mma(p.to(v.dtype), v, acc, DOT_PRECISION, UPCAST)
    return m_new, l_i, acc


@triton.jit
def _prefill_fwd_kernel(
    Q, K, V, O,
    B_Start_Loc, B_Seq_Len,
    Blocks,  # TABLE: the query blocks, request << 16 | block index, -1 past the last
    qk_scale,  # sm_scale * log2(e)
    stride_qt, stride_qh,
    stride_kt, stride_kh,
    stride_vt, stride_vh,
    stride_ot, stride_oh,
    KV_GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
    TABLE: tl.constexpr,
):
    # grid (heads, bs, query blocks): the heads of one KV group run side by side (K/V reuse in
    # L2), and the last, most expensive query blocks of the causal triangle are launched first.
    # TABLE: grid (heads, table entries), each entry naming its request and query block (a
    # grid fixed by the table's size, as a CUDA graph needs).
    cur_head = tl.program_id(0)
    if TABLE:
        entry = tl.load(Blocks + tl.program_id(1))
        if entry < 0:
            return
        cur_batch = entry >> 16
        start_m = (entry & 0xFFFF) * BLOCK_M
    else:
        cur_batch = tl.program_id(1)
        start_m = (tl.num_programs(2) - 1 - tl.program_id(2)) * BLOCK_M
    cur_kv_head = cur_head // KV_GROUP

    seq_len = tl.load(B_Seq_Len + cur_batch).to(tl.int32)
    if start_m >= seq_len:
        return
    tok0 = tl.load(B_Start_Loc + cur_batch).to(tl.int64)

    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    mask_m = offs_m < seq_len

    q_ptrs = Q + (tok0 + offs_m)[:, None] * stride_qt + cur_head * stride_qh + offs_d[None, :]
    q = _tile(q_ptrs, mask_m, offs_d, HEAD_DIM, BLOCK_D, True)
    k_base = K + tok0 * stride_kt + cur_kv_head * stride_kh
    v_base = V + tok0 * stride_vt + cur_kv_head * stride_vh

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)

    # Keys before the query block: every key is valid (< start_m < seq_len) and visible to every
    # query of the block, so nothing is masked but the head_dim padding.
    for start_n in range(0, start_m, BLOCK_N):
        cur_n = start_n + offs_n
        k = _tile(k_base + cur_n[:, None] * stride_kt + offs_d[None, :], cur_n, offs_d,
                  HEAD_DIM, BLOCK_D, False)
        qk = _dot(q, tl.trans(k), DOT_PRECISION, UPCAST)
        v = _tile(v_base + cur_n[:, None] * stride_vt + offs_d[None, :], cur_n, offs_d,
                  HEAD_DIM, BLOCK_D, False)
        m_i, l_i, acc = _online_softmax_step(qk, v, m_i, l_i, acc, qk_scale, DOT_PRECISION,
                                             UPCAST)

    # The diagonal: causal and length masks.
    end_n = tl.minimum(start_m + BLOCK_M, seq_len)
    for start_n in range(start_m, end_n, BLOCK_N):
        cur_n = start_n + offs_n
        mask_n = cur_n < end_n
        k = _tile(k_base + cur_n[:, None] * stride_kt + offs_d[None, :], mask_n, offs_d,
                  HEAD_DIM, BLOCK_D, True)
        qk = _dot(q, tl.trans(k), DOT_PRECISION, UPCAST)
        visible = (offs_m[:, None] >= cur_n[None, :]) & mask_n[None, :]
        qk = tl.where(visible, qk, float("-inf"))
        v = _tile(v_base + cur_n[:, None] * stride_vt + offs_d[None, :], mask_n, offs_d,
                  HEAD_DIM, BLOCK_D, True)
        m_i, l_i, acc = _online_softmax_step(qk, v, m_i, l_i, acc, qk_scale, DOT_PRECISION,
                                             UPCAST)

    acc = acc / l_i[:, None]
    o_ptrs = O + (tok0 + offs_m)[:, None] * stride_ot + cur_head * stride_oh + offs_d[None, :]
    if BLOCK_D == HEAD_DIM:
        tl.store(o_ptrs, acc.to(O.dtype.element_ty), mask=mask_m[:, None])
    else:
        tl.store(o_ptrs, acc.to(O.dtype.element_ty),
                 mask=mask_m[:, None] & (offs_d < HEAD_DIM)[None, :])


def context_attention_fwd(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    o: torch.Tensor,
    b_start_loc: torch.Tensor,
    b_seq_len: torch.Tensor,
    max_input_len: int,
    sm_scale: float,
    *,
    block_m: int | None = None,
    block_n: int | None = None,
    block_tables: "BlockTables | None" = None,
) -> None:
    """Causal attention of packed prompts, written into `o`.

    q, o: [T, H, D]; k, v: [T, Hkv, D] (Hkv divides H; any row/head strides, head_dim
    contiguous). b_start_loc, b_seq_len: [bs] int32/int64 device tensors; max_input_len: a host
    int >= max(b_seq_len). Rows of `o` not covered by any request are left untouched.
    `block_tables`: the programs come from its table of this call's BLOCK_M (`BlockTables`)
    rather than from max_input_len: a launch whose grid the host never changes (CUDA graphs).
    """
    group = check_heads(q, k)
    check_layout(q, k, v, o)
    if k.shape != v.shape or o.shape != q.shape:
        raise ValueError("k/v or q/o shape mismatch")
    bs = b_seq_len.shape[0]
    heads, head_dim = q.shape[1], q.shape[2]
    if bs == 0 or max_input_len <= 0:
        return
    default_m, default_n = default_blocks(q.dtype, head_dim)
    block_m = block_m or default_m
    block_n = block_n or default_n
    if block_m % block_n:
        raise ValueError("block_m must be a multiple of block_n")
    table = None if block_tables is None else block_tables.table(block_m)
    grid = ((heads, bs, triton.cdiv(max_input_len, block_m)) if table is None
            else (heads, table.shape[0], 1))
    _prefill_fwd_kernel[grid](
        q, k, v, o,
        b_start_loc, b_seq_len, table if table is not None else b_seq_len,
        sm_scale * LOG2E,
        q.stride(0), q.stride(1),
        k.stride(0), k.stride(1),
        v.stride(0), v.stride(1),
        o.stride(0), o.stride(1),
        KV_GROUP=group,
        HEAD_DIM=head_dim,
        BLOCK_D=triton.next_power_of_2(head_dim),
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        DOT_PRECISION=dot_precision(q.dtype),
        UPCAST=interpret_upcast(q.dtype),
        TABLE=table is not None,
        num_warps=PREFILL_NUM_WARPS,
        num_stages=pipeline_stages(q.dtype, head_dim, PREFILL_NUM_STAGES),
    )


class BlockTables:
    """The query blocks of one batch of prompts, for grids the host never changes.

    A table of BLOCK_M rows per block lists every (request, query block) of the batch as
    `request << 16 | block`, the blocks at the end of long prompts (the most keys) first, then
    -1 up to its fixed size `ceil(max_tokens / BLOCK_M) + max_requests` (each request adds at
    most one partial block). Tables live on the device at fixed addresses: `table(block_m)`
    makes one the first time a kernel asks for that block size (before a graph is captured),
    `fill(seq_lens)` rewrites every table for a new batch."""

    def __init__(self, max_tokens: int, max_requests: int, device: torch.device) -> None:
        if max_tokens >= (1 << 16) * 16 or max_requests >= 1 << 15:
            raise ValueError("a block table holds fewer than 2^15 requests of 2^20 tokens")
        self.max_tokens, self.max_requests, self.device = max_tokens, max_requests, device
        self.tables: dict[int, torch.Tensor] = {}
        self.seq_lens: list[int] = []

    def size(self, block_m: int) -> int:
        return -(-self.max_tokens // block_m) + self.max_requests

    def table(self, block_m: int) -> torch.Tensor:
        if block_m not in self.tables:
            t = torch.tensor(self.entries(self.seq_lens, block_m), dtype=torch.int32)
            self.tables[block_m] = t.to(self.device)
        return self.tables[block_m]

    def entries(self, seq_lens: list[int], block_m: int) -> list[int]:
        """The table of `seq_lens` (request i has seq_lens[i] rows) for `block_m`-row blocks."""
        if sum(seq_lens) > self.max_tokens or len(seq_lens) > self.max_requests:
            raise ValueError(f"{len(seq_lens)} prompts of {sum(seq_lens)} tokens exceed the "
                             f"table's {self.max_requests} of {self.max_tokens}")
        blocks = [(b, i) for i, n in enumerate(seq_lens) for b in range(-(-n // block_m))]
        blocks.sort(key=lambda bi: -bi[0])
        out = [i << 16 | b for b, i in blocks]
        return out + [-1] * (self.size(block_m) - len(out))

    def fill(self, seq_lens: list[int]) -> None:
        """Every table made so far rewritten for `seq_lens` (one host-to-device copy each)."""
        self.seq_lens = list(seq_lens)
        for block_m, t in self.tables.items():
            t.copy_(torch.tensor(self.entries(self.seq_lens, block_m), dtype=torch.int32),
                    non_blocking=True)


__all__ = ["BlockTables", "context_attention_fwd"]
