"""HeapTrimmer: malloc_trim gives the free pages of a fragmented heap back to the kernel."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from srt.heap import HeapTrimmer, heap_stats

glibc = pytest.mark.skipif(not heap_stats(), reason="needs glibc >= 2.33 (mallinfo2)")

# Run in a fresh interpreter: in the test process the heap holds whatever earlier tests freed,
# and new tensors reuse those chunks.
SCENARIO = r"""
import json, os, torch
from srt.heap import HeapTrimmer, heap_stats

def rss_mb():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20

h = HeapTrimmer(interval_s=3600)
h.trim()
free_before = heap_stats()["free_mb"]
# many small tensors (below the mmap threshold, so inside the arena), every other one freed:
# the free chunks are interleaved with live ones, so nothing is given back on its own
xs = [torch.randn(16000 + i % 7) for i in range(4000)]  # 64 KB each
del xs[::2]
out = {"free_mb": heap_stats()["free_mb"] - free_before, "before": rss_mb()}
h.idle()  # no work since the last trim: nothing to do
out["trims_after_idle"] = h.trims
h.busy()  # within the interval: marks work, no trim yet
out["trims_after_busy"] = h.trims
h.idle()
out["trims_after_work"] = h.trims
out["after"] = rss_mb()
out["stats_trims"] = h.stats()["trims"]
print(json.dumps(out))
"""


@glibc
def test_trim_returns_free_heap_pages() -> None:
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    res = subprocess.run([sys.executable, "-c", SCENARIO], capture_output=True, text=True,
                         timeout=120, check=True, cwd=repo)
    out = json.loads(res.stdout.strip().splitlines()[-1])
    assert out["free_mb"] > 100, out
    assert (out["trims_after_idle"], out["trims_after_busy"], out["trims_after_work"]) == (1, 1, 2)
    assert out["before"] - out["after"] > 0.8 * out["free_mb"], out
    assert out["stats_trims"] == 2


def test_stats_empty_without_glibc_or_keys_with_it() -> None:
    s = HeapTrimmer().stats()
    assert s == {} or {"arena_mb", "in_use_mb", "free_mb", "mmap_mb", "trims"} <= set(s)
