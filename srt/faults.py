"""Fault injection, for testing how the server fails: `SRT_FAULT=<process>:<kind>[:<after>]`.

    process  http | router | detokenizer | model<k> (TP rank k; `model` means model0)
    kind     raise  an exception escapes the process's loop
             exit   the process ends at once with status FAULT_EXIT_CODE (os._exit, no clean-up)
             stall  the process sleeps forever in its loop, holding its work
    after    units of work done normally before the fault fires (default 0: the first one)

A unit of work is, per process: http, one batch of results reaching the TokenizerManager's
result loop; router, one scheduling round while requests are in flight; model<k>, one round
while the rank holds or receives requests; detokenizer, one batch of token ids.

The variable is read once, by `ServerArgs.resolve`, and travels to the children in the args.
Without it every `FaultPoint.tick` is a no-op.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass

logger = logging.getLogger("srt.faults")

PROCESSES = ("http", "router", "detokenizer", "model")
KINDS = ("raise", "exit", "stall")
FAULT_EXIT_CODE = 3


class InjectedFault(RuntimeError):
    """Raised by a `raise` fault."""


@dataclass(frozen=True)
class FaultSpec:
    process: str  # "http", "router", "detokenizer" or "model<k>"
    kind: str
    after: int = 0

    @classmethod
    def parse(cls, text: str) -> "FaultSpec":
        """ValueError naming the problem for anything but `<process>:<kind>[:<after>]`."""
        parts = text.strip().split(":")
        if len(parts) not in (2, 3):
            raise ValueError(f"SRT_FAULT={text!r}: expected <process>:<kind>[:<after>]")
        process, kind = parts[0], parts[1]
        if process == "model":
            process = "model0"
        base = process.rstrip("0123456789")
        if base not in PROCESSES or (base != "model" and base != process):
            raise ValueError(f"SRT_FAULT={text!r}: process must be one of http, router, "
                             "detokenizer, model<k>")
        if kind not in KINDS:
            raise ValueError(f"SRT_FAULT={text!r}: kind must be one of {', '.join(KINDS)}")
        after = 0
        if len(parts) == 3:
            if not parts[2].isdigit():
                raise ValueError(f"SRT_FAULT={text!r}: after must be a non-negative integer")
            after = int(parts[2])
        return cls(process, kind, after)


class FaultPoint:
    """One process's fault: `tick()` once per unit of work; the fault fires at unit after + 1."""

    def __init__(self, spec: FaultSpec | None) -> None:
        self.spec = spec
        self.done = 0

    def tick(self) -> None:
        spec = self.spec
        if spec is None:
            return
        if self.done < spec.after:
            self.done += 1
            return
        self.spec = None  # fire once (a `raise` caught by a caller must not fire again)
        logger.error("injected fault: %s %s after %d unit(s) of work", spec.process, spec.kind,
                     spec.after)
        if spec.kind == "raise":
            raise InjectedFault(f"injected fault in the {spec.process} process")
        if spec.kind == "exit":
            logging.shutdown()
            os._exit(FAULT_EXIT_CODE)
        while True:  # stall: hold the work, make no progress, never return
            time.sleep(3600)


def fault_point(spec_text: str | None, process: str) -> FaultPoint:
    """The fault for `process` ("http", "router", "detokenizer", "model<k>"), if one is set."""
    if not spec_text:
        return FaultPoint(None)
    spec = FaultSpec.parse(spec_text)
    return FaultPoint(spec if spec.process == process else None)
