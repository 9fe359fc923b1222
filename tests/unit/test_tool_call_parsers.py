"""Tool-call parsers on canned model outputs of each format: one call, several calls in one
answer, text around them, arguments written as a JSON string, and outputs that only look like
calls (kept whole as content)."""

from __future__ import annotations

import json

import pytest

from srt.parsers.tool_calls import ToolCall, parse_tool_calls


def call(name: str, **args: object) -> ToolCall:
    return ToolCall(name, json.dumps(args, ensure_ascii=False))


CASES = [
    ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
     '</tool_call>', "", [call("get_weather", city="Paris")]),
    ("hermes", 'Let me check both.\n<tool_call>\n{"name": "get_weather", "arguments": '
     '{"city": "Paris", "unit": "c"}}\n</tool_call>\n<tool_call>\n{"name": "get_time", '
     '"arguments": {"tz": "Europe/Paris"}}\n</tool_call>',
     "Let me check both.",
     [call("get_weather", city="Paris", unit="c"), call("get_time", tz="Europe/Paris")]),
    ("qwen25", 'Sure <tool_call>{"name": "f", "arguments": "{\\"x\\": 1}"}</tool_call> done',
     "Sure  done", [call("f", x=1)]),
    ("hermes", '<tool_call>{"name": "f", "arguments": {"q": "é"}}', "", [call("f", q="é")]),
    ("hermes", "No tools needed: the answer is 4.", "No tools needed: the answer is 4.", []),
    ("hermes", '<tool_call>{"name": "f", "arguments": {"x": </tool_call>',
     '<tool_call>{"name": "f", "arguments": {"x": </tool_call>', []),
    ("llama3", '{"name": "get_weather", "parameters": {"city": "Oslo"}}', "",
     [call("get_weather", city="Oslo")]),
    ("llama3", '<|python_tag|>{"name": "a", "parameters": {"n": 1}}; '
     '{"name": "b", "parameters": {}}', "", [call("a", n=1), call("b")]),
    ("llama3", 'I will look it up. {"name": "search", "parameters": {"q": "srt"}}',
     "I will look it up.", [call("search", q="srt")]),
    ("llama3", 'A set {1, 2} is not a call.', 'A set {1, 2} is not a call.', []),
    ("llama3", 'Data: {"a": 1}', 'Data: {"a": 1}', []),
    ("mistral", '[TOOL_CALLS] [{"name": "add", "arguments": {"a": 1, "b": 2}}, '
     '{"name": "mul", "arguments": {"a": 3, "b": 4}}]', "",
     [call("add", a=1, b=2), call("mul", a=3, b=4)]),
    ("mistral", 'Computing.[TOOL_CALLS][{"name": "add", "arguments": {"a": 1}}]',
     "Computing.", [call("add", a=1)]),
    ("mistral", "[TOOL_CALLS] not json", "[TOOL_CALLS] not json", []),
]


@pytest.mark.parametrize("parser,text,content,calls", CASES)
def test_canned_outputs(parser: str, text: str, content: str, calls: list[ToolCall]) -> None:
    assert parse_tool_calls(text, parser) == (content, calls)


def test_arguments_are_json_objects() -> None:
    for parser, text, _, calls in CASES:
        for c in parse_tool_calls(text, parser)[1]:
            assert isinstance(json.loads(c.arguments), dict)


def test_unknown_parser() -> None:
    with pytest.raises(ValueError, match="hermes"):
        parse_tool_calls("x", "nope")
