"""The model process of one TP rank: scheduler state, radix cache, KV pools and model runner.

The loop only orchestrates: each StepInput from the router adds requests and aborts, then one
round runs either a fill batch (EXTEND/PREFILL) or a few DECODE steps. Rank 0 answers with a
StepOutput; every rank sees the same inputs, so every rank makes the same decisions.
"""

from __future__ import annotations

import logging
import random
import time
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import torch

from srt.constrained.fsm import FSMCache, constraint_regex
from srt.constrained.jump_forward import JumpForward
from srt.constrained.mask import ForbiddenRows, merge_forbidden
from srt.heap import HeapTrimmer
from srt.layers import parallel_state
from srt.layers.forward_batch import ForwardBatch, ForwardMode, ImageSpanInput
from srt.layers.sampler import sample
from srt.managers.io_struct import (
    AbortReq,
    BatchTokenIdOut,
    FlushCacheOut,
    FlushCacheReq,
    GetStatsReq,
    StatsOut,
    StepInput,
    StepOutput,
    TokenizedGenerateReq,
    TokenLogprobs,
    TokenOut,
)
from srt.managers.router.image_pads import ReqImage
from srt.managers.router.infer_batch import Req, SamplingRows, build_sampling_info
from srt.managers.router.logprob_step import StepLogprobs, prefix_limit
from srt.managers.router.model_runner import ModelRunner
from srt.managers.router.radix_cache import RadixCache, shared_prefix_len
from srt.managers.router.scheduler import Admission, InRoundPrefixes, order_queue
from srt.managers.router.step_inputs import StepInputBuilder
from srt.managers.router.step_timing import StepTimer
from srt.model_config import ModelConfig
from srt.sampling_params import SamplingParams
from srt.server_args import ServerArgs
from srt.stop_regex import SEARCH_TIMEOUT_S, match_stop

logger = logging.getLogger(__name__)

# Decode steps per round while nothing waits: amortizes the router round trip; a waiting request
# is reconsidered after every step.
DECODE_STEPS_PER_ROUND = 4
# Retraction re-estimates the ratio as if every request still ran this many steps.
RETRACT_LOOKAHEAD_STEPS = 20
# A running request that jumps forward stays in the decode batch (its new ids are computed by
# the batch's next step); False sends every jump through the waiting queue and a fill (tests
# compare the two).
JUMP_IN_BATCH = True


@dataclass
class TokenRatio:
    """Share of running requests' remaining max_new_tokens reserved at admission.

    Starts high, decays every decode step towards its floor (requests usually stop early), and is
    raised again when decoding runs out of slots.
    """

    value: float
    floor: float
    decay: float

    @classmethod
    def from_conservativeness(cls, c: float) -> "TokenRatio":
        return cls(value=min(0.7 * c, 1.0), floor=min(0.1 * c, 1.0), decay=0.001)

    def step(self) -> None:
        self.value = max(self.floor, self.value - self.decay)


@dataclass
class PendingIds:
    """A step's sampled ids on the device and their copy to the host, possibly in flight."""

    ids: torch.Tensor
    host: torch.Tensor
    done: Any = None  # a CUDA event recorded after the copy; None when it was synchronous

    @classmethod
    def start(cls, ids: torch.Tensor) -> "PendingIds":
        if ids.device.type != "cuda":
            return cls(ids, ids)
        host = torch.empty(ids.shape, dtype=ids.dtype, pin_memory=True)
        host.copy_(ids, non_blocking=True)
        done = torch.cuda.Event()
        done.record()
        return cls(ids, host, done)

    def wait(self) -> list[int]:
        if self.done is not None:
            self.done.synchronize()
        return self.host.tolist()


class ModelRpcServer:
    def __init__(self, args: ServerArgs, tp_rank: int, dist_init_port: int | None = None) -> None:
        from transformers import AutoTokenizer

        self.args = args
        self.tp_rank = tp_rank
        self.config = ModelConfig.load(args.model_path, args.context_length)
        self.runner = ModelRunner(args, self.config, tp_rank, dist_init_port)
        self.tokenizer = AutoTokenizer.from_pretrained(args.tokenizer_path)
        self.pool = self.runner.token_to_kv_pool
        self.req_pool = self.runner.req_to_token_pool
        self.tree = RadixCache(self.pool, disable=args.disable_radix_cache)
        self.waiting: list[Req] = []
        self.running: list[Req] = []
        self.ratio = TokenRatio.from_conservativeness(args.schedule_conservativeness)
        self.rng = random.Random(args.random_seed)
        self.arrivals = 0
        self.fsm_cache: FSMCache | None = None  # built at the first constrained request
        self.jump: JumpForward | None = None  # with the FSM cache, unless disabled
        self.mask_rows: ForbiddenRows | None = None  # device mask rows per (FSM, state)
        self.eos_ids = set(self.config.eos_token_ids)
        if self.tokenizer.eos_token_id is not None:
            self.eos_ids.add(int(self.tokenizer.eos_token_id))
        self.step_inputs = StepInputBuilder(self.runner.device)
        self.sampling_rows: SamplingRows | None = None  # the last batch's, reused while equal
        # A running request jumps only when that adds at least this many ids (see _jump_forward).
        self.jump_min_tokens = args.jump_forward_min_tokens
        self.heap = HeapTrimmer()  # the process loop trims when idle and every 30 s of work
        self._reset_stats()
        # On a GPU the first fills compile kernels; on the CPU there is nothing to warm up.
        if not args.skip_warmup and self.runner.device.type == "cuda":
            self._warm_up()

    def _reset_stats(self) -> None:
        self.prompt_tokens_total = 0
        self.cached_tokens_total = 0
        self.generated_since_log = 0
        self.last_log = time.monotonic()
        self.retracted_total = 0
        self.step_timer = StepTimer()
        self.jump_forwards_total = 0
        self.jump_forward_tokens_total = 0  # output ids added by jumps (net of re-tokenizing)
        self.mixed_steps_total = 0  # EXTEND steps of the running batch after jumps inside it

    def _warm_up(self) -> None:
        """Serve a few requests before reporting ready, so that the kernels of the fill paths
        (a PREFILL batch of three prompts, then an EXTEND batch with and without a cached
        prefix; odd and even token counts), of sampling and of decode steps are compiled and
        loaded now rather than inside the first users' requests (a fill otherwise pays seconds
        of Triton compilation). Every rank runs the same requests; the cache, the random
        generator and the statistics are reset afterwards."""
        # Small enough for any pool and context that can serve anything at all.
        n = min(96, self.pool.size // 8, self.config.context_len - 8)
        if n < 8:
            return
        t = time.perf_counter()
        rng_state = self.rng.getstate()
        vocab = self.config.vocab_size

        def ids(mult: int, length: int) -> list[int]:
            return [(mult * i + mult) % vocab for i in range(length)]

        params = {"temperature": 0.7, "top_p": 0.9, "max_new_tokens": 3, "ignore_eos": True}
        first = ids(7, n)
        rounds = [[first, ids(11, n // 2 + 1), ids(13, n // 3)],          # PREFILL, 3 prompts
                  [first[: n // 2] + ids(17, n // 4 + 1), ids(19, n // 5)]]  # EXTEND, mixed
        for k, prompts in enumerate(rounds):
            reqs = [TokenizedGenerateReq(f"warmup-{k}-{i}", x, dict(params))
                    for i, x in enumerate(prompts)]
            self.step(StepInput(reqs=reqs))
            for _ in range(100):
                if not (self.waiting or self.running):
                    break
                self.step(StepInput())
            else:
                raise RuntimeError("warm-up requests did not finish in 100 rounds")
        warm = getattr(self.runner.attn_backend, "warm_up_eager_decode", None)
        if warm is not None:
            warm(self.req_pool.req_to_token, *self.pool.get_kv_buffer(0))
        self.tree.reset()
        self.rng.setstate(rng_state)
        self.arrivals = 0
        self._reset_stats()
        logger.info("warm-up requests served in %.2f s", time.perf_counter() - t)

    # ------------------------------------------------------------------ one round

    def step(self, inp: StepInput) -> StepOutput:
        outs: list[TokenOut] = []
        for r in inp.reqs:
            self._add_request(r)
        for a in inp.aborts:
            self._abort(a, outs)
        controls = [self._control(c) for c in inp.controls]
        self._resolve_compiles(outs)
        batch = self._new_fill_batch()
        if batch:
            self._forward_fill(batch, outs)
        elif self.running:
            steps = 1 if self.waiting else DECODE_STEPS_PER_ROUND
            if steps > 1 and self.args.enable_overlap_schedule and self._overlap_eligible():
                self._decode_overlapped(outs, steps)
            else:
                for _ in range(steps):
                    if not self.running:
                        break
                    if self._forward_decode(outs):
                        break  # a request jumped forward: extend it in the next round
        elif self.waiting and all(r.fsm_pending for r in self.waiting):
            time.sleep(0.001)  # only FSM compiles pending: do not spin the router at full speed
        self._maybe_log()
        token_out = BatchTokenIdOut(outs) if outs else None
        return StepOutput(token_out, controls, has_work=bool(self.running or self.waiting))

    def _add_request(self, r: TokenizedGenerateReq) -> None:
        params = SamplingParams(
            **{
                k: tuple(v) if isinstance(v, list) else v
                for k, v in r.sampling_params.items()
            }
        )
        self.arrivals += 1
        ids, image = list(r.input_ids), None
        if r.image is not None:
            # The HTTP process checked that the prompt holds the image token exactly once.
            ids, image = ReqImage.expand_prompt(
                ids, r.image, self.config.image_token_id, self.config.image_tokens,
                self.config.vocab_size)
        req = Req(r.rid, ids, params, r.stream, r.group, arrival=self.arrivals,
                  logprob=r.logprob, image=image)
        if params.constraint_key is not None:
            req.fsm_future = self._compile(params)
        self.waiting.append(req)

    # ------------------------------------------------------------------ constrained decoding

    def _compile(self, params: SamplingParams) -> Future:
        if self.fsm_cache is None:
            eos = self.tokenizer.eos_token_id
            self.fsm_cache = FSMCache(self.tokenizer, int(eos) if eos is not None else -1,
                                      self.args.constrained_cache_size)
            # Without the radix cache a jump still works: a running request keeps its KV in
            # the batch, and one that jumps before its first fill has no KV to lose.
            if not self.args.disable_regex_jump_forward:
                jump = JumpForward(self.tokenizer, self.fsm_cache.token_bytes)
                self.jump = jump if jump.usable else None
        try:
            pattern = constraint_regex(params.regex, params.json_schema)
        except ValueError as e:  # the HTTP process checked it; a failed future keeps ranks equal
            fut: Future = Future()
            fut.set_exception(e)
            return fut
        return self.fsm_cache.get(pattern)

    def _resolve_compiles(self, outs: list[TokenOut]) -> None:
        """Mark waiting requests whose FSM compile finished as admissible.

        Each rank compiles on its own background thread, so compiles may finish at different
        times on different ranks; a request becomes admissible only once every rank has its FSM
        (one small all-reduce, only while compiles are pending), which keeps the schedules equal.
        """
        pending = [r for r in self.waiting if r.fsm_pending]
        if not pending:
            return
        done = torch.tensor([int(r.fsm_future.done()) for r in pending], dtype=torch.int64,
                            device=self.runner.device)
        done = parallel_state.all_reduce(done).tolist()
        failed: list[Req] = []
        for r, n in zip(pending, done):
            if n < self.args.tp_size:
                continue
            err = r.fsm_future.exception()
            if err is not None:
                r.finish_reason = {"type": "abort", "message": f"constraint failed: {err}"}
                failed.append(r)
                continue
            r.fsm = r.fsm_future.result()
            r.fsm_state = r.fsm.initial_state
            # Replay tokens already generated (none unless the request comes back retracted).
            for tok in r.output_ids:
                r.fsm_state = r.fsm.next_state(r.fsm_state, tok)
            # A pattern that starts with fixed text: its first fill computes that text too.
            self._jump_forward(r)
            if r.finished:  # the pattern was fixed text, or the jump hit a stop or the length
                failed.append(r)
        for r in failed:
            self.waiting.remove(r)
            outs.append(self._token_out(r))

    def _abort(self, a: AbortReq, outs: list[TokenOut]) -> None:
        for i, req in enumerate(self.waiting):
            if req.rid == a.rid:
                self.waiting.pop(i)
                req.finish_reason = {"type": "abort", "message": a.message}
                outs.append(self._token_out(req))
                return
        for i, req in enumerate(self.running):
            if req.rid == a.rid:
                self.running.pop(i)
                req.finish_reason = {"type": "abort", "message": a.message}
                self._cache_finished(req)
                outs.append(self._token_out(req))
                return

    def _control(self, c: Any) -> Any:
        if isinstance(c, FlushCacheReq):
            if self.running or self.waiting:
                return FlushCacheOut(
                    c.rid, False,
                    f"cache not flushed: {len(self.running)} running and {len(self.waiting)} "
                    "waiting requests",
                )
            self.tree.reset()
            return FlushCacheOut(c.rid, True, "cache flushed")
        if isinstance(c, GetStatsReq):
            return StatsOut(c.rid, self.stats())
        raise ValueError(f"unknown control message {type(c).__name__}")

    def stats(self) -> dict[str, Any]:
        info = self.runner.info()
        return {
            "max_total_num_tokens": info.max_total_num_tokens,
            "available_kv_tokens": self.pool.available_size(),
            "evictable_kv_tokens": self.tree.evictable_size(),
            "locked_kv_tokens": self.tree.locked_size(),
            "num_running_reqs": len(self.running),
            "num_waiting_reqs": len(self.waiting),
            "cache_hit_rate": self.cached_tokens_total / max(1, self.prompt_tokens_total),
            "retracted_reqs": self.retracted_total,
            "jump_forwards": self.jump_forwards_total,
            "jump_forward_tokens": self.jump_forward_tokens_total,
            "jump_forward_batch_steps": self.mixed_steps_total,
            "max_running_requests": info.max_running_requests,
            "device": info.device,
            "dtype": info.dtype,
            "attention_backend": info.attention_backend,
            "context_length": self.config.context_len,
            "tp_size": self.args.tp_size,
            # Each rank holds this many tokens of KV for its own heads.
            "kv_pool_per_rank": {
                "tokens": info.max_total_num_tokens,
                "kv_heads": self.runner.model_kv_heads(),
                "gb": round(info.kv_gb, 4),
            },
            "decode_step_times": self.step_timer.snapshot(),
            "heap": self.heap.stats(),
        }

    # ------------------------------------------------------------------ fill

    def _new_fill_batch(self) -> list[Req]:
        if not self.waiting:
            return []
        for r in self.waiting:
            # Keep at least one token to compute, and every prompt position whose logprobs are
            # asked for: only computed positions have logits.
            r.prefix_indices, r.last_node = self.tree.match_prefix(r.fill_ids[: prefix_limit(r)])
            if r.image is not None:
                keep = r.image.safe_prefix_len(len(r.prefix_indices))
                if keep < len(r.prefix_indices):
                    r.prefix_indices, r.last_node = self.tree.match_prefix(r.fill_ids[:keep])
            r.extend_input_len = len(r.fill_ids) - len(r.prefix_indices)
        queue = order_queue(self.waiting, self.args.schedule_heuristic, self.rng, self.tree.root)
        adm = Admission.start(
            free=self.pool.available_size(),
            evictable=self.tree.evictable_size(),
            running_remaining=[r.remaining_new_tokens for r in self.running],
            new_token_ratio=self.ratio.value,
            max_prefill_tokens=self.args.max_prefill_tokens,
            free_rows=self.req_pool.available_size(),
        )
        batch: list[Req] = []
        groups: set[str] = set()
        shared = InRoundPrefixes()
        for r in queue:
            if r.fsm_pending:
                continue  # its FSM is still compiling
            if r.group is not None and r.group in groups:
                # A sibling sample is computing this prompt now: wait one round and reuse its KV.
                continue
            sharing = not self.tree.disable and not r.wants_prompt_logprobs
            if sharing and shared.should_wait(r):
                continue  # another request of this batch computes its prompt's next tokens
            node = r.last_node
            if not adm.try_admit(
                r.extend_input_len,
                r.remaining_new_tokens,
                lock=lambda n=node: self.tree.inc_lock_ref(n),
                unlock=lambda n=node: self.tree.dec_lock_ref(n),
            ):
                break
            batch.append(r)
            if sharing:
                shared.add(r)
            if r.group is not None and sharing \
                    and len(r.prefix_indices) < len(r.origin_input_ids) - 1:
                # This batch computes the group's prompt. (Samples that want prompt logprobs
                # compute it themselves anyway: they do not wait.)
                groups.add(r.group)
        if batch:
            chosen = set(map(id, batch))
            self.waiting = [r for r in self.waiting if id(r) not in chosen]
        return batch

    def _alloc_slots(self, n: int) -> torch.Tensor:
        """n slots, evicting from the tree if needed. Callers have checked that n fits."""
        free = self.pool.available_size()
        if free < n:
            self.tree.evict(n - free)
        slots = self.pool.alloc(n)
        if slots is None:
            raise RuntimeError(
                f"KV pool accounting broken: {n} slots needed, {self.pool.available_size()} free"
            )
        return slots

    def _forward_fill(self, batch: list[Req], outs: list[TokenOut]) -> None:
        self.step_timer.fill_begin()
        ext_lens = [r.extend_input_len for r in batch]
        slots = self._alloc_slots(sum(ext_lens))
        table = self.req_pool.req_to_token
        input_ids: list[int] = []
        positions: list[int] = []
        images: list[ImageSpanInput] = []
        offset = 0
        for r, ext in zip(batch, ext_lens):
            row = self.req_pool.alloc()
            if row is None:
                raise RuntimeError("req_to_token rows exhausted despite admission")
            r.req_pool_idx = row
            pre = len(r.prefix_indices)
            table[row, :pre] = r.prefix_indices.to(table.device, torch.int32)
            table[row, pre : pre + ext] = slots[offset : offset + ext].to(table.device, torch.int32)
            span = r.image.step_span(pre, ext, offset) if r.image is not None else None
            if span is not None:
                images.append(span)
            offset += ext
            input_ids.extend(r.fill_ids[pre:])
            positions.extend(range(pre, pre + ext))
            if r.cached_tokens < 0:
                r.cached_tokens = pre
                self.prompt_tokens_total += len(r.origin_input_ids)
                self.cached_tokens_total += pre
        prefix_lens = [len(r.prefix_indices) for r in batch]
        mode = ForwardMode.EXTEND if any(prefix_lens) else ForwardMode.PREFILL
        next_ids, prompt_lps, out_lps = self._run(batch, mode, input_ids, positions, slots,
                                                  prefix_lens, ext_lens, images or None)
        for r, tok, prompt_lp, out_lp in zip(batch, next_ids, prompt_lps, out_lps):
            if not self.tree.disable:
                self._cache_filled(r)
            if prompt_lp is not None:
                r.input_logprobs = prompt_lp
                r.prompt_logprobs_done = True
            if r.sampling_params.max_new_tokens == 0 and not r.output_ids:
                r.finish_reason = {"type": "length", "length": 0}
            else:
                self._append_token(r, tok, out_lp)
        self.step_timer.fill_end(len(batch), len(input_ids))
        self._settle(batch, outs, newly_running=True)

    # ------------------------------------------------------------------ decode

    def _forward_decode(self, outs: list[TokenOut]) -> bool:
        """One step of the running batch; True if a request jumped forward out of the batch (it
        now waits for a fill).

        A DECODE step, or, when a request jumped forward inside the batch (its output ids were
        re-tokenized with forced text), a step with one token for each other request and the ids
        without KV for each request that jumped (`_forward_mixed`). The rest of the batch
        keeps decoding through the jump instead of waiting for a fill round of its own.
        """
        self.step_timer.begin()
        self._ensure_decode_memory(outs)
        batch = self.running
        if any(r.kv_valid is not None for r in batch):
            next_ids, out_lps = self._forward_mixed(batch)
        else:
            slots = self._alloc_slots(len(batch))
            positions = [r.kv_len for r in batch]
            input_ids = [r.output_ids[-1] for r in batch]
            next_ids, _, out_lps = self._run(
                batch, ForwardMode.DECODE, input_ids, positions, slots, positions,
                [1] * len(batch))
        for r, tok, out_lp in zip(batch, next_ids, out_lps):
            self._append_token(r, tok, out_lp)
        self.ratio.step()
        jumped = self._settle(batch, outs, newly_running=False)
        self.step_timer.end(len(batch))
        return jumped

    def _forward_mixed(self, batch: list[Req]) -> tuple[list[int], list[Any]]:
        """The step of a running batch in which some requests jumped forward: each request
        computes its ids from `kv_computed` on (one for most). Returns the sampled ids and their
        logprobs.

        It runs as a DECODE step with one row per new token, not as an EXTEND: row j of a
        request is its token at position p_j, reading the request's `req_to_token` row up to
        p_j + 1. Every layer stores the K/V of all rows before its attention reads any, so a
        row sees the rows before it of its own request as a causal extend would. A DECODE step
        of up to the largest graph's size replays a CUDA graph; an eager EXTEND of the batch
        costs a launch of every kernel of every layer (milliseconds of host time for a small
        model, far more than its few extra rows). Each request samples from its last row."""
        starts = [r.kv_computed for r in batch]
        ext_lens = [r.step_input_len for r in batch]
        slots = self._alloc_slots(sum(ext_lens))
        input_ids: list[int] = []
        positions: list[int] = []
        pool_rows: list[int] = []
        last_rows: list[int] = []
        for r, start, ext in zip(batch, starts, ext_lens):
            input_ids.extend(r.fill_ids[start:])
            positions.extend(range(start, start + ext))
            pool_rows.extend([r.req_pool_idx] * ext)
            last_rows.append(len(positions) - 1)
            r.kv_valid = None
        next_ids, _, out_lps = self._run(batch, ForwardMode.DECODE, input_ids, positions, slots,
                                         positions, [1] * len(positions),
                                         rows=(pool_rows, last_rows))
        self.mixed_steps_total += 1
        return next_ids, out_lps

    def _overlap_eligible(self) -> bool:
        """Every running request can take a step whose input the host has not seen: nothing
        that needs the previous token on the host before the next forward (an FSM mask,
        penalties over the output so far, a seed mixed with the position, the min_new_tokens
        stop mask) and no logprobs (a deferred step carries none)."""
        for r in self.running:
            p = r.sampling_params
            if (r.fsm is not None or r.logprob is not None or p.uses_penalties
                    or p.seed is not None or len(r.output_ids) <= p.min_new_tokens):
                return False
        return True

    def _decode_overlapped(self, outs: list[TokenOut], steps: int) -> None:
        """`steps` DECODE steps with the host one step behind the device.

        Step k is launched with step k-1's sampled ids straight from the device, before the
        host has read them; then the host reads step k-1's ids, appends them and finishes what
        finished while the device computes step k. A request that step k-1 finished (EOS, a
        stop string) has already been launched into step k: that step's token is dropped and
        its KV slot freed. A request whose in-flight token reaches max_new_tokens is left out
        of the next launch. The last step is read before returning, so the round ends in the
        state the plain loop leaves (greedy tokens are the same; a temperature > 0 request can
        draw different random rows, the batch of a step being different).
        """
        pending: PendingIds | None = None
        prev: list[Req] = []  # the batch of the step in flight, in the order of its ids
        for k in range(steps + 1):
            batch: list[Req] = []
            if k < steps:
                if pending is None:
                    self._ensure_decode_memory(outs)
                    batch = list(self.running)
                else:
                    batch = [r for r in prev if not r.finished
                             and len(r.output_ids) + 1 < r.sampling_params.max_new_tokens]
                    if self.pool.available_size() < len(batch):
                        batch = []  # no room without evicting under a step in flight
            slots: torch.Tensor | None = None
            launched: PendingIds | None = None
            if batch:
                self.step_timer.begin()
                slots = self._alloc_slots(len(batch))
                if pending is None:
                    positions = [r.kv_len for r in batch]
                    ids_in: list[int] | torch.Tensor = [r.output_ids[-1] for r in batch]
                else:  # the in-flight token is the input, one position further
                    positions = [r.kv_len + 1 for r in batch]
                    where = {id(r): i for i, r in enumerate(prev)}
                    index = torch.tensor([where[id(r)] for r in batch], dtype=torch.int64)
                    ids_in = pending.ids.index_select(0, index.to(pending.ids.device))
                launched = self._run(batch, ForwardMode.DECODE, ids_in, positions, slots,
                                     positions, [1] * len(batch), defer=True)
            if pending is not None:
                # Requests finished before this step was launched took part in it for nothing
                # (their slot was freed then): skip their tokens.
                live = [(r, tok) for r, tok in zip(prev, pending.wait()) if not r.finished]
                for r, tok in live:
                    self._append_token(r, tok)
                self.ratio.step()
                gone = [i for i, r in enumerate(batch) if r.finished]
                if gone:  # finished by the step just read, but already in the next one
                    assert slots is not None
                    self.pool.free(slots[gone])
                    for i in gone:
                        batch[i].forward_passes -= 1
                self._settle([r for r, _ in live], outs, newly_running=False)
            if not batch:
                return
            self.step_timer.end(len(batch))
            pending, prev = launched, batch

    def _ensure_decode_memory(self, outs: list[TokenOut]) -> None:
        """Make room for the next step's tokens (one per running request, more after a jump):
        evict, then retract."""
        def need() -> int:  # one token each, plus the extra ids of requests that jumped
            return len(self.running) + sum(r.step_input_len - 1 for r in self.running
                                           if r.kv_valid is not None)

        free = self.pool.available_size()
        if free >= need():
            return
        self.tree.evict(need() - free)
        retracted: list[Req] = []
        while self.pool.available_size() < need() and len(self.running) > 1:
            # least progress first: fewest generated tokens, then the longest prompt
            victim = min(self.running, key=lambda r: (len(r.output_ids), -len(r.origin_input_ids)))
            self.running.remove(victim)
            self._retract(victim)
            retracted.append(victim)
            self.tree.evict(max(0, need() - self.pool.available_size()))
        if self.pool.available_size() < need():
            raise RuntimeError("a single request does not fit the KV pool (admission is broken)")
        if retracted:
            total_max = sum(r.sampling_params.max_new_tokens for r in self.running) or 1
            done = sum(len(r.output_ids) for r in self.running)
            estimate = (done + RETRACT_LOOKAHEAD_STEPS * len(self.running)) / total_max
            self.ratio.value = min(1.0, max(self.ratio.value, estimate))
            self.retracted_total += len(retracted)
            logger.warning(
                "KV pool full: retracted %d request(s) to the waiting queue (%d running, "
                "new_token_ratio now %.3f)", len(retracted), len(self.running), self.ratio.value,
            )

    def _retract(self, req: Req) -> None:
        """Back to the waiting queue; its KV goes into the tree (evictable), its progress is kept."""
        self._cache_finished(req)
        req.retractions += 1
        self.waiting.append(req)

    # ------------------------------------------------------------------ shared helpers

    def _run(self, batch: list[Req], mode: ForwardMode, input_ids: list[int] | torch.Tensor,
             positions: list[int], out_cache_loc: torch.Tensor, prefix_lens: list[int],
             extend_lens: list[int], images: list[ImageSpanInput] | None = None,
             defer: bool = False, rows: tuple[list[int], list[int]] | None = None) -> Any:
        """One forward and sampling: (next ids, prompt logprobs, logprobs of the next ids) per
        request of the batch (None where not asked).

        `rows` (DECODE only): (the req_to_token row of each forward row, the forward row each
        request samples from), for a step with several rows per request (`_forward_mixed`);
        positions, out_cache_loc, prefix_lens and extend_lens are then per forward row.

        input_ids may be a device tensor (the previous step's sampled ids, never seen by the
        host). With `defer` (no logprobs in the batch), the sampled ids are not waited for: the
        result is a `PendingIds` whose host copy is in flight.
        """
        dev = self.runner.device
        for r in batch:
            r.forward_passes += 1
        if mode == ForwardMode.DECODE:
            seq_lens = [p + 1 for p in positions]
        else:
            seq_lens = [p + e for p, e in zip(prefix_lens, extend_lens)]
        on_device = isinstance(input_ids, torch.Tensor)
        assert rows is None or mode == ForwardMode.DECODE
        pool_rows = [r.req_pool_idx for r in batch] if rows is None else rows[0]
        t = self.step_inputs.build([0] * len(positions) if on_device else input_ids, positions,
                                   out_cache_loc, pool_rows, seq_lens)
        if on_device:  # stream-ordered after the inputs' copy
            t.input_ids.copy_(input_ids)
        if mode == ForwardMode.DECODE:  # the new token's slot: req_to_token[row, position]
            self.req_pool.req_to_token[t.req_pool_indices, t.positions] = t.out_cache_loc.to(
                torch.int32)
        fb = ForwardBatch(
            forward_mode=mode,
            batch_size=len(pool_rows),
            input_ids=t.input_ids,
            positions=t.positions,
            out_cache_loc=t.out_cache_loc,
            req_pool_indices=t.req_pool_indices,
            seq_lens=t.seq_lens,
            seq_lens_cpu=seq_lens,
            prefix_lens_cpu=prefix_lens,
            extend_lens_cpu=extend_lens,
            req_to_token_pool=self.req_pool,
            token_to_kv_pool=self.pool,
            attn_backend=self.runner.attn_backend,
            images=images,
        )
        if (mode == ForwardMode.DECODE and rows is None
                and self.runner.wants_shared_prefix(len(batch))):
            fb.shared_prefix_len = shared_prefix_len([r.last_node for r in batch])
        lps = None
        if any(r.logprob is not None for r in batch):
            lps = StepLogprobs(batch, mode, prefix_lens, extend_lens, dev)
            fb.prompt_logprobs = lps.prompt_request
        self.step_timer.mark("prepare")
        logits = self.runner.forward(fb)
        if rows is not None:
            logits = logits.index_select(
                0, torch.tensor(rows[1], dtype=torch.int64).to(dev, non_blocking=True))
        self.step_timer.mark("forward")
        assert logits.shape[-1] == self.config.vocab_size
        # The sampling tensors and masks after the launch: on a GPU the host builds them while
        # the device runs the forward (every copy in them is non-blocking).
        info, self.sampling_rows = build_sampling_info(
            batch, self.config.vocab_size, dev, self._stop_ids, self.sampling_rows)
        if any(r.fsm is not None for r in batch):
            fsm_rows = [(r.fsm, r.fsm_state) if r.fsm is not None else None for r in batch]
            if self.mask_rows is None:
                self.mask_rows = ForbiddenRows(logits.shape[-1], dev)
            info.forbidden = merge_forbidden(info.forbidden, self.mask_rows.batch(fsm_rows))
        self.step_timer.mark("sample_prep")
        ids = sample(logits, info, self.runner.sampler_generator)
        # Rank 0 samples for all: ranks hold bitwise-equal logits and generators, but one
        # small broadcast makes it impossible for their schedules to drift apart.
        ids = parallel_state.broadcast_from_first(ids)
        if defer:
            assert lps is None, "deferred steps carry no logprobs"
            self.step_timer.mark("sample")
            return PendingIds.start(ids)
        if lps is not None:
            # Logprobs of the raw logits (the model's distribution), moved with the ids.
            result = lps.collect(logits, ids)
        else:
            none: list[TokenLogprobs | None] = [None] * len(batch)
            result = ids.tolist(), none, none  # the one device-to-host copy of the step
        self.step_timer.mark("sample")
        return result

    def _stop_ids(self, req: Req) -> set[int]:
        ids = set(req.sampling_params.stop_token_ids)
        if not req.sampling_params.ignore_eos:
            ids |= self.eos_ids
        return ids

    def _append_token(self, req: Req, tok: int, logprob: TokenLogprobs | None = None) -> None:
        req.output_ids.append(tok)
        if logprob is not None:
            req.output_logprobs.extend(logprob)
        self.generated_since_log += 1
        p = req.sampling_params
        if req.fsm is not None:
            if tok == req.fsm.eos_token_id:
                req.finish_reason = {"type": "stop", "matched": tok}
                return
            state = req.fsm.next_state(req.fsm_state, tok)
            if state is None:  # cannot happen under the mask; never continue off the pattern
                req.finish_reason = {"type": "abort", "message": "token outside the pattern"}
                return
            req.fsm_state = state
        if len(req.output_ids) >= p.min_new_tokens:
            if tok in p.stop_token_ids or (not p.ignore_eos and tok in self.eos_ids):
                req.finish_reason = {"type": "stop", "matched": tok}
                return
            try:
                matched = self._match_stop_string(req)
            except TimeoutError:
                req.finish_reason = {"type": "abort", "message": "a stop_regex took over "
                                     f"{SEARCH_TIMEOUT_S} s to search the output"}
                return
            if matched is not None:
                req.finish_reason = {"type": "stop", "matched": matched}
                return
        if len(req.output_ids) >= p.max_new_tokens:
            req.finish_reason = {"type": "length", "length": len(req.output_ids)}
        elif req.fsm is not None and req.fsm.is_dead_end(req.fsm_state):
            # The pattern is complete and nothing may follow: done without sampling EOS.
            req.finish_reason = {"type": "stop", "matched": None}

    def _match_stop_string(self, req: Req) -> str | None:
        p = req.sampling_params
        return match_stop(lambda ids: self.tokenizer.decode(
            ids, skip_special_tokens=p.skip_special_tokens), req.output_ids, p.stop, p.stop_regex)

    def _settle(self, batch: list[Req], outs: list[TokenOut], newly_running: bool) -> bool:
        """Jump forward where a pattern forces text, finish what finished, emit outputs, keep
        the rest running. True if some request jumped (it went back to the waiting queue)."""
        keep: list[Req] = []
        jumped_any = False
        for r in batch:
            jumped = not r.finished and self._jump_forward(r)
            if r.finished:
                self._cache_finished(r)
                outs.append(self._token_out(r))
                continue
            if jumped:
                self.waiting.append(r)
                jumped_any = True
            else:
                keep.append(r)
            interval = r.sampling_params.stream_interval or self.args.stream_interval
            if r.stream and len(r.output_ids) - r.sent_len >= interval:
                outs.append(self._token_out(r))
        if newly_running:
            self.running.extend(keep)
        else:
            self.running = keep
        return jumped_any

    def _jump_forward(self, req: Req) -> bool:
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
        the pattern and the tokenizer.
        """
        if self.jump is None or req.fsm is None or req.logprob is not None:
            return False
        plan = self.jump.plan(req.fsm, req.fsm_state, req.output_ids, req.sent_len,
                              req.sampling_params.max_new_tokens)
        if plan is None:
            return False
        in_batch = False
        if req.req_pool_idx is not None:
            if len(plan.new_ids) - (len(req.output_ids) - plan.keep) < self.jump_min_tokens:
                return False  # too few ids gained (--jump-forward-min-tokens)
            old_ids, old_kv = req.fill_ids, req.kv_computed
            new_ids = old_ids[: len(req.origin_input_ids) + plan.keep] + plan.new_ids
            valid = min(len(req.origin_input_ids) + plan.keep, old_kv)
            # KV at a position depends only on the ids up to it: it stays valid while the new
            # ids equal the old (at least one new id is left to compute for the next logits).
            while valid < min(old_kv, len(new_ids) - 1) and new_ids[valid] == old_ids[valid]:
                valid += 1
            in_batch = JUMP_IN_BATCH and valid >= len(req.prefix_indices)
            if in_batch:
                row = self.req_pool.req_to_token[req.req_pool_idx]
                if valid < old_kv:
                    self.pool.free(row[valid:old_kv].to("cpu", torch.int64))
                req.kv_valid = valid
            else:
                self._cache_finished(req)
        before = len(req.output_ids)
        del req.output_ids[plan.keep :]
        req.fsm_state = plan.keep_state
        self.generated_since_log -= before - plan.keep
        for tok in plan.new_ids:
            self._append_token(req, tok)
            if req.finished:
                break
        self.jump_forwards_total += 1
        self.jump_forward_tokens_total += len(req.output_ids) - before
        return not in_batch

    def _token_out(self, r: Req) -> TokenOut:
        new = r.output_ids[r.sent_len :]
        out_lp = r.output_logprobs.since(r.sent_len) if r.logprob is not None else None
        in_lp, r.input_logprobs = r.input_logprobs, None  # the prompt's are sent once
        r.sent_len = len(r.output_ids)
        p = r.sampling_params
        return TokenOut(
            rid=r.rid,
            new_ids=new,
            prompt_tokens=len(r.origin_input_ids),
            cached_tokens=max(0, r.cached_tokens),
            completion_tokens=len(r.output_ids),
            finish_reason=r.finish_reason,
            forward_passes=r.forward_passes,
            skip_special_tokens=p.skip_special_tokens,
            spaces_between_special_tokens=p.spaces_between_special_tokens,
            stop=list(p.stop),
            stop_regex=list(p.stop_regex),
            no_stop_trim=p.no_stop_trim,
            input_logprobs=in_lp,
            output_logprobs=out_lp,
            return_text_in_logprobs=r.logprob is not None and r.logprob.return_text_in_logprobs,
        )

    # ------------------------------------------------------------------ radix cache hand-offs

    def _cache_filled(self, req: Req) -> None:
        """After an extend: give the request's KV to the tree and lock the new path, so that other
        requests can share it while this one still runs."""
        n = len(req.fill_ids)
        row = self.req_pool.req_to_token[req.req_pool_idx]
        slots = row[:n].to("cpu", torch.int64)
        old = len(req.prefix_indices)
        present = self.tree.insert(req.fill_ids, slots.clone())
        if present > old:  # someone inserted the same tokens meanwhile: use theirs, free ours
            self.pool.free(slots[old:present])
        new_prefix, new_node = self.tree.match_prefix(req.fill_ids)
        row[old : len(new_prefix)] = new_prefix[old:].to(row.device, torch.int32)
        self.tree.inc_lock_ref(new_node)
        self.tree.dec_lock_ref(req.last_node)
        req.prefix_indices, req.last_node = new_prefix, new_node

    def _cache_finished(self, req: Req) -> None:
        """The request leaves the running set: its KV goes to the tree, its lock and row go back."""
        if req.req_pool_idx is None:
            return
        # Every token has KV except the last sampled one (a prefill-only request has none), or
        # after a jump inside the batch, the ids before kv_valid.
        if req.kv_valid is not None:
            n = req.kv_valid
        else:
            n = req.kv_len if req.output_ids else len(req.origin_input_ids)
        req.kv_valid = None
        key = req.fill_ids[:n]
        slots = self.req_pool.req_to_token[req.req_pool_idx, :n].to("cpu", torch.int64)
        old = len(req.prefix_indices)
        present = self.tree.insert(key, slots.clone())
        if present > old:
            self.pool.free(slots[old:present])
        if req.last_node is not None:
            self.tree.dec_lock_ref(req.last_node)
        self.req_pool.free(req.req_pool_idx)
        req.req_pool_idx = None
        req.prefix_indices = torch.empty(0, dtype=torch.int64)
        req.last_node = None

    # ------------------------------------------------------------------ logs

    def _maybe_log(self) -> None:
        now = time.monotonic()
        if self.tp_rank != 0 or now - self.last_log < self.args.log_stats_interval:
            return
        if self.running or self.waiting or self.generated_since_log:
            used = self.runner.max_total_num_tokens - self.pool.available_size()
            logger.info(
                "running=%d waiting=%d kv_used=%.1f%% (%d/%d tokens, %d evictable) "
                "cache_hit_rate=%.1f%% gen_throughput=%.1f tok/s",
                len(self.running), len(self.waiting),
                100.0 * used / self.runner.max_total_num_tokens, used,
                self.runner.max_total_num_tokens, self.tree.evictable_size(),
                100.0 * self.cached_tokens_total / max(1, self.prompt_tokens_total),
                self.generated_since_log / (now - self.last_log),
            )
        self.generated_since_log = 0
        self.last_log = now


def run_model_process(args: ServerArgs, ports: Any, tp_rank: int, link: Any) -> None:
    """Entry of one TP rank's process: build everything, report ready (or the traceback), loop."""
    import zmq

    from srt.faults import fault_point
    from srt.managers.comm import PullSocket, PushSocket
    from srt.utils import run_loop, start_child
    from srt.watchdog import IDLE_POLL_MS

    sockets: list[Any] = []

    def build() -> ModelRpcServer:
        server = ModelRpcServer(args, tp_rank, ports.dist_init_port)
        ctx = zmq.Context()
        sockets.append(PullSocket(ctx, ports.router_to_model[tp_rank]))
        sockets.append(PushSocket(ctx, ports.model_to_router) if tp_rank == 0 else None)
        return server

    def ready_info(server: ModelRpcServer) -> dict[str, Any]:
        info = server.runner.info()
        logger.info(
            "model %s (%s) on %s, dtype %s, attention %s; weights %.2f GB; KV pool %d tokens "
            "(%.2f GB); up to %d running requests; context length %d",
            args.model_path, server.config.architecture, info.device, info.dtype,
            info.attention_backend, info.weight_gb, info.max_total_num_tokens, info.kv_gb,
            info.max_running_requests, server.config.context_len,
        )
        return {
            "max_total_num_tokens": info.max_total_num_tokens,
            "context_length": server.config.context_len,
            "vocab_size": server.config.vocab_size,
            "image_token_id": server.config.image_token_id,
            "image_tokens": server.config.image_tokens,
            "image_size": server.config.image_size,
            "device": info.device,
            "dtype": info.dtype,
            "attention_backend": info.attention_backend,
            "weight_bytes_per_rank": server.runner.weight_bytes,
            "cuda_graph": server.runner.graph_runner is not None,
        }

    server = start_child(link, args.log_level, f"model tp{tp_rank}", build, ready_info)
    inbox, outbox = sockets
    fault = fault_point(args.fault, f"model{tp_rank}")
    heartbeat = link.heartbeat

    def loop() -> None:
        while True:
            inp = inbox.recv(IDLE_POLL_MS)
            heartbeat.beat()  # idle, or a round done: progress either way
            if inp is None:
                if not (server.running or server.waiting):
                    server.heap.idle()
                continue
            work = bool(inp.reqs or server.running or server.waiting)
            if work:
                fault.tick()
            out = server.step(inp)
            if work:
                server.heap.busy()
            if outbox is not None:
                outbox.send(out)

    run_loop(f"model process (TP rank {tp_rank})", loop)
