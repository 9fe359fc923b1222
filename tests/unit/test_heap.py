"""HeapTrimmer: malloc_trim gives the free pages of a fragmented heap back to the kernel."""

from __future__ import annotations

import os

import pytest
import torch

from srt.heap import HeapTrimmer, heap_stats

glibc = pytest.mark.skipif(not heap_stats(), reason="needs glibc >= 2.33 (mallinfo2)")


def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


@glibc
def test_trim_returns_free_heap_pages() -> None:
    h = HeapTrimmer(interval_s=3600)
    h.trim()
    # free bytes counted before (earlier tests' heap: already given back by the trim above)
    free_before = heap_stats()["free_mb"]
    # many small tensors (below the mmap threshold, so inside the arena), every other one freed:
    # the free chunks are interleaved with live ones, so nothing is given back on its own
    xs = [torch.randn(16000 + i % 7) for i in range(4000)]  # 64 KB each
    del xs[::2]
    free = heap_stats()["free_mb"] - free_before
    assert free > 100, heap_stats()  # MB
    before = _rss_mb()
    h.idle()  # dirty since the last trim? no: only busy() marks work
    assert h.trims == 1
    h.busy()  # within the interval: marks work, no trim yet
    assert h.trims == 1
    h.idle()
    assert h.trims == 2
    after = _rss_mb()
    assert before - after > 0.8 * free, (before, after, free)
    assert h.stats()["trims"] == 2
    del xs


def test_stats_empty_without_glibc_or_keys_with_it() -> None:
    s = HeapTrimmer().stats()
    assert s == {} or {"arena_mb", "in_use_mb", "free_mb", "mmap_mb", "trims"} <= set(s)
