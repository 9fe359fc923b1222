"""stop_regex (srt/stop_regex.py): validation, the tail the model process searches, and the
detokenizer's trimming and hold-back, on the real SmolLM2 tokenizer. The whole path (model
process and detokenizer over HTTP) is in tests/e2e/test_sglang_api.py."""

from __future__ import annotations

import random
from typing import Any

import pytest
import regex

from srt import stop_regex
from srt.managers.detokenize import IncrementalDetokenizer
from srt.sampling_params import SamplingParamError, SamplingParams


@pytest.mark.parametrize("pattern,ok", [
    (r"\d+\.", True), ("END", True), (r"(?<=x)y", True), ("", False), ("(", False),
    ("a*", False), ("$", False), ("x" * 300, False),
])
def test_validate(pattern: str, ok: bool) -> None:
    assert (stop_regex.validate(pattern) is None) is ok
    if not ok:
        with pytest.raises(SamplingParamError) as e:
            SamplingParams.from_dict({"stop_regex": pattern})
        assert e.value.param == "stop_regex"


def test_params_take_a_string_or_a_list() -> None:
    assert SamplingParams.from_dict({"stop_regex": "a+b"}).stop_regex == ("a+b",)
    assert SamplingParams.from_dict({"stop_regex": ["x", "y", "x"]}).stop_regex == ("x", "y")
    assert SamplingParams.from_dict({"stop_regex": []}).stop_regex == ()
    for bad in (5, ["a", 5], {"a": 1}, ["a"] * 33):
        with pytest.raises(SamplingParamError):
            SamplingParams.from_dict({"stop_regex": bad})


@pytest.mark.parametrize("pattern,width", [
    ("abc", 3), (r"\d{2,5}", 5), ("a|bcd", 3), (r"\bend\b", 3), (r"\d+", None), (".*x", None),
    (r"\p{L}", None),  # `regex` syntax that `re` cannot parse: width unknown, whole output
])
def test_max_chars(pattern: str, width: int | None) -> None:
    assert stop_regex.max_chars(pattern) == width


def test_match_stop_searches_the_tail_a_match_can_end_in(smollm2_tokenizer: Any) -> None:
    tok = smollm2_tokenizer
    ids = tok.encode("The answer is 42. Then we went home and slept.")
    decode = tok.decode
    assert stop_regex.match_stop(decode, ids, (), (r"\d+\.",)) == r"\d+\."
    assert stop_regex.match_stop(decode, ids, ("home",), (r"\d+\.",)) == "home"  # strings first
    assert stop_regex.match_stop(decode, ids, (), (r"zzz\d",)) is None
    # a bounded pattern is searched in the tail a match can end in; an unbounded one in the
    # whole output, however long
    long_ids = tok.encode("The answer is 42 and" + " more" * 400)
    assert stop_regex.match_stop(decode, long_ids, (), (r"is \d{1,3} and",)) is None
    assert stop_regex.match_stop(decode, long_ids, (), (r"is \d+ and",)) == r"is \d+ and"
    assert stop_regex.match_stop(decode, long_ids, (), (r"answer.*more$",)) == r"answer.*more$"


def _stream(tok: Any, text: str, patterns: tuple[str, ...], no_stop_trim: bool = False,
            ) -> tuple[list[str], str, str | None]:
    """Feed text's ids one by one, as the model process would, stopping where match_stop says.
    Returns the shown texts, the final text and the matched pattern."""
    ids = tok.encode(text)
    det = IncrementalDetokenizer(tok, stop_regexes=patterns, no_stop_trim=no_stop_trim)
    shown, out, matched = [], [], None
    for t in ids:
        out.append(t)
        shown.append(det.add([t]))
        matched = stop_regex.match_stop(tok.decode, out, (), patterns)
        if matched is not None:
            break
    return shown, det.finish(matched), matched


@pytest.mark.parametrize("text,patterns,final", [
    ("Items: apple, pear 12. banana", (r"\d+\.",), "Items: apple, pear "),
    ("Total: 3 apples and 4 pears.", (r"\d+ pears", r"and \d"), "Total: 3 apples "),
    ("no match here at all", (r"\d",), "no match here at all"),
    ("über straße 9x done", (r"\d[a-z]",), "über straße "),
])
def test_detokenizer_trims_and_streams_prefixes(smollm2_tokenizer: Any, text: str,
                                                patterns: tuple[str, ...], final: str) -> None:
    shown, out, matched = _stream(smollm2_tokenizer, text, patterns)
    assert out == final
    for a, b in zip(shown, shown[1:] + [out]):
        assert b.startswith(a), (a, b)  # every streamed text is a prefix of the next
    assert (matched is None) == (final == text)


def test_no_stop_trim_keeps_the_match(smollm2_tokenizer: Any) -> None:
    shown, out, matched = _stream(smollm2_tokenizer, "pear 12. banana", (r"\d+\.",),
                                  no_stop_trim=True)
    assert matched == r"\d+\." and out == "pear 12."
    assert all(out.startswith(s) for s in shown)


def test_hold_back_is_where_a_match_may_start() -> None:
    assert stop_regex.hold_back_start([r"\d+\."], "pear 12") == 5
    assert stop_regex.hold_back_start([r"\d+\."], "pear 12 x") == 9
    assert stop_regex.hold_back_start([r"END", r"\d\d"], "x EN 1") == 5
    assert stop_regex.hold_back_start([r"END", r"\d\d"], "x 1 EN") == 4


def test_random_texts_match_a_full_search(smollm2_tokenizer: Any) -> None:
    """Against a reference: the final text is the text before the first match of the full
    search (or all of it), whatever the tokens."""
    rng = random.Random(7)
    pool = list("ab 12.,x\n") + ["é", "中", "😀"]
    pattern = r"\d[.,]x"
    for _ in range(40):
        text = "".join(rng.choice(pool) for _ in range(rng.randint(5, 40)))
        shown, out, _ = _stream(smollm2_tokenizer, text, (pattern,))
        m = regex.search(pattern, text)
        expect = text if m is None else text[:m.start()]
        # the model process stops at the token completing the match, so only that much text is
        # decoded; the cut is at the first match either way
        assert out == expect, (text, out)
        assert all(out.startswith(s) for s in shown), (text, shown, out)


def test_a_search_that_backtracks_without_bound_times_out(smollm2_tokenizer: Any) -> None:
    """The model process turns the TimeoutError into an abort; the detokenizer shows the text."""
    tok, pattern = smollm2_tokenizer, r"(a|aa)+$"
    text = "a" * 28 + "!"
    with pytest.raises(TimeoutError):
        stop_regex.match_stop(tok.decode, tok.encode(text), (), (pattern,))
    det = IncrementalDetokenizer(tok, stop_regexes=(pattern,))
    assert det.add(tok.encode(text)) == text
    assert det.finish(pattern) == text
