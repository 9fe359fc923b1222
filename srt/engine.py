"""`srt.Engine`: the serving runtime in-process, without HTTP.

    with srt.Engine(model_path="...", tp_size=2) as engine:
        outs = engine.generate(["Hello", "Hi"], {"max_new_tokens": 16})

It starts the same router, model and detokenizer processes as the server and talks to them
through a TokenizerManager whose event loop runs on a private thread, so `generate` is a plain
blocking call returning exactly what `POST /generate` returns (one dict, or a list of them for a
batch). Bad input raises `srt.managers.request_types.RequestError`; a dead child process
raises RuntimeError naming it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import threading
from typing import Any

from srt.launcher import Runtime, prepare_args, start_runtime
from srt.server_args import ServerArgs
from srt.utils import configure_logging

logger = logging.getLogger("srt.engine")


class Engine:
    def __init__(self, model_path: str | None = None, **server_args: Any) -> None:
        """Start the runtime; keyword arguments are ServerArgs fields (`tp_size`, `dtype`,
        `load_format`, ...). Blocks until every process is ready."""
        fields = {f.name for f in dataclasses.fields(ServerArgs)}
        unknown = sorted(set(server_args) - fields)
        if unknown:
            raise TypeError(f"unknown server argument {unknown[0]!r}")
        args = ServerArgs(model_path=model_path, **server_args)
        if not logging.getLogger().handlers:  # leave an application's logging alone
            configure_logging(args.log_level, "engine")
        self.args = prepare_args(args)
        self._rt: Runtime | None = start_runtime(self.args, "engine process")
        from srt.managers.tokenizer_manager import TokenizerManager

        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True,
                                        name="srt-engine-loop")
        self._thread.start()
        try:
            self.tm = self._call(self._make_tm(TokenizerManager))
        except BaseException:
            self.shutdown()
            raise

    async def _make_tm(self, cls: type) -> Any:
        assert self._rt is not None
        tm = cls(self.args, self._rt.ports, self._rt.limits)
        tm.on_loop_failure = tm.fail_all  # its result loop died: nothing more will arrive
        tm.start()
        return tm

    @property
    def model_info(self) -> dict[str, Any]:
        """What the model process reported at start-up (device, dtype, pool size, ...)."""
        if self._rt is None:
            raise RuntimeError("the engine is shut down")
        return dict(self._rt.model_info)

    def _call(self, coro: Any) -> Any:
        """Run a coroutine on the engine's loop; fail fast if a child process died."""
        fut = asyncio.run_coroutine_threadsafe(coro, self._loop)
        while True:
            try:
                return fut.result(timeout=0.5)
            except TimeoutError:
                failure = self._rt.supervisor.failure() if self._rt else None
                reason = failure.reason if failure is not None else None
                if reason is None and getattr(self, "tm", None) is not None:
                    reason = self.tm.failed
                if reason is not None:  # a process died or stalled (--watchdog-timeout)
                    fut.cancel()
                    raise RuntimeError(reason) from None

    def generate(self, prompt: str | list[str] | None = None,
                 sampling_params: dict[str, Any] | list[dict[str, Any]] | None = None,
                 input_ids: list[int] | list[list[int]] | None = None,
                 rid: str | list[str] | None = None,
                 **fields: Any) -> dict[str, Any] | list[dict[str, Any]]:
        """Like POST /generate with the same fields: text (`prompt`) or `input_ids`, a single
        prompt or a list; other /generate fields (`return_logprob`, `logprob_start_len`,
        `top_logprobs_num`, ...) as keywords. Returns the final result(s)."""
        if self._rt is None:
            raise RuntimeError("the engine is shut down")
        body: dict[str, Any] = dict(fields)
        if prompt is not None:
            body["text"] = prompt
        if input_ids is not None:
            body["input_ids"] = input_ids
        if sampling_params is not None:
            body["sampling_params"] = sampling_params
        if rid is not None:
            body["rid"] = rid
        return self._call(self._generate(body))

    async def _generate(self, body: dict[str, Any]) -> Any:
        parsed = self.tm.parse_generate_request(body)
        await self.tm.load_images(parsed)
        self.tm.submit(parsed)

        async def never() -> bool:
            return False

        results = await self.tm.wait_all(parsed, never)
        return results if parsed.is_batch else results[0]

    def flush_cache(self) -> bool:
        """Empty the radix cache, as POST /flush_cache; False (nothing done) while requests run."""
        return bool(self._call(self.tm.flush_cache()).success)

    def get_server_info(self) -> dict[str, Any]:
        """Live figures of rank 0's model process (KV pool, queues, cache hit rate)."""
        return self._call(self.tm.get_stats())

    def shutdown(self) -> None:
        """Stop every process; safe to call twice."""
        if self._rt is None:
            return
        rt, self._rt = self._rt, None
        asyncio.run_coroutine_threadsafe(self._close(), self._loop).result(timeout=5)
        rt.stop()
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=5)

    async def _close(self) -> None:
        if getattr(self, "tm", None) is not None:  # None when start-up failed
            await self.tm.close()
        tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()

    def __del__(self) -> None:
        try:
            self.shutdown()
        except Exception:  # interpreter shutdown: nothing sensible left to do
            pass
