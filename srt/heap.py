"""The C heap of a long-running process: what glibc's malloc holds, and giving free pages back.

A model process on the CPU allocates and frees tensors of every size each step. glibc keeps the
pages of freed chunks inside its arenas, so the resident size follows the largest working set
seen so far (a burst of long batches) rather than the current one. `HeapTrimmer` calls
`malloc_trim(0)`, which returns every whole free page of every arena to the kernel, when the
process goes idle after work and at most once per `interval_s` while it stays busy. Elsewhere
than on glibc (macOS, musl) every call is a no-op and `stats()` is empty.
"""

from __future__ import annotations

import ctypes
import logging
import time
from dataclasses import dataclass

logger = logging.getLogger(__name__)


class _Mallinfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
        "fordblks", "keepcost")]


def _libc() -> ctypes.CDLL | None:
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.malloc_trim.argtypes = [ctypes.c_size_t]
        libc.malloc_trim.restype = ctypes.c_int
        libc.mallinfo2.restype = _Mallinfo2
        return libc
    except (OSError, AttributeError):  # not glibc, or glibc < 2.33 (no mallinfo2)
        return None


def heap_stats(libc: ctypes.CDLL | None = None) -> dict[str, float]:
    """MB held by malloc: `arena_mb` (heap pages of all arenas), `in_use_mb` and `free_mb`
    (allocated and free bytes inside them), `mmap_mb` (large blocks mapped on their own)."""
    libc = libc or _libc()
    if libc is None:
        return {}
    m = libc.mallinfo2()
    mb = 2.0**20
    return {"arena_mb": round(m.arena / mb, 1), "in_use_mb": round(m.uordblks / mb, 1),
            "free_mb": round(m.fordblks / mb, 1), "mmap_mb": round(m.hblkhd / mb, 1)}


@dataclass
class HeapTrimmer:
    """Trims the heap on `idle()` after work and on `busy()` every `interval_s` seconds."""

    interval_s: float = 30.0
    trims: int = 0
    trim_s: float = 0.0  # total time spent in malloc_trim

    def __post_init__(self) -> None:
        self._libc = _libc()
        self._dirty = False  # work was done since the last trim
        self._last = time.monotonic()

    def busy(self) -> None:
        self._dirty = True
        if time.monotonic() - self._last >= self.interval_s:
            self.trim()

    def idle(self) -> None:
        if self._dirty:
            self.trim()

    def trim(self) -> None:
        self._dirty = False
        self._last = time.monotonic()
        if self._libc is None:
            return
        t = time.perf_counter()
        self._libc.malloc_trim(0)
        self.trim_s += time.perf_counter() - t
        self.trims += 1

    def stats(self) -> dict[str, float]:
        out = heap_stats(self._libc)
        if out:
            out.update(trims=self.trims, trim_ms_total=round(self.trim_s * 1e3, 1))
        return out
