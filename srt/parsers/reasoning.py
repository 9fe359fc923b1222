"""Reasoning separation (`--reasoning-parser`, SGLang's name): the text a reasoning model writes
between its think tags becomes `reasoning_content`, the rest `content`.

Formats: `qwen3` (the model opens `<think>` itself; an answer without the tag has no reasoning)
and `deepseek-r1` (the chat template opens `<think>` in the prompt, so the output starts inside
the reasoning and only `</think>` appears). A reasoning that is never closed (the output was cut)
is all reasoning; the whitespace between the end tag and the answer belongs to neither.

`split_reasoning` parses a whole output; `ReasoningStream` does the same for a stream of text
deltas, holding back a trailing piece that may be the start of a tag, so that no delta shows
part of a tag. Both give the same split for the same text.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class ReasoningFormat:
    start: str
    end: str
    starts_inside: bool  # the output begins inside the reasoning (the prompt opened it)


FORMATS: dict[str, ReasoningFormat] = {
    "qwen3": ReasoningFormat("<think>", "</think>", starts_inside=False),
    "deepseek-r1": ReasoningFormat("<think>", "</think>", starts_inside=True),
}


def get_format(name: str) -> ReasoningFormat:
    try:
        return FORMATS[name]
    except KeyError:
        raise ValueError(f"unknown reasoning parser {name!r}; known: {sorted(FORMATS)}") from None


def split_reasoning(text: str, fmt: ReasoningFormat) -> tuple[str | None, str]:
    """(reasoning_content, content) of a whole output; reasoning None when there is none."""
    stream = ReasoningStream(fmt)
    reasoning, content = stream.feed(text)
    r2, c2 = stream.finish()
    reasoning, content = reasoning + r2, content + c2
    return (reasoning if stream.saw_reasoning else None), content


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest suffix of text that is a proper prefix of tag."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


@dataclass
class ReasoningStream:
    """Split a stream of text deltas: `feed(delta) -> (reasoning delta, content delta)`, then
    `finish()` for what was held back."""

    fmt: ReasoningFormat
    inside: bool = field(init=False)
    at_start: bool = field(init=False, default=True)  # nothing but whitespace seen yet
    saw_reasoning: bool = field(init=False)
    pending: str = field(init=False, default="")
    after_end: bool = field(init=False, default=False)  # whitespace right after the end tag

    def __post_init__(self) -> None:
        self.inside = self.fmt.starts_inside
        self.saw_reasoning = self.fmt.starts_inside

    def feed(self, delta: str) -> tuple[str, str]:
        text = self.pending + delta
        self.pending = ""
        reasoning, content = [], []
        while text:
            if self.at_start:  # a start tag counts only before any other text
                stripped = text.lstrip()
                if not stripped:
                    self.pending = text
                    break
                if stripped.startswith(self.fmt.start):
                    text = stripped[len(self.fmt.start) :]
                    self.inside = self.saw_reasoning = True
                    self.at_start = False
                    continue
                if self.fmt.start.startswith(stripped):  # maybe the tag, not complete yet
                    self.pending = text
                    break
                self.at_start = False
                continue
            if self.inside:
                i = text.find(self.fmt.end)
                if i < 0:
                    keep = _partial_suffix(text, self.fmt.end)
                    reasoning.append(text[: len(text) - keep])
                    self.pending = text[len(text) - keep :]
                    break
                reasoning.append(text[:i])
                text = text[i + len(self.fmt.end) :]
                self.inside, self.after_end = False, True
                continue
            if self.after_end:  # the blank lines between the reasoning and the answer
                text = text.lstrip()
                if not text:
                    break
                self.after_end = False
            content.append(text)
            break
        return "".join(reasoning), "".join(content)

    def finish(self) -> tuple[str, str]:
        """What was held back: inside the reasoning it was reasoning, else content."""
        rest, self.pending = self.pending, ""
        return (rest, "") if self.inside else ("", rest)
