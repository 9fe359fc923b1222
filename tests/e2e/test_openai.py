"""The OpenAI-compatible API through the official `openai` client, against the real server;
contents are checked against the native /generate answers for the same prompts."""

from __future__ import annotations

from typing import Any

import openai
import pytest

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


@pytest.mark.parametrize("kwargs,exc,status,code,param", [
    ({"model": "no-such-model"}, openai.NotFoundError, 404, "model_not_found", "model"),
    ({"max_tokens": -1}, openai.BadRequestError, 400, "invalid_value", "max_tokens"),
    ({"temperature": -0.5}, openai.BadRequestError, 400, "invalid_value", "temperature"),
    ({"top_p": 1.5}, openai.BadRequestError, 400, "invalid_value", "top_p"),
    ({"n": 0}, openai.BadRequestError, 400, "invalid_value", "n"),
    ({"max_tokens": 9000}, openai.BadRequestError, 400, "context_length_exceeded",
     "max_tokens"),
    ({"suffix": "x"}, openai.BadRequestError, 400, "unsupported", "suffix"),
    ({"best_of": 3}, openai.BadRequestError, 400, "unsupported", "best_of"),
    ({"logprobs": 2}, openai.BadRequestError, 400, "unsupported", "logprobs"),
])
def test_completion_errors(client: openai.OpenAI, kwargs: dict[str, Any], exc: type,
                           status: int, code: str, param: str) -> None:
    args = {"model": "default", "prompt": PROMPT, "max_tokens": 4, **kwargs}
    with pytest.raises(exc) as info:
        client.completions.create(**args)
    assert info.value.status_code == status
    assert info.value.body["code"] == code and info.value.body["param"] == param


@pytest.mark.parametrize("kwargs,param", [
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "wizard", "content": "hi"}]}, "messages"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}]}, "tools"),
])
def test_chat_errors(client: openai.OpenAI, kwargs: dict[str, Any], param: str) -> None:
    args = {"model": "default", "messages": MESSAGES, "max_tokens": 4, **kwargs}
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(**args)
    assert info.value.status_code == 400 and info.value.body["param"] == param
