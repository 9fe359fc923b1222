"""GcWatch times the garbage collector's pauses and warns past the threshold; freeze_heap puts
what is alive out of the collector's reach. Run in a fresh interpreter: freezing and the
collector's callbacks are process-wide."""

from __future__ import annotations

import json
import subprocess
import sys

SCRIPT = r"""
import gc, json, logging
from srt.gc_watch import GcWatch, freeze_heap, process_watch, settle_process

records = []
class Keep(logging.Handler):
    def emit(self, record):
        records.append(record.getMessage())
logging.getLogger("srt.gc_watch").addHandler(Keep())
logging.getLogger("srt.gc_watch").setLevel(logging.WARNING)

assert process_watch() is None
junk = [[i, {"k": [i]}] for i in range(200_000)]  # many containers: a slow full collection
watch = settle_process(1e-9, "test")  # every pause counts as long
frozen = gc.get_freeze_count()
more = [[i] for i in range(50_000)]
gc.collect(0)
gc.collect()
quiet = GcWatch(0.0).install()  # threshold 0: counts, never warns
gc.collect()
quiet.uninstall()
gc.disable()  # no collection between the snapshots
stats, quiet_stats, warned = watch.stats(), quiet.stats(), list(records)
print(json.dumps({"frozen": frozen, "stats": stats, "quiet": quiet_stats,
                  "same": settle_process(5.0) is watch, "records": warned}))
"""


def test_gc_watch_counts_times_and_warns() -> None:
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    r = json.loads(out.stdout.strip().splitlines()[-1])
    assert r["frozen"] >= 200_000  # the junk's lists and dicts are frozen
    s = r["stats"]
    assert s["collections"][0] >= 1 and s["collections"][2] >= 2, s
    assert s["pause_ms_total"][2] > 0 and s["pause_ms_max"] > 0, s
    assert s["warnings"] == sum(s["collections"]) >= 3, s
    assert len(r["records"]) == s["warnings"]
    assert "test: garbage collection of generation 2 paused the process for" in r["records"][-1]
    q = r["quiet"]
    assert q["collections"][2] == 1 and q["warnings"] == 0, q
    assert r["same"]  # one watch per process


def test_frozen_objects_make_full_collections_cheap() -> None:
    """The point of freezing: a full collection no longer walks the frozen objects."""
    script = r"""
import gc, json, time
junk = [[i, {"k": [i]}] for i in range(300_000)]
def full():
    t = time.perf_counter(); gc.collect(); return time.perf_counter() - t
before = min(full() for _ in range(3))
from srt.gc_watch import freeze_heap
freeze_heap()
after = min(full() for _ in range(3))
print(json.dumps({"before": before, "after": after}))
"""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    r = json.loads(out.stdout.strip().splitlines()[-1])
    assert r["after"] < r["before"] / 5, r
