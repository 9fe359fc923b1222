"""Embeddings over HTTP (`--is-embedding`): OpenAI's `POST /v1/embeddings` and SGLang's
`POST /encode`.

Both become a /generate request of no new tokens (`max_new_tokens` 0), whose answer carries
the vector the model process pooled (srt/layers/pooler.py). /encode takes `text` (a string or a
list) or `input_ids` (ids or a list of id lists) and answers {"embedding", "meta_info"}, or a
list of them. /v1/embeddings takes `input` (a string, a list of strings, a list of ids or a list
of id lists), `model`, `encoding_format` ("float", or "base64": the little-endian float32 bytes)
and `dimensions` (the vector cut to its first d values and scaled back to length 1, as
Matryoshka-trained models are used), and answers OpenAI's list object with `usage`.
"""

from __future__ import annotations

import base64
import math
import struct
from typing import Any

from srt.managers.request_types import RequestError

FORMATS = ("float", "base64")


def generate_body(field: str, value: Any, rid: Any = None) -> dict[str, Any]:
    """The /generate body that computes the embeddings of `value` (`text` or `input_ids`)."""
    body: dict[str, Any] = {field: value, "sampling_params": {"max_new_tokens": 0}}
    if rid is not None:
        body["rid"] = rid
    return body


def encode_body(body: Any) -> dict[str, Any]:
    """/encode's body as a /generate body."""
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object", None, "invalid_type")
    unknown = sorted(set(body) - {"text", "input_ids", "rid"})
    if unknown:
        raise RequestError(f"unknown field {unknown[0]!r} (/encode takes text or input_ids, "
                           "and rid)", unknown[0])
    if ("text" in body) == ("input_ids" in body):
        raise RequestError("give exactly one of text and input_ids", "text")
    field = "text" if "text" in body else "input_ids"
    return generate_body(field, body[field], body.get("rid"))


def _is_ids(x: Any) -> bool:
    return isinstance(x, list) and bool(x) and all(
        isinstance(t, int) and not isinstance(t, bool) for t in x)


def openai_body(body: Any, model: str) -> tuple[dict[str, Any], bool, str, int | None]:
    """/v1/embeddings' body: (the /generate body, whether `input` was one item, the encoding
    format, the dimensions asked for)."""
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object", None, "invalid_type")
    name = body.get("model")
    if not isinstance(name, str):
        raise RequestError("model must be a string", "model", "invalid_type")
    if name not in (model, "default"):
        raise RequestError(f"the model {name!r} does not exist; this server serves {model!r}",
                           "model", "model_not_found", status=404)
    unknown = sorted(set(body) - {"input", "model", "encoding_format", "dimensions", "user"})
    if unknown:
        raise RequestError(f"unknown field {unknown[0]!r}", unknown[0])
    fmt = body.get("encoding_format") or "float"
    if fmt not in FORMATS:
        raise RequestError(f"encoding_format must be one of {', '.join(FORMATS)}",
                           "encoding_format", "invalid_value")
    dims = body.get("dimensions")
    if dims is not None and (not isinstance(dims, int) or isinstance(dims, bool) or dims < 1):
        raise RequestError("dimensions must be a positive integer", "dimensions",
                           "invalid_value")
    value = body.get("input")
    if isinstance(value, str):
        if not value:
            raise RequestError("input must not be empty", "input", "invalid_value")
        return generate_body("text", value), True, fmt, dims
    if _is_ids(value):
        return generate_body("input_ids", value), True, fmt, dims
    if isinstance(value, list) and value and all(isinstance(v, str) and v for v in value):
        return generate_body("text", value), False, fmt, dims
    if isinstance(value, list) and value and all(_is_ids(v) for v in value):
        return generate_body("input_ids", value), False, fmt, dims
    raise RequestError("input must be a non-empty string, a list of strings, a list of token "
                       "ids or a list of such lists", "input", "invalid_type")


def _cut(vector: list[float], dims: int | None) -> list[float]:
    if dims is None:
        return vector
    if dims > len(vector):
        raise RequestError(f"dimensions {dims} exceeds the model's {len(vector)}",
                           "dimensions", "invalid_value")
    cut = vector[:dims]
    norm = math.sqrt(sum(x * x for x in cut)) or 1.0
    return [x / norm for x in cut]


def _encoded(vector: list[float], fmt: str) -> list[float] | str:
    if fmt == "float":
        return vector
    return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode("ascii")


def openai_answer(results: list[dict[str, Any]], model: str, fmt: str,
                  dims: int | None) -> dict[str, Any]:
    """OpenAI's answer from the /generate results of the inputs, in order."""
    tokens = sum(r["meta_info"]["prompt_tokens"] for r in results)
    return {
        "object": "list",
        "data": [{"object": "embedding", "index": i,
                  "embedding": _encoded(_cut(r["embedding"], dims), fmt)}
                 for i, r in enumerate(results)],
        "model": model,
        "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
    }
