"""The fused Triton element-wise kernels (srt/layers/fused_triton.py) against the torch code they
replace, on random inputs with poisoned outputs; without CUDA in Triton's interpreter."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported

pytest.importorskip("triton")

from srt.layers.fused_triton import add_rmsnorm, rope_and_store, silu_and_mul  # noqa: E402
from srt.layers.rotary import RotaryEmbedding  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _same(a: torch.Tensor, b: torch.Tensor) -> None:
    """Bitwise equal; except bfloat16 in Triton's interpreter, whose float32 -> bfloat16
    conversion truncates instead of rounding to nearest (the GPU rounds): a few ulps there."""
    if a.dtype == torch.bfloat16 and DEV == "cpu":
        torch.testing.assert_close(a.float(), b.float(), rtol=3e-2, atol=5e-2)
    else:
        assert torch.equal(a, b)


def _rope_same(a: torch.Tensor, b: torch.Tensor) -> None:
    """The rotation's products and sum: on the GPU the compiler contracts a multiply and an add
    into one fused multiply-add, which skips one rounding: within an ulp of the terms there."""
    if DEV == "cpu":
        return _same(a, b)
    tol = {torch.float32: 1e-6, torch.bfloat16: 8e-3, torch.float16: 1e-3}[a.dtype]
    torch.testing.assert_close(a.float(), b.float(), rtol=tol, atol=4 * tol)


def _torch_rmsnorm(x, w, eps, residual=None):
    """The reference: srt/layers/layernorm.py's torch path."""
    if residual is not None:
        x = x + residual
        residual = x
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    out = w * h.to(x.dtype)
    return out if residual is None else (out, residual)


def _close(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype) -> None:
    # One unit in the last place of the dtype: the float32 sum inside the norm may be ordered
    # differently, which can flip a rounding.
    if dtype == torch.bfloat16 and DEV == "cpu":
        return _same(a, b)  # the interpreter's truncating conversions
    tol = {torch.float32: 1e-5, torch.bfloat16: 8e-3, torch.float16: 1e-3}[dtype]
    torch.testing.assert_close(a.float(), b.float(), rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,hidden", [(1, 64), (5, 96), (3, 200)])
def test_add_rmsnorm(dtype: torch.dtype, rows: int, hidden: int) -> None:
    g = torch.Generator().manual_seed(rows * hidden)
    x = torch.randn(rows, hidden, generator=g).to(dtype).to(DEV)
    r = torch.randn(rows, hidden, generator=g).to(dtype).to(DEV)
    w = (1 + 0.5 * torch.randn(hidden, generator=g)).to(dtype).to(DEV)
    out = add_rmsnorm(x, w, 1e-5)
    assert out.isfinite().all()
    _close(out, _torch_rmsnorm(x, w, 1e-5), dtype)
    out, res = add_rmsnorm(x, w, 1e-5, r)
    ref_out, ref_res = _torch_rmsnorm(x, w, 1e-5, r)
    _same(res, ref_res)  # the sum is rounded exactly as torch rounds it
    _close(out, ref_out, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,n", [(1, 64), (4, 1500), (7, 33)])
def test_silu_and_mul(dtype: torch.dtype, rows: int, n: int) -> None:
    g = torch.Generator().manual_seed(n)
    x = (3 * torch.randn(rows, 2 * n, generator=g)).to(dtype).to(DEV)
    gate, up = x.chunk(2, dim=-1)
    ref = torch.nn.functional.silu(gate) * up
    out = silu_and_mul(x)
    assert out.shape == (rows, n)
    # exp may differ by an ulp from torch's; the rounding steps are the same
    _close(out, ref, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens,heads,kv_heads,dim", [(1, 4, 2, 16), (6, 8, 2, 32),
                                                       (3, 20, 4, 64), (2, 3, 3, 8)])
def test_rope_and_store(dtype: torch.dtype, tokens: int, heads: int, kv_heads: int,
                        dim: int) -> None:
    g = torch.Generator().manual_seed(tokens * heads + dim)
    rot = RotaryEmbedding(dim, 512, 10000.0).to(DEV)
    width = (heads + 2 * kv_heads) * dim
    qkv = torch.randn(tokens, width, generator=g).to(dtype).to(DEV)
    q, k, v = qkv.split([heads * dim, kv_heads * dim, kv_heads * dim], dim=-1)
    q = q.view(tokens, heads, dim)
    k = k.view(tokens, kv_heads, dim)
    v = v.view(tokens, kv_heads, dim)
    positions = torch.randint(0, 512, (tokens,), generator=g).to(DEV)
    ref_q, ref_k = rot(positions, q.clone(), k.clone())
    ref_v = v.clone()
    slots = 40
    k_buf = torch.full((slots, kv_heads, dim), float("nan"), dtype=dtype, device=DEV)
    v_buf = torch.full_like(k_buf, float("nan"))
    loc = torch.randperm(slots, generator=g)[:tokens].to(DEV)
    out_q = rope_and_store(q, k, v, positions, rot.cos_cache, rot.sin_cache, k_buf, v_buf, loc)
    assert out_q.is_contiguous()
    _rope_same(out_q, ref_q)
    _rope_same(k, ref_k)  # rotated in place
    assert torch.equal(v, ref_v)  # untouched
    assert torch.equal(k_buf[loc], k) and torch.equal(v_buf[loc], ref_v)
    others = torch.ones(slots, dtype=torch.bool)
    others[loc.cpu()] = False
    assert k_buf[others.to(DEV)].isnan().all() and v_buf[others.to(DEV)].isnan().all()


def test_rope_without_store() -> None:
    g = torch.Generator().manual_seed(3)
    rot = RotaryEmbedding(16, 64, 500000.0, {"rope_type": "llama3", "factor": 8.0,
                                               "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                               "original_max_position_embeddings": 32}).to(DEV)
    q = torch.randn(5, 4, 16, generator=g).to(DEV)
    k = torch.randn(5, 2, 16, generator=g).to(DEV)
    v = torch.randn(5, 2, 16, generator=g).to(DEV)
    pos = torch.arange(5).to(DEV) * 11
    ref_q, ref_k = rot(pos, q.clone(), k.clone())
    out_q = rope_and_store(q, k, v, pos, rot.cos_cache, rot.sin_cache)
    _rope_same(out_q, ref_q)
    _rope_same(k, ref_k)
