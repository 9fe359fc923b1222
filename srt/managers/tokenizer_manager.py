"""TokenizerManager: the HTTP process's end of the ring.

It validates and tokenizes each request (request_parse.py; regexes, JSON schemas and images
here, off the event loop), registers a state per sample (request_state.py), sends the samples to
the router, and routes the detokenizer's results to each sample's queue by wire rid. Every
request in flight ends with an answer, an abort, or ServerFailure once the server has failed.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from typing import Any, AsyncIterator, Awaitable, Callable

import zmq
import zmq.asyncio

from srt.constrained.grammar import GrammarBackend
from srt.constrained.registry import create_grammar_backend
from srt.faults import fault_point
from srt.managers.comm import AsyncPullSocket, PushSocket
from srt.managers.image_processor import ImageLoader
from srt.managers.image_source import ImageError
from srt.managers.io_struct import (
    AbortReq,
    BatchStrOut,
    FlushCacheOut,
    FlushCacheReq,
    GetStatsReq,
    LoadLoraReq,
    LoraOut,
    StatsOut,
    StrOut,
    TokenizedGenerateReq,
    UnloadLoraReq,
)
from srt.lora.registry import LoraRegistry
from srt.managers.request_parse import RequestParser
from srt.managers.request_state import Failed, LogprobState, ReqState
from srt.managers.request_types import (
    ModelLimits,
    ParsedRequest,
    RequestError,
    ServerFailure,
    checked_fields,
)
from srt.port_args import PortArgs
from srt.server_args import ServerArgs

# Callers and tests import these from here as well as from request_types.
__all__ = ["TokenizerManager", "RequestError", "checked_fields"]

logger = logging.getLogger(__name__)


class TokenizerManager:
    def __init__(self, args: ServerArgs, ports: PortArgs, limits: ModelLimits) -> None:
        from transformers import AutoTokenizer

        self.args = args
        self.limits = limits
        self.tokenizer = AutoTokenizer.from_pretrained(args.tokenizer_path)
        # --enable-lora: adapter names -> ids (srt/lora/registry.py)
        self.loras = LoraRegistry(True, args.lora_specs, args.max_loaded_loras) \
            if args.enable_lora else None
        self.parser = RequestParser(args, self.tokenizer, limits, self.loras)
        self.ctx = zmq.asyncio.Context()
        self.sync_ctx = zmq.Context()
        self.to_router = PushSocket(self.sync_ctx, ports.tokenizer_to_router)
        self.ports = ports
        self.inbox: AsyncPullSocket | None = None
        self.states: dict[str, ReqState] = {}  # by wire rid
        self.user_rids: set[str] = set()  # client rids of requests in flight
        self.control_waiters: dict[str, asyncio.Future] = {}
        self._loop_task: asyncio.Task | None = None
        self.grammars: GrammarBackend | None = None  # built at the first constrained request
        # Sees each sample's submission, outputs and end (metrics, request log); set by the
        # server: on_submit(rid, stream), on_output(rid, StrOut, text so far), on_done(rid).
        self.observer: Any = None
        self.images: ImageLoader | None = None
        if limits.image_token_id is not None:
            self.images = ImageLoader.create(args, limits.image_size)
        self.fault = fault_point(args.fault, "http")
        # Set by the server: called (on the event loop) with the reason if the result loop dies.
        self.on_loop_failure: Callable[[str], None] | None = None
        self.failed: str | None = None  # set by fail_all

    # ------------------------------------------------------------------ results

    def start(self) -> None:
        """Start the result loop on the running event loop (called at app start-up)."""
        if self._loop_task is None:
            self.inbox = AsyncPullSocket(self.ctx, self.ports.detokenizer_to_tokenizer)
            self._loop_task = asyncio.get_running_loop().create_task(self._result_loop())
            self._loop_task.add_done_callback(self._result_loop_ended)

    def _result_loop_ended(self, task: asyncio.Task) -> None:
        if task.cancelled():  # close()
            return
        exc = task.exception()
        logger.critical("the result loop of the HTTP process crashed", exc_info=exc)
        if self.on_loop_failure is not None:
            self.on_loop_failure(f"the result loop of the HTTP process crashed: {exc!r}")

    def fail_all(self, reason: str) -> None:
        """The server failed: every request in flight (and every control call) ends now with
        ServerFailure(reason), and so does every later one. Call on the event loop."""
        self.failed = reason
        for state in self.states.values():
            if not state.finished:
                state.queue.put_nowait(Failed(reason))
        for fut in self.control_waiters.values():
            if not fut.done():
                fut.set_exception(ServerFailure(reason))

    def abort_all(self, message: str) -> int:
        """Abort every request in flight through the ring (each still gets its answer, finished
        with type "abort"). Returns how many."""
        wire = [w for w, st in self.states.items() if not st.finished]
        for w in wire:
            self.to_router.send(AbortReq(w, message))
        return len(wire)

    async def close(self) -> None:
        """Stop the result loop and close the sockets (on the loop that called `start`); a zmq
        context left with open sockets would block the interpreter's exit."""
        if self._loop_task is not None:
            self._loop_task.cancel()
            await asyncio.gather(self._loop_task, return_exceptions=True)
            self._loop_task = None
        if self.inbox is not None:
            self.inbox.close()
            self.inbox = None
        self.to_router.close()
        self.ctx.term()
        self.sync_ctx.term()

    async def _result_loop(self) -> None:
        assert self.inbox is not None
        while True:
            msg = await self.inbox.recv()
            if isinstance(msg, BatchStrOut):
                self.fault.tick()
                for out in msg.outs:
                    state = self.states.get(out.rid)
                    if state is not None:  # None: the client left and the request was aborted
                        state.queue.put_nowait(out)
            elif isinstance(msg, (FlushCacheOut, StatsOut, LoraOut)):
                fut = self.control_waiters.pop(msg.rid, None)
                if fut is not None and not fut.done():
                    fut.set_result(msg)
            else:
                logger.error("unexpected message from the detokenizer: %s", type(msg).__name__)

    async def control(self, kind: type, timeout: float = 60.0, **fields: Any) -> Any:
        if self.failed is not None:
            raise ServerFailure(self.failed)
        rid = uuid.uuid4().hex
        fut = asyncio.get_running_loop().create_future()
        self.control_waiters[rid] = fut
        self.to_router.send(kind(rid, **fields))
        try:
            return await asyncio.wait_for(fut, timeout)
        finally:
            self.control_waiters.pop(rid, None)

    async def get_stats(self) -> dict[str, Any]:
        out: StatsOut = await self.control(GetStatsReq)
        return out.stats

    async def flush_cache(self) -> FlushCacheOut:
        return await self.control(FlushCacheReq)

    async def load_lora_adapter(self, name: Any, path: Any) -> LoraOut:
        """Load an adapter on every rank; the name takes requests once they all have it."""
        if self.loras is None:
            raise RequestError("this server was started without --enable-lora", None)
        if not isinstance(path, str) or not path:
            raise RequestError("lora_path must be a non-empty string", "lora_path")
        ref = self.loras.begin_load(name, path)
        out: LoraOut | None = None
        try:
            out = await self.control(LoadLoraReq, 600.0, lora_id=ref.lora_id, name=name,
                                     path=path)
        finally:
            self.loras.end_load(ref, out is not None and out.success)
        return out

    async def unload_lora_adapter(self, name: Any) -> LoraOut:
        """Unload an adapter no request uses (one with requests in flight is refused)."""
        if self.loras is None:
            raise RequestError("this server was started without --enable-lora", None)
        if not isinstance(name, str):
            raise RequestError("lora_name must be a string", "lora_name", "invalid_type")
        ref = self.loras.refs.get(name)
        busy = 0 if ref is None else sum(st.lora_id == ref.lora_id and not st.finished
                                         for st in self.states.values())
        ref = self.loras.begin_unload(name, busy)
        out: LoraOut | None = None
        try:
            out = await self.control(UnloadLoraReq, lora_id=ref.lora_id, name=name)
        finally:
            self.loras.end_unload(ref, out is not None and out.success)
        return out

    # ------------------------------------------------------------------ requests

    def parse_generate_request(self, body: Any) -> ParsedRequest:
        """Validate a /generate body (RequestParser.parse). Raises RequestError naming the
        offending field, or a client rid already in flight."""
        return self.parser.parse(body, self.user_rids)

    @property
    def served_model_name(self) -> str:
        return self.parser.served_model_name

    def check_model(self, model: Any) -> None:
        """`model` on /generate, /tokenize and /detokenize (RequestParser.check_model)."""
        self.parser.check_model(model)

    async def check_constraints(self, parsed: ParsedRequest) -> None:
        """Compile every regex / JSON schema / EBNF grammar of the request once here, off the
        event loop, so that an invalid, unsupported or too costly constraint is a 400 naming
        its field before anything is scheduled (the model processes then compile it again, in
        bounded time, from their own caches)."""
        seen: set[str] = set()
        for r in parsed.reqs:
            spec = r.params.constraint
            if spec is None or spec.key in seen:
                continue
            seen.add(spec.key)
            field_name = spec.kind
            if self.grammars is None:
                self.grammars = create_grammar_backend(
                    self.args.grammar_backend, self.tokenizer, self._eos_id(),
                    max(self.limits.vocab_size, len(self.tokenizer)),
                    self.args.constrained_cache_size)
            timeout = self.args.constrained_compile_timeout
            try:
                grammar = await asyncio.wait_for(
                    asyncio.wrap_future(self.grammars.compile(spec)), timeout)
            except asyncio.TimeoutError:
                raise RequestError(f"{field_name} took longer than {timeout} s to compile",
                                   field_name) from None
            except ValueError as e:  # GrammarError, or a compiler's own ValueError
                raise RequestError(f"invalid {field_name}: {e}", field_name) from None
            limit = self.grammars.max_size(self.args)
            if grammar.size > limit:
                raise RequestError(
                    f"{field_name} compiles to {grammar.size} {self.grammars.size_unit} (at "
                    f"most {limit})", field_name)
            if not grammar.admits_output():
                raise RequestError(f"{field_name} admits no output", field_name)

    def _eos_id(self) -> int:
        eos = self.tokenizer.eos_token_id
        return int(eos) if eos is not None else self.limits.vocab_size

    async def load_images(self, parsed: ParsedRequest) -> None:
        """Read, decode, preprocess and hash each distinct image of the request on worker
        threads (off the event loop). RequestError (400, param image_data) for a bad one."""
        if self.images is None:
            return
        sources = {r.image_source for r in parsed.reqs if r.image_source is not None}
        if not sources:
            return
        loaded = dict(zip(sources, await asyncio.gather(
            *(self.images.load(s) for s in sources), return_exceptions=True)))
        for src, result in loaded.items():
            if isinstance(result, ImageError):
                raise RequestError(str(result), "image_data", result.code)
            if isinstance(result, BaseException):
                raise result
        for r in parsed.reqs:
            if r.image_source is not None:
                r.image = loaded[r.image_source]

    def submit(self, parsed: ParsedRequest) -> None:
        """Register every sample's state, then send them to the router (after
        `load_images` for a request with images)."""
        if any(r.image_source is not None and r.image is None for r in parsed.reqs):
            raise RuntimeError("submit before load_images: the request's image is not loaded")
        if self.failed is not None:
            raise ServerFailure(self.failed)
        msgs = [
            TokenizedGenerateReq(
                rid=r.wire_rid,
                input_ids=r.input_ids,
                sampling_params=r.params.to_dict(),
                stream=parsed.stream,
                group=r.group,
                logprob=r.logprob,
                image=r.image,
                lora_id=r.lora_id,
            )
            for r in parsed.reqs
        ]
        self.to_router.send_all(msgs)
        # No await in between: results cannot arrive before the states exist.
        for r in parsed.reqs:
            self.states[r.wire_rid] = ReqState(
                r.rid, r.parent_rid, logprobs=LogprobState() if r.logprob is not None else None,
                lora_id=r.lora_id)
            self.user_rids.add(r.rid)
            if self.observer is not None:
                self.observer.on_submit(r.wire_rid, parsed.stream)

    def abort(self, rid: str, message: str = "aborted: the client disconnected") -> None:
        """Forget a request here and stop it in the model process."""
        if self.observer is not None:
            self.observer.on_done(rid)
        state = self.states.pop(rid, None)
        if state is None:
            return
        self.user_rids.discard(state.user_rid)
        if not state.finished and self.failed is None:  # a failed ring takes no messages
            self.to_router.send(AbortReq(rid, message))

    def abort_by_client_rid(self, rid: str, message: str) -> int:
        """Stop the in-flight requests with this client rid (or the samples of it) in the model
        process. Their states stay: each still gets its result, finished with type "abort".
        Returns how many were aborted."""
        wire = [w for w, st in self.states.items()
                if not st.finished and rid in (st.user_rid, st.parent_rid)]
        for w in wire:
            self.to_router.send(AbortReq(w, message))
        return len(wire)

    async def stream_results(self, rid: str, deltas: bool = False
                             ) -> AsyncIterator[dict[str, Any]]:
        """Cumulative results of one sample, one per StrOut, until it finishes (`deltas`: what
        each StrOut adds, ReqState.add_delta)."""
        state = self.states[rid]
        try:
            while True:
                out: StrOut | Failed = await state.queue.get()
                if isinstance(out, Failed):
                    raise ServerFailure(out.reason)
                item = state.add_delta(out) if deltas else state.add(out)
                if self.observer is not None:
                    self.observer.on_output(rid, out, state.text)
                yield item
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
                         is_disconnected: Callable[[], Awaitable[bool]], deltas: bool = False
                         ) -> AsyncIterator[tuple[int, dict[str, Any]]]:
        """(answer index, cumulative result, or with `deltas` what is new) as results arrive,
        until every sample finished or the client left (then everything is aborted)."""
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(rid: str, index: int) -> None:
            async for item in self.stream_results(rid, deltas):
                await queue.put((index, item))

        tasks = [asyncio.ensure_future(pump(r.wire_rid, r.index)) for r in parsed.reqs]
        done = 0
        try:
            while done < len(tasks):
                try:
                    index, item = await asyncio.wait_for(queue.get(), timeout=0.25)
                except asyncio.TimeoutError:
                    failed = next((t for t in tasks if t.done() and not t.cancelled()
                                   and t.exception() is not None), None)
                    if failed is not None:
                        raise failed.exception()  # e.g. ServerFailure
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
