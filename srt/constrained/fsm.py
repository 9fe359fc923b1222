"""Token-level FSMs for regex-constrained decoding, compiled with outlines-core and cached.

A `TokenFSM` wraps an outlines-core `Index` (built once per pattern over the tokenizer's
vocabulary) and answers, per state, which tokens may come next. `FSMCache` compiles patterns on a
background thread and keeps the most recently used `capacity` FSMs.
"""

from __future__ import annotations

import json
import multiprocessing
import itertools
import threading
from collections import OrderedDict
from concurrent.futures import Future, ProcessPoolExecutor
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the HTTP process compiles patterns to validate them and needs no torch
    import torch


# Any JSON object, for response_format {"type": "json_object"}: string keys, values that are
# scalars, or flat arrays / objects of scalars. (outlines-core's regex for {"type": "object"}
# nests three levels deep and is ~20 kB: too slow to compile per server.)
_WS = r"[ ]?"
_STR = r'"([^"\\\x00-\x1F\x7F]|\\["\\/bfnrt])*"'
_NUM = r"-?(0|[1-9][0-9]*)(\.[0-9]+)?([eE][+-]?[0-9]+)?"
_SCALAR = rf"({_STR}|{_NUM}|true|false|null)"
_FLAT_ARR = rf"\[{_WS}({_SCALAR}({_WS},{_WS}{_SCALAR})*)?{_WS}\]"
_FLAT_OBJ = rf"\{{{_WS}({_STR}{_WS}:{_WS}{_SCALAR}({_WS},{_WS}{_STR}{_WS}:{_WS}{_SCALAR})*)?{_WS}\}}"
_VALUE = rf"({_SCALAR}|{_FLAT_ARR}|{_FLAT_OBJ})"
JSON_OBJECT_REGEX = (
    rf"\{{{_WS}({_STR}{_WS}:{_WS}{_VALUE}({_WS},{_WS}{_STR}{_WS}:{_WS}{_VALUE})*)?{_WS}\}}"
)


# Keywords outlines-core accepts but does not enforce (its regex for {"type": "integer",
# "maximum": 99} admits any integer): refused, rather than silently producing invalid output.
_UNENFORCED_KEYWORDS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum",
                        "multipleOf")
# Keywords whose value maps names to subschemas (the names are not keywords) ...
_NAME_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
# ... and keywords whose value is data, not a schema.
_DATA_KEYWORDS = ("enum", "const", "default", "examples")


def check_schema_keywords(schema: Any, path: str = "$") -> None:
    """Raise ValueError naming the first keyword of `schema` that would be ignored."""
    if isinstance(schema, list):
        for i, sub in enumerate(schema):
            check_schema_keywords(sub, f"{path}[{i}]")
        return
    if not isinstance(schema, dict):
        return
    for key, value in schema.items():
        if key in _DATA_KEYWORDS:
            continue
        if key in _NAME_MAPS and isinstance(value, dict):
            for name, sub in value.items():
                check_schema_keywords(sub, f"{path}.{key}.{name}")
            continue
        if key in _UNENFORCED_KEYWORDS:
            raise ValueError(f"the keyword {key!r} at {path} is not supported (numeric bounds "
                             "cannot be enforced; use an enum or a pattern)")
        check_schema_keywords(value, f"{path}.{key}")


def constraint_regex(regex: str | None, json_schema: str | None) -> str:
    """The regex a request is constrained by (a JSON schema is turned into one).

    Raises ValueError for an unsupported schema.
    """
    if regex is not None:
        return regex
    assert json_schema is not None
    from outlines_core.json_schema import build_regex_from_schema

    try:
        check_schema_keywords(json.loads(json_schema))
    except json.JSONDecodeError:
        pass  # outlines-core reports it
    return build_regex_from_schema(json_schema)


_SERIALS = itertools.count()


class TokenFSM:
    """Allowed tokens per state of one compiled pattern. Read-only after construction, so one
    instance is shared by every request with the same pattern."""

    def __init__(self, index: Any, eos_token_id: int, num_states: int | None = None) -> None:
        self.index = index
        self.eos_token_id = eos_token_id
        self.initial_state: int = index.get_initial_state()
        # Counting builds every transition as Python objects (seconds for a large pattern):
        # the compile worker does it and passes the count along.
        self.num_states = len(index.get_transitions()) if num_states is None else num_states
        self._allowed: dict[int, "torch.Tensor"] = {}
        self._dead_end: dict[int, bool] = {}  # asked every step of every constrained request
        # Jump-forward's forced bytes per state (filled by srt.constrained.jump_forward).
        self.forced: dict[int, bytes] = {}
        self._lock = threading.Lock()
        self.serial = next(_SERIALS)  # unique per instance (device mask rows are keyed by it)

    def allowed_tokens(self, state: int) -> "torch.Tensor":
        """int64 ids allowed from `state` (EOS only where the state is final); cached per state."""
        import torch

        t = self._allowed.get(state)
        if t is None:
            ids = self.index.get_allowed_tokens(state) or []
            t = torch.tensor(sorted(ids), dtype=torch.int64)
            with self._lock:
                self._allowed[state] = t
        return t

    def next_state(self, state: int, token: int) -> int | None:
        return self.index.get_next_state(state, token)

    def is_final(self, state: int) -> bool:
        return self.index.is_final_state(state)

    def is_dead_end(self, state: int) -> bool:
        """A final state from which no token but EOS continues: the output is complete."""
        hit = self._dead_end.get(state)
        if hit is None:
            hit = self.is_final(state) and bool(
                (self.allowed_tokens(state) == self.eos_token_id).all())
            self._dead_end[state] = hit
        return hit


def compile_fsm(pattern: str, vocabulary: Any, eos_token_id: int) -> TokenFSM:
    """Raises ValueError for a pattern outlines-core cannot compile."""
    from outlines_core import Index

    return TokenFSM(Index(pattern, vocabulary), eos_token_id)


_worker_vocabulary: Any = None


def _init_worker(vocabulary: Any) -> None:
    import os

    from srt.utils import become_child_process

    # Die with the process that started it (a server stopped by SIGTERM never shuts the pool
    # down; without this the worker outlives it).
    become_child_process(os.getppid(), "fsm compile")
    # Compiling is background work: on a machine with few cores it must not take CPU time from
    # the processes that serve the running requests (their inter-token gaps).
    try:
        os.nice(4)
    except OSError:
        pass
    global _worker_vocabulary
    _worker_vocabulary = vocabulary


def _compile_index(pattern: str) -> tuple[Any, int]:
    from outlines_core import Index

    index = Index(pattern, _worker_vocabulary)
    return index, len(index.get_transitions())


class FSMCache:
    """Pattern -> TokenFSM, compiled in a worker process, LRU-bounded.

    `get(pattern)` returns a Future; the same pattern gets the same future while it is cached.
    A failed compile is not cached. Compiling runs in a separate process because outlines-core
    holds the GIL while it builds an index (seconds for a large pattern): on a thread it would
    stall this process's decoding or event loop (measured: 6 s gaps in other streams).
    """

    def __init__(self, tokenizer: Any, eos_token_id: int, capacity: int) -> None:
        from srt.constrained.vocab import build_vocabulary, token_bytes_map

        self.token_bytes = token_bytes_map(tokenizer)
        self.vocabulary = build_vocabulary(tokenizer, eos_token_id, self.token_bytes)
        self.eos_token_id = eos_token_id
        self.capacity = max(1, capacity)
        self._entries: OrderedDict[str, Future] = OrderedDict()
        # One worker, started at the first compile; the vocabulary is sent to it once.
        self._pool = ProcessPoolExecutor(
            max_workers=1, mp_context=multiprocessing.get_context("spawn"),
            initializer=_init_worker, initargs=(self.vocabulary,))

    def get(self, pattern: str) -> Future:
        fut = self._entries.get(pattern)
        if fut is not None and not (fut.done() and fut.exception() is not None):
            self._entries.move_to_end(pattern)
            return fut
        fut = Future()
        self._pool.submit(_compile_index, pattern).add_done_callback(
            lambda done: self._finish(done, fut))
        self._entries[pattern] = fut
        while len(self._entries) > self.capacity:
            self._entries.popitem(last=False)  # requests holding it keep their reference
        return fut

    def _finish(self, done: Future, fut: Future) -> None:
        try:
            index, num_states = done.result()
            fut.set_result(TokenFSM(index, self.eos_token_id, num_states))
        except BaseException as e:  # the compile's error, for whoever waits on it
            fut.set_exception(e)

    def __len__(self) -> int:
        return len(self._entries)
