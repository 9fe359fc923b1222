"""Reasoning separation on canned outputs: whole texts and the same texts streamed in every
split into two deltas and in single characters give the same reasoning and content."""

from __future__ import annotations

import pytest

from srt.parsers.reasoning import ReasoningStream, get_format, split_reasoning

CASES = [
    # (format, output, reasoning, content)
    ("qwen3", "<think>\nThe user greets me.\n</think>\n\nHello!", "\nThe user greets me.\n",
     "Hello!"),
    ("qwen3", "Hello without thinking.", None, "Hello without thinking."),
    ("qwen3", "  <think>a < b and </thin k> is not a tag</think>ok", "a < b and </thin k> is "
     "not a tag", "ok"),
    ("qwen3", "<think>cut short", "cut short", ""),
    ("qwen3", "<thinking> is not the tag", None, "<thinking> is not the tag"),
    ("qwen3", "text <think>late tag</think> stays", None, "text <think>late tag</think> stays"),
    ("deepseek-r1", "Let me think: 2 + 2 = 4.</think>\n\nThe answer is 4.",
     "Let me think: 2 + 2 = 4.", "The answer is 4."),
    ("deepseek-r1", "<think>\nopened again</think>answer", "\nopened again", "answer"),
    ("deepseek-r1", "never closed", "never closed", ""),
]


def _streamed(fmt_name: str, pieces: list[str]) -> tuple[str | None, str]:
    stream = ReasoningStream(get_format(fmt_name))
    reasoning, content = "", ""
    for p in pieces:
        r, c = stream.feed(p)
        reasoning, content = reasoning + r, content + c
    r, c = stream.finish()
    return (reasoning + r if stream.saw_reasoning else None), content + c


@pytest.mark.parametrize("fmt,text,reasoning,content", CASES)
def test_whole_and_streamed(fmt: str, text: str, reasoning: str | None, content: str) -> None:
    assert split_reasoning(text, get_format(fmt)) == (reasoning, content)
    assert _streamed(fmt, list(text)) == (reasoning, content)
    for i in range(len(text) + 1):
        assert _streamed(fmt, [text[:i], text[i:]]) == (reasoning, content), i


def test_no_delta_shows_part_of_a_tag() -> None:
    stream = ReasoningStream(get_format("qwen3"))
    seen = [stream.feed(ch) for ch in "<think>ab</think>cd"]
    for r, c in seen:
        assert "<" not in r and "<" not in c and ">" not in r + c


def test_unknown_format() -> None:
    with pytest.raises(ValueError, match="qwen3"):
        get_format("nope")
