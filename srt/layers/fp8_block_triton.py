"""The product of half-precision activations with a block-scaled FP8 weight in one Triton kernel
(the GPU path of srt/layers/fp8_block.py).

One program computes a BLOCK_M x BLOCK_N tile of the output. Along K it reads x in its dtype and
the weight in e4m3 (one byte per value: the bytes a decode step is bound by), multiplies each
weight tile by the scales of its rows' blocks in float32 (BLOCK_K divides the block's Bk, so a
tile lies within one block column), rounds it to x's dtype and accumulates x @ w.T in float32
on the tensor cores: the product of the dequantized weight, as the CPU path computes it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from srt.layers.attention.triton_ops.prefill_attention import interpret_upcast


@triton.jit
def _block_fp8_kernel(x_ptr, w_ptr, s_ptr, o_ptr, M, N, K,
                      stride_xm, stride_wn, stride_sn, stride_om,
                      BN_BLOCK: tl.constexpr, BK_BLOCK: tl.constexpr,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                      UPCAST: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    mask_m = offs_m < M
    mask_n = offs_n < N
    x_ptrs = x_ptr + offs_m[:, None].to(tl.int64) * stride_xm + offs_k[None, :]
    w_ptrs = w_ptr + offs_n[:, None].to(tl.int64) * stride_wn + offs_k[None, :]
    s_rows = s_ptr + (offs_n // BN_BLOCK).to(tl.int64) * stride_sn
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        mask_k = (k0 + offs_k) < K
        x = tl.load(x_ptrs, mask=mask_m[:, None] & mask_k[None, :], other=0.0)
        w = tl.load(w_ptrs, mask=mask_n[:, None] & mask_k[None, :], other=0.0)
        s = tl.load(s_rows + k0 // BK_BLOCK, mask=mask_n, other=0.0)
        w = (w.to(tl.float32) * s[:, None]).to(x.dtype)
        if UPCAST:
            acc = tl.dot(x.to(tl.float32), tl.trans(w).to(tl.float32), acc,
                         input_precision="ieee")
        else:
            acc = tl.dot(x, tl.trans(w), acc)
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    o_ptrs = o_ptr + offs_m[:, None].to(tl.int64) * stride_om + offs_n[None, :]
    tl.store(o_ptrs, acc.to(o_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


def block_fp8_matmul(x: torch.Tensor, w: torch.Tensor, s: torch.Tensor, block: tuple[int, int],
                     block_m: int | None = None, block_n: int = 64,
                     block_k: int | None = None) -> torch.Tensor:
    """x [M, K] (contiguous rows) @ dequant(w).T -> [M, N] in x's dtype; w [N, K] e4m3,
    s [ceil(N / Bn), ceil(K / Bk)] float32, block (Bn, Bk)."""
    m, k = x.shape
    n = w.shape[0]
    bn, bk = block
    if (x.stride(1) != 1 or w.shape[1] != k or w.stride(1) != 1
            or s.shape != (triton.cdiv(n, bn), triton.cdiv(k, bk)) or s.stride(1) != 1):
        raise ValueError(f"x {tuple(x.shape)}, weight {tuple(w.shape)}, scales "
                         f"{tuple(s.shape)} of {bn} x {bk} blocks do not fit")
    block_k = block_k or min(bk, 128)
    if bk % block_k:
        raise ValueError(f"BLOCK_K {block_k} must divide the block's {bk} input features")
    block_m = block_m or (16 if m <= 16 else 64)
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
    _block_fp8_kernel[grid](x, w, s, out, m, n, k, x.stride(0), w.stride(0), s.stride(0),
                            out.stride(0), BN_BLOCK=bn, BK_BLOCK=bk, BLOCK_M=block_m,
                            BLOCK_N=block_n, BLOCK_K=block_k, UPCAST=interpret_upcast(x.dtype),
                            num_warps=4, num_stages=3)
    return out
