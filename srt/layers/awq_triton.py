"""Triton kernels for AWQ int4 weights (layout: srt/layers/awq.py).

- `awq_gemm`: x [M, K] @ w [K, N] with w dequantized tile by tile in registers (never written
  out): each program loads a [BLOCK_K, BLOCK_N] tile of packed int32 (each word holds eight
  neighbouring columns), the group's zero points and scales, computes (q - z) * s in float32,
  rounds to x's dtype and feeds the tensor cores. Few rows (decode) are memory-bound: the
  reduction over K is split across SPLIT_K programs (float32 atomic adds) so that enough
  programs stream the weight at once.
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
def _unpack(words, offs_n):
    """The 4-bit values of columns offs_n from their int32 words (AutoAWQ's order: column
    8j + c at bit 4 * (c // 2 + 4 * (c % 2)))."""
    c = offs_n % 8
    shifts = (c // 2 + (c % 2) * 4) * 4
    return (words >> shifts) & 0xF


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

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    mask_m = offs_m < M
    mask_n = offs_n < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(pid_k * BLOCK_K, K, BLOCK_K * SPLIT_K):
        ks = k0 + offs_k
        x = tl.load(x_ptr + offs_m[:, None].to(tl.int64) * stride_xm + ks[None, :],
                    mask=mask_m[:, None] & (ks < K)[None, :], other=0.0)
        words = tl.load(qw_ptr + ks[:, None].to(tl.int64) * stride_qw + (offs_n // 8)[None, :],
                        mask=(ks < K)[:, None] & mask_n[None, :], other=0)
        g = k0 // GROUP  # BLOCK_K divides GROUP: one group per tile
        zeros = _unpack(tl.load(qz_ptr + g * stride_qz + offs_n // 8, mask=mask_n, other=0),
                        offs_n)
        scales = tl.load(s_ptr + g * stride_s + offs_n, mask=mask_n, other=0.0).to(tl.float32)
        w = ((_unpack(words, offs_n[None, :]) - zeros[None, :]).to(tl.float32)
             * scales[None, :]).to(x.dtype)
        acc = tl.dot(x, w, acc, input_precision=PRECISION)
    out = out_ptr + offs_m[:, None].to(tl.int64) * stride_om + offs_n[None, :]
    mask = mask_m[:, None] & mask_n[None, :]
    if SPLIT_K == 1:
        tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=mask)
    else:
        tl.atomic_add(out, acc, mask=mask)


@triton.jit
def _awq_dequant_kernel(qw_ptr, qz_ptr, s_ptr, w_ptr, N, K, stride_qw, stride_qz, stride_s,
                        stride_w, GROUP: tl.constexpr, BLOCK_K: tl.constexpr,
                        BLOCK_N: tl.constexpr):
    offs_k = tl.program_id(0) * BLOCK_K + tl.arange(0, BLOCK_K)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (offs_k < K)[:, None] & (offs_n < N)[None, :]
    words = tl.load(qw_ptr + offs_k[:, None].to(tl.int64) * stride_qw + (offs_n // 8)[None, :],
                    mask=mask, other=0)
    g = offs_k // GROUP
    zeros = tl.load(qz_ptr + g[:, None] * stride_qz + (offs_n // 8)[None, :], mask=mask, other=0)
    scales = tl.load(s_ptr + g[:, None] * stride_s + offs_n[None, :], mask=mask, other=0.0)
    w = ((_unpack(words, offs_n[None, :]) - _unpack(zeros, offs_n[None, :])).to(tl.float32)
         * scales.to(tl.float32))
    tl.store(w_ptr + offs_k[:, None].to(tl.int64) * stride_w + offs_n[None, :],
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
