"""Every message that crosses a process boundary, and the one codec for them.

The whole protocol is in this file. Messages are small typed dataclasses registered by name; the
codec is msgpack with a `{"__t__": name, ...fields}` map per message, decoded only into registered
classes (no pickle on any socket: a reachable socket must never mean remote code execution).

Imports nothing heavy: every process loads it.

Ring (DESIGN section 2):
    HTTP (TokenizerManager) --GenerateReqInput/AbortReq/control--> router
    router --StepInput--> every model rank;  model rank 0 --StepOutput--> router
    router --BatchTokenIdOut, control results--> detokenizer --BatchStrOut, control results--> HTTP
Several nodes: node 0 <--Node*--> each other node;  router --StepInput--> their ranks (signed)
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Callable, TypeVar

import msgpack

_REGISTRY: dict[str, type] = {}
T = TypeVar("T")


def message(cls: type[T]) -> type[T]:
    """Register a dataclass as a wire message (decodable by name)."""
    if cls.__name__ in _REGISTRY:
        raise ValueError(f"duplicate message name {cls.__name__}")
    _REGISTRY[cls.__name__] = cls
    return cls


# ---------------------------------------------------------------- requests (HTTP -> router -> model)


@message
@dataclass
class LogprobOptions:
    """The logprobs one request asked for (validated by the HTTP process; names as in the API).

    logprob_start_len: -1 for no prompt logprobs, else the prompt position from which they are
    returned (prompt tokens logprob_start_len .. len(prompt) - 1). top_logprobs_num: how many of
    the most likely tokens to report per position (0..20). return_text_in_logprobs: the
    detokenizer adds each token's text.
    """

    logprob_start_len: int = -1
    top_logprobs_num: int = 0
    return_text_in_logprobs: bool = False


@message
@dataclass
class ImageInput:
    """One preprocessed image (decoded, resized, cropped and normalized by the HTTP process).

    pixel_values: the float32 array [channels, height, width] as raw little-endian bytes.
    hash: hex SHA-256 of the shape and pixel values; the scheduler derives the image's pad
    token ids from it, so the same image always gets the same ids.
    """

    pixel_values: bytes
    shape: list[int]
    hash: str


@message
@dataclass
class TokenizedGenerateReq:
    """One validated, tokenized request (one sample: `n` is expanded by the HTTP process)."""

    rid: str
    input_ids: list[int]
    sampling_params: dict[str, Any]  # SamplingParams.to_dict(); validated by the HTTP process
    stream: bool = False
    # Samples of one prompt share a group; the scheduler admits one of a group first so the others
    # find the prompt's KV in the radix cache.
    group: str | None = None
    logprob: LogprobOptions | None = None  # None: no logprobs at all
    # The prompt's image (its input_ids hold the image token exactly once), or None.
    image: ImageInput | None = None
    lora_id: int = 0  # the LoRA adapter (srt.lora.registry's id); 0: the base model


@message
@dataclass
class AbortReq:
    """Stop a request now (client gone, or asked): its KV slots and locks are released."""

    rid: str
    message: str = "aborted"


@message
@dataclass
class FlushCacheReq:
    rid: str


@message
@dataclass
class GetStatsReq:
    rid: str


@message
@dataclass
class LoadLoraReq:
    """Load a LoRA adapter under `lora_id` on every rank (rank 0 answers with a LoraOut)."""

    rid: str
    lora_id: int
    name: str
    path: str


@message
@dataclass
class UnloadLoraReq:
    rid: str
    lora_id: int
    name: str


@message
@dataclass
class StepInput:
    """What the router sends every model rank for one scheduling round (identical for all ranks)."""

    reqs: list[TokenizedGenerateReq] = field(default_factory=list)
    aborts: list[AbortReq] = field(default_factory=list)
    # FlushCacheReq | GetStatsReq | LoadLoraReq | UnloadLoraReq
    controls: list[Any] = field(default_factory=list)


# ---------------------------------------------------------------- results (model -> router -> detok)


@message
@dataclass
class TokenLogprobs:
    """Logprobs of consecutive tokens of one request; plain lists, one entry per token.

    logprobs[i] is log p(token_ids[i] | every token before it) under the model's distribution
    (log_softmax of the raw logits, before penalties, temperature and top-p/k), computed in
    float32. top_logprobs[i] / top_ids[i] are the request's top_logprobs_num most likely tokens at
    that position, most likely first. The first prompt token has nothing before it: its logprob
    and its top lists are None. texts / top_texts (each token decoded alone) are added by the
    detokenizer when the request asked for them, else None.
    """

    logprobs: list[float | None] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    top_logprobs: list[list[float] | None] = field(default_factory=list)
    top_ids: list[list[int] | None] = field(default_factory=list)
    texts: list[str] | None = None
    top_texts: list[list[str] | None] | None = None

    def extend(self, other: "TokenLogprobs") -> None:
        """Append other's entries (texts only where both have them)."""
        self.logprobs += other.logprobs
        self.token_ids += other.token_ids
        self.top_logprobs += other.top_logprobs
        self.top_ids += other.top_ids
        if self.texts is not None and other.texts is not None:
            self.texts += other.texts
        if self.top_texts is not None and other.top_texts is not None:
            self.top_texts += other.top_texts

    def since(self, start: int) -> "TokenLogprobs":
        """The entries from index `start` on (ids, logprobs and top lists; texts are not kept)."""
        return TokenLogprobs(self.logprobs[start:], self.token_ids[start:],
                             self.top_logprobs[start:], self.top_ids[start:])


@message
@dataclass
class SpecCounts:
    """A request's speculative decoding so far (meta_info's spec_* fields are built from it)."""

    verify_ct: int = 0  # verification steps (every decode step of a speculating server)
    draft_tokens: int = 0  # draft tokens proposed
    accepted_tokens: int = 0  # of those, accepted


@message
@dataclass
class TokenOut:
    """New output token ids of one request since its last TokenOut."""

    rid: str
    new_ids: list[int]
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    # None while running; {"type": "length", "length": n} | {"type": "stop", "matched": str | int}
    # | {"type": "abort", "message": str} when finished.
    finish_reason: dict[str, Any] | None = None
    forward_passes: int = 0  # model forwards the request took part in so far
    # Speculative decoding (None: off): verification steps the request took part in, draft
    # tokens proposed for it and draft tokens accepted, so far.
    spec: SpecCounts | None = None
    # Decoding options the detokenizer needs (sent with every TokenOut; they are small).
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    stop: list[str] = field(default_factory=list)
    stop_regex: list[str] = field(default_factory=list)
    no_stop_trim: bool = False
    # Logprobs, for requests that asked. The prompt's are sent once, with the first TokenOut after
    # the prompt was computed; output_logprobs has one entry per id of new_ids.
    input_logprobs: TokenLogprobs | None = None
    output_logprobs: TokenLogprobs | None = None
    return_text_in_logprobs: bool = False
    # --is-embedding: the request's vector, with its last TokenOut
    embedding: list[float] | None = None


@message
@dataclass
class BatchTokenIdOut:
    outs: list[TokenOut]


@message
@dataclass
class FlushCacheOut:
    rid: str
    success: bool
    message: str


@message
@dataclass
class LoraOut:
    rid: str
    success: bool
    message: str


@message
@dataclass
class StatsOut:
    rid: str
    stats: dict[str, Any]


@message
@dataclass
class StepOutput:
    """Rank 0's answer to one StepInput."""

    token_out: BatchTokenIdOut | None
    controls: list[Any] = field(default_factory=list)  # FlushCacheOut | StatsOut | LoraOut
    has_work: bool = False  # requests still running or waiting: the router keeps stepping
    # More of this round follows: the outputs of one decode step sent on at once (streaming);
    # the round's last StepOutput has partial False and carries controls and has_work.
    partial: bool = False


# ---------------------------------------------------------------- text (detok -> HTTP)


@message
@dataclass
class StrOut:
    """What a request's text became: the text from `text_start` on is `text` (everything
    before it is what its earlier StrOuts gave), so each carries only what is new (O(1) per
    token on the wire, not the whole text)."""

    rid: str
    text: str  # the request's output text from text_start on (safe to show)
    new_ids: list[int]
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    finish_reason: dict[str, Any] | None = None
    forward_passes: int = 0
    spec: SpecCounts | None = None
    # As in TokenOut (new entries only), with texts when the request asked for them.
    input_logprobs: TokenLogprobs | None = None
    output_logprobs: TokenLogprobs | None = None
    embedding: list[float] | None = None  # --is-embedding
    # Where `text` starts: the length of the text sent before, except where the final
    # decode differs from what was shown (then the common prefix's length).
    text_start: int = 0


@message
@dataclass
class BatchStrOut:
    outs: list[StrOut]


# ---------------------------------------------------------------- node links (several machines)
# Between node 0 and each other node (srt/node_hub.py, srt/node_worker.py), every frame signed
# (srt/managers/node_link.py). Control channel: a node sends NodeHello until NodeWelcome, then
# NodeReady once its ranks are ready, NodeHeartbeat every second and NodeFailure if it fails;
# node 0 sends NodeHeartbeat every second and NodeShutdown when it stops. Step channel: each rank
# of another node sends RankHello, then receives the router's StepInputs.


@message
@dataclass
class NodeHello:
    node_rank: int
    tp_size: int
    nnodes: int
    hostname: str = ""


@message
@dataclass
class NodeWelcome:
    pass


@message
@dataclass
class NodeReady:
    pass


@message
@dataclass
class NodeHeartbeat:
    pass


@message
@dataclass
class NodeFailure:
    reason: str  # names the node and the process


@message
@dataclass
class NodeShutdown:
    pass


@message
@dataclass
class RankHello:
    tp_rank: int


# ---------------------------------------------------------------- codec


def _default(obj: Any) -> Any:
    if dataclasses.is_dataclass(obj) and _REGISTRY.get(type(obj).__name__) is type(obj):
        d = {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj)}
        d["__t__"] = type(obj).__name__
        return d
    if isinstance(obj, tuple):
        return list(obj)
    raise TypeError(f"cannot encode {type(obj).__name__}: not a registered message")


def _object_hook(d: dict[str, Any]) -> Any:
    name = d.pop("__t__", None)
    if name is None:
        return d
    cls = _REGISTRY.get(name)
    if cls is None:
        raise ValueError(f"unknown message type {name!r}")
    return cls(**d)


def encode(obj: Any) -> bytes:
    """Encode a registered message (nested messages, lists, dicts and scalars allowed)."""
    return msgpack.packb(obj, default=_default, use_bin_type=True)


def decode(data: bytes) -> Any:
    """Decode bytes made by `encode`; only registered message classes are ever constructed."""
    return msgpack.unpackb(data, object_hook=_object_hook, raw=False, strict_map_key=False)


def registered_messages() -> dict[str, Callable[..., Any]]:
    return dict(_REGISTRY)
