"""Tool calling and reasoning separation on /v1/chat/completions, through the official clients
(openai, langchain-openai, litellm) against one real server (`--reasoning-parser qwen3`, the
default `--tool-call-parser hermes`, the default model with the built-in chatml-tools template).

`required` and a named function are enforced by a JSON-schema constraint, so their shape is
certain; `auto` is checked on what the model really says (without a call: content only), and,
to drive the parser through the server, on output a `regex` constraint makes the model write in
the template's call format. Every answer is compared with the native /generate answer for the
same prompt ids, which the tests render with the same template.
"""

from __future__ import annotations

import json
import os
from typing import Any, Literal

import jsonschema
import openai
import pydantic
import pytest
import requests

from srt.chat_templates import builtin_template
from tests.conftest import BASE_ARGS, ServerProcess

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "pattern": "[A-Z][a-z]{1,12}"},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"]}}}
ADD = {"type": "function", "function": {
    "name": "add", "description": "Add two integers",
    "parameters": {"type": "object", "properties": {"a": {"type": "integer"},
                                                    "b": {"type": "integer"}},
                   "required": ["a", "b"]}}}
TOOLS = [WEATHER, ADD]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]
# The model writes a call in the template's format (and a sentence before it).
CALL_REGEX = (r'I will check\. <tool_call>\n\{"name": "get_weather", "arguments": \{"city": '
              r'"[A-Z][a-z]{2,8}", "unit": "celsius"\}\}\n</tool_call>')
NAMED_ADD = {"type": "function", "function": {"name": "add"}}


@pytest.fixture(scope="module")
def tool_server(smollm2_dir: str) -> Any:
    srv = ServerProcess([*BASE_ARGS, "--max-total-tokens", "16384", "--reasoning-parser", "qwen3",
                         "--constrained-compile-timeout", "120"]).start()
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(tool_server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=tool_server.url + "/v1", api_key="unused", max_retries=0)


def _prompt_ids(tokenizer: Any, messages: list[dict[str, Any]],
                tools: list[dict[str, Any]] | None) -> list[int]:
    ids = tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True,
                                        chat_template=builtin_template("chatml-tools"))
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def _native(server: ServerProcess, ids: list[int], **params: Any) -> dict[str, Any]:
    return server.generate({"input_ids": ids, "sampling_params": {
        "temperature": 0, "max_new_tokens": 60, **params}})


def _chat(client: openai.OpenAI, **kwargs: Any) -> Any:
    args = {"model": "default", "messages": MESSAGES, "tools": TOOLS, "max_tokens": 60,
            "temperature": 0, **kwargs}
    return client.chat.completions.create(**args)


def _assemble(chunks: list[Any]) -> dict[str, Any]:
    """A stream's choice 0 reassembled; checks the shape of each tool-call delta."""
    content, reasoning, calls, finishes = "", "", {}, []
    for ch in chunks:
        if not ch.choices:
            continue
        d = ch.choices[0].delta
        content += d.content or ""
        reasoning += getattr(d, "reasoning_content", None) or ""
        for tc in d.tool_calls or []:
            if tc.index not in calls:  # a call's first delta: id, type, name, empty arguments
                assert tc.id.startswith("call_") and tc.type == "function", tc
                assert tc.function.name and tc.function.arguments == "", tc
                calls[tc.index] = {"name": tc.function.name, "arguments": ""}
            else:
                assert tc.id is None and tc.function.name is None, tc
                calls[tc.index]["arguments"] += tc.function.arguments
        finishes.append(ch.choices[0].finish_reason)
    assert finishes[-1] is not None and set(finishes[:-1]) == {None}, finishes
    return {"content": content, "reasoning": reasoning,
            "calls": [calls[i] for i in sorted(calls)], "finish": finishes[-1]}


def _calls(message: Any) -> list[dict[str, str]]:
    return [{"name": c.function.name, "arguments": c.function.arguments}
            for c in message.tool_calls or []]


def _assert_valid(calls: list[dict[str, str]]) -> None:
    for call in calls:
        jsonschema.validate(json.loads(call["arguments"]), SCHEMAS[call["name"]])


def test_required_named_and_none(client: openai.OpenAI, tool_server: ServerProcess,
                                 smollm2_tokenizer: Any) -> None:
    required = _chat(client, tool_choice="required")
    calls = _calls(required.choices[0].message)
    assert len(calls) >= 1 and required.choices[0].finish_reason == "tool_calls"
    assert required.choices[0].message.content is None
    assert all(c.id.startswith("call_") and c.type == "function"
               for c in required.choices[0].message.tool_calls)
    _assert_valid(calls)
    ids = _prompt_ids(smollm2_tokenizer, MESSAGES, TOOLS)
    assert required.usage.prompt_tokens == len(ids)

    named = _chat(client, tool_choice=NAMED_ADD)
    calls = _calls(named.choices[0].message)
    assert [c["name"] for c in calls] == ["add"] and named.choices[0].finish_reason == "tool_calls"
    _assert_valid(calls)
    native = _native(tool_server, ids, json_schema=SCHEMAS["add"])
    assert calls[0]["arguments"] == native["text"]
    assert named.usage.completion_tokens == native["meta_info"]["completion_tokens"]

    # none: the tools are in the prompt, the answer is never parsed for calls
    none = _chat(client, tool_choice="none")
    assert none.choices[0].message.tool_calls is None
    assert none.choices[0].message.content == _native(tool_server, ids)["text"]
    assert none.usage.prompt_tokens == len(ids)


def test_auto_without_a_call_is_content(client: openai.OpenAI, tool_server: ServerProcess,
                                        smollm2_tokenizer: Any) -> None:
    r = _chat(client)  # tool_choice defaults to auto with tools
    native = _native(tool_server, _prompt_ids(smollm2_tokenizer, MESSAGES, TOOLS))
    assert "<tool_call>" not in native["text"]  # what this small model really says
    assert r.choices[0].message.tool_calls is None
    assert r.choices[0].message.content == native["text"].strip()
    assert r.choices[0].finish_reason in ("stop", "length")


def test_auto_parses_the_call_the_model_writes(client: openai.OpenAI,
                                               tool_server: ServerProcess,
                                               smollm2_tokenizer: Any) -> None:
    r = _chat(client, extra_body={"regex": CALL_REGEX})
    native = _native(tool_server, _prompt_ids(smollm2_tokenizer, MESSAGES, TOOLS),
                     regex=CALL_REGEX)
    before, block = native["text"].split("<tool_call>")
    expected = json.loads(block.replace("</tool_call>", ""))
    assert r.choices[0].message.content == before.strip() == "I will check."
    calls = _calls(r.choices[0].message)
    assert [(c["name"], json.loads(c["arguments"])) for c in calls] == [
        ("get_weather", expected["arguments"])]
    assert r.choices[0].finish_reason == "tool_calls"


@pytest.mark.parametrize("kwargs", [
    {"extra_body": {"regex": CALL_REGEX}},
    {"tool_choice": "required"},
    {"tool_choice": "required", "parallel_tool_calls": False},
    {"tool_choice": NAMED_ADD},
], ids=["auto", "required", "required-one", "named"])
def test_stream_equals_non_stream(client: openai.OpenAI, kwargs: dict[str, Any]) -> None:
    full = _chat(client, **kwargs)
    chunks = list(_chat(client, stream=True, stream_options={"include_usage": True}, **kwargs))
    got = _assemble(chunks)
    message = full.choices[0].message
    assert got["content"] == (message.content or "")
    assert "<tool" not in got["content"]  # no marker text leaks into the content
    assert got["calls"] == _calls(message) and got["calls"]
    assert got["finish"] == full.choices[0].finish_reason == "tool_calls"
    # (the token counts may differ: text a pattern forces is appended in the tokens it
    # tokenizes to, which can be fewer or more than the ones sampled one by one)
    assert chunks[-1].usage.prompt_tokens == full.usage.prompt_tokens
    assert chunks[-1].usage.completion_tokens > 0
    if kwargs.get("parallel_tool_calls") is False:
        assert len(got["calls"]) == 1


def test_n2_each_choice_calls(client: openai.OpenAI) -> None:
    r = _chat(client, tool_choice="required", n=2, temperature=0.8, seed=7)
    assert [c.index for c in r.choices] == [0, 1]
    for choice in r.choices:
        assert choice.finish_reason == "tool_calls"
        _assert_valid(_calls(choice.message))
    ids = [c.id for choice in r.choices for c in choice.message.tool_calls]
    assert len(set(ids)) == len(ids)


def test_tool_result_turn_is_rendered(client: openai.OpenAI, tool_server: ServerProcess,
                                      smollm2_tokenizer: Any) -> None:
    messages = [
        *MESSAGES,
        {"role": "assistant", "content": None, "tool_calls": [{
            "id": "call_1", "type": "function",
            "function": {"name": "get_weather",
                         "arguments": '{"city": "Paris", "unit": "celsius"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 21}'},
    ]
    r = _chat(client, messages=messages)
    template_messages = [*MESSAGES, {**messages[1], "content": "", "tool_calls": [
        {**messages[1]["tool_calls"][0], "function": {
            "name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}}]},
        messages[2]]
    ids = _prompt_ids(smollm2_tokenizer, template_messages, TOOLS)
    rendered = smollm2_tokenizer.decode(ids)
    assert '<tool_response>\n{"temperature": 21}\n</tool_response>' in rendered
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"' in rendered
    assert r.usage.prompt_tokens == len(ids)
    assert r.choices[0].message.content == _native(tool_server, ids)["text"].strip()


class Weather(pydantic.BaseModel):
    # bounded, so that the small model's arguments end well within max_tokens
    city: str = pydantic.Field(pattern="[A-Z][a-z]{1,12}")
    unit: Literal["celsius", "fahrenheit"]


def test_openai_parse_with_a_pydantic_tool(client: openai.OpenAI) -> None:
    r = client.chat.completions.parse(
        model="default", messages=MESSAGES, tools=[openai.pydantic_function_tool(Weather)],
        tool_choice="required", max_tokens=60, temperature=0)
    call = r.choices[0].message.tool_calls[0]
    assert call.function.name == "Weather"
    assert isinstance(call.function.parsed_arguments, Weather)


def test_langchain_bind_tools_and_structured_output(tool_server: ServerProcess) -> None:
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(model="default", base_url=tool_server.url + "/v1", api_key="unused",
                     temperature=0, max_tokens=60, max_retries=0)
    answer = llm.bind_tools([WEATHER, ADD], tool_choice="any").invoke(MESSAGES[0]["content"])
    assert answer.tool_calls and answer.tool_calls[0]["name"] in SCHEMAS
    jsonschema.validate(answer.tool_calls[0]["args"], SCHEMAS[answer.tool_calls[0]["name"]])
    weather = llm.with_structured_output(Weather, method="function_calling").invoke(
        MESSAGES[0]["content"])
    assert isinstance(weather, Weather)


def test_litellm_tools(tool_server: ServerProcess) -> None:
    os.environ["LITELLM_LOCAL_MODEL_COST_MAP"] = "True"  # no network at import
    import litellm

    r = litellm.completion(model="openai/default", api_base=tool_server.url + "/v1",
                           api_key="unused", messages=MESSAGES, tools=TOOLS,
                           tool_choice="required", max_tokens=60, temperature=0)
    calls = r.choices[0].message.tool_calls
    assert calls and r.choices[0].finish_reason == "tool_calls"
    _assert_valid([{"name": c.function.name, "arguments": c.function.arguments} for c in calls])


# -- reasoning (--reasoning-parser qwen3): a regex makes the model think in the qwen3 format

THINK_REGEX = r"<think>[a-z ]{1,20}</think>\n\n[a-z ]{1,20}"


def test_reasoning_is_separated(client: openai.OpenAI, tool_server: ServerProcess,
                                smollm2_tokenizer: Any) -> None:
    args = {"tools": None, "extra_body": {"regex": THINK_REGEX}}
    ids = _prompt_ids(smollm2_tokenizer, MESSAGES, None)
    text = _native(tool_server, ids, regex=THINK_REGEX)["text"]
    reasoning, content = text[len("<think>"):].split("</think>")
    r = _chat(client, **args)
    assert r.choices[0].message.reasoning_content == reasoning
    assert r.choices[0].message.content == content.lstrip()
    got = _assemble(list(_chat(client, stream=True, **args)))
    assert (got["reasoning"], got["content"]) == (reasoning, content.lstrip())
    kept = _chat(client, tools=None, extra_body={"regex": THINK_REGEX,
                                                 "separate_reasoning": False})
    assert kept.choices[0].message.content == text
    held = list(_chat(client, stream=True, tools=None, extra_body={
        "regex": THINK_REGEX, "stream_reasoning": False}))
    pieces = [c.choices[0].delta.reasoning_content for c in held
              if c.choices and getattr(c.choices[0].delta, "reasoning_content", None)]
    assert pieces == [reasoning]  # one delta once the reasoning ended


def test_ebnf_reaches_the_native_parameter(tool_server: ServerProcess) -> None:
    """`ebnf` on /v1/* is the native sampling parameter: the same answer as /generate gives
    it (its output, or its refusal where the server has no EBNF grammar backend)."""
    grammar = 'root ::= "yes" | "no"'
    native = requests.post(tool_server.url + "/generate", json={
        "text": "Is the sky blue?", "sampling_params": {"max_new_tokens": 4, "temperature": 0,
                                                        "ebnf": grammar}}, timeout=120)
    chat = requests.post(tool_server.url + "/v1/completions", json={
        "model": "default", "prompt": "Is the sky blue?", "max_tokens": 4, "temperature": 0,
        "ebnf": grammar}, timeout=120)
    assert chat.status_code == native.status_code, (chat.text, native.text)
    if native.status_code == 200:
        assert chat.json()["choices"][0]["text"] == native.json()["text"] in ("yes", "no")
    else:
        assert chat.json()["error"]["param"] == native.json()["error"]["param"] == "ebnf"
