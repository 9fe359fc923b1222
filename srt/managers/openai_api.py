"""OpenAI-compatible endpoints on top of the TokenizerManager.

`/v1/completions` and `/v1/chat/completions` are translated into native /generate requests, so
they share one validation path (errors keep OpenAI's field names) and one way to run requests.
Fields that are not implemented (suffix, logit_bias, ...: srt/field_policy.py) are
accepted only at a no-op value and otherwise refused with a 400 naming the field, as are best_of
> n and more than one image. Chat takes one `image_url` part in a user
message (for a model with images); the chat template places the image token.

Chat takes OpenAI's tools (`tools`, `tool_choice`, `parallel_tool_calls`; assistant messages
with `tool_calls`, `tool` messages): the tool fields become a ToolPlan (tool_request.py) whose
constraint, if any, joins the sampling parameters, and each choice's text becomes a message or
deltas in chat_choice.py, with the reasoning separated by `--reasoning-parser` (unless the
request sets `separate_reasoning: false`).

Logprobs come from the native ones (the model's distribution: log_softmax of the raw logits).
Completions: `logprobs` (0..20) gives {tokens, token_logprobs, top_logprobs, text_offset}, with
`echo` the prompt's tokens first (the first without a logprob); text_offset is where each token's
text (decoded alone) starts in the choice's text. Chat: `logprobs: true` and `top_logprobs` (0..20)
give {"content": [{token, logprob, bytes, top_logprobs}]}. A stream carries in each chunk the
logprobs of the tokens that are new in it. A request aborted while it streams (POST
/abort_request with its `rid`) ends its stream with one `data: {"error": ...}` event.
"""

from __future__ import annotations

import contextlib
import json
import time
import uuid
from typing import Any, AsyncIterator, Awaitable, Callable

from srt import field_policy
from srt.constrained.fsm import JSON_OBJECT_REGEX
from srt.field_policy import Surface
from srt.managers.chat_choice import ChoiceOptions, ChoiceOutput
from srt.managers.chat_render import ChatRenderer
from srt.managers.model_cards import ModelCards
from srt.managers.token_bytes import TokenBytes
from srt.managers.tool_request import plan_tools
from srt.parsers.reasoning import get_format
from srt.managers.request_types import (
    MAX_TOP_LOGPROBS,
    ParsedRequest,
    RequestError,
    checked_fields,
)
from srt.managers.tokenizer_manager import TokenizerManager

# native name -> OpenAI name, for error messages (the prompt's name is set per endpoint)
_FIELD_NAMES = {"max_new_tokens": "max_tokens", "min_new_tokens": "min_tokens"}
# OpenAI / SGLang-extra field -> native sampling parameter
_SAMPLING_FIELDS = {
    "temperature": "temperature", "top_p": "top_p", "n": "n", "stop": "stop", "seed": "seed",
    "presence_penalty": "presence_penalty", "frequency_penalty": "frequency_penalty",
    "top_k": "top_k", "min_p": "min_p", "ignore_eos": "ignore_eos",
    "stop_token_ids": "stop_token_ids", "min_tokens": "min_new_tokens",
    "skip_special_tokens": "skip_special_tokens", "repetition_penalty": "repetition_penalty",
    "no_stop_trim": "no_stop_trim", "regex": "regex", "json_schema": "json_schema",
    "stop_regex": "stop_regex", "ebnf": "ebnf",
}


def _response_format(value: Any) -> dict[str, Any]:
    """response_format -> the native constraint parameter it means ({} for plain text)."""
    if value is None:
        return {}
    if not isinstance(value, dict) or not isinstance(value.get("type"), str):
        raise RequestError("response_format must be an object with a type", "response_format",
                           "invalid_type")
    kind = value["type"]
    if kind == "text":
        return {}
    if kind == "json_object":
        return {"regex": JSON_OBJECT_REGEX}
    if kind == "json_schema":
        spec = value.get("json_schema")
        schema = spec.get("schema") if isinstance(spec, dict) else None
        if not isinstance(schema, dict):
            raise RequestError("response_format json_schema needs json_schema.schema (an "
                               "object)", "response_format", "invalid_type")
        return {"json_schema": schema}
    raise RequestError(f"response_format type {kind!r} is not supported (text, json_object, "
                       "json_schema)", "response_format", "unsupported")


def _new_text(sent: list[str], sent_len: int, text: str, start: int) -> str:
    """The text to send after `sent` (the pieces sent so far) when the request's text from
    `start` on became `text`: the detokenizer only extends what it showed, except that a final
    decode may differ inside it; then only an extension of what was sent is sent."""
    if start == sent_len:
        return text
    if start > sent_len:  # (not produced: the text before `start` was all sent)
        return ""
    before = "".join(sent)
    full = before[:start] + text
    return full[sent_len:] if full.startswith(before) else ""


def _finish_reason(reason: dict[str, Any] | None) -> str | None:
    if reason is None:
        return None
    return {"length": "length", "stop": "stop"}.get(reason["type"], "abort")


def bool_field(body: dict[str, Any], name: str, default: bool) -> bool:
    """An optional boolean field (null: default); RequestError if it is not a boolean."""
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise RequestError(f"{name} must be a boolean", name, "invalid_type")
    return value


class OpenAIAdapter:
    def __init__(self, tm: TokenizerManager, served_model_name: str,
                 chat_template: str | None, tool_call_parser: str = "hermes",
                 reasoning_parser: str | None = None) -> None:
        """chat_template: the template text (None: the tokenizer's). tool_call_parser reads
        the calls of tool_choice auto; reasoning_parser (None: off) separates reasoning."""
        self.tm = tm
        self.model = served_model_name
        self.cards = ModelCards(served_model_name, tm)
        self.render = ChatRenderer(tm, chat_template)
        self.tool_call_parser = tool_call_parser
        self.reasoning = get_format(reasoning_parser) if reasoning_parser else None
        self._token_bytes: TokenBytes | None = None

    def token_bytes(self, token_id: int, text: str) -> list[int]:
        if self._token_bytes is None:  # built at the first chat request with logprobs
            self._token_bytes = TokenBytes(self.tm.tokenizer)
        return self._token_bytes(token_id, text)

    # ------------------------------------------------------------------ parsing

    def _common(self, body: Any, surface: Surface) -> dict[str, Any]:
        if not isinstance(body, dict):
            raise RequestError("the request body must be a JSON object", None, "invalid_type")
        model = body.get("model")
        if not isinstance(model, str):
            raise RequestError("model must be a string", "model", "invalid_type")
        adapter = self.cards.adapter_of(model)
        body = checked_fields(surface, body)
        self._check_best_of(body)
        stream = body.get("stream", False)
        if not isinstance(stream, bool):
            raise RequestError("stream must be a boolean", "stream", "invalid_type")
        options = body.get("stream_options") or {}
        if not isinstance(options, dict):
            raise RequestError("stream_options must be an object", "stream_options",
                               "invalid_type")
        params = {native: body[name] for name, native in _SAMPLING_FIELDS.items()
                  if body.get(name) is not None}
        fmt = _response_format(body.get("response_format"))
        if fmt and ("regex" in params or "json_schema" in params):
            raise RequestError("give at most one of response_format, regex and json_schema",
                               "response_format")
        params.update(fmt)
        extra = {"rid": body["rid"]} if body.get("rid") is not None else {}
        lora_path = body.get("lora_path")  # SGLang's field, beside `model`
        if lora_path is not None:
            if not isinstance(lora_path, str):
                raise RequestError("lora_path must be an adapter name", "lora_path",
                                   "invalid_type")
            if adapter is not None and lora_path != adapter:
                raise RequestError(f"model names the LoRA adapter {adapter!r} and lora_path "
                                   f"{lora_path!r}", "lora_path")
            adapter = lora_path
        if adapter is not None:
            extra["lora_path"] = adapter
        return {"stream": stream, "include_usage": bool(options.get("include_usage")),
                "params": params, "extra": extra}

    @staticmethod
    def _check_best_of(body: dict[str, Any]) -> None:
        best_of = body.get("best_of")
        if best_of is None:
            return
        if isinstance(best_of, bool) or not isinstance(best_of, int):
            raise RequestError("best_of must be an integer", "best_of", "invalid_type")
        n = body.get("n")
        n = n if isinstance(n, int) and not isinstance(n, bool) else 1
        if best_of < n:
            raise RequestError(f"best_of ({best_of}) must be >= n ({n})", "best_of")
        if best_of > n:
            raise RequestError("best_of > n (choosing the best samples on the server) is not "
                               "supported", "best_of", "unsupported")

    @staticmethod
    def _top_count(body: dict[str, Any], name: str) -> int | None:
        """An optional integer field in [0, MAX_TOP_LOGPROBS]."""
        value = body.get(name)
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, int):
            raise RequestError(f"{name} must be an integer", name, "invalid_type")
        if not 0 <= value <= MAX_TOP_LOGPROBS:
            raise RequestError(f"{name} must be in [0, {MAX_TOP_LOGPROBS}], got {value}", name)
        return value

    def _parse_native(self, native: dict[str, Any], names: dict[str, str]) -> ParsedRequest:
        """Run the native validation; errors are renamed to the endpoint's field names."""
        names = {**_FIELD_NAMES, **names}
        try:
            return self.tm.parse_generate_request(native)
        except RequestError as e:
            if e.param in names:
                raise RequestError(str(e).replace(e.param, names[e.param]),
                                   names[e.param], e.code, e.status) from None
            raise

    def parse_completion(self, body: Any) -> tuple[ParsedRequest, dict[str, Any]]:
        c = self._common(body, field_policy.COMPLETION)
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
        native.update(c["extra"])
        echo = body.get("echo", False)
        if not isinstance(echo, bool):
            raise RequestError("echo must be a boolean", "echo", "invalid_type")
        logprobs = self._top_count(body, "logprobs")
        if logprobs is not None:
            native.update(return_logprob=True, top_logprobs_num=logprobs,
                          return_text_in_logprobs=True, logprob_start_len=0 if echo else -1)
        parsed = self._parse_native(native, {"text": "prompt", "input_ids": "prompt",
                                             "top_logprobs_num": "logprobs"})
        c["echo"] = echo
        c["logprobs"] = logprobs is not None
        return parsed, c

    def parse_chat(self, body: Any) -> tuple[ParsedRequest, dict[str, Any]]:
        c = self._common(body, field_policy.CHAT)
        logprobs = body.get("logprobs")
        if logprobs is not None and not isinstance(logprobs, bool):
            raise RequestError("logprobs must be a boolean", "logprobs", "invalid_type")
        top = self._top_count(body, "top_logprobs")
        if top is not None and not logprobs:
            raise RequestError("top_logprobs needs logprobs: true", "top_logprobs")
        plan = plan_tools(body)
        if plan is not None and plan.constrained:
            if any(k in c["params"] for k in ("regex", "json_schema", "ebnf")):
                raise RequestError(f"tool_choice {plan.choice!r} constrains the output itself; "
                                   "it cannot be combined with response_format, regex, "
                                   "json_schema or ebnf", "tool_choice")
            c["params"].update(plan.constraint())
        separate = bool_field(body, "separate_reasoning", True)
        # A constrained tool answer is JSON from its first token: it has no reasoning.
        reasoning = self.reasoning if separate and not (plan and plan.constrained) else None
        c["choice"] = ChoiceOptions(plan, self.tool_call_parser, reasoning,
                                    bool_field(body, "stream_reasoning", True))
        ids, image = self.render.chat_ids(body.get("messages"),
                                   tools=list(plan.tools) if plan is not None else None)
        # max_completion_tokens, unless it is absent or null (SGLang's gateway sends both)
        budget_name = "max_completion_tokens" if body.get("max_completion_tokens") is not None \
            else "max_tokens"
        max_tokens = body.get(budget_name)
        if max_tokens is None:  # OpenAI's default: as much as the context leaves
            limits = self.tm.limits
            # an image fills image_tokens positions in place of its one token
            prompt_len = len(ids) + (limits.image_tokens - 1 if image is not None else 0)
            max_tokens = max(0, min(limits.context_length, limits.max_total_num_tokens)
                             - prompt_len)
        native = {"input_ids": ids, "sampling_params": {**c["params"], "max_new_tokens": max_tokens},
                  "stream": c["stream"], **c["extra"]}
        if image is not None:
            native["image_data"] = image
        if logprobs:
            native.update(return_logprob=True, top_logprobs_num=top or 0,
                          return_text_in_logprobs=True)
        c["logprobs"] = bool(logprobs)
        return self._parse_native(native, {"input_ids": "messages", "image_data": "messages",
                                           "max_new_tokens": budget_name,
                                           "json_schema": "tools"
                                           if plan is not None and plan.constrained
                                           else "json_schema"}), c

    async def load_images(self, parsed: ParsedRequest) -> None:
        """TokenizerManager.load_images; a bad image is a 400 naming `messages`."""
        try:
            await self.tm.load_images(parsed)
        except RequestError as e:
            if e.param != "image_data":
                raise
            raise RequestError(f"the image_url part: {e}", "messages", e.code, e.status) from None

    # ------------------------------------------------------------------ answers

    def _usage(self, parsed: ParsedRequest, completion_tokens: int) -> dict[str, int]:
        # prompt tokens count once per prompt, not once per sample
        prompts = {(r.group or r.rid): r.prompt_len for r in parsed.reqs}
        prompt_tokens = sum(prompts.values())
        return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                "total_tokens": prompt_tokens + completion_tokens}

    def _prompt_text(self, parsed: ParsedRequest, index: int) -> str:
        return self.tm.tokenizer.decode(parsed.reqs[index].input_ids)

    # ------------------------------------------------------------------ logprobs

    @staticmethod
    def _completion_logprobs(tokens: list[list[Any]], tops: list[Any],
                             offset: int) -> dict[str, Any]:
        """Native [logprob, id, text] entries -> the completions logprobs object; offset is where
        the first token's text starts in the choice's text."""
        offsets = []
        for t in tokens:
            offsets.append(offset)
            offset += len(t[2])
        top_dicts: list[dict[str, float] | None] = []
        for top in tops:
            if top is None:
                top_dicts.append(None)
                continue
            d: dict[str, float] = {}
            for value, _, text in top:  # most likely first: keep it when two texts are equal
                d.setdefault(text, value)
            top_dicts.append(d)
        return {"tokens": [t[2] for t in tokens], "token_logprobs": [t[0] for t in tokens],
                "top_logprobs": top_dicts, "text_offset": offsets}

    def _chat_logprobs(self, tokens: list[list[Any]], tops: list[Any]) -> dict[str, Any]:
        def entry(value: float, token_id: int, text: str) -> dict[str, Any]:
            return {"token": text, "logprob": value, "bytes": self.token_bytes(token_id, text)}

        content = [{**entry(*t), "top_logprobs": [entry(*x) for x in top or []]}
                   for t, top in zip(tokens, tops)]
        return {"content": content, "refusal": None}

    # ------------------------------------------------------------------ answers

    async def completion(self, parsed: ParsedRequest, c: dict[str, Any],
                         is_disconnected: Callable[[], Awaitable[bool]]) -> dict[str, Any] | None:
        results = await self.tm.wait_all(parsed, is_disconnected)
        if results is None:
            return None
        choices = []
        for i, r in enumerate(results):
            meta = r["meta_info"]
            text = (self._prompt_text(parsed, i) if c["echo"] else "") + r["text"]
            logprobs = None
            if c["logprobs"]:
                prompt = ([], [])
                if c["echo"]:
                    prompt = (meta["input_token_logprobs"], meta["input_top_logprobs"])
                logprobs = self._completion_logprobs(
                    prompt[0] + meta["output_token_logprobs"],
                    prompt[1] + meta["output_top_logprobs"], 0)
            choices.append({"index": i, "text": text, "logprobs": logprobs,
                            "finish_reason": _finish_reason(meta["finish_reason"])})
        return {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion",
                "created": int(time.time()), "model": self.model, "choices": choices,
                "usage": self._usage(parsed, sum(len(r["output_ids"]) for r in results))}

    async def chat(self, parsed: ParsedRequest, c: dict[str, Any],
                   is_disconnected: Callable[[], Awaitable[bool]]) -> dict[str, Any] | None:
        results = await self.tm.wait_all(parsed, is_disconnected)
        if results is None:
            return None
        choices = []
        for i, r in enumerate(results):
            meta = r["meta_info"]
            logprobs = None
            if c["logprobs"]:
                logprobs = self._chat_logprobs(meta["output_token_logprobs"],
                                               meta["output_top_logprobs"])
            out = ChoiceOutput(c["choice"])
            choices.append({"index": i, "message": out.message(r["text"]),
                            "logprobs": logprobs,
                            "finish_reason": out.finish_reason(
                                _finish_reason(meta["finish_reason"]))})
        return {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion",
                "created": int(time.time()), "model": self.model, "choices": choices,
                "usage": self._usage(parsed, sum(len(r["output_ids"]) for r in results))}

    async def stream(self, parsed: ParsedRequest, c: dict[str, Any], chat: bool,
                     is_disconnected: Callable[[], Awaitable[bool]]) -> AsyncIterator[bytes]:
        """SSE chunks: per choice (chat: a first chunk with the role; completions with echo: a
        first chunk with the prompt) the text deltas with the logprobs of their new tokens (chat:
        the deltas of ChoiceOutput: content, reasoning_content, tool_calls), a chunk with the
        finish reason; then the usage chunk when asked for, then [DONE]. An aborted request
        ends the stream with one error event instead."""
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        created = int(time.time())
        obj = "chat.completion.chunk" if chat else "text_completion"

        def event(body: dict[str, Any]) -> bytes:
            return f"data: {json.dumps(body, ensure_ascii=False)}\n\n".encode()

        def chunk(index: int, delta: str | dict[str, Any] | None, finish: str | None,
                  logprobs: dict[str, Any] | None = None) -> bytes:
            if chat:  # delta: a chat delta object
                choice = {"index": index, "delta": delta or {}, "logprobs": logprobs,
                          "finish_reason": finish}
            else:
                choice = {"index": index, "text": delta or "", "logprobs": logprobs,
                          "finish_reason": finish}
            return event({"id": rid, "object": obj, "created": created, "model": self.model,
                          "choices": [choice]})

        n = len(parsed.reqs)
        sent: list[list[str]] = [[] for _ in range(n)]  # the text sent per choice, in pieces
        sent_len = [0] * n
        text_offset = [0] * n  # completions: where the next token's text starts
        started = [False] * n
        completion_tokens = [0] * n
        outputs = [ChoiceOutput(c["choice"]) for _ in range(n)] if chat else []

        def logprobs_of(index: int, tokens: list[list[Any]], tops: list[Any]) -> dict[str, Any]:
            if chat:
                return self._chat_logprobs(tokens, tops)
            lp = self._completion_logprobs(tokens, tops, text_offset[index])
            text_offset[index] += sum(len(t[2]) for t in tokens)
            return lp

        if chat:
            for i in range(n):
                yield chunk(i, {"role": "assistant", "content": ""}, None)
        # aclosing: a client that leaves closes this generator; the requests are aborted now.
        async with contextlib.aclosing(self.tm.stream_all(parsed, is_disconnected,
                                                          deltas=True)) as items:
            async for index, item in items:
                meta = item["meta_info"]
                if meta["finish_reason"] is not None and meta["finish_reason"]["type"] == "abort":
                    # The other choices are aborted when `items` closes.
                    yield event({"error": {"message": meta["finish_reason"]["message"],
                                           "type": "server_error", "param": None,
                                           "code": "request_aborted"}})
                    return
                if not chat and c.get("echo") and not started[index]:
                    lp = None
                    if c["logprobs"]:
                        lp = logprobs_of(index, meta["input_token_logprobs"],
                                         meta["input_top_logprobs"])
                    yield chunk(index, self._prompt_text(parsed, index), None, logprobs=lp)
                started[index] = True
                delta = _new_text(sent[index], sent_len[index], item["text"], item["text_start"])
                if delta:
                    sent[index].append(delta)
                    sent_len[index] += len(delta)
                completion_tokens[index] = meta["completion_tokens"]
                finish = _finish_reason(meta["finish_reason"])
                lp = None
                if c["logprobs"] and meta["output_token_logprobs"]:  # (the new entries)
                    lp = logprobs_of(index, meta["output_token_logprobs"],
                                     meta["output_top_logprobs"])
                if not chat:
                    if delta or lp is not None:
                        yield chunk(index, delta, None, logprobs=lp)
                    if finish is not None:
                        yield chunk(index, None, finish)
                    continue
                out = outputs[index]
                deltas = out.feed(delta) + (out.finish() if finish is not None else [])
                if lp is not None and not deltas:  # the text is held: its logprobs go now
                    deltas = [{}]
                for k, d in enumerate(deltas):
                    yield chunk(index, d, None, logprobs=lp if k == 0 else None)
                if finish is not None:
                    yield chunk(index, None, out.finish_reason(finish))
        if c.get("include_usage"):
            yield event({"id": rid, "object": obj, "created": created, "model": self.model,
                         "choices": [], "usage": self._usage(parsed, sum(completion_tokens))})
        yield b"data: [DONE]\n\n"
