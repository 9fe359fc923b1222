"""The default grammar backend (xgrammar) through the real server: pydantic-generated schemas at
temperature 1 (every output validates, with format checking, parses back into its model and has
its keys in schema order), an EBNF grammar, unsupported keywords refused by name, and a fuzz of
bad constraints that may only give 200s or 400s naming the field. llguidance serves the same
models (one seed) and the EBNF grammar too; it and outlines-core get the fuzz in-process (their
compiles), which is what a bad grammar could break.

The server's compile timeout is 3 s: the schemas here compile in well under a second (the
largest, `Contact`, in 0.9 s on an idle core of the 2-core test machine, measured), and the
pathological pattern (10.6 s there, measured) must be a 400 within the bound: about 3x margin
either way, since the compile thread runs at lowered priority and a loaded machine slows both.
"""

from __future__ import annotations

import datetime
import json
import time
import uuid
from enum import Enum
from typing import Any, Literal, Optional, Union

import jsonschema
import pytest
import requests
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import BaseModel, Field
from typing_extensions import Annotated

from tests.conftest import BASE_ARGS, ServerProcess


class Person(BaseModel):
    name: str = Field(min_length=1, max_length=12)
    age: int = Field(ge=0, le=120)


class Address(BaseModel):
    street: str = Field(max_length=20)
    zip_code: str = Field(pattern=r"^[0-9]{5}$")


class Customer(BaseModel):
    person: Person
    address: Optional[Address] = None
    vip: bool = False


class Event(BaseModel):
    day: datetime.date
    starts: datetime.datetime
    ticket: uuid.UUID


class Contact(BaseModel):
    email: Annotated[str, Field(json_schema_extra={"format": "email"})]
    phone: str = Field(pattern=r"^\+[0-9]{6,10}$")


class Colour(str, Enum):
    red = "red"
    green = "green"
    blue = "blue"


class Paint(BaseModel):
    colour: Colour
    finish: Literal["matte", "gloss"]
    version: Literal[2] = 2


class Item(BaseModel):
    name: str = Field(min_length=1, max_length=8)
    qty: int = Field(ge=1, le=99)


class Order(BaseModel):
    items: list[Item] = Field(min_length=1, max_length=3)
    note: Optional[str] = Field(default=None, max_length=10)


class Reading(BaseModel):
    value: float = Field(gt=0, lt=100)
    delta: int = Field(ge=-5, le=5)


class Node(BaseModel):
    # A recursive model that can end at every level (a linked list): a tree with up to two
    # children per node kept nesting at temperature 1 past any token budget.
    value: int = Field(ge=0, le=9)
    next: Optional["Node"] = None


class Circle(BaseModel):
    kind: Literal["circle"]
    radius: int = Field(ge=1, le=9)


class Square(BaseModel):
    kind: Literal["square"]
    side: int = Field(ge=1, le=9)


class Drawing(BaseModel):
    shape: Union[Circle, Square] = Field(discriminator="kind")
    label: str = Field(max_length=8)


class Settings(BaseModel, extra="forbid"):
    verbose: bool
    level: Optional[int] = Field(default=None, ge=0, le=5)
    tags: list[Literal["a", "b"]] = Field(default_factory=list, max_length=2)


MODELS: list[type[BaseModel]] = [Person, Customer, Event, Contact, Paint, Order, Reading, Node,
                                 Drawing, Settings]
SEEDS = (1, 2, 3)
FORMATS = jsonschema.Draft202012Validator.FORMAT_CHECKER


COMPILE_TIMEOUT = 3
# Five repetitions of distinct classes: xgrammar's time grows with the distinct segments, not
# the bound (one `[a-zA-Z0-9 ]{1,400}` takes ~2.1 s, {1,2000} ~2.4 s; these five 10.6 s).
PATHOLOGICAL = ("[a-zA-Z0-9 ]{1,400}[a-zA-Z0-9_]{1,400}[a-z0-9 ]{1,400}[A-Z0-9 ]{1,400}"
                "[a-zA-Z ]{1,400}")


@pytest.fixture(scope="module")
def srv(smollm2_dir: str) -> Any:
    s = ServerProcess([*BASE_ARGS, "--max-total-tokens", "16384",
                       "--constrained-compile-timeout", str(COMPILE_TIMEOUT)]).start()
    yield s
    s.stop()


def _property_order(schema: dict[str, Any], value: Any) -> None:
    """Every object's keys in the order of its schema's `properties` (refs followed)."""
    defs = schema.get("$defs", {})

    def walk(sub: dict[str, Any], v: Any) -> None:
        if "$ref" in sub:
            sub = defs[sub["$ref"].split("/")[-1]]
        for alt in sub.get("anyOf", []) + sub.get("oneOf", []):
            try:
                jsonschema.validate(v, {**alt, "$defs": defs})
            except jsonschema.ValidationError:
                continue
            walk(alt, v)
            return
        if isinstance(v, dict) and "properties" in sub:
            order = list(sub["properties"])
            keys = list(v)
            assert keys == sorted(keys, key=order.index), (keys, order)
            for k, x in v.items():
                walk(sub["properties"][k], x)
        if isinstance(v, list) and isinstance(sub.get("items"), dict):
            for x in v:
                walk(sub["items"], x)

    walk(schema, value)


@pytest.fixture(scope="module")
def llg_srv(smollm2_dir: str) -> Any:
    s = ServerProcess([*BASE_ARGS, "--max-total-tokens", "16384", "--grammar-backend",
                       "llguidance"]).start()
    yield s
    s.stop()


def test_pydantic_schemas_at_temperature_one(srv: ServerProcess) -> None:
    _check_pydantic_schemas(srv, SEEDS)


def test_llguidance_through_the_server(llg_srv: ServerProcess) -> None:
    """The same models (one seed) and the EBNF grammar with --grammar-backend llguidance."""
    _check_pydantic_schemas(llg_srv, SEEDS[:1])
    _check_ebnf(llg_srv, range(3))
    r = requests.post(llg_srv.url + "/generate", timeout=60, json={
        "text": "x", "sampling_params": {"json_schema": {"type": "array", "uniqueItems": True},
                                          "max_new_tokens": 4}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "json_schema", r.text
    assert "uniqueItems" in r.json()["error"]["message"], r.text


def _check_pydantic_schemas(srv: ServerProcess, seeds: Any) -> None:
    cases = [(m, seed) for m in MODELS for seed in seeds]
    # No grammar can bound the depth of the recursive model, and SmolLM2-135M at temperature
    # 1 nests it past any token budget (1, 2, 3, ... for hundreds of levels), prompted with a
    # short example or not. Its requests add a repetition penalty, so that the tenth
    # `{"value":` costs the model something (the grammar still decides what is valid).
    extra = {Node: {"repetition_penalty": 1.5}}
    body = {"text": [f"A {m.__name__} as JSON:" for m, _ in cases],
            "sampling_params": [{"json_schema": m.model_json_schema(), "temperature": 1.0,
                                 "seed": seed, "max_new_tokens": 320, **extra.get(m, {})}
                                for m, seed in cases]}
    results = srv.generate(body, timeout=600)
    for (model, seed), r in zip(cases, results):
        schema = model.model_json_schema()
        text = r["text"]
        assert r["meta_info"]["finish_reason"]["type"] == "stop", (model.__name__, seed, text)
        value = json.loads(text)
        jsonschema.validate(value, schema, format_checker=FORMATS)
        model.model_validate_json(text)
        _property_order(schema, value)


@pytest.mark.parametrize("schema,keyword", [
    ({"type": "integer", "multipleOf": 0.5}, "multipleOf"),
    ({"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, "uniqueItems"),
    ({"type": "string", "format": "idn-email"}, "format"),
    ({"not": {"type": "string"}}, "not"),
    ({"type": "object", "properties": {"a": {"allOf": [{"type": "integer"}]}}}, "allOf"),
    ({"if": {"type": "integer"}, "then": {"minimum": 1}}, "if"),
    ({"type": "string", "contentEncoding": "base64"}, "contentEncoding"),
    ({"type": "string", "format": "email", "maxLength": 24}, "maxLength"),
])
def test_unenforced_keywords_are_400s(srv: ServerProcess, schema: dict[str, Any],
                                      keyword: str) -> None:
    r = requests.post(srv.url + "/generate", timeout=60, json={
        "text": "Hi", "sampling_params": {"json_schema": schema, "max_new_tokens": 4}})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "json_schema" and repr(keyword) in err["message"], err


# A small arithmetic language; the grammar is finite, so every sample ends.
ARITHMETIC = r"""
root ::= expr
expr ::= term | term op term | term op term op term
term ::= num | "(" num op num ")"
op ::= "+" | "-" | "*" | "/"
num ::= [0-9] | [1-9] [0-9]
"""


def _parses(text: str) -> bool:
    """Recursive descent over ARITHMETIC's language."""
    pos = 0

    def peek() -> str:
        return text[pos] if pos < len(text) else ""

    def num() -> bool:
        nonlocal pos
        if not peek().isdigit():
            return False
        first = peek()
        pos += 1
        if first != "0" and peek().isdigit():
            pos += 1
        return True

    def op() -> bool:
        nonlocal pos
        if peek() in ("+", "-", "*", "/") and peek():
            pos += 1
            return True
        return False

    def term() -> bool:
        nonlocal pos
        if peek() == "(":
            pos += 1
            if not (num() and op() and num()) or peek() != ")":
                return False
            pos += 1
            return True
        return num()

    if not term():
        return False
    for _ in range(2):
        if pos == len(text):
            return True
        if not (op() and term()):
            return False
    return pos == len(text)


def test_ebnf_arithmetic(srv: ServerProcess) -> None:
    assert _parses("(1+2)*30-4") and not _parses("1+") and not _parses("01")
    _check_ebnf(srv, range(6))


def _check_ebnf(srv: ServerProcess, seeds: Any) -> None:
    seeds = list(seeds)
    results = srv.generate({"text": ["Compute:"] * len(seeds), "sampling_params": [
        {"ebnf": ARITHMETIC, "temperature": 1.0, "seed": s, "max_new_tokens": 48}
        for s in seeds]})
    for r in results:
        assert r["meta_info"]["finish_reason"]["type"] == "stop", r
        assert _parses(r["text"]), r["text"]


GREEDY = {"text": "The capital of France is",
          "sampling_params": {"temperature": 0, "max_new_tokens": 8, "ignore_eos": True}}

_scalars = st.one_of(st.none(), st.booleans(), st.integers(-10**6, 10**6),
                     st.floats(allow_nan=False, allow_infinity=False), st.text(max_size=6))
_keywords = st.sampled_from(["type", "properties", "items", "enum", "const", "minimum",
                             "maximum", "minLength", "maxLength", "pattern", "anyOf", "$ref",
                             "$defs", "required", "format", "minItems", "maxItems",
                             "additionalProperties", "oneOf", "exclusiveMinimum", "garbage"])
_types = st.sampled_from(["object", "array", "string", "integer", "number", "boolean", "null",
                          "strin", 7])


def _schemas() -> st.SearchStrategy[Any]:
    leaf = st.one_of(
        st.fixed_dictionaries({"type": _types}),
        st.fixed_dictionaries({"enum": st.lists(_scalars, max_size=300)}),
        st.fixed_dictionaries({"type": st.just("integer"), "minimum": st.integers(-5, 5),
                               "maximum": st.integers(-5, 5)}),
        st.just({"$ref": "#/$defs/n"}),
        _scalars,
    )
    return st.recursive(leaf, lambda inner: st.one_of(
        st.dictionaries(_keywords, inner, max_size=4),
        st.fixed_dictionaries({"type": st.just("object"),
                               "properties": st.dictionaries(st.text(max_size=4), inner,
                                                             max_size=3)}),
        st.fixed_dictionaries({"$defs": st.fixed_dictionaries({"n": inner}),
                               "$ref": st.just("#/$defs/n")}),
        st.lists(inner, max_size=3)), max_leaves=12)


_constraints = st.one_of(
    st.builds(lambda s: ("json_schema", s), _schemas()),
    st.builds(lambda t: ("regex", t), st.text(alphabet="ab()[]{}|*+?.^$\\-0123456789,",
                                              min_size=1, max_size=24)),
    st.builds(lambda t: ("ebnf", t), st.one_of(
        st.text(alphabet='root::=ab"|()*+?[]- \n', min_size=1, max_size=40),
        st.builds(lambda a, b: f'root ::= {a}\nx ::= {b}',
                  st.sampled_from(['"a" x', 'x x', '[a-z]+', '"(" root ")"', 'y']),
                  st.sampled_from(['"b"', 'root', '[', '"c"*', ''])))),
)


def test_bad_constraints_never_take_the_server_down(srv: ServerProcess) -> None:
    before = srv.generate(GREEDY)["text"]
    answers: list[int] = []

    @settings(max_examples=40, deadline=None, database=None,
              suppress_health_check=list(HealthCheck))
    @given(_constraints)
    def one(c: tuple[str, Any]) -> None:
        field, value = c
        r = requests.post(srv.url + "/generate", timeout=60, json={
            "text": "x", "sampling_params": {field: value, "max_new_tokens": 4,
                                              "temperature": 1.0}})
        assert r.status_code in (200, 400), r.text
        if r.status_code == 400:
            assert r.json()["error"]["param"] == field, r.text
        answers.append(r.status_code)

    one()
    assert 200 in answers and 400 in answers, answers
    # the compile time bound (the fuzz's compiles are done: each answered before the next)
    t0 = time.monotonic()
    r = requests.post(srv.url + "/generate", timeout=60, json={
        "text": "x", "sampling_params": {"regex": PATHOLOGICAL, "max_new_tokens": 4}})
    assert r.status_code == 400 and "took longer" in r.json()["error"]["message"], r.text
    assert time.monotonic() - t0 < COMPILE_TIMEOUT + 2
    assert srv.generate(GREEDY)["text"] == before


@pytest.mark.parametrize("backend", ["llguidance", "outlines"])
def test_compile_fuzz_in_process(backend: str, smollm2_tokenizer: Any) -> None:
    """The other backends compile the same fuzz without crashing: a grammar or a GrammarError
    (a ValueError), nothing else."""
    from srt.constrained.grammar import ConstraintSpec
    from srt.constrained.registry import create_grammar_backend
    from srt.sampling_params import SamplingParamError, SamplingParams

    be = create_grammar_backend(backend, smollm2_tokenizer, smollm2_tokenizer.eos_token_id,
                                len(smollm2_tokenizer), 8)
    outcomes: list[str] = []

    @settings(max_examples=25 if backend == "outlines" else 40, deadline=None, database=None,
              suppress_health_check=list(HealthCheck))
    # a null value (e.g. "json_schema": null) means no constraint, which this test is not about
    @given(_constraints.filter(lambda c: c[1] is not None))
    def one(c: tuple[str, Any]) -> None:
        field, value = c
        try:
            spec = SamplingParams.from_dict({field: value}).constraint
        except SamplingParamError:
            return
        assert spec is not None
        try:
            grammar = be.compile(spec).result(timeout=30)
        except ValueError:
            outcomes.append("refused")
            return
        m = grammar.matcher()
        m.forced_bytes()
        outcomes.append("compiled")

    one()
    assert "refused" in outcomes, outcomes
    if backend == "outlines":
        with pytest.raises(ValueError, match="ebnf needs"):
            be.compile(ConstraintSpec("ebnf", ARITHMETIC)).result()
