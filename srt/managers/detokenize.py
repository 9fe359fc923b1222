"""Incremental, UTF-8-safe detokenization of one request's output, with stop strings and
stop regexes.

Used by the detokenizer process, which must stay light: this module imports only
the standard library and srt/stop_regex.py. The tokenizer is passed in and only its
``decode(ids, skip_special_tokens=..., **kwargs) -> str`` method is used
(any HF ``transformers`` tokenizer fits).

Technique (prefix_offset / read_offset, as in vLLM / SGLang): keep a small window
of ids ``window = context + pending``.  ``context`` ids are already represented in
the text; they are decoded again only so that the pending ids decode as they
would inside the full sequence (a SentencePiece leading space, a byte sequence
that spans tokens).  After an ``add``:

* ``decode(window)`` ends with U+FFFD -> the last char is (maybe) an incomplete
  UTF-8 sequence: show nothing new, keep the ids pending;
* otherwise the new text is ``decode(window)[len(decode(context)):]``; the pending
  ids become the next context and the window starts over.

Each ``add`` therefore decodes O(window) ids, not O(output); the window stays a
few tokens long (see ``_MAX_PENDING`` for the two ways it could otherwise grow).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from srt import stop_regex

__all__ = ["DetokenizeState", "IncrementalDetokenizer"]

_REPLACEMENT_CHAR = "\ufffd"

# Once this many ids are pending without completing a character, look for a
# boundary inside the pending ids at which the text can no longer change (e.g. a
# run of stray lead bytes, each permanently invalid).  A valid UTF-8 char is at
# most 4 bytes, so a real character never needs this many byte tokens.
_MAX_PENDING = 8
# How many split points (from the end of the window) that search tries; bounded
# so that a pathological window costs a constant number of extra decodes.
_MAX_SPLIT_TRIES = 4


@dataclass
class DetokenizeState:
    """Per-request detokenization state (one per request, owned by its
    ``IncrementalDetokenizer``).

    Invariants:
    * ``text`` is the decoded output text of ``output_ids[:n]`` for some n
      (the ids not yet represented are pending at the end of ``window``); it
      never ends in an incomplete UTF-8 character.
    * ``window[:read]`` are context ids (already in ``text``, or prompt context);
      ``window[read:]`` are pending ids, not yet in ``text``.
    * ``context_text`` is ``decode(window[:read])`` or None when not computed yet.
    * ``stop_cut`` is None until a stop string or a stop regex match is found in
      ``text``; then the text shown is frozen at ``text[:stop_cut]``.
    * ``stop_searched`` is a position in ``text`` before which no stop string
      starts (so each add only searches the new tail).
    """

    output_ids: list[int] = field(default_factory=list)
    # Prompt tail actually used as context (empty if unusable); kept for finish().
    prompt_context: list[int] = field(default_factory=list)
    window: list[int] = field(default_factory=list)
    read: int = 0
    context_text: str | None = ""
    text: str = ""
    stop_cut: int | None = None
    stop_searched: int = 0
    shown: str = ""
    final_text: str | None = None


class IncrementalDetokenizer:
    """Detokenizes one request's output ids incrementally.

    ``add`` returns the cumulative text that is safe to show so far; ``finish``
    returns the final text.  Without stop strings, every text returned by ``add``
    is a prefix of the next one and of ``finish(None)`` (for tokenizers whose
    decode is consistent on concatenation at character boundaries, e.g.
    byte-level BPE and SentencePiece).
    """

    def __init__(
        self,
        tokenizer,
        prompt_ids_tail: list[int] | None = None,
        skip_special_tokens: bool = True,
        stop_strings: tuple[str, ...] = (),
        no_stop_trim: bool = False,
        spaces_between_special_tokens: bool = True,
        stop_regexes: tuple[str, ...] = (),
    ) -> None:
        """
        Args:
            tokenizer: object with ``decode(ids, skip_special_tokens=..., **kw) -> str``.
            prompt_ids_tail: the last few prompt ids (about 5 is plenty), used only
                as decoding context so the first output token decodes as it would
                after the prompt (e.g. its SentencePiece leading space).  Never part
                of the returned text.  Ignored if it does not decode to clean text.
            skip_special_tokens: passed to every decode.
            stop_strings: strings at which the output ends; empty strings are ignored.
            no_stop_trim: show a found stop string instead of cutting before it.
            spaces_between_special_tokens: passed to decode only when False (the HF
                default is True, and not every tokenizer accepts the keyword).
            stop_regexes: patterns at which the output ends, like stop strings (the
                text is cut at the start of the earliest match, or after its end with
                ``no_stop_trim``).
        """
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._decode_kwargs: dict[str, object] = {}
        if not spaces_between_special_tokens:
            self._decode_kwargs["spaces_between_special_tokens"] = False
        # Deduplicate, keep order, drop "" (it would match everywhere).
        self._stops: tuple[str, ...] = tuple(dict.fromkeys(s for s in stop_strings if s))
        self._max_stop_len = max((len(s) for s in self._stops), default=0)
        self._no_stop_trim = no_stop_trim
        self._patterns: tuple[str, ...] = tuple(dict.fromkeys(stop_regexes))

        self.state = DetokenizeState()
        tail = list(prompt_ids_tail or ())
        if tail:
            tail_text = self._decode(tail)
            # A tail ending mid-character would make the first output char decode
            # differently in context than in the final decode: don't use it.
            if not tail_text.endswith(_REPLACEMENT_CHAR):
                self.state.prompt_context = tail
                self.state.window = list(tail)
                self.state.read = len(tail)
                self.state.context_text = tail_text

    # ------------------------------------------------------------------ API

    @property
    def output_ids(self) -> list[int]:
        """All output ids added so far (the prompt tail excluded). Do not mutate."""
        return self.state.output_ids

    def add(self, new_ids: list[int]) -> str:
        """Append output ids; return the cumulative text that is safe to show.

        The returned text:
        * never ends in an incomplete multi-byte character (ids whose decode ends
          in U+FFFD are held back until they complete);
        * holds back a trailing part that is a proper prefix of a stop string
          (it may still become one), unless ``no_stop_trim`` (then the stop string
          would be shown anyway, so holding back is unneeded);
        * once a stop string occurs, is cut before the first occurrence (or after
          its end with ``no_stop_trim``) and stays frozen; later ids are still
          recorded in ``output_ids``.
        Successive results are prefixes of one another.
        """
        st = self.state
        new_ids = list(new_ids)
        st.output_ids.extend(new_ids)
        if st.stop_cut is not None or not new_ids:
            return st.shown

        st.window.extend(new_ids)
        self._advance()

        text = st.text
        if self._stops:
            self._find_stop()
        if self._patterns:
            self._find_regex_stop()
        if st.stop_cut is not None:
            st.shown = text[: st.stop_cut]
        elif (self._stops or self._patterns) and not self._no_stop_trim:
            keep = len(text) - self._stop_prefix_len(text)
            if self._patterns:
                keep = min(keep, self._regex_hold_back(text))
            st.shown = text[:keep]
        else:
            st.shown = text
        return st.shown

    def finish(self, matched_stop: str | None) -> str:
        """Return the final text: all output ids decoded at once, no hold-back.

        If ``matched_stop`` is a non-empty string and not ``no_stop_trim``, the text
        is cut at its first occurrence (kept whole if it does not occur); when it is
        one of the stop regexes (and not a stop string), at the start of its first
        match.  Any
        other ``matched_stop`` (None, or e.g. an EOS token id) cuts nothing.

        With a usable prompt tail, the ids are decoded after it (and its text
        removed), so the first token decodes exactly as in ``add``; for byte-level
        BPE this equals ``tokenizer.decode(output_ids)``.
        """
        st = self.state
        text = self._decode_output()
        if isinstance(matched_stop, str) and matched_stop and not self._no_stop_trim:
            if matched_stop not in self._stops and matched_stop in self._patterns:
                found = self._regex_match(text, (matched_stop,))
                pos = -1 if found is None else found[1]
            else:
                pos = text.find(matched_stop)
            if pos >= 0:
                text = text[:pos]
        st.final_text = text
        return text

    # ------------------------------------------------------------ internals

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(
            ids, skip_special_tokens=self._skip_special_tokens, **self._decode_kwargs
        )

    def _decode_output(self) -> str:
        st = self.state
        if st.prompt_context:
            ctx_text = self._decode(st.prompt_context)
            full = self._decode(st.prompt_context + st.output_ids)
            if full.startswith(ctx_text):
                return full[len(ctx_text) :]
        return self._decode(st.output_ids)

    def _context_text(self) -> str:
        st = self.state
        if st.context_text is None:
            st.context_text = self._decode(st.window[: st.read])
        return st.context_text

    def _advance(self) -> None:
        """Move complete text from the pending ids into ``state.text``."""
        st = self.state
        ctx_text = self._context_text()
        new_text = self._decode(st.window)

        if not new_text.endswith(_REPLACEMENT_CHAR):
            if not new_text.startswith(ctx_text):
                # Decoder rewrote text across the context boundary (e.g. WordPiece
                # clean-up turning "a ." into "a."). What was shown cannot be taken
                # back; append what follows the common part rather than stall.
                common = 0
                for a, b in zip(ctx_text, new_text):
                    if a != b:
                        break
                    common += 1
                self._emit(new_text[common:], len(st.window))
            elif len(new_text) > len(ctx_text):
                self._emit(new_text[len(ctx_text) :], len(st.window))
            else:
                # The pending ids add no text (e.g. skipped special tokens): drop
                # them so a long run of them cannot grow the window.  They cannot
                # affect later text: an id carrying bytes would have changed the
                # text or produced U+FFFD.
                del st.window[st.read :]
            return

        if len(st.window) - st.read > _MAX_PENDING:
            self._split_pending(ctx_text, new_text)

    def _emit(self, piece: str, upto: int) -> None:
        """Append ``piece`` (the text of ``window[read:upto]``) and make those ids
        the new context."""
        st = self.state
        st.text += piece
        del st.window[: st.read]
        st.read = upto - st.read
        st.context_text = None  # decoded lazily at the next add

    def _split_pending(self, ctx_text: str, new_text: str) -> None:
        """Emit text up to a split point k inside the pending ids at which the
        decode is final: ``decode(w[:k]) + decode(w[k:]) == decode(w)`` with
        ``w[k:]`` carrying text, i.e. whatever ``w[:k]`` ends with (possibly an
        invalid byte shown as U+FFFD, as the final decode shows it) is already
        terminated by the bytes after k and no later id can change it."""
        st = self.state
        w = st.window
        lowest = max(st.read + 1, len(w) - _MAX_SPLIT_TRIES)
        for k in range(len(w) - 1, lowest - 1, -1):
            head = self._decode(w[:k])
            if len(head) <= len(ctx_text) or not head.startswith(ctx_text):
                continue
            tail = self._decode(w[k:])
            if tail and head + tail == new_text:
                self._emit(head[len(ctx_text) :], k)
                return

    def _find_stop(self) -> None:
        """Set ``stop_cut`` if a stop string now occurs in ``state.text``.

        Picks the earliest-starting occurrence (ties: the shortest string).  Only
        the tail that could hold a new occurrence is searched.
        """
        st = self.state
        text = st.text
        start = st.stop_searched
        best_pos = -1
        best_len = 0
        for s in self._stops:
            pos = text.find(s, start)
            if pos >= 0 and (best_pos < 0 or pos < best_pos or (pos == best_pos and len(s) < best_len)):
                best_pos, best_len = pos, len(s)
        if best_pos >= 0:
            st.stop_cut = best_pos + best_len if self._no_stop_trim else best_pos
        else:
            # A stop string starting before this point would already end inside text.
            st.stop_searched = max(start, len(text) - self._max_stop_len + 1)

    def _find_regex_stop(self) -> None:
        """Lower ``stop_cut`` to the earliest stop regex match in ``state.text``, if any.
        The whole text is searched: a pattern may match across any span of it."""
        st = self.state
        found = self._regex_match(st.text, self._patterns)
        if found is None:
            return
        cut = found[2] if self._no_stop_trim else found[1]
        st.stop_cut = cut if st.stop_cut is None else min(st.stop_cut, cut)

    # A search past stop_regex.SEARCH_TIMEOUT_S (the model process aborts such a request)
    # counts as no match here: the text is shown as it is.
    def _regex_match(self, text: str, patterns: tuple[str, ...]) -> tuple[str, int, int] | None:
        try:
            return stop_regex.first_match(patterns, text)
        except TimeoutError:
            return None

    def _regex_hold_back(self, text: str) -> int:
        try:
            return stop_regex.hold_back_start(self._patterns, text)
        except TimeoutError:
            return len(text)

    def _stop_prefix_len(self, text: str) -> int:
        """Length of the longest suffix of ``text`` that is a proper prefix of a
        stop string (0 if none)."""
        best = 0
        for s in self._stops:
            for k in range(min(len(s) - 1, len(text)), best, -1):
                if text.endswith(s[:k]):
                    best = k
                    break
        return best
