"""Per-token FP8 quantization of activations in one Triton kernel (the GPU path of
srt/layers/fp8.py): one program per row reads the row once, takes its largest magnitude and
writes the e4m3 values and the row's scale. The torch version (`quantize_per_token`) takes
five kernels and a float32 copy of the row; this one is what runs before every FP8 product.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from srt.layers.fp8 import FP8_DTYPE, FP8_MAX


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
