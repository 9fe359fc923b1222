"""Jump-forward on the host: the forced bytes of an FSM state against a brute force over the
regex itself, and the re-tokenized plans (SmolLM2's tokenizer, outlines-core FSMs)."""

from __future__ import annotations

import json
import random
from typing import Any

import pytest
import regex  # partial matching: is a string a prefix of some match?

from srt.constrained.fsm import TokenFSM, compile_fsm, constraint_regex
from srt.constrained.jump_forward import JumpForward
from srt.constrained.vocab import build_vocabulary, token_bytes_map

EOS = 2

SCHEMA = {"type": "object", "properties": {
    "first_name_of_the_person": {"type": "string", "maxLength": 8},
    "favourite_colour": {"enum": ["red", "green"]}},
    "required": ["first_name_of_the_person", "favourite_colour"]}
# pattern -> full matches whose every prefix is checked
PATTERNS: dict[str, list[str]] = {
    r"The answer is (yes|no)\.": ["The answer is yes.", "The answer is no."],
    r"(abc|abd)xyz[0-9]+ items": ["abcxyz12 items", "abdxyz7 items"],
    r"Date: (19|20)[0-9]{2}-(0[1-9]|1[0-2])": ["Date: 1999-07", "Date: 2024-12"],
    r"caf(é|è) (au lait|noir)!": ["café au lait!", "cafè noir!"],
    r"€ [0-9]{1,3}, 中文 ok": ["€ 12, 中文 ok"],
    r"(ab)?cdef": ["abcdef", "cdef"],
    constraint_regex(None, json.dumps(SCHEMA)): [
        '{"first_name_of_the_person": "Ann", "favourite_colour": "green"}',
        '{ "first_name_of_the_person" :"","favourite_colour":"red" }'],
}
# The brute force's alphabet: printable ASCII, a few others, every character of the examples.
ALPHABET = sorted({chr(c) for c in range(0x20, 0x7F)} | {"\n", "\t", "ü", "ñ"}
                  | set("".join(e for es in PATTERNS.values() for e in es)))


@pytest.fixture(scope="module")
def tok(smollm2_tokenizer: Any) -> Any:
    return smollm2_tokenizer


@pytest.fixture(scope="module")
def token_bytes(tok: Any) -> dict[int, bytes]:
    return token_bytes_map(tok)


@pytest.fixture(scope="module")
def vocab(tok: Any, token_bytes: dict[int, bytes]) -> Any:
    return build_vocabulary(tok, EOS, token_bytes)


@pytest.fixture(scope="module")
def jf(tok: Any, token_bytes: dict[int, bytes]) -> JumpForward:
    return JumpForward(tok, token_bytes)


def _common_prefix(items: list[bytes]) -> bytes:
    out = b""
    for chars in zip(*items):
        if len(set(chars)) > 1:
            break
        out += bytes([chars[0]])
    return out


def brute_forced(pattern: str, prefix: str, has_byte_token: set[int]) -> bytes:
    """The bytes every match of `pattern` that starts with `prefix` continues with, from the
    regex alone: add the only next character while there is exactly one and the text so far is
    not a full match; then the common leading bytes of the candidate characters. Cut at the
    first byte the vocabulary has no single-byte token for (where jump-forward stops)."""
    compiled = regex.compile(pattern)
    text = prefix
    tail = b""
    while not compiled.fullmatch(text):
        nxt = [c for c in ALPHABET if compiled.fullmatch(text + c, partial=True)]
        if len(nxt) == 1:
            text += nxt[0]
            continue
        tail = _common_prefix([c.encode() for c in nxt]) if nxt else b""
        break
    out = text[len(prefix):].encode() + tail
    for i, b in enumerate(out):
        if b not in has_byte_token:
            return out[:i]
    return out


def _state_after(fsm: TokenFSM, ids: list[int]) -> int:
    s = fsm.initial_state
    for t in ids:
        s = fsm.next_state(s, t)
        assert s is not None
    return s


def test_forced_bytes_match_brute_force(tok: Any, vocab: Any, jf: JumpForward) -> None:
    checked = nonempty = 0
    for pattern, examples in PATTERNS.items():
        fsm = compile_fsm(pattern, vocab, EOS)
        for example in examples:
            assert regex.fullmatch(pattern, example), (pattern, example)
            for i in range(len(example) + 1):
                prefix = example[:i]
                state = _state_after(fsm, tok.encode(prefix, add_special_tokens=False))
                got = jf.forced(fsm, state)
                want = brute_forced(pattern, prefix, set(jf.byte_token))
                assert got == want, (pattern, prefix, got, want)
                assert jf.forced(fsm, state) is got  # cached
                checked += 1
                nonempty += bool(got)
    assert checked > 250 and nonempty > 100, (checked, nonempty)
    # the partial-character case is among them: after "caf" only the lead byte of é/è is forced
    fsm = compile_fsm(r"caf(é|è)", vocab, EOS)
    assert jf.forced(fsm, _state_after(fsm, tok.encode("caf"))) == b"\xc3"


def test_forced_bytes_are_capped(tok: Any, vocab: Any, token_bytes: dict[int, bytes]) -> None:
    fsm = compile_fsm(r"x{100}y", vocab, EOS)
    short = JumpForward(tok, token_bytes, max_bytes=30)
    assert short.forced(fsm, fsm.initial_state) == b"x" * 30
    after = _state_after(fsm, tok.encode("x" * 90))
    assert JumpForward(tok, token_bytes).forced(fsm, after) == b"x" * 10 + b"y"


def test_a_byte_only_a_longer_token_carries_cuts_the_forced_string() -> None:
    """Byte 0x04 has no single-byte token here, but the token "a\\x04" may start the output:
    after "a" the walk sees only "b", yet "b" is not forced. A real outlines-core FSM over a
    small vocabulary."""
    from outlines_core import Index, Vocabulary

    tokens = {b"a": [1], b"b": [3], b"c": [4], b"a\x04": [5], b"bc": [6]}
    fsm = TokenFSM(Index(r"a(\x04|b)c", Vocabulary(0, tokens)), 0)
    token_bytes = {ids[0]: b for b, ids in tokens.items()}
    jf = JumpForward(None, token_bytes)
    assert jf.forced(fsm, fsm.initial_state) == b"a"
    after_a = fsm.next_state(fsm.initial_state, 1)
    assert jf.forced(fsm, after_a) == b"bc"  # from here no token carries 0x04: "bc" is forced


def test_no_single_byte_tokens_means_no_jump() -> None:
    assert not JumpForward(None, {7: b"ab", 8: b"cd"}).usable


def _decoded(token_bytes: dict[int, bytes], ids: list[int]) -> bytes:
    return b"".join(token_bytes[t] for t in ids)


def test_plan_from_the_start(tok: Any, vocab: Any, jf: JumpForward,
                             token_bytes: dict[int, bytes]) -> None:
    fsm = compile_fsm(r"The answer is (yes|no)\.", vocab, EOS)
    plan = jf.plan(fsm, fsm.initial_state, [], 0, 100)
    assert plan is not None and plan.keep == 0 and plan.keep_state == fsm.initial_state
    # "The answer is " is forced; its last token (" ") is left to the model
    assert plan.new_ids == tok.encode("The answer is", add_special_tokens=False)
    # a fixed pattern is appended whole: the model has nothing left to write
    fsm = compile_fsm(r"Hello world", vocab, EOS)
    plan = jf.plan(fsm, fsm.initial_state, [], 0, 100)
    assert plan is not None and plan.new_ids == tok.encode("Hello world", add_special_tokens=False)
    # never past max_new_tokens
    plan = jf.plan(fsm, fsm.initial_state, [], 0, 1)
    assert plan is not None and plan.new_ids == tok.encode("Hello world")[:1]
    assert jf.plan(fsm, fsm.initial_state, [], 0, 0) is None


def test_plan_re_tokenizes_the_unsent_tail(tok: Any, vocab: Any, jf: JumpForward,
                                           token_bytes: dict[int, bytes]) -> None:
    fsm = compile_fsm(constraint_regex(None, json.dumps(SCHEMA)), vocab, EOS)
    # the model wrote "{" and '"' as two tokens: the key is forced after them
    out = [tok.convert_tokens_to_ids("{"), tok.convert_tokens_to_ids('"')]
    state = _state_after(fsm, out)
    assert jf.forced(fsm, state) == b'first_name_of_the_person"'
    plan = jf.plan(fsm, state, out, 0, 100)
    assert plan is not None and plan.keep == 0
    # re-encoded with the forced key: '{"' is one token, as the tokenizer writes it; the
    # closing quote is held back for the model
    assert plan.new_ids == tok.encode('{"first_name_of_the_person', add_special_tokens=False)
    # sent ids are never changed
    plan = jf.plan(fsm, state, out, 2, 100)
    assert plan is not None and plan.keep == 2
    assert _decoded(token_bytes, plan.new_ids) == b"first_name_of_the_person"
    assert plan.keep_state == state


def test_plans_keep_their_contract(tok: Any, vocab: Any, jf: JumpForward,
                                   token_bytes: dict[int, bytes]) -> None:
    """Over random prefixes of random matches: every plan keeps the sent ids, spells the old
    tail followed by forced bytes, is accepted by the FSM and fits max_new_tokens."""
    rng = random.Random(0)
    plans = 0
    for pattern, examples in PATTERNS.items():
        fsm = compile_fsm(pattern, vocab, EOS)
        for example in examples:
            ids = tok.encode(example, add_special_tokens=False)
            for n in range(len(ids) + 1):
                out = ids[:n]
                state = _state_after(fsm, out)
                sent = rng.randint(0, n)
                max_new = rng.randint(n, n + 8)
                plan = jf.plan(fsm, state, out, sent, max_new)
                if plan is None:
                    continue
                plans += 1
                assert sent <= plan.keep <= n
                assert plan.keep_state == _state_after(fsm, out[: plan.keep])
                assert plan.keep + len(plan.new_ids) <= max_new
                old_tail = _decoded(token_bytes, out[plan.keep:])
                new = _decoded(token_bytes, plan.new_ids)
                forced = jf.forced(fsm, state)
                assert len(new) > len(old_tail)
                assert (old_tail + forced).startswith(new), (pattern, out, plan)
                _state_after(fsm, out[: plan.keep] + plan.new_ids)
    assert plans > 30
