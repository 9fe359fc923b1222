"""Heartbeats and stack dumps: how the launcher tells a stalled process from a busy one.

Every supervised loop (each child process's main loop, the HTTP process's event loop) owns a
`Heartbeat`, a time stamp in shared memory that the loop refreshes after each unit of work and,
while idle, at least every IDLE_BEAT_S. A loop that holds work and makes no progress stops
beating; once its heartbeat is older than `--watchdog-timeout` the launcher dumps the stacks of
every process (`dump_stacks`) and handles it as a crash. A process waiting on another one keeps
beating (its wait polls), so the stalled process is the one reported; a TP rank blocked in a
collective on a stalled peer cannot beat and is reported with it.

The clock is CLOCK_MONOTONIC, which Linux shares between processes.
"""

from __future__ import annotations

import faulthandler
import logging
import multiprocessing as mp
import os
import signal
import sys
import time

logger = logging.getLogger("srt.watchdog")

# Longest wait of an idle loop between two beats (and the poll interval of its socket).
IDLE_BEAT_S = 0.5
IDLE_POLL_MS = int(IDLE_BEAT_S * 1000)
# The signal that makes a child write the stacks of all its threads to stderr.
DUMP_SIGNAL = signal.SIGUSR1


class Heartbeat:
    """A time stamp shared between a loop and the launcher. Created by the launcher (before the
    child is spawned, which passes it on); `beat()` from the loop, `age()` from anywhere."""

    def __init__(self) -> None:
        self._stamp = mp.get_context("spawn").RawValue("d", time.monotonic())

    def beat(self) -> None:
        self._stamp.value = time.monotonic()

    def age(self) -> float:
        """Seconds since the last beat."""
        return time.monotonic() - self._stamp.value


def enable_stack_dumps() -> None:
    """In a child: write every thread's stack to stderr on DUMP_SIGNAL. faulthandler does it from
    the C signal handler, so it works while the main thread is stuck (in a sleep, or in C)."""
    faulthandler.register(DUMP_SIGNAL, file=sys.stderr, all_threads=True, chain=False)


def dump_stacks(own_name: str, children: list[tuple[str, int]]) -> None:
    """Log the stacks of this process and of each (name, pid) child, one after the other."""
    logger.error("stacks of the %s (pid %d):", own_name, os.getpid())
    sys.stderr.flush()
    faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
    for name, pid in children:
        logger.error("stacks of the %s (pid %d):", name, pid)
        try:
            os.kill(pid, DUMP_SIGNAL)
        except ProcessLookupError:
            logger.error("the %s is gone", name)
            continue
        time.sleep(0.2)  # let it finish writing before the next one starts
