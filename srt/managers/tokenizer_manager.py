"""TokenizerManager: validation, tokenization and per-request state in the HTTP process.

Nothing invalid crosses into the other processes: `parse_generate_request` turns a JSON body into
validated single-sample requests or raises RequestError naming the field. Results come back from
the detokenizer and are routed to each request's queue by rid.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import uuid
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Awaitable, Callable

import zmq
import zmq.asyncio

from srt.managers.comm import AsyncPullSocket, PushSocket
from srt.managers.io_struct import (
    AbortReq,
    BatchStrOut,
    FlushCacheOut,
    FlushCacheReq,
    GetStatsReq,
    StatsOut,
    StrOut,
    TokenizedGenerateReq,
)
from srt.sampling_params import SamplingParamError, SamplingParams, is_valid_utf8
from srt.server_args import PortArgs, ServerArgs

logger = logging.getLogger(__name__)


class RequestError(ValueError):
    """A client error: answered with HTTP 400 and {"error": {message, type, param, code}}."""

    def __init__(self, message: str, param: str | None, code: str = "invalid_value",
                 status: int = 400) -> None:
        super().__init__(message)
        self.param = param
        self.code = code
        self.status = status


@dataclass(frozen=True)
class ModelLimits:
    """What the model process reported at start-up; requests are checked against it."""

    context_length: int
    vocab_size: int
    max_total_num_tokens: int


@dataclass
class SingleRequest:
    rid: str  # the client's id, reported back in meta_info
    input_ids: list[int]
    params: SamplingParams
    index: int  # position in the answer list
    group: str | None  # internal id shared by the samples of one prompt (n > 1)
    # Internal id on the wire: unique per submission, so a client reusing a rid right after an
    # abort can never be confused with the request being aborted.
    wire_rid: str = field(default_factory=lambda: uuid.uuid4().hex)


@dataclass
class ParsedRequest:
    reqs: list[SingleRequest]
    stream: bool
    is_batch: bool  # answer with a list


@dataclass
class ReqState:
    user_rid: str
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    output_ids: list[int] = field(default_factory=list)
    finished: bool = False


class TokenizerManager:
    def __init__(self, args: ServerArgs, ports: PortArgs, limits: ModelLimits) -> None:
        from transformers import AutoTokenizer

        self.args = args
        self.limits = limits
        self.tokenizer = AutoTokenizer.from_pretrained(args.tokenizer_path)
        self.ctx = zmq.asyncio.Context()
        self.sync_ctx = zmq.Context()
        self.to_router = PushSocket(self.sync_ctx, ports.tokenizer_to_router)
        self.ports = ports
        self.inbox: AsyncPullSocket | None = None
        self.states: dict[str, ReqState] = {}  # by wire rid
        self.user_rids: set[str] = set()  # client rids of requests in flight
        self.control_waiters: dict[str, asyncio.Future] = {}
        self._loop_task: asyncio.Task | None = None

    # ------------------------------------------------------------------ results

    def start(self) -> None:
        """Start the result loop on the running event loop (called at app start-up)."""
        if self._loop_task is None:
            self.inbox = AsyncPullSocket(self.ctx, self.ports.detokenizer_to_tokenizer)
            self._loop_task = asyncio.get_running_loop().create_task(self._result_loop())

    async def _result_loop(self) -> None:
        assert self.inbox is not None
        while True:
            msg = await self.inbox.recv()
            if isinstance(msg, BatchStrOut):
                for out in msg.outs:
                    state = self.states.get(out.rid)
                    if state is not None:  # None: the client left and the request was aborted
                        state.queue.put_nowait(out)
            elif isinstance(msg, (FlushCacheOut, StatsOut)):
                fut = self.control_waiters.pop(msg.rid, None)
                if fut is not None and not fut.done():
                    fut.set_result(msg)
            else:
                logger.error("unexpected message from the detokenizer: %s", type(msg).__name__)

    async def control(self, kind: type, timeout: float = 60.0) -> Any:
        rid = uuid.uuid4().hex
        fut = asyncio.get_running_loop().create_future()
        self.control_waiters[rid] = fut
        self.to_router.send(kind(rid))
        try:
            return await asyncio.wait_for(fut, timeout)
        finally:
            self.control_waiters.pop(rid, None)

    async def get_stats(self) -> dict[str, Any]:
        out: StatsOut = await self.control(GetStatsReq)
        return out.stats

    async def flush_cache(self) -> FlushCacheOut:
        return await self.control(FlushCacheReq)

    # ------------------------------------------------------------------ requests

    def parse_generate_request(self, body: Any) -> ParsedRequest:
        """Validate a /generate body. Raises RequestError naming the offending field."""
        if not isinstance(body, dict):
            raise RequestError("the request body must be a JSON object", None, "invalid_type")
        known = {"text", "input_ids", "sampling_params", "stream", "rid"}
        unknown = sorted(set(body) - known)
        if unknown:
            raise RequestError(f"unknown field {unknown[0]!r}", unknown[0], "unknown_field")
        text, input_ids = body.get("text"), body.get("input_ids")
        if (text is None) == (input_ids is None):
            raise RequestError("give exactly one of text and input_ids", "text")
        stream = body.get("stream", False)
        if not isinstance(stream, bool):
            raise RequestError("stream must be a boolean", "stream", "invalid_type")
        if text is not None:
            prompts, is_batch = self._parse_text(text)
            prompt_ids = [self._encode(t) for t in prompts]
        else:
            prompt_ids, is_batch = self._parse_ids(input_ids)
        params = self._parse_params(body.get("sampling_params"), len(prompt_ids))
        rids = self._parse_rids(body.get("rid"), len(prompt_ids))
        reqs: list[SingleRequest] = []
        for i, (ids, p, rid) in enumerate(zip(prompt_ids, params, rids)):
            self._check_lengths(ids, p)
            if p.n == 1:
                reqs.append(SingleRequest(rid, ids, p, len(reqs), None))
                continue
            group = uuid.uuid4().hex
            for k in range(p.n):
                # each sample its own seed, or they would all draw the same tokens
                pk = p if p.seed is None else dataclasses.replace(p, seed=(p.seed + k) % 2**63)
                reqs.append(SingleRequest(f"{rid}-{k}", ids, pk, len(reqs), group))
        seen: set[str] = set()
        for r in reqs:
            if r.rid in self.user_rids or r.rid in seen:
                raise RequestError(f"rid {r.rid!r} is already in use", "rid", "duplicate_rid")
            seen.add(r.rid)
        is_batch = is_batch or any(p.n > 1 for p in params)
        return ParsedRequest(reqs, stream, is_batch)

    def _parse_text(self, text: Any) -> tuple[list[str], bool]:
        if isinstance(text, str):
            prompts, is_batch = [text], False
        elif isinstance(text, list) and text and all(isinstance(t, str) for t in text):
            prompts, is_batch = text, True
        else:
            raise RequestError("text must be a string or a non-empty list of strings", "text",
                               "invalid_type")
        if any(t == "" for t in prompts):
            raise RequestError("text must not be empty", "text")
        if not all(is_valid_utf8(t) for t in prompts):
            raise RequestError("text must be valid Unicode (no lone surrogates)", "text")
        return prompts, is_batch

    def _encode(self, text: str) -> list[int]:
        ids = self.tokenizer.encode(text)
        if not ids:
            raise RequestError("text encodes to no tokens", "text")
        return ids

    def _parse_ids(self, input_ids: Any) -> tuple[list[list[int]], bool]:
        def is_ids(x: Any) -> bool:
            return isinstance(x, list) and all(
                isinstance(t, int) and not isinstance(t, bool) for t in x
            )

        if is_ids(input_ids):
            batch, is_batch = [input_ids], False
        elif isinstance(input_ids, list) and input_ids and all(is_ids(x) for x in input_ids):
            batch, is_batch = input_ids, True
        else:
            raise RequestError("input_ids must be a list of integers or a list of such lists",
                               "input_ids", "invalid_type")
        vocab = self.limits.vocab_size
        for ids in batch:
            if not ids:
                raise RequestError("input_ids must not be empty", "input_ids")
            bad = next((t for t in ids if not 0 <= t < vocab), None)
            if bad is not None:
                raise RequestError(
                    f"token id {bad} is outside the vocabulary [0, {vocab})", "input_ids"
                )
        return batch, is_batch

    def _parse_params(self, raw: Any, n_prompts: int) -> list[SamplingParams]:
        try:
            if isinstance(raw, list):
                if len(raw) != n_prompts:
                    raise RequestError(
                        f"sampling_params has {len(raw)} entries for {n_prompts} prompts",
                        "sampling_params",
                    )
                return [SamplingParams.from_dict(p) for p in raw]
            p = SamplingParams.from_dict(raw)
        except SamplingParamError as e:
            raise RequestError(str(e), e.param) from None
        return [p] * n_prompts

    def _parse_rids(self, raw: Any, n: int) -> list[str]:
        if raw is None:
            return [uuid.uuid4().hex for _ in range(n)]
        def ok(r: Any) -> bool:
            return isinstance(r, str) and r != "" and is_valid_utf8(r)

        if n == 1 and ok(raw):
            return [raw]
        if isinstance(raw, list) and len(raw) == n and all(map(ok, raw)) and len(set(raw)) == n:
            return list(raw)
        raise RequestError("rid must be a non-empty string, or a list of distinct strings with "
                           "one per prompt", "rid", "invalid_type")

    def _check_lengths(self, ids: list[int], p: SamplingParams) -> None:
        need = len(ids) + p.max_new_tokens
        if need > self.limits.context_length:
            raise RequestError(
                f"the prompt has {len(ids)} tokens and max_new_tokens is {p.max_new_tokens}: "
                f"{need} exceeds the context length {self.limits.context_length}",
                "max_new_tokens", "context_length_exceeded",
            )
        if need > self.limits.max_total_num_tokens:
            raise RequestError(
                f"the prompt has {len(ids)} tokens and max_new_tokens is {p.max_new_tokens}: "
                f"{need} exceeds the KV cache capacity ({self.limits.max_total_num_tokens} tokens)",
                "max_new_tokens", "kv_capacity_exceeded",
            )

    def submit(self, parsed: ParsedRequest) -> None:
        """Register every sample's state, then send them to the router."""
        msgs = [
            TokenizedGenerateReq(
                rid=r.wire_rid,
                input_ids=r.input_ids,
                sampling_params=r.params.to_dict(),
                stream=parsed.stream,
                group=r.group,
            )
            for r in parsed.reqs
        ]
        self.to_router.send_all(msgs)
        # No await in between: results cannot arrive before the states exist.
        for r in parsed.reqs:
            self.states[r.wire_rid] = ReqState(r.rid)
            self.user_rids.add(r.rid)

    def abort(self, rid: str, message: str = "aborted: the client disconnected") -> None:
        """Forget a request here and stop it in the model process."""
        state = self.states.pop(rid, None)
        if state is None:
            return
        self.user_rids.discard(state.user_rid)
        if not state.finished:
            self.to_router.send(AbortReq(rid, message))

    async def stream_results(self, rid: str) -> AsyncIterator[dict[str, Any]]:
        """Cumulative results of one sample, one per StrOut, until it finishes."""
        state = self.states[rid]
        try:
            while True:
                out: StrOut = await state.queue.get()
                state.output_ids.extend(out.new_ids)
                state.finished = out.finish_reason is not None
                yield self.result_dict(state.user_rid, out, state)
                if state.finished:
                    return
        finally:
            # Finished, or the consumer went away (client disconnect): never leave state behind.
            self.abort(rid)

    async def wait_all(self, parsed: ParsedRequest,
                       is_disconnected: Callable[[], Awaitable[bool]]) -> list[dict[str, Any]] | None:
        """Final results of every sample in order; None (all aborted) if the client left."""
        async def one(rid: str) -> dict[str, Any]:
            last: dict[str, Any] = {}
            async for last in self.stream_results(rid):
                pass
            return last

        gathered = asyncio.gather(*(one(r.wire_rid) for r in parsed.reqs))
        try:
            while not gathered.done():
                await asyncio.wait({gathered}, timeout=0.25)
                if not gathered.done() and await is_disconnected():
                    gathered.cancel()
                    return None
            return gathered.result()
        finally:
            for r in parsed.reqs:
                self.abort(r.wire_rid)  # a no-op for finished requests

    async def stream_all(self, parsed: ParsedRequest,
                         is_disconnected: Callable[[], Awaitable[bool]]
                         ) -> AsyncIterator[tuple[int, dict[str, Any]]]:
        """(answer index, cumulative result) as results arrive, until every sample finished or
        the client left (then everything is aborted)."""
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(rid: str, index: int) -> None:
            async for item in self.stream_results(rid):
                await queue.put((index, item))

        tasks = [asyncio.ensure_future(pump(r.wire_rid, r.index)) for r in parsed.reqs]
        done = 0
        try:
            while done < len(tasks):
                try:
                    index, item = await asyncio.wait_for(queue.get(), timeout=0.25)
                except asyncio.TimeoutError:
                    if await is_disconnected():
                        return
                    if all(t.done() for t in tasks) and queue.empty():
                        return
                    continue
                if item["meta_info"]["finish_reason"] is not None:
                    done += 1
                yield index, item
        finally:
            for t in tasks:
                t.cancel()
            for r in parsed.reqs:
                self.abort(r.wire_rid)

    @staticmethod
    def result_dict(rid: str, out: StrOut, state: ReqState) -> dict[str, Any]:
        return {
            "text": out.text,
            "output_ids": list(state.output_ids),
            "meta_info": {
                "id": rid,
                "prompt_tokens": out.prompt_tokens,
                "completion_tokens": out.completion_tokens,
                "cached_tokens": out.cached_tokens,
                "finish_reason": out.finish_reason,
            },
        }
