"""The step executor: one forward, sampling and the TP broadcast of a `StepPlan`, launched
without waiting for the device.

`launch(plan)` copies the plan's integers to the device (one staged copy), writes the new
tokens' slots into req_to_token (device and host mirror), runs the model, samples, stores each
request's sampled id in `last_ids[row]` on the device and starts the copy of the ids (and
logprobs) to the host. It returns an `InFlight`; `InFlight.wait()` gives the results. A DECODE
plan without input ids reads them from `last_ids`, so step k+1 can be launched before step k's
ids reach the host.

Contract: the plans of launched steps are resolved (`wait`) in launch order, and a plan's
requests must not be mutated on the host between its launch and its wait except as the loop
does (appending the previous step's tokens). Sampling of a launched step reads each request's
host state at launch: requests whose sampling needs the previous step's token on the host
(penalties, pending min_new_tokens) are launched only after that step was resolved; a grammar's
mask is built after the step before was read, between this step's forward and its sampling
(`before_sample`).

On a GPU each step records an event before its first copy and one after its last, so `wait`
can book how long the device sat idle before the step (`StepTimer.gpu_idle`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

from srt.constrained.grammar import MaskBuilder
from srt.layers import parallel_state
from srt.layers.forward_batch import ForwardBatch, ForwardMode
from srt.layers.sampler import sample, verify_sample
from srt.managers.io_struct import TokenLogprobs
from srt.model_process.batch import StepPlan
from srt.model_process.logprob_step import StepLogprobs
from srt.model_process.model_runner import ModelRunner
from srt.model_process.radix_cache import shared_prefix_len
from srt.model_process.req import Req
from srt.model_process.sampling_info import SamplingRows, build_sampling_info, keep_out_rows
from srt.model_process.step_inputs import StepInputBuilder
from srt.model_process.step_timing import StepTimer


@dataclass
class StepResult:
    ids: list[int]
    prompt_logprobs: list[TokenLogprobs | None]
    output_logprobs: list[TokenLogprobs | None]
    # --is-embedding: each request's pooled rows of the step, [requests, H] float32 on the host
    pooled: torch.Tensor | None = None


@dataclass
class InFlight:
    """A launched step whose results are on their way to the host."""

    plan: StepPlan
    ids_host: torch.Tensor
    done: torch.cuda.Event | None
    logprobs: StepLogprobs | None
    timer: StepTimer
    start: torch.cuda.Event | None = None  # recorded before the step's first device work
    prev_end: torch.cuda.Event | None = None  # the end of the step launched before it
    result: StepResult | None = None
    pooled: torch.Tensor | None = None  # --is-embedding: the pooled rows, copied to the host

    def wait(self) -> StepResult:
        """Block until the step's ids (and logprobs) are on the host; idempotent."""
        if self.result is not None:
            return self.result
        if self.pooled is not None:
            if self.done is not None:
                self.done.synchronize()
            none: list[TokenLogprobs | None] = [None] * len(self.plan.reqs)
            self.result = StepResult([0] * len(self.plan.reqs), none, list(none), self.pooled)
            return self.result
        if self.logprobs is not None:
            ids, prompt, out = self.logprobs.collect()
        else:
            if self.done is not None:
                self.done.synchronize()
            ids = self.ids_host.tolist()  # one per request, or per row of a verification
            none: list[TokenLogprobs | None] = [None] * len(ids)
            prompt, out = none, list(none)
        if (self.start is not None and self.prev_end is not None
                and self.plan.mode == ForwardMode.DECODE and not self.plan.fill):
            idle_ms = max(0.0, self.prev_end.elapsed_time(self.start))
            self.timer.gpu_idle(len(self.plan.reqs), idle_ms / 1e3)
        self.result = StepResult(ids, prompt, out)
        return self.result


class StepExecutor:
    def __init__(self, runner: ModelRunner, vocab_size: int,
                 stop_ids: Callable[[Req], set[int]], timer: StepTimer,
                 grammar_masks: Callable[[int, torch.device], MaskBuilder]) -> None:
        """`grammar_masks(vocab_size, device)`: the grammar backend's mask builder."""
        self.runner = runner
        self.device = runner.device
        self.vocab_size = vocab_size
        self.stop_ids = stop_ids
        self.timer = timer
        self.req_pool = runner.req_to_token_pool
        self.inputs = StepInputBuilder(self.device)
        self.last_ids = torch.zeros(self.req_pool.size, dtype=torch.int64, device=self.device)
        self.sampling_rows: SamplingRows | None = None  # the last batch's, reused while equal
        self.grammar_masks = grammar_masks
        self.masks: MaskBuilder | None = None  # built at the first batch with a grammar
        self._timed = self.device.type == "cuda"
        self._last_end: torch.cuda.Event | None = None

    def _event(self) -> torch.cuda.Event | None:
        if not self._timed:
            return None
        e = torch.cuda.Event(enable_timing=True)
        e.record()
        return e

    @torch.inference_mode()
    def launch(self, plan: StepPlan,
               before_sample: Callable[[], None] | None = None) -> InFlight:
        """Launch `plan`'s forward, then sampling. `before_sample` runs on the host between the
        two, while the device computes the forward: the loop reads the previous step there, so
        that a grammar's mask sees the token that step sampled (requests it finished get no
        mask; their token of this step is dropped when it is read)."""
        dev = self.device
        start = self._event()
        reqs = plan.reqs
        t = self.inputs.build(plan.input_ids, plan.positions, plan.out_cache_loc, plan.rows,
                              plan.seq_lens)
        input_ids = t.input_ids
        if plan.input_ids is None:  # each row's last sampled id, never seen by the host
            input_ids = self.last_ids.index_select(0, t.req_pool_indices)
        if plan.verify is not None and plan.verify.fork is not None:
            self.req_pool.fork_rows(*plan.verify.fork)  # a draft tree's branches (scratch rows)
        if plan.mode == ForwardMode.DECODE:  # the new tokens' slots: req_to_token[row, position]
            self.req_pool.req_to_token[t.req_pool_indices, t.positions] = \
                t.out_cache_loc.to(torch.int32)
            if self.req_pool.host is not self.req_pool.req_to_token:
                self.req_pool.host.numpy()[plan.rows, plan.positions] = \
                    plan.out_cache_loc.numpy()
        seq_cpu = plan.seq_lens.tolist()
        fb = ForwardBatch(
            forward_mode=plan.mode,
            batch_size=len(plan.rows),
            input_ids=input_ids,
            positions=t.positions,
            out_cache_loc=t.out_cache_loc,
            req_pool_indices=t.req_pool_indices,
            seq_lens=t.seq_lens,
            seq_lens_cpu=seq_cpu,
            prefix_lens_cpu=plan.prefix_lens,
            extend_lens_cpu=plan.extend_lens,
            req_to_token_pool=self.req_pool,
            token_to_kv_pool=self.runner.token_to_kv_pool,
            attn_backend=self.runner.attn_backend,
            images=plan.images,
        )
        if plan.n_fill is not None and self.runner.attn_backend.supports_decode_tail:
            fb.decode_tail = _decode_tail(plan)
        # A verification step samples every row: the requests of its rows, in row order.
        rows_reqs = plan.verify.row_reqs if plan.verify is not None else reqs
        if self.runner.lora is not None:
            fb.lora = self.runner.lora.batch_info(_row_adapters(plan, rows_reqs))
        if (plan.mode == ForwardMode.DECODE and plan.sample_rows is None
                and plan.verify is None and self.runner.wants_shared_prefix(len(reqs))):
            fb.shared_prefix_len = shared_prefix_len([r.last_node for r in reqs])
        lps = None
        if any(r.logprob is not None for r in reqs):
            lps = StepLogprobs(rows_reqs, plan.mode, plan.prefix_lens, plan.extend_lens, dev)
            fb.prompt_logprobs = lps.prompt_request
        self.timer.mark("prepare")
        logits = self.runner.forward(fb)
        if self.runner.pooling is not None:
            return self._pooled_step(plan, logits, start)
        req_rows = t.req_pool_indices
        select = None
        if plan.sample_rows is not None:
            both = torch.from_numpy(np.stack((np.asarray(plan.sample_rows, dtype=np.int64),
                                              plan.req_rows))).to(dev, non_blocking=True)
            select, req_rows = both[0], both[1]
            logits = logits.index_select(0, select)
        self.timer.mark("forward")
        if before_sample is not None:
            before_sample()
        assert logits.shape[-1] == self.vocab_size
        # The sampling tensors and masks after the launch: on a GPU the host builds them while
        # the device runs the forward (every copy in them is non-blocking).
        # a verification's rows: each follows its request's drafts before it
        before = plan.verify.drafts_before() if plan.verify is not None else None
        constrained = any(r.matcher is not None for r in reqs)
        info, self.sampling_rows = build_sampling_info(
            rows_reqs, self.vocab_size, dev, self.stop_ids, self.sampling_rows, before,
            keep_out=not constrained)
        if constrained:
            if self.masks is None:
                self.masks = self.grammar_masks(logits.shape[-1], dev)
            # a verification's rows: each its own state (after the drafts before it)
            row_matchers = plan.verify.matchers if plan.verify is not None \
                and plan.verify.matchers is not None else [r.matcher for r in rows_reqs]
            # min_new_tokens' stop ids go to the mask builder, which folds them into its mask
            info.forbidden = self.masks.batch(
                [None if r.finished else m for r, m in zip(rows_reqs, row_matchers)],
                keep_out_rows(rows_reqs, self.stop_ids, before))
        self.timer.mark("sample_prep")
        if plan.verify is not None:
            # each row's output position (seeded rows draw their noise from it)
            info.positions = [p + int(o) for p, o in zip(info.positions, plan.verify.offsets)]
            children = torch.from_numpy(plan.verify.children).to(dev, non_blocking=True)
            ids = verify_sample(logits, info, children, self.runner.sampler_generator)
        else:
            ids = sample(logits, info, self.runner.sampler_generator)
        # Rank 0 samples for all: ranks hold bitwise-equal logits and generators, but one
        # small broadcast makes it impossible for their schedules to drift apart.
        ids = parallel_state.broadcast_from_first(ids)
        if plan.verify is None:  # (a verification's last ids are known after acceptance)
            self.last_ids.index_copy_(0, req_rows, ids)
        done = None
        if lps is not None:
            # Logprobs of the raw logits (the model's distribution), moved with the ids.
            lps.launch(logits, ids)
            host = ids
        elif dev.type == "cuda":
            host = torch.empty(ids.shape, dtype=ids.dtype, pin_memory=True)
            host.copy_(ids, non_blocking=True)
            done = torch.cuda.Event()
            done.record()
        else:
            host = ids
        if self.runner.draft is not None:
            # the draft's KV of the step's positions (and an EAGLE head's next features),
            # queued after the copy of the ids so that reading them does not wait for it
            self.runner.draft.mirror(fb, plan, ids, req_rows, select)
        for r in reqs:
            if not r.finished:  # (finished by the read in before_sample: its token is dropped)
                r.forward_passes += 1
            r.in_flight += 1
        end = self._event()
        inflight = InFlight(plan, host, done, lps, self.timer, start, self._last_end)
        self._last_end = end
        self.timer.mark("sample")
        return inflight

    def _pooled_step(self, plan: StepPlan, pooled: torch.Tensor,
                     start: torch.cuda.Event | None) -> InFlight:
        """--is-embedding: a fill step's pooled rows (nothing is sampled) on their way to the
        host."""
        done = None
        host = pooled
        if pooled.is_cuda:
            host = torch.empty(pooled.shape, dtype=pooled.dtype, pin_memory=True)
            host.copy_(pooled, non_blocking=True)
            done = torch.cuda.Event()
            done.record()
        for r in plan.reqs:
            r.forward_passes += 1
            r.in_flight += 1
        self.timer.mark("sample")
        return InFlight(plan, host, done, None, self.timer, start, self._last_end, pooled=host)

    def set_last_ids(self, rows: list[int], ids: list[int]) -> None:
        """Each row's last sampled id on the device, where the host decided it (after a
        verification step), for a DECODE step launched without input ids."""
        if rows:
            both = torch.tensor([rows, ids], dtype=torch.int64).to(self.device,
                                                                   non_blocking=True)
            self.last_ids.index_copy_(0, both[0], both[1])

    def break_chain(self) -> None:
        """The next step follows host work that is not a decode step (a fill, a pause): its
        device idle time is not booked."""
        self._last_end = None


def _decode_tail(plan: StepPlan) -> int:
    """Running requests at the end of a mixed step that compute one token each (those after a
    jump-forward compute several and stay extend rows)."""
    tail = 0
    for e in reversed(plan.extend_lens[plan.n_fill:]):
        if e != 1:
            break
        tail += 1
    return tail


def _row_adapters(plan: StepPlan, rows_reqs: list[Req]) -> np.ndarray:
    """The LoRA adapter id of each forward row (0: none): an extend's requests have
    extend_lens rows each; a decode's one each, a verification's one per row of `rows_reqs`, and
    the step after a jump inside the batch its rows up to each request's sampled row."""
    ids = np.fromiter((r.lora_id for r in rows_reqs), dtype=np.int64, count=len(rows_reqs))
    if plan.mode != ForwardMode.DECODE:
        return np.repeat(ids, plan.extend_lens)
    if plan.sample_rows is not None and plan.verify is None:
        return np.repeat(ids, np.diff(np.asarray([-1, *plan.sample_rows])))
    return ids
