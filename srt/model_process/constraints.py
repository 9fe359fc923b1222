"""The constraint manager: grammar compiles for regex / JSON-schema / EBNF requests (through
the `--grammar-backend`), their readiness on every rank, and jump-forward (appending the text a
grammar forces)."""

from __future__ import annotations

from concurrent.futures import Future
from typing import Any

import torch

from srt.constrained.grammar import GrammarBackend, MaskBuilder
from srt.constrained.jump_forward import JumpForward
from srt.constrained.registry import create_grammar_backend
from srt.constrained.vocab import token_bytes_map
from srt.layers import parallel_state
from srt.model_process.kv import KVManager
from srt.model_process.output import OutputProcessor
from srt.model_process.req import FinishReason, Req
from srt.sampling_params import SamplingParams
from srt.server_args import ServerArgs

# A running request that jumps forward stays in the decode batch (its new ids are computed by
# the batch's next step); False sends every jump through the waiting queue and a fill (tests
# compare the two).
JUMP_IN_BATCH = True


class ConstraintManager:
    def __init__(self, args: ServerArgs, tokenizer: Any, device: torch.device, kv: KVManager,
                 output: OutputProcessor, vocab_size: int) -> None:
        self.args = args
        self.tokenizer = tokenizer
        self.device = device
        self.kv = kv
        self.output = output
        self.vocab_size = vocab_size
        self.backend: GrammarBackend | None = None  # built at the first constrained request
        self.jump: JumpForward | None = None  # with the backend, unless disabled
        # A running request jumps only when that adds at least this many ids.
        self.jump_min_tokens = args.jump_forward_min_tokens
        self.jumps = 0
        self.jump_tokens = 0  # output ids added by jumps (net of re-tokenizing)

    def compile(self, params: SamplingParams) -> Future:
        """A future of the request's CompiledGrammar (failed for a refused constraint: the HTTP
        process checked it, and a failed future keeps the ranks equal)."""
        spec = params.constraint
        assert spec is not None
        return self._backend().compile(spec)

    def _backend(self) -> GrammarBackend:
        if self.backend is None:
            # Without the radix cache a jump still works: a running request keeps its KV in
            # the batch, and one that jumps before its first fill has no KV to lose.
            if not self.args.disable_regex_jump_forward:
                jump = JumpForward(self.tokenizer, token_bytes_map(self.tokenizer))
                self.jump = jump if jump.usable else None
            eos = self.tokenizer.eos_token_id
            self.backend = create_grammar_backend(
                self.args.grammar_backend, self.tokenizer, int(eos) if eos is not None else -1,
                self.vocab_size, self.args.constrained_cache_size, self.jump)
        return self.backend

    def mask_builder(self, vocab_size: int, device: torch.device) -> MaskBuilder:
        """The backend's per-step mask builder (asked once a batch has a constrained row)."""
        return self._backend().mask_builder(vocab_size, device)

    def resolve(self, waiting: list[Req]) -> list[Req]:
        """Mark waiting requests whose FSM compile finished as admissible; return those that
        ended instead (a failed compile, or a pattern that is fixed text throughout).

        Each rank compiles on its own background thread, so compiles may finish at different
        times on different ranks; a request becomes admissible only once every rank has its FSM
        (one small all-reduce, only while compiles are pending), which keeps the schedules equal.
        """
        pending = [r for r in waiting if r.grammar_pending]
        if not pending:
            return []
        done = torch.tensor([int(r.grammar_future.done()) for r in pending], dtype=torch.int64,
                            device=self.device)
        counts = parallel_state.all_reduce(done).tolist()
        ended: list[Req] = []
        for r, n in zip(pending, counts):
            if n < self.args.tp_size:
                continue
            err = r.grammar_future.exception()
            if err is not None:
                r.end(FinishReason.abort(f"constraint failed: {err}"))
                ended.append(r)
                continue
            r.matcher = r.grammar_future.result().matcher()
            # Replay tokens already generated (none unless the request comes back retracted).
            for tok in r.output_ids:
                if not r.matcher.accept(tok):
                    r.end(FinishReason.abort("token outside the pattern"))
                    break
            if r.finished:
                ended.append(r)
                continue
            # A pattern that starts with fixed text: its first fill computes that text too.
            self.jump_forward(r)
            if r.finished:  # the pattern was fixed text, or the jump hit a stop or the length
                ended.append(r)
        return ended

    def _jump_plan(self, req: Req) -> Any:
        """The jump `req` would take now (None: nothing forced, too few ids gained for a running
        request (--jump-forward-min-tokens), logprobs wanted, or jumps off)."""
        if self.jump is None or req.matcher is None or req.logprob is not None:
            return None
        plan = self.jump.plan_matcher(req.matcher, req.output_ids, req.sent_len,
                                      req.sampling_params.max_new_tokens)
        if plan is None:
            return None
        if (req.req_pool_idx is not None
                and len(plan.new_ids) - (len(req.output_ids) - plan.keep) < self.jump_min_tokens):
            return None
        return plan

    def wants_jump(self, req: Req) -> bool:
        """`jump_forward(req)` would change its ids (checked while a step of it is in flight,
        when the jump itself must wait)."""
        return self._jump_plan(req) is not None

    def jump_forward(self, req: Req) -> bool:
        """Append the text the request's pattern forces from its state, if that gains anything;
        True if the request must go back to the waiting queue for it.

        The unsent tail of the output ids is replaced by the re-tokenized tail plus the forced
        text; each new id passes the same checks as a sampled one (FSM, stop ids and strings,
        max_new_tokens, a completed pattern). A running request stays in the batch: the KV of
        the positions whose ids changed is freed, `kv_valid` marks where its KV ends, and the
        next step computes the new ids with the rest of the batch. A request without a row (a
        pattern that starts with fixed text, before its first fill), or one whose changed ids
        reach into the part of its KV that the radix tree holds, goes through the tree instead:
        its KV is cached, its row and lock released, and the caller puts it back in the waiting
        queue, whose next fill finds the kept prefix in the tree and computes the new ids.
        Requests that want logprobs never jump (forced tokens are not sampled, so they would
        have none). Every rank plans the same jump: the plan depends only on the request's ids,
        the pattern and the tokenizer. The request has no step in flight.
        """
        plan = self._jump_plan(req)
        if plan is None:
            return False
        assert not req.in_flight
        in_batch = False
        if req.req_pool_idx is not None:
            old_ids, old_kv = req.fill_ids, req.kv_computed
            new_ids = old_ids[: len(req.origin_input_ids) + plan.keep] + plan.new_ids
            valid = min(len(req.origin_input_ids) + plan.keep, old_kv)
            # KV at a position depends only on the ids up to it: it stays valid while the new
            # ids equal the old (at least one new id is left to compute for the next logits).
            while valid < min(old_kv, len(new_ids) - 1) and new_ids[valid] == old_ids[valid]:
                valid += 1
            in_batch = JUMP_IN_BATCH and valid >= len(req.prefix_indices)
            if in_batch:
                self.kv.free_tail(req, valid, old_kv)
                req.kv_valid = valid
            else:
                self.kv.cache_finished(req)
        before = len(req.output_ids)
        del req.output_ids[plan.keep :]
        req.matcher.rollback(before - plan.keep)
        self.output.generated -= before - plan.keep
        for tok in plan.new_ids:
            self.output.append(req, tok)
            if req.finished:
                break
        self.jumps += 1
        self.jump_tokens += len(req.output_ids) - before
        return not in_batch
