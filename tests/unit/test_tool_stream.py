"""Streamed tool-call parsing (srt/parsers/tool_stream.py), the required-output reader and the
tool plan (srt/managers/tool_request.py) and one choice's message and deltas
(srt/managers/chat_choice.py), on canned outputs split at random points."""

from __future__ import annotations

import json
import random
from typing import Any

import pytest
from hypothesis import given, settings, strategies as st

from srt.managers.chat_choice import ChoiceOptions, ChoiceOutput
from srt.managers.request_types import RequestError
from srt.managers.tool_request import CallArrayReader, plan_tools
from srt.parsers.reasoning import get_format
from srt.parsers.tool_calls import ToolCall
from srt.parsers.tool_stream import ToolCallStream, answer_content

CALL_F = '<tool_call>\n{"name": "f", "arguments": {"a": 1, "s": "x<y"}}\n</tool_call>'
CALL_G = '<tool_call>{"name": "g", "arguments": {}}</tool_call>'
ANSWERS = [
    ("hermes", f"Sure, calling. {CALL_F}\n{CALL_G}  done "),
    ("hermes", f"{CALL_F}"),
    ("hermes", '<tool_call>{"name": "f", "arguments": {"a": "</tool_"}}'),  # cut after the object
    ("hermes", "no call here, only a <tool_ and a < sign "),
    ("hermes", "   "),
    ("llama3", 'Let me see. <|python_tag|>{"name": "f", "parameters": {"a": 1}}; '
               '{"name": "g", "parameters": {}}'),
    ("llama3", '{"name": "f", "parameters": {"a": 1}}'),
    ("mistral", 'ok [TOOL_CALLS] [{"name": "f", "arguments": {"a": 1}}]'),
    ("mistral", "just text [TOOL_ no"),
]


def _pieces(text: str, rng: random.Random) -> list[str]:
    out, i = [], 0
    while i < len(text):
        k = rng.randint(1, 6)
        out.append(text[i:i + k])
        i += k
    return out


def _stream(parser: str, pieces: list[str]) -> tuple[str, list[ToolCall]]:
    s = ToolCallStream(parser)
    shown, calls = [], []
    for p in pieces:
        c, found = s.feed(p)
        shown, calls = shown + [c], calls + found
    c, found = s.finish()
    shown, calls = shown + [c], calls + found
    if calls:  # no delta showed a piece of a call marker
        assert not any(m in "".join(shown) for m in ("<tool_call>", "<|python_tag|>",
                                                      "[TOOL_CALLS]"))
    return "".join(shown), calls


@pytest.mark.parametrize("parser,text", ANSWERS)
def test_stream_equals_whole_answer(parser: str, text: str) -> None:
    whole = answer_content(text, parser)
    for seed in range(30):
        assert _stream(parser, _pieces(text, random.Random(seed))) == whole, seed


def test_whole_answers() -> None:
    content, calls = answer_content(ANSWERS[0][1], "hermes")
    assert content == "Sure, calling. \n  done"
    assert calls == [ToolCall("f", '{"a": 1, "s": "x<y"}'), ToolCall("g", "{}")]
    assert answer_content(ANSWERS[5][1], "llama3")[0] == "Let me see."


def test_a_partial_marker_is_held_then_released() -> None:
    s = ToolCallStream("hermes")
    assert s.feed("Hi <tool_") == ("Hi", [])  # the space and the partial marker are held
    assert s.feed("box>") == (" <tool_box>", [])
    assert s.feed("<tool_call>{") == ("", [])
    assert s.feed('"name": "f", "arguments": {}}</tool_call>') == ("", [ToolCall("f", "{}")])


@settings(max_examples=60, deadline=None)
@given(st.lists(st.text(alphabet="ab <>/_toolcaln{}", max_size=8), max_size=6),
       st.integers(0, 1000))
def test_plain_text_is_never_lost(words: list[str], seed: int) -> None:
    """Text with marker-like pieces but no valid call comes back whole, stripped."""
    text = "".join(words)
    content, calls = _stream("hermes", _pieces(text, random.Random(seed)))
    if not calls:
        assert content == text.strip()


def test_call_array_reader_reads_complete_objects() -> None:
    r = CallArrayReader()
    assert r.feed('[{"name": "f", "arguments": {"a": [1, ') == []
    assert r.feed('2]}}, {"name": "g", ') == [ToolCall("f", '{"a": [1, 2]}')]
    assert r.feed('"arguments": {}}]') == [ToolCall("g", "{}")]
    assert CallArrayReader().feed('[{"name": "f", "arguments": {"a": "cut') == []


TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}}},
         {"type": "function", "function": {"name": "g"}}]


def test_plan_constraints() -> None:
    assert plan_tools({}) is None
    assert plan_tools({"tool_choice": "none"}) is None
    auto = plan_tools({"tools": TOOLS})
    assert auto is not None and auto.choice == "auto" and auto.constraint() == {}
    named = plan_tools({"tools": TOOLS, "tool_choice": {"type": "function",
                                                        "function": {"name": "f"}}})
    assert named.constraint() == {"json_schema": TOOLS[0]["function"]["parameters"]}
    one = plan_tools({"tools": TOOLS, "tool_choice": "required", "parallel_tool_calls": False})
    schema = one.constraint()["json_schema"]
    assert (schema["minItems"], schema["maxItems"]) == (1, 1)
    names = [o["properties"]["name"]["const"] for o in schema["items"]["anyOf"]]
    assert names == ["f", "g"]
    assert schema["items"]["anyOf"][1]["properties"]["arguments"] == {
        "type": "object", "properties": {}}
    many = plan_tools({"tools": TOOLS, "tool_choice": "required"})
    assert "maxItems" not in many.constraint()["json_schema"]


@pytest.mark.parametrize("body,param", [
    ({"tools": {"f": 1}}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": ""}}]}, "tools"),
    ({"tools": [TOOLS[0], TOOLS[0]]}, "tools"),
    ({"tools": TOOLS, "tool_choice": "always"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "h"}}},
     "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": TOOLS, "parallel_tool_calls": "yes"}, "parallel_tool_calls"),
])
def test_plan_errors(body: dict[str, Any], param: str) -> None:
    with pytest.raises(RequestError) as e:
        plan_tools(body)
    assert e.value.param == param


def _assembled(out: ChoiceOutput, pieces: list[str]) -> dict[str, Any]:
    deltas = [d for p in pieces for d in out.feed(p)] + out.finish()
    content = "".join(d.get("content", "") for d in deltas)
    reasoning = "".join(d.get("reasoning_content", "") for d in deltas)
    calls: dict[int, dict[str, str]] = {}
    for d in deltas:
        for tc in d.get("tool_calls", []):
            if "id" in tc:
                assert tc["function"]["arguments"] == "" and tc["index"] not in calls
                calls[tc["index"]] = {"name": tc["function"]["name"], "arguments": ""}
            else:
                calls[tc["index"]]["arguments"] += tc["function"]["arguments"]
    return {"content": content, "reasoning": reasoning, "calls": list(calls.values())}


@pytest.mark.parametrize("choice,reasoning,text", [
    ("auto", "qwen3", f"<think>plan it</think>\n\nSure. {CALL_F}"),
    ("auto", None, "just words"),
    ("required", None, '[{"name": "f", "arguments": {"a": 3}}, {"name": "g", "arguments": {}}]'),
    ({"type": "function", "function": {"name": "f"}}, None, '{ "a": 12 }'),
    ("none", "qwen3", f"<think>x</think>{CALL_F}"),
])
def test_choice_stream_equals_message(choice: Any, reasoning: str | None, text: str) -> None:
    plan = plan_tools({"tools": TOOLS, "tool_choice": choice})
    opts = ChoiceOptions(plan, "hermes", get_format(reasoning) if reasoning else None)
    whole = ChoiceOutput(opts)
    msg = whole.message(text)
    calls = [{"name": c["function"]["name"], "arguments": c["function"]["arguments"]}
             for c in msg.get("tool_calls", [])]
    for seed in range(10):
        out = ChoiceOutput(opts)
        got = _assembled(out, _pieces(text, random.Random(seed)))
        assert got == {"content": msg["content"] or "",
                       "reasoning": msg.get("reasoning_content") or "", "calls": calls}
        assert out.finish_reason("stop") == whole.finish_reason("stop")
    assert (whole.finish_reason("stop") == "tool_calls") == bool(calls)
    assert whole.finish_reason("length") == "length"
    if choice == "none":
        assert not calls and "<tool_call>" in msg["content"]
    elif choice != "auto" or "tool_call" in text:
        assert calls and msg["content"] in (None, "Sure.")
        for c in calls:
            json.loads(c["arguments"])


def test_reasoning_held_until_it_ends() -> None:
    opts = ChoiceOptions(None, "hermes", get_format("qwen3"), stream_reasoning=False)
    out = ChoiceOutput(opts)
    assert out.feed("<think>a b") == [] and out.feed(" c</think>") == []
    assert out.feed("\n\nanswer") == [{"reasoning_content": "a b c"}, {"content": "answer"}]
