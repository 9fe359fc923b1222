"""The two-level KV memory: ReqToTokenPool (request rows) and TokenToKVPool (KV slots), page size 1.

Page size 1: every token owns one slot, so the radix cache can share any prefix at token
granularity. Free lists live on the CPU: allocating takes slices off the front, freeing appends a
chunk at the back; there is no `torch.nonzero` scan and no device sync on the hot path. This
module knows nothing of the tree or the scheduler.
"""

from __future__ import annotations

from collections import deque

import numpy as np
import torch

# Freed chunks shorter than this are merged with the chunk before them (if that one is short too),
# so many one-slot frees do not make an allocation gather thousands of pieces.
_SMALL_CHUNK = 4096


class ReqToTokenPool:
    """`req_to_token[row, i]` is the KV slot of token i of the request living in `row`.

    Rows are handed out by `alloc` and given back by `free`. The table lives on the device (the
    attention kernels read it) with a host mirror, `host`, that every write goes to as well, so
    the host never reads back from the device what it wrote itself (on the CPU they are one
    tensor). Writes go through `write_spans`, or `host` plus a device-side write by the caller.

    Scratch rows (`scratch`, rows size .. size + scratch - 1) are never handed out: a step
    that needs KV lists of its own for a while (the branches of a draft tree) writes them with
    `fork_rows` and reads them through its rows' indices; their content lasts until the next
    step that forks.
    """

    def __init__(self, size: int, context_len: int, device: torch.device | str,
                 scratch: int = 0) -> None:
        self.size = size
        self.context_len = context_len
        self.scratch = range(size, size + scratch)
        self.req_to_token = torch.zeros((size + scratch, context_len), dtype=torch.int32,
                                        device=device)
        self.host = (self.req_to_token if self.req_to_token.device.type == "cpu"
                     else torch.zeros((size + scratch, context_len), dtype=torch.int32))
        self._free_rows: list[int] = list(range(size))

    def fork_rows(self, dst: np.ndarray, src: np.ndarray, prefix: int,
                  cells: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None) -> None:
        """Scratch row dst[i] takes columns 0 .. prefix - 1 of row src[i] (what lies past a
        row's own length is copied too, and never read), then each cell (row, column, slot)
        of `cells` is written. Device copies only, queued in order; the host mirror of scratch
        rows is not kept."""
        if len(dst) == 0:
            return
        dev = self.req_to_token.device
        both = torch.from_numpy(np.stack((dst, src))).to(dev, non_blocking=True)
        self.req_to_token[both[0], :prefix] = self.req_to_token[both[1], :prefix]
        if cells is not None and len(cells[0]):
            c = torch.from_numpy(np.stack(cells)).to(dev, non_blocking=True)
            self.req_to_token[c[0], c[1]] = c[2].to(torch.int32)

    def write_spans(self, spans: list[tuple[int, int, torch.Tensor]]) -> None:
        """For each (row, start, slots): columns start .. start + len(slots) - 1 of row hold
        slots (a CPU tensor). The device gets them in one non-blocking copy."""
        spans = [(row, start, v) for row, start, v in spans if v.numel()]
        if not spans:
            return
        for row, start, v in spans:
            self.host[row, start : start + v.numel()] = v
        if self.host is self.req_to_token:
            return
        flat = torch.cat([torch.arange(start, start + v.numel(), dtype=torch.int64)
                          + row * self.context_len for row, start, v in spans])
        vals = torch.cat([v.to(torch.int64) for _, _, v in spans])
        both = torch.stack((flat, vals)).to(self.req_to_token.device, non_blocking=True)
        self.req_to_token.view(-1).index_copy_(0, both[0], both[1].to(torch.int32))

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
    `shared_kv`: K and V are one buffer (multi-head latent attention keeps one latent vector
    per token and layer, read as both keys and values).

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
        shared_kv: bool = False,
    ) -> None:
        self.size = size
        self.shared_kv = shared_kv
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
        self.v_buffer = self.k_buffer if shared_kv else [
            torch.empty((size + 1, kv_heads, head_dim), dtype=dtype, device=device)
            for _ in range(num_layers)
        ]
        self.clear()

    @property
    def bytes_per_token(self) -> int:
        kv = 1 if self.shared_kv else 2
        return kv * self.num_layers * self.kv_heads * self.head_dim * self.dtype.itemsize

    def available_size(self) -> int:
        return self._num_free

    def alloc(self, n: int) -> torch.Tensor | None:
        """n free slots (int64 CPU tensor), or None (and nothing taken) when fewer are free.

        Slots come in free-list order: first the never-used ones in index order, then freed ones
        in the order they were freed (a FIFO, so every TP rank hands out the same slots)."""
        if n > self._num_free:
            return None
        self._num_free -= n
        parts: list[torch.Tensor] = []
        while n > 0:
            head = self._chunks[0]
            if head.numel() <= n:
                parts.append(self._chunks.popleft())
                n -= head.numel()
            else:
                parts.append(head[:n])
                self._chunks[0] = head[n:]
                n = 0
        if len(parts) == 1:
            return parts[0]
        return torch.cat(parts) if parts else torch.empty(0, dtype=torch.int64)

    def free(self, slots: torch.Tensor) -> None:
        """Return slots to the free list: O(len(slots)), whatever the number of free slots (a
        concatenation with the whole free list cost milliseconds on a pool of millions)."""
        if slots.numel() == 0:
            return
        # A copy: the caller may keep using its tensor (a tree node keeps the rest of a split).
        slots = slots.to("cpu", torch.int64, copy=True).reshape(-1)
        self._num_free += slots.numel()
        tail = self._chunks[-1] if self._chunks else None
        if (tail is not None and slots.numel() < _SMALL_CHUNK
                and tail.numel() < _SMALL_CHUNK):
            self._chunks[-1] = torch.cat((tail, slots))
        else:
            self._chunks.append(slots)

    def clear(self) -> None:
        self._chunks: deque[torch.Tensor] = deque([torch.arange(self.size, dtype=torch.int64)])
        self._num_free = self.size

    def get_kv_buffer(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.k_buffer[layer_id], self.v_buffer[layer_id]
