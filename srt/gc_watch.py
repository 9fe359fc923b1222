"""Python's cyclic garbage collector in a long-running server process.

A full (generation 2) collection walks every container object the process holds. After torch,
transformers, Triton and a model are loaded that is hundreds of thousands to millions of
objects: 0.1 s on a laptop-class CPU and more on a process that compiled kernels and captured
graphs. Python starts one whenever the objects that survived younger collections grow by a
quarter of the old ones, which in a busy scheduler loop happens every few seconds; while it
runs the process stands still, so every stream it serves misses a token at the same moment.

`freeze_heap()` moves everything alive at the end of start-up into the permanent generation,
which collections never walk (`gc.freeze`), so later full collections only see what the
process allocated since. `GcWatch` times each collection through `gc.callbacks`, keeps counts
and pauses per generation for `/get_server_info`, and logs a warning for a pause over the
threshold (SGLang's `--gc-warning-threshold-secs`; 0 turns the warning off).
"""

from __future__ import annotations

import gc
import logging
import time
from dataclasses import dataclass, field
from typing import Any

logger = logging.getLogger(__name__)


def freeze_heap() -> int:
    """Collect once, then freeze every surviving object; returns how many are frozen."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


@dataclass
class GcWatch:
    """Counts and times the collections of this process (install() once per process)."""

    threshold_s: float = 0.0
    name: str = ""
    collections: list[int] = field(default_factory=lambda: [0, 0, 0])
    pause_s: list[float] = field(default_factory=lambda: [0.0, 0.0, 0.0])
    max_pause_s: float = 0.0
    warnings: int = 0

    def __post_init__(self) -> None:
        self._t0 = 0.0

    def install(self) -> "GcWatch":
        gc.callbacks.append(self._callback)
        return self

    def uninstall(self) -> None:
        if self._callback in gc.callbacks:
            gc.callbacks.remove(self._callback)

    def _callback(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._t0 = time.perf_counter()
            return
        pause = time.perf_counter() - self._t0
        gen = info.get("generation", 2)
        self.collections[gen] += 1
        self.pause_s[gen] += pause
        self.max_pause_s = max(self.max_pause_s, pause)
        if self.threshold_s > 0 and pause >= self.threshold_s:
            self.warnings += 1
            logger.warning(
                "%sgarbage collection of generation %d paused the process for %.3f s "
                "(%d objects collected, %d frozen); see --gc-warning-threshold-secs",
                f"{self.name}: " if self.name else "", gen, pause, info.get("collected", 0),
                gc.get_freeze_count())

    def stats(self) -> dict[str, Any]:
        return {"collections": list(self.collections),
                "pause_ms_total": [round(p * 1e3, 1) for p in self.pause_s],
                "pause_ms_max": round(self.max_pause_s * 1e3, 1),
                "frozen_objects": gc.get_freeze_count(), "warnings": self.warnings}


_WATCH: GcWatch | None = None


def settle_process(threshold_s: float, name: str = "") -> GcWatch:
    """At the end of a process's start-up: freeze the heap and watch later collections.
    Returns this process's watch (the same one if called again)."""
    global _WATCH
    frozen = freeze_heap()
    if _WATCH is None:
        _WATCH = GcWatch(threshold_s, name).install()
    logger.debug("froze %d objects out of the garbage collector's reach", frozen)
    return _WATCH


def process_watch() -> GcWatch | None:
    """This process's watch, once settle_process ran."""
    return _WATCH
