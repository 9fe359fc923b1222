"""The outlines-core grammar backend: regexes and JSON schemas (through a regex) compiled into
token FSMs (srt.constrained.fsm), masks from cached device rows per (FSM, state)
(srt.constrained.mask), forced bytes from the FSM walk (srt.constrained.jump_forward). No EBNF."""

from __future__ import annotations

from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

from srt.constrained.fsm import FSMCache, TokenFSM, constraint_regex
from srt.constrained.grammar import (
    CompiledGrammar,
    ConstraintSpec,
    GrammarBackend,
    GrammarError,
    MaskBuilder,
    Matcher,
    failed,
)

if TYPE_CHECKING:  # torch-based; the HTTP process (which only compiles) never loads them
    import torch

    from srt.constrained.jump_forward import JumpForward


class FSMMatcher(Matcher):
    """A request's state in a shared TokenFSM, with the states it passed (for rollback)."""

    def __init__(self, fsm: TokenFSM, jump: JumpForward | None,
                 states: list[int] | None = None) -> None:
        self.fsm = fsm
        self.jump = jump
        self.states = states if states is not None else [fsm.initial_state]

    @property
    def state(self) -> int:
        return self.states[-1]

    def is_stop_token(self, token: int) -> bool:
        return token == self.fsm.eos_token_id

    def accept(self, token: int) -> bool:
        nxt = self.fsm.next_state(self.state, token)
        if nxt is None:
            return False
        self.states.append(nxt)
        return True

    def rollback(self, n: int) -> None:
        if n:
            del self.states[-n:]

    def fork(self) -> "FSMMatcher":
        return FSMMatcher(self.fsm, self.jump, list(self.states))

    def is_dead_end(self) -> bool:
        return self.fsm.is_dead_end(self.state)

    def forced_bytes(self) -> bytes:
        return self.jump.forced(self.fsm, self.state) if self.jump is not None else b""


class OutlinesGrammar(CompiledGrammar):
    def __init__(self, fsm: TokenFSM, jump: JumpForward | None) -> None:
        self.fsm = fsm
        self.jump = jump
        self.serial = fsm.serial
        self.size = fsm.num_states

    def matcher(self) -> FSMMatcher:
        return FSMMatcher(self.fsm, self.jump)

    def admits_output(self) -> bool:
        return bool(self.fsm.index.get_allowed_tokens(self.fsm.initial_state))


class OutlinesMasks(MaskBuilder):
    def __init__(self, vocab_size: int, device: "torch.device") -> None:
        from srt.constrained.mask import ForbiddenRows

        self.rows = ForbiddenRows(vocab_size, device)

    def matcher_mask(self, matchers: list[Matcher | None]) -> "torch.Tensor":
        return self.rows.batch([(m.fsm, m.state) if isinstance(m, FSMMatcher) else None
                                for m in matchers])


class OutlinesBackend(GrammarBackend):
    name = "outlines"
    size_unit = "FSM states"

    def __init__(self, tokenizer: Any, eos_token_id: int, cache_size: int,
                 jump: "JumpForward | None") -> None:
        """`jump`: the forced-bytes walker the matchers use (None: they force nothing)."""
        self.cache = FSMCache(tokenizer, eos_token_id, cache_size)
        self.jump = jump
        self._wrapped: dict[int, OutlinesGrammar] = {}  # by FSM serial

    def compile(self, spec: ConstraintSpec) -> Future:
        if spec.kind == "ebnf":
            return failed(GrammarError("ebnf needs --grammar-backend xgrammar or llguidance"))
        try:
            pattern = constraint_regex(spec.text if spec.kind == "regex" else None,
                                       spec.text if spec.kind == "json_schema" else None)
        except ValueError as e:
            return failed(GrammarError(f"unsupported JSON schema: {e}"))
        out: Future = Future()
        self.cache.get(pattern).add_done_callback(lambda done: self._wrap(done, out))
        return out

    def _wrap(self, done: Future, out: Future) -> None:
        err = done.exception()
        if err is not None:
            out.set_exception(GrammarError(str(err)) if isinstance(err, ValueError) else err)
            return
        fsm: TokenFSM = done.result()
        # One wrapper per FSM, so its serial (the mask rows' key) stays the FSM's.
        g = self._wrapped.get(fsm.serial)
        if g is None:
            g = self._wrapped[fsm.serial] = OutlinesGrammar(fsm, self.jump)
            if len(self._wrapped) > 4 * self.cache.capacity:
                self._wrapped.pop(next(iter(self._wrapped)))
        out.set_result(g)

    def mask_builder(self, vocab_size: int, device: "torch.device") -> MaskBuilder:
        return OutlinesMasks(vocab_size, device)
