"""OpenAI-compatible endpoints on top of the TokenizerManager.

`/v1/completions` and `/v1/chat/completions` are translated into native /generate requests, so
they share one validation path (errors keep OpenAI's field names) and one way to run requests.
Fields that are accepted but not yet implemented (logprobs, tools, response formats) are refused
with a 400 naming the field rather than ignored.
"""

from __future__ import annotations

import contextlib
import json
import time
import uuid
from typing import Any, AsyncIterator, Awaitable, Callable

from srt.managers.tokenizer_manager import ParsedRequest, RequestError, TokenizerManager

# native name -> OpenAI name, for error messages
_FIELD_NAMES = {"max_new_tokens": "max_tokens", "min_new_tokens": "min_tokens",
                "text": "prompt", "input_ids": "prompt"}
# OpenAI / SGLang-extra field -> native sampling parameter
_SAMPLING_FIELDS = {
    "temperature": "temperature", "top_p": "top_p", "n": "n", "stop": "stop", "seed": "seed",
    "presence_penalty": "presence_penalty", "frequency_penalty": "frequency_penalty",
    "top_k": "top_k", "min_p": "min_p", "ignore_eos": "ignore_eos",
    "stop_token_ids": "stop_token_ids", "min_tokens": "min_new_tokens",
    "skip_special_tokens": "skip_special_tokens", "repetition_penalty": "repetition_penalty",
    "no_stop_trim": "no_stop_trim",
}
_IGNORED = {"user", "metadata", "store", "service_tier", "stream_options", "model", "stream",
            "max_tokens", "max_completion_tokens"}
_NOT_YET = {"logprobs", "top_logprobs", "tools", "tool_choice", "functions", "function_call",
            "response_format", "logit_bias", "suffix", "regex", "json_schema"}


def _finish_reason(reason: dict[str, Any] | None) -> str | None:
    if reason is None:
        return None
    return {"length": "length", "stop": "stop"}.get(reason["type"], "abort")


class OpenAIAdapter:
    def __init__(self, tm: TokenizerManager, served_model_name: str,
                 chat_template: str | None) -> None:
        self.tm = tm
        self.model = served_model_name
        self.chat_template = chat_template

    def models(self) -> dict[str, Any]:
        return {"object": "list", "data": [
            {"id": self.model, "object": "model", "created": 0, "owned_by": "srt"}]}

    # ------------------------------------------------------------------ parsing

    def _common(self, body: Any, endpoint_fields: set[str]) -> dict[str, Any]:
        if not isinstance(body, dict):
            raise RequestError("the request body must be a JSON object", None, "invalid_type")
        model = body.get("model")
        if not isinstance(model, str):
            raise RequestError("model must be a string", "model", "invalid_type")
        if model not in (self.model, "default"):
            raise RequestError(f"the model {model!r} does not exist; this server serves "
                               f"{self.model!r}", "model", "model_not_found", status=404)
        for name in sorted(set(body) & _NOT_YET):
            value = body[name]
            if name == "logprobs" and value in (None, False, 0) and "top_logprobs" not in body:
                continue
            if name in ("tools", "functions") and not value:
                continue
            if name in ("tool_choice", "function_call") and value in (None, "none"):
                continue
            raise RequestError(f"{name} is not supported yet", name, "unsupported")
        if "best_of" in body and body["best_of"] not in (None, 1, body.get("n", 1)):
            raise RequestError("best_of other than n is not supported", "best_of", "unsupported")
        unknown = sorted(set(body) - _IGNORED - set(_SAMPLING_FIELDS) - endpoint_fields
                         - {"best_of"})
        if unknown:
            raise RequestError(f"unknown field {unknown[0]!r}", unknown[0], "unknown_field")
        stream = body.get("stream", False)
        if not isinstance(stream, bool):
            raise RequestError("stream must be a boolean", "stream", "invalid_type")
        options = body.get("stream_options") or {}
        if not isinstance(options, dict):
            raise RequestError("stream_options must be an object", "stream_options",
                               "invalid_type")
        params = {native: body[name] for name, native in _SAMPLING_FIELDS.items()
                  if body.get(name) is not None}
        return {"stream": stream, "include_usage": bool(options.get("include_usage")),
                "params": params}

    def _parse_native(self, native: dict[str, Any]) -> ParsedRequest:
        try:
            return self.tm.parse_generate_request(native)
        except RequestError as e:
            if e.param in _FIELD_NAMES:
                raise RequestError(str(e).replace(e.param, _FIELD_NAMES[e.param]),
                                   _FIELD_NAMES[e.param], e.code, e.status) from None
            raise

    def parse_completion(self, body: Any) -> tuple[ParsedRequest, dict[str, Any]]:
        c = self._common(body, {"prompt", "echo"})
        prompt = body.get("prompt")
        if isinstance(prompt, str) or (isinstance(prompt, list) and prompt
                                       and all(isinstance(p, str) for p in prompt)):
            native: dict[str, Any] = {"text": prompt}
        elif isinstance(prompt, list) and prompt:
            native = {"input_ids": prompt}
        else:
            raise RequestError("prompt must be a string, a list of strings, a list of token ids "
                               "or a list of such lists", "prompt", "invalid_type")
        max_tokens = body.get("max_tokens", 16)
        native["sampling_params"] = {**c["params"], "max_new_tokens": max_tokens}
        native["stream"] = c["stream"]
        echo = body.get("echo", False)
        if not isinstance(echo, bool):
            raise RequestError("echo must be a boolean", "echo", "invalid_type")
        parsed = self._parse_native(native)
        c["echo"] = echo
        return parsed, c

    def parse_chat(self, body: Any) -> tuple[ParsedRequest, dict[str, Any]]:
        c = self._common(body, {"messages"})
        ids = self._chat_ids(body.get("messages"))
        max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
        if max_tokens is None:  # OpenAI's default: as much as the context leaves
            limits = self.tm.limits
            max_tokens = max(0, min(limits.context_length, limits.max_total_num_tokens) - len(ids))
        native = {"input_ids": ids, "sampling_params": {**c["params"], "max_new_tokens": max_tokens},
                  "stream": c["stream"]}
        return self._parse_native(native), c

    def _chat_ids(self, messages: Any) -> list[int]:
        if not isinstance(messages, list) or not messages:
            raise RequestError("messages must be a non-empty list", "messages", "invalid_type")
        clean = []
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or m.get("role") not in ("system", "user", "assistant"):
                raise RequestError(f"messages[{i}] needs a role of system, user or assistant",
                                   "messages", "invalid_value")
            content = m.get("content")
            if isinstance(content, list):
                if not all(isinstance(p, dict) and p.get("type") == "text"
                           and isinstance(p.get("text"), str) for p in content):
                    raise RequestError(f"messages[{i}].content: only text parts are supported",
                                       "messages", "unsupported")
                content = "".join(p["text"] for p in content)
            if not isinstance(content, str):
                raise RequestError(f"messages[{i}].content must be a string or a list of text "
                                   "parts", "messages", "invalid_type")
            clean.append({"role": m["role"], "content": content})
        try:
            ids = self.tm.tokenizer.apply_chat_template(
                clean, add_generation_prompt=True, chat_template=self.chat_template
            )
        except ValueError as e:  # no template, or the template rejected the conversation
            raise RequestError(f"the chat template failed: {e}", "messages") from None
        return list(ids["input_ids"] if hasattr(ids, "keys") else ids)

    # ------------------------------------------------------------------ answers

    def _usage(self, parsed: ParsedRequest, completion_tokens: int) -> dict[str, int]:
        # prompt tokens count once per prompt, not once per sample
        prompts = {(r.group or r.rid): len(r.input_ids) for r in parsed.reqs}
        prompt_tokens = sum(prompts.values())
        return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                "total_tokens": prompt_tokens + completion_tokens}

    def _prompt_text(self, parsed: ParsedRequest, index: int) -> str:
        return self.tm.tokenizer.decode(parsed.reqs[index].input_ids)

    async def completion(self, parsed: ParsedRequest, c: dict[str, Any],
                         is_disconnected: Callable[[], Awaitable[bool]]) -> dict[str, Any] | None:
        results = await self.tm.wait_all(parsed, is_disconnected)
        if results is None:
            return None
        choices = []
        for i, r in enumerate(results):
            text = (self._prompt_text(parsed, i) if c["echo"] else "") + r["text"]
            choices.append({"index": i, "text": text, "logprobs": None,
                            "finish_reason": _finish_reason(r["meta_info"]["finish_reason"])})
        return {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion",
                "created": int(time.time()), "model": self.model, "choices": choices,
                "usage": self._usage(parsed, sum(len(r["output_ids"]) for r in results))}

    async def chat(self, parsed: ParsedRequest, c: dict[str, Any],
                   is_disconnected: Callable[[], Awaitable[bool]]) -> dict[str, Any] | None:
        results = await self.tm.wait_all(parsed, is_disconnected)
        if results is None:
            return None
        choices = [{"index": i, "message": {"role": "assistant", "content": r["text"]},
                    "logprobs": None,
                    "finish_reason": _finish_reason(r["meta_info"]["finish_reason"])}
                   for i, r in enumerate(results)]
        return {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion",
                "created": int(time.time()), "model": self.model, "choices": choices,
                "usage": self._usage(parsed, sum(len(r["output_ids"]) for r in results))}

    async def stream(self, parsed: ParsedRequest, c: dict[str, Any], chat: bool,
                     is_disconnected: Callable[[], Awaitable[bool]]) -> AsyncIterator[bytes]:
        """SSE chunks: text deltas (chat: a first chunk with the role), a chunk with the finish
        reason, the usage chunk when asked for, then [DONE]."""
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        created = int(time.time())
        obj = "chat.completion.chunk" if chat else "text_completion"

        def chunk(index: int, delta: str | None, finish: str | None,
                  role: bool = False) -> bytes:
            if chat:
                d: dict[str, Any] = {"role": "assistant", "content": ""} if role else (
                    {"content": delta} if delta else {})
                choice = {"index": index, "delta": d, "logprobs": None, "finish_reason": finish}
            else:
                choice = {"index": index, "text": delta or "", "logprobs": None,
                          "finish_reason": finish}
            body = {"id": rid, "object": obj, "created": created, "model": self.model,
                    "choices": [choice]}
            return f"data: {json.dumps(body, ensure_ascii=False)}\n\n".encode()

        sent = [""] * len(parsed.reqs)
        completion_tokens = [0] * len(parsed.reqs)
        if chat:
            for i in range(len(parsed.reqs)):
                yield chunk(i, None, None, role=True)
        elif c.get("echo"):
            for i in range(len(parsed.reqs)):
                yield chunk(i, self._prompt_text(parsed, i), None)
        # aclosing: a client that leaves closes this generator; the requests are aborted now.
        async with contextlib.aclosing(self.tm.stream_all(parsed, is_disconnected)) as items:
            async for index, item in items:
                text = item["text"]
                # Results are cumulative; send what is new. The detokenizer only ever extends the
                # text it showed, so the new text is a suffix.
                delta = text[len(sent[index]):] if text.startswith(sent[index]) else ""
                sent[index] = text if text.startswith(sent[index]) else sent[index]
                completion_tokens[index] = item["meta_info"]["completion_tokens"]
                finish = _finish_reason(item["meta_info"]["finish_reason"])
                if delta:
                    yield chunk(index, delta, None)
                if finish is not None:
                    yield chunk(index, None, finish)
        if c.get("include_usage"):
            body = {"id": rid, "object": obj, "created": created, "model": self.model,
                    "choices": [], "usage": self._usage(parsed, sum(completion_tokens))}
            yield f"data: {json.dumps(body)}\n\n".encode()
        yield b"data: [DONE]\n\n"
