"""The per-step allowed-token mask of a batch with constrained requests."""

from __future__ import annotations

from collections import OrderedDict

import torch

from srt.constrained.fsm import TokenFSM


class ForbiddenRows:
    """Forbidden-token rows per (FSM, state) on the device, built once and reused.

    A row is a [vocab] bool tensor, True where the token is forbidden. Rows are kept in LRU
    order within `budget_bytes` (a JSON schema may have thousands of states; each row costs
    vocab bytes). Keys use the FSM's `serial`, unique per compiled FSM, so a row never outlives
    its pattern's meaning. A batch's mask is then one `stack` of cached rows on the device:
    nothing is copied from the host and nothing waits for the forward in flight.
    """

    def __init__(self, vocab_size: int, device: torch.device,
                 budget_bytes: int = 256 * 2**20) -> None:
        self.vocab_size = vocab_size
        self.device = device
        self.max_rows = max(16, budget_bytes // max(1, vocab_size))
        self._rows: OrderedDict[tuple[int, int], torch.Tensor] = OrderedDict()
        self._free = torch.zeros(vocab_size, dtype=torch.bool, device=device)

    def row(self, fsm: TokenFSM, state: int) -> torch.Tensor:
        key = (fsm.serial, state)
        r = self._rows.get(key)
        if r is not None:
            self._rows.move_to_end(key)
            return r
        ids = fsm.allowed_tokens(state)
        ids = ids[ids < self.vocab_size]
        r = torch.ones(self.vocab_size, dtype=torch.bool)
        r[ids] = False
        r = r.to(self.device)
        self._rows[key] = r
        if len(self._rows) > self.max_rows:
            self._rows.popitem(last=False)
        return r

    def batch(self, rows: list[tuple[TokenFSM, int] | None]) -> torch.Tensor:
        """[bs, vocab] bool, True where a token is forbidden: for each constrained row (fsm,
        state) every token outside the FSM's allowed set; unconstrained rows (None) forbid
        nothing."""
        return torch.stack([self._free if x is None else self.row(*x) for x in rows])


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
