"""The tool fields of a chat request (OpenAI's `tools`, `tool_choice`, `parallel_tool_calls`) and
what they ask of generation.

`plan_tools(body)` validates them into a `ToolPlan`:

* `none`: the tools are rendered in the prompt (as vLLM does) but the output is never parsed
  for calls;
* `auto` (the default with tools): free generation; the `--tool-call-parser` finds the calls;
* `required`: the output is constrained (`json_schema`) to a JSON array of one or more
  (exactly one without `parallel_tool_calls`) `{"name": const, "arguments": parameters}`
  objects, read directly as JSON (`CallArrayReader`), not by the text parser;
* a named function: the output is constrained to that function's arguments object.

The constraint uses only what the `json_schema` sampling parameter compiles today; a schema it
cannot enforce (numeric bounds) is refused there with a 400, like any `json_schema`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from srt.managers.request_types import RequestError
from srt.parsers.tool_calls import ToolCall

# A function without `parameters` takes none (OpenAI): its arguments are `{}`.
_NO_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}


@dataclass(frozen=True)
class ToolPlan:
    tools: tuple[dict[str, Any], ...]  # as the client sent them, for the chat template
    parameters: dict[str, dict[str, Any]]  # function name -> its parameters schema
    choice: str  # "none", "auto", "required" or "named"
    named: str | None  # the function of choice "named"
    parallel: bool

    @property
    def constrained(self) -> bool:
        """The output is JSON forced by a schema (required, named), not free text."""
        return self.choice in ("required", "named")

    def constraint(self) -> dict[str, Any]:
        """The native sampling parameters that enforce the choice ({} for none and auto)."""
        if self.choice == "named":
            assert self.named is not None
            return {"json_schema": self.parameters[self.named]}
        if self.choice != "required":
            return {}
        one_of = [{"type": "object",
                   "properties": {"name": {"const": name}, "arguments": schema},
                   "required": ["name", "arguments"]}
                  for name, schema in self.parameters.items()]
        items = one_of[0] if len(one_of) == 1 else {"anyOf": one_of}
        array: dict[str, Any] = {"type": "array", "items": items, "minItems": 1}
        if not self.parallel:
            array["maxItems"] = 1
        return {"json_schema": array}


def _function(tool: Any, i: int) -> tuple[str, dict[str, Any]]:
    """(name, parameters schema) of tools[i]; RequestError if it is not a function tool."""
    fn = tool.get("function") if isinstance(tool, dict) else None
    if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(fn, dict):
        raise RequestError(f"tools[{i}] must be {{\"type\": \"function\", \"function\": {{...}}}}",
                           "tools", "invalid_type")
    name = fn.get("name")
    if not isinstance(name, str) or not name:
        raise RequestError(f"tools[{i}].function.name must be a non-empty string", "tools",
                           "invalid_type")
    params = fn.get("parameters")
    if params is None:
        params = _NO_PARAMETERS
    if not isinstance(params, dict):
        raise RequestError(f"tools[{i}].function.parameters must be a JSON schema object",
                           "tools", "invalid_type")
    return name, params


def plan_tools(body: dict[str, Any]) -> ToolPlan | None:
    """The request's ToolPlan, or None when it offers no tools. RequestError for invalid
    fields, or a tool_choice that needs tools when none are given."""
    tools = body.get("tools")
    choice = body.get("tool_choice")
    parallel = body.get("parallel_tool_calls")
    if parallel is None:
        parallel = True
    if not isinstance(parallel, bool):
        raise RequestError("parallel_tool_calls must be a boolean", "parallel_tool_calls",
                           "invalid_type")
    if tools is not None and not isinstance(tools, list):
        raise RequestError("tools must be a list", "tools", "invalid_type")
    parameters: dict[str, dict[str, Any]] = {}
    for i, tool in enumerate(tools or []):
        name, params = _function(tool, i)
        if name in parameters:
            raise RequestError(f"tools[{i}]: the function name {name!r} is given twice", "tools")
        parameters[name] = params
    named = None
    if choice is None:
        choice = "auto"
    elif isinstance(choice, dict):
        fn = choice.get("function")
        named = fn.get("name") if isinstance(fn, dict) else None
        if choice.get("type") != "function" or not isinstance(named, str):
            raise RequestError('tool_choice must be "none", "auto", "required" or {"type": '
                               '"function", "function": {"name": ...}}', "tool_choice",
                               "invalid_type")
        if named not in parameters:
            raise RequestError(f"tool_choice names the function {named!r}, which is not in "
                               "tools", "tool_choice")
        choice = "named"
    elif choice not in ("none", "auto", "required"):
        raise RequestError('tool_choice must be "none", "auto", "required" or {"type": '
                           '"function", "function": {"name": ...}}', "tool_choice")
    if not parameters:
        if choice in ("required", "named"):
            raise RequestError(f"tool_choice {choice!r} needs tools", "tool_choice")
        return None
    return ToolPlan(tuple(tools or ()), parameters, choice, named, parallel)


def template_message(message: dict[str, Any], index: int) -> dict[str, Any]:
    """The tool fields of one chat message as the chat template takes them: an assistant's
    `tool_calls` (their `arguments` JSON text decoded into an object, as templates expect), a
    tool message's `tool_call_id` and `name`. {} for a message without them."""
    out: dict[str, Any] = {}
    if message.get("role") == "tool":
        for key in ("tool_call_id", "name"):
            if isinstance(message.get(key), str):
                out[key] = message[key]
        return out
    calls = message.get("tool_calls")
    if calls is None:
        return out
    if message.get("role") != "assistant" or not isinstance(calls, list):
        raise RequestError(f"messages[{index}].tool_calls must be a list on an assistant "
                           "message", "messages", "invalid_type")
    rendered = []
    for j, call in enumerate(calls):
        fn = call.get("function") if isinstance(call, dict) else None
        name = fn.get("name") if isinstance(fn, dict) else None
        arguments = fn.get("arguments") if isinstance(fn, dict) else None
        if not isinstance(name, str) or not isinstance(arguments, (str, dict)):
            raise RequestError(f"messages[{index}].tool_calls[{j}] needs function.name and "
                               "function.arguments", "messages", "invalid_type")
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments) if arguments.strip() else {}
            except json.JSONDecodeError:
                raise RequestError(f"messages[{index}].tool_calls[{j}].function.arguments is "
                                   "not JSON", "messages") from None
        rendered.append({"id": call.get("id"), "type": "function",
                         "function": {"name": name, "arguments": arguments}})
    out["tool_calls"] = rendered
    return out


class CallArrayReader:
    """Reads the calls of a `required` output (a JSON array of {"name", "arguments"} objects)
    as its text arrives: `feed(delta)` returns the calls whose object is now complete. An
    output cut short (max_tokens) yields the calls completed before the cut."""

    def __init__(self) -> None:
        self.buf = ""
        self.pos = 0
        self._decoder = json.JSONDecoder()

    def feed(self, delta: str) -> list[ToolCall]:
        self.buf += delta
        calls = []
        while True:
            while self.pos < len(self.buf) and self.buf[self.pos] in " \t\n\r[,":
                self.pos += 1
            if self.pos >= len(self.buf) or self.buf[self.pos] == "]":
                return calls
            try:
                obj, end = self._decoder.raw_decode(self.buf, self.pos)
            except json.JSONDecodeError:  # the object is not complete yet
                return calls
            self.pos = end
            if isinstance(obj, dict) and isinstance(obj.get("name"), str):
                calls.append(ToolCall(obj["name"], json.dumps(obj.get("arguments", {}),
                                                              ensure_ascii=False)))
