"""The OpenAI-compatible API through the official `openai` client, against the real server;
contents are checked against the native /generate answers for the same prompts."""

from __future__ import annotations

import json
from typing import Any

import openai
import pytest
import requests

PROMPT = "The capital of France is"
MESSAGES = [{"role": "system", "content": "You are terse."},
            {"role": "user", "content": "Name a fruit."}]


@pytest.fixture(scope="module")
def client(server: Any) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def _native_text(server: Any, body: dict[str, Any]) -> dict[str, Any]:
    return server.generate(body)


def test_models_lists_the_served_model(client: openai.OpenAI, server: Any) -> None:
    ids = [m.id for m in client.models.list().data]
    assert ids == [server.server_info()["served_model_name"]]


def test_completion_equals_native(client: openai.OpenAI, server: Any) -> None:
    native = _native_text(server, {"text": PROMPT, "sampling_params": {
        "temperature": 0, "max_new_tokens": 12}})
    r = client.completions.create(model="default", prompt=PROMPT, max_tokens=12, temperature=0)
    assert r.choices[0].text == native["text"]
    assert r.choices[0].finish_reason == "length"
    assert r.usage.prompt_tokens == native["meta_info"]["prompt_tokens"]
    assert r.usage.completion_tokens == 12 and r.usage.total_tokens == r.usage.prompt_tokens + 12


def test_completion_stream_equals_non_stream(client: openai.OpenAI) -> None:
    full = client.completions.create(model="default", prompt=PROMPT, max_tokens=12,
                                     temperature=0)
    chunks = list(client.completions.create(model="default", prompt=PROMPT, max_tokens=12,
                                            temperature=0, stream=True,
                                            stream_options={"include_usage": True}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == full.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 12


def test_completion_n2_stop_echo_and_token_prompts(client: openai.OpenAI,
                                                   smollm2_tokenizer: Any) -> None:
    r = client.completions.create(model="default", prompt=PROMPT, max_tokens=8, n=2,
                                  temperature=0.8, seed=3)
    assert [c.index for c in r.choices] == [0, 1]
    greedy = client.completions.create(model="default", prompt=PROMPT, max_tokens=12,
                                       temperature=0).choices[0].text
    word = greedy.split()[1]
    stopped = client.completions.create(model="default", prompt=PROMPT, max_tokens=12,
                                        temperature=0, stop=[word])
    assert stopped.choices[0].finish_reason == "stop"
    assert stopped.choices[0].text == greedy[: greedy.index(word)]
    echoed = client.completions.create(model="default", prompt=PROMPT, max_tokens=12,
                                       temperature=0, echo=True)
    assert echoed.choices[0].text == PROMPT + greedy
    ids = smollm2_tokenizer.encode(PROMPT)
    by_ids = client.completions.create(model="default", prompt=ids, max_tokens=12,
                                       temperature=0)
    assert by_ids.choices[0].text == greedy


def test_chat_equals_native_with_template(client: openai.OpenAI, server: Any,
                                          smollm2_tokenizer: Any) -> None:
    ids = smollm2_tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True)
    ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    native = _native_text(server, {"input_ids": ids, "sampling_params": {
        "temperature": 0, "max_new_tokens": 24}})
    r = client.chat.completions.create(model="default", messages=MESSAGES, max_tokens=24,
                                       temperature=0)
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == native["text"]
    assert r.usage.prompt_tokens == len(ids)
    parts = [{"role": m["role"], "content": [{"type": "text", "text": m["content"]}]}
             for m in MESSAGES]
    r2 = client.chat.completions.create(model="default", messages=parts,
                                        max_completion_tokens=24, temperature=0)
    assert r2.choices[0].message.content == native["text"]


def test_chat_stream(client: openai.OpenAI) -> None:
    full = client.chat.completions.create(model="default", messages=MESSAGES, max_tokens=24,
                                          temperature=0)
    chunks = list(client.chat.completions.create(
        model="default", messages=MESSAGES, max_tokens=24, temperature=0, stream=True,
        stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == full.choices[0].finish_reason and finishes[:-1] == [None] * (
        len(finishes) - 1)
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens


def _native_logprobs(server: Any, body: dict[str, Any], k: int) -> dict[str, Any]:
    return server.generate({**body, "return_logprob": True, "top_logprobs_num": k,
                            "return_text_in_logprobs": True})


def _assert_same_entries(tokens: list[str], values: list[Any], native: list[list[Any]]) -> None:
    assert tokens == [t[2] for t in native]
    assert len(values) == len(native)
    for v, t in zip(values, native):
        assert (v is None) == (t[0] is None)
        if v is not None:
            assert v == pytest.approx(t[0], abs=1e-4)


def test_completion_logprobs_equal_native(client: openai.OpenAI, server: Any) -> None:
    native = _native_logprobs(server, {"text": PROMPT, "logprob_start_len": 0, "sampling_params":
                                       {"temperature": 0, "max_new_tokens": 6}}, 3)
    meta = native["meta_info"]
    r = client.completions.create(model="default", prompt=PROMPT, max_tokens=6, temperature=0,
                                  logprobs=3)
    lp = r.choices[0].logprobs
    assert r.choices[0].text == native["text"]
    _assert_same_entries(lp.tokens, lp.token_logprobs, meta["output_token_logprobs"])
    for top, want in zip(lp.top_logprobs, meta["output_top_logprobs"]):
        assert set(top) == {t[2] for t in want}
        for value, _, text in want:
            assert top[text] == pytest.approx(value, abs=1e-4)
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
    # echo: the prompt's tokens first, the first one without a logprob
    e = client.completions.create(model="default", prompt=PROMPT, max_tokens=6, temperature=0,
                                  logprobs=1, echo=True)
    elp = e.choices[0].logprobs
    assert e.choices[0].text == PROMPT + native["text"]
    _assert_same_entries(elp.tokens, elp.token_logprobs,
                         meta["input_token_logprobs"] + meta["output_token_logprobs"])
    assert elp.token_logprobs[0] is None and elp.top_logprobs[0] is None
    assert all(len(t) == 1 for t in elp.top_logprobs[1:])
    assert "".join(elp.tokens) == e.choices[0].text
    assert elp.text_offset[len(meta["input_token_logprobs"])] == len(PROMPT)
    # logprobs=0: the chosen tokens only
    z = client.completions.create(model="default", prompt=PROMPT, max_tokens=3, temperature=0,
                                  logprobs=0)
    assert z.choices[0].logprobs.top_logprobs == [{}, {}, {}]
    assert len(z.choices[0].logprobs.token_logprobs) == 3


def test_completion_stream_logprobs_equal_non_stream(client: openai.OpenAI) -> None:
    args = {"model": "default", "prompt": PROMPT, "max_tokens": 8, "temperature": 0,
            "logprobs": 2, "echo": True}
    full = client.completions.create(**args).choices[0]
    chunks = [c.choices[0] for c in client.completions.create(**args, stream=True) if c.choices]
    assert "".join(c.text for c in chunks) == full.text
    tokens, values, offsets = [], [], []
    for c in chunks:
        if c.logprobs is not None:
            assert len(c.logprobs.tokens) >= 1
            tokens += c.logprobs.tokens
            values += c.logprobs.token_logprobs
            offsets += c.logprobs.text_offset
    assert tokens == full.logprobs.tokens
    assert offsets == full.logprobs.text_offset
    assert values[0] is None and full.logprobs.token_logprobs[0] is None
    assert values[1:] == pytest.approx(full.logprobs.token_logprobs[1:], abs=1e-4)
    assert chunks[-1].finish_reason == "length"


def test_completion_n2_logprobs(client: openai.OpenAI) -> None:
    r = client.completions.create(model="default", prompt=PROMPT, max_tokens=5, n=2,
                                  temperature=0.9, seed=11, logprobs=2, stop=["\n"])
    total = 0
    for choice in r.choices:
        lp = choice.logprobs
        assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) >= 1
        assert all(v is not None and v <= 0 for v in lp.token_logprobs)
        total += len(lp.tokens)
    assert total == r.usage.completion_tokens


def test_chat_logprobs_equal_native_stream_and_not(client: openai.OpenAI, server: Any,
                                                   smollm2_tokenizer: Any) -> None:
    ids = smollm2_tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True)
    ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    native = _native_logprobs(server, {"input_ids": ids, "sampling_params":
                                       {"temperature": 0, "max_new_tokens": 10}}, 2)
    meta = native["meta_info"]
    args = {"model": "default", "messages": MESSAGES, "max_tokens": 10, "temperature": 0,
            "logprobs": True, "top_logprobs": 2}
    r = client.chat.completions.create(**args)
    assert r.choices[0].message.content == native["text"]
    content = r.choices[0].logprobs.content
    _assert_same_entries([c.token for c in content], [c.logprob for c in content],
                         meta["output_token_logprobs"])
    for c, (_, token_id, text), top in zip(content, meta["output_token_logprobs"],
                                           meta["output_top_logprobs"]):
        assert bytes(c.bytes) == smollm2_tokenizer.convert_tokens_to_string(
            [smollm2_tokenizer.convert_ids_to_tokens(token_id)]).encode()
        assert [t.token for t in c.top_logprobs] == [t[2] for t in top]
        assert [t.logprob for t in c.top_logprobs] == pytest.approx([t[0] for t in top],
                                                                    abs=1e-4)
    streamed = []
    for chunk in client.chat.completions.create(**args, stream=True):
        if chunk.choices and chunk.choices[0].logprobs is not None:
            streamed += chunk.choices[0].logprobs.content
    assert [c.token for c in streamed] == [c.token for c in content]
    assert [c.logprob for c in streamed] == pytest.approx([c.logprob for c in content], abs=1e-4)
    plain = client.chat.completions.create(**{**args, "logprobs": None, "top_logprobs": None})
    assert plain.choices[0].logprobs is None


def test_chat_logprobs_bytes_of_partial_characters(client: openai.OpenAI) -> None:
    """A character split over tokens: each token's bytes are its own, and they join up."""
    r = client.chat.completions.create(
        model="default", max_tokens=12, temperature=0, logprobs=True,
        messages=[{"role": "user", "content": "Reply with exactly this emoji and nothing else: 😀"}])
    content = r.choices[0].logprobs.content
    # the model answers with emoji that SmolLM2 spells in 2-3 byte-level tokens each
    assert any(c.token == "\ufffd" and bytes(c.bytes) != c.token.encode() for c in content)
    joined = b"".join(bytes(c.bytes) for c in content)
    assert joined.decode("utf-8", errors="replace") == r.choices[0].message.content


def test_stream_aborted_midway_ends_with_one_error_event(client: openai.OpenAI,
                                                         server: Any) -> None:
    stream = client.completions.create(model="default", prompt="Count to one thousand:",
                                       max_tokens=500, temperature=0, stream=True,
                                       extra_body={"rid": "openai-abort", "ignore_eos": True})
    chunks = iter(stream)
    assert next(chunks).choices and next(chunks).choices  # it is running
    r = requests.post(server.url + "/abort_request", json={"rid": "openai-abort"}, timeout=30)
    assert r.status_code == 200 and r.json() == {"aborted": 1}
    with pytest.raises(openai.APIError) as info:
        for _ in chunks:
            pass
    assert info.value.body["code"] == "request_aborted"
    assert set(info.value.body) == {"message", "type", "param", "code"}
    r = requests.post(server.url + "/abort_request", json={"rid": "openai-abort"}, timeout=30)
    assert r.status_code == 404 and r.json()["error"]["code"] == "rid_not_found"
    r = requests.post(server.url + "/abort_request", json={"rid": 3}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "rid"


def test_native_stream_aborted_midway_reports_the_abort(server: Any) -> None:
    body = {"text": "Count to one thousand:", "rid": "native-abort", "stream": True,
            "sampling_params": {"temperature": 0, "max_new_tokens": 500, "ignore_eos": True}}
    events = []
    with requests.post(server.url + "/generate", json=body, stream=True, timeout=120) as resp:
        for line in resp.iter_lines():
            if not line:
                continue
            events.append(line)
            if len(events) == 2:
                requests.post(server.url + "/abort_request", json={"rid": "native-abort"},
                              timeout=30)
    assert events[-1] == b"data: [DONE]"
    last = json.loads(events[-2][len(b"data: "):])
    assert last["meta_info"]["finish_reason"]["type"] == "abort"
    assert last["meta_info"]["completion_tokens"] < 500


LONG_PROMPT = "hello " * 9000  # about 9000 tokens: more than the 8192 of the context


@pytest.mark.parametrize("kwargs,exc,status,code,param", [
    ({"model": "no-such-model"}, openai.NotFoundError, 404, "model_not_found", "model"),
    ({"max_tokens": -1}, openai.BadRequestError, 400, "invalid_value", "max_tokens"),
    ({"max_tokens": "10"}, openai.BadRequestError, 400, "invalid_value", "max_tokens"),
    ({"temperature": -0.5}, openai.BadRequestError, 400, "invalid_value", "temperature"),
    ({"temperature": "hot"}, openai.BadRequestError, 400, "invalid_value", "temperature"),
    ({"top_p": 1.5}, openai.BadRequestError, 400, "invalid_value", "top_p"),
    ({"top_p": 0}, openai.BadRequestError, 400, "invalid_value", "top_p"),
    ({"n": 0}, openai.BadRequestError, 400, "invalid_value", "n"),
    ({"n": 129}, openai.BadRequestError, 400, "limit_exceeded", "n"),  # --max-n
    ({"n": 2.0}, openai.BadRequestError, 400, "invalid_value", "n"),
    ({"stop": 5}, openai.BadRequestError, 400, "invalid_value", "stop"),
    ({"presence_penalty": 3}, openai.BadRequestError, 400, "invalid_value", "presence_penalty"),
    ({"frequency_penalty": -3}, openai.BadRequestError, 400, "invalid_value",
     "frequency_penalty"),
    ({"seed": "abc"}, openai.BadRequestError, 400, "invalid_value", "seed"),
    ({"extra_body": {"top_k": 0}}, openai.BadRequestError, 400, "invalid_value", "top_k"),
    ({"extra_body": {"min_tokens": 5}}, openai.BadRequestError, 400, "invalid_value",
     "min_tokens"),
    ({"max_tokens": 9000}, openai.BadRequestError, 400, "context_length_exceeded",
     "max_tokens"),
    ({"prompt": LONG_PROMPT}, openai.BadRequestError, 400, "context_length_exceeded", "prompt"),
    ({"prompt": ""}, openai.BadRequestError, 400, "invalid_value", "prompt"),
    ({"prompt": []}, openai.BadRequestError, 400, "invalid_type", "prompt"),
    ({"prompt": [[1, 2], []]}, openai.BadRequestError, 400, "invalid_value", "prompt"),
    ({"prompt": [1, 49152]}, openai.BadRequestError, 400, "invalid_value", "prompt"),
    ({"prompt": 5}, openai.BadRequestError, 400, "invalid_type", "prompt"),
    ({"echo": "yes"}, openai.BadRequestError, 400, "invalid_type", "echo"),
    ({"logprobs": 21}, openai.BadRequestError, 400, "limit_exceeded", "logprobs"),
    ({"logprobs": -1}, openai.BadRequestError, 400, "invalid_value", "logprobs"),
    ({"logprobs": True}, openai.BadRequestError, 400, "invalid_type", "logprobs"),
    ({"logprobs": "2"}, openai.BadRequestError, 400, "invalid_type", "logprobs"),
    ({"suffix": "x"}, openai.BadRequestError, 400, "unsupported", "suffix"),
    ({"best_of": 3}, openai.BadRequestError, 400, "unsupported", "best_of"),
    ({"best_of": 1, "n": 2}, openai.BadRequestError, 400, "invalid_value", "best_of"),
    ({"best_of": "2"}, openai.BadRequestError, 400, "invalid_type", "best_of"),
    ({"logit_bias": {"5": 1}}, openai.BadRequestError, 400, "unsupported", "logit_bias"),
    ({"extra_body": {"foo": 1}}, openai.BadRequestError, 400, "unknown_field", "foo"),
    ({"extra_body": {"rid": 5}}, openai.BadRequestError, 400, "invalid_type", "rid"),
])
def test_completion_errors(client: openai.OpenAI, kwargs: dict[str, Any], exc: type,
                           status: int, code: str, param: str) -> None:
    args = {"model": "default", "prompt": PROMPT, "max_tokens": 4, **kwargs}
    with pytest.raises(exc) as info:
        client.completions.create(**args)
    _assert_error(info.value, status, code, param)


def _assert_error(e: openai.APIStatusError, status: int, code: str, param: str) -> None:
    assert e.status_code == status
    assert set(e.body) == {"message", "type", "param", "code"}, e.body
    assert e.body["code"] == code and e.body["param"] == param, e.body
    assert e.body["type"] == "invalid_request_error" and e.body["message"]


@pytest.mark.parametrize("kwargs,exc,status,code,param", [
    ({"model": "no-such-model"}, openai.NotFoundError, 404, "model_not_found", "model"),
    ({"messages": []}, openai.BadRequestError, 400, "invalid_type", "messages"),
    ({"messages": "hi"}, openai.BadRequestError, 400, "invalid_type", "messages"),
    ({"messages": [{"role": "wizard", "content": "hi"}]}, openai.BadRequestError, 400,
     "invalid_value", "messages"),
    ({"messages": [{"content": "hi"}]}, openai.BadRequestError, 400, "invalid_value",
     "messages"),
    ({"messages": [{"role": "user", "content": 5}]}, openai.BadRequestError, 400,
     "invalid_type", "messages"),
    ({"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]},
     openai.BadRequestError, 400, "unsupported", "messages"),
    ({"messages": [{"role": "user", "content": LONG_PROMPT}], "max_tokens": None},
     openai.BadRequestError, 400, "context_length_exceeded", "messages"),
    ({"max_tokens": 9000}, openai.BadRequestError, 400, "context_length_exceeded",
     "max_tokens"),
    ({"max_tokens": -1}, openai.BadRequestError, 400, "invalid_value", "max_tokens"),
    ({"max_completion_tokens": -1, "max_tokens": None}, openai.BadRequestError, 400,
     "invalid_value", "max_completion_tokens"),
    ({"temperature": -1}, openai.BadRequestError, 400, "invalid_value", "temperature"),
    ({"top_p": 2}, openai.BadRequestError, 400, "invalid_value", "top_p"),
    ({"n": 0}, openai.BadRequestError, 400, "invalid_value", "n"),
    ({"logprobs": "yes"}, openai.BadRequestError, 400, "invalid_type", "logprobs"),
    ({"logprobs": True, "top_logprobs": 21}, openai.BadRequestError, 400, "limit_exceeded",
     "top_logprobs"),
    ({"logprobs": True, "top_logprobs": -1}, openai.BadRequestError, 400, "invalid_value",
     "top_logprobs"),
    ({"logprobs": True, "top_logprobs": 1.5}, openai.BadRequestError, 400, "invalid_type",
     "top_logprobs"),
    ({"top_logprobs": 2}, openai.BadRequestError, 400, "invalid_value", "top_logprobs"),
    ({"logprobs": False, "top_logprobs": 2}, openai.BadRequestError, 400, "invalid_value",
     "top_logprobs"),
    ({"tools": "f"}, openai.BadRequestError, 400, "invalid_type", "tools"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}],
      "tool_choice": {"type": "function", "function": {"name": "g"}}},
     openai.BadRequestError, 400, "invalid_value", "tool_choice"),
    ({"tool_choice": "required"}, openai.BadRequestError, 400, "invalid_value", "tool_choice"),
    ({"response_format": {"type": "xml"}}, openai.BadRequestError, 400, "unsupported",
     "response_format"),
    ({"stream_options": "x"}, openai.BadRequestError, 400, "invalid_type", "stream_options"),
])
def test_chat_errors(client: openai.OpenAI, kwargs: dict[str, Any], exc: type, status: int,
                     code: str, param: str) -> None:
    args = {"model": "default", "messages": MESSAGES, "max_tokens": 4, **kwargs}
    args = {k: v for k, v in args.items() if v is not None}
    with pytest.raises(exc) as info:
        client.chat.completions.create(**args)
    _assert_error(info.value, status, code, param)
