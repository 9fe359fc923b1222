"""Tool-call parsers (`--tool-call-parser`, SGLang's name): the calls a model wrote in its answer,
in the format its chat template taught it, and the text around them.

Formats:
  hermes   (Hermes, Qwen2.5, Qwen3)  <tool_call>{"name": ..., "arguments": {...}}</tool_call>,
           one block per call, text may come before and between;
  llama3   (Llama 3.1 / 3.2 JSON)     [<|python_tag|>]{"name": ..., "parameters": {...}}, several
           separated by ';', text may come before the first;
  mistral  (Mistral)                  [TOOL_CALLS] [{"name": ..., "arguments": {...}}, ...], text
           may come before.

`parse_tool_calls(text, name)` returns (content, calls): the text outside the calls (stripped)
and each call's name and arguments as a JSON text. An answer whose call text is not valid JSON
of the expected shape has no calls: it is returned whole as content, never half parsed.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Callable


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # a JSON object, as text


_decoder = json.JSONDecoder()


def _call(obj: Any, args_key: str) -> ToolCall | None:
    """A call from one decoded object, or None if it is not {"name": str, args_key: object}."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get(args_key, obj.get("arguments", {}))
    if isinstance(args, str):  # some models write the arguments as a JSON string
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            return None
    if not isinstance(args, dict):
        return None
    return ToolCall(obj["name"], json.dumps(args, ensure_ascii=False))


def _hermes(text: str) -> tuple[str, list[ToolCall]] | None:
    start, end = "<tool_call>", "</tool_call>"
    if start not in text:
        return None
    content: list[str] = []
    calls: list[ToolCall] = []
    pos = 0
    while True:
        i = text.find(start, pos)
        if i < 0:
            content.append(text[pos:])
            break
        content.append(text[pos:i])
        j = text.find(end, i)
        body = text[i + len(start) : j if j >= 0 else len(text)].strip()
        try:
            call = _call(json.loads(body), "arguments")
        except json.JSONDecodeError:
            return None
        if call is None:
            return None
        calls.append(call)
        if j < 0:  # the output ended inside the block (after a complete object)
            break
        pos = j + len(end)
    return "".join(content).strip(), calls


def _json_calls(body: str, args_key: str, sep: str | None) -> list[ToolCall] | None:
    """Consecutive JSON objects (or one JSON list of them) making up the whole body."""
    calls: list[ToolCall] = []
    pos = 0
    body = body.strip()
    while pos < len(body):
        try:
            obj, end = _decoder.raw_decode(body, pos)
        except json.JSONDecodeError:
            return None
        objs = obj if isinstance(obj, list) else [obj]
        for o in objs:
            call = _call(o, args_key)
            if call is None:
                return None
            calls.append(call)
        pos = end
        while pos < len(body) and (body[pos].isspace() or (sep and body[pos] == sep)):
            pos += 1
    return calls or None


def _llama3(text: str) -> tuple[str, list[ToolCall]] | None:
    tag = "<|python_tag|>"
    if tag in text:
        before, body = text.split(tag, 1)
    else:
        i = text.find("{")
        if i < 0:
            return None
        before, body = text[:i], text[i:]
    calls = _json_calls(body, "parameters", ";")
    return None if calls is None else (before.strip(), calls)


def _mistral(text: str) -> tuple[str, list[ToolCall]] | None:
    tag = "[TOOL_CALLS]"
    if tag not in text:
        return None
    before, body = text.split(tag, 1)
    calls = _json_calls(body, "arguments", None)
    return None if calls is None else (before.strip(), calls)


PARSERS: dict[str, Callable[[str], tuple[str, list[ToolCall]] | None]] = {
    "hermes": _hermes,
    "qwen25": _hermes,
    "llama3": _llama3,
    "mistral": _mistral,
}


def parse_tool_calls(text: str, parser: str) -> tuple[str, list[ToolCall]]:
    """(content, calls) of a whole answer; (text, []) when it holds no valid call."""
    try:
        parse = PARSERS[parser]
    except KeyError:
        raise ValueError(f"unknown tool-call parser {parser!r}; known: {sorted(PARSERS)}") \
            from None
    found = parse(text)
    return found if found is not None else (text, [])
