"""Requests as the model process sees them, and the per-step batch tensors built from them."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from srt.layers.sampler import SamplingBatchInfo
from srt.managers.io_struct import LogprobOptions, TokenLogprobs
from srt.sampling_params import SamplingParams


@dataclass(eq=False)  # identity semantics: requests live in lists and sets
class Req:
    """One request (one sample) inside a model process.

    KV state: while running, `req_pool_idx` is its row of req_to_token and the first `kv_len`
    columns hold its slots. The first `len(prefix_indices)` of those belong to the radix tree and
    are locked through `last_node`; the rest are the request's own until it is cached or freed.

    Jump-forward may replace the unsent tail of `output_ids` (re-tokenized with the text the
    pattern forces). While running, the request keeps its row: the KV of the replaced positions
    is freed and `kv_valid` says how many leading positions still hold KV; the next step computes
    the rest (`step_input_len` tokens instead of one). A request out of the running set holds no
    row and no `kv_valid`.

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
    last_node: Any = None
    extend_input_len: int = 0
    cached_tokens: int = -1  # prefix length found at the first admission (reported to the user)
    finish_reason: dict[str, Any] | None = None
    sent_len: int = 0  # output ids already sent on
    retractions: int = 0
    logprob: LogprobOptions | None = None
    prompt_logprobs_done: bool = False
    input_logprobs: TokenLogprobs | None = None  # computed, not sent yet
    output_logprobs: TokenLogprobs = field(default_factory=TokenLogprobs)
    # Constrained decoding: the FSM compile in flight (set while waiting for it), then the shared
    # compiled FSM and this request's state in it (advanced by every appended output token).
    fsm_future: Any = None
    fsm: Any = None
    fsm_state: int = 0
    # The prompt's image (srt.managers.router.image_pads.ReqImage): origin_input_ids hold its
    # pad ids; kept until the request finishes (a retracted request may need it again).
    image: Any = None
    forward_passes: int = 0  # model forwards (fills and decode steps) this request took part in
    kv_valid: int | None = None  # set by a jump while running: positions whose KV is still valid

    @property
    def fsm_pending(self) -> bool:
        """Constrained, and its FSM not agreed ready yet: not admitted."""
        return self.fsm_future is not None and self.fsm is None

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
        return self.finish_reason is not None

    @property
    def wants_prompt_logprobs(self) -> bool:
        """Prompt logprobs were asked for and are not computed yet."""
        return (self.logprob is not None and self.logprob.logprob_start_len >= 0
                and not self.prompt_logprobs_done)


@dataclass
class SamplingRows:
    """The per-row sampling parameters of one batch that never change while its requests stay
    the same: the four parameter rows on the device, the batch flags and the seeds."""

    reqs: list[Req]  # held, so that identity comparison is safe (no id reuse while cached)
    rows: torch.Tensor  # [4, bs] float32 on the device: temperature, top-p, top-k, min-p
    top_ks: torch.Tensor  # [bs] int64 on the device
    all_greedy: bool
    need_top_p_k: bool
    need_min_p: bool
    seeds: list[int | None]

    @classmethod
    def build(cls, reqs: list[Req], vocab_size: int, device: torch.device) -> "SamplingRows":
        ps = [r.sampling_params for r in reqs]
        temps = [p.temperature if not p.is_greedy else 0.0 for p in ps]
        top_ks = [p.top_k if p.top_k > 0 else vocab_size for p in ps]
        # One host-to-device copy for the four per-row parameters (top-k fits float32 exactly:
        # vocabularies are far below 2**24).
        rows = torch.tensor([temps, [p.top_p for p in ps], top_ks, [p.min_p for p in ps]],
                            dtype=torch.float32).to(device, non_blocking=True)
        return cls(list(reqs), rows, rows[2].to(torch.int64), all(t == 0.0 for t in temps),
                   any(p.top_p < 1.0 or 0 < p.top_k < vocab_size for p in ps),
                   any(p.min_p > 0 for p in ps), [p.seed for p in ps])

    def same_batch(self, reqs: list[Req]) -> bool:
        return len(reqs) == len(self.reqs) and all(a is b for a, b in zip(reqs, self.reqs))


def build_sampling_info(
    reqs: list[Req], vocab_size: int, device: torch.device,
    stop_ids: Callable[[Req], set[int]], cached: SamplingRows | None = None,
) -> tuple[SamplingBatchInfo, SamplingRows]:
    """Per-row sampling tensors for `reqs` (stop_ids(r): the tokens min_new_tokens keeps out of
    r's output; asked only of rows below their min_new_tokens), and the static part to pass back
    as `cached` next step: reused while the batch holds the same requests in the same order, so
    a decode round of an unchanged batch builds and copies only what changes per step."""
    static = cached if cached is not None and cached.same_batch(reqs) else \
        SamplingRows.build(reqs, vocab_size, device)
    ps = [r.sampling_params for r in reqs]
    rows = static.rows
    info = SamplingBatchInfo(
        temperatures=rows[0],
        top_ps=rows[1],
        top_ks=static.top_ks,
        min_ps=rows[3],
        all_greedy=static.all_greedy,
        need_top_p_k=static.need_top_p_k,
        need_min_p=static.need_min_p,
        seeds=static.seeds,
        positions=[len(r.output_ids) for r in reqs],
    )
    if any(p.uses_penalties for p in ps):
        _add_penalties(info, reqs, vocab_size, device)
    forbid = [
        (i, sorted(ids))
        for i, r in enumerate(reqs)
        if len(r.output_ids) < r.sampling_params.min_new_tokens and (ids := stop_ids(r))
    ]
    if forbid:
        # A few ids per row: their flat positions go to the device, not a [bs, vocab] mask.
        # (index_fill_, not `mask[rows, cols] = True`: that assignment waits for the device.)
        flat = [i * vocab_size + t for i, ids in forbid for t in ids if t < vocab_size]
        mask = torch.zeros((len(reqs), vocab_size), dtype=torch.bool, device=device)
        if flat:
            idx = torch.tensor(flat, dtype=torch.int64).to(device, non_blocking=True)
            mask.view(-1).index_fill_(0, idx, True)
        info.forbidden = mask
    return info, static


def _add_penalties(info: SamplingBatchInfo, reqs: list[Req], vocab: int,
                   device: torch.device) -> None:
    ps = [r.sampling_params for r in reqs]
    counts = torch.zeros((len(reqs), vocab), dtype=torch.float32)
    seen = torch.zeros((len(reqs), vocab), dtype=torch.bool)
    for i, r in enumerate(reqs):
        if r.output_ids:
            out = torch.tensor(r.output_ids, dtype=torch.int64)
            counts[i].scatter_add_(0, out, torch.ones(len(out)))
        if ps[i].repetition_penalty != 1.0:
            seen[i, torch.tensor(r.origin_input_ids, dtype=torch.int64)] = True
    seen |= counts > 0
    # Non-blocking (the driver stages pageable memory before returning): the forward in flight
    # is not waited for.
    info.output_counts = counts.to(device, non_blocking=True)
    info.seen_mask = seen.to(device, non_blocking=True)
    per_row = torch.tensor([[p.frequency_penalty for p in ps], [p.presence_penalty for p in ps],
                            [p.repetition_penalty for p in ps]]).to(device, non_blocking=True)
    info.frequency_penalties, info.presence_penalties, info.repetition_penalties = per_row
