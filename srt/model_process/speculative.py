"""Speculative decoding in the model process: which requests draft, and what a verification
step accepts.

A verification step replaces a decode step of the running batch: each request feeds its last
sampled id and its draft tokens (`Batch.prepare_verify`), the model computes every row in one
forward (DECODE rows, each attending to the rows before it), and each row is sampled given the
draft token after it (`srt.layers.sampler.verify_sample`). A request keeps its drafts up to the
first row that did not emit the next draft token, plus that row's token: one to len(draft) + 1
new tokens per step, each exactly what decoding one token at a time would emit (greedy), or
distributed as it (sampling). The KV of the rows past the kept ones is freed at once (page size
1 makes that exact: one slot per position). An EAGLE head with top-k > 1 drafts a tree: each
row is then sampled given all its children's tokens, the request keeps the path of children
its rows emitted, and the rows off that path are freed (`VerifyRows`).

Who drafts (`Speculator.drafts`): every request with room for at least one more token; the
step's drafts fit the KV pool's room. Each verification row's penalties and min_new_tokens
count the drafts before it as output (`VerifyRows.drafts_before`). A constrained request's
drafts are cut before the first token its grammar refuses (walked on a fork of its matcher),
and each of its verification rows is masked by the grammar's state after the drafts before
the row (`Proposal.matchers`), so every row samples what decoding one token at a time would;
of a tree it verifies the main path only (NGRAM: it drafts a chain).
While the running batch has
`--speculative-disable-by-batch-size` requests or more, nobody drafts: a large batch is bound
by compute, not by reading the weights, and verifying drafts would cost throughput.

Drafting needs the last token on the host, so a step that verifies drafts is never overlapped
with the one before. A request whose drafts were rejected whole backs off: after 2, 3, 4 ..
misses in a row it skips drafting for 1, 3, 7 .. MAX_BACKOFF decode steps (any accepted token
resets it), so
free-form text, where lookups rarely hit, decodes in the overlapped loop most of the time.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

import numpy as np
import torch

from srt.constrained.grammar import Matcher
from srt.managers.io_struct import SpecCounts
from srt.model_process.batch import Batch, chain_parents
from srt.model_process.ngram import NgramProposer
from srt.model_process.req import Req
from srt.server_args import ServerArgs

if TYPE_CHECKING:
    from srt.model_process.draft_runner import DraftRunner

MAX_BACKOFF = 16  # decode steps a request skips drafting after repeated rejections


@dataclass
class SpecTotals:
    """The server's speculative decoding so far (`/get_server_info` `speculative`)."""

    verify_steps: int = 0  # verification steps run
    request_steps: int = 0  # (request, verification step) pairs
    draft_tokens: int = 0
    accepted_tokens: int = 0
    emitted_tokens: int = 0  # tokens appended by verification steps
    plain_steps: int = 0  # decode steps run without drafts while speculation was on

    def snapshot(self, algorithm: str, draft_tokens: int, disable_bs: int) -> dict:
        return {
            "algorithm": algorithm,
            "num_draft_tokens": draft_tokens + 1,
            "disable_by_batch_size": disable_bs,
            "verify_steps": self.verify_steps,
            "plain_decode_steps": self.plain_steps,
            "draft_tokens": self.draft_tokens,
            "accepted_tokens": self.accepted_tokens,
            "accept_rate": round(self.accepted_tokens / self.draft_tokens, 4)
            if self.draft_tokens else 0.0,
            # output tokens per request and verification step, the bonus token included
            "accept_length": round(self.emitted_tokens / self.request_steps, 4)
            if self.request_steps else 0.0,
        }


@dataclass
class Proposal:
    """A verification round's drafts (ids on the host, per request; a tree by `parents`, as
    `VerifyRows` reads them, None: chains), the step's slots (one per request and draft token,
    request by request, each request's root first), and with a grammar in the batch the matcher
    of each row (None: the row is not constrained)."""

    drafts: list[list[int]]
    slots: torch.Tensor
    matchers: list[Matcher | None] | None = None
    parents: list[list[int]] | None = None


def main_path(parents: list[int]) -> list[int]:
    """The nodes of a tree's main path: the root's first child, its first child, ..."""
    path: list[int] = []
    node = -1
    for j, p in enumerate(parents):
        if p == node:
            path.append(j)
            node = j
    return path


def grammar_rows(m: Matcher | None, draft: list[int]) -> tuple[list[int], list[Matcher | None]]:
    """The leading drafts `m`'s grammar accepts (no stop token: the request would end there)
    and the matcher of each of the request's verification rows: `m` itself for the first, then
    forks that accepted the drafts before the row. `m` is not changed."""
    if m is None:
        return draft, [None] * (1 + len(draft))
    rows: list[Matcher | None] = [m]
    kept: list[int] = []
    if draft:
        f = m.fork()
        for t in draft:
            if m.is_stop_token(t) or not f.accept(t):
                break
            kept.append(t)
            rows.append(f.fork())
    return kept, rows


class Speculator:
    def __init__(self, args: ServerArgs, vocab_size: int,
                 draft_model: DraftRunner | None = None) -> None:
        """`draft_model`: STANDALONE's draft (None: NGRAM drafts from the request's tokens);
        `vocab_size`: the target's (no draft token at or above it)."""
        self.vocab_size = vocab_size
        self.algorithm = args.speculative_algorithm or ""
        self.k = args.speculative_draft_tokens
        self.topk = args.speculative_eagle_topk or 1
        self.breadth = args.speculative_ngram_max_bfs_breadth if self.algorithm == "NGRAM" else 1
        self.tree = args.speculative_tree_depth > 0
        # a tree's head steps write their KV into slots of their own, freed after drafting
        self.tree_slots = (args.speculative_steps - 1) * self.topk if self.topk > 1 else 0
        self.disable_bs = args.speculative_disable_by_batch_size
        self.proposer = NgramProposer(args.speculative_ngram_min_match_window_size,
                                      args.speculative_ngram_max_match_window_size)
        self.draft_model = draft_model
        # A lookup that missed says little about the next one of a draft model, whose cost
        # is paid in every step anyway (mirrored): only NGRAM backs off.
        self.backoff = draft_model is None
        self.totals = SpecTotals()

    def counts(self, req: Req) -> SpecCounts:
        if req.spec is None:
            req.spec = SpecCounts()
        return req.spec

    @staticmethod
    def _may_draft(r: Req) -> bool:
        return r.draft_backoff == 0

    def wants_drafts(self, reqs: list[Req]) -> bool:
        """Some request of the batch would draft now (asked before the step in flight is read:
        if none would, the batch goes on decoding overlapped)."""
        return len(reqs) < self.disable_bs and any(map(self._may_draft, reqs))

    def _count(self, r: Req, room: int) -> int:
        """Tokens `r` may draft now with `room` slots left for drafts: a chain no more than it
        may still emit after the next, a tree all its nodes (its branches are side by side)."""
        if not self._may_draft(r) or r.remaining_new_tokens < 2:
            return 0
        most = self.k if self.tree else min(self.k, r.remaining_new_tokens - 1)
        return max(0, min(most, room))

    def drafts(self, batch: Batch, room: int, alloc: Callable[[int], torch.Tensor],
               free: Callable[[torch.Tensor], None]) -> Proposal | None:
        """Draft tokens for each request of the running batch, at most `room` in all, and the
        verification step's slots from `alloc(n)` (`free` gives back those a grammar's cut
        left unused). None if no request drafts (the step is a plain decode step)."""
        if len(batch) >= self.disable_bs:
            return None
        constrained = any(r.matcher is not None for r in batch.reqs)
        rows: list[Matcher | None] = []
        if self.draft_model is None:
            drafts: list[list[int]] = []
            shapes: list[list[int]] = []  # each request's parents
            for r in batch.reqs:
                k = self._count(r, room)
                if self.breadth > 1 and r.matcher is None:  # (constrained: a chain)
                    d, par = self.proposer.propose_tree(r, k, self.breadth)
                    m = [None] * (1 + len(d))
                else:
                    d, m = grammar_rows(r.matcher, self.proposer.propose(r, k) if k else [])
                    par = chain_parents(len(d))
                drafts.append(d)
                shapes.append(par)
                rows.extend(m)
                room -= len(d)
            if not any(drafts):
                return None
            return Proposal(drafts, alloc(len(batch) + sum(map(len, drafts))),
                            rows if constrained else None, shapes if self.breadth > 1 else None)
        ks: list[int] = []
        for r in batch.reqs:
            k = self._count(r, room - self.tree_slots)
            ks.append(k)
            room -= k + (self.tree_slots if k else 0)
        if not any(ks):
            return None
        slots = alloc(len(batch) + sum(ks))  # the draft model writes into the step's slots
        parents: list[list[int]] | None = None
        if self.topk > 1:
            proposed, parents = self.draft_model.propose_tree(
                batch.rows, batch.kv_lens, ks, slots, self.vocab_size, alloc, free)
        else:
            proposed = self.draft_model.propose(batch.rows, batch.kv_lens,
                                                [r.fill_ids[-1] for r in batch.reqs], ks,
                                                slots, self.vocab_size)
        if not constrained and parents is None:
            return Proposal(proposed, slots)
        # A constrained request verifies its main path, cut before the first token its grammar
        # refuses; the slots of the nodes a request does not verify are given back (a tree may
        # also come out smaller than asked for).
        drafts = []
        keep = np.zeros(len(slots), dtype=bool)
        start = 0
        for i, (r, d) in enumerate(zip(batch.reqs, proposed)):
            nodes = list(range(len(d)))
            if r.matcher is None:
                rows.extend([None] * (1 + len(d)))
            else:
                path = main_path(parents[i]) if parents is not None else nodes
                kept, m = grammar_rows(r.matcher, [d[j] for j in path])
                nodes = path[: len(kept)]
                rows.extend(m)
                if parents is not None:
                    parents[i] = chain_parents(len(nodes))  # now a chain
            drafts.append([d[j] for j in nodes])
            keep[start] = True
            keep[[start + 1 + j for j in nodes]] = True
            start += 1 + ks[i]
        if not keep.all():
            mask = torch.from_numpy(keep)
            free(slots[~mask])
            slots = slots[mask]
        return Proposal(drafts, slots, rows if constrained else None, parents)

    def note_plain_step(self, reqs: list[Req]) -> None:
        """A decode step without drafts: each request took a step of one token."""
        self.totals.plain_steps += 1
        for r in reqs:
            self.counts(r).verify_ct += 1
            r.draft_backoff = max(0, r.draft_backoff - 1)

    def note(self, req: Req, drafted: int, accepted: int, emitted: int,
             chained: bool = False) -> None:
        """A verification step of `req`: `drafted` draft tokens, `accepted` of them kept,
        `emitted` tokens appended in all. A chained step (`spec_chain`) never backs off: it
        costs about a plain step, and backing off would break the chain."""
        if chained:
            req.draft_misses = 0
        elif drafted == 0:
            req.draft_backoff = max(0, req.draft_backoff - 1)
        elif accepted == 0 and self.backoff:
            req.draft_misses += 1
            req.draft_backoff = min(MAX_BACKOFF, (1 << (req.draft_misses - 1)) - 1)
        else:
            req.draft_misses = 0
        c = self.counts(req)
        c.verify_ct += 1
        c.draft_tokens += drafted
        c.accepted_tokens += accepted
        t = self.totals
        t.request_steps += 1
        t.draft_tokens += drafted
        t.accepted_tokens += accepted
        t.emitted_tokens += emitted

    def snapshot(self) -> dict:
        return self.totals.snapshot(self.algorithm, self.k, self.disable_bs)
