"""A progress bar on stderr without dependencies: on a terminal redrawn in place at most ten
times a second; into a file or pipe one line every five seconds."""

from __future__ import annotations

import sys
import time
from typing import TextIO


class Progress:
    """`update(n)` after each finished item; `close()` prints the final line. Disabled, it
    prints nothing."""

    def __init__(self, total: int, label: str = "", enabled: bool = True,
                 stream: TextIO = sys.stderr, width: int = 30) -> None:
        self.total = max(total, 1)
        self.label = label
        self.enabled = enabled
        self.stream = stream
        self.width = width
        self.done = 0
        self.start = time.perf_counter()
        self._drawn = 0.0
        self._tty = stream.isatty()
        self._every = 0.1 if self._tty else 5.0

    def update(self, n: int = 1) -> None:
        self.done += n
        now = time.perf_counter()
        if self.enabled and now - self._drawn >= self._every:
            self._drawn = now
            self._draw(now)

    def _draw(self, now: float) -> None:
        filled = self.width * min(self.done, self.total) // self.total
        bar = "#" * filled + "." * (self.width - filled)
        elapsed = now - self.start
        rate = self.done / elapsed if elapsed > 0 else 0.0
        line = f"{self.label} [{bar}] {self.done}/{self.total} {elapsed:6.1f} s {rate:6.2f}/s"
        self.stream.write(f"\r{line}" if self._tty else f"{line}\n")
        self.stream.flush()

    def close(self) -> None:
        if self.enabled:
            self._draw(time.perf_counter())
            if self._tty:
                self.stream.write("\n")
            self.stream.flush()
