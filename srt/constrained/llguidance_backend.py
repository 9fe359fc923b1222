"""The llguidance grammar backend: regexes, JSON schemas and EBNF grammars (GBNF, translated to
llguidance's Lark dialect), per-step masks as packed bitmasks unpacked on the device.

llguidance builds its lexer lazily, so "compiling" here is the grammar's validation and the
first matcher; its own limits (`LLParserLimits.max_grammar_size`, the lexer fuel per step) bound
the work a pathological grammar can cause later.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

from srt.constrained.bitmask import BitmaskMasks, BitmaskMatcher
from srt.constrained.cache import LRUFutures
from srt.constrained.grammar import (
    CompiledGrammar,
    ConstraintSpec,
    GrammarBackend,
    GrammarError,
    MaskBuilder,
    next_serial,
)
from srt.constrained.schema_support import LLGUIDANCE, closed_objects, exact_formats

if TYPE_CHECKING:
    import torch

# Compact JSON in the schema's key order (what clients parse back).
_JSON_DEFAULTS = {"whitespace_flexible": False, "item_separator": ",", "key_separator": ":"}


class LLGuidanceMatcher(BitmaskMatcher):
    def __init__(self, grammar: "LLGuidanceGrammar", inner: Any) -> None:
        self.grammar = grammar
        self.inner = inner  # llguidance.LLMatcher

    def is_stop_token(self, token: int) -> bool:
        return token in self.grammar.stop_ids

    def accept(self, token: int) -> bool:
        if token in self.grammar.stop_ids or self.inner.is_stopped():
            return False
        # consume_token moves the matcher into an error state on a refused token: test first.
        if self.inner.validate_tokens([token]) != 1:
            return False
        return bool(self.inner.consume_token(token))

    def rollback(self, n: int) -> None:
        if n:
            self.inner.rollback(n)

    def fork(self) -> "LLGuidanceMatcher":
        return LLGuidanceMatcher(self.grammar, self.inner.deep_copy())

    def is_dead_end(self) -> bool:
        # Stopped: the grammar allows nothing more (only EOS).
        return bool(self.inner.is_stopped())

    def forced_bytes(self) -> bytes:
        if self.inner.is_accepting() or self.inner.is_stopped():
            return b""
        return bytes(self.inner.compute_ff_bytes())

    def fill_bitmask(self, bitmask: "torch.Tensor", row: int) -> None:
        from llguidance.torch import fill_next_token_bitmask

        fill_next_token_bitmask(self.inner, bitmask, row)

    # llguidance's parallel fill runs the rows on its executor's threads; below this many
    # rows the hand-off costs more than it saves.
    BATCH_FILL_MIN_ROWS = 4
    _executor: Any = None

    @classmethod
    def fill_bitmasks(cls, matchers: list[BitmaskMatcher], bitmask: "torch.Tensor",
                      rows: list[int]) -> None:
        if len(matchers) < cls.BATCH_FILL_MIN_ROWS:
            super().fill_bitmasks(matchers, bitmask, rows)
            return
        import llguidance
        from llguidance.torch import fill_next_token_bitmask_par

        if cls._executor is None:
            cls._executor = llguidance.LLExecutor()
        fill_next_token_bitmask_par(
            cls._executor, [(m.inner, row) for m, row in zip(matchers, rows)],  # type: ignore
            bitmask)


class LLGuidanceGrammar(CompiledGrammar):
    def __init__(self, tokenizer: Any, grammar: str, limits: Any,
                 stop_ids: frozenset[int]) -> None:
        import llguidance

        self.tokenizer = tokenizer
        self.grammar = grammar
        self.limits = limits
        self.stop_ids = stop_ids
        self.serial = next_serial()
        self.size = len(grammar)
        first = llguidance.LLMatcher(tokenizer, grammar, limits=limits)
        if first.is_error():
            raise GrammarError(first.get_error()[:500])

    def matcher(self) -> LLGuidanceMatcher:
        import llguidance

        return LLGuidanceMatcher(self, llguidance.LLMatcher(self.tokenizer, self.grammar,
                                                            limits=self.limits))

    def admits_output(self) -> bool:
        m = self.matcher().inner
        return not m.is_error() and (m.is_accepting() or bool(m.compute_ff_bytes()) or
                                     not m.is_stopped())


class LLGuidanceBackend(GrammarBackend):
    name = "llguidance"
    size_unit = "bytes of grammar"

    def __init__(self, tokenizer: Any, eos_token_id: int, vocab_size: int,
                 cache_size: int, max_grammar_bytes: int = 256 * 2**20) -> None:
        import llguidance
        import llguidance.hf

        eos = eos_token_id if 0 <= eos_token_id < vocab_size else None
        self.tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size,
                                                      eos_token=eos)
        self.stop_ids = frozenset([eos] if eos is not None else [])
        self.limits = llguidance.LLParserLimits(max_grammar_size=max_grammar_bytes)
        self.cache = LRUFutures(cache_size)
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="llguidance-compile")

    def compile(self, spec: ConstraintSpec) -> Future:
        return self.cache.compile(spec, LLGUIDANCE, self._pool, self._compile)

    def _compile(self, spec: ConstraintSpec) -> LLGuidanceGrammar:
        import llguidance
        from llguidance.gbnf_to_lark import gbnf_to_lark

        try:
            if spec.kind == "regex":
                grammar = llguidance.LLMatcher.grammar_from_regex(spec.text)
            elif spec.kind == "json_schema":
                grammar = llguidance.LLMatcher.grammar_from_json_schema(
                    closed_objects(exact_formats(spec.text)), defaults=_JSON_DEFAULTS)
            else:
                grammar = llguidance.LLMatcher.grammar_from_lark(gbnf_to_lark(spec.text))
        except Exception as e:  # the translators raise assorted types for bad input
            raise GrammarError(str(e)[:500]) from None
        ok, err = _validate(grammar, self.tokenizer, self.limits)
        if not ok:
            raise GrammarError(err[:500])
        return LLGuidanceGrammar(self.tokenizer, grammar, self.limits, self.stop_ids)

    def mask_builder(self, vocab_size: int, device: "torch.device") -> MaskBuilder:
        return BitmaskMasks(vocab_size, device)

    def max_size(self, args: object) -> int:
        return int(getattr(args, "constrained_max_grammar_bytes"))


def _validate(grammar: str, tokenizer: Any, limits: Any) -> tuple[bool, str]:
    import llguidance

    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(
        grammar, tokenizer, limits=limits)
    if is_error:
        return False, "; ".join(str(m) for m in messages) or "invalid grammar"
    return True, ""
