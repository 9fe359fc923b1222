"""bench_serving's grouping of long inter-token gaps into moments when many streams stopped."""

from __future__ import annotations

from benchmarks.bench_serving import stall_events


def test_gaps_ending_together_are_one_stall() -> None:
    big = [(8.01, 600.0), (8.03, 610.0), (8.07, 590.0),  # one pause seen by three streams
           (12.5, 200.0),                               # one slow stream alone
           (20.0, 900.0), (20.04, 880.0)]
    out = stall_events(big)
    assert [g["streams"] for g in out] == [2, 3, 1]  # longest first
    assert out[0] == {"end_s": 20.0, "streams": 2, "max_ms": 900.0, "start_s": 19.1}
    assert out[1]["end_s"] == 8.01 and out[1]["max_ms"] == 610.0
    assert abs(out[1]["start_s"] - 7.41) < 1e-9
    assert stall_events([]) == []


def test_a_chain_of_close_gaps_stays_one_group() -> None:
    # ends 40 ms apart each: every one within the window of the one before
    big = [(1.0 + 0.04 * i, 160.0) for i in range(10)]
    (g,) = stall_events(big)
    assert g["streams"] == 10
