"""The xgrammar grammar backend: regexes, JSON schemas and EBNF grammars (xgrammar's GBNF-like
syntax, root rule `root`), per-step masks as packed bitmasks unpacked on the device.

Compiles run on one background thread: xgrammar releases the GIL while it compiles (measured:
the thread that drives decoding keeps its 1 ms ticks through a 1.5 s compile), so unlike
outlines-core it needs no worker process.
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import numpy as np

from srt.constrained.bitmask import BitmaskMasks, BitmaskMatcher
from srt.constrained.cache import LRUFutures
from srt.constrained.grammar import (
    CompiledGrammar,
    ConstraintSpec,
    GrammarBackend,
    GrammarError,
    MaskBuilder,
    Matcher,
    next_serial,
)
from srt.constrained.productive import unproductive_rules
from srt.constrained.schema_support import XGRAMMAR, exact_formats

if TYPE_CHECKING:
    import torch


def _lower_priority() -> None:
    # Compiling is background work: on a machine with few cores it must not take CPU time from
    # the thread serving running requests (Linux niceness is per thread).
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 4)
    except (OSError, AttributeError):
        pass


class XGrammarMatcher(BitmaskMatcher):
    def __init__(self, grammar: "XGrammar", inner: Any) -> None:
        self.grammar = grammar
        self.inner = inner  # xgrammar.GrammarMatcher
        self.accepted = 0
        # The mask row of the current state, once computed (by is_dead_end or prefetch): the
        # next step's mask needs the same row, so it is copied from here instead of filled
        # again. `_version` changes with every change of state; `_row_at` is the version of
        # `_row` ([words] int32, numpy: a view of a prefetched block or of `_own`).
        self._version = 0
        self._row: np.ndarray | None = None
        self._own: "torch.Tensor | None" = None  # this matcher's own [1, words] row
        self._row_at = -1
        # is_dead_end's answer for version `_dead_at` (set for a whole step by prefetch)
        self._dead = False
        self._dead_at = -1

    def is_stop_token(self, token: int) -> bool:
        return token in self.grammar.stop_ids

    def accept(self, token: int) -> bool:
        if token in self.grammar.stop_ids or not self.inner.accept_token(token):
            return False
        self.accepted += 1
        self._version += 1
        return True

    def rollback(self, n: int) -> None:
        if n:
            self.inner.rollback(n)
            self.accepted -= n
            self._version += 1

    def fork(self) -> "XGrammarMatcher":
        m = XGrammarMatcher(self.grammar, self.inner.fork())
        m.accepted = self.accepted
        return m

    def _current_row(self) -> np.ndarray:
        """[words] mask row of the current state (filled once per state)."""
        if self._row_at != self._version:
            if self._own is None:
                import xgrammar as xgr

                self._own = xgr.allocate_token_bitmask(1, self.grammar.vocab_size)
            self.inner.fill_next_token_bitmask(self._own)
            self._row = self._own.numpy()[0]
            self._row_at = self._version
        return self._row  # type: ignore[return-value]

    @classmethod
    def prefetch(cls, matchers: list[Matcher]) -> None:
        """The current mask row of every matcher whose row is stale, filled together (on
        xgrammar's threads from BATCH_FILL_MIN_ROWS rows) into one new block; each matcher keeps
        its row of it for is_dead_end and the next step's mask."""
        import torch

        todo = [m for m in matchers
                if isinstance(m, XGrammarMatcher) and m._row_at != m._version]
        if not todo:
            return
        block = torch.empty((len(todo), (todo[0].grammar.vocab_size + 31) // 32),
                            dtype=torch.int32)
        if len(todo) < cls.BATCH_FILL_MIN_ROWS:
            for i, m in enumerate(todo):
                m.inner.fill_next_token_bitmask(block, i)
        else:
            cls._batch_matcher().batch_fill_next_token_bitmask(
                [m.inner for m in todo], block, list(range(len(todo))))
        # The dead-end test of every row at once: a completed matcher whose row allows no
        # token but the stop tokens (one numpy pass where a per-row test costs ~5 us a row).
        words = block.numpy()
        done = np.fromiter((m.inner.is_completed() for m in todo), dtype=bool, count=len(todo))
        dead = done.copy()
        if done.any():
            dead[done] = ~(words[done] & todo[0].grammar.non_stop_bits()).any(axis=1)
        for i, m in enumerate(todo):
            m._row = words[i]
            m._row_at = m._dead_at = m._version
            m._dead = bool(dead[i])

    def is_dead_end(self) -> bool:
        if self._dead_at == self._version:
            return self._dead
        if not self.inner.is_completed():
            return False
        # Only stop tokens may follow: no bit outside theirs is set. (numpy: a few microseconds
        # where two small torch ops take ten, per row and step)
        return not np.bitwise_and(self._current_row(), self.grammar.non_stop_bits()).any()

    def fill_bitmask(self, bitmask: "torch.Tensor", row: int) -> None:
        if self._row_at == self._version:
            bitmask.numpy()[row] = self._row
        else:
            self.inner.fill_next_token_bitmask(bitmask, row)

    # xgrammar's batched fill runs the rows on its own threads (one pool per process); below
    # this many rows the hand-off costs more than it saves: on one H100's host, 16 rows of a
    # regex step took 1.65-1.88 ms a step filled row by row against 1.94-2.29 on 8 threads
    # (benchmarks/profile_constrained.py, same start).
    BATCH_FILL_MIN_ROWS = 32
    # the batched fill's threads: "auto" is xgrammar's (half the hardware threads)
    BATCH_FILL_THREADS: int | str = "auto"
    _batch: Any = None

    @classmethod
    def fill_bitmasks(cls, matchers: list[BitmaskMatcher], bitmask: "torch.Tensor",
                      rows: list[int]) -> None:
        todo: list[tuple[XGrammarMatcher, int]] = []
        ready: list[int] = []  # rows computed already for this state: copied in one go
        ready_rows: list[np.ndarray] = []
        for m, row in zip(matchers, rows):
            assert isinstance(m, XGrammarMatcher)
            if m._row_at == m._version:
                ready.append(row)
                ready_rows.append(m._row)  # type: ignore[arg-type]
            else:
                todo.append((m, row))
        if ready:
            bitmask.numpy()[ready] = np.stack(ready_rows)
        if len(todo) < cls.BATCH_FILL_MIN_ROWS:
            for m, row in todo:
                m.fill_bitmask(bitmask, row)
            return
        cls._batch_matcher().batch_fill_next_token_bitmask(
            [m.inner for m, _ in todo], bitmask, [row for _, row in todo])

    @classmethod
    def _batch_matcher(cls) -> Any:
        if XGrammarMatcher._batch is None:
            import xgrammar as xgr

            XGrammarMatcher._batch = xgr.BatchGrammarMatcher(
                max_threads=XGrammarMatcher.BATCH_FILL_THREADS)
        return XGrammarMatcher._batch

    def forced_bytes(self) -> bytes:
        if self.inner.is_completed():  # the output may end here: nothing is forced
            return b""
        return self.inner.find_jump_forward_string().encode("utf-8")


class XGrammar(CompiledGrammar):
    def __init__(self, compiled: Any, stop_ids: frozenset[int], vocab_size: int) -> None:
        self.compiled = compiled
        self.stop_ids = stop_ids
        self.vocab_size = vocab_size
        self.serial = next_serial()
        self.size = int(compiled.memory_size_bytes)
        self._scratch: Any = None
        self._non_stop: Any = None

    def non_stop_bits(self) -> np.ndarray:
        """[words] int32: every token's bit set except the stop tokens'."""
        if self._non_stop is None:
            words = np.full(((self.vocab_size + 31) // 32,), -1, dtype=np.int32)
            for t in self.stop_ids:
                bit = 1 << (t % 32)
                words[t // 32] &= np.int32(~(bit if bit < 2**31 else -(2**31)))
            self._non_stop = words
        return self._non_stop

    def scratch_mask(self) -> "torch.Tensor":
        """A [1, words] bitmask for one-off checks (used by one thread at a time)."""
        import xgrammar as xgr

        if self._scratch is None:
            self._scratch = xgr.allocate_token_bitmask(1, self.vocab_size)
        return self._scratch

    def matcher(self) -> XGrammarMatcher:
        import xgrammar as xgr

        return XGrammarMatcher(self, xgr.GrammarMatcher(self.compiled))

    def admits_output(self) -> bool:
        row = self.scratch_mask()
        self.matcher().inner.fill_next_token_bitmask(row)
        return bool(row.any())


class XGrammarBackend(GrammarBackend):
    name = "xgrammar"
    size_unit = "bytes"

    def __init__(self, tokenizer: Any, eos_token_id: int, vocab_size: int,
                 cache_size: int) -> None:
        import xgrammar as xgr

        stops = [eos_token_id] if 0 <= eos_token_id < vocab_size else []
        self.info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size,
                                                       stop_token_ids=stops)
        self.stop_ids = frozenset(self.info.stop_token_ids)
        self.vocab_size = vocab_size
        self.compiler = xgr.GrammarCompiler(self.info, max_threads=1, cache_enabled=False)
        self.cache = LRUFutures(cache_size)
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="xgrammar-compile",
                                        initializer=_lower_priority)

    def compile(self, spec: ConstraintSpec) -> Future:
        return self.cache.compile(spec, XGRAMMAR, self._pool, self._compile)

    def _compile(self, spec: ConstraintSpec) -> XGrammar:
        import xgrammar as xgr

        try:
            if spec.kind == "regex":
                grammar = xgr.Grammar.from_regex(spec.text)
            elif spec.kind == "json_schema":
                # Compact separators and the schema's key order: what clients parse back.
                grammar = xgr.Grammar.from_json_schema(
                    exact_formats(spec.text), any_whitespace=False, separators=(",", ":"),
                    strict_mode=True)
            else:
                grammar = xgr.Grammar.from_ebnf(spec.text)
        except (RuntimeError, ValueError) as e:  # xgrammar reports bad input as RuntimeError
            raise GrammarError(_short(e)) from None
        try:
            endless = unproductive_rules(str(grammar))
        except ValueError as e:  # a normalized form this reader does not know: refuse, safely
            raise GrammarError(f"cannot check the grammar: {e}") from None
        if endless:
            # xgrammar compiles these, but its jump-forward search then never returns
            raise GrammarError(f"the grammar admits no finite output (rule {endless[0]!r} "
                               "never ends)")
        try:
            compiled = self.compiler.compile_grammar(grammar)
        except (RuntimeError, ValueError) as e:
            raise GrammarError(_short(e)) from None
        return XGrammar(compiled, self.stop_ids, self.vocab_size)

    def mask_builder(self, vocab_size: int, device: "torch.device") -> MaskBuilder:
        return BitmaskMasks(vocab_size, device)

    def max_size(self, args: object) -> int:
        return int(getattr(args, "constrained_max_grammar_bytes"))


def _short(e: BaseException) -> str:
    """xgrammar's message without its C++ source location prefix."""
    text = str(e).strip()
    if text.startswith("[") and ": " in text:
        text = text.split(": ", 1)[1] if "/" in text.split(": ", 1)[0] else text
    return text[:500]
