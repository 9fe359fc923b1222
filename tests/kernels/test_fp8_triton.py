"""The FP8 Triton kernels (srt/layers/fp8_triton.py): the per-token quantization against the
torch version (srt.layers.fp8.quantize_per_token), the same scales and e4m3 values; fp8_gemm
against the float64 product of the dequantized operands. In Triton's interpreter without
CUDA, at the real widths on a GPU."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported

pytest.importorskip("triton")

from srt.layers.fp8 import Fp8Weight, quantize_per_channel, quantize_per_token  # noqa: E402
from srt.layers.fp8_triton import (  # noqa: E402
    Fp8GemmConfig,
    default_fp8_gemm_config,
    fp8_gemm,
    quantize_per_token_triton,
)
from srt.layers.quant_gemm_triton import split_workspace  # noqa: E402
from tests.kernels.test_kv_fp8 import DEV, _fp8_equal  # noqa: E402


def _same_scales(s: torch.Tensor, want: torch.Tensor) -> None:
    """Equal on the CPU. On the GPU torch divides a tensor by a number as a multiplication by
    its reciprocal (one rounding more) while the kernel divides: within an ulp, and the
    e4m3 values then within one step where a value sits at a rounding boundary."""
    if DEV == "cpu":
        assert torch.equal(s, want)
    else:
        torch.testing.assert_close(s, want, rtol=2.5e-7, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("m,k", [(1, 64), (5, 96), (3, 1000)])
def test_quantize_per_token_kernel(dtype: torch.dtype, m: int, k: int) -> None:
    g = torch.Generator().manual_seed(m * k)
    x = (torch.randn(m, k, generator=g) * torch.logspace(-2, 2, m)[:, None]).to(dtype).to(DEV)
    x[0, :3] = 0.0
    q, s = quantize_per_token_triton(x)
    want_q, want_s = quantize_per_token(x)
    assert q.dtype == want_q.dtype and s.shape == (m, 1) and s.dtype == torch.float32
    _same_scales(s, want_s)
    _fp8_equal(q.float(), want_q.float(), exact=DEV == "cpu")


def test_zero_row_and_strided_rows() -> None:
    x = torch.zeros(2, 64, device=DEV)
    q, s = quantize_per_token_triton(x)
    assert not q.float().any() and (s > 0).all()
    wide = torch.randn(4, 100, device=DEV)
    q, s = quantize_per_token_triton(wide[:, :64])
    _fp8_equal(q.float(), quantize_per_token(wide[:, :64])[0].float())
    with pytest.raises(ValueError, match="contiguous rows"):
        quantize_per_token_triton(wide.t())


@pytest.mark.gpu
@pytest.mark.parametrize("k", [4096, 14336])
def test_gpu_quantize_per_token(k: int) -> None:
    x = torch.randn(300, k, device="cuda", dtype=torch.bfloat16)
    q, s = quantize_per_token_triton(x)
    want_q, want_s = quantize_per_token(x)
    _same_scales(s, want_s)
    _fp8_equal(q.float(), want_q.float(), exact=False)


def _gemm_case(m: int, n: int, k: int, seed: int) -> tuple[torch.Tensor, ...]:
    """(xq, xs, w, s, reference in float64): random e4m3 operands with scales spread over
    four decades, so that a scale applied to the wrong row or column shows."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g) * torch.logspace(-2, 2, m)[:, None]
    xq, xs = quantize_per_token(x)
    w = torch.randn(n, k, generator=g) * torch.logspace(-2, 2, n)[torch.randperm(n, generator=g)][:, None]
    wq, ws = quantize_per_channel(w)
    want = (xq.double() * xs.double()) @ (wq.double() * ws.double()[:, None]).T
    return xq.to(DEV), xs.to(DEV), wq.to(DEV), ws.to(DEV), want


@pytest.mark.parametrize("m,n,k,cfg", [
    (5, 48, 1024, None),  # the default tiles: one 64-row tile, K split in two
    (70, 96, 384, Fp8GemmConfig(64, 32, 128, 3)),  # rows over two tiles, uneven split
    (130, 40, 200, Fp8GemmConfig(128, 32, 64, 2)),  # K not a whole number of tiles
    (33, 64, 256, Fp8GemmConfig(32, 64, 64, 1)),  # no split: the output written directly
], ids=["default", "split3", "ragged-k", "no-split"])
def test_fp8_gemm_matches_reference(m: int, n: int, k: int, cfg: Fp8GemmConfig | None) -> None:
    xq, xs, wq, ws, want = _gemm_case(m, n, k, seed=m + n + k)
    if cfg is None:
        assert default_fp8_gemm_config(m, n, k).SPLIT_K == 2
    for out_dtype, rtol in ((torch.float32, 1e-5), (torch.bfloat16, 8e-3)):
        for _ in range(2):  # the second call finds the split workspace left zeroed
            out = fp8_gemm(xq, xs, wq, ws, out_dtype, config=cfg)
            assert out.dtype == out_dtype and out.shape == (m, n)
            err = ((out.double().cpu() - want).abs() / want.abs().clamp(min=1e-30)).max().item()
            scale = want.abs().amax().item()
            torch.testing.assert_close(out.double().cpu(), want, rtol=rtol, atol=rtol * scale,
                                       msg=f"relative error {err}")
    sums, counts = split_workspace(xq.device, m * n)
    assert not sums[: m * n].any() and not counts[: m * n].any()


def test_fp8_gemm_refuses_mismatches() -> None:
    xq, xs, wq, ws, _ = _gemm_case(4, 32, 64, seed=1)
    with pytest.raises(ValueError, match="fp8_gemm"):
        fp8_gemm(xq, xs, wq[:, :32], ws, torch.float32)
    with pytest.raises(ValueError, match="fp8_gemm"):
        fp8_gemm(xq.float(), xs, wq, ws, torch.float32)
    with pytest.raises(ValueError, match="fp8_gemm"):
        fp8_gemm(xq, xs[:3], wq, ws, torch.float32)
    assert fp8_gemm(xq[:0], xs[:0], wq, ws, torch.bfloat16).shape == (0, 32)


def test_default_fp8_gemm_config() -> None:
    """About two programs per SM through SPLIT_K, at least four K tiles a program, at most 8
    splits; 64-row tiles up to 64 rows."""
    sms = 132
    down = default_fp8_gemm_config(128, 4096, 14336, sms)  # 32 tiles: 264 / 32 -> 8 splits
    assert (down.BLOCK_M, down.BLOCK_N, down.SPLIT_K) == (128, 128, 8)
    assert default_fp8_gemm_config(64, 4096, 4096, sms).BLOCK_M == 64
    assert default_fp8_gemm_config(200, 6144, 4096, sms).SPLIT_K == 3  # 96 tiles
    assert default_fp8_gemm_config(256, 28672, 4096, sms).SPLIT_K == 1  # 448 tiles
    assert default_fp8_gemm_config(128, 4096, 512, sms).SPLIT_K == 1  # 4 K tiles in all


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("m", [17, 64, 128, 256])
@pytest.mark.parametrize("n,k", [(6144, 4096), (4096, 14336)])
def test_gpu_fp8_gemm_layers(m: int, n: int, k: int) -> None:
    """The 8B layer sizes at decode batch sizes, default tiles, against the float64 product;
    Fp8Weight.matmul (which takes fp8_gemm at these rows on Hopper) against the same."""
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("FP8 products need compute capability 8.9")
    xq, xs, wq, ws, want = _gemm_case(m, n, k, seed=m)
    out = fp8_gemm(xq, xs, wq, ws, torch.bfloat16)
    torch.testing.assert_close(out.double().cpu(), want, rtol=1e-2,
                               atol=1e-2 * want.abs().amax().item())
    x = (xq.float() * xs).to(torch.bfloat16)
    got = Fp8Weight(wq, ws).matmul(x)
    ref = x.double().cpu() @ (wq.double().cpu() * ws.double().cpu()[:, None]).T
    torch.testing.assert_close(got.double().cpu(), ref, rtol=3e-2,
                               atol=3e-2 * ref.abs().amax().item())
