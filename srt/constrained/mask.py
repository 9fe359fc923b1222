"""The per-step allowed-token mask of a batch with constrained requests."""

from __future__ import annotations

import torch

from srt.constrained.fsm import TokenFSM


def constrained_forbidden(rows: list[tuple[TokenFSM, int] | None], vocab_size: int,
                          device: torch.device) -> torch.Tensor:
    """[bs, vocab] bool, True where a token is forbidden: for each constrained row (fsm, state)
    every token outside the FSM's allowed set; unconstrained rows (None) forbid nothing.

    The index lists are gathered on the host from per-state cached tensors and scattered into the
    mask with one indexing op on the device.
    """
    bs = len(rows)
    row_idx: list[torch.Tensor] = []
    tok_idx: list[torch.Tensor] = []
    free_rows: list[int] = []
    for i, row in enumerate(rows):
        if row is None:
            free_rows.append(i)
            continue
        fsm, state = row
        ids = fsm.allowed_tokens(state)
        ids = ids[ids < vocab_size]
        row_idx.append(torch.full_like(ids, i))
        tok_idx.append(ids)
    allowed = torch.zeros((bs, vocab_size), dtype=torch.bool, device=device)
    if free_rows:
        allowed[torch.tensor(free_rows, device=device)] = True
    if row_idx:
        r = torch.cat(row_idx).to(device, non_blocking=True)
        c = torch.cat(tok_idx).to(device, non_blocking=True)
        allowed[r, c] = True
    return ~allowed


def merge_forbidden(existing: torch.Tensor | None, fsm_forbidden: torch.Tensor) -> torch.Tensor:
    """Union of both masks; where that leaves a row nothing (min_new_tokens keeping out the EOS
    that is the FSM's only way on), the FSM's mask alone wins: the pattern is the harder rule."""
    if existing is None:
        return fsm_forbidden
    both = existing | fsm_forbidden
    empty = both.all(dim=-1, keepdim=True)
    return torch.where(empty, fsm_forbidden, both)
