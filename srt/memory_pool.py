"""The two-level KV memory: ReqToTokenPool (request rows) and TokenToKVPool (KV slots), page size 1.

Page size 1: every token owns one slot, so the radix cache can share any prefix at token
granularity. Free lists live on the CPU: allocating is a slice, freeing a concatenation; there is
no `torch.nonzero` scan and no device sync on the hot path. This module knows nothing of the tree
or the scheduler.
"""

from __future__ import annotations

import torch


class ReqToTokenPool:
    """`req_to_token[row, i]` is the KV slot of token i of the request living in `row`.

    Rows are handed out by `alloc` and given back by `free`; the table itself is on the device.
    """

    def __init__(self, size: int, context_len: int, device: torch.device | str) -> None:
        self.size = size
        self.context_len = context_len
        self.req_to_token = torch.zeros((size, context_len), dtype=torch.int32, device=device)
        self._free_rows: list[int] = list(range(size))

    def available_size(self) -> int:
        return len(self._free_rows)

    def alloc(self) -> int | None:
        """One free row, or None when all are in use."""
        if not self._free_rows:
            return None
        return self._free_rows.pop()

    def free(self, row: int) -> None:
        if not 0 <= row < self.size:
            raise ValueError(f"row {row} out of range")
        self._free_rows.append(row)

    def clear(self) -> None:
        self._free_rows = list(range(self.size))


class TokenToKVPool:
    """Per layer a K and a V buffer `[size, kv_heads, head_dim]`, and the slot free list.

    Slots are int64 indices into dim 0. Slot `size` exists as a padding slot: writes for padded
    positions may go there, and it is never handed out.
    """

    def __init__(
        self,
        size: int,
        num_layers: int,
        kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        self.size = size
        self.num_layers = num_layers
        self.kv_heads = kv_heads
        self.head_dim = head_dim
        self.dtype = dtype
        self.device = torch.device(device)
        # torch.empty: pages are touched only when used; slot `size` is the padding slot.
        self.k_buffer = [
            torch.empty((size + 1, kv_heads, head_dim), dtype=dtype, device=device)
            for _ in range(num_layers)
        ]
        self.v_buffer = [
            torch.empty((size + 1, kv_heads, head_dim), dtype=dtype, device=device)
            for _ in range(num_layers)
        ]
        self.clear()

    @property
    def bytes_per_token(self) -> int:
        return 2 * self.num_layers * self.kv_heads * self.head_dim * self.dtype.itemsize

    def available_size(self) -> int:
        return int(self._free.numel())

    def alloc(self, n: int) -> torch.Tensor | None:
        """n free slots (int64 CPU tensor), or None (and nothing taken) when fewer are free."""
        if n > self._free.numel():
            return None
        out = self._free[:n]
        self._free = self._free[n:]
        return out

    def free(self, slots: torch.Tensor) -> None:
        """Return slots to the free list. Freeing is batched by the caller where it can be."""
        if slots.numel() == 0:
            return
        self._free = torch.cat((self._free, slots.to("cpu", torch.int64)))

    def clear(self) -> None:
        self._free = torch.arange(self.size, dtype=torch.int64)

    def get_kv_buffer(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.k_buffer[layer_id], self.v_buffer[layer_id]
