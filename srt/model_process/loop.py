"""The model process of one TP rank: the loop that orchestrates its components.

Each StepInput from the router adds requests and aborts; then one round runs either a fill
batch (EXTEND/PREFILL) or a few DECODE steps of the running batch. Rank 0 answers with a
StepOutput; every rank sees the same inputs, so every rank makes the same decisions. Within a
round of several decode steps, rank 0 hands each step's outputs on at once (`emit`: a partial
StepOutput), so a streamed token reaches the client when it is read, not at the round's end.

Chunked prefill (`--chunked-prefill-size`): a fill computes at most that many new tokens; a longer
prompt is computed over several fills and waits between them (PREFILLING, its KV kept). With
`--enable-mixed-chunk` every fill step also carries the next token of every running request
(a mixed step); without it, a decode step of the running batch runs between two chunks. Either
way a long prompt never stops the running requests for longer than one chunk.

Overlap (on by default, `--disable-overlap-schedule` turns it off): a launched decode step is
left in flight. The next one is launched from its sampled ids on the device (`Batch`,
`StepExecutor`), and only then are its ids read and its host work done (appending, stop checks,
streaming, finishing), while the device computes; a round ends with a step in flight, so the
router round trip overlaps it too. With a grammar in the batch the step in flight is read
between the next step's forward and its sampling (the masks need its tokens); a request whose
pattern then forces text has that step resolved before the next launch, and jumps. A batch whose
sampling needs the previous token on the host otherwise (penalties) or whose KV needs a
retraction resolves the step in flight first.
A request finished by step k that was already launched into step k+1 has that step's slot
freed and its token dropped.
"""

from __future__ import annotations

import dataclasses
import random
import time
from typing import Any, Callable

import numpy as np
import torch

from srt.heap import HeapTrimmer
from srt.managers.io_struct import (AbortReq, BatchTokenIdOut, StepInput, StepOutput,
                                    TokenizedGenerateReq, TokenOut)
from srt.model_config import ModelConfig
from srt.model_process.batch import Batch, StepPlan
from srt.model_process.constraints import ConstraintManager
from srt.model_process.executor import InFlight, StepExecutor
from srt.model_process.graph_fill import GraphFill
from srt.model_process.intake import handle_control, new_req
from srt.model_process.kv import KVManager
from srt.model_process.model_runner import ModelRunner
from srt.model_process.output import OutputProcessor
from srt.model_process.policy import (FillWait, TokenRatio, fill_cap_tokens, fill_wait_tokens,
                                      next_fill)
from srt.model_process.retraction import make_room
from srt.model_process.spec_chain import ChainStep, SpecChain, apply_chained, chain_step
from srt.model_process.speculative import Speculator
from srt.model_process.radix_cache import RadixCache
from srt.model_process.req import FinishReason, Req, ReqStatus
from srt.model_process.stats import Counters, maybe_log, stats
from srt.model_process.warmup import warm_up
from srt.server_args import ServerArgs

# Decode steps per round while nothing waits: amortizes the router round trip; a waiting request
# is reconsidered after every step, and a new input ends the round (`step`).
DECODE_STEPS_PER_ROUND = 4


class ModelProcess:
    def __init__(self, args: ServerArgs, tp_rank: int, dist_init_port: int | None = None) -> None:
        from transformers import AutoTokenizer

        self.args, self.tp_rank = args, tp_rank
        self.config = ModelConfig.load(args.model_path, args.context_length)
        self.runner = ModelRunner(args, self.config, tp_rank, dist_init_port)
        self.tokenizer = AutoTokenizer.from_pretrained(args.tokenizer_path)
        pool = self.runner.token_to_kv_pool
        self.kv = KVManager(pool, self.runner.req_to_token_pool,
                            RadixCache(pool, disable=args.disable_radix_cache))
        self.waiting: list[Req] = []
        self.batch = Batch()  # the running requests
        self.inflight: InFlight | None = None  # the last launched decode step, not yet read
        self.overlap = not args.disable_overlap_schedule
        self.chunk_size = args.chunked_prefill_size if args.chunked_prefill_size > 0 else None
        self.fill_cap = cap = fill_cap_tokens(args, self.runner.model)
        self.decoding_chunk_size = min(cap, self.chunk_size or cap) if cap > 0 else self.chunk_size
        self.mixed = args.enable_mixed_chunk
        self._decode_turn = False  # running requests decode once before the next fill
        self.fill_wait = FillWait(fill_wait_tokens(args, self.runner.model),
                                  args.max_fill_wait_steps)
        self._emit: Callable[[BatchTokenIdOut], None] | None = None  # this round's
        self.ratio = TokenRatio.from_conservativeness(args.schedule_conservativeness)
        self.rng = random.Random(args.random_seed)
        self.arrivals = 0
        eos = self.tokenizer.eos_token_id
        eos_ids = set(self.config.eos_token_ids) | (set() if eos is None else {int(eos)})
        self.output = OutputProcessor(self.tokenizer, eos_ids, args.stream_interval)
        self.counters = Counters()
        self.constraints = ConstraintManager(args, self.tokenizer, self.runner.device, self.kv,
                                             self.output, self.config.vocab_size)
        self.executor = StepExecutor(self.runner, self.config.vocab_size, self.output.stop_ids,
                                     self.counters.timer, self.constraints.mask_builder)
        # Speculative decoding (--speculative-algorithm): drafts verified in decode steps.
        self.spec = Speculator(args, self.config.vocab_size, self.runner.draft) \
            if args.speculative_algorithm else None
        self.graph_fill = GraphFill.of(args, self.runner)  # short fills as decode rows
        self.chain = SpecChain(self) if SpecChain.possible(self) else None
        self.heap = HeapTrimmer()  # the process loop trims when idle and every 30 s of work
        # On a GPU the first fills compile kernels; on the CPU there is nothing to warm up.
        if not args.skip_warmup and self.runner.device.type == "cuda":
            warm_up(self)

    @property
    def running(self) -> list[Req]:
        return self.batch.reqs

    def reset_stats(self) -> None:
        self.counters = Counters()
        self.executor.timer = self.counters.timer
        self.output.generated = 0
        self.constraints.jumps = self.constraints.jump_tokens = 0

    def stats(self) -> dict[str, Any]:
        return stats(self)

    # ------------------------------------------------------------------ one round

    def step(self, inp: StepInput, emit: Callable[[BatchTokenIdOut], None] | None = None,
             input_pending: Callable[[], bool] | None = None) -> StepOutput:
        """One round. `emit` (rank 0 of a server): called with the outputs of each decode step
        but the last of the round, which go into the returned StepOutput with the rest.
        `input_pending`: the next input is waiting (the round ends for it; alike on all ranks)."""
        began, t0 = time.time(), time.perf_counter()
        outs: list[TokenOut] = []
        self._emit = emit
        if self.inflight is not None and (inp.aborts or inp.controls):
            self._resolve(outs)  # aborts and controls see every request's host state
        for r in inp.reqs:
            self._add_request(r)
        for a in inp.aborts:
            self._abort(a, outs)
        controls = [handle_control(c, self) for c in inp.controls]
        for r in self.constraints.resolve(self.waiting):
            self.waiting.remove(r)
            outs.append(self.output.token_out(r))
        fill = next_fill(self) if self.waiting and not self._decode_turn else []
        self._decode_turn = False
        fill_tokens = sum(r.extend_input_len for r in fill)
        if fill:
            # Unless the fill carried a token of each running request (a mixed step), they
            # take a step before the next fill, of a chunk or of new arrivals: no stream waits
            # for two fills in a row.
            self._decode_turn = not self._fill(fill, outs) and bool(self.batch)
        elif self.batch:
            for i in range(1 if self.waiting else DECODE_STEPS_PER_ROUND):
                if i and input_pending is not None and input_pending():
                    self.counters.rounds_cut += 1
                    break  # new requests, aborts or controls wait for no more steps
                if i:
                    self._flush(outs)
                if not self.batch or self._decode_step(outs):
                    break  # done, or a request jumped forward: extend it in the next round
        elif self.waiting and all(r.grammar_pending for r in self.waiting):
            time.sleep(0.001)  # only grammar compiles pending: do not spin the router at full speed
        if self.inflight is not None and not self.batch:
            self._resolve(outs)  # every request of it finished meanwhile
        self.counters.slow_rounds.note(
            began, time.perf_counter() - t0, "fill" if fill else "decode", fill_tokens,
            len(self.running))
        maybe_log(self)
        return StepOutput(BatchTokenIdOut(outs) if outs else None, controls,
                          has_work=bool(self.batch or self.waiting))

    def _flush(self, outs: list[TokenOut]) -> None:
        """Hand the outputs so far on before the round ends (through the round's `emit`)."""
        if self._emit is not None and outs:
            self._emit(BatchTokenIdOut(list(outs)))
            outs.clear()

    def _add_request(self, r: TokenizedGenerateReq) -> None:
        self.arrivals += 1
        req = new_req(r, self.arrivals, self.config)
        pooling = self.runner.pooling
        if pooling is not None:  # an embedding: its prompt computed, nothing generated
            req.sampling_params = dataclasses.replace(req.sampling_params, max_new_tokens=0)
            req.pool_all = pooling.mode != "last"
        if req.sampling_params.constraint is not None:
            req.grammar_future = self.constraints.compile(req.sampling_params)
        self.waiting.append(req)

    def _abort(self, a: AbortReq, outs: list[TokenOut]) -> None:
        for req in self.waiting + self.running:
            if req.rid == a.rid:
                if req.status == ReqStatus.RUNNING:
                    self.batch.remove([req])
                else:
                    self.waiting.remove(req)
                self.kv.cache_finished(req)  # (nothing to give back if it holds no row)
                req.end(FinishReason.abort(a.message))
                outs.append(self.output.token_out(req))
                return

    # ------------------------------------------------------------------ fill

    def _fill(self, reqs: list[Req], outs: list[TokenOut]) -> bool:
        """Launch the fill batch, read the decode step in flight meanwhile, then the fill's
        results; the fill's running requests join the batch, a chunked one waits for its next
        chunk. A mixed step (--enable-mixed-chunk) first reads the step in flight (the running
        requests' ids go in from the host) and computes a token of every running request too.
        True if it was a mixed step."""
        self.counters.timer.fill_begin()
        fill = Batch(reqs)
        n_fill = sum(r.extend_input_len for r in reqs)
        mix = False
        if self.mixed and self.batch:
            self._resolve(outs)
            self._flush(outs)  # its tokens go out now, not with the mixed step's
            mix = bool(self.batch) and self.kv.room() >= n_fill + self.batch.mixed_rows()
        n_run = self.batch.mixed_rows() if mix else 0
        slots = self.kv.alloc_slots(n_fill + n_run)
        self.kv.assign_rows(reqs, slots[:n_fill])
        if mix:
            self.kv.extend_rows(self.batch.reqs, [r.kv_computed for r in self.batch.reqs],
                                slots[n_fill:])
            self.counters.mixed_fills += 1
        for r in reqs:
            r.status = ReqStatus.RUNNING
            if r.cached_tokens < 0:
                r.cached_tokens = len(r.prefix_indices)
                self.counters.prompt_tokens += len(r.origin_input_ids)
                self.counters.cached_tokens += r.cached_tokens
        plan = self.graph_fill.plan(fill.prepare_fill(slots, self.batch if mix else None),
                                    self.counters)
        launched = self.executor.launch(plan)
        if self.inflight is not None:
            self._resolve(outs)
            self._flush(outs)  # while the device computes the fill
        self._apply(launched, outs)
        fill.filter(lambda r: r.status == ReqStatus.RUNNING)
        if mix:
            self.batch.filter(lambda r: r.status == ReqStatus.RUNNING)
        self.batch.merge(fill)
        self.counters.timer.fill_end(len(reqs), len(plan.positions))
        self.executor.break_chain()
        return mix

    # ------------------------------------------------------------------ decode

    def _chainable(self) -> bool:
        """Every running request can be launched before the host has its previous token: no
        penalties (they read the output so far), no jump pending or wanted. (A grammar's mask
        is built after the step before is read, between the forward and the sampling.)"""
        return not any(r.kv_valid is not None or r.jump_wanted
                       or r.sampling_params.uses_penalties for r in self.running)

    def _decode_step(self, outs: list[TokenOut]) -> bool:
        """Launch one step of the running batch and read the one before it (overlapped), or
        launch and read it (plain). True if a request jumped out of the batch."""
        timer = self.counters.timer
        timer.begin()
        if self.spec is not None:
            verified = self._verify_step(outs)
            if verified is not None:
                return verified
        prev = self.inflight
        if prev is not None:
            launch = np.fromiter((len(r.output_ids) + r.in_flight < r.sampling_params
                                  .max_new_tokens for r in self.running), dtype=bool)
            n = int(launch.sum())
            if not n or not self._chainable() or self.kv.room() < n:
                if self._resolve(outs) or not self.batch:
                    timer.discard()
                    return True
                prev = None
        if prev is None:
            make_room(self)
            if any(r.kv_valid is not None for r in self.running):
                plan = self.batch.prepare_mixed(self.kv.alloc_slots(self.batch.mixed_rows()))
                self.counters.mixed_steps += 1
            else:
                plan = self.batch.prepare_decode(self.kv.alloc_slots(len(self.batch)))
        else:
            plan = self.batch.prepare_decode(self.kv.alloc_slots(n), launch)
        # With a grammar in the batch, the step before is read between this step's forward
        # and its sampling, so the masks see the tokens it sampled.
        read: list[bool] = []

        def read_prev() -> None:
            read.append(self._read(prev, outs, then=plan, deferred=True))
        grammar = prev is not None and any(r.matcher is not None for r in self.running)
        self.inflight = self.executor.launch(plan, read_prev if grammar else None)
        if self.spec is not None:
            self.spec.note_plain_step(plan.reqs)
        self.ratio.step()
        jumped = False
        if prev is not None:
            self.counters.overlapped_steps += 1
            jumped = read[0] if read else self._read(prev, outs, then=plan)
        elif not self.overlap:
            jumped = self._resolve(outs)
        timer.end(len(plan.reqs))
        return jumped

    def _verify_step(self, outs: list[TokenOut]) -> bool | None:
        """Speculative decoding: read the step in flight, draft, and run a verification step
        of the running batch. None if no request drafts (the caller takes a plain decode step);
        else True if a request jumped out of the batch (or it emptied), as `_decode_step`."""
        assert self.spec is not None
        if self.chain is not None:  # chained verification steps, where they can run
            if self.chain.eligible(self.running):
                return chain_step(self, outs)
            if isinstance(self.inflight, ChainStep) and (self._resolve(outs) or not self.batch):
                self.counters.timer.discard()
                return True
        if not self.spec.wants_drafts(self.running):
            return None
        if self.inflight is not None:
            # drafts continue the tokens of the step in flight: read it first
            if self._resolve(outs) or not self.batch:
                self.counters.timer.discard()
                return True
        if any(r.kv_valid is not None for r in self.running):
            return None  # a jump's ids go first (a plain step computes them)
        make_room(self)
        proposed = self.spec.drafts(self.batch, self.kv.room() - len(self.batch),
                                    self.kv.alloc_slots, self.kv.pool.free)
        if proposed is None:
            return None
        plan = self.batch.prepare_verify(proposed.slots, proposed.drafts, proposed.matchers,
                                         proposed.parents, self.kv.req_pool.scratch)
        step = self.executor.launch(plan)
        self.ratio.step()
        self.spec.totals.verify_steps += 1
        self._apply_verify(step, outs)
        self.counters.timer.end(len(plan.reqs))
        return any(r.status == ReqStatus.WAITING for r in plan.reqs) or not self.batch

    def _apply_verify(self, step: InFlight, outs: list[TokenOut]) -> None:
        """Each request keeps its accepted drafts and the token after them (fewer where it
        finishes first): a tree's accepted path moves into the request's row where it left
        the main path; the KV of every other row is freed."""
        assert self.spec is not None
        res = step.wait()
        self.counters.timer.mark("wait")
        plan = step.plan
        v = plan.verify
        assert v is not None
        live: list[Req] = []
        kept: list[int] = []  # each request's last kept row of the step
        spans: list[tuple[int, int, torch.Tensor]] = []
        gone: list[torch.Tensor] = []
        for i, (r, start, draft) in enumerate(zip(plan.reqs, v.starts, v.drafts)):
            r.in_flight -= 1
            base = r.kv_len  # the root's position
            path = v.accepted(res.ids, i)
            emitted = 0
            for node in [-1] + path:
                self.output.append(r, res.ids[start + 1 + node],
                                   res.output_logprobs[start + 1 + node], dead_end=False)
                emitted += 1
                if r.finished:
                    break
            path = path[: emitted - 1]  # the nodes whose KV the request keeps
            kept.append(start + 1 + (path[-1] if path else -1))
            self.spec.note(r, len(draft), len(path), emitted)
            mine = plan.out_cache_loc[start : start + 1 + len(draft)]
            keep = np.zeros(1 + len(draft), dtype=bool)
            keep[0] = True
            keep[[1 + n for n in path]] = True
            if path and not (v.chains and v.chains[i]):  # (a chain's path is there already)
                spans.append((r.req_pool_idx, base + 1, mine[[1 + n for n in path]]))
            gone.append(mine[torch.from_numpy(~keep)])
            live.append(r)
        self.kv.req_pool.write_spans(spans)
        if gone:
            self.kv.pool.free(torch.cat(gone))
        if self.runner.draft is not None:
            self.runner.draft.accept(kept, [r.req_pool_idx for r in plan.reqs])
        self.output.finish_dead_ends(live)
        self.batch.kv_lens[:] = [r.kv_len for r in self.batch.reqs]
        running = [r for r in live if not r.finished]
        self.executor.set_last_ids([r.req_pool_idx for r in running],
                                   [r.output_ids[-1] for r in running])
        for r in live:
            self._settle(r, outs)
        self.batch.filter(lambda r: r.status == ReqStatus.RUNNING)

    def retract(self, req: Req) -> None:
        """Back to the waiting queue; its KV goes into the tree (evictable), its progress is
        kept. Nothing is in flight."""
        assert not req.in_flight, "retraction with a step in flight"
        self.batch.remove([req])
        self.kv.cache_finished(req)
        req.retractions += 1
        req.status = ReqStatus.WAITING
        self.waiting.append(req)

    # ------------------------------------------------------------------ results

    def _resolve(self, outs: list[TokenOut]) -> bool:
        """Read the decode step in flight; True if a request jumped out of the batch."""
        prev, self.inflight = self.inflight, None
        if isinstance(prev, ChainStep):
            return apply_chained(self, prev, outs)
        return prev is not None and self._read(prev, outs, then=None)

    def _read(self, step: InFlight, outs: list[TokenOut], then: StepPlan | None,
              deferred: bool = False) -> bool:
        """Wait for a decode step's results and do its host work. `then`: the plan of the step
        launched after it, into which the requests this one finishes were launched for nothing;
        `deferred`: that step's sampling waits for this read (its jumps wait too)."""
        self._apply(step, outs, then, deferred)
        self.batch.filter(lambda r: r.status == ReqStatus.RUNNING)
        return any(r.status == ReqStatus.WAITING for r in step.plan.reqs)

    def _apply(self, step: InFlight, outs: list[TokenOut], then: StepPlan | None = None,
               deferred: bool = False) -> None:
        res = step.wait()
        self.counters.timer.mark("wait")
        plan = step.plan
        n_fill = (plan.n_fill if plan.n_fill is not None else len(plan.reqs)) \
            if plan.mode.is_extend() or plan.fill else 0
        live: list[Req] = []
        chunked: list[Req] = []
        for i, (r, tok, prompt_lp, out_lp) in enumerate(zip(
                plan.reqs, res.ids, res.prompt_logprobs, res.output_logprobs)):
            r.in_flight -= 1
            if r.finished:  # finished after this step was launched: its slot was freed then
                continue
            if i < n_fill:
                if res.pooled is not None:
                    r.pooled = self.runner.pooling.add(r.pooled, res.pooled[i])
                if prompt_lp is not None:
                    if r.input_logprobs is None:
                        r.input_logprobs = prompt_lp
                    else:  # the entries of the prompt's next chunk
                        r.input_logprobs.extend(prompt_lp)
                end = plan.fill_end(i)
                if end < len(r.fill_ids):  # a chunk: its prompt goes on in a later fill
                    self.kv.cache_chunk(r, end)
                    self.counters.prefill_chunks += 1
                    r.status = ReqStatus.PREFILLING
                    chunked.append(r)
                    continue  # its sampled token is not one of its outputs
                self.kv.cache_filled(r)
                if prompt_lp is not None:
                    r.prompt_logprobs_done = True
            live.append(r)
            if i < n_fill:
                if r.sampling_params.max_new_tokens == 0 and not r.output_ids:
                    if r.pooled is not None:
                        r.embedding = self.runner.pooling.vector(r.pooled,
                                                                 len(r.origin_input_ids))
                    r.end(FinishReason.of_length(0))
                    continue
            self.output.append(r, tok, out_lp, dead_end=False)
        self.output.finish_dead_ends(live)
        if then is not None:
            gone = [i for i, r in enumerate(then.reqs) if r.finished]
            if gone:
                self.kv.pool.free(then.out_cache_loc[gone])
                if not deferred:  # (deferred: that step's launch has not counted them yet)
                    for i in gone:
                        then.reqs[i].forward_passes -= 1
        self.waiting[:0] = chunked
        for r in live:
            self._settle(r, outs, deferred)

    def release_chunked(self) -> bool:
        """Let the request between prefill chunks give up its row and lock (its computed KV
        goes to the tree, evictable): the last resort when decoding needs its room. Its prompt
        logprobs so far are dropped (recomputed with the prompt). False if there is none."""
        for r in self.waiting:
            if r.prefilling:
                self.kv.cache_finished(r)
                r.status = ReqStatus.WAITING
                if not r.prompt_logprobs_done:
                    r.input_logprobs = None
                return True
        return False

    def _settle(self, r: Req, outs: list[TokenOut], deferred: bool = False) -> None:
        """Jump forward where a pattern forces text (`deferred`: a step of it is in flight, so
        only note that it wants to), finish what finished, emit outputs."""
        if deferred:
            jumped = False
            r.jump_wanted = (not r.finished and r.matcher is not None
                             and self.constraints.wants_jump(r))
        else:
            r.jump_wanted = False
            jumped = not r.finished and self.constraints.jump_forward(r)
        if r.finished:
            self.kv.cache_finished(r)
            outs.append(self.output.token_out(r))
            return
        if jumped:
            r.status = ReqStatus.WAITING
            self.waiting.append(r)
        if self.output.due(r):
            outs.append(self.output.token_out(r))
