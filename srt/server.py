"""The HTTP process: launches the other processes, supervises them, and serves the API.

    python -m srt.server [--model-path DIR] [--port 30000] ...

Start-up: the router, one model process per TP rank and the detokenizer are spawned; each reports
ready (or its traceback) over a pipe; only then does the HTTP server answer. If any child dies the
server logs which one and why and exits non-zero, leaving no process behind. Ctrl-C and SIGTERM
stop everything.

This process never imports the model runner, layers, models or kernels.
"""

import contextlib
import dataclasses
import json
import logging
import multiprocessing as mp
import os
import shutil
import signal
import sys
import threading
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any, AsyncIterator, Callable

from srt.server_args import PortArgs, ServerArgs
from srt.utils import configure_logging, describe_exit

logger = logging.getLogger("srt.server")


@dataclass
class Child:
    name: str
    process: mp.process.BaseProcess
    ready: Connection


class Supervisor:
    """Owns the child processes: start, wait for ready, watch, stop."""

    def __init__(self) -> None:
        self.children: list[Child] = []
        self.stopping = False
        self.all_ready = False

    def start(self, name: str, target: Callable[..., None], *args: Any) -> None:
        ctx = mp.get_context("spawn")
        reader, writer = ctx.Pipe(duplex=False)
        proc = ctx.Process(target=target, args=(*args, os.getpid(), writer), name=name,
                           daemon=False)
        proc.start()
        writer.close()
        self.children.append(Child(name, proc, reader))

    def wait_ready(self) -> dict[str, dict[str, Any]]:
        """Block until every child reported ready; raise with the child's traceback otherwise."""
        infos: dict[str, dict[str, Any]] = {}
        pending = list(self.children)
        while pending:
            for child in list(pending):
                if child.ready.poll(0.1):
                    try:
                        status, payload = child.ready.recv()
                    except EOFError:
                        status, payload = "error", "it exited before reporting ready"
                    if status != "ready":
                        raise RuntimeError(f"the {child.name} failed to start:\n{payload}")
                    infos[child.name] = payload
                    pending.remove(child)
                elif not child.process.is_alive():
                    raise RuntimeError(
                        f"the {child.name} died during start-up "
                        f"({describe_exit(child.process.exitcode)})"
                    )
        self.all_ready = True
        return infos

    def alive(self) -> bool:
        return all(c.process.is_alive() for c in self.children)

    def watch(self, on_death: Callable[[Child], None], interval: float = 0.5) -> None:
        def run() -> None:
            while not self.stopping:
                for child in self.children:
                    if not child.process.is_alive() and not self.stopping:
                        on_death(child)
                        return
                time.sleep(interval)

        threading.Thread(target=run, daemon=True, name="supervisor").start()

    def stop(self, timeout: float = 5.0) -> None:
        self.stopping = True
        for c in self.children:
            if c.process.is_alive():
                c.process.terminate()
        deadline = time.monotonic() + timeout
        for c in self.children:
            c.process.join(max(0.0, deadline - time.monotonic()))
            if c.process.is_alive():
                c.process.kill()
                c.process.join(1.0)


def _error(status: int, message: str, param: str | None, code: str) -> Any:
    from fastapi.responses import JSONResponse

    return JSONResponse(
        status_code=status,
        content={"error": {"message": message, "type": "invalid_request_error" if status < 500
                           else "server_error", "param": param, "code": code}},
    )


def create_app(args: ServerArgs, tm: Any, supervisor: Supervisor) -> Any:
    from contextlib import asynccontextmanager

    from fastapi import FastAPI, Request
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse, StreamingResponse
    from starlette.exceptions import HTTPException as StarletteHTTPException

    from srt.managers.openai_api import OpenAIAdapter
    from srt.managers.tokenizer_manager import RequestError

    chat_template = None
    if args.chat_template:
        with open(args.chat_template) as f:
            chat_template = f.read()

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        tm.start()
        yield

    app = FastAPI(title="srt", lifespan=lifespan)

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError) -> Any:
        return _error(400, str(exc), None, "invalid_request")

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> Any:
        return _error(exc.status_code, str(exc.detail), None, "http_error")

    @app.exception_handler(RequestError)
    async def _request_error(_: Request, exc: RequestError) -> Any:
        return _error(exc.status, str(exc), exc.param, exc.code)

    async def read_json(request: Request) -> Any:
        raw = await request.body()
        try:
            return json.loads(raw)
        except (ValueError, RecursionError) as e:  # JSONDecodeError and UnicodeDecodeError too
            raise RequestError(f"malformed JSON body: {e}", None, "invalid_json") from None

    @app.get("/health")
    async def health() -> Any:
        if supervisor.all_ready and supervisor.alive():
            return JSONResponse({"status": "ok"})
        return JSONResponse({"status": "unavailable"}, status_code=503)

    @app.get("/get_model_info")
    async def get_model_info() -> Any:
        return {"model_path": args.model_path, "tokenizer_path": args.tokenizer_path,
                "is_generation": True}

    @app.get("/get_server_info")
    async def get_server_info() -> Any:
        return {**dataclasses.asdict(args), **(await tm.get_stats())}

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

    openai = OpenAIAdapter(tm, args.served_model_name or str(args.model_path), chat_template)

    @app.get("/v1/models")
    async def v1_models() -> Any:
        return openai.models()

    @app.post("/v1/completions")
    async def v1_completions(request: Request) -> Any:
        parsed, c = openai.parse_completion(await read_json(request))
        return await _openai_answer(request, parsed, c, chat=False)

    @app.post("/v1/chat/completions")
    async def v1_chat_completions(request: Request) -> Any:
        parsed, c = openai.parse_chat(await read_json(request))
        return await _openai_answer(request, parsed, c, chat=True)

    async def _openai_answer(request: Request, parsed: Any, c: dict[str, Any], chat: bool) -> Any:
        tm.submit(parsed)
        if c["stream"]:
            return StreamingResponse(openai.stream(parsed, c, chat, request.is_disconnected),
                                     media_type="text/event-stream")
        answer = await (openai.chat if chat else openai.completion)(
            parsed, c, request.is_disconnected)
        if answer is None:
            return JSONResponse({"status": "client disconnected"}, status_code=499)
        return answer

    @app.post("/generate")
    async def generate(request: Request) -> Any:
        parsed = tm.parse_generate_request(await read_json(request))
        tm.submit(parsed)
        if parsed.stream:
            return StreamingResponse(_sse(request, parsed), media_type="text/event-stream")
        return await _collect(request, parsed)

    async def _collect(request: Request, parsed: Any) -> Any:
        results = await tm.wait_all(parsed, request.is_disconnected)
        if results is None:
            return JSONResponse({"status": "client disconnected"}, status_code=499)
        return results if parsed.is_batch else results[0]

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


def launch_server(args: ServerArgs) -> int:
    """Start everything and serve until stopped. Returns the process exit code."""
    configure_logging(args.log_level, "http")
    if args.model_path is None:
        from srt.default_model import ensure_default_model

        args = dataclasses.replace(args, model_path=ensure_default_model())
    args = args.resolve()
    from srt.model_config import check_tp_size

    try:
        check_tp_size(args.model_path, args.tp_size)
    except (OSError, ValueError) as e:
        logger.error("%s", e)
        return 2
    logger.info("starting srt: model %s, tp_size %d", args.model_path, args.tp_size)

    from srt.managers.detokenizer_manager import run_detokenizer_process
    from srt.managers.router.manager import run_router_process
    from srt.managers.router.model_rpc import run_model_process
    from srt.managers.tokenizer_manager import ModelLimits, TokenizerManager

    ports = PortArgs.create(args.tp_size)
    supervisor = Supervisor()
    try:
        for rank in range(args.tp_size):
            supervisor.start(f"model process (TP rank {rank})", run_model_process, args, ports,
                             rank)
        supervisor.start("router process", run_router_process, args, ports)
        supervisor.start("detokenizer process", run_detokenizer_process, args, ports)
        infos = supervisor.wait_ready()
    except (RuntimeError, KeyboardInterrupt) as e:
        logger.error("%s", e)
        supervisor.stop()
        shutil.rmtree(ports.ipc_dir, ignore_errors=True)
        return 1

    model = infos["model process (TP rank 0)"]
    limits = ModelLimits(model["context_length"], model["vocab_size"],
                         model["max_total_num_tokens"])
    tm = TokenizerManager(args, ports, limits)

    def on_death(child: Child) -> None:
        logger.error("the %s died (%s); shutting the server down", child.name,
                     describe_exit(child.process.exitcode))
        supervisor.stop()
        shutil.rmtree(ports.ipc_dir, ignore_errors=True)
        logging.shutdown()
        os._exit(1)

    supervisor.watch(on_death)
    app = create_app(args, tm, supervisor)

    import uvicorn

    logger.info("ready: serving on http://%s:%d", args.host, args.port)
    # uvicorn handles SIGINT/SIGTERM itself, then re-raises the signal into the handlers it found:
    # make those record the stop instead of killing us before the children are stopped.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda signum, _frame: logger.info(
            "received %s, stopping", signal.Signals(signum).name))
    try:
        uvicorn.run(app, host=args.host, port=args.port, log_level="warning",
                    timeout_graceful_shutdown=3)
    finally:
        supervisor.stop()
        shutil.rmtree(ports.ipc_dir, ignore_errors=True)
    logger.info("stopped")
    return 0


def main(argv: list[str] | None = None) -> None:
    args = ServerArgs.from_cli(argv)
    try:
        args.validate()
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    sys.exit(launch_server(args))


if __name__ == "__main__":
    main()
