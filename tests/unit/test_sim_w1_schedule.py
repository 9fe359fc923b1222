"""The W1 schedule simulator (benchmarks/sim_w1_schedule.py) on small workloads."""

from __future__ import annotations

from benchmarks.sim_w1_schedule import folded_schedule, srt_schedule, step_ms


def test_schedules() -> None:
    prompts, outs = [300, 200, 500, 100, 400, 250], [20, 50, 10, 40, 30, 60]
    base = srt_schedule(prompts, outs, 10**6, 4096, 45.0, 0.008)
    # everything fits at once: one fill round, then the longest output's steps
    assert base["fill_rounds"] == 1 and base["decode_steps"] == max(outs) - 1
    assert abs(base["seconds"] * 1e3 - (45.0 + 0.008 * sum(prompts) + sum(
        step_ms(sum(o > s for o in outs)) for s in range(1, max(outs))))) < 1e-6
    # a pool for about two requests: more rounds; a fill that may not wait is the default
    small = srt_schedule(prompts, outs, 900, 4096, 45.0, 0.008)
    assert small["fill_rounds"] > 1
    assert srt_schedule(prompts, outs, 900, 4096, 45.0, 0.008, 10**6, 0) == small
    waiting = srt_schedule(prompts, outs, 900, 4096, 45.0, 0.008, 10**6, 50)
    assert waiting["fill_rounds"] <= small["fill_rounds"]
    folded = folded_schedule(prompts, outs, 10**6, 8192, 0.012)
    assert folded["preempted"] == 0 and folded["steps"] == max(outs)
    tight = folded_schedule(prompts, outs, 530, 8192, 0.012)  # 300 + 200 admitted, then grow
    assert tight["preempted"] > 0 and tight["steps"] > folded["steps"]
