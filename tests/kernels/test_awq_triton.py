"""The AWQ int4 Triton kernels (srt/layers/awq_triton.py) against x @ dequantize_awq(...).T in
float64: without CUDA in Triton's interpreter on small shapes (float32 and float16), on a GPU
at the Llama-3-8B layer sizes (`gpu` marker). Random weights and inputs. The kernels allocate
their outputs (torch.empty, or zeros for split-K's float32 accumulator); every element is
compared with the reference and checked for NaN."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported

triton = pytest.importorskip("triton")

from srt.layers.awq import dequantize_awq, quantize_awq  # noqa: E402
from srt.layers.awq_triton import awq_dequantize, awq_gemm, awq_matmul, gemm_config  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _case(m: int, n: int, k: int, group: int, dtype: torch.dtype, seed: int):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * k**-0.5
    qweight, qzeros, scales = (t.to(DEV) for t in quantize_awq(w, group))
    x = torch.randn(m, k, generator=g).to(dtype).to(DEV)
    ref = x.double() @ dequantize_awq(qweight, qzeros, scales, dtype).double().t()
    return x, qweight, qzeros, scales, ref


def _rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    assert not out.isnan().any()
    return ((out.double() - ref).abs().max() / ref.abs().max()).item()


TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
@pytest.mark.parametrize("m,n,k,group,cfg", [
    (1, 64, 256, 64, dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=32, SPLIT_K=1, num_warps=4)),
    (3, 72, 256, 128, dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=64, SPLIT_K=4, num_warps=4)),
    (19, 40, 192, 64, dict(BLOCK_M=16, BLOCK_N=16, BLOCK_K=32, SPLIT_K=2, num_warps=4)),
    (33, 48, 128, 32, dict(BLOCK_M=32, BLOCK_N=32, BLOCK_K=32, SPLIT_K=1, num_warps=4)),
])
def test_awq_gemm(dtype: torch.dtype, m: int, n: int, k: int, group: int, cfg: dict) -> None:
    # N not a multiple of BLOCK_N, M of BLOCK_M, K tiles not a multiple of SPLIT_K
    x, qw, qz, s, ref = _case(m, n, k, group, dtype, seed=m + n)
    out = awq_gemm(x, qw, qz, s, cfg)
    assert out.dtype == dtype and out.shape == (m, n)
    assert _rel(out, ref) < TOL[dtype]


def test_awq_gemm_default_config_and_strided_rows() -> None:
    x, qw, qz, s, ref = _case(5, 64, 512, 128, torch.float32, seed=3)
    wide = torch.full((5, 600), float("nan"), device=DEV)
    wide[:, :512] = x
    out = awq_gemm(wide[:, :512], qw, qz, s)
    assert _rel(out, ref) < TOL[torch.float32]


def test_awq_dequantize_equals_the_definition() -> None:
    _, qw, qz, s, _ = _case(1, 80, 256, 64, torch.float32, seed=4)
    for dtype in (torch.float32, torch.float16):
        got = awq_dequantize(qw, qz, s, dtype)
        assert torch.equal(got, dequantize_awq(qw, qz, s, dtype).t())


def test_awq_matmul_paths() -> None:
    """Few rows through the fused kernel, many through dequantize + GEMM: the same product."""
    x, qw, qz, s, ref = _case(300, 32, 128, 64, torch.float32, seed=5)
    many = awq_matmul(x.view(3, 100, 128), qw, qz, s)
    few = awq_matmul(x[:7], qw, qz, s)
    assert _rel(many.view(300, 32), ref) < TOL[torch.float32]
    assert _rel(few, ref[:7]) < TOL[torch.float32]


def test_split_k_heuristic() -> None:
    # one decode row over the 8B down projection: 64 column tiles, split to fill 132 SMs twice
    cfg = gemm_config(1, 4096, 14336, 128, 132)
    assert cfg["SPLIT_K"] == 4 and cfg["BLOCK_M"] == 16
    # a prefill-sized product is not split
    assert gemm_config(200, 28672, 4096, 128, 132)["SPLIT_K"] == 1


def test_shape_checks() -> None:
    _, qw, qz, s, _ = _case(1, 64, 256, 64, torch.float32, seed=6)
    with pytest.raises(ValueError, match="input features"):
        awq_gemm(torch.randn(2, 128, device=DEV), qw, qz, s)
    with pytest.raises(ValueError, match="do not match"):
        awq_gemm(torch.randn(2, 256, device=DEV), qw, qz[:, :4], s)


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 4, 16, 64, 512])
@pytest.mark.parametrize("n,k", [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)])
def test_gpu_awq_matmul_real_sizes(m: int, n: int, k: int) -> None:
    x, qw, qz, s, _ = _case(m, n, k, 128, torch.float16, seed=m)
    ref = x.float() @ dequantize_awq(qw, qz, s, torch.float16).float().t()
    out = awq_matmul(x, qw, qz, s)
    assert _rel(out, ref.double()) < 5e-3
