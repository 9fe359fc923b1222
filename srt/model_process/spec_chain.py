"""Chained verification steps (NGRAM): each verification step is launched before the host reads
the one before it, so the host's work of a step (reading, appending, stop checks, streaming,
preparing the next) runs while the device computes the next one, as in the overlapped decode
loop.

A verification step's inputs depend on what the step before accepted: the root is the token the
target emitted after the last accepted draft, the positions start after it, and the drafts are
looked up in the tokens including it. So they are computed on the device. Each request's tokens
live there too (`hist[i]`, `dlen[i]` of them for the chain's i-th request: prompt, outputs, and
the last emitted token, whose KV is computed by the next step), written from the host's copy
when a chain starts (a chain keeps its requests: any change ends it) and advanced by every
chained step:

  - drafts: the longest suffix of the tokens (`--speculative-ngram-min/max-match-window-size`)
    that occurred before, its latest occurrence, and the k tokens after it (continued as an
    overlapping copy near the end), exactly the rule of `NgramIndex.propose`, for all requests
    at once (`lookup`); where no suffix recurs, the request verifies k copies of its last token;
  - rows: the root and the k drafts at positions dlen - 1 .., their KV into the k + 1 slots the
    host gave the request (written to req_to_token on the device);
  - after sampling (`verify_sample`), the accepted count (the leading drafts equal to the
    emitted tokens), the emitted tokens into `hist`, `dlen` advanced, and the last emitted token
    into the executor's `last_ids` (where a plain decode step reads it).

The host reads a step one step late: each request appends its emitted tokens (the accepted
drafts and the token after them, fewer where it finishes), keeps the KV of their rows and frees
the rest (page size 1: one slot per position), and books the step (`Speculator.note`). A request
that finished has the step launched after that one dropped (its slots freed when it is read).

Chains run with `--speculative-chain` (auto: where greedy chains run as graphs: decode graphs
captured, one rank, no LoRA) and the overlapped loop, while every running request can take
them (`eligible`): NGRAM drafting chains (no tree); no grammar, logprobs, penalties,
pending min_new_tokens or per-request seed (their sampling reads host state per row); no jump
pending; not backing off after drafts rejected by unchained steps; room in the context for two
steps of k + 1 tokens. Chained steps never back off themselves (a rejected or missing lookup
costs a step of about a plain step's time, and backing off would end the chain). LoRA adapters
are fine (rows are grouped by adapter as in any decode step). The attention backend must read
each row's length from the device (`device_lengths`: Triton; the torch backend on the CPU,
where lengths read back for free). Anything else ends the chain: the step in flight is read
first, and the plain verification step of `Speculator` (or a decode step) runs.

On a GPU with decode graphs, a chain of greedy requests at one rank without LoRA launches its
steps as CUDA graphs around the decode graph (`spec_chain_graph.ChainGraphs`): a few replays
per step instead of some eighty launches; other chains run the same work op by op (`_eager`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from srt.layers import parallel_state
from srt.layers.forward_batch import ForwardBatch, ForwardMode
from srt.layers.sampler import verify_sample
from srt.model_process.req import Req, ReqStatus
from srt.model_process.sampling_info import SamplingRows, build_sampling_info
from srt.model_process.spec_chain_graph import (CaptureFailed, ChainGraphs, step_inputs,
                                                 step_outputs, width_for)
from srt.model_process.step_inputs import StagedCopier

if TYPE_CHECKING:
    from srt.managers.io_struct import TokenOut
    from srt.model_process.loop import ModelProcess

logger = logging.getLogger(__name__)


@dataclass
class ChainStep:
    """A launched chained verification step, read one step later (`wait`)."""

    reqs: list[Req]
    slots: torch.Tensor  # int64 host: k + 1 per request, request by request
    k: int
    host: torch.Tensor  # [B, k + 3]: emitted ids (k + 1), accepted count, found
    done: torch.cuda.Event | None

    def wait(self) -> np.ndarray:
        if self.done is not None:
            self.done.synchronize()
        return self.host.numpy()


class SpecChain:
    def __init__(self, p: ModelProcess) -> None:
        args = p.args
        self.p = p
        self.runner = p.runner
        self.dev = p.runner.device
        self.k = args.speculative_draft_tokens
        self.min_n = args.speculative_ngram_min_match_window_size
        self.max_n = args.speculative_ngram_max_match_window_size
        self.context = p.config.context_len
        self.copier = StagedCopier(self.dev)
        # [requests, context] int32 and [requests]: made at the first chain, one row per
        # request of a chain (fewer than --speculative-disable-by-batch-size)
        self.hist: torch.Tensor | None = None
        self.dlen: torch.Tensor | None = None
        self.sampling_rows: SamplingRows | None = None
        # the step's device work as CUDA graphs (greedy chains of one rank on a GPU, no LoRA)
        self.graphable = self.dev.type == "cuda" and self.graphs_apply(p)
        self.graphs: ChainGraphs | None = None
        self.greedy = False  # every request of the current chain is greedy
        self.graphed = 0  # steps launched through the graphs
        self.steps = 0  # chained steps launched
        self.starts = 0  # chains started (steps launched with nothing in flight to follow)
        self.found = 0  # (request, chained step) pairs whose suffix recurred

    @staticmethod
    def graphs_apply(p: ModelProcess) -> bool:
        """Chained steps can run as CUDA graphs here: decode graphs captured, one rank, no
        LoRA."""
        return (p.runner.graph_runner is not None and p.runner.lora is None
                and parallel_state.tp_size() == 1)

    @staticmethod
    def possible(p: ModelProcess) -> bool:
        """Whether this server chains at all: NGRAM drafting chains, `--speculative-chain` on
        (auto: where greedy chains run as CUDA graphs: decode graphs captured, one rank, no
        LoRA), the overlapped loop, and a backend that reads lengths from the device (or the
        CPU)."""
        args = p.args
        backend = p.runner.attn_backend
        mode = args.speculative_chain
        wanted = mode == "on" or (mode == "auto" and SpecChain.graphs_apply(p))
        return (args.speculative_algorithm == "NGRAM" and p.spec is not None and p.overlap
                and wanted
                and p.spec.breadth == 1 and args.speculative_draft_tokens >= 1
                and (p.runner.device.type == "cpu" or getattr(backend, "device_lengths", False)))

    def eligible(self, reqs: list[Req]) -> bool:
        spec = self.p.spec
        assert spec is not None
        if not reqs or len(reqs) >= spec.disable_bs:
            return False
        room = self.context - 2 * (self.k + 1)
        for r in reqs:
            sp = r.sampling_params
            if (r.matcher is not None or r.logprob is not None or sp.uses_penalties
                    or sp.seed is not None or r.kv_valid is not None or r.jump_wanted
                    or len(r.output_ids) + (self.k + 1) * r.in_flight < sp.min_new_tokens
                    or r.draft_backoff > 0 or r.remaining_new_tokens < 2
                    or len(r.origin_input_ids) + len(r.output_ids) > room):
                return False
        return True

    def _sync(self, reqs: list[Req]) -> None:
        """The requests' tokens as the host has them (nothing in flight) into `hist` and
        `dlen`, request i at row i."""
        if self.hist is None:
            rows_all, width = self.p.kv.req_pool.req_to_token.shape
            n = min(rows_all, self.p.spec.disable_bs)
            self.hist = torch.zeros((n, width), dtype=torch.int32, device=self.dev)
            self.dlen = torch.ones(n, dtype=torch.int64, device=self.dev)
        seqs = [r.origin_input_ids + r.output_ids for r in reqs]
        longest = max(map(len, seqs))
        host = np.zeros((len(seqs), longest), dtype=np.int32)
        for i, s in enumerate(seqs):
            host[i, : len(s)] = s
        n = len(seqs)
        self.hist[:n, :longest] = torch.from_numpy(host).to(self.dev)
        self.dlen[:n] = torch.tensor(list(map(len, seqs)), dtype=torch.int64).to(self.dev)
        self.greedy = all(r.sampling_params.is_greedy for r in reqs)
        if self.graphable and self.graphs is None:
            self.graphs = ChainGraphs(self.hist, self.dlen, self.p.executor.last_ids,
                                      self.p.kv.req_pool.req_to_token,
                                      self.runner.graph_runner, self.k, self.min_n, self.max_n)

    def _eager(self, reqs: list[Req], rows_h: np.ndarray, slots: torch.Tensor, width: int,
               bound: list[int]) -> torch.Tensor:
        """The step's device work op by op (sampled requests, LoRA, TP, the CPU, or more rows
        than the decode graphs hold); the packed result [B, k + 3] as `ChainGraphs.run_post`
        returns it."""
        p, k = self.p, self.k
        R = k + 1
        B = len(reqs)
        assert self.hist is not None and self.dlen is not None
        rows, out_loc = self.copier.copy([rows_h, slots.numpy()])
        lens = self.dlen[:B].clone()
        input_ids, positions, req_idx, drafts, found = step_inputs(
            self.hist[:B, :width], lens, rows, k, self.min_n, self.max_n)
        seq_lens = positions + 1
        req_pool = p.kv.req_pool
        req_pool.req_to_token[req_idx, positions] = out_loc.to(req_pool.req_to_token.dtype)
        if self.dev.type == "cpu":
            seq_cpu = seq_lens.tolist()
        else:
            seq_cpu = np.repeat(bound, R).tolist()
        fb = ForwardBatch(
            forward_mode=ForwardMode.DECODE, batch_size=B * R, input_ids=input_ids,
            positions=positions, out_cache_loc=out_loc, req_pool_indices=req_idx,
            seq_lens=seq_lens, seq_lens_cpu=seq_cpu, prefix_lens_cpu=[s - 1 for s in seq_cpu],
            extend_lens_cpu=[1] * (B * R), req_to_token_pool=req_pool,
            token_to_kv_pool=self.runner.token_to_kv_pool, attn_backend=self.runner.attn_backend)
        row_reqs = [r for r in reqs for _ in range(R)]
        if self.runner.lora is not None:
            fb.lora = self.runner.lora.batch_info(
                np.fromiter((r.lora_id for r in row_reqs), dtype=np.int64, count=B * R))
        logits = self.runner.forward(fb)
        info, self.sampling_rows = build_sampling_info(
            row_reqs, p.config.vocab_size, self.dev, p.output.stop_ids, self.sampling_rows)
        children = torch.cat([drafts, torch.full((B, 1), -1, dtype=torch.int64,
                                                 device=self.dev)], dim=1).view(-1)
        out = verify_sample(logits, info, children, self.runner.sampler_generator)
        out = parallel_state.broadcast_from_first(out).view(B, R)
        return step_outputs(out, lens, drafts, found, rows, self.hist, self.dlen,
                            p.executor.last_ids)

    def _graphed(self, g: ChainGraphs, B: int, rows_h: np.ndarray, slots: torch.Tensor,
                 longest: int, bound: list[int]) -> torch.Tensor:
        """The step's device work as three graph replays; the packed result."""
        R = self.k + 1
        assert self.hist is not None
        host_in = np.zeros(g.slot_at + B * R, dtype=np.int64)
        host_in[:B] = rows_h
        host_in[g.slot_at:] = slots.numpy()
        pbs = g.run_pre(B, width_for(longest, self.hist.shape[1]),
                        self.copier.copy([host_in])[0])
        seq_cpu = np.repeat(bound, R).tolist() + [1] * (pbs - B * R)
        self.runner.graph_runner.replay_static(pbs, seq_cpu)
        packed = g.run_post(B)
        self.graphed += 1
        return packed

    @torch.inference_mode()
    def launch(self, reqs: list[Req], slots: torch.Tensor, sync: bool) -> ChainStep:
        """Launch a chained verification step of `reqs` (k + 1 of `slots` each). `sync`: no
        step is in flight, the host's tokens are the latest."""
        k = self.k
        R = k + 1
        B = len(reqs)
        rows_h = np.array([r.req_pool_idx for r in reqs], dtype=np.int64)
        if sync or self.hist is None:
            self._sync(reqs)
            self.starts += 1
        assert self.hist is not None and self.dlen is not None
        # every row's tokens lie within the longest the host knows plus one step in flight
        longest = max(len(r.origin_input_ids) + len(r.output_ids) for r in reqs) + R
        # (an upper bound of each row's length: the Triton backend reads them from the device)
        bound = [len(r.origin_input_ids) + len(r.output_ids) + 2 * R for r in reqs]
        g = self.graphs
        packed = None
        if g is not None and self.greedy and g.fits(B):
            try:
                packed = self._graphed(g, B, rows_h, slots, longest, bound)
            except CaptureFailed as e:
                # (a capture records without running: the device holds the state before this
                # step's acceptance, which the eager path then computes in full)
                logger.warning("chained steps run op by op from now on: a CUDA graph capture "
                               "failed (%s)", e)
                self.graphs = None
                self.graphable = False
        if packed is None:
            packed = self._eager(reqs, rows_h, slots, min(self.context, longest), bound)
        done = None
        host = packed
        if self.dev.type == "cuda":
            host = torch.empty(packed.shape, dtype=packed.dtype, pin_memory=True)
            host.copy_(packed, non_blocking=True)
            done = torch.cuda.Event()
            done.record()
        for r in reqs:
            r.in_flight += 1
            r.forward_passes += 1
        self.steps += 1
        return ChainStep(list(reqs), slots, k, host, done)


def chain_step(p: ModelProcess, outs: list[TokenOut]) -> bool | None:
    """Launch the next chained verification step of the running batch, then read the one in
    flight (if it was chained and of the same requests). True if the caller's round must end
    (the batch emptied or a request left it), None if the pool has no room for the step (the
    caller takes a plain step, which retracts if it must)."""
    chain = p.chain
    assert chain is not None and p.spec is not None
    prev = p.inflight
    if prev is not None and not (isinstance(prev, ChainStep)
                                 and _same(prev.reqs, p.batch.reqs)):
        if p._resolve(outs) or not p.batch:
            p.counters.timer.discard()
            return True
        prev = None
    n = len(p.batch) * (chain.k + 1)
    if p.kv.room() < n:  # (the plain steps retract to make room)
        if prev is not None and (p._resolve(outs) or not p.batch):
            p.counters.timer.discard()
            return True
        return None
    step = chain.launch(p.batch.reqs, p.kv.alloc_slots(n), sync=prev is None)
    p.inflight = step
    p.ratio.step()
    p.spec.totals.verify_steps += 1
    if prev is not None:
        p.counters.overlapped_steps += 1
        apply_chained(p, prev, outs)
    p.counters.timer.end(len(step.reqs))
    return not p.batch


def _same(a: list[Req], b: list[Req]) -> bool:
    return len(a) == len(b) and all(x is y for x, y in zip(a, b))


def apply_chained(p: ModelProcess, step: ChainStep, outs: list[TokenOut]) -> bool:
    """Read a chained step: append each request's emitted tokens, keep their rows' KV and free
    the rest; a request finished before the step (by the read of the one before) frees all of
    its rows. Finished requests leave the batch. False (no request jumps: none has a grammar)."""
    assert p.spec is not None and p.chain is not None
    chain = p.chain
    res = step.wait()
    p.counters.timer.mark("wait")
    R = step.k + 1
    req_pool = p.kv.req_pool
    free: list[torch.Tensor] = []
    live: list[Req] = []
    for i, r in enumerate(step.reqs):
        r.in_flight -= 1
        mine = step.slots[i * R : (i + 1) * R]
        if r.finished:  # launched for nothing
            free.append(mine)
            r.forward_passes -= 1
            continue
        base = r.kv_len  # the root's position
        accepted, found = int(res[i, R]), int(res[i, R + 1])
        emitted = 0
        for j in range(accepted + 1):
            p.output.append(r, int(res[i, j]), None, dead_end=False)
            emitted += 1
            if r.finished:
                break
        if req_pool.host is not req_pool.req_to_token:
            req_pool.host.numpy()[r.req_pool_idx, base : base + emitted] = \
                mine[:emitted].numpy()
        free.append(mine[emitted:])
        # (a request whose suffix did not recur verified copies of its last token: drafts too)
        p.spec.note(r, step.k, min(accepted, emitted - 1), emitted, chained=True)
        chain.found += found
        live.append(r)
    if free:
        p.kv.pool.free(torch.cat(free))
    p.output.finish_dead_ends(live)
    for r in live:
        p._settle(r, outs)
    p.batch.filter(lambda r: r.status == ReqStatus.RUNNING)
    # (a request with a chained step in flight has no host length: it is read before any
    # step that uses one)
    p.batch.kv_lens[:] = [r.kv_len for r in p.batch.reqs]
    return False
