"""The HTTP process's life after start-up: serving, draining on SIGTERM, failing on a crash.

    serving --SIGTERM/SIGINT--> draining --in flight done, or --shutdown-timeout--> exit 0
    serving | draining --a process died or stalled--> failed --> exit 1

While draining, every route but /metrics answers 503 `shutting_down` and the requests in flight
go on; at the timeout the rest are aborted through the ring (their answers finish with type
"abort"). Once failed, every route but /metrics answers 503 `server_failed`, the requests in
flight end with that error (`TokenizerManager.fail_all`), the children are stopped and the
process exits 1. A second SIGTERM/SIGINT while draining stops at once.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import threading
from typing import Any, Callable

from srt.http.errors import send_error
from srt.watchdog import IDLE_BEAT_S, Heartbeat

logger = logging.getLogger("srt.http")

# Routes still served while draining or failed (scrapers see the last figures).
EXEMPT_PATHS = frozenset({"/metrics"})
# After aborting what is left at the drain timeout: how long the aborted answers may take to
# come back through the ring before they are failed locally.
ABORT_GRACE_S = 5.0


class Phase(enum.Enum):
    SERVING = "serving"
    DRAINING = "draining"
    FAILED = "failed"


class Lifecycle:
    """The phase, changed from signal handlers, the supervisor thread and the event loop (each
    change is one attribute store under a lock)."""

    def __init__(self) -> None:
        self.phase = Phase.SERVING
        self.reason = ""
        self._lock = threading.Lock()

    def start_draining(self) -> bool:
        """serving -> draining; False in any other phase."""
        with self._lock:
            if self.phase is not Phase.SERVING:
                return False
            self.phase, self.reason = Phase.DRAINING, "the server is shutting down"
            return True

    def fail(self, reason: str) -> bool:
        """-> failed; False if it had already failed (the first reason is kept)."""
        with self._lock:
            if self.phase is Phase.FAILED:
                return False
            self.phase, self.reason = Phase.FAILED, reason
            return True

    def refusal(self) -> tuple[str, str] | None:
        """(message, code) of the 503 every route answers now, or None while serving."""
        phase = self.phase
        if phase is Phase.SERVING:
            return None
        code = "shutting_down" if phase is Phase.DRAINING else "server_failed"
        return self.reason, code


class LifecycleGate:
    """ASGI middleware: once the server is not serving, every route but EXEMPT_PATHS is a 503.
    It sits inside AuthMiddleware, so the path it compares is the normalized one."""

    def __init__(self, app: Any, lifecycle: Lifecycle) -> None:
        self.app = app
        self.lifecycle = lifecycle

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope.get("path") not in EXEMPT_PATHS:
            refusal = self.lifecycle.refusal()
            if refusal is not None:
                message, code = refusal
                await send_error(send, 503, message, None, code, {"Connection": "close"})
                return
        await self.app(scope, receive, send)


async def beat_forever(heartbeat: Heartbeat) -> None:
    """The event loop's heartbeat: stops when the loop is blocked (a stall)."""
    while True:
        heartbeat.beat()
        await asyncio.sleep(IDLE_BEAT_S)


async def drain(tm: Any, timeout: float) -> None:
    """Let the requests in flight finish for up to `timeout` seconds, then abort the rest
    through the ring and wait (ABORT_GRACE_S at most) until each got its answer."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    if tm.states:
        logger.info("draining: %d request(s) in flight, up to %g s", len(tm.states), timeout)
    while tm.states and loop.time() < deadline:
        await asyncio.sleep(0.05)
    if not tm.states:
        return
    n = tm.abort_all("aborted: the server is shutting down")
    logger.warning("shutdown timeout (%g s): aborted %d request(s)", timeout, n)
    deadline = loop.time() + ABORT_GRACE_S
    while tm.states and loop.time() < deadline:
        await asyncio.sleep(0.05)
    if tm.states:
        tm.fail_all("the server is shutting down")


def make_graceful_server(config: Any, on_first_signal: Callable[[int], None]) -> Any:
    """A uvicorn Server whose first SIGTERM/SIGINT calls on_first_signal (which drains and
    later sets `should_exit`) instead of closing the listener at once; a second one stops now."""
    import uvicorn

    class GracefulServer(uvicorn.Server):
        draining = False

        def handle_exit(self, sig: int, frame: Any) -> None:
            if self.draining:
                logger.warning("second stop signal: stopping now")
                self.should_exit = True
                self.force_exit = True
                return
            self.draining = True
            on_first_signal(sig)

    return GracefulServer(config)
