"""StepTimer: decode phases per batch bucket, fill rounds, and differencing two snapshots."""

import time

from srt.model_process.step_timing import StepTimer, batch_bucket, per_step_ms


def test_batch_bucket_is_next_power_of_two():
    assert [batch_bucket(b) for b in (1, 2, 3, 4, 5, 200, 256, 257)] == \
        [1, 2, 4, 4, 8, 256, 256, 512]


def test_phases_fills_and_differences():
    t = StepTimer()
    t.fill_begin()
    time.sleep(0.01)
    t.fill_end(requests=3, tokens=100)
    before = t.snapshot()
    for bs in (3, 3, 5):
        t.begin()
        time.sleep(0.002)
        t.mark("prepare")
        time.sleep(0.004)
        t.mark("sample")
        t.end(bs)
    t.fill_begin()
    time.sleep(0.01)
    t.fill_end(requests=2, tokens=50)
    after = t.snapshot()
    d = per_step_ms(before, after)
    assert d["total"]["steps"] == 3 and abs(d["total"]["mean_batch"] - 11 / 3) < 1e-9
    assert set(d["by_batch"]) == {"4", "8"} and d["by_batch"]["4"]["steps"] == 2
    assert d["total"]["prepare_ms"] >= 2.0 and d["total"]["sample_ms"] >= 4.0
    # The first step after a fill has no gap; the next ones do (a few microseconds here).
    assert d["total"]["host_ms"] >= d["total"]["prepare_ms"]
    f = d["fills"]
    assert (f["rounds"], f["requests"], f["tokens"]) == (1, 2, 50)
    assert 0.01 <= f["seconds"] < 1.0 and f["tokens_per_s"] == 50 / f["seconds"]
    since_start = per_step_ms(None, after)["fills"]
    assert (since_start["rounds"], since_start["tokens"]) == (2, 150)
