"""How model processes use the host's cores when the model runs on the CPU.

Two rules, both overridable from the environment:

- Each model rank on the CPU runs `cores // ranks on this node` compute threads (at least one),
  so that TP ranks on one machine do not ask for more threads than it has cores (unless
  `OMP_NUM_THREADS` is set, which is then obeyed as is).
- Idle compute threads spin only briefly before they sleep (`GOMP_SPINCOUNT`, set for the
  children unless `GOMP_SPINCOUNT` or `OMP_WAIT_POLICY` is already set). With OpenMP's default
  spin (300,000 rounds), a thread that finishes its share first keeps its core busy waiting for
  a sibling that another process (the HTTP process, the client, any other job) has pushed off
  the other core; each parallel region then costs a scheduler time slice. On a 2-core machine
  with one other busy process a 64-token prefill chunk of SmolLM2-135M took seconds instead of
  0.45 s, and running streams stalled for up to 20 s behind a long prompt. Spinning 1,000
  rounds cost 5-8% of the decode speed on an idle 2-core machine, within run-to-run noise.

libgomp reads its settings once, when it loads (with torch), so `child_env` must be in the
environment before a model process is spawned; the thread count is set inside the process.
"""

from __future__ import annotations

import os

SPIN_COUNT = "1000"


def child_env() -> dict[str, str]:
    """Environment variables to add for spawned model processes (none the user already set)."""
    if "GOMP_SPINCOUNT" in os.environ or "OMP_WAIT_POLICY" in os.environ:
        return {}
    return {"GOMP_SPINCOUNT": SPIN_COUNT}


def available_cores() -> int:
    """Cores this process may run on (its affinity mask, not the machine's total)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        return os.cpu_count() or 1


def threads_per_rank(local_ranks: int) -> int | None:
    """Compute threads for one CPU model rank of `local_ranks` on this machine; None when
    `OMP_NUM_THREADS` is set (the user's choice stands)."""
    if os.environ.get("OMP_NUM_THREADS"):
        return None
    return max(1, available_cores() // max(1, local_ranks))
