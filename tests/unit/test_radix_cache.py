"""Tests of srt.model_process.radix_cache against a pure-Python reference model.

The reference model is a dict {token-prefix tuple: slot} holding one entry per
cached token; locks are kept as the list of locked prefixes.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from srt.model_process.radix_cache import RadixCache, TreeNode

KEYS = st.lists(st.integers(0, 3), min_size=1, max_size=12)


class RecordingPool:
    """Test double of the KV pool: records every freed slot, rejects double frees."""

    def __init__(self) -> None:
        self.freed: list[int] = []
        self.calls = 0

    def free(self, slots: torch.Tensor) -> None:
        assert slots.dtype == torch.int64 and slots.dim() == 1
        self.calls += 1
        for s in slots.tolist():
            assert s not in self.freed, f"slot {s} freed twice"
            self.freed.append(s)


def tree_contents(cache: RadixCache) -> dict[tuple[int, ...], tuple[int, int]]:
    """Walk the tree: {token prefix: (slot, lock_ref of its node)}; checks node shape."""
    out: dict[tuple[int, ...], tuple[int, int]] = {}
    assert not cache.root_node.key and len(cache.root_node.value) == 0

    def walk(node: TreeNode, prefix: tuple[int, ...]) -> None:
        for first, child in node.children.items():
            assert child.parent is node
            assert child.key and child.key[0] == first
            assert child.value.dtype == torch.int64 and len(child.value) == len(child.key)
            assert child.lock_ref >= 0
            # A node's lock count covers all of its subtree's locks.
            assert all(child.lock_ref >= g.lock_ref for g in child.children.values())
            p = prefix
            for tok, slot in zip(child.key, child.value.tolist()):
                p = p + (tok,)
                out[p] = (slot, child.lock_ref)
            walk(child, p)

    walk(cache.root_node, ())
    return out


def path_key(cache: RadixCache, node: TreeNode) -> list[int]:
    """Tokens from the root to the end of node."""
    parts = []
    while node is not cache.root_node:
        assert node.parent is not None, "node detached from the tree"
        parts.append(node.key)
        node = node.parent
    return [t for part in reversed(parts) for t in part]


class RadixCacheMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.pool = RecordingPool()
        self.cache = RadixCache(self.pool)
        self.ref: dict[tuple[int, ...], int] = {}  # cached prefix -> slot
        self.locks: list[tuple[TreeNode, tuple[int, ...]]] = []  # (node, locked prefix)
        self.next_slot = 0
        self.owned_ever: set[int] = set()  # slots the tree took ownership of
        self.caller_kept: set[int] = set()  # duplicates handed back to the caller

    # ---------------------------------------------------------- model helpers

    def ref_prefix_len(self, key: list[int]) -> int:
        n = 0
        while n < len(key) and tuple(key[: n + 1]) in self.ref:
            n += 1
        return n

    def lock_count(self, prefix: tuple[int, ...]) -> int:
        return sum(1 for _, p in self.locks if p[: len(prefix)] == prefix and len(p) >= len(prefix))

    def locked_prefixes(self) -> set[tuple[int, ...]]:
        return {p[:i] for _, p in self.locks for i in range(1, len(p) + 1)}

    # ----------------------------------------------------------------- rules

    @rule(key=KEYS)
    def insert(self, key: list[int]) -> None:
        slots = torch.arange(self.next_slot, self.next_slot + len(key), dtype=torch.int64)
        self.next_slot += len(key)
        expected = self.ref_prefix_len(key)
        got = self.cache.insert(key, slots)
        assert got == expected
        for i in range(expected, len(key)):
            self.ref[tuple(key[: i + 1])] = int(slots[i])
            self.owned_ever.add(int(slots[i]))
        self.caller_kept.update(slots[:got].tolist())

    @rule(key=KEYS, lock=st.booleans())
    def match(self, key: list[int], lock: bool) -> None:
        slots, node = self.cache.match_prefix(key)
        n = self.ref_prefix_len(key)
        assert slots.dtype == torch.int64
        assert slots.tolist() == [self.ref[tuple(key[: i + 1])] for i in range(n)]
        assert path_key(self.cache, node) == key[:n]
        if lock:
            before = self.locked_prefixes()
            delta = self.cache.inc_lock_ref(node)
            self.locks.append((node, tuple(key[:n])))
            assert delta == -(len(self.locked_prefixes()) - len(before))

    @precondition(lambda self: self.locks)
    @rule(i=st.integers(0, 1000))
    def unlock(self, i: int) -> None:
        before = self.locked_prefixes()
        node, prefix = self.locks.pop(i % len(self.locks))
        assert path_key(self.cache, node) == list(prefix)
        delta = self.cache.dec_lock_ref(node)
        assert delta == len(before) - len(self.locked_prefixes())

    @rule(n=st.integers(0, 30))
    def evict(self, n: int) -> None:
        evictable = self.cache.evictable_size()
        locked = self.locked_prefixes()
        start = len(self.pool.freed)
        freed = self.cache.evict(n)
        new = self.pool.freed[start:]
        assert freed == len(new)
        assert freed >= min(n, evictable)
        assert freed <= evictable
        if freed < n:
            assert self.cache.evictable_size() == 0
        by_slot = {s: p for p, s in self.ref.items()}
        for s in new:
            assert s in by_slot, f"evict freed slot {s} the tree did not hold"
            assert by_slot[s] not in locked, f"evict freed locked slot {s}"
            del self.ref[by_slot[s]]

    @precondition(lambda self: not self.locks)
    @rule()
    def reset(self) -> None:
        self.reset_body()

    def reset_body(self) -> None:
        start = len(self.pool.freed)
        self.cache.reset()
        assert sorted(self.pool.freed[start:]) == sorted(self.ref.values())
        self.ref.clear()
        assert self.cache.total_size() == 0

    @precondition(lambda self: any(p for _, p in self.locks))  # root-only locks lock nothing
    @rule()
    def reset_while_locked_raises(self) -> None:
        with pytest.raises(RuntimeError):
            self.cache.reset()

    @precondition(lambda self: self.locks and not any(p for _, p in self.locks))
    @rule()
    def reset_with_root_locks(self) -> None:
        self.reset_body()

    @precondition(lambda self: self.locks)
    @rule()
    def unlock_everything_then_drain(self) -> None:
        self.drain()

    # ------------------------------------------------------------ invariants

    @invariant()
    def tree_matches_model(self) -> None:
        contents = tree_contents(self.cache)
        assert {p: s for p, (s, _) in contents.items()} == self.ref
        for p, (_, lock_ref) in contents.items():
            assert lock_ref == self.lock_count(p), p
        locked = len(self.locked_prefixes())
        assert self.cache.locked_size() == locked
        assert self.cache.evictable_size() == len(self.ref) - locked
        assert self.cache.evictable_size() + self.cache.locked_size() == self.cache.total_size()
        assert self.cache.total_size() == len(self.ref)
        # Every slot went to exactly one place: tree, caller, or (once) the pool.
        held = set(self.ref.values())
        freed = set(self.pool.freed)
        assert len(freed) == len(self.pool.freed)
        assert not held & freed and not held & self.caller_kept and not freed & self.caller_kept
        assert held | freed == self.owned_ever

    def drain(self) -> None:
        while self.locks:
            node, _ = self.locks.pop()
            self.cache.dec_lock_ref(node)
        self.cache.evict(10**9)
        self.ref.clear()
        assert self.cache.total_size() == 0 and self.cache.evictable_size() == 0
        assert not self.cache.root_node.children
        # No leaks: everything the tree ever owned was freed exactly once.
        assert sorted(self.pool.freed) == sorted(self.owned_ever)

    def teardown(self) -> None:
        self.drain()


RadixCacheMachine.TestCase.settings = settings(max_examples=200, stateful_step_count=40, deadline=None)
TestRadixCacheStateful = RadixCacheMachine.TestCase


# --------------------------------------------------------------- disabled mode


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["insert", "match", "evict"]), KEYS), max_size=20))
def test_disabled_caches_nothing(ops: list[tuple[str, list[int]]]) -> None:
    pool = RecordingPool()
    cache = RadixCache(pool, disable=True)
    given_slots: list[int] = []
    for op, key in ops:
        if op == "insert":
            slots = torch.arange(len(given_slots), len(given_slots) + len(key), dtype=torch.int64)
            given_slots += slots.tolist()
            assert cache.insert(key, slots) == 0
            assert pool.freed == given_slots  # freed at once
        elif op == "match":
            slots, node = cache.match_prefix(key)
            assert len(slots) == 0 and node is cache.root_node
            assert cache.inc_lock_ref(node) == 0 and cache.dec_lock_ref(node) == 0
        else:
            assert cache.evict(len(key)) == 0
        assert cache.total_size() == cache.evictable_size() == cache.locked_size() == 0
    assert not cache.root_node.children


# ---------------------------------------------------------- deterministic tests


def t(*xs: int) -> torch.Tensor:
    return torch.tensor(xs, dtype=torch.int64)


def test_split_in_middle_of_node() -> None:
    pool = RecordingPool()
    cache = RadixCache(pool)
    assert cache.insert([1, 2, 3, 4], t(10, 11, 12, 13)) == 0
    assert len(cache.root.children) == 1

    slots, node = cache.match_prefix([1, 2, 9])
    assert slots.tolist() == [10, 11]
    assert node.key == [1, 2] and node.parent is cache.root
    (suffix,) = node.children.values()
    assert suffix.key == [3, 4] and suffix.value.tolist() == [12, 13]
    assert cache.total_size() == 4

    # Inserting a diverging key reuses the split prefix; the caller keeps slots[:2].
    assert cache.insert([1, 2, 7], t(20, 21, 22)) == 2
    assert sorted(node.children) == [3, 7]
    assert cache.match_prefix([1, 2, 7])[0].tolist() == [10, 11, 22]
    assert cache.total_size() == 5 and pool.freed == []


def test_match_prefix_edges() -> None:
    cache = RadixCache(RecordingPool())
    slots, node = cache.match_prefix([])
    assert len(slots) == 0 and slots.dtype == torch.int64 and node is cache.root
    cache.insert([5, 6], t(1, 2))
    assert cache.match_prefix([7])[1] is cache.root
    # Key ending inside a node counts as fully cached without splitting.
    assert cache.insert([5], t(9)) == 1
    assert cache.root.children[5].key == [5, 6]
    with pytest.raises(ValueError):
        cache.insert([1, 2], t(1))


def test_evict_is_lru_over_leaves() -> None:
    pool = RecordingPool()
    cache = RadixCache(pool)
    cache.insert([0, 1], t(0, 1))
    cache.insert([0, 2], t(2, 3))  # splits: [0] -> {[1], [2]}
    cache.insert([3], t(4))
    cache.match_prefix([0, 1])  # [0] and [1] are now the most recent

    assert cache.evict(1) == 1
    assert pool.freed == [3]  # leaf [2], the least recently used
    assert cache.evict(1) == 1
    assert pool.freed == [3, 4]  # then leaf [3]
    # [1] goes, then its parent [0] becomes a leaf and goes too.
    assert cache.evict(2) == 2
    assert pool.freed == [3, 4, 1, 0]
    assert cache.total_size() == 0 and not cache.root.children


def test_evict_batches_frees_and_may_overshoot() -> None:
    pool = RecordingPool()
    cache = RadixCache(pool)
    cache.insert([1, 1, 1], t(0, 1, 2))
    cache.insert([2, 2, 2], t(3, 4, 5))
    assert cache.evict(4) == 6  # whole nodes only
    assert pool.calls == 1
    assert cache.evict(4) == 0 and pool.calls == 1


def test_lock_protects_path() -> None:
    pool = RecordingPool()
    cache = RadixCache(pool)
    cache.insert([1, 2, 3], t(0, 1, 2))
    cache.insert([1, 2, 4, 5], t(9, 9, 3, 4))
    _, node = cache.match_prefix([1, 2, 3])
    assert cache.inc_lock_ref(node) == -3
    assert cache.locked_size() == 3 and cache.evictable_size() == 2
    assert cache.inc_lock_ref(node) == 0  # already locked: no size change

    assert cache.evict(100) == 2
    assert pool.freed == [3, 4]
    assert cache.match_prefix([1, 2, 3])[0].tolist() == [0, 1, 2]
    with pytest.raises(RuntimeError):
        cache.reset()

    # A split after locking keeps the lock on both halves.
    _, mid = cache.match_prefix([1, 9])
    assert mid.key == [1] and mid.lock_ref == 2
    assert cache.dec_lock_ref(node) == 0
    assert cache.dec_lock_ref(node) == 3
    assert cache.locked_size() == 0 and cache.evictable_size() == 3
    cache.reset()
    assert sorted(pool.freed) == [0, 1, 2, 3, 4] and cache.total_size() == 0


def test_dec_lock_ref_below_zero_raises() -> None:
    cache = RadixCache(RecordingPool())
    cache.insert([1, 2], t(0, 1))
    _, node = cache.match_prefix([1, 2])
    with pytest.raises(RuntimeError):
        cache.dec_lock_ref(node)
    cache.inc_lock_ref(node)
    cache.dec_lock_ref(node)
    with pytest.raises(RuntimeError):
        cache.dec_lock_ref(node)
    assert node.lock_ref == 0 and cache.evictable_size() == 2


def test_dec_lock_ref_is_all_or_nothing() -> None:
    cache = RadixCache(RecordingPool())
    cache.insert([1, 2, 3], t(0, 1, 2))
    _, parent = cache.match_prefix([1])
    _, child = cache.match_prefix([1, 2, 3])
    cache.inc_lock_ref(parent)
    # child is unlocked though its parent is locked: nothing may change.
    with pytest.raises(RuntimeError):
        cache.dec_lock_ref(child)
    assert parent.lock_ref == 1 and cache.locked_size() == 1


def test_pretty_print() -> None:
    cache = RadixCache(RecordingPool())
    cache.insert([1, 2], t(7, 8))
    out = cache.pretty_print()
    assert "[1, 2]" in out and "[7, 8]" in out and "total=2" in out
