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

from srt import field_policy
from srt.constrained.fsm import FSMCache, constraint_regex
from srt.field_policy import FieldError, Surface
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
    ImageInput,
    LogprobOptions,
    StatsOut,
    StrOut,
    TokenizedGenerateReq,
    TokenLogprobs,
)
from srt.sampling_params import SamplingParamError, SamplingParams, is_valid_utf8
from srt.server_args import PortArgs, ServerArgs

logger = logging.getLogger(__name__)

MAX_TOP_LOGPROBS = 20


class RequestError(ValueError):
    """A client error: answered with HTTP 400 and {"error": {message, type, param, code}}."""

    def __init__(self, message: str, param: str | None, code: str = "invalid_value",
                 status: int = 400) -> None:
        super().__init__(message)
        self.param = param
        self.code = code
        self.status = status


def checked_fields(surface: Surface, body: dict[str, Any]) -> dict[str, Any]:
    """`surface.apply(body)` (srt/field_policy.py), its refusal as a RequestError."""
    try:
        return surface.apply(body)
    except FieldError as e:
        raise RequestError(str(e), e.name, e.code) from None


class ServerFailure(RuntimeError):
    """The server cannot finish the request: a process died or stalled. Answered with HTTP 503
    and code "server_failed" (a stream ends with one error event)."""


@dataclass(frozen=True)
class _Failed:
    """Put on a request's queue when the server fails: its consumer raises ServerFailure."""

    reason: str


@dataclass(frozen=True)
class ModelLimits:
    """What the model process reported at start-up; requests are checked against it."""

    context_length: int
    vocab_size: int
    max_total_num_tokens: int
    # Image input (LLaVA; None / 0 for a text-only model): the image token, the positions one
    # image fills in the prompt, and the side of the square image the vision tower takes.
    image_token_id: int | None = None
    image_tokens: int = 0
    image_size: int = 0


@dataclass
class SingleRequest:
    rid: str  # the client's id, reported back in meta_info
    input_ids: list[int]
    params: SamplingParams
    index: int  # position in the answer list
    group: str | None  # internal id shared by the samples of one prompt (n > 1)
    logprob: LogprobOptions | None = None
    parent_rid: str = ""  # the client's rid of the prompt (n > 1: the samples' rid is rid-k)
    image_source: str | None = None  # the prompt's image_data entry
    image: ImageInput | None = None  # set by load_images
    prompt_len: int = 0  # tokens of the prompt in the KV cache (an image counts its positions)
    # Internal id on the wire: unique per submission, so a client reusing a rid right after an
    # abort can never be confused with the request being aborted.
    wire_rid: str = field(default_factory=lambda: uuid.uuid4().hex)


@dataclass
class ParsedRequest:
    reqs: list[SingleRequest]
    stream: bool
    is_batch: bool  # answer with a list


def _triples(lp: TokenLogprobs) -> tuple[list[list[Any]], list[list[list[Any]] | None]]:
    """TokenLogprobs -> the API's [logprob, token_id, text or None] per token, and per token
    the list of such triples of its top tokens (None for the first prompt token)."""
    texts = lp.texts or [None] * len(lp.token_ids)
    top_texts = lp.top_texts or [None] * len(lp.top_ids)
    tokens = [[v, t, x] for v, t, x in zip(lp.logprobs, lp.token_ids, texts)]
    tops: list[list[list[Any]] | None] = []
    for values, ids, words in zip(lp.top_logprobs, lp.top_ids, top_texts):
        if values is None or ids is None:
            tops.append(None)
        else:
            tops.append([[v, t, w] for v, t, w in zip(values, ids, words or [None] * len(ids))])
    return tokens, tops


@dataclass
class LogprobState:
    """The logprobs of one sample so far, as meta_info reports them (cumulative)."""

    input_token_logprobs: list[list[Any]] = field(default_factory=list)
    input_top_logprobs: list[Any] = field(default_factory=list)
    output_token_logprobs: list[list[Any]] = field(default_factory=list)
    output_top_logprobs: list[Any] = field(default_factory=list)

    def add(self, out: StrOut) -> None:
        if out.input_logprobs is not None:
            tokens, tops = _triples(out.input_logprobs)
            self.input_token_logprobs += tokens
            self.input_top_logprobs += tops
        if out.output_logprobs is not None:
            tokens, tops = _triples(out.output_logprobs)
            self.output_token_logprobs += tokens
            self.output_top_logprobs += tops

    def meta(self) -> dict[str, Any]:
        values = [t[0] for t in self.input_token_logprobs if t[0] is not None]
        return {
            "input_token_logprobs": list(self.input_token_logprobs),
            "output_token_logprobs": list(self.output_token_logprobs),
            "input_top_logprobs": list(self.input_top_logprobs),
            "output_top_logprobs": list(self.output_top_logprobs),
            # mean logprob of the prompt tokens from logprob_start_len on (None: none asked)
            "normalized_prompt_logprob": sum(values) / len(values) if values else None,
        }


@dataclass
class ReqState:
    user_rid: str
    parent_rid: str = ""
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    output_ids: list[int] = field(default_factory=list)
    finished: bool = False
    logprobs: LogprobState | None = None  # None: no logprobs asked


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
        self.fsm_cache: FSMCache | None = None  # built at the first constrained request
        # Sees each sample's submission, outputs and end (metrics, request log); set by the
        # server: on_submit(rid, stream), on_output(rid, StrOut), on_done(rid).
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
                state.queue.put_nowait(_Failed(reason))
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
            elif isinstance(msg, (FlushCacheOut, StatsOut)):
                fut = self.control_waiters.pop(msg.rid, None)
                if fut is not None and not fut.done():
                    fut.set_result(msg)
            else:
                logger.error("unexpected message from the detokenizer: %s", type(msg).__name__)

    async def control(self, kind: type, timeout: float = 60.0) -> Any:
        if self.failed is not None:
            raise ServerFailure(self.failed)
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
        body = checked_fields(field_policy.GENERATE, body)
        self.check_model(body.get("model"))
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
        prompt_field = "text" if text is not None else "input_ids"
        images = self._parse_images(body.get("image_data"), prompt_ids, prompt_field)
        # With an image, prompt positions count the positions the image fills.
        lens = [len(ids) + (self.limits.image_tokens - 1 if img is not None else 0)
                for ids, img in zip(prompt_ids, images)]
        logprobs = self._parse_logprobs(body, lens)
        reqs: list[SingleRequest] = []
        for i, (ids, p, rid, lp, img, n) in enumerate(
                zip(prompt_ids, params, rids, logprobs, images, lens)):
            self._check_lengths(n, p, prompt_field)
            if p.n == 1:
                reqs.append(SingleRequest(rid, ids, p, len(reqs), None, lp, rid,
                                          image_source=img, prompt_len=n))
                continue
            group = uuid.uuid4().hex
            for k in range(p.n):
                # each sample its own seed, or they would all draw the same tokens
                pk = p if p.seed is None else dataclasses.replace(p, seed=(p.seed + k) % 2**63)
                reqs.append(SingleRequest(f"{rid}-{k}", ids, pk, len(reqs), group, lp, rid,
                                          image_source=img, prompt_len=n))
        seen: set[str] = set()
        for r in reqs:
            if r.rid in self.user_rids or r.rid in seen:
                raise RequestError(f"rid {r.rid!r} is already in use", "rid", "duplicate_rid")
            seen.add(r.rid)
        is_batch = is_batch or any(p.n > 1 for p in params)
        return ParsedRequest(reqs, stream, is_batch)

    async def check_constraints(self, parsed: ParsedRequest) -> None:
        """Compile every regex / JSON schema of the request once here, off the event loop, so
        that an invalid or too costly pattern is a 400 before anything is scheduled (the model
        processes then compile it again, in bounded time, from their own caches)."""
        seen: set[str] = set()
        for r in parsed.reqs:
            key = r.params.constraint_key
            if key is None or key in seen:
                continue
            seen.add(key)
            field_name = "regex" if r.params.regex is not None else "json_schema"
            try:
                pattern = constraint_regex(r.params.regex, r.params.json_schema)
            except ValueError as e:
                raise RequestError(f"unsupported JSON schema: {e}", field_name) from None
            if self.fsm_cache is None:
                self.fsm_cache = FSMCache(self.tokenizer, self._eos_id(),
                                          self.args.constrained_cache_size)
            fut = self.fsm_cache.get(pattern)
            try:
                fsm = await asyncio.wait_for(asyncio.wrap_future(fut),
                                             self.args.constrained_compile_timeout)
            except asyncio.TimeoutError:
                raise RequestError(
                    f"{field_name} took longer than {self.args.constrained_compile_timeout} s "
                    "to compile", field_name) from None
            except ValueError as e:
                raise RequestError(f"invalid {field_name}: {e}", field_name) from None
            if fsm.num_states > self.args.constrained_max_states:
                raise RequestError(
                    f"{field_name} compiles to {fsm.num_states} states (at most "
                    f"{self.args.constrained_max_states})", field_name)
            if not fsm.index.get_allowed_tokens(fsm.initial_state):
                raise RequestError(f"{field_name} admits no output", field_name)

    @property
    def served_model_name(self) -> str:
        return self.args.served_model_name or str(self.args.model_path)

    def check_model(self, model: Any) -> None:
        """`model` on /generate (SGLang's gateway sends it, often null), /tokenize and
        /detokenize: null, "default" or the served model's name (404 otherwise)."""
        if model is None or model in ("default", self.served_model_name):
            return
        if not isinstance(model, str):
            raise RequestError("model must be a string or null", "model", "invalid_type")
        raise RequestError(f"the model {model!r} does not exist; this server serves "
                           f"{self.served_model_name!r}", "model", "model_not_found", status=404)

    def _eos_id(self) -> int:
        eos = self.tokenizer.eos_token_id
        return int(eos) if eos is not None else self.limits.vocab_size

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
            raise RequestError(str(e), e.param, e.code) from None
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

    def _parse_images(self, raw: Any, prompt_ids: list[list[int]],
                      prompt_field: str) -> list[str | None]:
        """image_data (a string, or a list with one string or null per prompt) -> per prompt
        its image source. A prompt with an image holds the image token exactly once; one
        without holds none."""
        n = len(prompt_ids)
        if raw is None:
            sources: list[str | None] = [None] * n
        elif isinstance(raw, str) and n == 1:
            sources = [raw]
        elif isinstance(raw, list) and len(raw) == n and all(
                x is None or isinstance(x, str) for x in raw):
            sources = list(raw)
        else:
            raise RequestError("image_data must be a string (one prompt), or a list with one "
                               "string or null per prompt", "image_data", "invalid_type")
        token = self.limits.image_token_id
        if token is None:
            if any(x is not None for x in sources):
                raise RequestError("this model does not take images", "image_data",
                                   "unsupported")
            return sources
        name = self.tokenizer.convert_ids_to_tokens(token)
        for ids, src in zip(prompt_ids, sources):
            count = ids.count(token)
            if src is not None and src == "":
                raise RequestError("image_data must not be empty", "image_data")
            if src is not None and count != 1:
                raise RequestError(f"a prompt with an image must hold the image token {name!r} "
                                   f"exactly once (found {count})", prompt_field)
            if src is None and count:
                raise RequestError(f"the prompt holds the image token {name!r} but no "
                                   "image_data was given", prompt_field)
        return sources

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

    def _parse_logprobs(self, body: dict[str, Any],
                        prompt_lens: list[int]) -> list[LogprobOptions | None]:
        """The logprob fields (each a value, or a list with one per prompt) -> per prompt the
        options, or None where return_logprob is false."""
        n = len(prompt_lens)

        def per_prompt(name: str, default: Any) -> list[Any]:
            raw = body.get(name)
            if isinstance(raw, list):
                if len(raw) != n:
                    raise RequestError(f"{name} has {len(raw)} entries for {n} prompts", name)
                return [default if v is None else v for v in raw]
            return [default if raw is None else raw] * n

        def check_bool(name: str, v: Any) -> None:
            if not isinstance(v, bool):
                raise RequestError(f"{name} must be a boolean", name, "invalid_type")

        def check_int(name: str, v: Any, lo: int, hi: int) -> None:
            if isinstance(v, bool) or not isinstance(v, int):
                raise RequestError(f"{name} must be an integer", name, "invalid_type")
            if not lo <= v <= hi:
                raise RequestError(f"{name} must be in [{lo}, {hi}], got {v}", name)

        out: list[LogprobOptions | None] = []
        for length, ret, start, top, text in zip(
            prompt_lens, per_prompt("return_logprob", False), per_prompt("logprob_start_len", -1),
            per_prompt("top_logprobs_num", 0), per_prompt("return_text_in_logprobs", False),
        ):
            check_bool("return_logprob", ret)
            check_int("logprob_start_len", start, -1, length - 1)
            check_int("top_logprobs_num", top, 0, MAX_TOP_LOGPROBS)
            check_bool("return_text_in_logprobs", text)
            out.append(LogprobOptions(start, top, text) if ret else None)
        return out

    def _check_lengths(self, n_tokens: int, p: SamplingParams, prompt_field: str) -> None:
        """prompt + max_new_tokens must fit the context and the KV pool; the error names the
        prompt when the prompt alone does not fit, else max_new_tokens."""
        limits = [(self.limits.context_length, f"the context length {self.limits.context_length}",
                   "context_length_exceeded"),
                  (self.limits.max_total_num_tokens,
                   f"the KV cache capacity ({self.limits.max_total_num_tokens} tokens)",
                   "kv_capacity_exceeded")]
        for limit, what, code in limits:
            if n_tokens > limit:
                raise RequestError(f"the prompt has {n_tokens} tokens: it exceeds {what}",
                                   prompt_field, code)
            need = n_tokens + p.max_new_tokens
            if need > limit:
                raise RequestError(
                    f"the prompt has {n_tokens} tokens and max_new_tokens is "
                    f"{p.max_new_tokens}: {need} exceeds {what}", "max_new_tokens", code)

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
            )
            for r in parsed.reqs
        ]
        self.to_router.send_all(msgs)
        # No await in between: results cannot arrive before the states exist.
        for r in parsed.reqs:
            self.states[r.wire_rid] = ReqState(
                r.rid, r.parent_rid, logprobs=LogprobState() if r.logprob is not None else None)
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

    async def stream_results(self, rid: str) -> AsyncIterator[dict[str, Any]]:
        """Cumulative results of one sample, one per StrOut, until it finishes."""
        state = self.states[rid]
        try:
            while True:
                out: StrOut | _Failed = await state.queue.get()
                if isinstance(out, _Failed):
                    raise ServerFailure(out.reason)
                if self.observer is not None:
                    self.observer.on_output(rid, out)
                state.output_ids.extend(out.new_ids)
                if state.logprobs is not None:
                    state.logprobs.add(out)
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

    @staticmethod
    def result_dict(rid: str, out: StrOut, state: ReqState) -> dict[str, Any]:
        """The answer so far; every list in it is cumulative (streaming too)."""
        meta: dict[str, Any] = {
            "id": rid,
            "prompt_tokens": out.prompt_tokens,
            "completion_tokens": out.completion_tokens,
            "cached_tokens": out.cached_tokens,
            "finish_reason": out.finish_reason,
            "forward_passes": out.forward_passes,
        }
        if state.logprobs is not None:
            meta.update(state.logprobs.meta())
        return {"text": out.text, "output_ids": list(state.output_ids), "meta_info": meta}
