"""The batch object: a list of requests and the per-request host arrays a step is built from.

A `Batch` is either a fill batch (waiting requests admitted this round) or the running batch.
Its arrays are kept in step with `reqs` by every mutator (`filter`, `merge`, `remove`) and
updated in place by the step builders, not rebuilt from the requests each step:

    rows[i]     the req_to_token row of reqs[i]
    kv_lens[i]  positions of reqs[i] whose KV is computed or being computed by a launched step:
                r.kv_len + r.in_flight for a decoding request (`check` asserts it)

A step is described by a `StepPlan` (host arrays and the slots it writes); the step executor
turns it into device tensors. A DECODE plan has no input ids: the executor takes each row's last
sampled id from the device (so a step can be launched before the previous one's ids reach the
host).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

import numpy as np
import torch

from srt.layers.forward_batch import ForwardMode, ImageSpanInput
from srt.model_process.req import Req


@dataclass
class StepPlan:
    """One forward: per forward row positions / rows / seq_lens (one row per request, except
    a mixed step's several per jumped request), the slots it writes, and which row each request
    samples from (None: row i for request i)."""

    mode: ForwardMode
    reqs: list[Req]
    positions: np.ndarray
    rows: np.ndarray
    seq_lens: np.ndarray
    prefix_lens: list[int]
    extend_lens: list[int]
    out_cache_loc: torch.Tensor  # int64 CPU
    input_ids: list[int] | None = None  # None: the rows' last sampled ids, on the device
    sample_rows: list[int] | None = None
    images: list[ImageSpanInput] | None = None
    # A fill step: its first n_fill requests are filled (the rest are running requests that
    # decode inside it: a mixed step). None: every request (or not a fill).
    n_fill: int | None = None
    verify: VerifyRows | None = None  # a verification step (speculative decoding)
    fill: bool = False  # a fill planned as DECODE rows (srt.model_process.graph_fill)

    def fill_end(self, i: int) -> int:
        """Where fill request i's computed tokens end (its prompt is done if that is all of
        it): after its last row's position."""
        if self.fill:
            return int(self.seq_lens[self.sample_rows[i]])
        return self.prefix_lens[i] + self.extend_lens[i]

    @property
    def req_rows(self) -> np.ndarray:
        """The req_to_token row of each request (its last sampled id goes there)."""
        return np.array([r.req_pool_idx for r in self.reqs], dtype=np.int64) \
            if self.sample_rows is not None else self.rows


@dataclass
class VerifyRows:
    """The rows of a verification step. Request i's drafts form a tree: node j holds token
    drafts[i][j] and follows node parents[i][j] (-1: the request's last sampled id, the root;
    a parent comes before its children, and siblings hold distinct tokens; a chain is
    parents [-1, 0, 1, ...]). The request feeds its root and then every node, one DECODE row
    each from row starts[i] on (node j at row starts[i] + 1 + j, position kv_len + its depth);
    every row's logits are sampled given its children's tokens.

    Each row attends to its own path: the nodes of the main path (the root's first child, its
    first child, ...) sit in the request's req_to_token row, as a chain's drafts do; every other
    node reads a scratch row (`fork`: the request's row up to kv_len, then its ancestors' slots,
    then its own), so no tree mask is needed."""

    drafts: list[list[int]]
    parents: list[list[int]]
    starts: list[int]
    row_reqs: list[Req]  # the request of each row
    offsets: np.ndarray  # [rows] the row's depth (0: the root): output tokens before it
    children: np.ndarray  # [rows, C] int64: the tokens of the row's children, -1 padded
    # the grammar state of each row (after the drafts before it); None: no grammar in the step
    matchers: list[Any] | None = None
    # scratch rows to write before the step: (dst, src, prefix, (row, column, slot) cells)
    fork: tuple[np.ndarray, np.ndarray, int, tuple[np.ndarray, np.ndarray, np.ndarray]] | None \
        = None
    chains: list[bool] | None = None  # per request: its drafts are a chain (no fork, no move)

    @property
    def draft_next(self) -> np.ndarray:
        """[rows] the first child's token after each row (-1: none): a chain's next draft."""
        return self.children[:, 0]

    def path(self, i: int, node: int) -> list[int]:
        """Request i's nodes from the root's child down to `node` (-1: [])."""
        par = self.parents[i]
        out: list[int] = []
        while node >= 0:
            out.append(node)
            node = par[node]
        return out[::-1]

    def drafts_before(self) -> list[list[int]]:
        """For each row, the draft tokens its output follows (the path fed up to the row)."""
        out: list[list[int]] = []
        for i, d in enumerate(self.drafts):
            out.append([])
            out.extend([d[n] for n in self.path(i, j)] for j in range(len(d)))
        return out

    def accepted(self, ids: list[int], i: int) -> list[int]:
        """Request i's kept nodes, root's child first: from the root, each row's emitted token
        leads to the child that holds it, until a row emits a token no child holds."""
        d, par, start = self.drafts[i], self.parents[i], self.starts[i]
        kept: list[int] = []
        node = -1
        while True:
            t = ids[start + 1 + node]
            nxt = next((j for j in range(node + 1, len(d)) if par[j] == node and d[j] == t),
                       None)
            if nxt is None:
                return kept
            kept.append(nxt)
            node = nxt


def chain_parents(n: int) -> list[int]:
    """The parents of a chain of n drafts."""
    return list(range(-1, n - 1))


@dataclass
class Batch:
    reqs: list[Req] = field(default_factory=list)
    rows: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    kv_lens: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))

    @classmethod
    def of(cls, reqs: Iterable[Req]) -> "Batch":
        """A batch of running requests (rows assigned), arrays read from the requests."""
        reqs = list(reqs)
        return cls(reqs, np.array([r.req_pool_idx for r in reqs], dtype=np.int64),
                   np.array([r.kv_len + r.in_flight for r in reqs], dtype=np.int64))

    def __len__(self) -> int:
        return len(self.reqs)

    def __iter__(self):  # noqa: ANN204 - an iterator of Req
        return iter(self.reqs)

    def __bool__(self) -> bool:
        return bool(self.reqs)

    # ------------------------------------------------------------------ membership

    def filter(self, keep: Callable[[Req], bool]) -> list[Req]:
        """Keep the requests for which keep(r) holds, in order; return the others."""
        mask = np.fromiter((keep(r) for r in self.reqs), dtype=bool, count=len(self.reqs))
        if mask.all():
            return []
        gone = [r for r, k in zip(self.reqs, mask) if not k]
        self.reqs = [r for r, k in zip(self.reqs, mask) if k]
        self.rows, self.kv_lens = self.rows[mask], self.kv_lens[mask]
        return gone

    def remove(self, reqs: Iterable[Req]) -> None:
        """Take these requests out (retraction, aborts)."""
        drop = set(map(id, reqs))
        self.filter(lambda r: id(r) not in drop)

    def merge(self, other: "Batch") -> None:
        """Append other's requests after ours."""
        self.reqs.extend(other.reqs)
        self.rows = np.concatenate((self.rows, other.rows))
        self.kv_lens = np.concatenate((self.kv_lens, other.kv_lens))

    def check(self) -> None:
        """The arrays agree with the requests (tests call it; it costs a pass over the batch)."""
        assert len(self.rows) == len(self.kv_lens) == len(self.reqs)
        for i, r in enumerate(self.reqs):
            assert self.rows[i] == r.req_pool_idx, (i, r.rid)
            if r.kv_valid is None:
                assert self.kv_lens[i] == r.kv_len + r.in_flight, (i, r.rid, self.kv_lens[i])

    # ------------------------------------------------------------------ steps

    def prepare_fill(self, slots: torch.Tensor, running: "Batch | None" = None) -> StepPlan:
        """The EXTEND (or PREFILL) step of a fill batch whose rows were just assigned: each
        request computes extend_input_len fill ids after its cached prefix into its share of
        `slots` (all of its prompt, or the next chunk of it).

        `running`: a mixed step. The running batch's requests follow the fill's in the same
        step, each computing its step_input_len ids (one, unless it jumped) from kv_computed
        on as an extend row of its own, into the rest of `slots`; their kv_lens grow to their
        whole length. Their ids must be on the host (no step in flight)."""
        members = self.reqs + (running.reqs if running is not None else [])
        prefix: list[int] = []
        ext: list[int] = []
        input_ids: list[int] = []
        positions: list[np.ndarray] = []
        images: list[ImageSpanInput] = []
        offset = 0
        for i, r in enumerate(members):
            if i < len(self.reqs):
                pre, e = len(r.prefix_indices), r.extend_input_len
            else:
                pre, e = r.kv_computed, r.step_input_len
                r.kv_valid = None
            prefix.append(pre)
            ext.append(e)
            input_ids.extend(r.fill_ids[pre : pre + e])
            positions.append(np.arange(pre, pre + e, dtype=np.int64))
            span = r.image.step_span(pre, e, offset) if r.image is not None else None
            if span is not None:
                images.append(span)
            offset += e
        seq = np.array(prefix, dtype=np.int64) + np.array(ext, dtype=np.int64)
        n = len(self.reqs)
        self.rows = np.array([r.req_pool_idx for r in self.reqs], dtype=np.int64)
        self.kv_lens = seq[:n].copy()
        if running is not None:
            running.kv_lens[:] = seq[n:]
        rows = np.array([r.req_pool_idx for r in members], dtype=np.int64)
        mode = ForwardMode.EXTEND if any(prefix) else ForwardMode.PREFILL
        return StepPlan(mode, members, np.concatenate(positions), rows, seq, prefix, ext,
                        slots, input_ids=input_ids, images=images or None,
                        n_fill=n if running is not None else None)

    def prepare_decode(self, slots: torch.Tensor, launch: np.ndarray | None = None) -> StepPlan:
        """The DECODE step of the requests where `launch` holds (all by default): one token
        each at position kv_lens[i], whose KV goes to `slots`; their kv_lens grow by one."""
        idx = np.arange(len(self.reqs)) if launch is None else np.flatnonzero(launch)
        reqs = [self.reqs[i] for i in idx]
        positions = self.kv_lens[idx]
        self.kv_lens[idx] += 1
        n = len(reqs)
        return StepPlan(ForwardMode.DECODE, reqs, positions, self.rows[idx], positions + 1,
                        positions.tolist(), [1] * n, slots)

    def mixed_rows(self) -> int:
        """Forward rows of the next step when some request jumped forward inside the batch."""
        return sum(r.step_input_len for r in self.reqs)

    def prepare_mixed(self, slots: torch.Tensor) -> StepPlan:
        """The step after a jump inside the batch: each request computes its ids from
        `kv_computed` on (one for most), one DECODE row per id; each samples from its last row.
        Every request's kv_lens becomes its whole length."""
        input_ids: list[int] = []
        positions: list[np.ndarray] = []
        rows: list[np.ndarray] = []
        last: list[int] = []
        n = 0
        for r in self.reqs:
            start, ext = r.kv_computed, r.step_input_len
            input_ids.extend(r.fill_ids[start:])
            positions.append(np.arange(start, start + ext, dtype=np.int64))
            rows.append(np.full(ext, r.req_pool_idx, dtype=np.int64))
            n += ext
            last.append(n - 1)
            r.kv_valid = None
            self.kv_lens[len(last) - 1] = start + ext
        pos = np.concatenate(positions)
        return StepPlan(ForwardMode.DECODE, list(self.reqs), pos, np.concatenate(rows), pos + 1,
                        pos.tolist(), [1] * len(pos), slots, input_ids=input_ids,
                        sample_rows=last)

    def prepare_verify(self, slots: torch.Tensor, drafts: list[list[int]],
                       matchers: list[Any] | None = None,
                       parents: list[list[int]] | None = None,
                       scratch: range | None = None) -> StepPlan:
        """A verification step (speculative decoding): request i computes its last sampled id
        and then the nodes of drafts[i] (a tree by `parents`, None: chains; see `VerifyRows`),
        one DECODE row each at position kv_lens[i] + depth, into its share of `slots` (root,
        then nodes in order); every row is sampled. Nodes off the main path read scratch rows
        taken from `scratch` in order. kv_lens[i] grows by 1 + len(drafts[i]): the loop sets it
        back to what was accepted and frees the rest. The ids must be on the host (no step in
        flight). `matchers`: each row's grammar state (a constrained request's rows differ)."""
        if parents is None:
            return self._prepare_chains(slots, drafts, matchers)
        input_ids: list[int] = []
        counts = np.array([1 + len(d) for d in drafts], dtype=np.int64)
        starts = np.concatenate(([0], np.cumsum(counts)[:-1]))
        n_rows = int(counts.sum())
        depth = np.zeros(n_rows, dtype=np.int64)
        rows = np.repeat(self.rows, counts)
        kids: list[list[int]] = [[] for _ in range(n_rows)]
        row_reqs: list[Req] = []
        slot_list = slots.tolist()
        next_scratch = 0
        dst: list[int] = []
        src: list[int] = []
        cells: list[tuple[int, int, int]] = []
        for i, (r, d, par) in enumerate(zip(self.reqs, drafts, parents)):
            s0, base = int(starts[i]), int(self.kv_lens[i])
            input_ids.append(r.fill_ids[-1])
            input_ids.extend(d)
            row_reqs.extend([r] * (1 + len(d)))
            main = -1  # the last node of the main path so far
            for j, p in enumerate(par):
                assert -1 <= p < j, (p, j)
                row = s0 + 1 + j
                depth[row] = depth[s0 + 1 + p] + 1
                kids[s0 + 1 + p].append(d[j])
                if p == main:
                    main = j
                    continue
                assert scratch is not None and next_scratch < len(scratch), "no scratch row"
                rows[row] = scratch[next_scratch]
                next_scratch += 1
                dst.append(int(rows[row]))
                src.append(int(self.rows[i]))
                a = p
                while a >= -1:  # its ancestors' slots, down to the root's
                    cells.append((int(rows[row]), base + int(depth[s0 + 1 + a]),
                                  slot_list[s0 + 1 + a]))
                    a = par[a] if a >= 0 else -2
        width = max(1, max(map(len, kids)))
        children = np.full((n_rows, width), -1, dtype=np.int64)
        for row, k in enumerate(kids):
            children[row, : len(k)] = k
        positions = np.repeat(self.kv_lens, counts) + depth
        fork = None
        if dst:
            c = np.array(cells, dtype=np.int64).T
            fork = (np.array(dst, dtype=np.int64), np.array(src, dtype=np.int64),
                    int(self.kv_lens.max()), (c[0], c[1], c[2]))
        self.kv_lens += counts
        verify = VerifyRows(drafts, parents, starts.tolist(), row_reqs, depth, children,
                            matchers, fork,
                            [p == chain_parents(len(p)) for p in parents])
        return StepPlan(ForwardMode.DECODE, list(self.reqs), positions, rows, positions + 1,
                        positions.tolist(), [1] * len(positions), slots, input_ids=input_ids,
                        verify=verify)

    def _prepare_chains(self, slots: torch.Tensor, drafts: list[list[int]],
                        matchers: list[Any] | None) -> StepPlan:
        """`prepare_verify` where every request's drafts are a chain: its rows at consecutive
        positions of its own row, laid out with array operations."""
        input_ids: list[int] = []
        counts = np.array([1 + len(d) for d in drafts], dtype=np.int64)
        starts = np.concatenate(([0], np.cumsum(counts)[:-1]))
        offsets = np.arange(int(counts.sum()), dtype=np.int64) - np.repeat(starts, counts)
        positions = np.repeat(self.kv_lens, counts) + offsets
        children = np.full((len(positions), 1), -1, dtype=np.int64)
        row_reqs: list[Req] = []
        for i, (r, d) in enumerate(zip(self.reqs, drafts)):
            input_ids.append(r.fill_ids[-1])
            input_ids.extend(d)
            children[starts[i] : starts[i] + len(d), 0] = d
            row_reqs.extend([r] * (1 + len(d)))
        self.kv_lens += counts
        verify = VerifyRows(drafts, [chain_parents(len(d)) for d in drafts], starts.tolist(),
                            row_reqs, offsets, children, matchers, None, [True] * len(drafts))
        return StepPlan(ForwardMode.DECODE, list(self.reqs), positions,
                        np.repeat(self.rows, counts), positions + 1, positions.tolist(),
                        [1] * len(positions), slots, input_ids=input_ids, verify=verify)
