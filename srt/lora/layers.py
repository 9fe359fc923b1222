"""The LoRA part of one tensor-parallel linear layer: the adapters' weights in pool slots, and
the shrink / expand that adds them to the layer's output.

A layer adapts one or several projections (slices of its output: q, k and v of `qkv_proj`, gate
and up of `gate_up_proj`). Slot s of the pool holds, for every slice j, A_j in rows
j * max_rank .. of `a` [slots, slices * max_rank, in] and B_j (times the adapter's scaling) in the
slice's rows of `b` [slots, out, max_rank]; a smaller rank is zero-padded, a projection the
adapter does not adapt is zero.

Sharding follows the base layer (its own `weight_loader` cuts the adapter's tensors):
column-parallel layers keep A whole and B's rows of the rank's output; row-parallel layers keep
A's columns of the rank's input and B whole, and their LoRA output is added to the rank's partial
sum before the layer's all-reduce (B (sum_r A_r x_r) = sum_r B A_r x_r), so LoRA costs no extra
communication.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from srt.lora.sgmv import expand_triton, sgmv_torch, sgmv_triton, shrink_splits


@dataclass
class LoraBatchInfo:
    """A step's rows that use adapters, grouped by slot (srt.lora.sgmv): group s is
    rows[indptr[s] : indptr[s + 1]], one group per pool slot (empty for unused slots); and the
    Triton path's block table of that grouping (`row_blocks`, block_m rows a block)."""

    rows: torch.Tensor  # [R] int64, on the model's device
    indptr: torch.Tensor  # [slots + 1] int64, on the model's device
    block_slot: torch.Tensor  # [blocks] int64 (-1: padding)
    block_start: torch.Tensor  # [blocks] int64
    block_m: int
    indptr_host: list[int] | None  # the torch path's copy; None: the Triton path


@dataclass(frozen=True)
class Slice:
    """One adapted projection of a layer: its name (PEFT's), the loader's shard id, and where
    its output lies in the layer's rank-local output."""

    module: str
    shard: object  # None (a one-projection layer), 0 / 1 (gate / up), "q" / "k" / "v"
    out_offset: int
    out_size: int


@dataclass
class SlotImage:
    """One adapter's tensors for one LoraLinear, laid out as a pool slot holds them (the rank's
    shard, the model's dtype; pinned host memory on a GPU): written into a slot by two copies."""

    a: torch.Tensor  # [slices * max_rank, in_local]
    b: torch.Tensor  # [col_hi - col_lo, max_rank]


class LoraLinear:
    """Attached to a base linear layer as `layer.lora`; `apply` runs inside its forward."""

    def __init__(self, base: torch.nn.Module, slices: list[Slice], in_full: int,
                 row_parallel: bool, num_slots: int, max_rank: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        self.base = base
        self.slices = slices
        self.row_parallel = row_parallel
        self.in_full = in_full
        self.max_rank = max_rank
        self.in_local = base.in_per_rank if row_parallel else in_full
        # b's rows are the output columns col_lo .. col_hi (those between adapted slices, e.g. k
        # when only q and v are adapted, stay zero)
        self.col_lo = slices[0].out_offset
        self.col_hi = slices[-1].out_offset + slices[-1].out_size
        self.a = torch.zeros(num_slots, len(slices) * max_rank, self.in_local, dtype=dtype,
                             device=device)
        self.b = torch.zeros(num_slots, self.col_hi - self.col_lo, max_rank, dtype=dtype,
                             device=device)

    def image(self, pairs: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> SlotImage:
        """A slot's contents from an adapter's full (unsharded) A [r, in] / B [out, r] of this
        layer's projections (`pairs` by PEFT name; a missing one is zero)."""
        a_img = torch.zeros(self.a.shape[1:])
        b_img = torch.zeros(self.b.shape[1:])
        for j, s in enumerate(self.slices):
            if s.module not in pairs:
                continue
            a, b = pairs[s.module]
            r = a.shape[0]
            a_dst = a_img[j * self.max_rank: j * self.max_rank + r]
            rows = slice(s.out_offset - self.col_lo, s.out_offset - self.col_lo + s.out_size)
            if self.row_parallel:
                self.base.weight_loader(a_dst, a)  # the rank's input columns
                b_img[rows, :r] = b
            else:
                a_dst.copy_(a)
                local = torch.zeros(self.col_hi, r)
                if s.shard is None:
                    self.base.weight_loader(local, b)
                else:
                    self.base.weight_loader(local, b, s.shard)  # the slice's rows of the rank
                b_img[rows, :r] = local[s.out_offset:s.out_offset + s.out_size]
        pin = self.a.device.type == "cuda"
        return SlotImage(a_img.to(self.a.dtype).pin_memory() if pin else a_img.to(self.a.dtype),
                         b_img.to(self.b.dtype).pin_memory() if pin else b_img.to(self.b.dtype))

    def put(self, slot: int, image: SlotImage) -> None:
        """Write an image into a slot, on the current stream (after the steps before it)."""
        self.a[slot].copy_(image.a, non_blocking=True)
        self.b[slot].copy_(image.b, non_blocking=True)

    def write_slot(self, slot: int, pairs: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> None:
        self.put(slot, self.image(pairs))

    def apply(self, x: torch.Tensor, out: torch.Tensor, info: LoraBatchInfo) -> torch.Tensor:
        """out (the base layer's output for x, or a row-parallel rank's partial sum) plus each
        row's adapter; rows of no adapter unchanged. Writes into `out`."""
        x2 = x.reshape(-1, x.shape[-1])
        out2 = out.view(-1, out.shape[-1])
        rank = self.max_rank
        if info.indptr_host is not None:
            shrunk = torch.empty(x2.shape[0], self.a.shape[1], dtype=x2.dtype,
                                 device=x2.device)
            sgmv_torch(x2, self.a, shrunk, info.rows, info.indptr_host, add=False)
            for j, s in enumerate(self.slices):
                lo = s.out_offset - self.col_lo
                sgmv_torch(shrunk[:, j * rank:(j + 1) * rank],
                           self.b[:, lo:lo + s.out_size],
                           out2[:, s.out_offset:s.out_offset + s.out_size],
                           info.rows, info.indptr_host, add=True)
            return out
        blocks = (info.rows, info.indptr, info.block_slot, info.block_start, info.block_m)
        # float32 partial sums over K splits [splits, rows, slices x rank]
        shrunk = torch.empty(shrink_splits(x2.shape[0], x2.shape[1]), x2.shape[0],
                             self.a.shape[1], dtype=torch.float32, device=x2.device)
        sgmv_triton(x2, self.a, shrunk, *blocks, add=False)
        expand_triton(shrunk, self.b, out2, self.col_lo,
                      [(s.out_offset, s.out_offset + s.out_size) for s in self.slices], rank,
                      *blocks)
        return out
