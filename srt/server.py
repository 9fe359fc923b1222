"""The HTTP process: launches the other processes, supervises them, and serves the API.

    python -m srt.server [--model-path DIR] [--port 30000] ...

Start-up: the router, one model process per TP rank and the detokenizer are spawned; each reports
ready (or its traceback) over a pipe; only then does the HTTP server answer. If any process dies or
stalls (srt/watchdog.py) the server fails the requests in flight, logs which one and why and exits
1, leaving no process behind. SIGTERM and Ctrl-C drain: new requests get 503, those in flight get
--shutdown-timeout to finish, then everything stops with status 0 (srt/http/lifecycle.py).

This process never imports the model runner, layers, models or kernels.
"""

import asyncio
import contextlib
import dataclasses
import json
import logging
import os
import signal
import sys
import threading
import time
from typing import Any, AsyncIterator, Callable

from srt.gc_watch import settle_process
from srt.launcher import Failure, Supervisor, prepare_args, start_runtime
from srt.server_args import ServerArgs
from srt.utils import configure_logging

logger = logging.getLogger("srt.server")


def _error(status: int, message: str, param: str | None, code: str) -> Any:
    from srt.http.errors import error_response

    return error_response(status, message, param, code)


def create_app(args: ServerArgs, tm: Any, supervisor: Supervisor, lifecycle: Any,
               on_loop: Callable[[Any], None] = lambda _: None) -> Any:
    """The FastAPI app. on_loop(loop) is called once the event loop runs (at app start-up)."""
    from contextlib import asynccontextmanager

    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse, StreamingResponse

    from srt.http import layer as http_layer
    from srt.http.errors import error_event
    from srt.http.lifecycle import beat_forever
    from srt.managers import embeddings_api, tokenize_api
    from srt.managers.openai_api import OpenAIAdapter
    from srt.managers.request_types import RequestError, ServerFailure
    from srt.watchdog import Heartbeat

    from srt.chat_templates import load_template

    chat_template = load_template(args.chat_template) if args.chat_template else None

    heartbeat = Heartbeat()
    supervisor.add_loop("HTTP process", heartbeat)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        tm.start()
        beat = asyncio.ensure_future(beat_forever(heartbeat))
        on_loop(asyncio.get_running_loop())
        yield
        beat.cancel()

    app = FastAPI(title="srt", lifespan=lifespan)
    # error envelope, auth, limits, metrics, lifecycle gate, /health_generate, /metrics
    http = http_layer.install(app, args, tm, supervisor, lifecycle)

    async def read_json(request: Request) -> Any:
        raw = await request.body()
        try:
            return json.loads(raw)
        except (ValueError, RecursionError) as e:  # JSONDecodeError and UnicodeDecodeError too
            raise RequestError(f"malformed JSON body: {e}", None, "invalid_json") from None

    @app.get("/health")
    async def health() -> Any:
        # Liveness only: no model work, no message to another process (the lifecycle gate
        # answers while draining or failed).
        if supervisor.healthy():
            return JSONResponse({"status": "ok"})
        failure = supervisor.failure()
        return _error(503, failure.reason if failure else "the server is not running", None,
                      "unhealthy")

    # SGLang's current names (/model_info, /server_info) and the older get_ forms.
    @app.get("/model_info")
    @app.get("/get_model_info")
    async def get_model_info() -> Any:
        return {"model_path": args.model_path, "tokenizer_path": args.tokenizer_path,
                "is_generation": True}

    @app.get("/server_info")
    @app.get("/get_server_info")
    async def get_server_info() -> Any:
        return {**http.public_args(), **(await tm.get_stats())}

    @app.post("/flush_cache")
    async def flush_cache() -> Any:
        out = await tm.flush_cache()
        if out.success:
            return {"success": True, "message": out.message}
        return _error(409, out.message, None, "busy")

    @app.post("/abort_request")
    async def abort_request(request: Request) -> Any:
        body = await read_json(request)
        rid = body.get("rid") if isinstance(body, dict) else None
        if not isinstance(rid, str) or not rid:
            raise RequestError("rid must be a non-empty string", "rid", "invalid_type")
        n = tm.abort_by_client_rid(rid, "aborted by /abort_request")
        if n == 0:
            return _error(404, f"no request with rid {rid!r} is running", "rid", "rid_not_found")
        return {"aborted": n}

    # LoRA adapters, live: SGLang's routes and vLLM's /v1/ forms (admin routes)
    @app.post("/load_lora_adapter")
    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(request: Request) -> Any:
        body = await read_json(request)
        body = body if isinstance(body, dict) else {}
        return _lora_answer(await tm.load_lora_adapter(body.get("lora_name"),
                                                       body.get("lora_path")), "lora_path")

    @app.post("/unload_lora_adapter")
    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(request: Request) -> Any:
        body = await read_json(request)
        body = body if isinstance(body, dict) else {}
        return _lora_answer(await tm.unload_lora_adapter(body.get("lora_name")), "lora_name")

    def _lora_answer(out: Any, param: str) -> Any:
        """SGLang's answer (success, the adapters loaded); a failure is a 400 that says why."""
        if not out.success:
            raise RequestError(out.message, param)
        loaded = {r.name: r.path for r in tm.loras.ready()} if tm.loras is not None else {}
        return {"success": True, "message": out.message, "loaded_adapters": loaded}

    openai = OpenAIAdapter(tm, args.served_model_name or str(args.model_path), chat_template,
                           args.tool_call_parser, args.reasoning_parser)

    @app.get("/v1/models")
    async def v1_models() -> Any:
        return openai.cards.models()

    @app.get("/v1/models/{model_id:path}")
    async def v1_model(model_id: str) -> Any:
        return openai.cards.model_card(model_id)

    @app.post("/tokenize")
    async def tokenize(request: Request) -> Any:
        return tokenize_api.tokenize(openai, await read_json(request))

    @app.post("/detokenize")
    async def detokenize(request: Request) -> Any:
        return tokenize_api.detokenize(openai, await read_json(request))

    def _serves(embeddings: bool, route: str) -> None:
        """A route of the other kind of server is a 400 that says which flag makes it."""
        if args.is_embedding != embeddings:
            raise RequestError(
                f"{route} is not served: this server serves "
                + ("embeddings (started with --is-embedding: POST /v1/embeddings, /encode)"
                   if args.is_embedding else "generated text (start it with --is-embedding "
                   "for embeddings)"), None, "unsupported_route")

    async def _embeddings(request: Request, body: dict[str, Any]) -> Any:
        http.admit("/generate", body)
        parsed = tm.parse_generate_request(body)
        tm.submit(parsed)
        return parsed, await tm.wait_all(parsed, request.is_disconnected)

    @app.post("/encode")
    async def encode(request: Request) -> Any:
        _serves(True, "/encode")
        parsed, results = await _embeddings(request, embeddings_api.encode_body(
            await read_json(request)))
        if results is None:
            return JSONResponse({"status": "client disconnected"}, status_code=499)
        return results if parsed.is_batch else results[0]

    @app.post("/v1/embeddings")
    async def v1_embeddings(request: Request) -> Any:
        _serves(True, "/v1/embeddings")
        body, _, fmt, dims = embeddings_api.openai_body(await read_json(request), openai.model)
        _, results = await _embeddings(request, body)
        if results is None:
            return JSONResponse({"status": "client disconnected"}, status_code=499)
        return embeddings_api.openai_answer(results, openai.model, fmt, dims)

    @app.post("/v1/completions")
    async def v1_completions(request: Request) -> Any:
        _serves(False, "/v1/completions")
        body = await read_json(request)
        http.admit("/v1/completions", body)
        parsed, c = openai.parse_completion(body)
        return await _openai_answer(request, parsed, c, chat=False)

    @app.post("/v1/chat/completions")
    async def v1_chat_completions(request: Request) -> Any:
        _serves(False, "/v1/chat/completions")
        body = await read_json(request)
        http.admit("/v1/chat/completions", body)
        parsed, c = openai.parse_chat(body)
        return await _openai_answer(request, parsed, c, chat=True)

    async def _openai_answer(request: Request, parsed: Any, c: dict[str, Any], chat: bool) -> Any:
        await tm.check_constraints(parsed)
        await openai.load_images(parsed)
        tm.submit(parsed)
        if c["stream"]:
            return StreamingResponse(
                _until_failure(openai.stream(parsed, c, chat, request.is_disconnected)),
                media_type="text/event-stream")
        answer = await (openai.chat if chat else openai.completion)(
            parsed, c, request.is_disconnected)
        if answer is None:
            return JSONResponse({"status": "client disconnected"}, status_code=499)
        return answer

    @app.post("/generate")
    async def generate(request: Request) -> Any:
        _serves(False, "/generate")
        body = await read_json(request)
        http.admit("/generate", body)
        parsed = tm.parse_generate_request(body)
        await tm.check_constraints(parsed)
        await tm.load_images(parsed)
        tm.submit(parsed)
        if parsed.stream:
            return StreamingResponse(_until_failure(_sse(request, parsed)),
                                     media_type="text/event-stream")
        return await _collect(request, parsed)

    async def _collect(request: Request, parsed: Any) -> Any:
        results = await tm.wait_all(parsed, request.is_disconnected)
        if results is None:
            return JSONResponse({"status": "client disconnected"}, status_code=499)
        return results if parsed.is_batch else results[0]

    async def _until_failure(events: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
        """A stream's events; if the server fails meanwhile, one error event ends it (no
        [DONE])."""
        try:
            async with contextlib.aclosing(events) as items:
                async for event in items:
                    yield event
        except ServerFailure as e:
            yield error_event(503, str(e), None, "server_failed")

    async def _sse(request: Request, parsed: Any) -> AsyncIterator[bytes]:
        # aclosing: when the client goes away this generator is closed, and the inner one must
        # be closed (aborting its requests) now, not whenever it is garbage-collected.
        async with contextlib.aclosing(tm.stream_all(parsed, request.is_disconnected)) as items:
            async for index, item in items:
                if parsed.is_batch:
                    item["index"] = index
                yield f"data: {json.dumps(item, ensure_ascii=False)}\n\n".encode()
        yield b"data: [DONE]\n\n"

    return app


# After a failure: how long the failed requests' answers get to leave before the process exits.
FAILURE_FLUSH_S = 3.0


def launch_server(args: ServerArgs) -> int:
    """Start everything and serve until stopped. Returns the process exit code: 0 after a
    SIGTERM/SIGINT, 1 after a failure (a process died or stalled), 2 for a bad configuration."""
    configure_logging(args.log_level, "http")
    try:
        args = prepare_args(args)
    except (OSError, ValueError) as e:
        logger.error("%s", e)
        return 2
    from srt.http.listen import bind_listeners

    try:  # the port first: a taken one fails now, not after the model load
        listeners = bind_listeners(args.host, args.port)
    except OSError as e:
        logger.error("%s", e)
        return 2
    if args.port == 0:  # the port the kernel picked, for the logs and /get_server_info
        args = dataclasses.replace(args, port=listeners[0].getsockname()[1])
    try:
        return _launch(args, listeners)
    finally:
        for sock in listeners:
            sock.close()


def _launch(args: ServerArgs, listeners: list[Any]) -> int:
    """launch_server past the port's claim: serves on `listeners` (bound sockets)."""
    try:
        rt = start_runtime(args, "HTTP process")
    except (RuntimeError, KeyboardInterrupt) as e:
        logger.error("%s", e)
        return 1
    supervisor, ports = rt.supervisor, rt.ports
    from srt.http.lifecycle import Lifecycle
    from srt.managers.tokenizer_manager import TokenizerManager

    try:
        tm = TokenizerManager(args, ports, rt.limits)
    except (OSError, ValueError) as e:  # e.g. a LLaVA model without its preprocessor config
        logger.error("%s", e)
        rt.stop()
        return 2

    lifecycle = Lifecycle()
    loop_box: list[asyncio.AbstractEventLoop] = []  # the event loop, once it runs

    def on_failure(failure: Failure) -> None:
        """From the supervisor thread (or a thread of the event loop's): fail the requests in
        flight, dump every stack if something stalled, stop everything, exit 1."""
        reason = failure.reason
        if not lifecycle.fail(reason):
            return
        logger.error("shutting the server down: %s", reason)
        in_flight: list[asyncio.Task] = []  # the HTTP exchanges open when it failed

        def fail_on_loop() -> None:
            tm.fail_all(reason)
            in_flight.extend(getattr(getattr(server, "server_state", None), "tasks", ()))

        if loop_box:
            loop_box[0].call_soon_threadsafe(fail_on_loop)
        if failure.stalled:  # where is everyone? (before anything is stopped)
            supervisor.dump_stacks()
        deadline = time.monotonic() + FAILURE_FLUSH_S
        while tm.states and time.monotonic() < deadline:  # len() of a dict: thread-safe
            time.sleep(0.05)
        # Each open exchange ends once its error answer (or a stream's error event and final
        # chunk) is handed to its socket; a busy event loop can take a while to get there.
        while any(not t.done() for t in list(in_flight)) and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.2)  # the last error answers leave their sockets
        rt.stop()
        logging.shutdown()
        os._exit(1)

    tm.on_loop_failure = lambda reason: threading.Thread(
        target=on_failure, args=(Failure(reason, stalled=False),), daemon=True).start()
    supervisor.watch(on_failure)
    try:
        server = _http_server(args, tm, supervisor, lifecycle, loop_box)
    except Exception:  # e.g. a broken web framework install: never hang with children up
        logger.exception("the HTTP server could not be set up")
        rt.stop()
        return 1
    settle_process(args.gc_warning_threshold_secs, "http")
    logger.info("ready: serving on http://%s:%d", args.host, args.port)
    try:
        server.run(sockets=listeners)
    finally:
        rt.stop()
    logger.info("stopped")
    return 0


def _http_server(args: ServerArgs, tm: Any, supervisor: Any, lifecycle: Any,
                 loop_box: list[asyncio.AbstractEventLoop]) -> Any:
    """The app and the uvicorn server that drains on the first SIGTERM / SIGINT."""
    from srt.http.lifecycle import drain, make_graceful_server

    app = create_app(args, tm, supervisor, lifecycle, on_loop=loop_box.append)

    import uvicorn

    # log_config=None: uvicorn's records go through our handler, which escapes control
    # characters (srt/logsafe.py); no access log (it would carry paths and clients).
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level="warning",
                            log_config=None, access_log=False, server_header=False,
                            timeout_graceful_shutdown=3)

    async def drain_then_exit() -> None:
        await drain(tm, args.shutdown_timeout)
        server.should_exit = True

    def on_signal(signum: int) -> None:
        logger.info("received %s: refusing new requests, draining (up to %g s)",
                    signal.Signals(signum).name, args.shutdown_timeout)
        if not lifecycle.start_draining():  # failing already: that path exits
            return
        loop = loop_box[0] if loop_box else None
        if loop is None:  # not serving yet
            server.should_exit = True
            return
        loop.call_soon_threadsafe(lambda: loop.create_task(drain_then_exit()))

    server = make_graceful_server(config, on_signal)
    return server


def main(argv: list[str] | None = None) -> None:
    args = ServerArgs.from_cli(argv)
    try:
        args.validate()
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    if args.node_rank > 0:  # another machine's ranks only: no HTTP server (srt/node_worker.py)
        from srt.node_worker import run_node

        sys.exit(run_node(args))
    sys.exit(launch_server(args))


if __name__ == "__main__":
    main()
