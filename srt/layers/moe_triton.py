"""A fused mixture-of-experts kernel for the GPU (tested on the CPU in Triton's interpreter).

The (token, choice) pairs are sorted by expert and each expert's run is padded to a multiple of
BLOCK_M, so that every block of BLOCK_M rows belongs to one expert; one grouped GEMM kernel then
runs twice: x @ w13[e]^T for the gate/up projection, and act @ w2[e]^T times the routing weight
for the down projection. The padding is laid out on the device with a fixed upper bound on its
size, so nothing waits for the host; padded rows point past the last pair and are masked.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from srt.layers.fused_triton import silu_and_mul

BLOCK_M = 16  # the default row block (pairs of one expert per program)
# Row blocks whose programs sweep the column blocks together (1 << 20: every row block per
# column block). One row block at a time (1) keeps its gathered input rows in L2 across the
# column blocks: on one H100, Qwen3-30B-A3B's experts at 4,096 tokens 1.124 ms a layer against
# 1.344 with every row block together, DeepSeek-V2-Lite's 1.215 against 1.479; the same or
# better at every count from 1 to 8,192 tokens (`benchmarks/bench_moe.py --group-m`).
GROUP_M = 1
# The shared memory a block may take where the device cannot be asked (Triton's interpreter):
# an H100's / H200's 227 KiB. `_fit_stages` drops stages of a tile that would need more.
SMEM_BYTES = 232_448


@dataclass(frozen=True)
class TileConfig:
    """Tile sizes and launch settings of the grouped GEMM (block_m also pads each expert's run)."""

    block_m: int = BLOCK_M
    block_n: int = 64
    block_k: int = 64
    num_warps: int = 4
    num_stages: int = 3


# Every tile configuration `tile_config` returns: the start-up warm-up compiles each of them
# (`warm_up_fused_moe`), since a fill is the first to need the larger ones. Chosen on one H100
# from 14 configurations timed on Qwen3-30B-A3B's experts (128 x top 8, 2048 -> 768) and
# DeepSeek-V2-Lite's (64 x top 6, 2048 -> 1408) at 1 to 8,192 tokens, GROUP_M 1
# (benchmarks/results/2026-12-07-moe-tiles/): per expert up to 16 pairs the 16-row blocks, to
# 48 the 64-row ones (DeepSeek at 256 tokens 0.488 ms against 0.505 for 32-row blocks), to 96
# 128 x 128 with 8 warps (DeepSeek at 1,024 tokens 0.568 against 0.781 for the 32-row blocks
# picked before), above 128 x 256 with 4 stages (Qwen3 at 4,096 tokens 1.023 ms, at 8,192
# 1.794 against 1.869 for 128 x 128).
DECODE_TILES = TileConfig(16, 64, 128, 4, 4)
MID_TILES = TileConfig(64, 128, 64, 4, 3)
FILL_TILES = TileConfig(128, 128, 64, 8, 3)
LARGE_FILL_TILES = TileConfig(128, 256, 64, 8, 4)
TILE_CONFIGS = (DECODE_TILES, MID_TILES, FILL_TILES, LARGE_FILL_TILES)


def tile_config(num_pairs: int, num_experts: int) -> TileConfig:
    """Small row blocks while each expert gets few pairs (decode: the weights are read once per
    row block, so padding rows cost bandwidth), larger ones once the GEMMs are compute-bound."""
    per_expert = num_pairs / max(1, num_experts)
    if per_expert <= 16:
        return DECODE_TILES
    if per_expert <= 48:
        return MID_TILES
    return LARGE_FILL_TILES if per_expert > 96 else FILL_TILES


@functools.cache
def _smem_limit(device_index: int | None) -> int:
    """A block's shared memory on this GPU (SMEM_BYTES where there is none)."""
    if device_index is None:
        return SMEM_BYTES
    props = triton.runtime.driver.active.utils.get_device_properties(device_index)
    return int(props["max_shared_mem"])


def _fit_stages(cfg: TileConfig, block_n: int, block_k: int, itemsize: int,
                device: torch.device) -> int:
    """cfg's pipeline stages, fewer where its stages of A and W tiles in `itemsize`-byte
    elements would not fit the device's shared memory (float32 inputs of the 128 x 256 tiles:
    2 stages; a GPU of 100 KiB: 2 stages of bf16 128 x 128 tiles)."""
    per_stage = (cfg.block_m + block_n) * block_k * itemsize
    limit = _smem_limit(device.index if device.type == "cuda" else None)
    return max(1, min(cfg.num_stages, limit // per_stage))


def warm_up_fused_moe(w13: torch.Tensor, w2: torch.Tensor, top_k: int, dtype: torch.dtype,
                      w13_scale: torch.Tensor | None = None,
                      w2_scale: torch.Tensor | None = None) -> None:
    """Run `fused_moe_triton` on these experts once per tile configuration and per kind of
    pair count Triton compiles apart (a multiple of 16 or not), on 16 and 15 random tokens of
    `dtype`, and the pair layout's large-chunk variant: the kernels a fill of any size takes
    are then compiled at start-up, not inside the first fills that reach a larger
    configuration (seconds each)."""
    experts, hidden = w13.shape[0], w13.shape[2]
    g = torch.Generator(device=w13.device).manual_seed(0)
    for cfg in TILE_CONFIGS:
        for tokens in (16, 15):
            x = torch.randn(tokens, hidden, generator=g, device=w13.device).to(dtype)
            ids = torch.randint(0, experts, (tokens, top_k), generator=g, device=w13.device)
            weights = torch.rand(tokens, top_k, generator=g, device=w13.device)
            fused_moe_triton(x, w13, w2, weights, ids, cfg=cfg, w13_scale=w13_scale,
                             w2_scale=w2_scale)
    # the layout's large-chunk variant, which only fills above ALIGN_LARGE_FROM pairs take
    for pairs in (ALIGN_LARGE_FROM + 16, ALIGN_LARGE_FROM + 15):
        ids = torch.randint(0, experts, (pairs, 1), generator=g, device=w13.device)
        for cfg in TILE_CONFIGS:
            align_pairs_by_expert(ids, experts, cfg.block_m)


@triton.jit
def _grouped_gemm_kernel(
    a_ptr, w_ptr, c_ptr, weight_ptr, sorted_pairs_ptr, block_expert_ptr, scale_ptr,
    num_pairs, N, K,
    stride_am, stride_we, stride_wn, stride_wk, stride_cm, stride_se,
    A_ROW_DIV: tl.constexpr, MUL_WEIGHT: tl.constexpr, IEEE: tl.constexpr,
    W_SCALE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    """c[pair] = a[pair // A_ROW_DIV] @ w[expert of the block]^T (times weight[pair]). With
    W_SCALE, w is FP8 and row n of expert e stands for w[e, n] * scale[e, n]."""
    # One program per (row block, column block), in groups of GROUP_M row blocks that sweep
    # every column block together (see GROUP_M).
    pid = tl.program_id(0)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    num_pid_m = tl.num_programs(0) // num_pid_n
    group = pid // (GROUP_M * num_pid_n)
    first_m = group * GROUP_M
    group_m = tl.minimum(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % (GROUP_M * num_pid_n)) % group_m
    pid_n = (pid % (GROUP_M * num_pid_n)) // group_m
    # Each expert's run starts with real pairs, so a block whose first entry is padding holds
    # only padding: skip it rather than read an expert's weights for nothing.
    if tl.load(sorted_pairs_ptr + pid_m * BLOCK_M) >= num_pairs:
        return
    expert = tl.load(block_expert_ptr + pid_m)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pairs = tl.load(sorted_pairs_ptr + offs_m)
    valid = pairs < num_pairs
    rows = tl.where(valid, pairs // A_ROW_DIV, 0)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + offs_k
        a = tl.load(a_ptr + rows[:, None] * stride_am + kk[None, :],
                    mask=valid[:, None] & (kk[None, :] < K), other=0.0)
        w = tl.load(w_ptr + expert * stride_we + offs_n[None, :] * stride_wn
                    + kk[:, None] * stride_wk,
                    mask=(offs_n[None, :] < N) & (kk[:, None] < K), other=0.0)
        if W_SCALE:
            w = w.to(a.dtype)  # exact: every e4m3 value is a bf16 / fp16 / fp32 value
        if IEEE:
            acc += tl.dot(a, w, input_precision="ieee")
        else:
            acc += tl.dot(a, w)
    if W_SCALE:
        acc = acc * tl.load(scale_ptr + expert * stride_se + offs_n, mask=offs_n < N,
                            other=0.0)[None, :]
    if MUL_WEIGHT:
        acc = acc * tl.load(weight_ptr + pairs, mask=valid, other=0.0)[:, None]
    tl.store(c_ptr + pairs[:, None] * stride_cm + offs_n[None, :],
             acc.to(c_ptr.dtype.element_ty), mask=valid[:, None] & (offs_n[None, :] < N))


# The align kernel's programs each loop over every id twice, `CHUNK` ids an iteration: the
# loop's latency, not its bytes, is its time (0.18 ms a layer at 4,096 tokens of Qwen3-30B-A3B,
# 32,768 pairs in 256-id chunks, on one H100). Above ALIGN_LARGE_FROM pairs the chunks are
# ALIGN_LARGE_CHUNK ids (8 warps), so a fill's layout takes 8x fewer iterations.
ALIGN_CHUNK = 256
ALIGN_LARGE_FROM = 4096
ALIGN_LARGE_CHUNK = 2048


@triton.jit
def _align_kernel(ids_ptr, sorted_ptr, block_expert_ptr, num_pairs, cap,
                  E: tl.constexpr, E_PAD: tl.constexpr, BLOCK_M: tl.constexpr,
                  CHUNK: tl.constexpr):
    """Program e lays out expert e's run: its pairs in index order from the run's start, then
    padding up to the run's padded end, and e as the expert of the run's blocks. Every program
    counts every expert (a histogram of all ids) to find where its run starts; the last one
    also pads from the end of the last run to `cap`."""
    e = tl.program_id(0)
    counts = tl.zeros((E_PAD,), dtype=tl.int32)
    for start in range(0, num_pairs, CHUNK):
        offs = start + tl.arange(0, CHUNK)
        # past the end: bin E, an extra bin no expert owns
        ids = tl.load(ids_ptr + offs, mask=offs < num_pairs, other=E).to(tl.int32)
        counts += tl.histogram(ids, E_PAD)
    bins = tl.arange(0, E_PAD)
    padded = tl.where(bins < E, (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M, 0)
    ends = tl.cumsum(padded, 0)
    run_start = tl.sum(tl.where(bins == e, ends - padded, 0))
    run_count = tl.sum(tl.where(bins == e, counts, 0))
    run_padded = tl.sum(tl.where(bins == e, padded, 0))
    seen = 0
    for start in range(0, num_pairs, CHUNK):
        offs = start + tl.arange(0, CHUNK)
        ids = tl.load(ids_ptr + offs, mask=offs < num_pairs, other=E).to(tl.int32)
        mine = (ids == e).to(tl.int32)
        rank = seen + tl.cumsum(mine, 0) - mine
        tl.store(sorted_ptr + run_start + rank, offs, mask=mine > 0)
        seen += tl.sum(mine)
    lane = tl.arange(0, BLOCK_M)
    tl.store(sorted_ptr + run_start + run_count + lane, num_pairs,
             mask=lane < run_padded - run_count)
    block_lane = tl.arange(0, CHUNK)
    for b in range(0, run_padded // BLOCK_M, CHUNK):
        tl.store(block_expert_ptr + run_start // BLOCK_M + b + block_lane, e,
                 mask=b + block_lane < run_padded // BLOCK_M)
    if e == E - 1:
        total = tl.sum(padded)
        for p in range(total, cap, CHUNK):
            tl.store(sorted_ptr + p + block_lane, num_pairs, mask=p + block_lane < cap)
        for b in range(total // BLOCK_M, cap // BLOCK_M, CHUNK):
            tl.store(block_expert_ptr + b + block_lane, E - 1,
                     mask=b + block_lane < cap // BLOCK_M)


def align_pairs_by_expert(
    topk_ids: torch.Tensor, num_experts: int, block_m: int = BLOCK_M, chunk: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(sorted_pairs [P], block_expert [P // block_m]) with P an upper bound fixed by the shapes.

    sorted_pairs lists the flattened (token, choice) indices grouped by expert, in index order
    within each expert, each expert's run padded to a multiple of block_m with `num_pairs` (an
    index past the end: masked). Ids are in [0, num_experts]; a pair of id num_experts is in no
    run (dropped: another rank's expert). One kernel launch (`_align_kernel`, one program an
    expert), reading the ids `chunk` at a time (default: by the pair count, see
    ALIGN_LARGE_FROM)."""
    flat = topk_ids.reshape(-1)
    num_pairs = flat.numel()
    cap = num_pairs + num_experts * (block_m - 1)
    cap = (cap + block_m - 1) // block_m * block_m
    sorted_pairs = torch.empty(cap, dtype=torch.int64, device=flat.device)
    block_expert = torch.empty(cap // block_m, dtype=torch.int64, device=flat.device)
    if chunk is None:
        chunk = ALIGN_CHUNK if num_pairs <= ALIGN_LARGE_FROM else ALIGN_LARGE_CHUNK
    _align_kernel[(num_experts,)](
        flat, sorted_pairs, block_expert, num_pairs, cap, E=num_experts,
        E_PAD=triton.next_power_of_2(num_experts + 1), BLOCK_M=block_m, CHUNK=chunk,
        num_warps=4 if chunk <= ALIGN_CHUNK else 8)
    return sorted_pairs, block_expert


def align_pairs_by_expert_torch(
    topk_ids: torch.Tensor, num_experts: int, block_m: int = BLOCK_M
) -> tuple[torch.Tensor, torch.Tensor]:
    """The same layout from torch operations (about 25 launches): the kernel's reference."""
    flat = topk_ids.reshape(-1)
    num_pairs = flat.numel()
    cap = num_pairs + num_experts * (block_m - 1)
    cap = (cap + block_m - 1) // block_m * block_m
    counts = torch.zeros(num_experts, dtype=torch.int64, device=flat.device).scatter_add_(
        0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    padded_end = padded.cumsum(0)
    order = flat.argsort(stable=True)
    experts_sorted = flat[order]
    rank_in_expert = torch.arange(num_pairs, device=flat.device) - (counts.cumsum(0) - counts)[
        experts_sorted]
    dest = (padded_end - padded)[experts_sorted] + rank_in_expert
    sorted_pairs = torch.full((cap,), num_pairs, dtype=torch.int64, device=flat.device)
    sorted_pairs[dest] = order
    block_start = torch.arange(0, cap, block_m, device=flat.device)
    # blocks past the last expert's run hold only padding; any valid expert index will do
    block_expert = torch.searchsorted(padded_end, block_start, right=True).clamp_(
        max=num_experts - 1)
    return sorted_pairs, block_expert


def _grouped_gemm(a: torch.Tensor, w: torch.Tensor, c: torch.Tensor, weights: torch.Tensor,
                  sorted_pairs: torch.Tensor, block_expert: torch.Tensor, a_row_div: int,
                  mul_weight: bool, cfg: TileConfig, scale: torch.Tensor | None = None) -> None:
    num_pairs = c.shape[0]
    n, k = w.shape[1], w.shape[2]
    block_n = min(cfg.block_n, max(16, triton.next_power_of_2(n)))
    block_k = min(cfg.block_k, max(16, triton.next_power_of_2(k)))
    grid = (block_expert.numel() * triton.cdiv(n, block_n),)
    stages = _fit_stages(cfg, block_n, block_k, a.element_size(), a.device)
    _grouped_gemm_kernel[grid](
        a, w, c, weights, sorted_pairs, block_expert, scale if scale is not None else weights,
        num_pairs, n, k,
        a.stride(0), w.stride(0), w.stride(1), w.stride(2), c.stride(0),
        scale.stride(0) if scale is not None else 0,
        A_ROW_DIV=a_row_div, MUL_WEIGHT=mul_weight, IEEE=a.dtype == torch.float32,
        W_SCALE=scale is not None,
        BLOCK_M=cfg.block_m, BLOCK_N=block_n, BLOCK_K=block_k, GROUP_M=GROUP_M,
        num_warps=cfg.num_warps, num_stages=stages,
    )


@triton.jit
def _moe_sum_kernel(down_ptr, ids_ptr, out_ptr, hidden, E: tl.constexpr, K: tl.constexpr,
                    BLOCK: tl.constexpr):
    """out[t] = sum over the token's k choices of down[t * k + j], in float32, rounded once
    (as torch's sum over that dimension; its reduction kernel takes 5 us for one token); a
    dropped choice (id E: its row was never computed) is not read."""
    t = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < hidden
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for j in tl.static_range(K):
        expert = tl.load(ids_ptr + t * K + j)
        acc += tl.load(down_ptr + (t * K + j) * hidden + cols,
                       mask=mask & (cols * 0 + expert < E), other=0.0).to(tl.float32)
    tl.store(out_ptr + t * hidden + cols, acc.to(out_ptr.dtype.element_ty), mask=mask)


def fused_moe_triton(
    x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
    topk_ids: torch.Tensor, out: torch.Tensor | None = None, cfg: TileConfig | None = None,
    w13_scale: torch.Tensor | None = None, w2_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Same contract as srt.layers.moe.moe_forward_torch (FP8 experts with their scales
    included; choices of id E dropped); writes into `out` when given. `cfg` overrides the
    tile sizes `tile_config` picks from the shapes."""
    num_tokens, top_k = topk_ids.shape
    hidden = x.shape[1]
    num_pairs = num_tokens * top_k
    cfg = cfg or tile_config(num_pairs, w13.shape[0])
    x, w13, w2 = x.contiguous(), w13.contiguous(), w2.contiguous()
    sorted_pairs, block_expert = align_pairs_by_expert(topk_ids, w13.shape[0], cfg.block_m)
    weights = topk_weights.reshape(-1).float().contiguous()
    gate_up = torch.empty(num_pairs, w13.shape[1], dtype=x.dtype, device=x.device)
    _grouped_gemm(x, w13, gate_up, weights, sorted_pairs, block_expert, top_k, False, cfg,
                  w13_scale)
    act = silu_and_mul(gate_up)
    down = torch.empty(num_pairs, hidden, dtype=x.dtype, device=x.device)
    _grouped_gemm(act, w2, down, weights, sorted_pairs, block_expert, 1, True, cfg, w2_scale)
    if out is None or not out.is_contiguous():
        result = torch.empty(num_tokens, hidden, dtype=x.dtype, device=x.device)
    else:
        result = out
    block = min(1024, triton.next_power_of_2(hidden))
    _moe_sum_kernel[(num_tokens, triton.cdiv(hidden, block))](
        down, topk_ids, result, hidden, E=w13.shape[0], K=top_k, BLOCK=block, num_warps=4)
    if out is not None and result is not out:
        out.copy_(result)
    return result if out is None else out
