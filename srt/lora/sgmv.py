"""Segmented gathered matrix-vector products: the LoRA shrink and expand of a mixed batch.

The rows of a step that use adapters are grouped by the pool slot of their adapter: `rows`
lists them slot after slot, and the rows of slot s are rows[indptr[s] : indptr[s + 1]]. For each
slot, every listed row r gets

    out[r] (+)= x[r] @ w[slot].T          x [T, K], w [slots, N, K], out [T, N]

so each adapter's weights are read once per tile however many rows use it, and rows of no adapter
are not touched (their output rows keep whatever they held). The shrink writes x @ A.T into a
[T, slices * rank] buffer; each slice's expand adds its part times B.T into its columns of the
layer's output (views with strides, no copies).

`sgmv_torch` loops over the slots on the host (the CPU path); `sgmv_triton` is one kernel launch
over a block table (`row_blocks`): block b is up to BLOCK_M rows of one slot, from rows
position block_start[b] to that slot's end, so the grid (blocks, column blocks) has about R /
BLOCK_M + slots row blocks however the rows are grouped. A table padded with slot -1 (programs
that return at once) to its bound for a batch of R rows gives a fixed grid (CUDA graphs).
"""

from __future__ import annotations

import numpy as np
import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # the torch path needs no triton
    triton = None


def sgmv_torch(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor, rows: torch.Tensor,
               indptr: list[int], add: bool) -> None:
    """The reference: per slot, gather its rows, one matmul, scatter (`indptr` on the host)."""
    for slot in range(len(indptr) - 1):
        lo, hi = indptr[slot], indptr[slot + 1]
        if hi == lo:
            continue
        idx = rows[lo:hi]
        y = x.index_select(0, idx) @ w[slot].t().to(x.dtype)
        if add:
            out.index_add_(0, idx, y.to(out.dtype))
        else:
            out.index_copy_(0, idx, y.to(out.dtype))


if triton is not None:

    @triton.jit
    def _block_rows(rows_ptr, indptr_ptr, block_start_ptr, b, slot, BLOCK_M: tl.constexpr):
        """(mask, row indices as int64) of block b's rows: up to BLOCK_M of slot's group."""
        start = tl.load(block_start_ptr + b)
        hi = tl.load(indptr_ptr + slot + 1)
        offs_m = start + tl.arange(0, BLOCK_M)
        mask_m = offs_m < hi
        return mask_m, tl.load(rows_ptr + offs_m, mask=mask_m, other=0).to(tl.int64)

    @triton.jit
    def _sgmv_kernel(x_ptr, w_ptr, out_ptr, rows_ptr, indptr_ptr, block_slot_ptr,
                     block_start_ptr, N, K, K_PER_SPLIT, stride_xs, stride_xm, stride_xk,
                     stride_ws, stride_wn, stride_wk, stride_os, stride_om, stride_on,
                     ADD: tl.constexpr, X_SPLITS: tl.constexpr, BLOCK_M: tl.constexpr,
                     BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        b = tl.program_id(0)
        slot = tl.load(block_slot_ptr + b)
        if slot < 0:
            return
        mask_m, row = _block_rows(rows_ptr, indptr_ptr, block_start_ptr, b, slot, BLOCK_M)
        offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        mask_n = offs_n < N
        split = tl.program_id(2)  # this program's range of K (a split-K shrink)
        k_lo = split * K_PER_SPLIT
        k_hi = tl.minimum(K, k_lo + K_PER_SPLIT)
        w_base = w_ptr + slot.to(tl.int64) * stride_ws
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(k_lo, k_hi, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            mask_k = offs_k < k_hi
            a_ptrs = x_ptr + row[:, None] * stride_xm + offs_k[None, :] * stride_xk
            a_mask = mask_m[:, None] & mask_k[None, :]
            a = tl.load(a_ptrs, mask=a_mask, other=0.0).to(tl.float32)
            for s in tl.static_range(1, X_SPLITS):  # x is a split-K shrink's partial sums: add them
                a += tl.load(a_ptrs + s * stride_xs, mask=a_mask, other=0.0).to(tl.float32)
            w = tl.load(w_base + offs_n[None, :] * stride_wn + offs_k[:, None] * stride_wk,
                        mask=mask_n[None, :] & mask_k[:, None], other=0.0)
            acc += tl.dot(a.to(w.dtype), w)
        ptrs = out_ptr + split * stride_os + row[:, None] * stride_om + offs_n[None, :] * stride_on
        mask = mask_m[:, None] & mask_n[None, :]
        if ADD:
            acc += tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
        tl.store(ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask)


    @triton.jit
    def _expand_kernel(x_ptr, b_ptr, out_ptr, rows_ptr, indptr_ptr, block_slot_ptr,
                       block_start_ptr, COL_LO, COL_HI, LO0, HI0, LO1, HI1, LO2, HI2,
                       stride_xs, stride_xm, stride_xk, stride_bs, stride_bn, stride_bk,
                       stride_om, stride_on, RANK: tl.constexpr, X_SPLITS: tl.constexpr,
                       NUM_SLICES: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                       BLOCK_K: tl.constexpr):
        b = tl.program_id(0)
        slot = tl.load(block_slot_ptr + b)
        if slot < 0:
            return
        mask_m, row = _block_rows(rows_ptr, indptr_ptr, block_start_ptr, b, slot, BLOCK_M)
        n0 = COL_LO + tl.program_id(1) * BLOCK_N
        offs_n = n0 + tl.arange(0, BLOCK_N)
        mask_n = offs_n < COL_HI
        offs_k = tl.arange(0, BLOCK_K)
        mask_k = offs_k < RANK
        w = tl.load(b_ptr + slot.to(tl.int64) * stride_bs + (offs_n - COL_LO)[None, :] * stride_bn
                    + offs_k[:, None] * stride_bk, mask=mask_n[None, :] & mask_k[:, None],
                    other=0.0)
        a_mask = mask_m[:, None] & mask_k[None, :]
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for j in tl.static_range(NUM_SLICES):
            if j == 0:
                lo = LO0
                hi = HI0
            elif j == 1:
                lo = LO1
                hi = HI1
            else:
                lo = LO2
                hi = HI2
            if (n0 < hi) & (n0 + BLOCK_N > lo):  # this block holds columns of slice j
                a_ptrs = x_ptr + row[:, None] * stride_xm + (j * RANK + offs_k)[None, :] * stride_xk
                a = tl.load(a_ptrs, mask=a_mask, other=0.0).to(tl.float32)
                for s in tl.static_range(1, X_SPLITS):  # a split-K shrink's partial sums
                    a += tl.load(a_ptrs + s * stride_xs, mask=a_mask, other=0.0).to(tl.float32)
                mine = (offs_n >= lo) & (offs_n < hi)
                acc += tl.dot(a.to(w.dtype), tl.where(mine[None, :], w, 0.0).to(w.dtype))
        ptrs = out_ptr + row[:, None] * stride_om + offs_n[None, :] * stride_on
        mask = mask_m[:, None] & mask_n[None, :]
        acc += tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
        tl.store(ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask)


EXPAND_BLOCK_N = 128  # output columns per expand program
FILL_ROWS = 1025  # steps of this many rows or more take the fills' block size


def block_m_for(rows: int) -> int:
    """Rows per block: 16 for decode-sized steps (and every CUDA graph), 64 for fills."""
    return 16 if rows < FILL_ROWS else 64


def max_row_blocks(rows: int, slots: int, block_m: int) -> int:
    """The most blocks `row_blocks` gives for up to `rows` rows over `slots` slots."""
    return -(-rows // block_m) + slots


def row_blocks(counts: np.ndarray, indptr: np.ndarray, block_m: int
               ) -> tuple[np.ndarray, np.ndarray]:
    """The block table of a grouping: (slot, first row position) of each block of up to
    block_m rows of one slot."""
    nblocks = -(-counts // block_m)
    slot = np.repeat(np.arange(len(counts), dtype=np.int64), nblocks)
    local = np.arange(len(slot), dtype=np.int64) - (np.cumsum(nblocks) - nblocks)[slot]
    return slot, indptr[slot] + local * block_m


def shrink_splits(rows: int, k: int) -> int:
    """K splits of a shrink of a step of `rows` rows: decode-sized steps have few row blocks,
    so their long K is cut into parallel programs (partial sums the expand adds); fills have
    rows enough."""
    return 8 if rows < FILL_ROWS and k >= 2048 else 1


def sgmv_triton(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor, rows: torch.Tensor,
                indptr: torch.Tensor, block_slot: torch.Tensor, block_start: torch.Tensor,
                block_m: int, add: bool) -> None:
    """One launch over the block table (device tensors; `block_m` the table's rows per
    block). Each row appears at most once in `rows`. A 3-D `out` [S, T, N] takes S partial
    sums over K (a split-K shrink, add False); a 3-D `x` [S, T, K] is such partial sums, added
    as they are read."""
    n, k = w.shape[1], w.shape[2]
    if block_slot.shape[0] == 0:
        return
    splits = out.shape[0] if out.dim() == 3 else 1
    x_splits = x.shape[0] if x.dim() == 3 else 1
    x3 = x if x.dim() == 3 else x.unsqueeze(0)
    o3 = out if out.dim() == 3 else out.unsqueeze(0)
    # the shrink has a small N and a long K; the expand the reverse
    block_n = max(16, min(64, triton.next_power_of_2(n)))
    block_k = max(16, min(128, triton.next_power_of_2(k)))
    per_split = triton.cdiv(triton.cdiv(k, splits), block_k) * block_k
    grid = (block_slot.shape[0], triton.cdiv(n, block_n), splits)
    _sgmv_kernel[grid](
        x3, w, o3, rows, indptr, block_slot, block_start, n, k, per_split,
        x3.stride(0), x3.stride(1), x3.stride(2), w.stride(0), w.stride(1), w.stride(2),
        o3.stride(0), o3.stride(1), o3.stride(2),
        ADD=add, X_SPLITS=x_splits, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
    )


def expand_triton(x: torch.Tensor, b: torch.Tensor, out: torch.Tensor, col_lo: int,
                  slices: list[tuple[int, int]], rank: int, rows: torch.Tensor,
                  indptr: torch.Tensor, block_slot: torch.Tensor, block_start: torch.Tensor,
                  block_m: int) -> None:
    """Every slice's expand in one launch: out[r, c] += sum_k x[r, j * rank + k] b[slot, c -
    col_lo, k] for each row r of a slot and each column c of slice j, slices[j] = (lo, hi) a
    column range of `out` (at most 3, ascending, from col_lo; columns between slices are left
    as they are). x [T, slices * rank] or [S, T, slices * rank] (a split-K shrink's partial
    sums, added as they are read); b [slots, hi_last - col_lo, rank]."""
    if block_slot.shape[0] == 0:
        return
    assert 1 <= len(slices) <= 3
    x3 = x if x.dim() == 3 else x.unsqueeze(0)
    col_hi = slices[-1][1]
    bounds = [v for lo_hi in slices for v in lo_hi] + [0] * (6 - 2 * len(slices))
    block_n = EXPAND_BLOCK_N
    grid = (block_slot.shape[0], triton.cdiv(col_hi - col_lo, block_n))
    _expand_kernel[grid](
        x3, b, out, rows, indptr, block_slot, block_start, col_lo, col_hi, *bounds,
        x3.stride(0), x3.stride(1), x3.stride(2), b.stride(0), b.stride(1), b.stride(2),
        out.stride(0), out.stride(1), RANK=rank, X_SPLITS=x3.shape[0],
        NUM_SLICES=len(slices), BLOCK_M=block_m, BLOCK_N=block_n,
        BLOCK_K=max(16, triton.next_power_of_2(rank)),
    )
