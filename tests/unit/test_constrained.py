"""Constrained decoding pieces on the host: the vocabulary's bytes and the allowed-token mask."""

from __future__ import annotations

import json
import random
import re
from typing import Any

import pytest
import torch

from srt.constrained.fsm import JSON_OBJECT_REGEX, FSMCache, TokenFSM, compile_fsm
from srt.constrained.mask import constrained_forbidden, merge_forbidden
from srt.constrained.vocab import build_vocabulary, byte_level_alphabet, token_bytes_map
from srt.sampling_params import SamplingParamError, SamplingParams

EOS = 2


@pytest.fixture(scope="module")
def tok(smollm2_tokenizer: Any) -> Any:
    return smollm2_tokenizer


@pytest.fixture(scope="module")
def vocab(tok: Any) -> Any:
    return build_vocabulary(tok, EOS)


def test_byte_alphabet_is_a_bijection() -> None:
    table = byte_level_alphabet()
    assert sorted(table.values()) == list(range(256))
    assert table["Ġ"] == ord(" ") and table["Ċ"] == ord("\n") and table["A"] == ord("A")


def test_token_bytes_round_trip_with_decode(tok: Any) -> None:
    m = token_bytes_map(tok)
    assert set(tok.all_special_ids).isdisjoint(m)
    assert len(m) == len(tok.get_vocab()) - len(set(tok.all_special_ids))
    rng = random.Random(0)
    sample = rng.sample(sorted(m), 3000)
    checked = 0
    for i in sample:
        text = tok.decode([i])
        if "\ufffd" in text:  # a partial UTF-8 sequence: check it inside a sequence below
            continue
        assert m[i] == text.encode("utf-8"), (i, tok.convert_ids_to_tokens(i), m[i], text)
        checked += 1
    assert checked > 2000
    # Sequences (which also join partial characters): bytes concatenate to the decoded text.
    for _ in range(200):
        ids = [rng.choice(sample) for _ in range(rng.randint(2, 6))]
        joined = b"".join(m[i] for i in ids)
        assert joined.decode("utf-8", errors="replace") == tok.decode(ids)
    # Leading spaces survive (the reason for bytes keys).
    space_hello = tok.encode(" hello")
    assert len(space_hello) == 1 and m[space_hello[0]] == b" hello"


def _brute_allowed(tok: Any, pattern: str, prefix: str, m: dict[int, bytes]) -> set[int]:
    """Tokens t such that prefix + t is still a prefix of some match of `pattern` (checked by
    enumerating completions of the small finite language), plus EOS where prefix matches."""
    lang = _finite_language(pattern)
    out = set()
    for i, b in m.items():
        try:
            s = prefix + b.decode("utf-8")
        except UnicodeDecodeError:
            continue
        if s and any(w.startswith(s) for w in lang):
            out.add(i)
    if prefix in lang:
        out.add(EOS)
    return out


def _finite_language(pattern: str) -> set[str]:
    # The test pattern: a choice of words then one or two digits.
    words = ["cat", "car", "dog"]
    digits = [str(d) for d in range(10)] + [f"{a}{b}" for a in range(10) for b in range(10)]
    lang = {w + "-" + d for w in words for d in digits}
    assert all(re.fullmatch(pattern, w) for w in lang)
    return lang


def test_mask_against_brute_force(tok: Any, vocab: Any) -> None:
    pattern = r"(cat|car|dog)-[0-9]{1,2}"
    fsm = compile_fsm(pattern, vocab, EOS)
    m = token_bytes_map(tok)
    vocab_size = 49152
    walks = ["", "c", "ca", "car", "car-", "car-4", "car-42", "dog-", "d"]
    rows: list[tuple[TokenFSM, int] | None] = []
    expected: list[set[int] | None] = []
    for prefix in walks:
        state = fsm.initial_state
        for tid in tok.encode(prefix) if prefix else []:
            state = fsm.next_state(state, tid)
            assert state is not None, prefix
        rows.append((fsm, state))
        expected.append(_brute_allowed(tok, pattern, prefix, m))
        rows.append(None)  # an unconstrained row between each
        expected.append(None)
    forbidden = constrained_forbidden(rows, vocab_size, torch.device("cpu"))
    assert forbidden.shape == (len(rows), vocab_size)
    # Poison: logits of random garbage; only allowed tokens may survive the mask.
    logits = torch.randn(len(rows), vocab_size) * 100
    masked = logits.masked_fill(forbidden, float("-inf"))
    for row, exp in enumerate(expected):
        if exp is None:
            assert not forbidden[row].any()
            assert torch.equal(masked[row], logits[row])
            continue
        got = set(torch.nonzero(~forbidden[row]).flatten().tolist())
        assert got == exp, (walks[row // 2], sorted(got ^ exp)[:10])
        assert got
        assert int(masked[row].argmax()) in exp


def test_dead_end_and_final(vocab: Any) -> None:
    fsm = compile_fsm(r"(ab|a)", vocab, EOS)
    s = fsm.initial_state
    a = fsm.next_state(s, 81)  # "a"
    assert fsm.is_final(a) and not fsm.is_dead_end(a)
    ab = fsm.next_state(s, 369)  # "ab"
    assert fsm.is_dead_end(ab)
    assert fsm.allowed_tokens(ab).tolist() == [EOS]


def test_merge_forbidden_keeps_the_pattern() -> None:
    fsm_forb = torch.tensor([[True, True, False], [False, True, True]])
    min_tokens = torch.tensor([[False, False, True], [False, False, False]])
    merged = merge_forbidden(min_tokens, fsm_forb)
    assert merged.tolist() == [[True, True, False], [False, True, True]]
    assert merge_forbidden(None, fsm_forb) is fsm_forb


def test_cache_is_bounded_and_shared(tok: Any) -> None:
    cache = FSMCache(tok, EOS, capacity=2)
    a1 = cache.get(r"[0-9]")
    assert cache.get(r"[0-9]") is a1
    cache.get(r"[a-c]")
    cache.get(r"x|y")
    assert len(cache) == 2
    assert cache.get(r"[0-9]") is not a1  # evicted, compiled again
    assert a1.result().num_states > 0
    bad = cache.get(r"a(")
    with pytest.raises(ValueError):
        bad.result()


def test_json_object_regex() -> None:
    for ok in ['{}', '{"a": 1}', '{"a": "x", "b": [1, 2], "c": {"d": null}}']:
        assert re.fullmatch(JSON_OBJECT_REGEX, ok), ok
    assert not re.fullmatch(JSON_OBJECT_REGEX, '[1]')


def test_sampling_params_constraints() -> None:
    p = SamplingParams.from_dict({"json_schema": {"type": "integer"}})
    assert p.json_schema == '{"type":"integer"}'
    assert p.constraint_key == 'json_schema:{"type":"integer"}'
    assert SamplingParams.from_dict({"json_schema": '{"type": "integer"}'}) == p
    assert SamplingParams.from_dict({"regex": "a+"}).constraint_key == "regex:a+"
    assert SamplingParams().constraint_key is None
    for bad, field in [({"regex": 3}, "regex"), ({"regex": "a", "json_schema": {}}, "regex"),
                       ({"json_schema": "[1"}, "json_schema"), ({"json_schema": 1}, "json_schema"),
                       ({"json_schema": "[1]"}, "json_schema")]:
        with pytest.raises(SamplingParamError) as e:
            SamplingParams.from_dict(bad)
        assert e.value.param == field


def test_unenforced_schema_keywords_are_refused() -> None:
    from srt.constrained.fsm import check_schema_keywords, constraint_regex

    with pytest.raises(ValueError, match="'maximum' at \\$.properties.age"):
        constraint_regex(None, json.dumps({"type": "object", "properties": {
            "age": {"type": "integer", "maximum": 99}}}))
    with pytest.raises(ValueError, match="multipleOf"):
        check_schema_keywords({"type": "array", "items": {"type": "number", "multipleOf": 2}})
    # a property named like a keyword, and keyword-like data, are fine
    check_schema_keywords({"type": "object", "properties": {"minimum": {"type": "string"}},
                           "default": {"maximum": 1}, "enum": [{"minimum": 3}]})
    assert constraint_regex(None, json.dumps({"type": "integer"}))


def test_forbidden_rows_cache(tok: Any, vocab: Any) -> None:
    """Rows are built once per (FSM, state), keyed by the FSM's serial (two FSMs with the same
    state numbers do not share rows), and evicted in LRU order past the budget."""
    from srt.constrained.mask import ForbiddenRows

    digits = compile_fsm(r"[0-9]+", vocab, tok.eos_token_id)
    letters = compile_fsm(r"[a-z]+", vocab, tok.eos_token_id)
    assert digits.serial != letters.serial
    v = 49152
    rows = ForbiddenRows(v, torch.device("cpu"), budget_bytes=16 * v)
    assert rows.max_rows == 16
    a = rows.row(digits, digits.initial_state).clone()
    assert torch.equal(rows.row(digits, digits.initial_state), a) and rows.built == 1  # cached
    b = rows.row(letters, letters.initial_state)
    assert not torch.equal(a, b)
    assert set(torch.nonzero(~a).flatten().tolist()) == \
        {t for t in digits.allowed_tokens(digits.initial_state).tolist() if t < v}
    batch = rows.batch([(digits, digits.initial_state), None, (letters, letters.initial_state)])
    assert torch.equal(batch[0], a) and not batch[1].any() and torch.equal(batch[2], b)
    # Fill past the budget with 30 distinct states: the oldest rows go first.
    counted = compile_fsm(r"[0-9]{30}", vocab, tok.eos_token_id)
    state, seen = counted.initial_state, []
    for t in tok.encode("0" * 30):
        state = counted.next_state(state, t)
        seen.append(state)
    assert len(set(seen)) >= 20
    for s in seen:
        rows.row(counted, s)
    assert len(rows._rows) == 16
    assert (counted.serial, seen[-1]) in rows._rows
    assert (counted.serial, seen[0]) not in rows._rows
    assert (digits.serial, digits.initial_state) not in rows._rows
    # every cached row still holds its own state's mask after the slots were reused
    for s in seen[-16:]:
        want = torch.ones(v, dtype=torch.bool)
        want[counted.allowed_tokens(s)] = False
        assert torch.equal(rows.row(counted, s), want), s
    # a batch with more distinct states than the cache holds is still right
    many = rows.batch([(counted, s) for s in seen] + [None])
    for i, s in enumerate(seen):
        assert torch.equal(many[i], rows.row(counted, s)), s
    assert not many[-1].any()
