"""Chat templates shipped with srt, selectable by name with `--chat-template NAME`.

`chatml-tools`: chatml with function calling in the Hermes / Qwen2.5 layout (the tools as JSON
inside `<tools></tools>` in the system turn, calls as `<tool_call>{"name", "arguments"}</tool_call>`,
results as `<tool_response>` in a user turn); the `hermes` tool-call parser reads its calls.
Without tools it renders what SmolLM2-Instruct's chatml template renders, so the default model
answers the same as with its own template.
"""

from __future__ import annotations

import os

_DIR = os.path.dirname(os.path.abspath(__file__))
BUILTIN = {"chatml-tools": "chatml_tools.jinja"}


def builtin_template(name: str) -> str | None:
    """The text of the built-in template `name`, or None if there is none by that name."""
    file = BUILTIN.get(name)
    if file is None:
        return None
    with open(os.path.join(_DIR, file)) as f:
        return f.read()


def load_template(value: str) -> str:
    """`--chat-template`: a built-in name, else a Jinja file's path. OSError if neither."""
    text = builtin_template(value)
    if text is not None:
        return text
    with open(value) as f:
        return f.read()


def supports_tools(template: str | None) -> bool:
    """Whether a template renders the `tools` it is given (it names the variable)."""
    return template is not None and "tools" in template


def tools_fallback(template: str | None) -> str | None:
    """The template to render a request with tools when `template` (the tokenizer's) cannot:
    the built-in chatml one for a chatml template, else None (the request is rendered with
    `template` and the model sees no tool definitions)."""
    if template is None or supports_tools(template) or "<|im_start|>" not in template:
        return None
    return builtin_template("chatml-tools")
