"""The per-step allowed-token mask of a batch with constrained requests."""

from __future__ import annotations

from collections import OrderedDict
from typing import Sequence

import torch

from srt.constrained.fsm import TokenFSM


class ForbiddenRows:
    """Forbidden-token rows per (FSM, state) on the device, built once and reused.

    A row is a [vocab] bool vector, True where the token is forbidden. Rows live in one
    [slots, vocab] tensor on the device (slot 0 forbids nothing: the unconstrained rows), kept
    in LRU order within `budget_bytes` (a JSON schema may have thousands of states; each row
    costs vocab bytes); the tensor grows by doubling up to that. Keys use the FSM's `serial`,
    unique per compiled FSM, so a row never outlives its pattern's meaning. A batch's mask is
    then one `index_select` of cached rows on the device: nothing but the row indices is copied
    from the host, and nothing waits for the forward in flight (every copy is non-blocking, so
    the host builds the mask while the device still runs the forward).
    """

    def __init__(self, vocab_size: int, device: torch.device,
                 budget_bytes: int = 256 * 2**20) -> None:
        self.vocab_size = vocab_size
        self.device = device
        self.max_rows = max(16, budget_bytes // max(1, vocab_size))
        self._rows: OrderedDict[tuple[int, int], int] = OrderedDict()  # key -> slot
        self._slab = torch.zeros((min(64, self.max_rows) + 1, vocab_size), dtype=torch.bool,
                                 device=device)
        self._free_slots = list(range(self._slab.shape[0] - 1, 0, -1))
        self.built = 0  # rows built so far (each (FSM, state) once while cached)

    def _grow(self) -> None:
        old = self._slab
        n = min(2 * (old.shape[0] - 1), self.max_rows) + 1
        self._slab = torch.zeros((n, self.vocab_size), dtype=torch.bool, device=self.device)
        self._slab[: old.shape[0]] = old
        self._free_slots.extend(range(n - 1, old.shape[0] - 1, -1))

    def _slot(self, fsm: TokenFSM, state: int) -> int:
        key = (fsm.serial, state)
        slot = self._rows.get(key)
        if slot is not None:
            self._rows.move_to_end(key)
            return slot
        if not self._free_slots:
            if len(self._rows) < self.max_rows:
                self._grow()
            else:
                self._free_slots.append(self._rows.popitem(last=False)[1])
        slot = self._free_slots.pop()
        ids = fsm.allowed_tokens(state)
        ids = ids[ids < self.vocab_size]
        r = torch.ones(self.vocab_size, dtype=torch.bool)
        r[ids] = False
        # Non-blocking from pageable memory: the driver stages `r` before the call returns, and
        # the copy is ordered after any earlier read of this slot on the stream.
        self._slab[slot].copy_(r, non_blocking=True)
        self._rows[key] = slot
        self.built += 1
        return slot

    def row(self, fsm: TokenFSM, state: int) -> torch.Tensor:
        return self._slab[self._slot(fsm, state)]

    def batch(self, rows: list[tuple[TokenFSM, int] | None]) -> torch.Tensor:
        """[bs, vocab] bool, True where a token is forbidden: for each constrained row (fsm,
        state) every token outside the FSM's allowed set; unconstrained rows (None) forbid
        nothing."""
        keys = {(x[0].serial, x[1]) for x in rows if x is not None}
        if len(keys) > self.max_rows:  # more states at once than the cache holds
            return torch.stack([torch.zeros(self.vocab_size, dtype=torch.bool,
                                            device=self.device) if x is None
                                else self.row(*x).clone() for x in rows])
        index = torch.tensor([0 if x is None else self._slot(*x) for x in rows],
                             dtype=torch.int64).to(self.device, non_blocking=True)
        if self.device.type == "cpu":  # the CPU's index_select of bool rows is ~1000x slower
            return self._slab.view(torch.uint8).index_select(0, index).view(torch.bool)
        return self._slab.index_select(0, index)


def constrained_forbidden(rows: list[tuple[TokenFSM, int] | None], vocab_size: int,
                          device: torch.device) -> torch.Tensor:
    """`ForbiddenRows.batch` without a cache kept between calls."""
    return ForbiddenRows(vocab_size, device).batch(rows)


def merge_forbidden(existing: torch.Tensor | None, fsm_forbidden: torch.Tensor) -> torch.Tensor:
    """Union of both masks; where that leaves a row nothing (min_new_tokens keeping out the EOS
    that is the FSM's only way on), the FSM's mask alone wins: the pattern is the harder rule."""
    if existing is None:
        return fsm_forbidden
    both = existing | fsm_forbidden
    empty = both.all(dim=-1, keepdim=True)
    return torch.where(empty, fsm_forbidden, both)


def keep_out_mask(keep_out: Sequence[tuple[int, Sequence[int]]], bs: int, vocab_size: int,
                  device: torch.device) -> torch.Tensor:
    """[bs, vocab] bool on `device`, True at each (row, ids) of `keep_out` (ids at or past
    `vocab_size` ignored). A few ids a row: their flat positions go to the device, not a
    [bs, vocab] host mask (and index_fill_, not `mask[rows, cols] = True`: that assignment
    waits for the device)."""
    flat = [i * vocab_size + t for i, ids in keep_out for t in ids if t < vocab_size]
    mask = torch.zeros((bs, vocab_size), dtype=torch.bool, device=device)
    if flat:
        idx = torch.tensor(flat, dtype=torch.int64).to(device, non_blocking=True)
        mask.view(-1).index_fill_(0, idx, True)
    return mask
