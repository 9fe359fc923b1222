"""One chat choice's output text as OpenAI's message (`message`) or as stream deltas (`feed`,
`finish`): reasoning separated (`--reasoning-parser`), then tool calls read as the request's
ToolPlan says (srt/managers/tool_request.py).

A streamed choice gives the same reasoning, content and calls as the whole answer, assembled:
each call's first delta carries `index`, `id`, `type`, `function.name` and `arguments: ""`, the
next ones `index` and fragments of `function.arguments`. A call found by a text parser (auto)
is sent once complete, its arguments in one fragment; the arguments of a named function stream
as the model writes them.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Any

from srt.managers.tool_request import CallArrayReader, ToolPlan
from srt.parsers.reasoning import ReasoningFormat, ReasoningStream, split_reasoning
from srt.parsers.tool_calls import ToolCall
from srt.parsers.tool_stream import ToolCallStream, answer_content


@dataclass(frozen=True)
class ChoiceOptions:
    tools: ToolPlan | None  # None: no tools offered
    tool_parser: str  # --tool-call-parser, for tool_choice auto
    reasoning: ReasoningFormat | None  # None: reasoning text stays in the content
    stream_reasoning: bool = True  # False: a stream sends the reasoning in one delta

    @property
    def parses_calls(self) -> bool:
        return self.tools is not None and self.tools.choice != "none"


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def _call_json(call: ToolCall, call_id: str) -> dict[str, Any]:
    return {"id": call_id, "type": "function",
            "function": {"name": call.name, "arguments": call.arguments}}


@dataclass
class ChoiceOutput:
    opts: ChoiceOptions
    calls: int = field(init=False, default=0)  # calls given so far
    _reasoning: ReasoningStream | None = field(init=False, default=None)
    _held_reasoning: str = field(init=False, default="")
    _tool_stream: ToolCallStream | None = field(init=False, default=None)
    _array: CallArrayReader | None = field(init=False, default=None)

    def __post_init__(self) -> None:
        if self.opts.reasoning is not None:
            self._reasoning = ReasoningStream(self.opts.reasoning)
        if self.opts.parses_calls:
            assert self.opts.tools is not None
            if self.opts.tools.choice == "auto":
                self._tool_stream = ToolCallStream(self.opts.tool_parser)
            elif self.opts.tools.choice == "required":
                self._array = CallArrayReader()

    def finish_reason(self, native: str | None) -> str | None:
        """OpenAI's finish reason: "tool_calls" for an answer that stopped after giving calls."""
        return "tool_calls" if native == "stop" and self.calls else native

    # ------------------------------------------------------------------ whole answer

    def _calls_of(self, content: str) -> tuple[str | None, list[ToolCall]]:
        plan = self.opts.tools
        if plan is None or not self.opts.parses_calls:
            return content, []
        if plan.choice == "auto":
            return answer_content(content, self.opts.tool_parser)
        if plan.choice == "required":
            return None, CallArrayReader().feed(content)
        assert plan.named is not None
        return None, [ToolCall(plan.named, content)] if content.strip() else []

    def message(self, text: str) -> dict[str, Any]:
        """The assistant message of a whole answer (content null when it made calls and wrote
        nothing else)."""
        msg: dict[str, Any] = {"role": "assistant"}
        if self.opts.reasoning is not None:
            reasoning, text = split_reasoning(text, self.opts.reasoning)
            msg["reasoning_content"] = reasoning
        content, calls = self._calls_of(text)
        self.calls = len(calls)
        msg["content"] = (content or None) if calls else (content or "")
        if calls:
            msg["tool_calls"] = [_call_json(c, new_call_id()) for c in calls]
        return msg

    # ------------------------------------------------------------------ stream

    def _call_deltas(self, calls: list[ToolCall]) -> list[dict[str, Any]]:
        out = []
        for call in calls:
            out.append({"tool_calls": [{"index": self.calls, "id": new_call_id(),
                                        "type": "function",
                                        "function": {"name": call.name, "arguments": ""}}]})
            out.append({"tool_calls": [{"index": self.calls,
                                        "function": {"arguments": call.arguments}}]})
            self.calls += 1
        return out

    def _answer_deltas(self, text: str, final: bool) -> list[dict[str, Any]]:
        """Deltas for text after the reasoning (final: nothing more will come)."""
        plan = self.opts.tools
        if plan is None or not self.opts.parses_calls:
            return [{"content": text}] if text else []
        if self._tool_stream is not None:
            content, calls = self._tool_stream.feed(text)
            if final:
                rest, more = self._tool_stream.finish()
                content, calls = content + rest, calls + more
            return ([{"content": content}] if content else []) + self._call_deltas(calls)
        if self._array is not None:
            return self._call_deltas(self._array.feed(text))
        if not text:  # a named function: its arguments as they come
            return []
        assert plan.named is not None
        if self.calls == 0:
            return self._call_deltas([ToolCall(plan.named, text)])
        return [{"tool_calls": [{"index": 0, "function": {"arguments": text}}]}]

    def _split(self, delta: str, final: bool) -> list[dict[str, Any]]:
        reasoning, text = "", delta
        if self._reasoning is not None:
            reasoning, text = self._reasoning.feed(delta)
            if final:
                r2, t2 = self._reasoning.finish()
                reasoning, text = reasoning + r2, text + t2
        out: list[dict[str, Any]] = []
        if self.opts.stream_reasoning:
            if reasoning:
                out.append({"reasoning_content": reasoning})
        else:
            self._held_reasoning += reasoning
        answer = self._answer_deltas(text, final)
        if self._held_reasoning and (answer or final):  # the reasoning has ended
            out.append({"reasoning_content": self._held_reasoning})
            self._held_reasoning = ""
        return out + answer

    def feed(self, delta: str) -> list[dict[str, Any]]:
        """Deltas for new output text (possibly none while text is held)."""
        return self._split(delta, final=False)

    def finish(self) -> list[dict[str, Any]]:
        """Deltas for what was held, once the output is complete."""
        return self._split("", final=True)
