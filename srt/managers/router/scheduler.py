"""Which waiting requests join the next fill batch: queue order and the admission arithmetic.

Admission (DESIGN section 3): a fill batch may use

    available = free + evictable - sum(remaining max_new_tokens of running requests) * new_token_ratio

and admits requests in queue order while `extend_len + max_new_tokens` fits `available` and the
batch's new tokens fit the prefill budget. The running requests' reservation is scaled by a ratio
(most requests stop before max_new_tokens); if decoding then runs out of slots the model process
retracts requests and raises the ratio.
"""

from __future__ import annotations

import random
from collections import defaultdict
from dataclasses import dataclass
from typing import Any, Callable


def order_queue(waiting: list[Any], policy: str, rng: random.Random, root: Any = None) -> list[Any]:
    """Order requests whose `prefix_indices` / `last_node` were just matched.

    lpm: longest cached prefix first. dfs-weight: depth-first over the radix tree, heavier subtrees
    (more waiting requests) first, so requests sharing a prefix run together. fcfs: arrival order.
    random: shuffled (with the server's seeded generator, so every rank agrees).
    """
    if policy == "lpm":
        return sorted(waiting, key=lambda r: (-len(r.prefix_indices), r.arrival))
    if policy == "fcfs":
        return sorted(waiting, key=lambda r: r.arrival)
    if policy == "random":
        out = sorted(waiting, key=lambda r: r.arrival)
        rng.shuffle(out)
        return out
    if policy == "dfs-weight":
        return _dfs_weight(waiting, root)
    raise ValueError(f"unknown schedule heuristic {policy!r}")


def _dfs_weight(waiting: list[Any], root: Any) -> list[Any]:
    by_node: dict[int, list[Any]] = defaultdict(list)
    weight: dict[int, int] = defaultdict(int)
    for r in sorted(waiting, key=lambda r: r.arrival):
        by_node[id(r.last_node)].append(r)
        node = r.last_node
        while node is not None:
            weight[id(node)] += 1
            node = node.parent
    out: list[Any] = []
    stack = [root]
    while stack:
        node = stack.pop()
        out.extend(by_node.get(id(node), ()))
        children = [c for c in node.children.values() if weight.get(id(c), 0) > 0]
        # push lightest first so the heaviest subtree is visited next
        children.sort(key=lambda c: weight[id(c)])
        stack.extend(children)
    return out


@dataclass
class Admission:
    """The running arithmetic of one fill batch. `try_admit` is the only mutator."""

    available: int
    max_prefill_tokens: int
    free_rows: int
    batch_new_tokens: int = 0
    admitted: int = 0

    @classmethod
    def start(
        cls,
        free: int,
        evictable: int,
        running_remaining: list[int],
        new_token_ratio: float,
        max_prefill_tokens: int,
        free_rows: int,
    ) -> "Admission":
        reserved = sum(running_remaining) * new_token_ratio
        return cls(int(free + evictable - reserved), max_prefill_tokens, free_rows)

    def _fits(self, extend_len: int, max_new: int) -> bool:
        if self.free_rows <= self.admitted:
            return False
        if extend_len + max_new > self.available:
            return False
        # A prompt longer than the budget still runs, alone.
        return self.admitted == 0 or self.batch_new_tokens + extend_len <= self.max_prefill_tokens

    def try_admit(
        self, extend_len: int, max_new: int, lock: Callable[[], int], unlock: Callable[[], int]
    ) -> bool:
        """Admit one request if it fits. `lock()` locks its matched prefix and returns the change
        of evictable tokens (<= 0); if the lock made it no longer fit, `unlock()` undoes it."""
        if not self._fits(extend_len, max_new):
            return False
        self.available += lock()
        if not self._fits(extend_len, max_new):
            self.available += unlock()
            return False
        self.available -= extend_len + max_new
        self.batch_new_tokens += extend_len
        self.admitted += 1
        return True
