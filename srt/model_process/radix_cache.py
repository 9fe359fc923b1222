"""Radix tree of cached KV slots, keyed by token ids (page size 1).

Each node holds a run of tokens (``key``) and the KV-cache slot indices of
those tokens (``value``: a 1-D int64 tensor, one slot per token). Any shared
prefix is reused because a node can be split at any token.

Contracts:

* Ownership. The tree never allocates slots. ``insert`` hands it slots; it
  keeps only those for tokens it did not already hold and gives them back
  only through ``pool.free`` (from ``evict`` or ``reset``). The caller keeps,
  and must free, the duplicate slots for the prefix that was already cached.
* Locking. The caller (the scheduler) locks the node returned by
  ``match_prefix`` with ``inc_lock_ref`` while a request uses that prefix and
  unlocks it with ``dec_lock_ref`` when done. A lock covers the node and all
  its ancestors. Locks survive later splits: the locked node keeps its
  identity and the new parent inherits its lock count.
* Eviction. ``evict`` frees only unlocked leaves, least recently used first;
  a parent whose last child went becomes a leaf and a candidate. Locked
  nodes and the root are never freed.
* Errors. ``dec_lock_ref`` below zero and ``reset`` while anything is locked
  raise ``RuntimeError``; ``insert`` with ``len(slots) != len(key)`` raises
  ``ValueError``.
* Disabled mode (``disable=True``) caches nothing: ``match_prefix`` returns an
  empty match at the root and ``insert`` frees all given slots at once.
* Namespaces. ``match_prefix`` and ``insert`` take a namespace (an int, 0 by
  default), each its own tree under its own root: keys of different
  namespaces never share slots (the requests of different LoRA adapters).
  Eviction, sizes and ``reset`` cover every namespace; ``drop_namespace``
  frees one.

The tree knows nothing of requests or scheduling and is not thread-safe.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Sequence
from typing import Protocol

import torch

__all__ = ["KVPool", "TreeNode", "RadixCache"]


class KVPool(Protocol):
    """What the tree needs from the KV slot allocator."""

    def free(self, slots: torch.Tensor) -> None: ...


_EMPTY = torch.empty(0, dtype=torch.int64)
_node_ids = itertools.count()


class TreeNode:
    """One run of tokens and their slots.

    ``children`` is keyed by the first token of each child. ``lock_ref`` counts
    the locks covering this node (its own plus those of descendants). All
    tokens of a node share one lock count and one access time.
    """

    __slots__ = ("id", "children", "parent", "key", "value", "lock_ref", "last_access_time")

    def __init__(
        self,
        key: list[int] | None = None,
        value: torch.Tensor | None = None,
        parent: TreeNode | None = None,
        last_access_time: int = 0,
    ) -> None:
        self.id = next(_node_ids)  # unique tie-break for the LRU heap
        self.children: dict[int, TreeNode] = {}
        self.parent = parent
        self.key: list[int] = key if key is not None else []
        self.value: torch.Tensor = value if value is not None else _EMPTY
        self.lock_ref = 0
        self.last_access_time = last_access_time

    def __repr__(self) -> str:
        return f"TreeNode(id={self.id}, key={self.key}, lock_ref={self.lock_ref})"


def _common_prefix_len(a: list[int], b: list[int]) -> int:
    """Length of the common prefix of two token lists (lists both: a list never equals a
    tuple, so mixed types would defeat the slice comparisons).

    Slice comparisons run in C: the whole-overlap check answers the common case (a cached
    prefix matched to its end) at once, and a mismatch is narrowed by bisection down to a short
    run compared in Python. (A Python loop over every token cost about 0.1 ms per 2k-token
    prompt, several times per request.)
    """
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    lo, hi = 0, n  # a[:lo] == b[:lo]; the first difference lies in [lo, hi)
    while hi - lo > 16:
        mid = (lo + hi) // 2
        if a[lo:mid] == b[lo:mid]:
            lo = mid
        else:
            hi = mid
    while a[lo] == b[lo]:
        lo += 1
    return lo


def shared_prefix_len(nodes: Sequence[TreeNode | None]) -> int:
    """Tokens on the path from the root to the deepest node that is `nodes[i]` or one of its
    ancestors for every i (their lowest common ancestor); 0 if any node is None. A request's
    slots for those positions are the tree's, so requests locked at `nodes` share them."""
    if not nodes or any(n is None for n in nodes):
        return 0
    path: list[TreeNode] = []  # nodes[0] up to the root
    n: TreeNode | None = nodes[0]
    while n is not None:
        path.append(n)
        n = n.parent
    index = {id(x): i for i, x in enumerate(path)}
    lowest = 0  # index in `path` of the common ancestor so far
    for n in nodes[1:]:
        while n is not None and id(n) not in index:
            n = n.parent
        if n is None:  # another namespace's tree
            return 0
        lowest = max(lowest, index[id(n)])
        if lowest == len(path) - 1:
            return 0
    return sum(len(x.key) for x in path[lowest:])


class RadixCache:
    """Prefix cache over KV slots; see the module docstring for the contracts.

    ``evictable_size()`` (tokens in unlocked nodes) and ``locked_size()``
    (tokens in locked nodes) are running counters; their sum is
    ``total_size()``, every slot the tree holds.
    """

    def __init__(self, pool: KVPool, disable: bool = False) -> None:
        self.pool = pool
        self.disable = disable
        # A logical clock, not wall time: deterministic LRU order in tests.
        self._clock = itertools.count(1)
        self.root_node = TreeNode()  # never holds tokens, never evicted
        self._roots: dict[int, TreeNode] = {0: self.root_node}  # by namespace
        self._root_ids = {id(self.root_node)}
        self._evictable = 0
        self._locked = 0

    @property
    def root(self) -> TreeNode:
        """Namespace 0's root."""
        return self.root_node

    def roots(self) -> list[TreeNode]:
        """The root of every namespace that holds or held tokens."""
        return list(self._roots.values())

    def _root(self, namespace: int) -> TreeNode:
        root = self._roots.get(namespace)
        if root is None:
            root = self._roots[namespace] = TreeNode()
            self._root_ids.add(id(root))
        return root

    def _is_root(self, node: TreeNode) -> bool:
        return id(node) in self._root_ids

    # ------------------------------------------------------------------ lookup

    def match_prefix(self, key: Sequence[int], namespace: int = 0
                     ) -> tuple[torch.Tensor, TreeNode]:
        """Return (slots of the longest cached prefix of key in `namespace`, node ending it).

        Splits a node if the match ends inside it, so the returned node ends
        exactly at the match and can be locked. Touches access times.
        """
        if self.disable:
            return _EMPTY.clone(), self.root_node
        key = key if isinstance(key, list) else list(key)
        now = next(self._clock)
        node = self._root(namespace)
        values: list[torch.Tensor] = []
        pos = 0
        while pos < len(key):
            child = node.children.get(key[pos])
            if child is None:
                break
            n = _common_prefix_len(child.key, key[pos:])
            if n < len(child.key):
                child = self._split(child, n)
            child.last_access_time = now
            values.append(child.value)
            node = child
            pos += n
        slots = torch.cat(values) if values else _EMPTY.clone()
        return slots, node

    def insert(self, key: Sequence[int], slots: torch.Tensor, namespace: int = 0) -> int:
        """Cache key -> slots in `namespace`; return how many leading tokens were already
        cached.

        The tree takes ownership of ``slots[returned:]`` (copied, so the
        caller may reuse its buffer); ``slots[:returned]`` stay the caller's.
        """
        if len(slots) != len(key):
            raise ValueError(f"len(slots)={len(slots)} != len(key)={len(key)}")
        if self.disable:
            if len(slots):
                self.pool.free(slots.to(torch.int64))
            return 0
        key = key if isinstance(key, list) else list(key)
        now = next(self._clock)
        node = self._root(namespace)
        pos = 0
        while pos < len(key):
            child = node.children.get(key[pos])
            if child is None:
                new = TreeNode(
                    key=list(key[pos:]),
                    value=slots[pos:].to(dtype=torch.int64, copy=True),
                    parent=node,
                    last_access_time=now,
                )
                node.children[new.key[0]] = new
                self._evictable += len(new.key)
                break
            n = _common_prefix_len(child.key, key[pos:])
            pos += n
            if n < len(child.key) and pos < len(key):
                # Diverges inside child: split so only the shared part is touched.
                child = self._split(child, n)
            child.last_access_time = now
            if n < len(child.key):
                break  # key ends inside child: all of it is cached, no split needed
            node = child
        return pos

    def _split(self, child: TreeNode, n: int) -> TreeNode:
        """Split child after n tokens; return the new prefix node.

        ``child`` keeps its identity as the suffix so that locks held on it
        stay valid; the new prefix node inherits its lock count. Sizes are
        unchanged.
        """
        assert 0 < n < len(child.key)
        parent = child.parent
        assert parent is not None
        prefix = TreeNode(
            key=child.key[:n],
            value=child.value[:n],
            parent=parent,
            last_access_time=child.last_access_time,
        )
        prefix.lock_ref = child.lock_ref
        child.key = child.key[n:]
        child.value = child.value[n:]
        child.parent = prefix
        prefix.children[child.key[0]] = child
        parent.children[prefix.key[0]] = prefix
        return prefix

    # ----------------------------------------------------------------- locking

    def inc_lock_ref(self, node: TreeNode) -> int:
        """Lock node and its ancestors (not root); return the change of evictable_size() (<= 0)."""
        delta = 0
        while not self._is_root(node):
            assert node.parent is not None, "node is not in this tree"
            if node.lock_ref == 0:
                self._evictable -= len(node.key)
                self._locked += len(node.key)
                delta -= len(node.key)
            node.lock_ref += 1
            node = node.parent
        return delta

    def dec_lock_ref(self, node: TreeNode) -> int:
        """Undo one inc_lock_ref(node); return the change of evictable_size() (>= 0).

        Raises RuntimeError, changing nothing, if any lock on the path would go negative.
        """
        path: list[TreeNode] = []
        while not self._is_root(node):
            if node.lock_ref <= 0 or node.parent is None:
                raise RuntimeError(f"dec_lock_ref on unlocked or detached node {node!r}")
            path.append(node)
            node = node.parent
        delta = 0
        for n in path:
            n.lock_ref -= 1
            if n.lock_ref == 0:
                self._evictable += len(n.key)
                self._locked -= len(n.key)
                delta += len(n.key)
        return delta

    # ---------------------------------------------------------------- eviction

    def evict(self, num_tokens: int) -> int:
        """Free LRU unlocked leaves until >= num_tokens slots went or none are evictable.

        Frees whole nodes, so it may free more than asked. Returns slots freed.
        """
        if self.disable or num_tokens <= 0:
            return 0
        heap = [(n.last_access_time, n.id, n) for n in self._leaves() if n.lock_ref == 0]
        heapq.heapify(heap)
        freed: list[torch.Tensor] = []
        num_freed = 0
        while num_freed < num_tokens and heap:
            _, _, node = heapq.heappop(heap)
            parent = node.parent
            assert parent is not None and not node.children and node.lock_ref == 0
            freed.append(node.value)
            num_freed += len(node.key)
            self._evictable -= len(node.key)
            del parent.children[node.key[0]]
            node.parent = None  # detached: a stale dec_lock_ref on it raises
            if not self._is_root(parent) and not parent.children and parent.lock_ref == 0:
                heapq.heappush(heap, (parent.last_access_time, parent.id, parent))
        if freed:
            self.pool.free(torch.cat(freed))  # one batched call
        return num_freed

    def _leaves(self) -> list[TreeNode]:
        leaves = []
        stack = [c for root in self._roots.values() for c in root.children.values()]
        while stack:
            node = stack.pop()
            if node.children:
                stack.extend(node.children.values())
            else:
                leaves.append(node)
        return leaves

    # ------------------------------------------------------------------- sizes

    def evictable_size(self) -> int:
        return self._evictable

    def locked_size(self) -> int:
        return self._locked

    def total_size(self) -> int:
        return self._evictable + self._locked

    # ------------------------------------------------------------------- reset

    def reset(self) -> None:
        """Free every slot the tree holds and empty it; RuntimeError if anything is locked."""
        if self._locked:
            raise RuntimeError(f"reset with {self._locked} locked tokens")
        for namespace in list(self._roots):
            self.drop_namespace(namespace)

    def drop_namespace(self, namespace: int) -> None:
        """Free every slot of one namespace (none of it may be locked: RuntimeError)."""
        root = self._roots.get(namespace)
        if root is None:
            return
        values, stack = [], list(root.children.values())
        while stack:
            node = stack.pop()
            if node.lock_ref:
                raise RuntimeError(f"namespace {namespace} has locked tokens")
            values.append(node.value)
            stack.extend(node.children.values())
        if values:
            freed = torch.cat(values)
            self.pool.free(freed)
            self._evictable -= len(freed)
        # Keep the root object: callers may hold it (e.g. from an empty match).
        root.children = {}
        if root is not self.root_node:
            del self._roots[namespace]
            self._root_ids.discard(id(root))

    # ------------------------------------------------------------------- debug

    def pretty_print(self) -> str:
        """One line per node, indented by depth: key, slots, lock count."""
        lines = [f"root (total={self.total_size()}, evictable={self._evictable}, locked={self._locked})"]

        def walk(node: TreeNode, depth: int) -> None:
            for first in sorted(node.children):
                c = node.children[first]
                lines.append(f"{'  ' * depth}{c.key} -> {c.value.tolist()} lock={c.lock_ref}")
                walk(c, depth + 1)

        for namespace, root in self._roots.items():
            if namespace:
                lines.append(f"namespace {namespace}")
            walk(root, 1)
        return "\n".join(lines)
