"""The per-token FP8 quantization kernel (srt/layers/fp8_triton.py) against the torch version
(srt.layers.fp8.quantize_per_token): the same scales and the same e4m3 values; in Triton's
interpreter without CUDA, at the real widths on a GPU."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported

pytest.importorskip("triton")

from srt.layers.fp8 import quantize_per_token  # noqa: E402
from srt.layers.fp8_triton import quantize_per_token_triton  # noqa: E402
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
