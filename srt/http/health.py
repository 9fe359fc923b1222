"""Readiness: `/health_generate` runs a one-token greedy generation through the whole ring.

At most one probe is in flight: callers that arrive while one runs share its result. `/health`
stays the cheap liveness check (every process up and beating, srt/watchdog.py), with no
generation.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from typing import Any

from srt.managers.request_types import ServerFailure

logger = logging.getLogger("srt.http")


class ReadinessProbe:
    def __init__(self, tm: Any, supervisor: Any, timeout: float = 60.0) -> None:
        self.tm = tm
        self.supervisor = supervisor
        self.timeout = timeout
        self._probe: asyncio.Future | None = None

    async def check(self) -> tuple[bool, str]:
        """(ready, reason)."""
        if not self.supervisor.healthy():
            failure = self.supervisor.failure()
            return False, failure.reason if failure else "a process of the server is not running"
        if self._probe is None or self._probe.done():
            self._probe = asyncio.ensure_future(self._run())
        # shield: a caller that goes away must not cancel the probe the others wait on
        return await asyncio.shield(self._probe)

    async def _run(self) -> tuple[bool, str]:
        parsed = self.tm.parse_generate_request({
            "input_ids": [0], "rid": f"health-probe-{uuid.uuid4().hex}",
            "sampling_params": {"max_new_tokens": 0 if self.tm.args.is_embedding else 1,
                                "temperature": 0, "ignore_eos": True}})

        async def never_disconnected() -> bool:
            return False

        try:
            self.tm.submit(parsed)
            results = await asyncio.wait_for(self.tm.wait_all(parsed, never_disconnected),
                                             self.timeout)
        except asyncio.TimeoutError:
            return False, f"a one-token generation took longer than {self.timeout} s"
        except ServerFailure as e:
            return False, str(e)
        if not results or results[0]["meta_info"]["completion_tokens"] != 1:
            return False, "the one-token generation did not complete"
        return True, "ok"
