"""The split-K FP8 x FP8 product (srt/layers/fp8_gemm_triton.py) against a float64 product of
the same FP8 values and scales: in Triton's interpreter without CUDA on small shapes (ragged
M, N and K, every split count, unsplit), at the Llama-3-8B layer widths on a GPU. The output
is poisoned before each call; a second call gives the same bits (no order-dependent sums)."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported

pytest.importorskip("triton")

from srt.layers.fp8 import FP8_DTYPE, Fp8Weight, quantize_per_channel  # noqa: E402
from srt.layers.fp8_gemm_triton import (Fp8GemmConfig, default_fp8_gemm_config,  # noqa: E402
                                        fp8_gemm)
from tests.kernels.compile_sm90 import compile_in_subprocess, ptxas  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _case(m: int, n: int, k: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    xq = ((torch.rand(m, k, generator=g) * 2 - 1) * 400).to(FP8_DTYPE)
    xs = torch.rand(m, 1, generator=g) * 1e-2 + 1e-3
    w = ((torch.rand(n, k, generator=g) * 2 - 1) * 400).to(FP8_DTYPE)
    s = torch.rand(n, generator=g) * 1e-3 + 1e-4
    xq, xs, w, s = (t.to(DEV) for t in (xq, xs, w, s))
    want = (xq.double() * xs.double()) @ (w.double() * s.double()[:, None]).T
    return [xq, xs, w, s], want


def _poisoned_call(args, dtype, cfg):
    """fp8_gemm with torch.empty's next block filled with NaN first (the output reuses it)."""
    m, n = args[0].shape[0], args[2].shape[0]
    torch.full((m, n), float("nan"), dtype=dtype, device=DEV)  # freed: its block comes back
    return fp8_gemm(*args, dtype, config=cfg)


@pytest.mark.parametrize("m,n,k,split", [
    (1, 32, 64, 1), (5, 48, 96, 3), (19, 40, 80, 2), (33, 70, 200, 4), (17, 64, 256, 8),
    (3, 16, 48, 5)])
def test_equals_the_float64_product(m: int, n: int, k: int, split: int) -> None:
    args, want = _case(m, n, k, seed=m * 1000 + n + k)
    # (FP8 MMA on a GPU takes K tiles of 32 or more)
    cfg = Fp8GemmConfig(BLOCK_M=16, BLOCK_N=16, BLOCK_K=16 if DEV == "cpu" else 32,
                        SPLIT_K=split)
    got = _poisoned_call(args, torch.float32, cfg)
    assert not got.isnan().any()
    torch.testing.assert_close(got.double(), want, rtol=1e-5,
                               atol=1e-5 * want.abs().max().item())
    again = fp8_gemm(*args, torch.float32, config=cfg)
    assert torch.equal(got, again)
    # a tile scaled by the wrong channel's scale would not match
    wrong = fp8_gemm(args[0], args[1], args[2], args[3].flip(0), torch.float32, config=cfg)
    assert not torch.allclose(wrong.double(), want, rtol=1e-3)


def test_default_config_splits_k_for_few_tiles() -> None:
    # the 8B down product at 128 rows: 64 column tiles of one row tile, K 14,336 in 112 tiles
    cfg = default_fp8_gemm_config(128, 4096, 14336, num_sms=132)
    assert (cfg.BLOCK_M, cfg.BLOCK_N, cfg.SPLIT_K) == (128, 64, 5)
    # gate_up at 256 rows has 896 tiles already
    assert default_fp8_gemm_config(256, 28672, 4096, num_sms=132).SPLIT_K == 1
    # never fewer than 4 K tiles a part
    assert default_fp8_gemm_config(32, 64, 512, num_sms=132).SPLIT_K == 1


def test_shapes_are_checked() -> None:
    args, _ = _case(2, 32, 64, 0)
    with pytest.raises(ValueError, match="fp8_gemm"):
        fp8_gemm(args[0], args[1], args[2][:, :32].contiguous(), args[3], torch.float32)
    with pytest.raises(ValueError, match="fp8_gemm"):
        fp8_gemm(args[0].float(), args[1], args[2], args[3], torch.float32)


@pytest.mark.skipif(ptxas() is None, reason="Triton's NVIDIA backend has no ptxas here")
def test_kernels_compile_for_sm90() -> None:
    """Both kernels through Triton's compiler and ptxas for an H100 / H200 (the interpreter
    multiplies in float32): the first multiplies e4m3 tiles on the tensor cores (wgmma)."""
    split, split_mma, unsplit, unsplit_mma, total, _ = compile_in_subprocess("fp8gemm")
    assert min(split, unsplit, total) > 0
    assert split_mma > 0 and unsplit_mma > 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("layer", [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)])
@pytest.mark.parametrize("m", [17, 64, 128, 256])  # (the kernel serves 17-64 in Fp8Weight)
def test_gpu_layer_widths(layer: tuple[int, int], m: int) -> None:
    """The default tiles at the 8B layers' widths, bf16 out; and through Fp8Weight.matmul (the
    split-K kernel up to FP8_GEMM_MAX_ROWS rows), which must match torch._scaled_mm's product
    of the same quantized activations."""
    n, k = layer
    args, want = _case(m, n, k, seed=m + n)
    got = _poisoned_call(args, torch.bfloat16, None)
    # FP8 MMA sums on Hopper keep fewer bits than float32; bf16 output rounding on top
    torch.testing.assert_close(got.double(), want, rtol=1e-2,
                               atol=1e-2 * want.abs().max().item())
    assert torch.equal(got, fp8_gemm(*args, torch.bfloat16))
    x = torch.randn(m, k, device=DEV, dtype=torch.bfloat16)
    wt = Fp8Weight(*quantize_per_channel(torch.randn(n, k, device=DEV) * k**-0.5))
    from srt.layers.fp8_triton import quantize_per_token_triton

    xq, xs = quantize_per_token_triton(x)
    ref = torch._scaled_mm(xq, wt.qweight.t(), scale_a=xs, scale_b=wt.scale_row,
                           out_dtype=torch.float32)
    torch.testing.assert_close(wt.matmul(x).float(), ref, rtol=2e-2,
                               atol=2e-2 * ref.abs().max().item())
