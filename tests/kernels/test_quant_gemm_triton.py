"""The weight-only kernels (srt/layers/quant_gemm_triton.py) for FP8 and int4 (AWQ) weights
against x @ dequantized(w).T in float64: without CUDA in Triton's interpreter on small shapes
(float32 and float16 activations), on a GPU at the Llama-3-8B layer sizes (`gpu` marker).
Random weights and inputs; the outputs are allocated by the kernels (torch.empty, or zeros
for split-K) and every element is compared with the reference and checked for NaN."""

from __future__ import annotations

import os
from dataclasses import replace

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported

triton = pytest.importorskip("triton")

from srt.layers.awq import AwqKernelWeight, AwqWeight, dequantize_awq, quantize_awq  # noqa: E402
from srt.layers.fp8 import dequantize, quantize_per_channel  # noqa: E402
from tests.kernels.compile_sm90 import compile_in_subprocess, ptxas  # noqa: E402
from srt.layers.quant_gemm_triton import (  # noqa: E402
    WoConfig, dequantize_int4, split_workspace, wo_matmul)

DEV = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}


def _rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    assert not out.isnan().any()
    return ((out.double() - ref).abs().max() / ref.abs().max()).item()


def _awq(n: int, k: int, group: int, seed: int) -> tuple[AwqWeight, AwqKernelWeight]:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * k**-0.5
    a = AwqWeight(*(t.to(DEV) for t in quantize_awq(w, group)))
    return a, AwqKernelWeight.from_checkpoint(a)


def _x(m: int, k: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(m, k, generator=g).to(dtype).to(DEV)


def test_kernel_layout_dequantizes_to_the_checkpoints_weight() -> None:
    a, kw = _awq(40, 256, 64, seed=1)
    assert kw.w.shape == (32, 40) and kw.w.dtype == torch.int32
    assert kw.scales.shape == (4, 40) and kw.zeros.shape == (4, 40)
    for dtype in (torch.float32, torch.float16):
        ref = dequantize_awq(a.qweight, a.qzeros, a.scales, dtype)
        assert torch.equal(kw.dequantize(dtype), ref)
        out = torch.full((256, 40), float("nan"), dtype=dtype, device=DEV)
        assert torch.equal(dequantize_int4(kw.w, kw.scales, kw.zeros, dtype, out=out), ref.t())


CONFIGS = [
    # CUDA-core kernel: N not a multiple of BLOCK_N, K (FP8) not of BLOCK_K, split K
    (1, WoConfig(1, 16, 64, 1, 4)),
    (2, WoConfig(1, 8, 128, 3, 4)),
    (1, WoConfig(1, 16, 64, 1, 4, REDUCE=1)),
    (2, WoConfig(1, 8, 128, 2, 4, REDUCE=1)),
    (1, WoConfig(1, 16, 64, 4, 2, UNROLL_N=2)),  # (REDUCE is FP8's, UNROLL_N and ROWS int4's)
    (2, WoConfig(1, 32, 128, 1, 2, UNROLL_N=2)),
    (3, WoConfig(1, 16, 64, 2, 2, UNROLL_N=2, ROWS=2)),  # M not a multiple of ROWS
    (4, WoConfig(1, 32, 128, 1, 2, ROWS=2)),
    # tensor-core kernel: M not a multiple of BLOCK_M, split K
    (5, WoConfig(16, 32, 32, 1, 4)),
    (19, WoConfig(16, 16, 64, 2, 4)),
]
if DEV == "cuda":  # packed half-precision arithmetic (a GPU and half-precision x only;
    # X_WORDS: float16 x read as words of two channels)
    CONFIGS += [(1, WoConfig(1, 32, 64, 3, 2, PACKED=1)),
                (3, WoConfig(1, 16, 64, 2, 2, UNROLL_N=2, ROWS=2, PACKED=1)),
                (1, WoConfig(1, 32, 64, 3, 2, PACKED=1, X_WORDS=1)),
                (3, WoConfig(1, 16, 64, 2, 2, UNROLL_N=2, ROWS=2, PACKED=1, X_WORDS=1))]


# bfloat16 only on the GPU: Triton's interpreter keeps bfloat16 in float32 storage, so the
# kernel's bitcast of int16 bits to bfloat16 does not mean there what it means on the GPU
HALF = [torch.float16] + ([torch.bfloat16] if DEV == "cuda" else [])


@pytest.mark.parametrize("dtype", [torch.float32] + HALF, ids=str)
@pytest.mark.parametrize("m,cfg", CONFIGS, ids=lambda v: str(v))
def test_int4(dtype: torch.dtype, m: int, cfg: WoConfig) -> None:
    a, kw = _awq(72, 384, 128, seed=m)  # three groups
    x = _x(m, 384, dtype, seed=m + 1)
    ref = x.double() @ dequantize_awq(a.qweight, a.qzeros, a.scales, dtype).double().t()
    out = wo_matmul(x, kw.w, kw.scales, kw.zeros, cfg)
    assert out.dtype == dtype and out.shape == (m, 72)
    assert _rel(out, ref) < TOL[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
@pytest.mark.parametrize("m,cfg", CONFIGS, ids=lambda v: str(v))
def test_fp8(dtype: torch.dtype, m: int, cfg: WoConfig) -> None:
    g = torch.Generator().manual_seed(m)
    # K = 352: not a multiple of any BLOCK_K here
    q, s = (t.to(DEV) for t in quantize_per_channel(torch.randn(72, 352, generator=g)))
    x = _x(m, 352, dtype, seed=m + 2)
    ref = x.double() @ dequantize(q, s, torch.float64).t()
    out = wo_matmul(x, q, s, config=cfg)
    assert out.dtype == dtype and out.shape == (m, 72)
    assert _rel(out, ref) < TOL[dtype]


def test_default_configs_and_paths() -> None:
    """Default tiles at each row count the decode path takes, and AwqKernelWeight.matmul over
    its two paths (kernel below DEQUANT_MIN_ROWS, dequantize + GEMM from it) on 3-D input."""
    a, kw = _awq(48, 256, 128, seed=7)
    w = dequantize_awq(a.qweight, a.qzeros, a.scales, torch.float32).double()
    for m in (1, 2, 3, 17, 40, 70):
        x = _x(m, 256, torch.float32, seed=m)
        assert _rel(kw.matmul(x), x.double() @ w.t()) < TOL[torch.float32]
    x = _x(300, 256, torch.float32, seed=9)
    assert _rel(kw.matmul(x.view(3, 100, 256)).view(300, 48), x.double() @ w.t()) < 1e-5


def test_split_k_leaves_its_workspace_zero() -> None:
    """Split K sums in a shared workspace that the last program per output resets: products
    one after another (both formats, both kernels) stay exact."""
    a, kw = _awq(72, 384, 128, seed=5)
    wa = dequantize_awq(a.qweight, a.qzeros, a.scales, torch.float32).double()
    q, s = (t.to(DEV) for t in quantize_per_channel(torch.randn(72, 384)))
    wf = dequantize(q, s, torch.float64)
    for seed in (1, 2, 3):
        x = _x(2, 384, torch.float32, seed)
        out = wo_matmul(x, kw.w, kw.scales, kw.zeros, WoConfig(1, 16, 64, 5, 4, UNROLL_N=2))
        assert _rel(out, x.double() @ wa.t()) < TOL[torch.float32]
        out = wo_matmul(x, q, s, config=WoConfig(1, 16, 64, 3, 4))
        assert _rel(out, x.double() @ wf.t()) < TOL[torch.float32]
        x = _x(5, 384, torch.float32, seed)  # the tensor-core kernel
        out = wo_matmul(x, kw.w, kw.scales, kw.zeros, WoConfig(16, 16, 64, 3, 4))
        assert _rel(out, x.double() @ wa.t()) < TOL[torch.float32]
        out = wo_matmul(x, q, s, config=WoConfig(16, 32, 64, 4, 4))
        assert _rel(out, x.double() @ wf.t()) < TOL[torch.float32]
    ws, cnt = split_workspace(x.device, 5 * 72)
    assert not ws.any() and not cnt.any()


def test_bad_shapes_are_refused() -> None:
    a, kw = _awq(16, 128, 64, seed=3)
    with pytest.raises(ValueError):
        wo_matmul(_x(1, 64, torch.float32, 0), kw.w, kw.scales, kw.zeros)
    with pytest.raises(ValueError):  # zeros of another shape than the scales
        wo_matmul(_x(1, 128, torch.float32, 0), kw.w, kw.scales, kw.zeros[:1])
    with pytest.raises(ValueError):  # FP8: one scale per output row
        q, s = quantize_per_channel(torch.randn(16, 128))
        wo_matmul(_x(1, 128, torch.float32, 0), q.to(DEV), s[:8].to(DEV))
    for bm in (1, 16):
        with pytest.raises(ValueError):  # BLOCK_K 128 spans two groups of 64
            wo_matmul(_x(4, 128, torch.float32, 0), kw.w, kw.scales, kw.zeros,
                      WoConfig(bm, 16, 128))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("layer", [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)],
                         ids=str)
def test_llama3_8b_sizes_gpu(layer: tuple[int, int]) -> None:
    n, k = layer
    a, kw = _awq(n, k, 128, seed=n)
    g = torch.Generator().manual_seed(k)
    q, s = (t.cuda() for t in quantize_per_channel(torch.randn(n, k, generator=g) * k**-0.5))
    for dtype in (torch.float16, torch.bfloat16):
        wa = dequantize_awq(a.qweight, a.qzeros, a.scales, dtype).double()
        wf = dequantize(q, s, dtype).double()
        for m in (1, 2, 8, 16, 64, 200):
            x = _x(m, k, dtype, seed=m)
            assert _rel(wo_matmul(x, kw.w, kw.scales, kw.zeros), x.double() @ wa.t()) < TOL[dtype]
            assert _rel(wo_matmul(x, q, s), x.double() @ wf.t()) < TOL[dtype]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_packed_int4_keeps_large_and_small_activations_gpu(dtype: torch.dtype) -> None:
    """The packed path scales x by 2^-6 into half precision: activations of 10^4 neither
    overflow nor lose precision, those of 10^-3 are not lost to fp16's subnormals; every
    tiling equals the float path within the dtype's tolerance."""
    a, kw = _awq(4096 + 96, 4096, 128, seed=11)
    w = dequantize_awq(a.qweight, a.qzeros, a.scales, dtype).double()
    tiles = [WoConfig(1, 32, 128, 8, 2), WoConfig(1, 32, 128, 16, 4, UNROLL_N=2),
             WoConfig(1, 64, 64, 8, 4, UNROLL_N=2), WoConfig(1, 32, 128, 8, 2, ROWS=2),
             WoConfig(1, 32, 128, 8, 4, UNROLL_N=2, ROWS=2)]
    for magnitude in (1e-3, 1.0, 1e4):
        for m in (1, 2, 3):
            x = (_x(m, 4096, torch.float32, seed=m) * magnitude).to(dtype)
            x[0, :7] = torch.tensor([magnitude * 3, -magnitude * 3, 0, 0, 0, 0, 0])
            ref = x.double() @ w.t()
            for cfg in tiles:
                for words in (0, 1):  # per-value loads, or x read as words (X_WORDS)
                    c = replace(cfg, PACKED=1, X_WORDS=words)
                    packed = wo_matmul(x, kw.w, kw.scales, kw.zeros, c)
                    assert torch.isfinite(packed).all(), (magnitude, m, c)
                    assert _rel(packed, ref) < TOL[dtype], (magnitude, m, c)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_x_words_equal_the_per_value_loads_gpu(dtype: torch.dtype) -> None:
    """X_WORDS reads x as 4-byte words and forms the same half-precision pairs as the
    per-value loads, so with split K off (no atomics) the outputs are equal bit for bit;
    rows of an odd stride, or a first row at an odd half-word, take the per-value loads."""
    a, kw = _awq(4096, 4096, 128, seed=12)
    w = dequantize_awq(a.qweight, a.qzeros, a.scales, dtype).double()
    cfg = WoConfig(1, 32, 128, 1, 2, PACKED=1)
    for m in (1, 2, 3):
        x = _x(m, 4096, dtype, seed=m) * 3
        x[0, :5] = torch.tensor([7e3, -1e-3, 0.0, 2.0**-20, -6e4])  # large, small, zero, subnormal
        odd_stride = torch.zeros(m, 4097, dtype=dtype, device=DEV)[:, :4096]
        odd_stride.copy_(x)
        odd_start = torch.zeros(m * 4096 + 1, dtype=dtype, device=DEV)[1:].view(m, 4096)
        odd_start.copy_(x)
        for rows in (1, 2):
            want = wo_matmul(x, kw.w, kw.scales, kw.zeros, replace(cfg, ROWS=rows))
            assert _rel(want, x.double() @ w.t()) < TOL[dtype]
            for xx in (x, odd_stride, odd_start):
                got = wo_matmul(xx, kw.w, kw.scales, kw.zeros, replace(cfg, X_WORDS=1,
                                                                         ROWS=rows))
                assert torch.equal(got, want), (m, rows, xx.stride(), xx.data_ptr() % 4)


@pytest.mark.skipif(ptxas() is None, reason="Triton's NVIDIA backend has no ptxas here")
@pytest.mark.parametrize("x_dtype,words,rows,unroll", [
    ("fp16", 0, 1, 1), ("fp16", 1, 1, 1), ("fp16", 1, 2, 2), ("bf16", 0, 2, 1),
    ("bf16", 1, 2, 2)], ids=str)
def test_packed_path_compiles_for_sm90(x_dtype: str, words: int, rows: int,
                                       unroll: int) -> None:
    """The packed path's inline PTX is GPU-only (the interpreter cannot run it): compiled
    here for an H100/H200 through ptxas, in a process outside the interpreter. X_WORDS on
    float16 takes its pairs with byte permutes; bfloat16 words and the per-value path use
    none."""
    cubin, prmt = compile_in_subprocess("int4", x_dtype, str(words), str(rows), str(unroll))
    assert cubin > 0
    assert (prmt > 0) == (bool(words) and x_dtype == "fp16"), prmt
