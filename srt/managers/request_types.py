"""What a validated request is, and how a request is refused, in the HTTP process.

A ParsedRequest holds only single-sample requests that passed every check (request_parse.py
builds them); a client error is a RequestError naming the field, a server that cannot finish is
a ServerFailure. The HTTP layer, the OpenAI adapter and the Engine all share these types.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Any

from srt.field_policy import FieldError, Surface
from srt.managers.io_struct import ImageInput, LogprobOptions
from srt.sampling_params import SamplingParams

MAX_TOP_LOGPROBS = 20


class RequestError(ValueError):
    """A client error: answered with HTTP 400 and {"error": {message, type, param, code}}."""

    def __init__(self, message: str, param: str | None, code: str = "invalid_value",
                 status: int = 400) -> None:
        super().__init__(message)
        self.param = param
        self.code = code
        self.status = status


def checked_fields(surface: Surface, body: dict[str, Any]) -> dict[str, Any]:
    """`surface.apply(body)` (srt/field_policy.py), its refusal as a RequestError."""
    try:
        return surface.apply(body)
    except FieldError as e:
        raise RequestError(str(e), e.name, e.code) from None


class ServerFailure(RuntimeError):
    """The server cannot finish the request: a process died or stalled. Answered with HTTP 503
    and code "server_failed" (a stream ends with one error event)."""


@dataclass(frozen=True)
class ModelLimits:
    """What the model process reported at start-up; requests are checked against it."""

    context_length: int
    vocab_size: int
    max_total_num_tokens: int
    # Image input (LLaVA; None / 0 for a text-only model): the image token, the positions one
    # image fills in the prompt, and the side of the square image the vision tower takes.
    image_token_id: int | None = None
    image_tokens: int = 0
    image_size: int = 0


@dataclass
class SingleRequest:
    rid: str  # the client's id, reported back in meta_info
    input_ids: list[int]
    params: SamplingParams
    index: int  # position in the answer list
    group: str | None  # internal id shared by the samples of one prompt (n > 1)
    logprob: LogprobOptions | None = None
    parent_rid: str = ""  # the client's rid of the prompt (n > 1: the samples' rid is rid-k)
    image_source: str | None = None  # the prompt's image_data entry
    image: ImageInput | None = None  # set by load_images
    prompt_len: int = 0  # tokens of the prompt in the KV cache (an image counts its positions)
    lora_id: int = 0  # its LoRA adapter (srt.lora.registry); 0: the base model
    # Internal id on the wire: unique per submission, so a client reusing a rid right after an
    # abort can never be confused with the request being aborted.
    wire_rid: str = field(default_factory=lambda: uuid.uuid4().hex)


@dataclass
class ParsedRequest:
    reqs: list[SingleRequest]
    stream: bool
    is_batch: bool  # answer with a list
