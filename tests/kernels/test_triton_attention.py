"""The Triton attention kernels and TritonAttnBackend against float64 references.

Without CUDA the kernels run in the Triton interpreter (TRITON_INTERPRET=1, set below before
triton is imported) on small shapes; the `gpu` tests use real sizes (32 heads / 8 KV heads,
head_dim 128, bf16, contexts up to 4096) and are skipped without a GPU.

Every case: GQA, ragged lengths, several requests, request rows and pool slots shuffled, stale
`req_to_token` entries and every unwritten pool slot (including the padding slot) NaN, outputs
filled with NaN before the call, random (never zero) inputs. Error measure:
    rel_err = max|out - ref| / max|ref|   over the whole output,
with ref computed in float64 from the same (rounded) inputs; limits 1e-3 for fp32 and 1e-2 for
bf16 (fp16 shares the bf16 limit).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from types import SimpleNamespace

import pytest
import torch

if not torch.cuda.is_available():
    # must happen before anything imports triton (the kernels are decorated at import)
    os.environ.setdefault("TRITON_INTERPRET", "1")

triton = pytest.importorskip("triton")

from srt.layers.attention.torch_backend import TorchAttnBackend  # noqa: E402
from srt.layers.attention.triton_backend import TritonAttnBackend  # noqa: E402
from srt.layers.attention.triton_ops.decode_config import DECODE_MLA_PROGRAMS_PER_SM  # noqa: E402
from srt.layers.attention.triton_ops import (  # noqa: E402
    choose_num_kv_splits,
    context_attention_fwd,
    decode_attention_fwd,
    decode_workspace,
    extend_attention_fwd,
)
from srt.layers.attention.triton_ops.prefill_attention import BlockTables  # noqa: E402
from srt.layers.attention.triton_ops.decode_attention import (  # noqa: E402
    DECODE_MAX_KV_SPLITS,
    DECODE_MIN_TOKENS_PER_SPLIT,
    DECODE_NUM_STAGES,
    DECODE_NUM_STAGES_SMALL_HEAD,
    choose_shared_splits,
    decode_num_stages,
    decode_workspace_numel,
)
from srt.layers.forward_batch import ForwardBatch, ForwardMode, forward_context  # noqa: E402
from srt.layers.radix_attention import RadixAttention  # noqa: E402
from srt.memory_pool import ReqToTokenPool, TokenToKVPool  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float32: 1e-3, torch.bfloat16: 1e-2, torch.float16: 1e-2}
HEAD_DIMS = [64, 80, 96, 128]
DTYPES = [torch.float32, torch.bfloat16]
NAN = float("nan")
# Tiles smaller than tl.dot's minimum (16) only compile in the interpreter.
SMALL_BLOCK_N = 16 if torch.cuda.is_available() else 8


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    assert out.shape == ref.shape
    assert not torch.isnan(out).any(), "unwritten (NaN) or NaN-contaminated output"
    return ((out.double() - ref).abs().max() / ref.abs().max()).item()


def reference(q: torch.Tensor, ctx_k: torch.Tensor, ctx_v: torch.Tensor, pre: int,
              scale: float, window: int | None = None, cap: float = 0.0) -> torch.Tensor:
    """q: [ext, H, D] at positions pre..pre+ext-1; ctx_k/v: [seq, Hkv, D] -> [ext, H, D] float64.
    Causal softmax attention, query head h reads KV head h // (H // Hkv); with `window` W a
    query at p sees keys p - W + 1 .. p; `cap` c > 0: scores s become c * tanh(s / c)."""
    ext, heads, _ = q.shape
    seq, kv_heads, _ = ctx_k.shape
    group = heads // kv_heads
    qd = q.double().transpose(0, 1)  # [H, ext, D]
    kd = ctx_k.double().repeat_interleave(group, 1).transpose(0, 1)  # [H, seq, D]
    vd = ctx_v.double().repeat_interleave(group, 1).transpose(0, 1)
    scores = qd @ kd.transpose(1, 2) * scale  # [H, ext, seq]
    if cap:
        scores = cap * torch.tanh(scores / cap)
    keys = torch.arange(seq, device=q.device)[None, :]
    pos = (pre + torch.arange(ext, device=q.device))[:, None]
    visible = keys <= pos
    if window:
        visible &= keys > pos - window
    scores = scores.masked_fill(~visible, float("-inf"))
    return (scores.softmax(-1) @ vd).transpose(0, 1)


def reference_gpu(q: torch.Tensor, ctx_k: torch.Tensor, ctx_v: torch.Tensor, pre: int,
                  scale: float) -> torch.Tensor:
    """Same as `reference` in float32, one KV group at a time (for the big GPU shapes)."""
    ext, heads, d = q.shape
    seq, kv_heads, _ = ctx_k.shape
    group = heads // kv_heads
    out = torch.empty(ext, heads, d, dtype=torch.float32, device=q.device)
    visible = torch.arange(seq, device=q.device)[None, :] <= (
        pre + torch.arange(ext, device=q.device))[:, None]
    for kh in range(kv_heads):
        qg = q[:, kh * group:(kh + 1) * group].float().transpose(0, 1)  # [g, ext, d]
        scores = qg @ ctx_k[:, kh].float().T * scale  # [g, ext, seq]
        scores = scores.masked_fill(~visible, float("-inf"))
        out[:, kh * group:(kh + 1) * group] = (scores.softmax(-1) @ ctx_v[:, kh].float()
                                               ).transpose(0, 1)
    return out.double()


# ====================================================================== inputs


def fused_qkv(tokens: int, heads: int, kv_heads: int, d: int, dtype: torch.dtype,
              g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q [T, H, D], k, v [T, Hkv, D] as strided views of one fused qkv tensor (as the model
    passes them), random normal."""
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * d, generator=g).to(dtype).to(DEV)
    q, k, v = qkv.split([heads * d, kv_heads * d, kv_heads * d], dim=-1)
    return (q.view(tokens, heads, d), k.view(tokens, kv_heads, d), v.view(tokens, kv_heads, d))


@dataclass
class PoolCase:
    k_buffer: torch.Tensor  # [S + 1, Hkv, D]; unwritten slots NaN
    v_buffer: torch.Tensor
    req_to_token: torch.Tensor  # [R, C]
    rows: torch.Tensor  # [bs] the requests' rows
    ctx_k: list[torch.Tensor]  # per request [seq, Hkv, D] (prefix + new), on DEV
    ctx_v: list[torch.Tensor]
    slots: list[torch.Tensor]  # per request [seq] int64 pool slots


def make_pool(seq_lens: list[int], written: list[int], kv_heads: int, d: int,
              dtype: torch.dtype, g: torch.Generator, idx_dtype: torch.dtype = torch.int32,
              spare: int = 16) -> PoolCase:
    """Shuffled slots per request; only the first written[i] tokens of request i are in the pool.
    Stale req_to_token entries point at NaN slots (spare slots or the padding slot)."""
    bs = len(seq_lens)
    size = sum(seq_lens) + spare
    k_buffer = torch.full((size + 1, kv_heads, d), NAN, dtype=dtype, device=DEV)
    v_buffer = torch.full((size + 1, kv_heads, d), NAN, dtype=dtype, device=DEV)
    perm = torch.randperm(size, generator=g)
    never_written = torch.cat([perm[sum(seq_lens):], torch.tensor([size])])
    n_rows, ctx = bs + 3, max(seq_lens) + 8
    req_to_token = never_written[torch.randint(0, len(never_written), (n_rows, ctx), generator=g)]
    rows = torch.randperm(n_rows, generator=g)[:bs]
    off = 0
    ctx_k, ctx_v, all_slots = [], [], []
    for i in range(bs):
        slots = perm[off:off + seq_lens[i]]
        off += seq_lens[i]
        req_to_token[rows[i], :seq_lens[i]] = slots
        kk = torch.randn(seq_lens[i], kv_heads, d, generator=g).to(dtype).to(DEV)
        vv = torch.randn(seq_lens[i], kv_heads, d, generator=g).to(dtype).to(DEV)
        w = slots[:written[i]].to(DEV)
        k_buffer[w] = kk[:written[i]]
        v_buffer[w] = vv[:written[i]]
        ctx_k.append(kk)
        ctx_v.append(vv)
        all_slots.append(slots)
    return PoolCase(k_buffer, v_buffer, req_to_token.to(idx_dtype).to(DEV),
                    rows.to(idx_dtype).to(DEV), ctx_k, ctx_v, all_slots)


def ivec(values: list[int], dtype: torch.dtype = torch.int32) -> torch.Tensor:
    return torch.tensor(values, dtype=dtype, device=DEV)


# ====================================================================== prefill


def run_prefill_case(lens: list[int], heads: int, kv_heads: int, d: int, dtype: torch.dtype,
                     seed: int, idx_dtype: torch.dtype = torch.int32, ref=reference,
                     tables: BlockTables | None = None, **blocks: int) -> float:
    """With `tables`, the programs come from them (filled for `lens`) and max_input_len is
    passed as 1: a kernel that still read it would leave most rows unwritten (NaN)."""
    g = torch.Generator().manual_seed(seed)
    q, k, v = fused_qkv(sum(lens), heads, kv_heads, d, dtype, g)
    o = torch.full(q.shape, NAN, dtype=dtype, device=DEV)
    starts = [sum(lens[:i]) for i in range(len(lens))]
    scale = d ** -0.5
    if tables is not None:
        tables.fill(lens)
    context_attention_fwd(q, k, v, o, ivec(starts, idx_dtype), ivec(lens, idx_dtype),
                          max(lens) if tables is None else 1, scale, block_tables=tables,
                          **blocks)
    want = torch.cat([ref(q[s:s + n], k[s:s + n], v[s:s + n], 0, scale)
                      for s, n in zip(starts, lens)])
    return rel_err(o, want)


@pytest.mark.parametrize("d", HEAD_DIMS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_prefill_matches_reference(dtype: torch.dtype, d: int) -> None:
    # small tiles so the interpreter sees several query blocks, off-diagonal and diagonal key
    # blocks, and partial blocks
    idx = torch.int64 if d in (80, 128) else torch.int32
    err = run_prefill_case([1, 17, 40], 4, 2, d, dtype, seed=d, idx_dtype=idx,
                           block_m=16, block_n=SMALL_BLOCK_N)
    assert err < TOL[dtype], err


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_prefill_default_tiles(dtype: torch.dtype) -> None:
    err = run_prefill_case([3, 70, 33], 4, 1, 128, dtype, seed=5)
    assert err < TOL[dtype], err


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_prefill_block_tables_match_reference(dtype: torch.dtype) -> None:
    """The grid of a prefill graph: programs from a block table sized for more tokens and
    requests than the batch has (entries -1 past its blocks), refilled for a second batch."""
    tables = BlockTables(96, 6, torch.device(DEV))
    for seed, lens in enumerate(([1, 17, 40], [33, 2, 16, 5, 9])):
        err = run_prefill_case(lens, 4, 2, 64, dtype, seed=seed, tables=tables, block_m=16,
                               block_n=SMALL_BLOCK_N)
        assert err < TOL[dtype], err
    assert set(tables.tables) == {16}


def test_block_table_entries() -> None:
    tables = BlockTables(100, 4, torch.device("cpu"))
    entries = tables.entries([40, 1, 17], 16)
    assert len(entries) == tables.size(16) == 7 + 4
    blocks = [(e >> 16, e & 0xFFFF) for e in entries if e >= 0]
    # every query block once, the ones with the most keys first
    assert sorted(blocks) == [(0, 0), (0, 1), (0, 2), (1, 0), (2, 0), (2, 1)]
    assert [b for _, b in blocks] == sorted((b for _, b in blocks), reverse=True)
    assert entries[len(blocks):] == [-1] * (len(entries) - len(blocks))
    with pytest.raises(ValueError, match="exceed"):
        tables.entries([60, 50], 16)
    with pytest.raises(ValueError, match="exceed"):
        tables.entries([1] * 5, 16)


def test_prefill_poisoned_output_is_detected() -> None:
    """The NaN poisoning catches an output the kernel did not write (max_input_len too small)."""
    g = torch.Generator().manual_seed(0)
    q, k, v = fused_qkv(20, 4, 2, 64, torch.float32, g)
    o = torch.full(q.shape, NAN, device=DEV)
    context_attention_fwd(q, k, v, o, ivec([0]), ivec([20]), 8, 0.125, block_m=16, block_n=SMALL_BLOCK_N)
    assert torch.isnan(o[16:]).all() and not torch.isnan(o[:16]).any()


# ====================================================================== extend


def run_extend_case(prefix_lens: list[int], extend_lens: list[int], heads: int, kv_heads: int,
                    d: int, dtype: torch.dtype, seed: int, idx_dtype: torch.dtype = torch.int32,
                    ref=reference, window: int | None = None, cap: float = 0.0,
                    **blocks: int) -> float:
    g = torch.Generator().manual_seed(seed)
    seq_lens = [p + e for p, e in zip(prefix_lens, extend_lens)]
    # only the prefixes are in the pool: the new tokens must come from k_extend / v_extend
    pool = make_pool(seq_lens, prefix_lens, kv_heads, d, dtype, g, idx_dtype)
    q, _, _ = fused_qkv(sum(extend_lens), heads, kv_heads, d, dtype, g)
    k_ext = torch.cat([kk[p:] for kk, p in zip(pool.ctx_k, prefix_lens)])
    v_ext = torch.cat([vv[p:] for vv, p in zip(pool.ctx_v, prefix_lens)])
    o = torch.full(q.shape, NAN, dtype=dtype, device=DEV)
    starts = [sum(extend_lens[:i]) for i in range(len(extend_lens))]
    scale = d ** -0.5
    extend_attention_fwd(q, k_ext, v_ext, o, pool.k_buffer, pool.v_buffer, pool.req_to_token,
                         pool.rows, ivec(prefix_lens, idx_dtype), ivec(extend_lens, idx_dtype),
                         ivec(starts, idx_dtype), max(extend_lens), scale,
                         sliding_window=window, logit_cap=cap, **blocks)
    extra = dict(window=window, cap=cap) if window or cap else {}
    want = torch.cat([ref(q[s:s + e], pool.ctx_k[i], pool.ctx_v[i], prefix_lens[i], scale,
                          **extra) for i, (s, e) in enumerate(zip(starts, extend_lens))])
    return rel_err(o, want)


@pytest.mark.parametrize("d", HEAD_DIMS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_extend_matches_reference(dtype: torch.dtype, d: int) -> None:
    idx = torch.int64 if d in (64, 96) else torch.int32
    err = run_extend_case([0, 13, 30, 5], [5, 1, 24, 17], 4, 2, d, dtype, seed=d + 1,
                          idx_dtype=idx, block_m=16, block_n=SMALL_BLOCK_N)
    assert err < TOL[dtype], err


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_extend_default_tiles(dtype: torch.dtype) -> None:
    err = run_extend_case([0, 40, 7], [33, 70, 2], 4, 1, 80, dtype, seed=9)
    assert err < TOL[dtype], err


@pytest.mark.parametrize("window,cap", [(5, 0.0), (17, 0.0), (1, 0.0), (9, 0.3), (None, 0.3)])
def test_extend_sliding_window_and_soft_cap(window: int | None, cap: float) -> None:
    """Windows shorter than tiles, across the prefix / new-token boundary and wider than
    some contexts (rows that see no key of a whole tile); a cap small enough to bite
    (random scores are mostly beyond it)."""
    err = run_extend_case([0, 13, 30, 5, 40], [5, 1, 24, 17, 3], 4, 2, 64, torch.float32,
                          seed=window or 3, window=window, cap=cap, block_m=16,
                          block_n=SMALL_BLOCK_N)
    assert err < TOL[torch.float32], err


# ====================================================================== decode


def run_decode_case(seq_lens: list[int], heads: int, kv_heads: int, d: int, dtype: torch.dtype,
                    num_kv_splits: int, seed: int, idx_dtype: torch.dtype = torch.int32,
                    ref=reference, workspace: torch.Tensor | None = None,
                    window: int | None = None, cap: float = 0.0, **blocks: int) -> float:
    g = torch.Generator().manual_seed(seed)
    pool = make_pool(seq_lens, seq_lens, kv_heads, d, dtype, g, idx_dtype)
    q, _, _ = fused_qkv(len(seq_lens), heads, kv_heads, d, dtype, g)
    o = torch.full(q.shape, NAN, dtype=dtype, device=DEV)
    scale = d ** -0.5
    extra = dict(sliding_window=window, logit_cap=cap) if window or cap else {}
    decode_attention_fwd(q, pool.k_buffer, pool.v_buffer, o, pool.req_to_token, pool.rows,
                         ivec(seq_lens, idx_dtype), scale, num_kv_splits, workspace, **extra,
                         **blocks)
    ref_extra = dict(window=window, cap=cap) if window or cap else {}
    want = torch.cat([ref(q[i:i + 1], pool.ctx_k[i], pool.ctx_v[i], n - 1, scale, **ref_extra)
                      for i, n in enumerate(seq_lens)])
    return rel_err(o, want)


@pytest.mark.parametrize("splits", [1, 3, 8])
@pytest.mark.parametrize("d", HEAD_DIMS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_decode_matches_reference(dtype: torch.dtype, d: int, splits: int) -> None:
    # seq 1 and 5 with 8 splits: more splits than tokens (empty splits); a NaN-filled,
    # reused workspace must not leak into the result
    lens = [1, 37, 5, 20]
    ws = torch.full((decode_workspace_numel(len(lens), 4, d, splits) + 7,), NAN, device=DEV)
    idx = torch.int64 if (d + splits) % 2 else torch.int32
    err = run_decode_case(lens, 4, 2, d, dtype, splits, seed=d * splits, idx_dtype=idx,
                          workspace=ws, block_n=SMALL_BLOCK_N)
    assert err < TOL[dtype], err


@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("window,cap", [(6, 0.0), (25, 0.3), (None, 0.3)])
def test_decode_sliding_window_and_soft_cap(window: int | None, cap: float,
                                            splits: int) -> None:
    """Only the window's positions are read (contexts shorter and longer than it), the splits
    spread over them; soft-capped scores."""
    lens = [1, 37, 5, 20, 64]
    err = run_decode_case(lens, 4, 2, 64, torch.float32, splits, seed=splits + 11,
                          window=window, cap=cap, block_n=SMALL_BLOCK_N)
    assert err < TOL[torch.float32], err


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_decode_default_block_and_mha_and_large_group(dtype: torch.dtype) -> None:
    # default BLOCK_N, no workspace given; MHA (group 1) and a group of 32 (> 16 padded rows)
    assert run_decode_case([70, 3], 4, 4, 64, dtype, 4, seed=3) < TOL[dtype]
    assert run_decode_case([70, 3], 32, 1, 64, dtype, 2, seed=4) < TOL[dtype]


def run_shared_prefix_case(seq_lens: list[int], shared: int, heads: int, kv_heads: int, d: int,
                           dtype: torch.dtype, splits: int, shared_splits: int, seed: int,
                           **blocks: int) -> float:
    """Every request's first `shared` positions are request 0's slots (one cached prefix)."""
    g = torch.Generator().manual_seed(seed)
    pool = make_pool(seq_lens, seq_lens, kv_heads, d, dtype, g)
    rows = pool.rows.tolist()
    for i in range(1, len(seq_lens)):
        pool.req_to_token[rows[i], :shared] = pool.req_to_token[rows[0], :shared]
        pool.ctx_k[i][:shared] = pool.ctx_k[0][:shared]
        pool.ctx_v[i][:shared] = pool.ctx_v[0][:shared]
    q, _, _ = fused_qkv(len(seq_lens), heads, kv_heads, d, dtype, g)
    scale = d ** -0.5
    ws = torch.full((decode_workspace_numel(len(seq_lens), heads, d, splits + shared_splits),),
                    NAN, device=DEV)
    o = torch.full(q.shape, NAN, dtype=dtype, device=DEV)
    decode_attention_fwd(q, pool.k_buffer, pool.v_buffer, o, pool.req_to_token, pool.rows,
                         ivec(seq_lens), scale, splits, ws, shared_len=shared,
                         shared_splits=shared_splits, **blocks)
    want = torch.cat([reference(q[i:i + 1], pool.ctx_k[i], pool.ctx_v[i], n - 1, scale)
                      for i, n in enumerate(seq_lens)])
    plain = torch.full(q.shape, NAN, dtype=dtype, device=DEV)
    decode_attention_fwd(q, pool.k_buffer, pool.v_buffer, plain, pool.req_to_token, pool.rows,
                         ivec(seq_lens), scale, splits, **blocks)
    assert rel_err(o, plain.double()) < TOL[dtype]
    return rel_err(o, want)


@pytest.mark.parametrize("shared,splits,shared_splits", [(1, 1, 1), (17, 3, 1), (40, 1, 4),
                                                         (33, 8, 3)])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_decode_shared_prefix_matches_reference(dtype: torch.dtype, shared: int, splits: int,
                                                shared_splits: int) -> None:
    # the shortest request has one own position; more splits than positions in some cases
    lens = [shared + 1, shared + 30, shared + 7, shared + 50, shared + 2]
    err = run_shared_prefix_case(lens, shared, 4, 2, 64, dtype, splits, shared_splits,
                                 seed=shared, block_n=SMALL_BLOCK_N)
    assert err < TOL[dtype], err


def test_decode_shared_prefix_many_row_blocks() -> None:
    # 40 requests x a group of 4 = 160 query rows: three row blocks of the shared stage, the
    # last one partial; head_dim 80 (padded to 128)
    g = torch.Generator().manual_seed(1)
    lens = [37 + int(x) for x in torch.randint(1, 20, (40,), generator=g)]
    err = run_shared_prefix_case(lens, 37, 4, 1, 80, torch.float32, 2, 2, seed=2)
    assert err < TOL[torch.float32], err


def test_decode_shared_prefix_argument_checks() -> None:
    with pytest.raises(ValueError):
        run_shared_prefix_case([5, 6], 3, 4, 2, 64, torch.float32, 1, 0, seed=0)
    with pytest.raises(ValueError):  # a workspace sized without the shared splits
        g = torch.Generator().manual_seed(0)
        pool = make_pool([5, 6], [5, 6], 2, 64, torch.float32, g)
        q, _, _ = fused_qkv(2, 4, 2, 64, torch.float32, g)
        decode_attention_fwd(q, pool.k_buffer, pool.v_buffer, torch.empty_like(q),
                             pool.req_to_token, pool.rows, ivec([5, 6]), 0.1, 2,
                             decode_workspace(2, 4, 64, 2, DEV), shared_len=3, shared_splits=1)


def test_decode_workspace_checks() -> None:
    ws = decode_workspace(2, 4, 64, 3, DEV)
    assert ws.dtype == torch.float32 and ws.numel() == 2 * 4 * 3 * 65
    with pytest.raises(ValueError):
        run_decode_case([5, 6, 7], 4, 2, 64, torch.float32, 3, seed=0, workspace=ws)
    # a smaller batch with more splits fits the same flat workspace
    assert run_decode_case([5], 4, 2, 64, torch.float32, 6, seed=0, workspace=ws) < 1e-3


def test_decode_num_stages_fit_shared_memory() -> None:
    """The tuned depth where shared memory holds it (an H200: 227 KiB a block), fewer K/V
    tiles on 99 KiB GPUs (one stage of d 128, 64 tokens, bf16 is 32 KiB), never below 2."""
    h200, small = 227 << 10, 99 << 10
    assert DECODE_NUM_STAGES == 3 and DECODE_NUM_STAGES_SMALL_HEAD == 4
    assert decode_num_stages(128, 64, 2, h200) == 3
    assert decode_num_stages(128, 64, 2, None) == 3  # unknown: the tuned depth
    assert decode_num_stages(128, 64, 2, small) == 2  # 3 x 32 KiB + 16 KiB > 99 KiB
    assert decode_num_stages(128, 64, 1, small) == 3  # an FP8 pool's tiles are half the size
    assert decode_num_stages(64, 64, 2, h200) == 4
    assert decode_num_stages(64, 64, 4, small) == 2  # float32, d 64: 4 x 32 KiB too many
    assert decode_num_stages(256, 64, 2, 48 << 10) == 2  # never below 2


def test_choose_shared_splits() -> None:
    """About 4 programs per SM over (kv heads x blocks of 64 query rows), >= 256 prefix tokens
    a split, within [1, max_splits]."""
    sms = 132
    # 512 requests x 4 heads = 32 row blocks, 8 KV heads: 256 programs a split -> 3 splits
    assert choose_shared_splits(512, 4, 8, 2048, num_sms=sms) == 3
    assert choose_shared_splits(16, 4, 8, 2048, num_sms=sms) == 8  # 1 block: 256-token splits
    assert choose_shared_splits(16, 4, 8, 100, num_sms=sms) == 1
    assert choose_shared_splits(2, 4, 8, 1 << 20, num_sms=sms, max_splits=16) == 16
    assert choose_shared_splits(1 << 16, 4, 8, 2048, num_sms=sms) == 1


def test_choose_num_kv_splits() -> None:
    sms = 132
    assert choose_num_kv_splits(64, 8, 2048, num_sms=sms) == 3  # 1056 programs / 512
    assert choose_num_kv_splits(128, 8, 2048, num_sms=sms) == 2
    assert choose_num_kv_splits(256, 8, 2048, num_sms=sms) == 1
    assert choose_num_kv_splits(1, 8, 8192, num_sms=sms) == DECODE_MAX_KV_SPLITS
    assert DECODE_MIN_TOKENS_PER_SPLIT == 128
    assert choose_num_kv_splits(1, 8, 100, num_sms=sms) == 1  # >= 128 tokens a split
    assert choose_num_kv_splits(1, 8, 300, num_sms=sms) == 3
    assert choose_num_kv_splits(1, 8, 1, num_sms=sms) == 1
    assert choose_num_kv_splits(512, 8, 4096, num_sms=sms) == 1
    assert choose_num_kv_splits(1, 8, 8192, num_sms=sms, max_splits=16) == 16
    # latent attention (one KV head; DECODE_MLA_PROGRAMS_PER_SM 3): batch 200 and 256 two
    # splits, 128 four (the sizes an H100 sweep of DeepSeek-V2-Lite's heads chose)
    for bs, splits in ((200, 2), (256, 2), (128, 4), (8, 50)):
        assert choose_num_kv_splits(bs, 1, 1 << 20, num_sms=sms,
                                    programs_per_sm=DECODE_MLA_PROGRAMS_PER_SM) == splits
    for bs in (1, 2, 3, 7, 16, 33, 64, 200):
        for kv in (1, 2, 8):
            for n in (1, 63, 64, 65, 1000, 4096, 100000):
                s = choose_num_kv_splits(bs, kv, n, num_sms=sms)
                assert 1 <= s <= DECODE_MAX_KV_SPLITS
                assert s == 1 or math.ceil(n / s) >= DECODE_MIN_TOKENS_PER_SPLIT // 2
                # enough programs to fill the GPU unless capped by length or max_splits
                if s < DECODE_MAX_KV_SPLITS and s < math.ceil(n / DECODE_MIN_TOKENS_PER_SPLIT):
                    assert bs * kv * s >= 4 * sms


# ====================================================================== backend end to end


@dataclass
class BackendCase:
    fb: ForwardBatch
    layer: RadixAttention
    q: torch.Tensor  # [T, H, D] (strided views of a fused qkv)
    k: torch.Tensor
    v: torch.Tensor
    ctx_k: list[torch.Tensor]
    ctx_v: list[torch.Tensor]


def build_backend_case(mode: ForwardMode, prefix_lens: list[int], extend_lens: list[int],
                       dtype: torch.dtype, seed: int, heads: int = 4, kv_heads: int = 2,
                       d: int = 64, layer_id: int = 1) -> BackendCase:
    g = torch.Generator().manual_seed(seed)
    bs = len(prefix_lens)
    seq_lens = [p + e for p, e in zip(prefix_lens, extend_lens)]
    pool_size = sum(seq_lens) + 16
    kv_pool = TokenToKVPool(pool_size, 2, kv_heads, d, dtype, DEV)
    for buf in kv_pool.k_buffer + kv_pool.v_buffer:
        buf.fill_(NAN)
    req_pool = ReqToTokenPool(bs + 3, max(seq_lens) + 8, DEV)
    case = make_pool(seq_lens, prefix_lens, kv_heads, d, dtype, g, spare=16)
    kb, vb = kv_pool.get_kv_buffer(layer_id)
    kb.copy_(case.k_buffer)
    vb.copy_(case.v_buffer)
    req_pool.req_to_token.copy_(case.req_to_token)
    q, _, _ = fused_qkv(sum(extend_lens), heads, kv_heads, d, dtype, g)
    k = torch.cat([kk[p:] for kk, p in zip(case.ctx_k, prefix_lens)])
    v = torch.cat([vv[p:] for vv, p in zip(case.ctx_v, prefix_lens)])
    fb = ForwardBatch(
        forward_mode=mode,
        batch_size=bs,
        input_ids=torch.zeros(q.shape[0], dtype=torch.int64, device=DEV),
        positions=torch.cat([torch.arange(p, p + e) for p, e in zip(prefix_lens, extend_lens)]
                            ).to(DEV),
        out_cache_loc=torch.cat([s[p:] for s, p in zip(case.slots, prefix_lens)]).to(DEV),
        req_pool_indices=case.rows.long(),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int64, device=DEV),
        seq_lens_cpu=seq_lens,
        prefix_lens_cpu=list(prefix_lens),
        extend_lens_cpu=list(extend_lens),
        req_to_token_pool=req_pool,
        token_to_kv_pool=kv_pool,
        attn_backend=None,
    )
    layer = RadixAttention(heads, d, d ** -0.5, kv_heads, layer_id)
    return BackendCase(fb, layer, q, k, v, case.ctx_k, case.ctx_v)


def fake_runner(heads: int, kv_heads: int, d: int, dtype: torch.dtype, max_bs: int = 8):
    return SimpleNamespace(
        config=SimpleNamespace(num_heads=heads, num_kv_heads=kv_heads, head_dim=d),
        model_kv_heads=lambda: kv_heads,
        max_running_requests=max_bs,
        device=torch.device(DEV),
        dtype=dtype,
    )


def run_backend(case: BackendCase, backend) -> torch.Tensor:
    fb = case.fb
    fb.attn_backend = backend
    backend.init_forward_metadata(fb)
    h, d = case.layer.num_heads, case.layer.head_dim
    # the layer takes [T, H * D] views of the fused projection output
    with forward_context(fb):
        out = case.layer(case.q.reshape(-1, h * d), case.k.reshape(case.k.shape[0], -1),
                         case.v.reshape(case.v.shape[0], -1))
    return out.view(-1, h, d)


BACKEND_CASES = [
    (ForwardMode.EXTEND, [0, 6, 3, 19], [5, 3, 1, 7]),
    (ForwardMode.EXTEND, [30], [21]),
    (ForwardMode.PREFILL, [0, 0, 0], [1, 18, 3]),
    (ForwardMode.DECODE, [0, 12, 40], [1, 1, 1]),
]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("mode,prefix_lens,extend_lens", BACKEND_CASES,
                         ids=["extend", "extend1", "prefill", "decode"])
def test_backend_matches_torch_backend(mode: ForwardMode, prefix_lens: list[int],
                                       extend_lens: list[int], dtype: torch.dtype) -> None:
    heads, kv_heads, d = 4, 2, 64
    case = build_backend_case(mode, prefix_lens, extend_lens, dtype, seed=sum(extend_lens))
    triton_be = TritonAttnBackend(runner=fake_runner(heads, kv_heads, d, dtype))
    assert triton_be.workspace.numel() >= decode_workspace_numel(
        1, heads, d, choose_num_kv_splits(1, kv_heads, 1 << 30, num_sms=triton_be.num_sms))
    got = run_backend(case, triton_be)
    if mode == ForwardMode.DECODE:
        assert case.fb.attn_metadata.num_kv_splits >= 1
    else:  # every pointer 16-byte aligned whatever the batch size (one compiled variant)
        meta = case.fb.attn_metadata
        for t in (meta.prefix_lens, meta.extend_lens, meta.extend_start_loc):
            assert t.data_ptr() % 16 == 0 and t.shape == (len(prefix_lens),)
    want_torch = run_backend(case, TorchAttnBackend())
    start, refs = 0, []
    for i, (p, e) in enumerate(zip(prefix_lens, extend_lens)):
        refs.append(reference(case.q[start:start + e], case.ctx_k[i], case.ctx_v[i], p,
                              case.layer.scaling))
        start += e
    ref = torch.cat(refs)
    assert got.shape == case.q.shape and got.dtype == dtype
    assert rel_err(got, ref) < TOL[dtype]
    assert rel_err(got, want_torch.double()) < TOL[dtype]
    # the pool now holds this step's K/V at out_cache_loc (written by the layer)
    kb, _ = case.fb.token_to_kv_pool.get_kv_buffer(case.layer.layer_id)
    assert torch.equal(kb[case.fb.out_cache_loc], case.k)


@pytest.mark.parametrize("mode,prefix_lens,extend_lens", BACKEND_CASES,
                         ids=["extend", "extend1", "prefill", "decode"])
def test_backends_keep_sliding_window_and_soft_cap(mode: ForwardMode, prefix_lens: list[int],
                                                   extend_lens: list[int]) -> None:
    """A layer with a window of 4 and a logit cap: the Triton backend (PREFILL through the
    extend kernel) and the torch backend both equal the reference."""
    heads, kv_heads, d, dtype = 4, 2, 64, torch.float32
    case = build_backend_case(mode, prefix_lens, extend_lens, dtype, seed=len(prefix_lens))
    case.layer = RadixAttention(heads, d, d ** -0.5, kv_heads, case.layer.layer_id,
                                sliding_window=4, logit_cap=0.3)
    got = run_backend(case, TritonAttnBackend(runner=fake_runner(heads, kv_heads, d, dtype)))
    want_torch = run_backend(case, TorchAttnBackend())
    start, refs = 0, []
    for i, (p, e) in enumerate(zip(prefix_lens, extend_lens)):
        refs.append(reference(case.q[start:start + e], case.ctx_k[i], case.ctx_v[i], p,
                              case.layer.scaling, window=4, cap=0.3))
        start += e
    ref = torch.cat(refs)
    assert rel_err(got, ref) < TOL[dtype]
    assert rel_err(want_torch, ref) < TOL[dtype]


@pytest.mark.parametrize("mode", ["decode", "extend"])
def test_wide_heads_of_latent_attention(mode: str) -> None:
    """Multi-head latent attention's shape: one KV head of 576 values (padded to 1024) read by
    every query head, with the default tiles (which must fit in shared memory on a GPU)."""
    dtype = torch.bfloat16 if torch.cuda.is_available() else torch.float32
    if mode == "decode":
        err = run_decode_case([1, 37, 70], 16, 1, 576, dtype, 4, seed=5)
    else:
        err = run_extend_case([0, 13, 40], [5, 17, 3], 16, 1, 576, dtype, seed=6)
    assert err < TOL[dtype], err


@pytest.mark.parametrize("d,v,shared,splits", [(48, 32, 0, 3), (48, 32, 9, 3), (576, 512, 0, 3),
                                                (576, 512, 0, 40)])
def test_decode_latent_values(d: int, v: int, shared: int, splits: int) -> None:
    """Multi-head latent attention's decode (`v_head_dim`): the values are the keys' first v
    channels of one buffer (a poisoned v_buffer is not read), 16 query heads on one KV head;
    the output's first v channels are attention with V = K[..., :v], the rest zero (o poisoned
    before); with a shared prefix its stage reads the latent the same way. 40 splits of
    sequences up to 1,100 tokens: stage 2 merges 512-wide splits 16 at a time (three chunks
    with data, rescaled as the maximum grows)."""
    dtype = torch.bfloat16 if torch.cuda.is_available() else torch.float32
    lens = ([1, 37, 70] if splits < 16 else [1, 700, 1100]) if not shared else [12, 30, 21]
    g = torch.Generator().manual_seed(d + shared)
    pool = make_pool(lens, lens, 1, d, dtype, g)
    rows = pool.rows.tolist()
    for i in range(1, len(lens)):
        pool.req_to_token[rows[i], :shared] = pool.req_to_token[rows[0], :shared]
        pool.ctx_k[i][:shared] = pool.ctx_k[0][:shared]
    q, _, _ = fused_qkv(len(lens), 16, 1, d, dtype, g)
    o = torch.full(q.shape, NAN, dtype=dtype, device=DEV)
    poisoned = torch.full_like(pool.v_buffer, NAN)
    scale = d ** -0.5
    decode_attention_fwd(q, pool.k_buffer, poisoned, o, pool.req_to_token, pool.rows, ivec(lens),
                         scale, splits, shared_len=shared, shared_splits=2 if shared else 0,
                         v_head_dim=v)
    want = torch.cat([reference(q[i:i + 1], pool.ctx_k[i], pool.ctx_k[i][..., :v], n - 1,
                                scale) for i, n in enumerate(lens)])
    assert rel_err(o[..., :v], want) < TOL[dtype]
    assert (o[..., v:] == 0).all()


# ====================================================================== GPU sizes

GPU_HEADS, GPU_KV_HEADS, GPU_D = 32, 8, 128


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
def test_gpu_prefill(dtype: torch.dtype) -> None:
    err = run_prefill_case([1, 300, 1024, 4096, 77], GPU_HEADS, GPU_KV_HEADS, GPU_D, dtype,
                           seed=11, ref=reference_gpu)
    assert err < TOL[dtype], err


@pytest.mark.gpu
@pytest.mark.parametrize("d", HEAD_DIMS)
def test_gpu_extend(d: int) -> None:
    err = run_extend_case([0, 1000, 3000, 17], [512, 77, 1096, 1], GPU_HEADS, GPU_KV_HEADS, d,
                          torch.bfloat16, seed=d, ref=reference_gpu)
    assert err < TOL[torch.bfloat16], err


@pytest.mark.gpu
@pytest.mark.parametrize("splits", [None, 1, 7, 64])
def test_gpu_decode(splits: int | None) -> None:
    g = torch.Generator().manual_seed(5)
    lens = torch.randint(1, 4097, (64,), generator=g).tolist()
    lens[:3] = [1, 4096, 2048]
    n = splits or choose_num_kv_splits(len(lens), GPU_KV_HEADS, max(lens))
    err = run_decode_case(lens, GPU_HEADS, GPU_KV_HEADS, GPU_D, torch.bfloat16, n, seed=6,
                          ref=reference_gpu)
    assert err < TOL[torch.bfloat16], err


@pytest.mark.gpu
def test_gpu_decode_shared_prefix() -> None:
    """64 requests behind one 2048-token prefix, 1-300 own tokens each, real head sizes."""
    g = torch.Generator().manual_seed(8)
    lens = [2048 + int(x) for x in torch.randint(1, 300, (64,), generator=g)]
    err = run_shared_prefix_case(lens, 2048, GPU_HEADS, GPU_KV_HEADS, GPU_D, torch.bfloat16,
                                 2, 4, seed=9)
    assert err < TOL[torch.bfloat16], err


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("mode,prefix_lens,extend_lens", [
    (ForwardMode.EXTEND, [0, 600, 2000], [700, 300, 5]),
    (ForwardMode.PREFILL, [0, 0], [1000, 3]),
    (ForwardMode.DECODE, [0, 999, 4000], [1, 1, 1]),
], ids=["extend", "prefill", "decode"])
def test_gpu_backend_matches_torch_backend(mode, prefix_lens, extend_lens, dtype) -> None:
    case = build_backend_case(mode, prefix_lens, extend_lens, dtype, seed=3, heads=GPU_HEADS,
                              kv_heads=GPU_KV_HEADS, d=GPU_D)
    got = run_backend(case, TritonAttnBackend(
        runner=fake_runner(GPU_HEADS, GPU_KV_HEADS, GPU_D, dtype, max_bs=256)))
    want = run_backend(case, TorchAttnBackend())
    start, refs = 0, []
    for i, (p, e) in enumerate(zip(prefix_lens, extend_lens)):
        refs.append(reference_gpu(case.q[start:start + e], case.ctx_k[i], case.ctx_v[i], p,
                                  case.layer.scaling))
        start += e
    assert rel_err(got, torch.cat(refs)) < TOL[dtype]
    assert rel_err(got, want.double()) < TOL[dtype]


def _time_graph(fn, iters: int = 50) -> float:
    """Seconds per call of fn, replayed from a CUDA graph (no launch overhead)."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        fn()
        with torch.cuda.graph(graph, stream=stream):
            for _ in range(iters):
                fn()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        best = min(best, start.elapsed_time(end) / 1e3 / iters)
    return best


@pytest.mark.gpu
@pytest.mark.parametrize("bs,ctx,target", [(64, 2048, 0.70), (1, 8192, 0.40)])
def test_gpu_decode_bandwidth(bs: int, ctx: int, target: float) -> None:
    """Acceptance check on the H200: KV bytes read / time >= target x device copy bandwidth."""
    heads, kv_heads, d, dtype = GPU_HEADS, GPU_KV_HEADS, GPU_D, torch.bfloat16
    total = bs * ctx
    k_buf = torch.randn(total + 1, kv_heads, d, device="cuda", dtype=dtype)
    v_buf = torch.randn(total + 1, kv_heads, d, device="cuda", dtype=dtype)
    req_to_token = torch.randperm(total, device="cuda").to(torch.int32).view(bs, ctx)
    rows = torch.arange(bs, device="cuda")
    seq_lens = torch.full((bs,), ctx, device="cuda", dtype=torch.int64)
    q = torch.randn(bs, heads, d, device="cuda", dtype=dtype)
    o = torch.empty_like(q)
    splits = choose_num_kv_splits(bs, kv_heads, ctx)
    ws = decode_workspace(bs, heads, d, splits, "cuda")
    t_attn = _time_graph(lambda: decode_attention_fwd(
        q, k_buf, v_buf, o, req_to_token, rows, seq_lens, d ** -0.5, splits, ws))
    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    t_copy = _time_graph(lambda: dst.copy_(src), iters=10)
    copy_bw = 2 * src.numel() / t_copy  # read + write
    kv_bytes = 2 * total * kv_heads * d * dtype.itemsize
    attn_bw = kv_bytes / t_attn
    print(f"decode bs={bs} ctx={ctx} splits={splits}: {t_attn * 1e6:.1f} us, "
          f"{attn_bw / 1e9:.0f} GB/s = {attn_bw / copy_bw:.2f} x copy ({copy_bw / 1e9:.0f} GB/s)")
    assert attn_bw >= target * copy_bw
