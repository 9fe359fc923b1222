"""Tests of srt.model_process.policy: the admission arithmetic and the queue orders."""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from srt.model_process.radix_cache import RadixCache, TreeNode
from srt.model_process.policy import Admission, order_queue

# ====================================================================== Admission


class LockSpy:
    """lock() returns -delta, unlock() returns +delta; both calls are recorded."""

    def __init__(self, delta: int = 0) -> None:
        self.delta = delta
        self.locks = 0
        self.unlocks = 0

    def lock(self) -> int:
        self.locks += 1
        return -self.delta

    def unlock(self) -> int:
        self.unlocks += 1
        return self.delta


def admit(adm: Admission, ext: int, max_new: int, delta: int = 0) -> tuple[bool, LockSpy]:
    spy = LockSpy(delta)
    return adm.try_admit(ext, max_new, spy.lock, spy.unlock), spy


def test_start_formula_truncates() -> None:
    # 100 + 20 - (10 + 7) * 0.5 = 111.5 -> 111
    adm = Admission.start(100, 20, [10, 7], 0.5, 50, 4)
    assert adm.available == 111
    assert (adm.max_prefill_tokens, adm.free_rows, adm.batch_new_tokens, adm.admitted) == (50, 4, 0, 0)
    # 10 + 0 - 3 * 0.7 = 7.9 -> 7 (truncated, not rounded)
    assert Admission.start(10, 0, [3], 0.7, 8, 1).available == 7
    # negative: 0 + 0 - 5 * 0.5 = -2.5 -> int() truncates toward zero: -2
    assert Admission.start(0, 0, [5], 0.5, 8, 1).available == -2
    # no running requests
    assert Admission.start(30, 12, [], 0.9, 8, 1).available == 42
    # ratio 1 reserves all of it
    assert Admission.start(30, 12, [40, 2], 1.0, 8, 1).available == 0


def test_admits_while_memory_and_prefill_budget_fit() -> None:
    adm = Admission.start(100, 20, [10, 7], 0.5, 50, 4)  # available 111
    ok, spy = admit(adm, 30, 20)
    assert ok and spy.locks == 1 and spy.unlocks == 0
    assert (adm.available, adm.batch_new_tokens, adm.admitted) == (61, 30, 1)
    # 25 + 10 = 35 <= 61 fits memory, but 30 + 25 = 55 > 50 prefill tokens
    ok, spy = admit(adm, 25, 10)
    assert not ok and spy.locks == 0 and spy.unlocks == 0
    assert (adm.available, adm.batch_new_tokens, adm.admitted) == (61, 30, 1)
    # exactly fits both: 20 + 41 = 61 <= 61, 30 + 20 = 50 <= 50
    ok, _ = admit(adm, 20, 41)
    assert ok
    assert (adm.available, adm.batch_new_tokens, adm.admitted) == (0, 50, 2)
    ok, spy = admit(adm, 0, 1)
    assert not ok and spy.locks == 0
    # zero-cost request still fits with 0 available
    ok, _ = admit(adm, 0, 0)
    assert ok and adm.admitted == 3


def test_one_over_memory_is_refused() -> None:
    adm = Admission.start(40, 0, [], 1.0, 1000, 8)
    ok, spy = admit(adm, 30, 11)  # 41 > 40
    assert not ok and spy.locks == 0
    assert (adm.available, adm.admitted) == (40, 0)
    ok, _ = admit(adm, 30, 10)  # 40 <= 40
    assert ok and adm.available == 0


def test_first_request_ignores_prefill_budget() -> None:
    adm = Admission.start(100, 0, [], 0.0, 10, 4)
    ok, _ = admit(adm, 30, 5)  # 30 > 10 prefill tokens, but it is the first
    assert ok
    assert (adm.available, adm.batch_new_tokens, adm.admitted) == (65, 30, 1)
    ok, _ = admit(adm, 1, 1)  # 30 + 1 > 10
    assert not ok
    # a request with no new tokens to compute (all cached) does not add to the budget... but
    # the batch is already over it: 30 + 0 > 10
    ok, _ = admit(adm, 0, 1)
    assert not ok


def test_lock_delta_is_applied_when_it_still_fits() -> None:
    adm = Admission.start(100, 0, [], 0.0, 1000, 4)
    ok, spy = admit(adm, 10, 10, delta=15)
    assert ok and spy.locks == 1 and spy.unlocks == 0
    assert adm.available == 100 - 15 - 20


def test_lock_that_makes_it_not_fit_is_undone() -> None:
    adm = Admission.start(50, 0, [], 0.0, 1000, 4)
    ok, spy = admit(adm, 20, 20, delta=15)  # 40 <= 50, but 40 > 50 - 15 after the lock
    assert not ok and spy.locks == 1 and spy.unlocks == 1
    assert (adm.available, adm.batch_new_tokens, adm.admitted) == (50, 0, 0)
    ok, spy = admit(adm, 20, 20, delta=10)  # 40 <= 50 - 10 exactly
    assert ok and spy.unlocks == 0
    assert (adm.available, adm.batch_new_tokens, adm.admitted) == (0, 20, 1)


def test_lock_that_makes_it_not_fit_with_uneven_unlock() -> None:
    """The unlock's return value (not the lock's) is what is added back."""
    adm = Admission.start(50, 0, [], 0.0, 1000, 4)
    calls: list[str] = []

    def lock() -> int:
        calls.append("lock")
        return -20

    def unlock() -> int:
        calls.append("unlock")
        return 12  # e.g. another lock still holds part of the path

    assert not adm.try_admit(20, 20, lock, unlock)
    assert calls == ["lock", "unlock"]
    assert adm.available == 42


def test_free_rows_limit_the_count() -> None:
    adm = Admission.start(1000, 0, [], 0.0, 1000, 2)
    assert admit(adm, 1, 1)[0]
    assert admit(adm, 1, 1)[0]
    ok, spy = admit(adm, 1, 1)
    assert not ok and spy.locks == 0
    assert adm.admitted == 2
    none = Admission.start(1000, 0, [], 0.0, 1000, 0)
    ok, spy = admit(none, 1, 1)
    assert not ok and spy.locks == 0


def test_chunked_admission_cuts_the_request_that_crosses_the_chunk() -> None:
    adm = Admission.start(1000, 0, [], 0.0, 1000, 4, chunk_size=100)
    spy = LockSpy(10)
    assert adm.admit(60, 5, spy.lock, spy.unlock) == 60
    # 70 more tokens: only 40 fit this fill, but the whole request (70 + 5) is reserved
    assert adm.admit(70, 5, spy.lock, spy.unlock) == 40
    assert (adm.available, adm.batch_new_tokens, adm.admitted, adm.free_rows) == \
        (1000 - 20 - 65 - 75, 100, 2, 2)
    assert adm.admit(1, 1, spy.lock, spy.unlock) is None  # the chunk is full
    assert spy.locks == 2 and spy.unlocks == 0


def test_chunked_admission_of_a_prefilling_request() -> None:
    # its prefix is locked already and it holds its row: no lock, no row, the rest reserved
    adm = Admission.start(500, 0, [], 0.0, 1000, 0, chunk_size=128)
    assert adm.admit(300, 10, lambda: 0, lambda: 0, held_row=True) == 128
    assert (adm.available, adm.free_rows) == (190, 0)
    # a request that does not fit whole is not admitted, not even for a chunk
    adm = Admission.start(200, 0, [], 0.0, 1000, 4, chunk_size=128)
    spy = LockSpy()
    assert adm.admit(300, 10, spy.lock, spy.unlock) is None and spy.locks == 0


def test_chunk_never_exceeds_max_prefill_tokens() -> None:
    adm = Admission.start(10_000, 0, [], 0.0, 64, 4, chunk_size=256)
    assert adm.admit(1000, 1, lambda: 0, lambda: 0) == 64


# ---------------------------------------------------------------- reference property


def reference_admission(free: int, evictable: int, running: list[int], ratio: float,
                        max_prefill: int, free_rows: int,
                        reqs: list[tuple[int, int, int, int]]) -> tuple[list[bool], list[tuple[int, int]], int]:
    """Straight from the docstring. reqs: (extend_len, max_new, lock_delta, unlock_delta).

    Returns (admitted flags, (locks, unlocks) per request, final available)."""
    available = math.trunc(free + evictable - sum(running) * ratio)
    count = 0
    new_tokens = 0
    flags: list[bool] = []
    calls: list[tuple[int, int]] = []

    def fits(ext: int, max_new: int) -> bool:
        if count >= free_rows:
            return False
        if ext + max_new > available:
            return False
        if count > 0 and new_tokens + ext > max_prefill:
            return False
        return True

    for ext, max_new, lock_delta, unlock_delta in reqs:
        if not fits(ext, max_new):
            flags.append(False)
            calls.append((0, 0))
            continue
        available += lock_delta
        if not fits(ext, max_new):
            available += unlock_delta
            flags.append(False)
            calls.append((1, 1))
            continue
        available -= ext + max_new
        new_tokens += ext
        count += 1
        flags.append(True)
        calls.append((1, 0))
    return flags, calls, available


@settings(max_examples=200, deadline=None)
@given(
    free=st.integers(0, 300),
    evictable=st.integers(0, 200),
    running=st.lists(st.integers(0, 60), max_size=6),
    ratio=st.floats(0.0, 1.5, allow_nan=False),
    max_prefill=st.integers(1, 120),
    free_rows=st.integers(0, 6),
    reqs=st.lists(
        st.tuples(st.integers(0, 80), st.integers(0, 60), st.integers(0, 40)), max_size=10
    ),
)
def test_admission_matches_reference(free: int, evictable: int, running: list[int], ratio: float,
                                     max_prefill: int, free_rows: int,
                                     reqs: list[tuple[int, int, int]]) -> None:
    full = [(e, m, -d, d) for e, m, d in reqs]
    flags, calls, final = reference_admission(free, evictable, running, ratio, max_prefill,
                                              free_rows, full)
    adm = Admission.start(free, evictable, running, ratio, max_prefill, free_rows)
    got_flags, got_calls = [], []
    for ext, max_new, delta in reqs:
        ok, spy = admit(adm, ext, max_new, delta)
        got_flags.append(ok)
        got_calls.append((spy.locks, spy.unlocks))
    assert got_flags == flags
    assert got_calls == calls
    assert adm.available == final
    assert adm.admitted == sum(flags)
    assert adm.admitted <= free_rows
    assert adm.batch_new_tokens == sum(e for (e, _, _), f in zip(reqs, flags) if f)
    # Invariants the formula promises
    admitted = [(e, m) for (e, m, _), f in zip(reqs, flags) if f]
    if len(admitted) > 1:
        assert sum(e for e, _ in admitted) <= max_prefill
    if admitted:
        assert adm.available >= 0


# ====================================================================== order_queue


@dataclass(eq=False)
class R:
    name: str
    arrival: int
    prefix_indices: Any = field(default_factory=lambda: torch.empty(0, dtype=torch.int64))
    last_node: Any = None


def names(reqs: list[R]) -> list[str]:
    return [r.name for r in reqs]


def with_prefix(name: str, arrival: int, n: int) -> R:
    return R(name, arrival, torch.arange(n, dtype=torch.int64))


def test_lpm_longest_prefix_first_ties_by_arrival() -> None:
    waiting = [
        with_prefix("a", 0, 2),
        with_prefix("c", 2, 5),  # listed before b: ties must go by arrival, not list order
        with_prefix("b", 1, 5),
        with_prefix("d", 3, 0),
        with_prefix("e", 4, 7),
    ]
    out = order_queue(waiting, "lpm", random.Random(0))
    assert names(out) == ["e", "b", "c", "a", "d"]
    assert names(waiting) == ["a", "c", "b", "d", "e"]  # input untouched


def test_fcfs_is_arrival_order() -> None:
    waiting = [with_prefix(n, a, p) for n, a, p in [("x", 5, 9), ("y", 1, 0), ("z", 3, 4)]]
    assert names(order_queue(waiting, "fcfs", random.Random(0))) == ["y", "z", "x"]


def test_random_is_a_reproducible_permutation() -> None:
    waiting = [with_prefix(f"r{i}", i, i % 3) for i in range(12)]
    shuffled_input = list(waiting)
    random.Random(99).shuffle(shuffled_input)
    a = order_queue(waiting, "random", random.Random(1234))
    b = order_queue(shuffled_input, "random", random.Random(1234))
    assert sorted(names(a)) == sorted(names(waiting))  # a permutation
    assert len(a) == len(waiting)
    # same seed -> same order, whatever order the waiting list was in (every rank agrees)
    assert names(a) == names(b)
    # a different seed gives another order (12! orders: a collision would be astonishing)
    c = order_queue(waiting, "random", random.Random(4321))
    assert names(c) != names(a)
    # and it actually shuffles
    assert names(a) != names(order_queue(waiting, "fcfs", random.Random(0)))


def test_unknown_policy_raises() -> None:
    with pytest.raises(ValueError):
        order_queue([], "sjf", random.Random(0))


class NullPool:
    def free(self, slots: torch.Tensor) -> None:
        pass


def build_tree(keys: list[list[int]]) -> RadixCache:
    cache = RadixCache(NullPool())
    next_slot = 0
    for key in keys:
        cache.insert(key, torch.arange(next_slot, next_slot + len(key), dtype=torch.int64))
        next_slot += len(key)
    return cache


def matched(cache: RadixCache, name: str, arrival: int, prompt: list[int]) -> R:
    slots, node = cache.match_prefix(prompt)
    return R(name, arrival, slots, node)


def test_dfs_weight_groups_shared_subtrees_heaviest_first() -> None:
    cache = build_tree([[1, 2, 3, 4], [1, 2, 5, 6], [7, 8, 9]])
    reqs = [
        matched(cache, "A", 0, [1, 2, 3, 4, 10]),  # under [1 2] -> [3 4]
        matched(cache, "E", 1, [7, 8, 9, 11]),  # under [7 8] -> [9] (split happens below)
        matched(cache, "B", 2, [1, 2, 5, 6]),  # under [1 2] -> [5 6]
        matched(cache, "F", 3, [42]),  # no match: at the root
        matched(cache, "C", 4, [1, 2, 5, 6, 3]),  # under [1 2] -> [5 6]
        matched(cache, "D", 5, [7, 8, 1]),  # splits [7 8 9] -> ends at [7 8]
        matched(cache, "G", 6, [1, 2, 9]),  # ends exactly at [1 2]
    ]
    assert [len(r.prefix_indices) for r in reqs] == [4, 3, 4, 0, 4, 2, 2]
    assert reqs[3].last_node is cache.root
    # weights: [1 2]: A, B, C, G = 4 (its children [5 6]: 2 > [3 4]: 1); [7 8]: D, E = 2
    out = order_queue(list(reversed(reqs)), "dfs-weight", random.Random(0), cache.roots())
    assert names(out) == ["F", "G", "B", "C", "A", "D", "E"]


def _subtree_nodes(node: TreeNode) -> list[TreeNode]:
    out, stack = [], [node]
    while stack:
        n = stack.pop()
        out.append(n)
        stack.extend(n.children.values())
    return out


@settings(max_examples=60, deadline=None)
@given(
    keys=st.lists(st.lists(st.integers(0, 3), min_size=1, max_size=6), min_size=1, max_size=6),
    prompts=st.lists(st.lists(st.integers(0, 3), max_size=7), min_size=1, max_size=10),
    seed=st.integers(0, 1000),
)
def test_dfs_weight_properties(keys: list[list[int]], prompts: list[list[int]], seed: int) -> None:
    cache = build_tree(keys)
    reqs = [matched(cache, f"q{i}", i, p) for i, p in enumerate(prompts)]
    waiting = list(reqs)
    random.Random(seed).shuffle(waiting)
    out = order_queue(waiting, "dfs-weight", random.Random(0), cache.roots())
    # a permutation of the waiting requests
    assert sorted(map(id, out)) == sorted(map(id, reqs))
    pos = {id(r): i for i, r in enumerate(out)}

    def members(node: TreeNode) -> list[R]:
        ids = {id(n) for n in _subtree_nodes(node)}
        return [r for r in reqs if id(r.last_node) in ids]

    for node in _subtree_nodes(cache.root):
        inside = members(node)
        if not inside:
            continue
        idx = sorted(pos[id(r)] for r in inside)
        # requests sharing this subtree are contiguous ...
        assert idx == list(range(idx[0], idx[0] + len(idx)))
        # ... those ending at this node come first, in arrival order ...
        here = [r for r in inside if r.last_node is node]
        assert [r.name for r in out[idx[0]: idx[0] + len(here)]] == [
            r.name for r in sorted(here, key=lambda r: r.arrival)
        ]
        # ... then the children's subtrees, heavier (more requests) first
        child_groups = [members(c) for c in node.children.values()]
        child_groups = [g for g in child_groups if g]
        child_groups.sort(key=lambda g: min(pos[id(r)] for r in g))
        sizes = [len(g) for g in child_groups]
        assert sizes == sorted(sizes, reverse=True)
