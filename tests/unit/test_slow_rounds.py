"""SlowRounds keeps the longest model-loop rounds over its threshold, longest first."""

from __future__ import annotations

from srt.model_process.stats import SlowRounds


def test_keeps_the_longest_over_the_threshold() -> None:
    s = SlowRounds(threshold_s=0.1, keep=3)
    for i, sec in enumerate([0.05, 0.2, 0.5, 0.15, 0.3, 0.099, 0.12]):
        s.note(1000.0 + i, sec, "fill" if i % 2 else "decode", 100 * i, i)
    snap = s.snapshot()
    assert snap["count"] == 5  # 0.2, 0.5, 0.15, 0.3, 0.12
    assert [r["ms"] for r in snap["longest"]] == [500.0, 300.0, 200.0]
    assert snap["longest"][0] == {"wall_time": 1002.0, "ms": 500.0, "kind": "decode",
                                  "fill_tokens": 200, "running": 2}
    assert snap["threshold_ms"] == 100.0
