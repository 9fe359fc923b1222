"""SGLang's API over HTTP on a real server: the field policy of every surface, stop_regex,
SGLang's route names, the JSON key order of json_schema output, and requests of one fill round
sharing an uncomputed prefix. SGLang's own clients against srt: test_sglang_clients.py."""

from __future__ import annotations

import json
import uuid
from typing import Any

import openai
import pytest
import regex
import requests

from srt import field_policy
from srt.field_policy import NoOp, Surface, is_noop

GREEDY = {"max_new_tokens": 1, "temperature": 0}
BASES: dict[str, tuple[str, dict[str, Any]]] = {
    "generate": ("/generate", {"text": "Hi", "sampling_params": GREEDY}),
    "completion": ("/v1/completions", {"model": "default", "prompt": "Hi", "max_tokens": 1}),
    "chat": ("/v1/chat/completions", {"model": "default", "max_tokens": 1,
                                      "messages": [{"role": "user", "content": "Hi"}]}),
    "tokenize": ("/tokenize", {"prompt": "Hi"}),
    "detokenize": ("/detokenize", {"tokens": [19556]}),
}
SURFACES = {"generate": field_policy.GENERATE, "completion": field_policy.COMPLETION,
            "chat": field_policy.CHAT, "tokenize": field_policy.TOKENIZE,
            "detokenize": field_policy.DETOKENIZE}


def active_value(rule: NoOp) -> Any:
    """A value at which an unimplemented field would do something."""
    return next(v for v in (True, 7, "x", {"k": 1}) if not is_noop(v, rule))


def _post(url: str, path: str, body: dict[str, Any]) -> requests.Response:
    return requests.post(url + path, json=body, timeout=300)


def _error(r: requests.Response) -> dict[str, Any]:
    assert r.status_code == 400, (r.status_code, r.text)
    return r.json()["error"]


def _with(base: dict[str, Any], where: str, extra: dict[str, Any]) -> dict[str, Any]:
    body = json.loads(json.dumps(base))
    target = body["sampling_params"] if where == "sampling" else body
    target.update(extra)
    return body


CASES = [(name, *BASES[name], SURFACES[name]) for name in SURFACES] + [
    ("sampling", *BASES["generate"], field_policy.SAMPLING)]


@pytest.mark.parametrize("where,path,base,surface", CASES, ids=[c[0] for c in CASES])
def test_field_policy(server: Any, where: str, path: str, base: dict[str, Any],
                      surface: Surface) -> None:
    url = server.url
    # every unimplemented field at its no-op values, one by one and all at once (as SGLang's
    # gateway sends them)
    for name, rule in sorted(surface.unsupported.items()):
        for value in dict.fromkeys([rule.default, None, *rule.also], None):
            r = _post(url, path, _with(base, where, {name: value}))
            assert r.status_code == 200, (name, value, r.text)
    everything = {name: rule.default for name, rule in surface.unsupported.items()}
    assert _post(url, path, _with(base, where, everything)).status_code == 200
    # at a value that would do something: 400 unsupported, naming the field
    for name, rule in sorted(surface.unsupported.items()):
        err = _error(_post(url, path, _with(base, where, {name: active_value(rule)})))
        assert (err["code"], err["param"]) == ("unsupported", name), err
    # a name in neither list: 400 unknown_field (a typo still fails loudly)
    err = _error(_post(url, path, _with(base, where, {"max_new_tokenz": 3})))
    assert (err["code"], err["param"]) == ("unknown_field", "max_new_tokenz"), err


# ------------------------------------------------------------------ stop_regex

PROMPT = "Count with me: 1, 2, 3,"


@pytest.fixture(scope="module")
def reference(server: Any) -> dict[str, Any]:
    """The greedy continuation without any stop."""
    return server.generate({"text": PROMPT, "sampling_params": {
        "max_new_tokens": 24, "temperature": 0, "ignore_eos": True}})


def _stop_regex(server: Any, stop_regex: Any, **extra: Any) -> dict[str, Any]:
    return server.generate({"text": PROMPT, "sampling_params": {
        "max_new_tokens": 24, "temperature": 0, "ignore_eos": True, "stop_regex": stop_regex,
        **extra}})


@pytest.mark.parametrize("stop_regex", [r"\b[5-9],", [r"7|8", r"\d, \d,"]])
def test_stop_regex(server: Any, reference: dict[str, Any], stop_regex: Any) -> None:
    ref = reference["text"]
    patterns = [stop_regex] if isinstance(stop_regex, str) else stop_regex
    starts = {p: m.start() for p in patterns if (m := regex.search(p, ref))}
    assert starts, ref  # the reference text has a match to stop at
    first = min(starts.values())
    out = _stop_regex(server, stop_regex)
    assert out["text"] == ref[:first], (ref, out["text"])
    reason = out["meta_info"]["finish_reason"]
    assert reason["type"] == "stop" and reason["matched"] in patterns
    assert starts[reason["matched"]] == first
    assert out["meta_info"]["completion_tokens"] < reference["meta_info"]["completion_tokens"]
    assert out["output_ids"] == reference["output_ids"][:len(out["output_ids"])]


def test_stop_regex_no_stop_trim(server: Any, reference: dict[str, Any]) -> None:
    ref, pattern = reference["text"], r"\b[5-9],"
    m = regex.search(pattern, ref)
    out = _stop_regex(server, pattern, no_stop_trim=True)
    # the text runs to the end of the token that completed the match
    assert out["text"].startswith(ref[:m.end()]) and ref.startswith(out["text"]), out["text"]
    assert regex.search(pattern, out["text"]).start() == m.start()


def test_stop_regex_streamed(server: Any, reference: dict[str, Any]) -> None:
    pattern = r"\b[5-9],"
    whole = _stop_regex(server, pattern)
    body = {"text": PROMPT, "stream": True, "sampling_params": {
        "max_new_tokens": 24, "temperature": 0, "ignore_eos": True, "stop_regex": [pattern]}}
    texts = []
    with requests.post(server.url + "/generate", json=body, stream=True, timeout=300) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith(b"data: ") and line != b"data: [DONE]":
                texts.append(json.loads(line[6:])["text"])
    assert texts[-1] == whole["text"]
    for a, b in zip(texts, texts[1:]):
        assert b.startswith(a), texts  # nothing shown is taken back
    assert not any(regex.search(r"\b[5-9]", t[len(whole["text"]):]) for t in texts)


def test_stop_regex_openai(server: Any) -> None:
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none")
    out = client.completions.create(model="default", prompt=PROMPT, max_tokens=24,
                                    temperature=0, extra_body={"stop_regex": r"\b[5-9],",
                                                               "ignore_eos": True})
    assert out.choices[0].text == _stop_regex(server, r"\b[5-9],")["text"]
    assert out.choices[0].finish_reason == "stop"
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="default", prompt=PROMPT, max_tokens=2,
                                  extra_body={"stop_regex": "("})
    assert e.value.body["param"] == "stop_regex"


# ------------------------------------------------------------------ routes

def test_sglang_route_names(server: Any) -> None:
    url = server.url
    assert requests.get(url + "/model_info", timeout=30).json() == \
        requests.get(url + "/get_model_info", timeout=30).json()
    a = requests.get(url + "/server_info", timeout=30).json()
    b = requests.get(url + "/get_server_info", timeout=30).json()
    assert set(a) == set(b) and a["model_path"] == b["model_path"]
    models = requests.get(url + "/v1/models", timeout=30).json()["data"]
    card = requests.get(url + "/v1/models/" + models[0]["id"], timeout=30)
    assert card.status_code == 200 and card.json()["id"] == models[0]["id"]
    assert card.json()["max_model_len"] > 0
    missing = requests.get(url + "/v1/models/no-such-model", timeout=30)
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"


def _template_ids(tok: Any, messages: list[dict[str, str]], generation_prompt: bool) -> list[int]:
    ids = tok.apply_chat_template(messages, add_generation_prompt=generation_prompt)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def test_tokenize_and_detokenize(server: Any, smollm2_tokenizer: Any) -> None:
    url, tok = server.url, smollm2_tokenizer
    one = _post(url, "/tokenize", {"prompt": "Hello world"}).json()
    assert one["tokens"] == tok.encode("Hello world") and one["count"] == len(one["tokens"])
    assert one["max_model_len"] == 8192
    two = _post(url, "/tokenize", {"prompt": ["a b", "Hello"]}).json()
    assert two["tokens"] == [tok.encode("a b"), tok.encode("Hello")] and two["count"] == [2, 1]
    messages = [{"role": "user", "content": "Hi"}]
    chat = _post(url, "/tokenize", {"messages": messages}).json()["tokens"]
    assert chat == _template_ids(tok, messages, True)
    bare = _post(url, "/tokenize", {"messages": messages,
                                    "add_generation_prompt": False}).json()["tokens"]
    assert bare == _template_ids(tok, messages, False) != chat
    assert _post(url, "/detokenize", {"tokens": one["tokens"]}).json() == {"text": "Hello world"}
    assert _post(url, "/detokenize", {"tokens": two["tokens"]}).json() == {
        "text": ["a b", "Hello"]}
    special = tok.encode("<|im_start|>x")
    assert _post(url, "/detokenize", {"tokens": special, "skip_special_tokens": False}).json() \
        == {"text": "<|im_start|>x"}
    for path, body, param in [("/tokenize", {}, "prompt"),
                              ("/tokenize", {"prompt": 5}, "prompt"),
                              ("/detokenize", {"tokens": [10**9]}, "tokens"),
                              ("/detokenize", {"tokens": "x"}, "tokens")]:
        assert _error(_post(url, path, body))["param"] == param


def test_generate_takes_model(server: Any) -> None:
    name = requests.get(server.url + "/v1/models", timeout=30).json()["data"][0]["id"]
    for model in (None, "default", name):
        body = {"text": "Hi", "model": model, "sampling_params": GREEDY}
        assert _post(server.url, "/generate", body).status_code == 200
    r = _post(server.url, "/generate", {"text": "Hi", "model": "other", "sampling_params": GREEDY})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"


# ------------------------------------------------------------------ json_schema key order

# Bounded types only (a greedy small model may write digits forever).
SHORT = {"type": "string", "maxLength": 6}
SCHEMAS = [
    {"type": "object", "properties": {"zeta": {"type": "boolean"},
                                      "alpha": {"type": "string", "maxLength": 8}},
     "required": ["zeta", "alpha"]},
    {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 8},
        "address": {"type": "object", "properties": {
            "street": {"type": "string", "maxLength": 8}, "city": {"type": "string",
                                                               "maxLength": 8}},
                    "required": ["street", "city"]},
        "age": {"enum": [1, 2, 3]}},
     "required": ["name", "address", "age"]},
    {"type": "object", "properties": {
        "ok": {"type": "boolean"},
        "items": {"type": "array", "maxItems": 2, "items": {
            "type": "object", "properties": {"y": SHORT, "x": {"type": "boolean"}},
            "required": ["y", "x"]}},
        "b": SHORT},
     "required": ["ok", "items", "b"]},
]


def _key_orders(value: Any, schema: dict[str, Any]) -> list[tuple[list[str], list[str]]]:
    """(keys in the output, properties in the schema) for every object, recursively."""
    if schema.get("type") == "object":
        pairs = [(list(value), list(schema["properties"]))]
        for k, sub in schema["properties"].items():
            pairs += _key_orders(value[k], sub)
        return pairs
    if schema.get("type") == "array":
        return [p for v in value for p in _key_orders(v, schema["items"])]
    return []


def test_json_schema_keeps_key_order(server: Any) -> None:
    import jsonschema

    out = server.generate({"text": ["A record as JSON:"] * len(SCHEMAS), "sampling_params": [
        {"max_new_tokens": 120, "temperature": 0, "json_schema": s} for s in SCHEMAS]})
    for schema, o in zip(SCHEMAS, out):
        value = json.loads(o["text"])
        jsonschema.validate(value, schema)
        for got, want in _key_orders(value, schema):
            assert got == want, (o["text"], schema)


# ------------------------------------------------------------------ in-round prefix sharing

def _common_len(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def test_one_round_computes_a_shared_prefix_once(server: Any) -> None:
    """Prompts of one /generate batch arrive in one fill round: the ones that share an
    uncomputed prefix with an earlier one wait a round and find it in the cache; their answers
    are those they give alone."""
    prefix = f"Context {uuid.uuid4().hex}: " + "the river runs past the old mill. " * 24
    texts = [prefix + f"Question {i}: where does the river run?" for i in range(3)]
    ids = [_post(server.url, "/tokenize", {"prompt": t}).json()["tokens"] for t in texts]
    shared = _common_len(ids[0], ids[1])
    assert shared >= 200
    params = {"max_new_tokens": 4, "temperature": 0}
    out = server.generate({"text": texts, "sampling_params": params})
    cached = sorted(o["meta_info"]["cached_tokens"] for o in out)
    assert cached[0] < 32, cached  # one of them computed the prefix ...
    assert cached[1] >= shared and cached[2] >= shared, (cached, shared)  # ... once
    assert requests.post(server.url + "/flush_cache", timeout=60).status_code == 200
    alone = [server.generate({"text": t, "sampling_params": params})["text"] for t in texts]
    assert [o["text"] for o in out] == alone


def test_chat_null_max_completion_tokens_falls_back_to_max_tokens(server: Any) -> None:
    body = {"model": "default", "messages": [{"role": "user", "content": "Tell me a story."}],
            "max_completion_tokens": None, "max_tokens": 3, "temperature": 0, "ignore_eos": True}
    r = _post(server.url, "/v1/chat/completions", body)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 3
