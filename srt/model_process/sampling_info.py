"""The per-step sampling tensors of a batch, built from its requests' parameters.

The parameters that never change while a batch holds the same requests in the same order stay on
the device between steps (`SamplingRows`); only what changes per step (positions for seeded rows,
penalty counts, the min_new_tokens stop mask) is built again.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from srt.constrained.mask import keep_out_mask
from srt.layers.sampler import SamplingBatchInfo
from srt.model_process.req import Req


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
    before: list[list[int]] | None = None, keep_out: bool = True,
) -> tuple[SamplingBatchInfo, SamplingRows]:
    """Per-row sampling tensors for `reqs` (stop_ids(r): the tokens min_new_tokens keeps out of
    r's output; asked only of rows below their min_new_tokens), and the static part to pass back
    as `cached` next step: reused while the batch holds the same requests in the same order, so
    a decode round of an unchanged batch builds and copies only what changes per step.
    `before`: a verification step's rows, the draft tokens each row's output would follow
    (penalties count them, min_new_tokens counts them as output). `keep_out=False` leaves
    min_new_tokens' mask out of `info.forbidden`: the caller hands `keep_out_rows` to a
    grammar's mask builder, which folds them into its own mask."""
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
        positions=[len(r.output_ids) + r.in_flight for r in reqs],
    )
    if any(p.uses_penalties for p in ps):
        _add_penalties(info, reqs, vocab_size, device, before)
    if keep_out:
        kept = keep_out_rows(reqs, stop_ids, before)
        if kept:
            info.forbidden = keep_out_mask(kept, len(reqs), vocab_size, device)
    return info, static


def keep_out_rows(reqs: list[Req], stop_ids: Callable[[Req], set[int]],
                  before: list[list[int]] | None = None) -> list[tuple[int, list[int]]]:
    """(row, sorted stop ids) of each row below its min_new_tokens that has stop ids (the
    arguments as `build_sampling_info`'s)."""
    ahead = [0] * len(reqs) if before is None else [len(b) for b in before]
    return [(i, sorted(ids)) for i, r in enumerate(reqs)
            if len(r.output_ids) + r.in_flight + ahead[i] < r.sampling_params.min_new_tokens
            and (ids := stop_ids(r))]


def _add_penalties(info: SamplingBatchInfo, reqs: list[Req], vocab: int,
                   device: torch.device, before: list[list[int]] | None) -> None:
    ps = [r.sampling_params for r in reqs]
    counts = torch.zeros((len(reqs), vocab), dtype=torch.float32)
    seen = torch.zeros((len(reqs), vocab), dtype=torch.bool)
    for i, r in enumerate(reqs):
        ids = r.output_ids if before is None or not before[i] else r.output_ids + before[i]
        if ids:
            out = torch.tensor(ids, dtype=torch.int64)
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
