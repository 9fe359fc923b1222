"""`--log-requests`: each request's body and each sample's output text in the log.

Off by default: then no prompt, output or other request content is ever logged. On, the content
is written as JSON with every non-ASCII and control character escaped (one line per record,
nothing a client sends can forge a line), cut at `MAX_LOGGED_CHARS`. Headers, and with them any
key, are never logged.
"""

from __future__ import annotations

import json
import logging
from typing import Any

from srt.managers.io_struct import StrOut

logger = logging.getLogger("srt.requests")

MAX_LOGGED_CHARS = 4096


def _clip(value: Any) -> str:
    try:
        text = json.dumps(value, ensure_ascii=True)
    except (TypeError, ValueError, RecursionError):
        text = json.dumps(repr(value), ensure_ascii=True)
    if len(text) > MAX_LOGGED_CHARS:
        text = text[:MAX_LOGGED_CHARS] + f"... ({len(text)} chars)"
    return text


class RequestLog:
    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled

    def received(self, endpoint: str, body: Any) -> None:
        if self.enabled:
            logger.info("request %s %s", endpoint, _clip(body))

    # request observer (TokenizerManager)
    def on_submit(self, rid: str, stream: bool) -> None:
        pass

    def on_output(self, rid: str, out: StrOut, text: str) -> None:
        if self.enabled and out.finish_reason is not None:
            logger.info("output %s %s finish=%s", rid, _clip(text), _clip(out.finish_reason))

    def on_done(self, rid: str) -> None:
        pass


class Observers:
    """Fans the TokenizerManager's request events out to several observers."""

    def __init__(self, *observers: Any) -> None:
        self.observers = [o for o in observers if o is not None]

    def on_submit(self, rid: str, stream: bool) -> None:
        for o in self.observers:
            o.on_submit(rid, stream)

    def on_output(self, rid: str, out: StrOut, text: str) -> None:
        for o in self.observers:
            o.on_output(rid, out, text)

    def on_done(self, rid: str) -> None:
        for o in self.observers:
            o.on_done(rid)
