"""The block-scaled FP8 product (srt/layers/fp8_block_triton.py) against the dequantized weight's
product (srt.layers.fp8_block.dequantize_block): in Triton's interpreter without CUDA on small
shapes, at a real layer's width on a GPU. Ragged M, N and K (masked tiles), scales random per
block, the output poisoned before the call."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported

pytest.importorskip("triton")

from srt.layers.fp8 import FP8_DTYPE  # noqa: E402
from srt.layers.fp8_block import Fp8BlockWeight, dequantize_block  # noqa: E402
from srt.layers.fp8_block_triton import block_fp8_matmul  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _case(m: int, n: int, k: int, block: tuple[int, int], dtype: torch.dtype, seed: int):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g).to(dtype).to(DEV)
    w = (torch.rand(n, k, generator=g) * 2 - 1).mul(400).to(FP8_DTYPE).to(DEV)
    s = (torch.rand(-(-n // block[0]), -(-k // block[1]), generator=g) * 1e-3 + 1e-4).to(DEV)
    return x, w, s


@pytest.mark.parametrize("m,n,k,block", [(1, 64, 128, (32, 64)), (5, 96, 192, (32, 32)),
                                         (19, 40, 80, (16, 16)), (3, 64, 100, (32, 64))])
def test_block_fp8_matmul_equals_the_dequantized_product(m: int, n: int, k: int,
                                                         block: tuple[int, int]) -> None:
    dtype = torch.float32 if DEV == "cpu" else torch.bfloat16
    x, w, s = _case(m, n, k, block, dtype, seed=m * n + k)
    got = block_fp8_matmul(x, w, s, block, block_n=16, block_k=16)
    want = x.float() @ dequantize_block(w, s, block, dtype).float().T
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), want, rtol=tol, atol=tol * want.abs().max().item())
    # a tile scaled by a neighbour's block would not match
    wrong = x.float() @ dequantize_block(w, s.flip(0), block, dtype).float().T
    assert not torch.allclose(got.float(), wrong, rtol=tol, atol=tol * want.abs().max().item())


def test_shapes_are_checked() -> None:
    x, w, s = _case(2, 64, 128, (32, 64), torch.float32, 0)
    with pytest.raises(ValueError, match="do not fit"):
        block_fp8_matmul(x, w, s[:, :1], (32, 64))
    with pytest.raises(ValueError, match="must divide"):
        block_fp8_matmul(x, w, s, (32, 64), block_k=48)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("m", [1, 16, 300])
def test_gpu_layer_width(m: int) -> None:
    """A Llama-3-8B o_proj-sized weight in 128 x 128 blocks, through Fp8BlockWeight."""
    x, w, s = _case(m, 4096, 4096, (128, 128), torch.bfloat16, seed=m)
    got = Fp8BlockWeight(w, s, (128, 128)).matmul(x)
    want = x.float() @ dequantize_block(w, s, (128, 128), torch.bfloat16).float().T
    torch.testing.assert_close(got.float(), want, rtol=2e-2, atol=2e-2 * want.abs().max().item())
