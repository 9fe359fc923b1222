"""FP8 x FP8 products of decode batches with K split over programs and a second pass that adds
the parts (the GPU path of srt/layers/fp8.py between the weight-only kernel's rows and
prefill's).

`torch._scaled_mm` runs one program per output tile: at 32-256 rows a layer of 4,096 outputs
has 32-64 tiles for 132 SMs, each walking the whole K alone, so the o and down products of a
Llama-3-8B decode step ran at about 3x their weight-read time. Here each program takes one
output tile over one contiguous K range (SPLIT_K ranges per tile, enough programs to keep
every SM streaming the weight) and stores its float32 partial sums; a second kernel adds the
SPLIT_K parts of each output in a fixed order, applies the per-token and per-channel scales
and writes the result. Unlike sums through atomics (tried in this project and 3-8x slower),
the result does not depend on which program finishes first. With SPLIT_K 1 the first kernel
applies the scales and writes the output itself.

Measured on one H100 at the 8B layers (benchmarks/results/README.md, 2026-12-07): at 17-64
rows 1.02-1.59x `_scaled_mm`'s speed on every layer (down at 17 rows 0.032 against 0.050 ms);
at 128 rows 0.75-1.03x and at 256 0.66-0.87x, where `_scaled_mm` stays (srt/layers/fp8.py
FP8_GEMM_MAX_ROWS).

Products in FP8 on the tensor cores with float32 sums (Hopper's FP8 MMA keeps fewer bits in
its sums than float32 does: the GPU tests hold it to a float64 product of the same FP8 values
within 1e-2 of the largest output, bf16 rounding included). In Triton's interpreter (the CPU
tests) the FP8 tiles are multiplied in float32.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from srt.layers.attention.triton_ops.decode_config import device_num_sms
from srt.layers.fp8 import FP8_DTYPE


@triton.jit
def _fp8_splitk_kernel(x_ptr, xs_ptr, w_ptr, s_ptr, out_ptr, part_ptr, M, N, K, stride_xm,
                       stride_w, stride_om, k_per_split, BLOCK_M: tl.constexpr,
                       BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DIRECT: tl.constexpr,
                       EVEN_K: tl.constexpr, UPCAST: tl.constexpr):
    # DIRECT: one part (K unsplit): scale and write the output here, no second pass
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_k = tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    mask_m = offs_m < M
    mask_n = offs_n < N
    k_lo = pid_k * k_per_split  # a multiple of BLOCK_K
    k_hi = tl.minimum(k_lo + k_per_split, K)
    x_ptrs = x_ptr + offs_m[:, None].to(tl.int64) * stride_xm + (k_lo + offs_k)[None, :]
    w_ptrs = w_ptr + offs_n[:, None].to(tl.int64) * stride_w + (k_lo + offs_k)[None, :]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        if EVEN_K:
            x = tl.load(x_ptrs, mask=mask_m[:, None], other=0.0)
            w = tl.load(w_ptrs, mask=mask_n[:, None], other=0.0)
        else:
            mask_k = (k0 + offs_k) < k_hi
            x = tl.load(x_ptrs, mask=mask_m[:, None] & mask_k[None, :], other=0.0)
            w = tl.load(w_ptrs, mask=mask_n[:, None] & mask_k[None, :], other=0.0)
        if UPCAST:  # the interpreter has no FP8 products
            acc = tl.dot(x.to(tl.float32), tl.trans(w.to(tl.float32)), acc,
                         input_precision="ieee")
        else:
            acc = tl.dot(x, tl.trans(w), acc)
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    mask = mask_m[:, None] & mask_n[None, :]
    if DIRECT:
        xs = tl.load(xs_ptr + offs_m, mask=mask_m, other=0.0)
        s = tl.load(s_ptr + offs_n, mask=mask_n, other=0.0)
        acc = acc * xs[:, None] * s[None, :]
        o_ptrs = out_ptr + offs_m[:, None].to(tl.int64) * stride_om + offs_n[None, :]
        tl.store(o_ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask)
    else:
        p_ptrs = (part_ptr + (pid_k * M + offs_m[:, None]).to(tl.int64) * N + offs_n[None, :])
        tl.store(p_ptrs, acc, mask=mask)


@triton.jit
def _splitk_sum_kernel(part_ptr, xs_ptr, s_ptr, out_ptr, M, N, stride_om,
                       SPLIT_K: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < N
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for sk in tl.static_range(SPLIT_K):  # a fixed order: the same sums every run
        acc += tl.load(part_ptr + (sk * M + row).to(tl.int64) * N + offs, mask=mask, other=0.0)
    xs = tl.load(xs_ptr + row)
    s = tl.load(s_ptr + offs, mask=mask, other=0.0)
    tl.store(out_ptr + row.to(tl.int64) * stride_om + offs,
             (acc * xs * s).to(out_ptr.dtype.element_ty), mask=mask)


@dataclass(frozen=True)
class Fp8GemmConfig:
    """One fp8_gemm launch: BLOCK_M x BLOCK_N outputs a program over a 1 / SPLIT_K share of K
    (whole BLOCK_K tiles)."""

    BLOCK_M: int
    BLOCK_N: int
    BLOCK_K: int = 128
    SPLIT_K: int = 1
    num_warps: int = 4
    num_stages: int = 4


# The default split aims at this many programs per SM, each over at least FP8_GEMM_MIN_K_TILES
# tiles of K, in at most FP8_GEMM_MAX_SPLIT_K parts.
FP8_GEMM_PROGRAMS_PER_SM = 2
FP8_GEMM_MIN_K_TILES = 4
FP8_GEMM_MAX_SPLIT_K = 8
SUM_BLOCK = 1024  # outputs a program of the second pass adds


def default_fp8_gemm_config(m: int, n: int, k: int, num_sms: int) -> Fp8GemmConfig:
    """Row tiles of 16-128 (the batch rounded up to a power of two), 64 columns, 128 of K; K
    split until the grid has about FP8_GEMM_PROGRAMS_PER_SM programs an SM."""
    bm = min(max(triton.next_power_of_2(m), 16), 128)
    bn, bk = 64, 128
    tiles = triton.cdiv(m, bm) * triton.cdiv(n, bn)
    split = triton.cdiv(num_sms * FP8_GEMM_PROGRAMS_PER_SM, tiles)
    split = max(1, min(split, FP8_GEMM_MAX_SPLIT_K, triton.cdiv(k, bk) // FP8_GEMM_MIN_K_TILES))
    return Fp8GemmConfig(bm, bn, bk, split, 8 if bm == 128 else 4)


def fp8_gemm(xq: torch.Tensor, xs: torch.Tensor, w: torch.Tensor, s: torch.Tensor,
             out_dtype: torch.dtype, config: Fp8GemmConfig | None = None) -> torch.Tensor:
    """(xq * xs) @ (w * s[:, None]).T -> [M, N] in out_dtype: xq [M, K] float8_e4m3fn with
    contiguous rows and xs [M] or [M, 1] float32 (srt.layers.fp8_triton's per-token pair), w
    [N, K] float8_e4m3fn with contiguous rows and s [N] float32. The same inputs give the same
    output on every run (the split sums are added in a fixed order)."""
    m, k = xq.shape
    n = w.shape[0]
    if (xq.dtype != FP8_DTYPE or w.dtype != FP8_DTYPE or w.shape[1] != k or xq.stride(1) != 1
            or w.stride(1) != 1 or xs.numel() != m or s.numel() != n):
        raise ValueError(f"fp8_gemm: x {tuple(xq.shape)} {xq.dtype}, scales {tuple(xs.shape)}, "
                         f"w {tuple(w.shape)} {w.dtype}, scales {tuple(s.shape)}")
    out = torch.empty((m, n), dtype=out_dtype, device=xq.device)
    if m == 0:
        return out
    # (the interpreter counts an H100's 132 SMs, so the CPU tests split as a GPU would)
    cfg = config or default_fp8_gemm_config(m, n, k, device_num_sms(xq.device))
    k_tiles = triton.cdiv(k, cfg.BLOCK_K)
    split = max(1, min(cfg.SPLIT_K, k_tiles))
    k_per_split = triton.cdiv(k_tiles, split) * cfg.BLOCK_K
    split = triton.cdiv(k, k_per_split)  # (no empty part)
    part = (torch.empty((split, m, n), dtype=torch.float32, device=xq.device) if split > 1
            else out)
    xs, s = xs.reshape(-1), s.reshape(-1)
    grid = (triton.cdiv(n, cfg.BLOCK_N), triton.cdiv(m, cfg.BLOCK_M), split)
    _fp8_splitk_kernel[grid](
        xq, xs, w, s, out, part, m, n, k, xq.stride(0), w.stride(0), out.stride(0), k_per_split,
        BLOCK_M=cfg.BLOCK_M, BLOCK_N=cfg.BLOCK_N, BLOCK_K=cfg.BLOCK_K, DIRECT=split == 1,
        EVEN_K=k % cfg.BLOCK_K == 0, UPCAST=not xq.is_cuda, num_warps=cfg.num_warps,
        num_stages=cfg.num_stages)
    if split > 1:
        _splitk_sum_kernel[(m, triton.cdiv(n, SUM_BLOCK))](
            part, xs, s, out, m, n, out.stride(0), SPLIT_K=split, BLOCK=SUM_BLOCK, num_warps=4)
    return out
