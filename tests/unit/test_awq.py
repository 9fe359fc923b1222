"""AWQ int4 (AutoAWQ's GEMM layout): packing order, the quantizer, the dequantization that
defines the weight, and the CPU product through a linear layer."""

from __future__ import annotations

import pytest
import torch

from srt.layers.awq import AWQ_SHIFTS, AwqWeight, dequantize_awq, pack_awq, quantize_awq, \
    unpack_awq


def test_packing_order_is_autoawq_s() -> None:
    # AutoAWQ puts column order_map[i] of each eight in nibble i, order_map [0,2,4,6,1,3,5,7]:
    # columns holding 1..8 give nibbles (low to high) 1,3,5,7,2,4,6,8 = 0x86427531
    word = pack_awq(torch.arange(1, 9).view(1, 8))
    assert word.dtype == torch.int32 and word.shape == (1, 1)
    assert int(word) & 0xFFFFFFFF == 0x86427531
    assert AWQ_SHIFTS == (0, 16, 4, 20, 8, 24, 12, 28)


def test_pack_unpack_round_trip() -> None:
    g = torch.Generator().manual_seed(0)
    v = torch.randint(0, 16, (7, 64), generator=g)
    assert torch.equal(unpack_awq(pack_awq(v)), v.to(torch.int32))
    with pytest.raises(ValueError, match="eight per int32"):
        pack_awq(torch.zeros(2, 12, dtype=torch.int64))


def test_quantize_dequantize() -> None:
    """Round to nearest: every weight within half a step (plus the scale's float16 rounding)
    of its original; the layout's shapes and dtypes are AutoAWQ's."""
    g = torch.Generator().manual_seed(1)
    w = torch.randn(48, 256, generator=g) * 0.05  # [N, K]
    qweight, qzeros, scales = quantize_awq(w, 64)
    assert qweight.shape == (256, 6) and qweight.dtype == torch.int32
    assert qzeros.shape == (4, 6) and qzeros.dtype == torch.int32
    assert scales.shape == (4, 48) and scales.dtype == torch.float16
    deq = dequantize_awq(qweight, qzeros, scales, torch.float32)
    assert deq.shape == w.shape
    step = scales.float().repeat_interleave(64, 0).t()
    assert ((deq - w).abs() <= 0.5 * step * 1.01 + 1e-6).all()
    assert (deq != w).any()
    # the definition, written out for one element
    q = unpack_awq(qweight)[70, 5]
    z = unpack_awq(qzeros)[70 // 64, 5]
    assert deq[5, 70] == (q - z).float() * scales[1, 5].float()


def test_cpu_product_uses_the_dequantized_weight() -> None:
    g = torch.Generator().manual_seed(2)
    w = torch.randn(32, 128, generator=g)
    awq = AwqWeight(*quantize_awq(w, 32))
    x = torch.randn(3, 5, 128, generator=g)
    want = x @ dequantize_awq(awq.qweight, awq.qzeros, awq.scales, torch.float32).t()
    out = awq.matmul(x)
    assert out.shape == (3, 5, 32)
    torch.testing.assert_close(out, want, rtol=0, atol=1e-5)
    assert awq.group == 32


def test_kernel_layout_keeps_the_layer_and_its_parameters() -> None:
    """to_kernel_layout (run on the GPU once loaded) repacks a layer's AWQ weight: the layer
    computes the same product (here through the layout's torch dequantization, on the CPU)
    and its parameters are the repacked tensors, so the model's weight bytes still count them."""
    from srt.layers.awq import AwqKernelWeight, set_awq, to_kernel_layout
    from srt.layers.linear import ColumnParallelLinear

    g = torch.Generator().manual_seed(3)
    layer = ColumnParallelLinear(128, 48)
    set_awq(layer, 32)
    for p, t in zip((layer.qweight, layer.qzeros, layer.scales),
                    quantize_awq(torch.randn(48, 128, generator=g), 32)):
        p.data.copy_(t)
    x = torch.randn(5, 128, generator=g)
    before = layer(x)
    assert to_kernel_layout(layer) == 1
    assert isinstance(layer.quant, AwqKernelWeight)
    assert {n for n, _ in layer.named_parameters()} == {"awq_w", "awq_scales", "awq_zeros"}
    assert sum(p.numel() * p.element_size() for p in layer.parameters()) == (
        48 * 128 // 2 + 48 * 4 * 2 + 48 * 4)
    torch.testing.assert_close(layer(x), before, rtol=0, atol=1e-5)
