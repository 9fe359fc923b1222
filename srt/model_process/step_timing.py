"""Where the wall time of DECODE steps goes on the host: cheap always-on counters.

A decode step is cut into phases by `mark` calls in the model process:

    gap          end of the previous decode step -> start of this one, when no fill ran in
                 between: the router round trip and the rest of the round (every
                 DECODE_STEPS_PER_ROUND steps; near zero otherwise)
    prepare      step start -> the forward call: room in the pool, slots, req_to_token, the
                 input tensors and their host-to-device copy
    forward      the runner's forward call: on a GPU launching the kernels (or copying the
                 inputs and launching a graph replay), on the CPU the computation itself
    sample_prep  the sampling tensors and masks of the batch
    sample       launching sampling and the copy of the sampled ids to the host
    wait         blocked until a step's ids are on the host (the step just launched in the plain
                 loop; the one before it in the overlapped loop, where the device is busy with
                 the next step meanwhile)
    post         the rest of the step: appending tokens, stop checks, outputs

In the plain loop the device idles through `gap`, `prepare` and `post`; in the overlapped loop
the host does them while the device runs the step launched before. What the device really
waited for is measured on the device itself: `gpu_idle` sums, over `gpu_timed` decode steps,
the time from the end of the step before to the start of this one (CUDA events; GPU only).
Sums are kept per batch-size bucket (the next power of two) so a benchmark can difference two
snapshots.

Fill rounds (EXTEND / PREFILL) are summed whole: count, requests, new tokens and wall seconds
from the round's start to its sampled ids on the host (so they include the device time).
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from typing import Any

PHASES = ("gap", "prepare", "forward", "sample_prep", "sample", "wait", "post")


@dataclass
class PhaseSums:
    """Summed seconds per phase over `steps` decode steps of `requests` rows in all."""

    steps: int = 0
    requests: int = 0
    gap: float = 0.0
    prepare: float = 0.0
    forward: float = 0.0
    sample_prep: float = 0.0
    sample: float = 0.0
    wait: float = 0.0
    post: float = 0.0
    gpu_timed: int = 0
    gpu_idle: float = 0.0


def batch_bucket(bs: int) -> int:
    """The smallest power of two >= bs."""
    return 1 << max(0, bs - 1).bit_length()


@dataclass
class FillSums:
    """Summed fill rounds: `rounds` of `requests` requests and `tokens` computed tokens in all,
    `seconds` of wall time."""

    rounds: int = 0
    requests: int = 0
    tokens: int = 0
    seconds: float = 0.0


class StepTimer:
    """Accumulates decode-step phases. `begin` opens a step, `mark(phase)` closes the phase that
    ran since the last mark, `end(bs)` closes `post` and books the step; `mark` outside a step
    does nothing, and a fill round (`fill_begin`) drops the next step's gap."""

    def __init__(self) -> None:
        self.buckets: dict[int, PhaseSums] = {}
        self._open = False
        self._t = 0.0
        self._last_end: float | None = None
        self._cur: dict[str, float] = {}
        self.fills = FillSums()
        self._fill_t = 0.0

    def begin(self) -> None:
        now = time.perf_counter()
        self._cur = dict.fromkeys(PHASES, 0.0)
        if self._last_end is not None:
            self._cur["gap"] = now - self._last_end
        self._open = True
        self._t = now

    def mark(self, phase: str) -> None:
        if not self._open:
            return
        now = time.perf_counter()
        self._cur[phase] += now - self._t
        self._t = now

    def end(self, bs: int) -> None:
        if not self._open:
            return
        self.mark("post")
        self._open = False
        self._last_end = self._t
        sums = self.buckets.setdefault(batch_bucket(bs), PhaseSums())
        sums.steps += 1
        sums.requests += bs
        for k, v in self._cur.items():
            setattr(sums, k, getattr(sums, k) + v)

    def discard(self) -> None:
        """Close the open step without booking it (it launched nothing)."""
        self._open = False

    def gpu_idle(self, bs: int, seconds: float) -> None:
        """Book the device's idle time before one decode step of bs rows."""
        sums = self.buckets.setdefault(batch_bucket(bs), PhaseSums())
        sums.gpu_timed += 1
        sums.gpu_idle += seconds

    def fill_begin(self) -> None:
        """A fill round starts (it also breaks the decode chain)."""
        self._last_end = None
        self._fill_t = time.perf_counter()

    def fill_end(self, requests: int, tokens: int) -> None:
        self.fills.rounds += 1
        self.fills.requests += requests
        self.fills.tokens += tokens
        self.fills.seconds += time.perf_counter() - self._fill_t

    def snapshot(self) -> dict[str, Any]:
        """{"by_batch": {bucket: sums}, "total": sums, "fills": FillSums fields}, sums as
        PhaseSums fields (seconds)."""
        total = PhaseSums()
        for s in self.buckets.values():
            for k, v in asdict(s).items():
                setattr(total, k, getattr(total, k) + v)
        return {"by_batch": {str(b): asdict(s) for b, s in sorted(self.buckets.items())},
                "total": asdict(total), "fills": asdict(self.fills)}


def per_step_ms(before: dict[str, Any] | None, after: dict[str, Any]) -> dict[str, Any]:
    """Mean ms per decode step by phase between two `snapshot`s (before None: since start),
    total and per bucket; `host` is gap + prepare + sample_prep + post;
    `gpu_idle_ms` the device's mean idle time before a decode step (None off the GPU)."""

    def diff(a: dict[str, Any] | None, b: dict[str, Any]) -> dict[str, Any] | None:
        d = {k: b[k] - (a.get(k, 0) if a else 0) for k in b}
        if d["steps"] <= 0:
            return None
        n = d["steps"]
        out = {"steps": n, "mean_batch": d["requests"] / n}
        out.update({f"{p}_ms": d[p] / n * 1e3 for p in PHASES})
        out["host_ms"] = sum(out[f"{p}_ms"] for p in ("gap", "prepare", "sample_prep", "post"))
        timed = d.get("gpu_timed", 0)
        out["gpu_idle_ms"] = d["gpu_idle"] / timed * 1e3 if timed else None
        return out

    res: dict[str, Any] = {"total": diff(before["total"] if before else None, after["total"]),
                           "by_batch": {}, "fills": fill_diff(before, after)}
    for b, s in after["by_batch"].items():
        d = diff((before or {}).get("by_batch", {}).get(b), s)
        if d is not None:
            res["by_batch"][b] = d
    return res


def fill_diff(before: dict[str, Any] | None, after: dict[str, Any]) -> dict[str, Any]:
    """Fill rounds between two `snapshot`s: rounds, requests, tokens, seconds, tokens_per_s."""
    b = (before or {}).get("fills") or asdict(FillSums())
    a = after.get("fills") or asdict(FillSums())
    d = {k: a[k] - b[k] for k in a}
    d["tokens_per_s"] = d["tokens"] / d["seconds"] if d["seconds"] > 0 else None
    return d
