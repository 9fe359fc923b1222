"""FP8 Triton kernels of the GPU path of srt/layers/fp8.py.

- Per-token quantization of activations: one program per row reads the row once, takes its
  largest magnitude and writes the e4m3 values and the row's scale. The torch version
  (`quantize_per_token`) takes five kernels and a float32 copy of the row; this one runs
  before every FP8 x FP8 product.
- `fp8_gemm`: x_q [M, K] e4m3 with per-token scales times w [N, K] e4m3 with per-channel
  scales on the tensor cores (FP8 MMA, float32 sums), the scales applied once per output.
  Made for decode batches (tens to a few hundred rows) of layers with few output tiles: K is
  split over SPLIT_K programs (srt/layers/quant_gemm_triton.py's self-resetting workspace, no
  extra kernels) so that enough programs stream the weight, where torch._scaled_mm runs one
  program per output tile (on one H200, the 8B down product at 128 rows: 3.1x its
  weight-read time).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from srt.layers.fp8 import FP8_DTYPE, FP8_MAX
from srt.layers.quant_gemm_triton import _finish, split_workspace


@triton.jit
def _quantize_per_token_kernel(x_ptr, q_ptr, s_ptr, n, stride_x, stride_q,
                               FP8MAX: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    # IEEE divisions (Triton's `/` is approximate on the GPU): torch's values on the CPU; on
    # the GPU torch multiplies by the reciprocal, an ulp away at most
    scale = tl.math.div_rn(tl.maximum(tl.max(tl.abs(x), 0), 1e-12), FP8MAX)
    q = tl.minimum(tl.maximum(tl.math.div_rn(x, scale), -FP8MAX), FP8MAX)
    tl.store(q_ptr + row * stride_q + offs, q.to(q_ptr.dtype.element_ty), mask=mask)
    tl.store(s_ptr + row, scale)


def quantize_per_token_triton(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(x_q [M, K] float8_e4m3fn, scale [M, 1] float32) with x ~= x_q * scale, for x [M, K]
    with contiguous rows; srt.layers.fp8.quantize_per_token's values (an ulp of the scale and
    one e4m3 step apart at most, where torch multiplies by a reciprocal)."""
    if x.dim() != 2 or x.stride(1) != 1:
        raise ValueError("quantize_per_token_triton takes [M, K] with contiguous rows")
    m, k = x.shape
    q = torch.empty((m, k), dtype=FP8_DTYPE, device=x.device)
    s = torch.empty((m, 1), dtype=torch.float32, device=x.device)
    if m:
        block = triton.next_power_of_2(k)
        _quantize_per_token_kernel[(m,)](x, q, s, k, x.stride(0), q.stride(0), FP8MAX=FP8_MAX,
                                         BLOCK=block, num_warps=min(max(block // 512, 1), 16))
    return q, s


@triton.jit
def _fp8_gemm_kernel(x_ptr, xs_ptr, w_ptr, s_ptr, out_ptr, ws_ptr, cnt_ptr, M, N, K, stride_xm,
                     stride_w, stride_om, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                     BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr, EVEN_K: tl.constexpr,
                     UPCAST: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_k = tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    mask_m = offs_m < M
    mask_n = offs_n < N
    x_rows = x_ptr + offs_m[:, None].to(tl.int64) * stride_xm
    w_rows = w_ptr + offs_n[:, None].to(tl.int64) * stride_w
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    # split k takes K tiles pid_k, pid_k + SPLIT_K, ...
    for k0 in range(pid_k * BLOCK_K, K, BLOCK_K * SPLIT_K):
        ks = k0 + offs_k
        if EVEN_K:
            x = tl.load(x_rows + ks[None, :], mask=mask_m[:, None], other=0.0)
            w = tl.load(w_rows + ks[None, :], mask=mask_n[:, None], other=0.0)
        else:
            x = tl.load(x_rows + ks[None, :], mask=mask_m[:, None] & (ks < K)[None, :],
                        other=0.0)
            w = tl.load(w_rows + ks[None, :], mask=mask_n[:, None] & (ks < K)[None, :],
                        other=0.0)
        if UPCAST:  # the interpreter has no FP8 products
            acc += tl.dot(x.to(tl.float32), tl.trans(w.to(tl.float32)), input_precision="ieee")
        else:
            acc = tl.dot(x, tl.trans(w), acc)
    xs = tl.load(xs_ptr + offs_m, mask=mask_m, other=0.0)
    s = tl.load(s_ptr + offs_n, mask=mask_n, other=0.0)
    acc = acc * xs[:, None] * s[None, :]
    _finish(acc, offs_n[None, :], mask_m[:, None] & mask_n[None, :], offs_m[:, None].to(tl.int64),
            out_ptr, ws_ptr, cnt_ptr, N, stride_om, SPLIT_K)


@dataclass(frozen=True)
class Fp8GemmConfig:
    """Tiles of one fp8_gemm: BLOCK_M x BLOCK_N outputs a program over K / SPLIT_K."""

    BLOCK_M: int
    BLOCK_N: int
    BLOCK_K: int = 128
    SPLIT_K: int = 1
    num_warps: int = 4
    num_stages: int = 4


# fp8_gemm's default aims at this many programs per SM (through SPLIT_K), with at least
# FP8_GEMM_MIN_K_TILES tiles of K per program.
FP8_GEMM_PROGRAMS_PER_SM = 2
FP8_GEMM_MIN_K_TILES = 4
FP8_GEMM_MAX_SPLIT_K = 8


def default_fp8_gemm_config(m: int, n: int, k: int, num_sms: int = 132) -> Fp8GemmConfig:
    """64-row tiles up to 64 rows, else 128; 128 columns, 128 K; K split until the grid has
    about FP8_GEMM_PROGRAMS_PER_SM programs per SM."""
    bm = 64 if m <= 64 else 128
    bn, bk = 128, 128
    tiles = triton.cdiv(m, bm) * triton.cdiv(n, bn)
    split = triton.cdiv(num_sms * FP8_GEMM_PROGRAMS_PER_SM, tiles)
    split = max(1, min(split, FP8_GEMM_MAX_SPLIT_K, triton.cdiv(k, bk) // FP8_GEMM_MIN_K_TILES))
    return Fp8GemmConfig(bm, bn, bk, split, 4 if bm == 64 else 8)


def fp8_gemm(xq: torch.Tensor, xs: torch.Tensor, w: torch.Tensor, s: torch.Tensor,
             out_dtype: torch.dtype, config: Fp8GemmConfig | None = None) -> torch.Tensor:
    """(xq * xs) @ (w * s[:, None]).T -> [M, N] in out_dtype: xq [M, K] float8_e4m3fn with
    contiguous rows and xs [M] or [M, 1] float32 (quantize_per_token_triton's pair), w [N, K]
    float8_e4m3fn with contiguous rows and s [N] float32. Products in FP8 with float32 sums;
    with SPLIT_K > 1 the split sums add in an order that varies between runs."""
    m, k = xq.shape
    n = w.shape[0]
    if (xq.dtype != FP8_DTYPE or w.dtype != FP8_DTYPE or w.shape[1] != k or xq.stride(1) != 1
            or w.stride(1) != 1 or xs.numel() != m or s.numel() != n):
        raise ValueError(f"fp8_gemm: x {tuple(xq.shape)} {xq.dtype}, scales {tuple(xs.shape)}, "
                         f"w {tuple(w.shape)} {w.dtype}, scales {tuple(s.shape)}")
    out = torch.empty((m, n), dtype=out_dtype, device=xq.device)
    if m == 0:
        return out
    cfg = config or default_fp8_gemm_config(m, n, k)
    ws, cnt = split_workspace(xq.device, m * n) if cfg.SPLIT_K > 1 else (out, out)
    grid = (triton.cdiv(n, cfg.BLOCK_N), triton.cdiv(m, cfg.BLOCK_M), cfg.SPLIT_K)
    _fp8_gemm_kernel[grid](
        xq, xs, w, s, out, ws, cnt, m, n, k, xq.stride(0), w.stride(0), out.stride(0),
        BLOCK_M=cfg.BLOCK_M, BLOCK_N=cfg.BLOCK_N, BLOCK_K=cfg.BLOCK_K, SPLIT_K=cfg.SPLIT_K,
        EVEN_K=k % cfg.BLOCK_K == 0, UPCAST=not xq.is_cuda, num_warps=cfg.num_warps,
        num_stages=cfg.num_stages if xq.is_cuda else 1)
    return out
