"""`POST /tokenize` and `POST /detokenize` in SGLang's shapes.

/tokenize takes `prompt` (a string or a list of strings) or `messages` (a chat, rendered by the
chat template as for /v1/chat/completions; `add_generation_prompt` passed to the template,
default true) and answers {"tokens", "count", "max_model_len"}: a list of ids and its length for
one prompt, lists of them for a list. `add_special_tokens` (default true) applies to `prompt`.
/detokenize takes `tokens` (a list of ids, or a list of such lists) and `skip_special_tokens`
(default true) and answers {"text"}: a string, or a list of them.
"""

from __future__ import annotations

from typing import Any

from srt import field_policy
from srt.field_policy import Surface
from srt.managers.openai_api import OpenAIAdapter, bool_field
from srt.managers.request_types import RequestError, checked_fields
from srt.sampling_params import is_valid_utf8


def _fields(body: Any, surface: Surface, adapter: OpenAIAdapter) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object", None, "invalid_type")
    body = checked_fields(surface, body)
    adapter.tm.check_model(body.get("model"))
    return body


def tokenize(adapter: OpenAIAdapter, body: Any) -> dict[str, Any]:
    body = _fields(body, field_policy.TOKENIZE, adapter)
    tm = adapter.tm
    prompt, messages = body.get("prompt"), body.get("messages")
    if (prompt is None) == (messages is None):
        raise RequestError("give exactly one of prompt and messages", "prompt")
    if messages is not None:
        ids, _ = adapter.render.chat_ids(messages, bool_field(body, "add_generation_prompt", True))
        return {"tokens": ids, "count": len(ids), "max_model_len": tm.limits.context_length}
    special = bool_field(body, "add_special_tokens", True)
    prompts = [prompt] if isinstance(prompt, str) else prompt
    if not isinstance(prompts, list) or not prompts \
            or not all(isinstance(p, str) and is_valid_utf8(p) for p in prompts):
        raise RequestError("prompt must be a string or a non-empty list of strings", "prompt",
                           "invalid_type")
    tokens = [list(tm.tokenizer.encode(p, add_special_tokens=special)) for p in prompts]
    if isinstance(prompt, str):
        return {"tokens": tokens[0], "count": len(tokens[0]),
                "max_model_len": tm.limits.context_length}
    return {"tokens": tokens, "count": [len(t) for t in tokens],
            "max_model_len": tm.limits.context_length}


def detokenize(adapter: OpenAIAdapter, body: Any) -> dict[str, Any]:
    body = _fields(body, field_policy.DETOKENIZE, adapter)
    tm = adapter.tm
    tokens = body.get("tokens")
    vocab = tm.limits.vocab_size

    def is_ids(x: Any) -> bool:
        return isinstance(x, list) and all(
            isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab for t in x)

    if is_ids(tokens):
        batch, single = [tokens], True
    elif isinstance(tokens, list) and tokens and all(is_ids(t) for t in tokens):
        batch, single = tokens, False
    else:
        raise RequestError(f"tokens must be a list of token ids in [0, {vocab}), or a list of "
                           "such lists", "tokens", "invalid_type")
    skip = bool_field(body, "skip_special_tokens", True)
    texts = [tm.tokenizer.decode(ids, skip_special_tokens=skip) for ids in batch]
    return {"text": texts[0] if single else texts}
