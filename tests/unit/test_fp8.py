"""FP8 (e4m3) weight quantization: per-channel scales, the dequantized weight, the CPU product."""

from __future__ import annotations

import pytest
import torch

from srt.layers.fp8 import FP8_DTYPE, FP8_MAX, Fp8Weight, dequantize, quantize_per_channel, \
    quantize_per_token


def test_per_channel_quantization_keeps_each_row_within_e4m3_precision() -> None:
    g = torch.Generator().manual_seed(0)
    w = torch.randn(64, 96, generator=g) * torch.logspace(-3, 1, 64)[:, None]  # rows of all sizes
    w[5] = 0.0
    q, scale = quantize_per_channel(w)
    assert q.dtype == FP8_DTYPE and q.shape == w.shape and scale.shape == (64,)
    assert scale[5] == 1.0 and not q[5].float().any()  # a zero row stays zero
    # every other row's largest entry maps to +-448 exactly
    rows = [i for i in range(64) if i != 5]
    assert torch.equal(q[rows].float().abs().amax(1), torch.full((63,), FP8_MAX))
    back = dequantize(q, scale, torch.float32)
    # e4m3 keeps 3 mantissa bits: a relative error of at most 2^-4 for normal values; values
    # below its normal range (2^-6 of the scale) are off by at most half their spacing 2^-10
    err = (back - w).abs()
    bound = torch.maximum(w.abs() * 2.0**-4, scale[:, None] * 2.0**-10)
    assert bool((err <= bound * 1.0001).all())
    assert err.max() > 0  # it did round


def test_cpu_product_equals_the_dequantized_linear() -> None:
    g = torch.Generator().manual_seed(1)
    w = torch.randn(48, 32, generator=g)
    x = torch.randn(5, 7, 32, generator=g)
    q, scale = quantize_per_channel(w)
    fp8 = Fp8Weight(q, scale)
    assert not fp8.scaled_mm
    out = fp8.matmul(x)
    want = torch.nn.functional.linear(x, dequantize(q, scale, torch.float32))
    assert out.shape == (5, 7, 48)
    assert torch.equal(out, want)
    assert not torch.allclose(out, torch.nn.functional.linear(x, w), atol=1e-6)


def test_per_token_activation_scales() -> None:
    g = torch.Generator().manual_seed(2)
    x = torch.randn(9, 40, generator=g) * torch.arange(1, 10)[:, None]
    xq, s = quantize_per_token(x)
    assert xq.dtype == FP8_DTYPE and s.shape == (9, 1)
    assert torch.allclose(xq.float().abs().amax(1), torch.full((9,), FP8_MAX))
    assert (xq.float() * s - x).abs().max() <= (x.abs().amax(1, keepdim=True) * 2.0**-4).max()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_scaled_mm_product_near_the_dequantized_one_on_the_gpu() -> None:
    """The GPU product against the bf16 product with the dequantized weight, at a real size
    (4096 -> 14336): 1 token through the weight-only kernel, 300 through the row-wise scaled
    FP8 GEMM (Hopper)."""
    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("row-wise scaled FP8 GEMMs need compute capability 9.0")
    g = torch.Generator(device="cuda").manual_seed(3)
    w = torch.randn(14336, 4096, device="cuda", generator=g, dtype=torch.bfloat16) * 0.02
    q, scale = quantize_per_channel(w)
    fp8 = Fp8Weight(q, scale)
    assert fp8.scaled_mm  # decided at construction: the product takes torch._scaled_mm
    for m in (1, 300):
        x = torch.randn(m, 4096, device="cuda", generator=g, dtype=torch.bfloat16)
        out = torch.full((m, 14336), float("nan"), device="cuda", dtype=torch.bfloat16)
        out.copy_(fp8.matmul(x))
        want = x.float() @ dequantize(q, scale, torch.float32).t()
        rel = (out.float() - want).norm() / want.norm()
        assert rel < 0.05, rel  # the activations' own e4m3 rounding
