"""An OpenAI chat conversation to the prompt's token ids through the chat template: message
checks, text and image parts, tool fields, and the template for conversations with tools."""

from __future__ import annotations

from typing import Any

from srt.chat_templates import tools_fallback
from srt.managers.request_types import RequestError
from srt.managers.tool_request import template_message


def _image_url(value: Any, index: int) -> str:
    """An image_url part's URL ({"url": ...}, or the URL itself)."""
    url = value.get("url") if isinstance(value, dict) else value
    if not isinstance(url, str) or not url:
        raise RequestError(f"messages[{index}]: an image_url part needs image_url.url",
                           "messages", "invalid_type")
    return url


def _inline(parts: list[dict[str, str]], image_text: str) -> str:
    """A message's parts as one string, the image part replaced by image_text."""
    return "".join(p["text"] if p["type"] == "text" else image_text for p in parts)



class ChatRenderer:
    def __init__(self, tm: Any, chat_template: str | None) -> None:
        """`tm`: the TokenizerManager (its tokenizer and limits); chat_template: the template
        text (None: the tokenizer's)."""
        self.tm = tm
        self.chat_template = chat_template

    def template_for(self, with_tools: bool) -> str | None:
        """The chat template of a conversation: --chat-template if given; for one with tools
        (definitions, calls or results) on a tokenizer whose chatml template cannot render
        them, the built-in chatml-tools; else the tokenizer's (None)."""
        if self.chat_template is not None or not with_tools:
            return self.chat_template
        return tools_fallback(getattr(self.tm.tokenizer, "chat_template", None))

    def chat_ids(self, messages: Any, add_generation_prompt: bool = True,
                 tools: list[dict[str, Any]] | None = None) -> tuple[list[int], str | None]:
        """The templated prompt's token ids, and the URL of its image (at most one per
        request: an `image_url` part of a user message), or None. `tools` (OpenAI's tool
        definitions) are given to the template."""
        if not isinstance(messages, list) or not messages:
            raise RequestError("messages must be a non-empty list", "messages", "invalid_type")
        # Each message as a list of parts: {"type": "text", "text"} or {"type": "image"}.
        parts_per_message: list[list[dict[str, str]]] = []
        extras: list[dict[str, Any]] = []  # each message's tool fields, for the template
        images: list[str] = []
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or m.get("role") not in ("system", "user", "assistant",
                                                                "tool"):
                raise RequestError(f"messages[{i}] needs a role of system, user, assistant or "
                                   "tool", "messages", "invalid_value")
            extras.append(template_message(m, i))
            content = m.get("content")
            if content is None and "tool_calls" in extras[-1]:
                content = ""  # an assistant message that only calls tools
            if isinstance(content, str):
                parts_per_message.append([{"type": "text", "text": content}])
                continue
            if not isinstance(content, list):
                raise RequestError(f"messages[{i}].content must be a string or a list of parts",
                                   "messages", "invalid_type")
            parts = []
            for p in content:
                if isinstance(p, dict) and p.get("type") == "text" and isinstance(
                        p.get("text"), str):
                    parts.append({"type": "text", "text": p["text"]})
                elif isinstance(p, dict) and p.get("type") == "image_url" \
                        and m["role"] == "user":
                    images.append(_image_url(p.get("image_url"), i))
                    parts.append({"type": "image"})
                else:
                    raise RequestError(f"messages[{i}].content: only text parts, and image_url "
                                       "parts in user messages, are supported", "messages",
                                       "unsupported")
            parts_per_message.append(parts)
        if len(images) > 1:
            raise RequestError("at most one image per request is supported", "messages",
                               "unsupported")
        roles = [m["role"] for m in messages]
        template = self.template_for(bool(tools) or any(extras))

        def render(contents: list[Any]) -> list[int]:
            conversation = [{"role": r, "content": c, **x}
                            for r, c, x in zip(roles, contents, extras)]
            return self._apply_template(conversation, template, add_generation_prompt, tools)

        if not images:
            return render([_inline(p, "") for p in parts_per_message]), None
        token = self.tm.limits.image_token_id
        if token is None:
            raise RequestError("this model does not take images", "messages", "unsupported")
        # A template written for images renders {"type": "image"} parts itself; for one that
        # takes plain strings, the image token's text goes where the image part was.
        try:
            ids = render(parts_per_message)
            if ids.count(token) == 1:
                return ids, images[0]
        except RequestError:
            pass
        text = self.tm.tokenizer.convert_ids_to_tokens(token)
        return render([_inline(p, text) for p in parts_per_message]), images[0]

    def _apply_template(self, conversation: list[dict[str, Any]], template: str | None,
                        add_generation_prompt: bool,
                        tools: list[dict[str, Any]] | None) -> list[int]:
        try:
            ids = self.tm.tokenizer.apply_chat_template(
                conversation, add_generation_prompt=add_generation_prompt,
                chat_template=template, tools=tools or None
            )
        except Exception as e:  # no template, or the template rejected the conversation
            raise RequestError(f"the chat template failed: {e}", "messages") from None
        return list(ids["input_ids"] if hasattr(ids, "keys") else ids)
