"""The KV manager: the radix tree over the two pools, and every hand-off of slots between them.

A running request owns a row of req_to_token; its first `len(prefix_indices)` slots belong to
the tree (locked through `last_node`), the rest are its own until `cache_filled` or
`cache_finished` gives them to the tree. Every read of a row here uses the host mirror
(`ReqToTokenPool.host`), so no hand-off waits for the device.

Frees while a step is in flight are safe: the device runs work in launch order, so a slot freed
now and handed out again is written by a later step only after the step in flight is done.
"""

from __future__ import annotations

import torch

from srt.memory_pool import ReqToTokenPool, TokenToKVPool
from srt.model_process.radix_cache import RadixCache
from srt.model_process.req import Req


class KVManager:
    def __init__(self, pool: TokenToKVPool, req_pool: ReqToTokenPool, tree: RadixCache) -> None:
        self.pool = pool
        self.req_pool = req_pool
        self.tree = tree

    def alloc_slots(self, n: int) -> torch.Tensor:
        """n slots, evicting from the tree if needed. Callers have checked that n fits."""
        free = self.pool.available_size()
        if free < n:
            self.tree.evict(n - free)
        slots = self.pool.alloc(n)
        if slots is None:
            raise RuntimeError(
                f"KV pool accounting broken: {n} slots needed, {self.pool.available_size()} free"
            )
        return slots

    def room(self) -> int:
        """Slots a step could get now, evicting what the tree holds unlocked."""
        return self.pool.available_size() + self.tree.evictable_size()

    def assign_rows(self, reqs: list[Req], slots: torch.Tensor) -> None:
        """Give each request of a fill batch a row holding its cached prefix and then its share
        of `slots` (extend_input_len each, in order). A request between prefill chunks keeps
        its row (which holds its prefix already) and gets only the new slots."""
        spans: list[tuple[int, int, torch.Tensor]] = []
        offset = 0
        for r in reqs:
            pre, ext = len(r.prefix_indices), r.extend_input_len
            if r.req_pool_idx is None:
                row = self.req_pool.alloc()
                if row is None:
                    raise RuntimeError("req_to_token rows exhausted despite admission")
                r.req_pool_idx = row
                spans.append((row, 0, r.prefix_indices))
            spans.append((r.req_pool_idx, pre, slots[offset : offset + ext]))
            offset += ext
        self.req_pool.write_spans(spans)

    def extend_rows(self, reqs: list[Req], starts: list[int], slots: torch.Tensor) -> None:
        """Write `slots` into running requests' rows: request i gets the next share from column
        starts[i] on, as many as it computes (`step_input_len`). For a decode row inside a fill
        step (a mixed step), whose slot the executor does not write."""
        spans: list[tuple[int, int, torch.Tensor]] = []
        offset = 0
        for r, start in zip(reqs, starts):
            n = r.step_input_len
            assert r.req_pool_idx is not None
            spans.append((r.req_pool_idx, start, slots[offset : offset + n]))
            offset += n
        self.req_pool.write_spans(spans)

    def row_slots(self, req: Req, start: int, end: int) -> torch.Tensor:
        """Slots of columns start .. end - 1 of the request's row (int64, from the host mirror)."""
        assert req.req_pool_idx is not None
        return self.req_pool.host[req.req_pool_idx, start:end].to(torch.int64)

    def cache_filled(self, req: Req) -> None:
        """After an extend: give the request's KV to the tree and lock the new path, so that
        other requests can share it while this one still runs."""
        req.kv_valid = None
        if self.tree.disable:
            req.prefix_indices = torch.empty(0, dtype=torch.int64)
            return
        self._insert_and_lock(req, len(req.fill_ids))

    def cache_chunk(self, req: Req, n: int) -> None:
        """After a chunk of a chunked prefill computed the request's first n positions: they
        go to the tree (locked, as for `cache_filled`) and `prefix_indices` covers them all,
        so the next chunk starts at n. Radix cache off: the row keeps them, as its own."""
        req.kv_valid = n
        if self.tree.disable:
            req.prefix_indices = self.row_slots(req, 0, n)
            return
        self._insert_and_lock(req, n)

    def _insert_and_lock(self, req: Req, n: int) -> None:
        slots = self.row_slots(req, 0, n)
        old = len(req.prefix_indices)
        present = self.tree.insert(req.fill_ids[:n], slots, req.lora_id)
        if present > old:  # someone inserted the same tokens meanwhile: use theirs, free ours
            self.pool.free(slots[old:present])
        new_prefix, new_node = self.tree.match_prefix(req.fill_ids[:n], req.lora_id)
        assert req.req_pool_idx is not None and req.last_node is not None
        self.req_pool.write_spans([(req.req_pool_idx, old, new_prefix[old:])])
        self.tree.inc_lock_ref(new_node)
        self.tree.dec_lock_ref(req.last_node)
        req.prefix_indices, req.last_node = new_prefix, new_node

    def cache_finished(self, req: Req) -> None:
        """The request leaves the running set: its KV goes to the tree, its lock and row go
        back. A token of a step still in flight is not counted (its slot is the step's)."""
        if req.req_pool_idx is None:
            return
        # Every token has KV except the last sampled one (a prefill-only request has none), or
        # after a jump inside the batch or between prefill chunks, the ids before kv_valid.
        if req.kv_valid is not None:
            n = req.kv_valid
        else:
            n = req.kv_len if req.output_ids else len(req.origin_input_ids)
        req.kv_valid = None
        slots = self.row_slots(req, 0, n)
        old = len(req.prefix_indices)
        present = self.tree.insert(req.fill_ids[:n], slots, req.lora_id)
        if present > old:
            self.pool.free(slots[old:present])
        if req.last_node is not None:
            self.tree.dec_lock_ref(req.last_node)
        self.req_pool.free(req.req_pool_idx)
        req.req_pool_idx = None
        req.prefix_indices = torch.empty(0, dtype=torch.int64)
        req.last_node = None

    def free_tail(self, req: Req, start: int, end: int) -> None:
        """Free the request's own slots of columns start .. end - 1 (a jump replaced their ids)."""
        if start < end:
            self.pool.free(self.row_slots(req, start, end))

    def is_free(self) -> bool:
        """Every slot free or evictable, no tree lock, every row free (nothing runs)."""
        return (self.pool.available_size() + self.tree.evictable_size() == self.pool.size
                and self.tree.locked_size() == 0
                and self.req_pool.available_size() == self.req_pool.size)
