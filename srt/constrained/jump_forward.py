"""Jump-forward for constrained decoding: the bytes a pattern forces next, and the re-tokenized
output ids that append them.

Forced bytes. From an FSM state that is not final (so EOS is not allowed), if every token the FSM
allows starts with the same byte, the model cannot write anything else: that byte is forced. The
walk then follows the vocabulary's single-byte token for it (byte-level BPE vocabularies have one
for nearly every byte) and repeats, so no character-level automaton is needed. A vocabulary may
lack some single-byte tokens (SmolLM2's lacks 21, e.g. a few control bytes): a token allowed at an
earlier state of the walk could then produce a byte that no token allowed at a later state starts
with, so the forced string is cut where it disagrees with any token allowed along the walk. The
walk stops at a final state, at a choice, at a byte without a single-byte token, or at
`max_bytes`; its result is cached per state on the FSM.

Re-tokenizing. Appending forced bytes token by token in whatever split would give ids the
tokenizer would never produce (and that the model reads badly), so the tail of the output is
re-encoded together with them: `plan` keeps the output ids before a boundary (at most `window`
ids back, never before the ids already sent to the client, and at a character boundary), encodes
the tail's text plus the forced text with the tokenizer and checks that the new ids spell exactly
those bytes and that the FSM accepts them. Unless the forced text completes the pattern, the last
new id is held back for the model to write: the forced text may end in the middle of what the
tokenizer would merge with the text that follows (`": ` before a number), and the model's own
token there keeps its output equal to decoding without jump-forward.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from srt.constrained.fsm import TokenFSM
from srt.constrained.grammar import Matcher

# Longest forced string appended in one jump (longer ones continue at the next jump).
MAX_FORCED_BYTES = 256
# Output ids before the forced string that are re-encoded with it.
RETOKENIZE_WINDOW = 4

_UTF8_MAX_CHAR = 4


@dataclass(frozen=True)
class JumpPlan:
    """Replace `output_ids[keep:]` by `new_ids`; `keep_state` is the FSM state after
    `output_ids[:keep]` (plans over an FSM). `new_ids` spells the replaced tail's bytes followed by at least one byte
    of the forced string (a prefix of it)."""

    keep: int
    keep_state: int | None  # None for a plan_matcher plan (the matcher rolls back instead)
    new_ids: list[int]


def _is_continuation(byte: int) -> bool:
    return byte & 0xC0 == 0x80


def _common_prefix_len(a: bytes, b: bytes) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


class JumpForward:
    """Forced strings and jump plans over one tokenizer. Deterministic: every TP rank, given the
    same request state, computes the same plan."""

    def __init__(self, tokenizer: Any, token_bytes: dict[int, bytes],
                 max_bytes: int = MAX_FORCED_BYTES, window: int = RETOKENIZE_WINDOW) -> None:
        """`token_bytes`: id -> bytes of every ordinary token (srt.constrained.vocab)."""
        self.tokenizer = tokenizer
        self.token_bytes = token_bytes
        self.max_bytes = max_bytes
        self.window = window
        self.byte_token: dict[int, int] = {}
        for i in sorted(token_bytes, reverse=True):  # the lowest id wins for a repeated byte
            b = token_bytes[i]
            if len(b) == 1:
                self.byte_token[b[0]] = i
        first = [-1] * (max(token_bytes, default=-1) + 1)
        for i, b in token_bytes.items():
            if b:
                first[i] = b[0]
        self.first_byte = torch.tensor(first, dtype=torch.int16)  # -1: no bytes (special)

    @property
    def usable(self) -> bool:
        """False for a vocabulary with no single-byte tokens: nothing can be forced then."""
        return bool(self.byte_token)

    # ------------------------------------------------------------------ forced bytes

    def forced(self, fsm: TokenFSM, state: int) -> bytes:
        """The bytes every continuation of `state` starts with (b"" when there is a choice now
        or the state is final). Cached on the FSM per state."""
        hit = fsm.forced.get(state)
        if hit is None:
            hit = self._walk(fsm, state)
            fsm.forced[state] = hit
        return hit

    def _walk(self, fsm: TokenFSM, state: int) -> bytes:
        out = bytearray()
        along: list[tuple[int, torch.Tensor]] = []  # (offset in out, allowed ids) per state
        s = state
        while len(out) < self.max_bytes and not fsm.is_final(s):
            ids = fsm.allowed_tokens(s)
            ids = ids[ids < len(self.first_byte)]
            if len(ids) == 0:
                break
            firsts = self.first_byte[ids]
            b = int(firsts[0])
            if b < 0 or not bool((firsts == b).all()):
                break
            tok = self.byte_token.get(b)
            nxt = fsm.next_state(s, tok) if tok is not None else None
            if nxt is None:
                break
            along.append((len(out), ids))
            out.append(b)
            s = nxt
        # A multi-byte token allowed at an earlier state must agree with every later forced byte
        # it covers (it may carry a byte that has no single-byte token).
        n = len(out)
        for start, ids in along:
            if start >= n:
                break
            for t in ids.tolist():
                tb = self.token_bytes.get(t, b"")
                span = min(len(tb), n - start)
                if tb[:span] != out[start : start + span]:
                    n = start + _common_prefix_len(tb[:span], bytes(out[start : start + span]))
        return bytes(out[:n])

    # ------------------------------------------------------------------ re-tokenized output

    def plan(self, fsm: TokenFSM, state: int, output_ids: list[int], sent_len: int,
             max_new_tokens: int) -> JumpPlan | None:
        """How to append the string forced from `state` (the state after `output_ids`), or None
        when there is nothing to gain. Ids before `sent_len` are never changed; the output never
        grows past `max_new_tokens` ids."""
        forced = self.forced(fsm, state)
        tail = self._retokenize(forced, output_ids, sent_len)
        if tail is None:
            return None
        keep, old_bytes, new = tail
        s = fsm.initial_state
        for t in output_ids[:keep]:
            s = fsm.next_state(s, t)
            if s is None:
                return None
        keep_state = s
        for t in new:
            s = fsm.next_state(s, t)
            if s is None:
                return None
        return self._finish(keep, keep_state, new, fsm.is_dead_end(s), old_bytes,
                            max_new_tokens)

    def plan_matcher(self, matcher: Matcher, output_ids: list[int], sent_len: int,
                     max_new_tokens: int) -> JumpPlan | None:
        """`plan` for a request walking `matcher` (its state after `output_ids`, left
        unchanged): the new ids are checked on a fork rolled back to `keep`."""
        tail = self._retokenize(matcher.forced_bytes(), output_ids, sent_len)
        if tail is None:
            return None
        keep, old_bytes, new = tail
        probe = matcher.fork()
        probe.rollback(len(output_ids) - keep)
        for t in new:
            if not probe.accept(t):
                return None
        return self._finish(keep, None, new, probe.is_dead_end(), old_bytes, max_new_tokens)

    def _retokenize(self, forced: bytes, output_ids: list[int],
                    sent_len: int) -> tuple[int, int, list[int]] | None:
        """(keep, bytes of output_ids[keep:], ids encoding those bytes followed by the forced
        text), or None when nothing is forced or the re-encoding does not spell them."""
        if not forced:
            return None
        n = len(output_ids)
        keep = max(sent_len, n - self.window)
        # Start the re-encoded tail at a character boundary.
        while keep > sent_len and keep < n and self._starts_mid_char(output_ids[keep]):
            keep -= 1
        while keep < n and self._starts_mid_char(output_ids[keep]):
            keep += 1
        tail_parts = [self.token_bytes.get(t) for t in output_ids[keep:]]
        if any(p is None for p in tail_parts):
            return None
        tail = b"".join(tail_parts)  # type: ignore[arg-type]
        text = None
        for cut in range(len(forced), max(0, len(forced) - _UTF8_MAX_CHAR), -1):
            try:
                text = (tail + forced[:cut]).decode("utf-8")
                break
            except UnicodeDecodeError:
                continue
        if text is None:
            return None
        new = list(self.tokenizer.encode(text, add_special_tokens=False))
        spelled = [self.token_bytes.get(t) for t in new]
        if any(p is None for p in spelled) or b"".join(spelled) != text.encode("utf-8"):  # type: ignore[arg-type]
            return None  # a tokenizer that normalizes, or a special token in the text
        return keep, len(tail), new

    def _finish(self, keep: int, keep_state: int | None, new: list[int], complete: bool,
                old_bytes: int, max_new_tokens: int) -> JumpPlan | None:
        if not complete:
            new = new[:-1]  # the model writes the last token (see the module docstring)
        new = new[: max(0, max_new_tokens - keep)]
        if sum(len(self.token_bytes[t]) for t in new) <= old_bytes:
            return None  # no forced byte left to append
        return JumpPlan(keep, keep_state, new)

    def _starts_mid_char(self, token: int) -> bool:
        b = self.token_bytes.get(token, b"")
        return bool(b) and _is_continuation(b[0])
