"""Requests as the model process sees them: status, KV state, progress and a typed finish reason."""

from __future__ import annotations

import enum
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from srt.managers.io_struct import LogprobOptions, SpecCounts, TokenLogprobs
from srt.sampling_params import SamplingParams

if TYPE_CHECKING:
    from srt.constrained.grammar import Matcher
    from srt.model_process.image_pads import ReqImage
    from srt.model_process.radix_cache import TreeNode


class ReqStatus(enum.Enum):
    WAITING = enum.auto()  # in the waiting queue (new, retracted, or jumped out of the batch)
    RUNNING = enum.auto()  # in the running batch: holds a req_to_token row
    # Between two chunks of its prompt (chunked prefill): in the waiting queue, holding its
    # row, the KV of its first `kv_valid` positions and (radix cache on) the tree's lock on them.
    PREFILLING = enum.auto()
    FINISHED = enum.auto()  # done; its last output is (being) sent


@dataclass(frozen=True)
class FinishReason:
    """Why a request ended. `to_dict` is the wire form the detokenizer and the HTTP process
    read: {"type": "stop", "matched": id | str | None}, {"type": "length", "length": n} or
    {"type": "abort", "message": text}."""

    type: str  # "stop" | "length" | "abort"
    matched: int | str | None = None
    length: int = 0
    message: str = ""

    @classmethod
    def stop(cls, matched: int | str | None) -> "FinishReason":
        return cls("stop", matched=matched)

    @classmethod
    def of_length(cls, n: int) -> "FinishReason":
        return cls("length", length=n)

    @classmethod
    def abort(cls, message: str) -> "FinishReason":
        return cls("abort", message=message)

    def to_dict(self) -> dict[str, Any]:
        if self.type == "stop":
            return {"type": "stop", "matched": self.matched}
        if self.type == "length":
            return {"type": "length", "length": self.length}
        return {"type": "abort", "message": self.message}


@dataclass(eq=False)  # identity semantics: requests live in lists and sets
class Req:
    """One request (one sample) inside a model process.

    KV state: while running (or between the chunks of a chunked prefill), `req_pool_idx` is its row of req_to_token and the first `kv_len`
    columns hold its slots. The first `len(prefix_indices)` of those belong to the radix tree and
    are locked through `last_node`; the rest are the request's own until it is cached or freed.

    Jump-forward may replace the unsent tail of `output_ids` (re-tokenized with the text the
    pattern forces). While running, the request keeps its row: the KV of the replaced positions
    is freed and `kv_valid` says how many leading positions still hold KV; the next step computes
    the rest (`step_input_len` tokens instead of one). A request out of the running set holds no
    row and no `kv_valid`.

    Chunked prefill: a prompt longer than the fill budget is computed over several fills. Between
    them the request is PREFILLING: it waits in the queue with its row, `kv_valid` is the number
    of positions computed so far and (radix cache on) those positions are in the tree, locked
    through `last_node`, so `prefix_indices` covers them all; the next fill continues from there.

    Logprobs (when `logprob` is set): the prompt's are computed at the first fill only and wait in
    `input_logprobs` until sent; `output_logprobs` has one entry per output id (kept across
    retraction, like the ids), sent from `sent_len` on.
    """

    rid: str
    origin_input_ids: list[int]
    sampling_params: SamplingParams
    stream: bool = False
    group: str | None = None
    arrival: int = 0
    output_ids: list[int] = field(default_factory=list)
    req_pool_idx: int | None = None
    prefix_indices: torch.Tensor = field(default_factory=lambda: torch.empty(0, dtype=torch.int64))
    last_node: TreeNode | None = None
    extend_input_len: int = 0
    cached_tokens: int = -1  # prefix length found at the first admission (reported to the user)
    finish: FinishReason | None = None
    status: ReqStatus = ReqStatus.WAITING
    sent_len: int = 0  # output ids already sent on
    retractions: int = 0
    logprob: LogprobOptions | None = None
    prompt_logprobs_done: bool = False
    input_logprobs: TokenLogprobs | None = None  # computed, not sent yet
    output_logprobs: TokenLogprobs = field(default_factory=TokenLogprobs)
    # Constrained decoding: the grammar compile in flight (set while waiting for it), then this
    # request's matcher over the shared compiled grammar (advanced by every appended token).
    grammar_future: Future | None = None
    matcher: Matcher | None = None
    # The prompt's image (srt.model_process.image_pads.ReqImage): origin_input_ids hold its
    # pad ids; kept until the request finishes (a retracted request may need it again).
    image: ReqImage | None = None
    forward_passes: int = 0  # model forwards (fills and decode steps) this request took part in
    # Set by a jump while running, and between prefill chunks: positions whose KV is valid.
    kv_valid: int | None = None
    # Its pattern forces text, seen while a step of it was in flight (a jump needs none): the
    # loop resolves that step before launching another, and the jump happens then.
    jump_wanted: bool = False
    # Launched steps whose tokens are not on the host yet (the overlapped loop): each one
    # writes the KV of one more position, and output_ids lack its token.
    in_flight: int = 0  # launched steps not resolved yet (2 for a moment while chaining)
    # Speculative decoding: the drafter's index of this request's tokens (NGRAM), and its
    # counts (verification steps, draft tokens proposed, accepted), None while speculation is off.
    draft_index: Any = None
    spec: SpecCounts | None = None
    # Drafts rejected whole in a row, and decode steps left before this request drafts again
    # (a request whose drafts keep failing decodes plainly, overlapped, and tries again later).
    draft_misses: int = 0
    draft_backoff: int = 0
    # --is-embedding: its pooled hidden states so far (summed over chunks where every token
    # counts: `pool_all`, whose prompt is then computed whole, not read from the radix cache),
    # and the finished vector
    pool_all: bool = False
    pooled: torch.Tensor | None = None
    embedding: list[float] | None = None
    # Its LoRA adapter's id (0: the base model): also its radix cache namespace, so that its
    # prompt never shares KV with another adapter's
    lora_id: int = 0

    @property
    def grammar_pending(self) -> bool:
        """Constrained, and its grammar not agreed ready yet: not admitted."""
        return self.grammar_future is not None and self.matcher is None

    @property
    def fill_ids(self) -> list[int]:
        return self.origin_input_ids + self.output_ids

    @property
    def kv_len(self) -> int:
        """Tokens whose KV is in the pool while running: all but the last sampled one."""
        return len(self.origin_input_ids) + len(self.output_ids) - 1

    @property
    def kv_computed(self) -> int:
        """Leading positions of the row that hold KV while running (kv_len unless a jump
        replaced ids that had KV)."""
        return self.kv_len if self.kv_valid is None else self.kv_valid

    @property
    def step_input_len(self) -> int:
        """Tokens the next step feeds for this running request: 1, or more after a jump."""
        return len(self.origin_input_ids) + len(self.output_ids) - self.kv_computed

    @property
    def remaining_new_tokens(self) -> int:
        return self.sampling_params.max_new_tokens - len(self.output_ids)

    @property
    def finished(self) -> bool:
        return self.finish is not None

    def end(self, reason: FinishReason) -> None:
        self.finish = reason
        self.status = ReqStatus.FINISHED

    @property
    def prefilling(self) -> bool:
        """Between two chunks of its prompt (see the class docstring)."""
        return self.status == ReqStatus.PREFILLING

    @property
    def wants_prompt_logprobs(self) -> bool:
        """Prompt logprobs were asked for and are not computed yet."""
        return (self.logprob is not None and self.logprob.logprob_start_len >= 0
                and not self.prompt_logprobs_done)


