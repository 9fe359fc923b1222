"""The compile cache of the grammar backends that compile in this process."""

from __future__ import annotations

import json
from collections import OrderedDict
from concurrent.futures import Executor, Future
from typing import Any, Callable

from srt.constrained.grammar import ConstraintSpec, GrammarError, failed
from srt.constrained.schema_support import SchemaSupport


class LRUFutures:
    """Key -> Future, least recently used dropped past `capacity`; failed futures are not
    kept. Callers hold their own reference, so dropping never cancels a compile."""

    def __init__(self, capacity: int) -> None:
        self.capacity = max(1, capacity)
        self._entries: OrderedDict[str, Future] = OrderedDict()

    def get(self, key: str) -> Future | None:
        fut = self._entries.get(key)
        if fut is None or (fut.done() and fut.exception() is not None):
            return None
        self._entries.move_to_end(key)
        return fut

    def put(self, key: str, fut: Future) -> None:
        self._entries[key] = fut
        while len(self._entries) > self.capacity:
            self._entries.popitem(last=False)

    def __len__(self) -> int:
        return len(self._entries)

    def compile(self, spec: ConstraintSpec, support: SchemaSupport, pool: Executor,
                build: Callable[[ConstraintSpec], Any]) -> Future:
        """The cached future of `spec`, or `build(spec)` submitted to `pool` (a JSON schema is
        checked against `support` first: a refused keyword fails the future at once)."""
        fut = self.get(spec.key)
        if fut is not None:
            return fut
        if spec.kind == "json_schema":
            try:
                support.check(json.loads(spec.text))
            except ValueError as e:
                return failed(GrammarError(f"unsupported JSON schema: {e}"))
        fut = pool.submit(build, spec)
        self.put(spec.key, fut)
        return fut
