"""`stop_regex`: generation stops once the output text matches one of a request's patterns.

SGLang's sampling parameter: a regex or a list of them, searched (not anchored) in the output
text. The model process decides that a request stops (`first_match` on the decoded tail of its
output); the detokenizer trims the text at the match, like a stop string, unless `no_stop_trim`,
and while streaming holds back a tail that may still become the start of a match
(`hold_back_start`), so every streamed text is a prefix of the final one.

Patterns are compiled by the `regex` package (Python's `re` syntax, plus partial matching, which
the hold-back needs). Loaded by the HTTP process and the detokenizer, so nothing heavy here.
"""

from __future__ import annotations

import functools
import re
from typing import Callable, Iterable

import regex

try:  # Python 3.11+
    from re import _parser as _sre_parse  # type: ignore[attr-defined]
except ImportError:  # Python 3.10
    import sre_parse as _sre_parse  # type: ignore[no-redef]

MAX_STOP_REGEXES = 32
MAX_STOP_REGEX_BYTES = 256
# The widest match for which the model process decodes only a tail of the output; a pattern
# that may match more characters (or whose width is unknown) is searched in the whole output.
MAX_TAIL_CHARS = 4096
# One search of one pattern may take this long; past it `TimeoutError` (a pattern that
# backtracks without bound must not stall the model process or the detokenizer).
SEARCH_TIMEOUT_S = 0.1


@functools.lru_cache(maxsize=1024)
def compiled(pattern: str) -> "regex.Pattern[str]":
    return regex.compile(pattern)


def validate(pattern: str) -> str | None:
    """Why `pattern` cannot be a stop_regex, or None when it can."""
    if pattern == "":
        return "stop_regex patterns must not be empty (they would match at once)"
    if len(pattern.encode("utf-8", "surrogatepass")) > MAX_STOP_REGEX_BYTES:
        return f"stop_regex patterns must be at most {MAX_STOP_REGEX_BYTES} bytes"
    try:
        p = compiled(pattern)
    except (regex.error, RecursionError, OverflowError) as e:
        return f"invalid stop_regex {pattern!r}: {e}"
    if p.search("") is not None:
        return f"stop_regex {pattern!r} matches the empty string (it would stop at once)"
    return None


@functools.lru_cache(maxsize=1024)
def max_chars(pattern: str) -> int | None:
    """An upper bound on the characters one match of `pattern` spans, or None if unbounded
    (or beyond MAX_TAIL_CHARS, or not known: `re` cannot parse every `regex` pattern)."""
    try:
        width = _sre_parse.parse(pattern).getwidth()[1]
    except (re.error, RecursionError, OverflowError, TypeError, ValueError):
        return None
    return width if width <= MAX_TAIL_CHARS else None


def tail_tokens(patterns: Iterable[str]) -> int | None:
    """How many trailing output tokens cover every match that can end in the newest token, or
    None when the whole output must be searched. A character is at most 4 byte-level tokens."""
    widest = 0
    for p in patterns:
        w = max_chars(p)
        if w is None:
            return None
        widest = max(widest, w)
    return 4 * widest + 4


def first_match(patterns: Iterable[str], text: str) -> tuple[str, int, int] | None:
    """(pattern, start, end) of the earliest-starting match of any pattern in `text` (ties: the
    pattern listed first), or None. Raises TimeoutError for a search over SEARCH_TIMEOUT_S."""
    best: tuple[str, int, int] | None = None
    for p in patterns:
        m = compiled(p).search(text, timeout=SEARCH_TIMEOUT_S)
        if m is not None and (best is None or m.start() < best[1]):
            best = (p, m.start(), m.end())
    return best


def hold_back_start(patterns: Iterable[str], text: str) -> int:
    """Where the tail of `text` that may still grow into a match begins (len(text) if none).
    Raises TimeoutError like first_match."""
    start = len(text)
    for p in patterns:
        m = compiled(p).search(text, partial=True, timeout=SEARCH_TIMEOUT_S)
        if m is not None and m.partial:
            start = min(start, m.start())
    return start


def match_stop(decode: Callable[[list[int]], str], output_ids: list[int],
               stops: tuple[str, ...], patterns: tuple[str, ...]) -> str | None:
    """The stop string, else the stop_regex pattern, that occurs in the decoded tail of
    `output_ids` that could hold one ending at the newest token (the whole output for a pattern
    of unbounded width); None if none does. `decode(ids)` gives the ids' text. Raises
    TimeoutError like first_match."""
    if not stops and not patterns:
        return None
    # A character is at most 4 byte-level tokens: these tails cover the longest stop string
    # and the widest match.
    n_str = 4 * max(map(len, stops)) + 4 if stops else 0
    n_re = tail_tokens(patterns) if patterns else 0
    n = None if n_re is None else max(n_str, n_re)
    tail = decode(output_ids if n is None else output_ids[-n:])
    for s in stops:
        if s in tail:
            return s
    found = first_match(patterns, tail) if patterns else None
    return None if found is None else found[0]
