"""Checks and rewrites of constraints before they are compiled: grammars that can never finish
are found (xgrammar's jump-forward search would follow their forced path forever), and object
schemas are closed for every backend alike."""

from __future__ import annotations

import json

import pytest

from srt.constrained.productive import unproductive_rules

xgr = pytest.importorskip("xgrammar")


def ebnf(text: str) -> list[str]:
    return unproductive_rules(str(xgr.Grammar.from_ebnf(text)))


def schema(s: dict) -> list[str]:
    return unproductive_rules(str(xgr.Grammar.from_json_schema(json.dumps(s))))


@pytest.mark.parametrize("text,endless", [
    ('root ::= "(" root ")"', ["root"]),
    ('root ::= "a" x\nx ::= root', ["root", "x"]),
    ('root ::= "a" | "b" x\nx ::= "c" x', ["x"]),  # root can end, but not once in x
    ('root ::= x+\nx ::= "a" x', ["root", "x"]),
    ('root ::= x{2,3}\nx ::= "(" x ")"', ["root", "x"]),
    ('root ::= "(" root ")" | "x"', []),
    ('root ::= x* "a"\nx ::= "(" x ")"', ["x"]),  # root ends at once, x is reachable
    ('root ::= "a" [b-z]+ (y | "q")?\ny ::= [^\\n]{0,4}', []),
    ('root ::= "a"\nunused ::= unused "b"', []),  # unreachable rules do not matter
])
def test_ebnf(text: str, endless: list[str]) -> None:
    # xgrammar adds helper rules (root_1, ...) for x+ and x{m,n}: only the named ones compared
    assert [r for r in ebnf(text) if r in ("root", "x", "y", "unused")] == endless


def test_json_schemas() -> None:
    recursive = {"type": "object", "properties": {"a": {"$ref": "#"}}}
    assert schema(recursive) == []
    assert schema({**recursive, "required": ["a"]}) != []
    assert schema({"type": "array", "items": {"$ref": "#"}, "minItems": 1}) != []
    assert schema({"type": "array", "items": {"$ref": "#"}}) == []
    # the built-in JSON rules (strings with escapes, numbers, lookaheads) all read and end
    assert schema({"type": "object", "properties": {
        "s": {"type": "string", "pattern": "^[a-z]{2,5}$"}, "n": {"type": "number"},
        "e": {"enum": ["x\\\"y", 1, None]}, "any": {}}}) == []


def test_regexes_always_end() -> None:
    for r in ["a{3}(b|c)+", "[a-z]*", "(ab|c?)d{2,}", "\\d+\\.\\d*"]:
        assert unproductive_rules(str(xgr.Grammar.from_regex(r))) == []


def test_unreadable_text_is_a_value_error() -> None:
    with pytest.raises(ValueError):
        unproductive_rules("root ::= ( \"a\"")
    with pytest.raises(ValueError):
        unproductive_rules('x ::= "a"')


def test_closed_objects_leave_names_and_data_alone() -> None:
    import json as _json

    from srt.constrained.schema_support import closed_objects

    schema = {"type": "object", "properties": {
        "properties": {"type": "object", "properties": {"x": {"type": "integer"}}},
        "open": {"type": "object", "properties": {}, "additionalProperties": True},
        "e": {"enum": [{"properties": 1}]}},
        "$defs": {"d": {"properties": {"y": {}}}}}
    out = _json.loads(closed_objects(_json.dumps(schema)))
    assert out["additionalProperties"] is False
    props = out["properties"]
    assert set(props) == {"properties", "open", "e"}  # a property named "properties" stays one
    assert props["properties"]["additionalProperties"] is False
    assert props["open"]["additionalProperties"] is True
    assert props["e"] == {"enum": [{"properties": 1}]}  # data is not a schema
    assert out["$defs"]["d"]["additionalProperties"] is False


@pytest.mark.parametrize("backend", ["xgrammar", "llguidance"])
def test_batched_mask_fill_equals_row_by_row(smollm2_tokenizer, backend: str,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    from srt.constrained.grammar import ConstraintSpec
    from srt.constrained.llguidance_backend import LLGuidanceMatcher
    from srt.constrained.registry import create_grammar_backend
    from srt.constrained.xgrammar_backend import XGrammarMatcher

    tok = smollm2_tokenizer
    be = create_grammar_backend(backend, tok, tok.eos_token_id, len(tok), 8)
    cls = XGrammarMatcher if backend == "xgrammar" else LLGuidanceMatcher
    regex = be.compile(ConstraintSpec("regex", "[a-z ,.]+")).result()
    obj = be.compile(ConstraintSpec("json_schema", json.dumps(
        {"type": "object", "properties": {"a": {"type": "string"}}, "required": ["a"]}))).result()
    matchers = [regex.matcher() if i % 3 else obj.matcher() for i in range(9)] + [None]
    for m in matchers[1:9:3]:
        assert m.accept(tok.encode("hello")[0])
    masks = be.mask_builder(len(tok), torch.device("cpu"))
    monkeypatch.setattr(cls, "BATCH_FILL_MIN_ROWS", 2)  # the 9 rows on the backend's threads
    batched = masks.batch(matchers).clone()
    monkeypatch.setattr(cls, "BATCH_FILL_MIN_ROWS", 10**9)
    one_by_one = masks.batch(matchers).clone()
    assert torch.equal(batched, one_by_one)
    assert not batched[-1].any()  # the unconstrained row forbids nothing
    assert batched[0].sum() != batched[1].sum()  # the rows differ by grammar and state


def test_xgrammar_dead_end_and_its_cached_mask_row(smollm2_tokenizer) -> None:
    """is_dead_end fills the current state's mask row; the next mask copies it. Rows copied
    from the cache equal fresh fills, and any change of state (accept, rollback) refills."""
    import torch

    from srt.constrained.grammar import ConstraintSpec
    from srt.constrained.registry import create_grammar_backend

    tok = smollm2_tokenizer
    be = create_grammar_backend("xgrammar", tok, tok.eos_token_id, len(tok), 8)
    g = be.compile(ConstraintSpec("regex", "(yes|no)( indeed)?")).result()
    fresh = g.matcher()
    cached = g.matcher()
    masks = be.mask_builder(len(tok), torch.device("cpu"))

    def same_masks() -> None:
        assert torch.equal(masks.batch([cached]).clone(), masks.batch([fresh]).clone())

    for text in ["yes", " indeed"]:
        ids = tok.encode(text, add_special_tokens=False)
        for t in ids:
            assert cached.accept(t) and fresh.accept(t)
            cached.is_dead_end()  # fills the row of this state
            same_masks()
    assert cached.is_dead_end() and fresh.is_dead_end()  # "yes indeed": only the end follows
    cached.rollback(len(tok.encode(" indeed", add_special_tokens=False)))
    fresh.rollback(len(tok.encode(" indeed", add_special_tokens=False)))
    assert not cached.is_dead_end()  # "yes": complete, but " indeed" may follow
    same_masks()
    allowed = ~masks.batch([cached])[0]
    assert allowed[tok.eos_token_id] and allowed.sum() > 1


def test_xgrammar_prefetch_equals_per_row_checks(smollm2_tokenizer) -> None:
    """prefetch answers every row's dead-end test at once and keeps its mask row: both equal a
    fresh matcher's per-row answer and fill, over rows that are dead ends, complete with more to
    come, and incomplete, through accepts and a rollback."""
    import torch

    from srt.constrained.grammar import ConstraintSpec
    from srt.constrained.registry import create_grammar_backend
    from srt.constrained.xgrammar_backend import XGrammarMatcher

    tok = smollm2_tokenizer
    be = create_grammar_backend("xgrammar", tok, tok.eos_token_id, len(tok), 8)
    g = be.compile(ConstraintSpec("regex", "(yes|no)( indeed)?")).result()
    texts = ["yes indeed", "yes", "no", "n", "yes indeed", "no indeed", ""]
    pairs = []
    for text in texts:
        a, b = g.matcher(), g.matcher()
        for t in tok.encode(text, add_special_tokens=False) if text else []:
            assert a.accept(t) and b.accept(t)
        pairs.append((a, b))
    masks = be.mask_builder(len(tok), torch.device("cpu"))

    def check() -> list[bool]:
        XGrammarMatcher.prefetch([a for a, _ in pairs])
        dead = [a.is_dead_end() for a, _ in pairs]
        # b's own copies, never prefetched: the per-row test and the per-row fill
        assert dead == [XGrammarMatcher(g, b.inner.fork()).is_dead_end() for _, b in pairs]
        fresh = masks.batch([XGrammarMatcher(g, b.inner.fork()) for _, b in pairs]).clone()
        assert torch.equal(masks.batch([a for a, _ in pairs]).clone(), fresh)
        return dead

    assert check() == [True, False, False, False, True, True, False]
    for a, b in pairs[1:3]:  # "yes" / "no" -> + " indeed": dead ends now
        for t in tok.encode(" indeed", add_special_tokens=False):
            assert a.accept(t) and b.accept(t)
    assert check()[1:3] == [True, True]
    n = len(tok.encode(" indeed", add_special_tokens=False))
    pairs[0][0].rollback(n)
    pairs[0][1].rollback(n)
    assert check()[0] is False


@pytest.mark.parametrize("backend", ["xgrammar", "llguidance"])
def test_packed_keep_out_equals_the_merged_masks(smollm2_tokenizer, backend: str) -> None:
    """min_new_tokens' ids cleared in the packed rows give the mask of the general path (the
    matcher's mask merged with a keep-out mask on the device): ids kept out of a free row and of
    constrained rows, not out of a row they would leave empty (a finished pattern whose only
    way on is the EOS), ids past the model's vocabulary ignored."""
    import random

    import torch

    from srt.constrained.grammar import ConstraintSpec
    from srt.constrained.mask import keep_out_mask, merge_forbidden
    from srt.constrained.registry import create_grammar_backend

    if backend == "llguidance":
        pytest.importorskip("llguidance")
    tok = smollm2_tokenizer
    be = create_grammar_backend(backend, tok, tok.eos_token_id, len(tok), 8)
    g = be.compile(ConstraintSpec("regex", "(yes|no)( indeed)?")).result()
    ms = []
    for text in ["yes indeed", None, "yes", "", "n"]:
        m = None if text is None else g.matcher()
        for t in tok.encode(text, add_special_tokens=False) if text else []:
            assert m.accept(t)
        ms.append(m)
    # 3 ids short of the tokenizer: the packed rows' last word has padding bits
    vocab = len(tok) - 3
    rng = random.Random(5)
    eos = tok.eos_token_id
    keep_out = [(0, [eos]), (1, sorted(rng.sample(range(vocab), 40)) + [vocab + 1]),
                (2, [eos, rng.randrange(vocab)]), (4, [eos])]
    masks = be.mask_builder(vocab, torch.device("cpu"))
    plain = masks.matcher_mask(ms).clone()
    got = masks.batch(ms, keep_out).clone()
    want = merge_forbidden(keep_out_mask(keep_out, len(ms), vocab, torch.device("cpu")), plain)
    assert torch.equal(got, want)
    # what the rows cover
    assert (~got[0]).nonzero().flatten().tolist() == [eos]  # only the EOS: kept
    assert int(got[1].sum()) == 40  # the free row
    assert not plain[2, eos] and got[2, eos]  # "yes" may end, but not yet
    assert torch.equal(got[3], plain[3]) and torch.equal(got[4], plain[4])
