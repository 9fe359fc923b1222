"""Request limits, checked in the HTTP process before any per-item work (tokenization, chat
templates, constraint compiles).

- `BodySizeMiddleware`: a body over `--max-request-body-bytes` is a 413, by its Content-Length
  before anything is read, or as soon as the bytes read pass the limit.
- `RequestLimits.check_generate` / `check_completion` / `check_chat`: counts and sizes of the raw
  JSON body (prompts per batch, n, top logprobs, stop strings and ids, regex and schema size) ->
  400 `limit_exceeded` naming the field. Only sizes are checked here: a value of the wrong type is
  left to the normal validation, which names it. Each returns the number of samples the request
  will hold, for the queue gate.
- `QueueGate`: past `--max-queued-requests` samples held at once, a 503 with Retry-After.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Callable

from srt.http.errors import ApiError, send_error

RETRY_AFTER_S = 1


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _limit(param: str, message: str) -> ApiError:
    return ApiError(400, message, param, "limit_exceeded")


@dataclass(frozen=True)
class RequestLimits:
    max_batch_prompts: int
    max_n: int
    max_top_logprobs: int
    max_stop_strings: int
    max_stop_string_length: int
    max_regex_length: int
    max_json_schema_bytes: int
    max_ebnf_bytes: int = 32768

    @classmethod
    def from_args(cls, args: Any) -> "RequestLimits":
        return cls(args.max_batch_prompts, args.max_n, args.max_top_logprobs,
                   args.max_stop_strings, args.max_stop_string_length, args.max_regex_length,
                   args.max_json_schema_bytes, args.max_ebnf_bytes)

    # ------------------------------------------------------------- shared pieces

    def _prompts(self, count: int, param: str) -> None:
        if count > self.max_batch_prompts:
            raise _limit(param, f"{param} has {count} prompts; at most {self.max_batch_prompts} "
                         "per request (--max-batch-prompts)")

    def _top(self, value: Any, param: str) -> None:
        values = value if isinstance(value, list) else [value]
        for v in values:
            if _is_int(v) and v > self.max_top_logprobs:
                raise _limit(param, f"{param} is {v}; at most {self.max_top_logprobs} "
                             "(--max-top-logprobs)")

    def _sampling(self, p: Any, names: dict[str, str]) -> int:
        """Check one sampling-parameter object (native names); return its n (1 if unusable)."""
        if not isinstance(p, dict):
            return 1
        name = names.get
        n = p.get("n")
        if _is_int(n) and n > self.max_n:
            raise _limit(name("n", "n"), f"n is {n}; at most {self.max_n} (--max-n)")
        stop = p.get("stop")
        stops = [stop] if isinstance(stop, str) else stop
        if isinstance(stops, list):
            if len(stops) > self.max_stop_strings:
                raise _limit(name("stop", "stop"), f"{len(stops)} stop strings; at most "
                             f"{self.max_stop_strings} (--max-stop-strings)")
            for s in stops:
                if isinstance(s, str) and len(s) > self.max_stop_string_length:
                    raise _limit(name("stop", "stop"), f"a stop string has {len(s)} "
                                 f"characters; at most {self.max_stop_string_length} "
                                 "(--max-stop-string-length)")
        ids = p.get("stop_token_ids")
        if isinstance(ids, list) and len(ids) > self.max_stop_strings:
            raise _limit(name("stop_token_ids", "stop_token_ids"), f"{len(ids)} stop token ids; "
                         f"at most {self.max_stop_strings} (--max-stop-strings)")
        regex = p.get("regex")
        if isinstance(regex, str) and len(regex) > self.max_regex_length:
            raise _limit(name("regex", "regex"), f"regex has {len(regex)} characters; at most "
                         f"{self.max_regex_length} (--max-regex-length)")
        self._schema(p.get("json_schema"), name("json_schema", "json_schema"))
        ebnf = p.get("ebnf")
        if isinstance(ebnf, str):
            size = len(ebnf.encode("utf-8", "surrogatepass"))
            if size > self.max_ebnf_bytes:
                raise _limit(name("ebnf", "ebnf"), f"ebnf has {size} bytes; at most "
                             f"{self.max_ebnf_bytes} (--max-ebnf-bytes)")
        return n if _is_int(n) and n >= 1 else 1

    def _schema(self, schema: Any, param: str) -> None:
        if isinstance(schema, str):
            size = len(schema.encode("utf-8", "surrogatepass"))
        elif isinstance(schema, (dict, list)):
            try:
                size = len(json.dumps(schema).encode("utf-8", "surrogatepass"))
            except (ValueError, RecursionError):
                return  # left to the normal validation
        else:
            return
        if size > self.max_json_schema_bytes:
            raise _limit(param, f"the JSON schema has {size} bytes; at most "
                         f"{self.max_json_schema_bytes} (--max-json-schema-bytes)")

    # ------------------------------------------------------------- per endpoint

    def check_generate(self, body: Any) -> int:
        """A /generate body. Returns the number of samples it asks for."""
        if not isinstance(body, dict):
            return 1
        text, input_ids = body.get("text"), body.get("input_ids")
        prompts = 1
        if isinstance(text, list):
            prompts = len(text)
            self._prompts(prompts, "text")
        elif isinstance(input_ids, list) and input_ids and isinstance(input_ids[0], list):
            prompts = len(input_ids)
            self._prompts(prompts, "input_ids")
        self._top(body.get("top_logprobs_num"), "top_logprobs_num")
        params = body.get("sampling_params")
        if isinstance(params, list):
            self._prompts(len(params), "sampling_params")
            return sum(self._sampling(p, {}) for p in params) or 1
        return prompts * self._sampling(params, {})

    def _openai_common(self, body: dict[str, Any]) -> int:
        fields = {k: body.get(k) for k in ("n", "stop", "stop_token_ids", "regex", "json_schema")}
        n = self._sampling(fields, {})
        fmt = body.get("response_format")
        if isinstance(fmt, dict) and isinstance(fmt.get("json_schema"), dict):
            self._schema(fmt["json_schema"].get("schema"), "response_format")
        return n

    def check_completion(self, body: Any) -> int:
        if not isinstance(body, dict):
            return 1
        prompt = body.get("prompt")
        prompts = 1
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            prompts = len(prompt)
            self._prompts(prompts, "prompt")
        self._top(body.get("logprobs"), "logprobs")
        return prompts * self._openai_common(body)

    def check_chat(self, body: Any) -> int:
        if not isinstance(body, dict):
            return 1
        self._top(body.get("top_logprobs"), "top_logprobs")
        return self._openai_common(body)


class QueueGate:
    """Admits a request only while the samples held (running or waiting) stay within the limit."""

    def __init__(self, max_queued: int, in_flight: Callable[[], int]) -> None:
        self.max_queued = max_queued
        self.in_flight = in_flight

    def admit(self, samples: int) -> None:
        if samples > self.max_queued:
            raise _limit("n", f"the request holds {samples} samples; at most {self.max_queued} "
                         "(--max-queued-requests)")
        held = self.in_flight()
        if held + samples > self.max_queued:
            raise ApiError(503, f"the server holds {held} requests (at most {self.max_queued}); "
                           "retry later", None, "queue_full",
                           {"Retry-After": str(RETRY_AFTER_S)})


class BodySizeMiddleware:
    """413 for a body over the limit (Content-Length, or counted as it is read)."""

    def __init__(self, app: Any, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    def _message(self, size: str) -> str:
        return (f"the request body has {size} bytes; at most {self.max_bytes} "
                "(--max-request-body-bytes)")

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        for name, value in scope.get("headers", []):
            if name.lower() == b"content-length":
                try:
                    length = int(value)
                except ValueError:
                    await send_error(send, 400, "invalid Content-Length", None,
                                     "invalid_content_length")
                    return
                if length > self.max_bytes:
                    await send_error(send, 413, self._message(str(length)), None,
                                     "request_too_large")
                    return
        seen = 0

        async def counted() -> dict[str, Any]:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_bytes:
                    raise ApiError(413, self._message(f"more than {self.max_bytes}"), None,
                                   "request_too_large")
            return message

        await self.app(scope, counted, send)
