"""Triton kernels for AWQ int4 weights (layout: srt/layers/awq.py).

- `awq_gemm`: x [M, K] @ w [K, N] without writing w out: each program loads a tile of packed
  words [BLOCK_K, BLOCK_N / 8] once, spreads their nibbles into a [BLOCK_K, BLOCK_N] tile of
  small integers (columns in the words' own order, put right at the store), multiplies x by it
  on the tensor cores (exact: integers up to 15), and applies the group's zero points and
  scales to the product: sum_k x (q - z) s = s (x @ q - z sum_k x), one group per K tile.
  Few rows (decode) are memory-bound: the reduction over K is split across SPLIT_K programs
  (float32 atomic adds) so that enough programs stream the weight at once.
- `awq_dequantize`: the whole weight [K, N] in x's dtype, for large M (prefill), where one
  dequantization plus a cuBLAS GEMM beats dequantizing the same tiles once per row block.

`awq_matmul` picks between them. Both run in Triton's interpreter on the CPU (tests).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from srt.layers.awq import PACK

# Rows from which one dequantization + cuBLAS is used instead of the fused kernel.
DEQUANT_MIN_ROWS = 256


@triton.jit
def _expand(words, DTYPE: tl.constexpr):
    """int32 words [R, W] -> their 4-bit values [R, 8 W] in DTYPE, nibble i of word w in
    column 8 w + i (AutoAWQ's column 8 w + AWQ_ORDER[i]: see _true_columns). Half
    precision takes the values through the bits of 1024 + v (fp16) or 128 + v (bf16) rather
    than an integer-to-float conversion, which runs at a quarter of the integer rate."""
    shifts = tl.arange(0, 8) * 4
    v = (words[:, :, None] >> shifts[None, None, :]) & 0xF
    v = tl.reshape(v, (words.shape[0], words.shape[1] * 8))
    if DTYPE == tl.float16:
        return (v | 0x6400).to(tl.int16).to(tl.float16, bitcast=True) - 1024.0
    elif DTYPE == tl.bfloat16:
        return ((v | 0x4300).to(tl.int16).to(tl.bfloat16, bitcast=True) - 128.0).to(DTYPE)
    else:
        return v.to(DTYPE)


@triton.jit
def _true_columns(first_word, BLOCK_N: tl.constexpr):
    """The output columns of _expand's columns for words first_word.. (AutoAWQ's order
    [0, 2, 4, 6, 1, 3, 5, 7] inside each word)."""
    c = tl.arange(0, BLOCK_N)
    i = c % 8
    return first_word * 8 + (c // 8) * 8 + (i % 4) * 2 + i // 4


@triton.jit
def _awq_gemm_kernel(x_ptr, qw_ptr, qz_ptr, s_ptr, out_ptr, M, N, K,
                     stride_xm, stride_qw, stride_qz, stride_s, stride_om,
                     GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                     BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr, GROUP_M: tl.constexpr,
                     PRECISION: tl.constexpr):
    pid = tl.program_id(0)
    pid_k = tl.program_id(1)
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    # row blocks grouped so that neighbouring programs share weight tiles in L2
    in_group = GROUP_M * num_n
    first_m = (pid // in_group) * GROUP_M
    size_m = tl.minimum(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % in_group) % size_m
    pid_n = (pid % in_group) // size_m

    BLOCK_W: tl.constexpr = BLOCK_N // 8
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_w = pid_n * BLOCK_W + tl.arange(0, BLOCK_W)  # packed words along N
    cols = _true_columns(pid_n * BLOCK_W, BLOCK_N)  # acc's columns in the output
    offs_k = tl.arange(0, BLOCK_K)
    mask_m = offs_m < M
    mask_w = offs_w < N // 8
    mask_n = cols < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(pid_k * BLOCK_K, K, BLOCK_K * SPLIT_K):
        ks = k0 + offs_k
        x = tl.load(x_ptr + offs_m[:, None].to(tl.int64) * stride_xm + ks[None, :],
                    mask=mask_m[:, None] & (ks < K)[None, :], other=0.0)
        words = tl.load(qw_ptr + ks[:, None].to(tl.int64) * stride_qw + offs_w[None, :],
                        mask=(ks < K)[:, None] & mask_w[None, :], other=0)
        # one group per tile (BLOCK_K divides GROUP): sum_k x (q - z) s
        #   = s * (x @ q - z * sum_k x), with x @ q exact on the tensor cores
        g = k0 // GROUP
        zw = tl.load(qz_ptr + g * stride_qz + offs_w, mask=mask_w, other=0)
        zeros = tl.reshape(_expand(zw[None, :], tl.float32), (BLOCK_N,))
        scales = tl.load(s_ptr + g * stride_s + cols, mask=mask_n, other=0.0).to(tl.float32)
        xq = tl.dot(x, _expand(words, x.dtype), input_precision=PRECISION)
        xsum = tl.sum(x.to(tl.float32), 1)
        acc += (xq - xsum[:, None] * zeros[None, :]) * scales[None, :]
    out = out_ptr + offs_m[:, None].to(tl.int64) * stride_om + cols[None, :]
    mask = mask_m[:, None] & mask_n[None, :]
    if SPLIT_K == 1:
        tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=mask)
    else:
        tl.atomic_add(out, acc, mask=mask)


@triton.jit
def _awq_dequant_kernel(qw_ptr, qz_ptr, s_ptr, w_ptr, N, K, stride_qw, stride_qz, stride_s,
                        stride_w, GROUP: tl.constexpr, BLOCK_K: tl.constexpr,
                        BLOCK_N: tl.constexpr):
    BLOCK_W: tl.constexpr = BLOCK_N // 8
    offs_k = tl.program_id(0) * BLOCK_K + tl.arange(0, BLOCK_K)
    offs_w = tl.program_id(1) * BLOCK_W + tl.arange(0, BLOCK_W)
    cols = _true_columns(tl.program_id(1) * BLOCK_W, BLOCK_N)
    mask_w = (offs_k < K)[:, None] & (offs_w < N // 8)[None, :]
    mask = (offs_k < K)[:, None] & (cols < N)[None, :]
    words = tl.load(qw_ptr + offs_k[:, None].to(tl.int64) * stride_qw + offs_w[None, :],
                    mask=mask_w, other=0)
    g = offs_k // GROUP
    zw = tl.load(qz_ptr + g[:, None] * stride_qz + offs_w[None, :], mask=mask_w, other=0)
    scales = tl.load(s_ptr + g[:, None] * stride_s + cols[None, :], mask=mask, other=0.0)
    w = ((_expand(words, tl.float32) - _expand(zw, tl.float32)) * scales.to(tl.float32))
    tl.store(w_ptr + offs_k[:, None].to(tl.int64) * stride_w + cols[None, :],
             w.to(w_ptr.dtype.element_ty), mask=mask)


def _check(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor) -> tuple[int, int,
                                                                                     int]:
    k, n = qweight.shape[0], scales.shape[1]
    groups = scales.shape[0]
    if (qweight.dtype != torch.int32 or qzeros.dtype != torch.int32 or qweight.shape[1] * PACK != n
            or qzeros.shape != (groups, n // PACK) or k % groups):
        raise ValueError(f"AWQ tensors do not match: qweight {tuple(qweight.shape)} "
                         f"{qweight.dtype}, qzeros {tuple(qzeros.shape)}, scales "
                         f"{tuple(scales.shape)}")
    for t in (qweight, qzeros, scales):
        if t.stride(1) != 1:
            raise ValueError("AWQ tensors need contiguous rows")
    return k, n, k // groups


def awq_dequantize(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor,
                   dtype: torch.dtype) -> torch.Tensor:
    """The weight [K, N] in `dtype` (the transpose of srt.layers.awq.dequantize_awq's)."""
    k, n, group = _check(qweight, qzeros, scales)
    w = torch.empty((k, n), dtype=dtype, device=qweight.device)
    block_k, block_n = 32, 128
    _awq_dequant_kernel[(triton.cdiv(k, block_k), triton.cdiv(n, block_n))](
        qweight, qzeros, scales, w, n, k, qweight.stride(0), qzeros.stride(0), scales.stride(0),
        w.stride(0), GROUP=group, BLOCK_K=block_k, BLOCK_N=block_n, num_warps=4)
    return w


def gemm_config(m: int, n: int, k: int, group: int, num_sms: int) -> dict[str, int]:
    """Tile sizes and split of the fused kernel for an [m, k] x [k, n] product."""
    if m <= 16:
        block_m, block_n, block_k, warps = 16, 64, min(group, 128), 4
    elif m <= 64:
        block_m, block_n, block_k, warps = 32 if m <= 32 else 64, 128, min(group, 64), 4
    else:
        block_m, block_n, block_k, warps = 64, 128, min(group, 64), 8
    tiles = triton.cdiv(m, block_m) * triton.cdiv(n, block_n)
    k_tiles = triton.cdiv(k, block_k)
    split = 1
    # fill the GPU about twice over, never with fewer than four K tiles per program
    while tiles * split * 2 <= 2 * num_sms and k_tiles // (split * 2) >= 4 and split < 16:
        split *= 2
    return dict(BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, SPLIT_K=split,
                num_warps=warps)


_NUM_SMS: dict[int, int] = {}


def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 132
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _NUM_SMS:
        _NUM_SMS[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return _NUM_SMS[index]


def awq_gemm(x: torch.Tensor, qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor,
             config: dict[str, int] | None = None) -> torch.Tensor:
    """x [M, K] @ w [K, N] -> [M, N] in x's dtype, w dequantized on the fly."""
    k, n, group = _check(qweight, qzeros, scales)
    m = x.shape[0]
    if x.shape[1] != k or x.stride(1) != 1:
        raise ValueError(f"x {tuple(x.shape)} against an AWQ weight of {k} input features")
    cfg = dict(config or gemm_config(m, n, k, group, _num_sms(x.device)))
    if group % cfg["BLOCK_K"]:
        raise ValueError(f"BLOCK_K {cfg['BLOCK_K']} must divide the group size {group}")
    split = cfg.pop("SPLIT_K")
    warps = cfg.pop("num_warps", 4)
    out = (torch.zeros((m, n), dtype=torch.float32, device=x.device) if split > 1
           else torch.empty((m, n), dtype=x.dtype, device=x.device))
    if m == 0:
        return out.to(x.dtype)
    grid = (triton.cdiv(m, cfg["BLOCK_M"]) * triton.cdiv(n, cfg["BLOCK_N"]), split)
    _awq_gemm_kernel[grid](
        x, qweight, qzeros, scales, out, m, n, k, x.stride(0), qweight.stride(0),
        qzeros.stride(0), scales.stride(0), out.stride(0), GROUP=group, SPLIT_K=split,
        GROUP_M=8, PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        num_warps=warps, num_stages=3 if x.is_cuda else 1, **cfg)
    return out.to(x.dtype) if split > 1 else out


def awq_matmul(x: torch.Tensor, qweight: torch.Tensor, qzeros: torch.Tensor,
               scales: torch.Tensor) -> torch.Tensor:
    """x [..., K] @ w [K, N]: the fused kernel for few rows, dequantize + GEMM for many."""
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    if x2.stride(1) != 1:
        x2 = x2.contiguous()
    if x2.shape[0] >= DEQUANT_MIN_ROWS:
        out = x2 @ awq_dequantize(qweight, qzeros, scales, x.dtype)
    else:
        out = awq_gemm(x2, qweight, qzeros, scales)
    return out.reshape(*shape[:-1], out.shape[-1])
