"""Tool-call parsing of a streamed answer (`tool_choice: "auto"`): `ToolCallStream.feed(delta)`
returns the content to show now and the calls completed by this delta; `finish()` the rest.

Text before a call streams as content at once, except a trailing piece that may be the start of
a call marker (a partial `<tool_call>`), which is held until the next delta tells. In the hermes
format each `<tool_call>...</tool_call>` block becomes a call as soon as it closes, and the text
between blocks is content. In the llama3 and mistral formats the calls run to the end of the
answer, so everything from the marker on is held and parsed by `parse_tool_calls` at the end.

Content is the text outside the calls without leading or trailing whitespace (whitespace is held
until non-whitespace follows), as `answer_content` gives for a whole answer. For an answer whose
calls are all valid, the streamed content and calls equal the whole-answer parse; a hermes
block that is not a valid call streams as content (the whole-answer parse then keeps the whole
answer as content, having seen it all).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from srt.parsers.tool_calls import ToolCall, parse_tool_calls

# parser -> (markers that start the calls, end tag of one call or None: calls run to the end)
_MARKERS: dict[str, tuple[tuple[str, ...], str | None]] = {
    "hermes": (("<tool_call>",), "</tool_call>"),
    "qwen25": (("<tool_call>",), "</tool_call>"),
    "llama3": (("<|python_tag|>", "{"), None),
    "mistral": (("[TOOL_CALLS]",), None),
}


def answer_content(text: str, parser: str) -> tuple[str, list[ToolCall]]:
    """(content, calls) of a whole answer: `parse_tool_calls`, content stripped."""
    content, calls = parse_tool_calls(text, parser)
    return content.strip(), calls


def _held_prefix(text: str, markers: tuple[str, ...]) -> int:
    """Length of the longest suffix of text that is a proper prefix of a marker."""
    longest = 0
    for m in markers:
        for n in range(min(len(m) - 1, len(text)), longest, -1):
            if text.endswith(m[:n]):
                longest = n
                break
    return longest


def _hermes_call(block: str) -> ToolCall | None:
    """The call of one `<tool_call>` block (closed, or cut after its object), or None if it is
    not a valid call."""
    calls = parse_tool_calls(block, "hermes")[1]
    return calls[0] if len(calls) == 1 else None


@dataclass
class ToolCallStream:
    parser: str
    text: str = field(init=False, default="")  # everything fed
    buf: str = field(init=False, default="")  # fed, not yet shown nor parsed
    in_call: bool = field(init=False, default=False)
    shown: str = field(init=False, default="")  # content sent so far
    ws: str = field(init=False, default="")  # whitespace held after the content sent

    def __post_init__(self) -> None:
        if self.parser not in _MARKERS:
            raise ValueError(f"unknown tool-call parser {self.parser!r}; known: "
                             f"{sorted(_MARKERS)}")
        self.markers, self.end = _MARKERS[self.parser]

    def _content(self, text: str) -> str:
        """Content to show for text outside the calls (whitespace held as the module says)."""
        text = self.ws + text
        if not self.shown:
            text = text.lstrip()
        body = text.rstrip()
        self.ws = text[len(body):]
        if not body:
            return ""
        self.shown += body
        return body

    def feed(self, delta: str) -> tuple[str, list[ToolCall]]:
        self.text += delta
        self.buf += delta
        out: list[str] = []
        calls: list[ToolCall] = []
        while self.buf:
            if not self.in_call:
                starts = [(i, m) for m in self.markers if (i := self.buf.find(m)) >= 0]
                if not starts:
                    keep = _held_prefix(self.buf, self.markers)
                    out.append(self._content(self.buf[:len(self.buf) - keep]))
                    self.buf = self.buf[len(self.buf) - keep:]
                    break
                i, _ = min(starts)
                out.append(self._content(self.buf[:i]))
                self.buf = self.buf[i:]
                self.in_call = True
                continue
            if self.end is None:  # the calls run to the end of the answer
                break
            j = self.buf.find(self.end)
            if j < 0:
                break
            block = self.buf[:j + len(self.end)]
            call = _hermes_call(block)
            if call is not None:
                calls.append(call)
            else:
                out.append(self._content(block))
            self.buf = self.buf[len(block):]
            self.in_call = False
        return "".join(out), calls

    def finish(self) -> tuple[str, list[ToolCall]]:
        """What was held: a partial marker is content; an open call is parsed."""
        rest, self.buf = self.buf, ""
        if not self.in_call:
            return self._content(rest), []
        if self.end is not None:  # a hermes block the answer ended inside
            call = _hermes_call(rest)
            return ("", [call]) if call is not None else (self._content(rest), [])
        content, calls = answer_content(self.text, self.parser)
        if not calls:
            return self._content(rest), []
        # The calls' parse may place the content boundary elsewhere than the first marker.
        extra = content[len(self.shown):] if content.startswith(self.shown) else ""
        if extra:
            extra = (self.ws + extra) if self.shown else extra
            self.shown += extra
        return extra, calls
