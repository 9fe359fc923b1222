"""Sampling of one token per request from float32 logits, for a whole batch at once.

Order: penalties, then masks (min_new_tokens), then greedy rows take the argmax and the other rows
are scaled by temperature, filtered by top-k / top-p / min-p and sampled by an exponential race
(argmax of p / Exp(1) noise, which draws from p). A request with a seed draws its noise from a
generator seeded by (seed, output position), so the same seed gives the same output whatever else
is in the batch. On a GPU a batch without top-k / top-p / min-p rows is sampled in one pass
instead (`srt.layers.sample_triton`: Gumbel-max, the same distribution, Philox noise keyed by
the same seeds), so a seed's tokens there differ from the torch path's.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

logger = logging.getLogger(__name__)


@dataclass
class SamplingBatchInfo:
    """Per-row sampling tensors of one batch, on the device. Built by the scheduler each step."""

    temperatures: torch.Tensor  # [bs] float32; 0 marks a greedy row
    top_ps: torch.Tensor  # [bs] float32
    top_ks: torch.Tensor  # [bs] int64; vocab size where disabled
    min_ps: torch.Tensor  # [bs] float32
    all_greedy: bool
    need_top_p_k: bool
    need_min_p: bool
    seeds: list[int | None]  # per row
    positions: list[int]  # per row: how many tokens it has generated (the noise stream's index)
    # Penalties, present only when some row uses them.
    frequency_penalties: torch.Tensor | None = None  # [bs]
    presence_penalties: torch.Tensor | None = None  # [bs]
    repetition_penalties: torch.Tensor | None = None  # [bs]
    output_counts: torch.Tensor | None = None  # [bs, vocab] float32 counts of generated tokens
    seen_mask: torch.Tensor | None = None  # [bs, vocab] bool: token in prompt or output
    # Tokens forbidden this step (min_new_tokens keeps stop tokens out): [bs, vocab] bool or None.
    forbidden: torch.Tensor | None = None


def apply_penalties(logits: torch.Tensor, info: SamplingBatchInfo) -> torch.Tensor:
    if info.repetition_penalties is not None and info.seen_mask is not None:
        p = info.repetition_penalties.unsqueeze(1)
        penalized = torch.where(logits > 0, logits / p, logits * p)
        logits = torch.where(info.seen_mask, penalized, logits)
    if info.output_counts is not None:
        if info.frequency_penalties is not None:
            logits = logits - info.frequency_penalties.unsqueeze(1) * info.output_counts
        if info.presence_penalties is not None:
            logits = logits - info.presence_penalties.unsqueeze(1) * (info.output_counts > 0)
    return logits


def _exponential_noise(info: SamplingBatchInfo, shape: torch.Size, device: torch.device,
                       generator: torch.Generator | None) -> torch.Tensor:
    noise = torch.empty(shape, device=device).exponential_(generator=generator)
    for row, seed in enumerate(info.seeds):
        if seed is None:
            continue
        g = torch.Generator(device=device)
        g.manual_seed(_seed_of(seed, info.positions[row]))
        noise[row].exponential_(generator=g)
    return noise


def _fused_sample(logits: torch.Tensor, info: SamplingBatchInfo,
                  generator: torch.Generator | None) -> torch.Tensor | None:
    """`gumbel_sample` of the batch; None (and the torch path from then on, with a warning)
    where its kernels fail to build on this device (the start-up warm-up takes this path)."""
    global FUSED
    from srt.layers.sample_triton import gumbel_sample

    try:
        return gumbel_sample(logits, info.temperatures, _row_seeds(info, logits.device,
                                                                   generator))
    except Exception as exc:  # noqa: BLE001 - a compile error: sample the torch way instead
        logger.warning("one-pass sampling kernel unavailable (%s: %s); sampling with torch "
                       "operations", type(exc).__name__, exc)
        FUSED = "never"
        return None


def _seed_of(seed: int, position: int) -> int:
    """A seeded row's 63-bit noise seed at an output position (splitmix-style constants)."""
    return (seed * 0x9E3779B97F4A7C15 + position * 0xBF58476D1CE4E5B9) & ((1 << 63) - 1)


def _row_seeds(info: SamplingBatchInfo, device: torch.device,
               generator: torch.Generator | None) -> torch.Tensor:
    """[bs] int64 Philox keys of `gumbel_sample`: a seeded row's from (seed, position); the
    others one draw of `generator` (which it advances, as the noise tensor would) plus the
    row's index."""
    bs = len(info.seeds)
    base = torch.randint(0, 1 << 62, (1,), generator=generator, device=device)
    keys = base + torch.arange(bs, device=device)
    if any(s is not None for s in info.seeds):
        rows = [r for r, s in enumerate(info.seeds) if s is not None]
        seeded = torch.tensor([_seed_of(info.seeds[r], info.positions[r]) for r in rows],
                              dtype=torch.int64)
        keys[torch.tensor(rows, device=device)] = seeded.to(device, non_blocking=True)
    return keys


def _filtered_probs(logits: torch.Tensor, info: SamplingBatchInfo) -> torch.Tensor:
    """The distribution each sampled row draws from, unnormalized: softmax at its
    temperature, then top-k / top-p / min-p zero the dropped tokens (greedy rows get
    temperature 1; their probabilities are not used)."""
    is_greedy = info.temperatures == 0
    temps = torch.where(is_greedy, torch.ones_like(info.temperatures), info.temperatures)
    probs = torch.softmax(logits / temps.unsqueeze(1), dim=-1)
    if info.need_top_p_k:
        sorted_p, order = probs.sort(dim=-1, descending=True)
        ranks = torch.arange(probs.shape[-1], device=probs.device).unsqueeze(0)
        drop = ranks >= info.top_ks.unsqueeze(1)
        # drop a token when the tokens strictly before it already reach top_p
        drop |= (sorted_p.cumsum(-1) - sorted_p) > info.top_ps.unsqueeze(1)
        drop[:, 0] = False  # the most likely token always stays
        sorted_p = sorted_p.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter_(1, order, sorted_p)
    if info.need_min_p:
        top = probs.max(dim=-1, keepdim=True).values
        probs = probs.masked_fill(probs < info.min_ps.unsqueeze(1) * top, 0.0)
    return probs


def _masked_logits(logits: torch.Tensor, info: SamplingBatchInfo) -> torch.Tensor:
    logits = apply_penalties(logits, info)
    if info.forbidden is not None:
        logits = logits.masked_fill(info.forbidden, float("-inf"))
    return logits


# Rows without top-k / top-p / min-p on a GPU: one pass of `srt.layers.sample_triton` (the
# same distribution by Gumbel-max; "never" keeps the torch sequence everywhere, "always" takes
# the kernel on the CPU too, in Triton's interpreter).
FUSED = "gpu"


def sample(logits: torch.Tensor, info: SamplingBatchInfo,
           generator: torch.Generator | None = None) -> torch.Tensor:
    """logits: [bs, vocab] float32 -> next token ids [bs] int64 (on the logits' device)."""
    logits = _masked_logits(logits, info)
    if info.all_greedy:
        return logits.argmax(dim=-1)
    if not (info.need_top_p_k or info.need_min_p) and (
            FUSED == "always" or (FUSED == "gpu" and logits.is_cuda)):
        ids = _fused_sample(logits, info, generator)
        if ids is not None:
            return ids
    greedy = logits.argmax(dim=-1)
    probs = _filtered_probs(logits, info)
    noise = _exponential_noise(info, probs.shape, probs.device, generator)
    sampled = (probs / noise).argmax(dim=-1)
    return torch.where(info.temperatures == 0, greedy, sampled)


def _uniform(info: SamplingBatchInfo, n: int, device: torch.device,
             generator: torch.Generator | None, salt: int = 0) -> torch.Tensor:
    """One U[0, 1) draw per row; a seeded row's from (seed, position, salt), like its noise."""
    u = torch.rand(n, device=device, generator=generator)
    for row, seed in enumerate(info.seeds):
        if seed is None:
            continue
        g = torch.Generator(device=device)
        g.manual_seed((seed * 0xD6E8FEB86659FD93 + info.positions[row] * 0x94D049BB133111EB
                       + 1 + salt * 0xA0761D6478BD642F) & ((1 << 63) - 1))
        u[row] = torch.rand(1, device=device, generator=g)[0]
    return u


def verify_sample(logits: torch.Tensor, info: SamplingBatchInfo, children: torch.Tensor,
                  generator: torch.Generator | None = None) -> torch.Tensor:
    """The token the model emits at each row of a verification step, given the draft tokens
    that follow the row (children[r, :], distinct, -1 padded; a row without any is sampled as
    by `sample`; a 1-d tensor is one child per row). A greedy row emits its argmax: a draft is
    accepted iff it equals it. A sampled row tries its children in order: child c is accepted
    with probability p'(c), p' being the row's filtered distribution p with the children tried
    before it removed and renormalized; if none is, the row draws from p without all of them.
    Each draft being a fixed token (q(c) = 1), this is exact rejection applied child after
    child, so every emitted token is distributed as p. A row emitting a child's token means
    that child was accepted there."""
    if children.dim() == 1:
        children = children.unsqueeze(1)
    logits = _masked_logits(logits, info)
    greedy = logits.argmax(dim=-1)
    if info.all_greedy:
        return greedy
    probs = _filtered_probs(logits, info)
    residual = probs / probs.sum(dim=-1, keepdim=True)  # (filters leave it unnormalized)
    out = torch.full_like(greedy, -1)
    for c in range(children.shape[1]):
        d = children[:, c]
        has = (d >= 0) & (out < 0)
        idx = d.clamp(min=0).unsqueeze(1)
        left = residual.sum(dim=-1)
        p_d = residual.gather(1, idx).squeeze(1)
        u = _uniform(info, probs.shape[0], probs.device, generator, salt=c)
        # (p_d >= left: the children hold all that is left, which rounding may leave short)
        take = has & ((u * left < p_d) | (p_d >= left))
        out = torch.where(take, d, out)
        residual = torch.where((has & ~take).unsqueeze(1), residual.scatter(1, idx, 0.0),
                               residual)
    noise = _exponential_noise(info, probs.shape, probs.device, generator)
    drawn = (residual / noise).argmax(dim=-1)  # argmax of p / Exp(1): a draw from p, unscaled
    out = torch.where(out >= 0, out, drawn)
    return torch.where(info.temperatures == 0, greedy, out)
