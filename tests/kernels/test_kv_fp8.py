"""An FP8 KV cache (`--kv-cache-dtype fp8_e4m3 / fp8_e5m2`) through the Triton kernels, the
fused rope-and-store kernel and the torch backend.

The pool holds round_fp8(clamp(x / scale)); the references attend over the dequantized values
(stored * scale) in float64, so the kernels are held to the same limits as with a model-dtype
pool (1e-3 float32, 1e-2 bfloat16). Unwritten slots, stale req_to_token entries and outputs are
NaN before the call; scales other than 1 make a kernel that forgets them fail by far.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported

pytest.importorskip("triton")

from srt.layers.attention.triton_ops import (  # noqa: E402
    decode_attention_fwd,
    extend_attention_fwd,
)
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from srt.layers.attention.triton_ops.decode_attention import (  # noqa: E402
    decode_workspace_numel,
    fp8_pairs,
)
from srt.layers.attention.triton_ops.decode_tiles import _fp8_pair_halves  # noqa: E402
from srt.layers.fused_triton import rope_and_store  # noqa: E402
from srt.layers.kv_cache_dtype import dequantize_kv, quantize_kv  # noqa: E402
from srt.layers.rotary import RotaryEmbedding  # noqa: E402
from tests.kernels.test_triton_attention import (  # noqa: E402
    DEV,
    NAN,
    SMALL_BLOCK_N,
    TOL,
    fused_qkv,
    ivec,
    make_pool,
    reference,
    rel_err,
)

FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]
# (k_scale, v_scale): 1.0, and scales that put N(0, 1) values near the top of e4m3's range
SCALES = [(1.0, 1.0), (0.011, 0.0093)]


def _fp8_equal(got: torch.Tensor, want: torch.Tensor, exact: bool = True) -> None:
    """Bitwise equal on the GPU (`exact`; else within one FP8 step). Triton's interpreter (3.x)
    converts float32 to FP8 its own way: where rounding carries into the next binade it gives
    half the right power of two (124.4 becomes 64, not 128), and ties may round away from
    even; there, values are held to one FP8 step."""
    if DEV == "cpu":
        carry = (got * 2 == want) & (want.abs().log2() == want.abs().log2().round())
        got = torch.where(carry, want, got)
        assert carry.float().mean() < 0.1
        exact = False
    if exact:
        assert torch.equal(got, want)
    else:  # one FP8 step (e4m3: 1/8 relative)
        torch.testing.assert_close(got, want, rtol=0.13, atol=0.05)


def to_fp8_pool(pool, kv_dtype: torch.dtype, k_scale: float, v_scale: float, dtype):
    """The pool's buffers quantized (NaN slots stay NaN) and each request's context as the
    kernels must see it: dequantized, in `dtype`."""
    pool.k_buffer = quantize_kv(pool.k_buffer, k_scale, kv_dtype)
    pool.v_buffer = quantize_kv(pool.v_buffer, v_scale, kv_dtype)
    pool.ctx_k = [dequantize_kv(quantize_kv(x, k_scale, kv_dtype), k_scale, dtype)
                  for x in pool.ctx_k]
    pool.ctx_v = [dequantize_kv(quantize_kv(x, v_scale, kv_dtype), v_scale, dtype)
                  for x in pool.ctx_v]
    return pool


@pytest.mark.parametrize("scales", SCALES, ids=str)
@pytest.mark.parametrize("kv_dtype", FP8, ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_decode_fp8_pool(dtype: torch.dtype, kv_dtype: torch.dtype, scales) -> None:
    k_scale, v_scale = scales
    g = torch.Generator().manual_seed(7)
    lens, heads, kv_heads, d, splits = [1, 37, 5, 20], 4, 2, 64, 3
    pool = to_fp8_pool(make_pool(lens, lens, kv_heads, d, dtype, g), kv_dtype, k_scale,
                       v_scale, dtype)
    q, _, _ = fused_qkv(len(lens), heads, kv_heads, d, dtype, g)
    o = torch.full(q.shape, NAN, dtype=dtype, device=DEV)
    ws = torch.full((decode_workspace_numel(len(lens), heads, d, splits),), NAN, device=DEV)
    decode_attention_fwd(q, pool.k_buffer, pool.v_buffer, o, pool.req_to_token, pool.rows,
                         ivec(lens), d ** -0.5, splits, ws, block_n=SMALL_BLOCK_N,
                         k_scale=k_scale, v_scale=v_scale)
    want = torch.cat([reference(q[i:i + 1], pool.ctx_k[i], pool.ctx_v[i], n - 1, d ** -0.5)
                      for i, n in enumerate(lens)])
    assert rel_err(o, want) < TOL[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_decode_fp8_pool_shared_prefix(dtype: torch.dtype) -> None:
    """The shared-prefix stage reads the FP8 pool with the same scales (bfloat16: as words of
    two channels)."""
    g = torch.Generator().manual_seed(3)
    shared, lens, k_scale, v_scale = 17, [18, 47, 24], 0.02, 0.015
    kv_dtype = torch.float8_e4m3fn
    pool = make_pool(lens, lens, 2, 64, dtype, g)
    rows = pool.rows.tolist()
    for i in range(1, len(lens)):
        pool.req_to_token[rows[i], :shared] = pool.req_to_token[rows[0], :shared]
        pool.ctx_k[i][:shared] = pool.ctx_k[0][:shared]
        pool.ctx_v[i][:shared] = pool.ctx_v[0][:shared]
    pool = to_fp8_pool(pool, kv_dtype, k_scale, v_scale, dtype)
    q, _, _ = fused_qkv(len(lens), 4, 2, 64, dtype, g)
    o = torch.full(q.shape, NAN, dtype=dtype, device=DEV)
    decode_attention_fwd(q, pool.k_buffer, pool.v_buffer, o, pool.req_to_token, pool.rows,
                         ivec(lens), 0.125, 2, shared_len=shared, shared_splits=2,
                         block_n=SMALL_BLOCK_N, k_scale=k_scale, v_scale=v_scale)
    want = torch.cat([reference(q[i:i + 1], pool.ctx_k[i], pool.ctx_v[i], n - 1, 0.125)
                      for i, n in enumerate(lens)])
    assert rel_err(o, want) < TOL[dtype]


@triton.jit
def _pair_halves_kernel(w_ptr, lo_ptr, hi_ptr, E5M2: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    lo, hi = _fp8_pair_halves(tl.load(w_ptr + offs), E5M2)
    tl.store(lo_ptr + offs, lo)
    tl.store(hi_ptr + offs, hi)


@pytest.mark.parametrize("kv_dtype", FP8, ids=str)
def test_fp8_pair_halves_every_byte_pair(kv_dtype: torch.dtype) -> None:
    """Every int16 word of two FP8 bytes: the low byte's value in the first float16 tile, the
    high byte's in the second, exact (e4m3 times 2^-8), on every finite value, subnormals and
    signed zeros included."""
    b = torch.arange(256, dtype=torch.uint8)
    pairs = torch.stack([b.repeat_interleave(256), b.repeat(256)], 1).contiguous()  # (lo, hi)
    words = pairs.view(torch.int16).view(-1).to(DEV)
    lo = torch.full((words.numel(),), NAN, dtype=torch.float16, device=DEV)
    hi = torch.full_like(lo, NAN)
    e5m2 = kv_dtype == torch.float8_e5m2
    _pair_halves_kernel[(words.numel() // 1024,)](words, lo, hi, E5M2=e5m2, BLOCK=1024)
    values = pairs.view(kv_dtype).float() * (1.0 if e5m2 else 2.0 ** -8)
    finite = values.isfinite()
    want = values.to(torch.float16)
    for got, col in ((lo, 0), (hi, 1)):
        ok = finite[:, col]
        assert torch.equal(got.cpu()[ok].view(torch.int16), want[ok, col].view(torch.int16))


def test_fp8_pairs_rule() -> None:
    """Words of two channels for half-precision queries of an even head size >= 32."""
    for kv in FP8:
        assert fp8_pairs(torch.bfloat16, kv, 128) and fp8_pairs(torch.float16, kv, 64)
        assert not fp8_pairs(torch.float32, kv, 128)  # float32 queries: tiles as float32
        assert not fp8_pairs(torch.bfloat16, kv, 16) and not fp8_pairs(torch.bfloat16, kv, 65)
    assert not fp8_pairs(torch.bfloat16, torch.bfloat16, 128)


@pytest.mark.parametrize("scales", SCALES, ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_extend_fp8_pool(dtype: torch.dtype, scales) -> None:
    """The prefix comes from the FP8 pool (dequantized), the new tokens as computed."""
    k_scale, v_scale = scales
    g = torch.Generator().manual_seed(11)
    prefix, extend, heads, kv_heads, d = [0, 13, 30, 5], [5, 1, 24, 17], 4, 2, 64
    seq = [p + e for p, e in zip(prefix, extend)]
    pool = make_pool(seq, prefix, kv_heads, d, dtype, g)
    k_new = [x[p:] for x, p in zip(pool.ctx_k, prefix)]
    v_new = [x[p:] for x, p in zip(pool.ctx_v, prefix)]
    pool = to_fp8_pool(pool, torch.float8_e4m3fn, k_scale, v_scale, dtype)
    ctx_k = [torch.cat((x[:p], n)) for x, p, n in zip(pool.ctx_k, prefix, k_new)]
    ctx_v = [torch.cat((x[:p], n)) for x, p, n in zip(pool.ctx_v, prefix, v_new)]
    q, _, _ = fused_qkv(sum(extend), heads, kv_heads, d, dtype, g)
    o = torch.full(q.shape, NAN, dtype=dtype, device=DEV)
    starts = [sum(extend[:i]) for i in range(len(extend))]
    extend_attention_fwd(q, torch.cat(k_new), torch.cat(v_new), o, pool.k_buffer,
                         pool.v_buffer, pool.req_to_token, pool.rows, ivec(prefix),
                         ivec(extend), ivec(starts), max(extend), d ** -0.5, block_m=16,
                         block_n=SMALL_BLOCK_N, k_scale=k_scale, v_scale=v_scale)
    want = torch.cat([reference(q[s:s + e], ctx_k[i], ctx_v[i], prefix[i], d ** -0.5)
                      for i, (s, e) in enumerate(zip(starts, extend))])
    assert rel_err(o, want) < TOL[dtype]


def test_scales_matter() -> None:
    """The check above can fail: reading the pool with scale 1 instead of its scales is far
    off."""
    g = torch.Generator().manual_seed(7)
    lens, dtype = [9, 30], torch.float32
    pool = to_fp8_pool(make_pool(lens, lens, 2, 64, dtype, g), torch.float8_e4m3fn, 0.011,
                       0.0093, dtype)
    q, _, _ = fused_qkv(len(lens), 4, 2, 64, dtype, g)
    o = torch.full(q.shape, NAN, dtype=dtype, device=DEV)
    decode_attention_fwd(q, pool.k_buffer, pool.v_buffer, o, pool.req_to_token, pool.rows,
                         ivec(lens), 0.125, 1, block_n=SMALL_BLOCK_N)
    want = torch.cat([reference(q[i:i + 1], pool.ctx_k[i], pool.ctx_v[i], n - 1, 0.125)
                      for i, n in enumerate(lens)])
    assert rel_err(o, want) > 10.0


def test_pool_dtype_mismatch_is_refused() -> None:
    g = torch.Generator().manual_seed(1)
    pool = make_pool([4], [4], 2, 64, torch.float16, g)
    q, _, _ = fused_qkv(1, 4, 2, 64, torch.float32, g)
    with pytest.raises(ValueError, match="dtype mismatch"):
        decode_attention_fwd(q, pool.k_buffer, pool.v_buffer, torch.empty_like(q),
                             pool.req_to_token, pool.rows, ivec([4]), 0.125, 1)


@pytest.mark.parametrize("kv_dtype", FP8, ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_rope_and_store_fp8(dtype: torch.dtype, kv_dtype: torch.dtype) -> None:
    """The fused kernel writes exactly what the torch path writes: the rotated k and the v,
    divided by their scales, clamped, rounded to FP8."""
    g = torch.Generator().manual_seed(5)
    tokens, heads, kv_heads, dim, k_scale, v_scale = 6, 8, 2, 32, 0.004, 0.0071
    rot = RotaryEmbedding(dim, 512, 10000.0).to(DEV)
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * dim, generator=g).to(dtype).to(DEV)
    q, k, v = qkv.split([heads * dim, kv_heads * dim, kv_heads * dim], dim=-1)
    q, k, v = (x.view(tokens, -1, dim) for x in (q, k, v))
    positions = torch.randint(0, 512, (tokens,), generator=g).to(DEV)
    _, ref_k = rot(positions, q.clone(), k.clone())
    k_buf = torch.full((40, kv_heads, dim), NAN, device=DEV).to(kv_dtype)
    v_buf = k_buf.clone()
    loc = torch.randperm(40, generator=g)[:tokens].to(DEV)
    rope_and_store(q, k, v, positions, rot.cos_cache, rot.sin_cache, k_buf, v_buf, loc,
                   k_scale=k_scale, v_scale=v_scale)
    want_k = quantize_kv(k, k_scale, kv_dtype).float()  # k: rotated in place
    want_v = quantize_kv(v, v_scale, kv_dtype).float()
    assert (want_k.abs().amax() > 200) if kv_dtype == torch.float8_e4m3fn else True
    # bitwise where the rotated k is bitwise torch's; one FP8 step where bf16 rounding in the
    # interpreter differs (see test_fused_triton._same)
    if dtype == torch.float32:
        _fp8_equal(k_buf[loc].float(), want_k)
    else:
        _fp8_equal(k_buf[loc].float(), want_k, exact=False)
    _fp8_equal(v_buf[loc].float(), want_v)
    # k is rotated in place, as torch rotates it (the GPU contracts a multiply and an add
    # into one fused multiply-add: within an ulp there, as test_fused_triton allows)
    torch.testing.assert_close(k.float(), ref_k.float(), rtol=0 if DEV == "cpu" and
                               dtype == torch.float32 else 8e-3, atol=0 if DEV == "cpu" and
                               dtype == torch.float32 else 3e-2)
    others = torch.ones(40, dtype=torch.bool)
    others[loc.cpu()] = False
    assert k_buf[others.to(DEV)].float().isnan().all()
