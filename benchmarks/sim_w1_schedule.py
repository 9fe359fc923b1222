"""W1's schedule simulated from measured step costs: where would its time go under another
admission policy? (No model runs: a table of decode-step and fill-round times stands in.)

    python benchmarks/sim_w1_schedule.py [--pool 104630] [--min-fill-tokens 2048 --max-wait 8]

The workload is bench_offline's W1 (256 prompts of 100-1024 tokens, 100-1024 tokens out each).
Two schedules over one KV pool of `--pool` tokens:

- srt: a fill round admits waiting requests in order while each one's prompt plus its whole
  max_new_tokens fits the pool less the running requests' remaining tokens times the new-token
  ratio (0.7, decaying by 0.001 a step to 0.1), at most `--fill-budget` new tokens while others
  decode; the running requests wait for it. A small fill may wait (`--min-fill-tokens`,
  `--max-wait`) as `--min-fill-tokens-while-decoding` does.
- folded: every step decodes the running requests and admits waiting prompts whose tokens fit the
  pool now (up to `--step-budget` tokens a step), their tokens costing only their compute; when a
  step would not fit, the newest request is preempted and recomputed later (vLLM's scheduler).

Step and fill costs default to one H100's Qwen3-30B-A3B shape (2026-12-07,
benchmarks/results/README.md): a decode step by batch size from bench_offline's table, a separate
fill round 45 ms plus 0.008 ms a token (profile_decode --fills-while-decoding), a prompt token
inside a decode step 0.012 ms. Prints each schedule's seconds, decode steps, fill rounds and mean
batch. A model: it tells which lever is worth building, not what a GPU will measure.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.bench_offline import w1_workload  # noqa: E402

# (mean batch, ms a decode step): Qwen3-30B-A3B shape, one H100, bench_offline's step table
STEP_MS = [(0, 0.0), (1, 3.4), (2, 5.3), (3.4, 7.2), (5.9, 9.5), (12, 13.4), (22, 17.0),
           (45, 21.2), (103, 21.0), (300, 22.0)]


def step_ms(batch: float) -> float:
    """A decode step's time at `batch` requests, linear between the measured points."""
    for (b0, t0), (b1, t1) in zip(STEP_MS, STEP_MS[1:]):
        if batch <= b1:
            return t0 + (t1 - t0) * (batch - b0) / (b1 - b0)
    return STEP_MS[-1][1]


def srt_schedule(prompts: list[int], outs: list[int], pool: int, fill_budget: int,
                 fill_ms: float, fill_token_ms: float, min_fill_tokens: int = 0,
                 max_wait: int = 0) -> dict[str, float]:
    waiting = list(range(len(prompts)))
    running: dict[int, int] = {}  # request -> tokens generated
    ratio, t, steps, fills, waited, batch_sum = 0.7, 0.0, 0, 0, 0, 0
    while waiting or running:
        used = sum(prompts[i] + g for i, g in running.items())
        room = pool - used - ratio * sum(outs[i] - g for i, g in running.items())
        tokens, admitted = 0, []
        for i in waiting:
            if prompts[i] + outs[i] > room or tokens + prompts[i] > fill_budget:
                break
            room -= prompts[i] + outs[i]
            tokens += prompts[i]
            admitted.append(i)
        if admitted and (not running or tokens >= min_fill_tokens
                         or len(admitted) == len(waiting) or waited >= max_wait):
            for i in admitted:
                waiting.remove(i)
                running[i] = 1  # the fill samples the first token
            t += fill_ms + fill_token_ms * tokens
            fills += 1
            waited = 0
            continue
        waited += bool(admitted)
        t += step_ms(len(running))
        steps += 1
        batch_sum += len(running)
        ratio = max(0.1, ratio - 0.001)
        for i in list(running):
            running[i] += 1
            if running[i] >= outs[i]:
                del running[i]
    return {"seconds": t / 1e3, "decode_steps": steps, "fill_rounds": fills,
            "mean_batch": batch_sum / max(1, steps)}


def folded_schedule(prompts: list[int], outs: list[int], pool: int, step_budget: int,
                    token_ms: float) -> dict[str, float]:
    waiting = list(range(len(prompts)))
    running: dict[int, int] = {}
    order: list[int] = []  # admission order, for preemption
    t, steps, preempted, batch_sum = 0.0, 0, 0, 0
    while waiting or running:
        used = sum(prompts[i] + g for i, g in running.items())
        while running and used + len(running) > pool:  # the newest is recomputed later
            victim = order.pop()
            used -= prompts[victim] + running.pop(victim)
            waiting.insert(0, victim)
            preempted += 1
        free, tokens = pool - used - len(running), 0
        while waiting:
            need = prompts[waiting[0]]
            if need > free or tokens + need > step_budget - len(running):
                break
            i = waiting.pop(0)
            free -= need
            tokens += need
            running[i] = 0
            order.append(i)
        t += step_ms(max(1, len(running))) + token_ms * tokens
        steps += 1
        batch_sum += len(running)
        for i in list(running):
            running[i] += 1
            if running[i] >= outs[i]:
                del running[i]
                order.remove(i)
    return {"seconds": t / 1e3, "steps": steps, "preempted": preempted,
            "mean_batch": batch_sum / steps}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--pool", type=int, default=104630, help="KV pool tokens (srt's Qwen3 W1)")
    p.add_argument("--fill-budget", type=int, default=4096)
    p.add_argument("--step-budget", type=int, default=8192)
    p.add_argument("--fill-ms", type=float, default=45.0)
    p.add_argument("--fill-token-ms", type=float, default=0.008)
    p.add_argument("--token-ms", type=float, default=0.012)
    p.add_argument("--min-fill-tokens", type=int, default=2048)
    p.add_argument("--max-wait", type=int, default=8)
    p.add_argument("--out", default=None)
    a = p.parse_args()
    prompts, outs = w1_workload(256)
    lens = [len(x) for x in prompts]
    rows = {
        "srt": srt_schedule(lens, outs, a.pool, a.fill_budget, a.fill_ms, a.fill_token_ms),
        "srt, waiting fills": srt_schedule(lens, outs, a.pool, a.fill_budget, a.fill_ms,
                                           a.fill_token_ms, a.min_fill_tokens, a.max_wait),
        "folded": folded_schedule(lens, outs, a.pool, a.step_budget, a.token_ms),
    }
    print(f"{'schedule':20} {'seconds':>8} {'steps':>6} {'fills':>6} {'mean_batch':>10}")
    for name, r in rows.items():
        print(f"{name:20} {r['seconds']:8.2f} {r.get('decode_steps', r.get('steps')):6d} "
              f"{r.get('fill_rounds', '-'):>6} {r['mean_batch']:10.1f}")
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"args": vars(a), "schedules": rows}, f, indent=1)


if __name__ == "__main__":
    main()
