"""Small process helpers shared by the launcher and the child processes."""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import socket
import sys
import threading
import time
import traceback
from dataclasses import dataclass
from typing import Any, Callable, NoReturn, TypeVar

T = TypeVar("T")

_PR_SET_PDEATHSIG = 1


def configure_logging(level: str, process_name: str) -> None:
    from srt.logsafe import SafeFormatter

    handler = logging.StreamHandler(sys.stderr)
    # Control characters from user input are escaped in every record (srt/logsafe.py).
    handler.setFormatter(SafeFormatter(f"%(asctime)s [{process_name}] %(levelname)s %(message)s",
                                       datefmt="%H:%M:%S"))
    logging.basicConfig(level=getattr(logging, level.upper()), handlers=[handler], force=True)


_PR_SET_NAME = 15


def become_child_process(parent_pid: int, name: str = "") -> None:
    """Set up a child of the launcher: die with the parent, leave Ctrl-C to the parent.

    Ctrl-C reaches the whole process group; the launcher alone handles it and stops the children
    with SIGTERM. If the launcher is killed outright, the kernel (PR_SET_PDEATHSIG) and a watcher
    thread end the child too, so no process is left behind.
    """
    from srt.watchdog import enable_stack_dumps

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, lambda *_: os._exit(0))
    enable_stack_dumps()
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
        if name:  # what `ps -o comm` and `top` show (at most 15 bytes)
            libc.prctl(_PR_SET_NAME, ("srt-" + name.replace(" ", "-")).encode()[:15])

    def watch() -> None:
        while True:
            if os.getppid() != parent_pid:
                os._exit(1)
            time.sleep(1.0)

    threading.Thread(target=watch, daemon=True, name="parent-watch").start()
    if os.getppid() != parent_pid:  # the parent died before the signal was armed
        os._exit(1)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def describe_exit(code: int | None) -> str:
    if code is None:
        return "still running"
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


@dataclass
class ChildLink:
    """What a child process gets from the launcher besides its arguments: the launcher's pid
    (to die with it), the write end of the ready pipe, and its heartbeat (srt/watchdog.py)."""

    parent_pid: int
    ready: Any  # multiprocessing Connection
    heartbeat: Any  # srt.watchdog.Heartbeat


def start_child(link: ChildLink, args: Any, name: str, build: Callable[[], T],
                info: Callable[[T], dict[str, Any]] = lambda _: {}) -> T:
    """The ready handshake of a child process: set it up, build its main object, then report
    ("ready", info(obj)) on the pipe, or ("error", traceback) and exit 1 if building failed.
    `args` is the ServerArgs (log level, garbage-collector warning threshold). Everything alive
    once built is frozen out of the garbage collector's reach (srt/gc_watch.py)."""
    from srt.gc_watch import settle_process

    become_child_process(link.parent_pid, name)
    configure_logging(args.log_level, name)
    try:
        obj = build()
        payload = info(obj)
    except Exception:
        link.ready.send(("error", traceback.format_exc()))
        raise SystemExit(1)
    settle_process(args.gc_warning_threshold_secs, name)
    link.heartbeat.beat()  # the watchdog starts counting from here
    link.ready.send(("ready", payload))
    return obj


def run_loop(name: str, loop: Callable[[], Any]) -> NoReturn:
    """Run a child's main loop; if anything escapes it, log the traceback and exit 1 at once.

    os._exit, not a normal interpreter exit: a half-torn-down process (threads, ZMQ contexts,
    a process group) could hang in its exit handlers, and the launcher must see the death now.
    """
    try:
        loop()
        logging.getLogger("srt").critical("the %s loop returned", name)
    except BaseException:
        logging.getLogger("srt").critical("the %s crashed", name, exc_info=True)
    logging.shutdown()
    os._exit(1)
