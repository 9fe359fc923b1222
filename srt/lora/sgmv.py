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
    def _sgmv_kernel(x_ptr, w_ptr, out_ptr, rows_ptr, indptr_ptr, block_slot_ptr,
                     block_start_ptr, N, K, stride_xm, stride_xk, stride_ws, stride_wn,
                     stride_wk, stride_om, stride_on,
                     ADD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                     BLOCK_K: tl.constexpr):
        b = tl.program_id(0)
        slot = tl.load(block_slot_ptr + b)
        if slot < 0:
            return
        start = tl.load(block_start_ptr + b)
        hi = tl.load(indptr_ptr + slot + 1)
        offs_m = start + tl.arange(0, BLOCK_M)
        mask_m = offs_m < hi
        row = tl.load(rows_ptr + offs_m, mask=mask_m, other=0).to(tl.int64)
        offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        mask_n = offs_n < N
        w_base = w_ptr + slot.to(tl.int64) * stride_ws
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            mask_k = offs_k < K
            a = tl.load(x_ptr + row[:, None] * stride_xm + offs_k[None, :] * stride_xk,
                        mask=mask_m[:, None] & mask_k[None, :], other=0.0)
            w = tl.load(w_base + offs_n[None, :] * stride_wn + offs_k[:, None] * stride_wk,
                        mask=mask_n[None, :] & mask_k[:, None], other=0.0)
            acc += tl.dot(a.to(w.dtype), w)
        ptrs = out_ptr + row[:, None] * stride_om + offs_n[None, :] * stride_on
        mask = mask_m[:, None] & mask_n[None, :]
        if ADD:
            acc += tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
        tl.store(ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask)


def block_m_for(rows: int) -> int:
    """Rows per block: 16 for decode-sized steps (and every CUDA graph), 64 for fills."""
    return 16 if rows <= 1024 else 64


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


def sgmv_triton(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor, rows: torch.Tensor,
                indptr: torch.Tensor, block_slot: torch.Tensor, block_start: torch.Tensor,
                block_m: int, add: bool) -> None:
    """One launch over the block table (device tensors; `block_m` the table's rows per
    block). Each row appears at most once in `rows`."""
    n, k = w.shape[1], w.shape[2]
    if block_slot.shape[0] == 0:
        return
    # the shrink has a small N and a long K; the expand the reverse
    block_n = max(16, min(64, triton.next_power_of_2(n)))
    block_k = max(16, min(128, triton.next_power_of_2(k)))
    grid = (block_slot.shape[0], triton.cdiv(n, block_n))
    _sgmv_kernel[grid](
        x, w, out, rows, indptr, block_slot, block_start, n, k,
        x.stride(0), x.stride(1), w.stride(0), w.stride(1), w.stride(2),
        out.stride(0), out.stride(1),
        ADD=add, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
    )
