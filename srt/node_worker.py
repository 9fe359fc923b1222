"""A node other than node 0 (--node-rank K > 0): runs its TP ranks under node 0's direction.

    python -m srt.server --model-path DIR --tp-size T --nnodes N --node-rank K \\
        --dist-init-addr HOST:PORT          (with SRT_NODE_SECRET or --node-secret-file)

No HTTP server, router or detokenizer: node 0 runs those. This launcher joins node 0's control
channel (srt/managers/node_link.py: a signed NodeHello until node 0 answers NodeWelcome, within
--dist-timeout), only then starts its model processes (ranks K * T/N .. (K + 1) * T/N - 1; they
join the TP group at HOST:PORT and take their steps from node 0's router over the signed step
channel), reports NodeReady, and from then on heartbeats node 0 every second.

It stops its ranks and exits: 0 on node 0's NodeShutdown or a SIGTERM/SIGINT of its own (node 0
is told, and fails); 1 when one of its processes dies or stalls (node 0 is told why) or when
node 0 is silent for LINK_TIMEOUT_S (node 0 gone: nothing left to serve).
"""

from __future__ import annotations

import logging
import shutil
import signal
import socket
import threading
import time
from dataclasses import dataclass

import zmq

from srt import cpu_threads
from srt.launcher import Failure, Supervisor, prepare_args
from srt.managers import node_link
from srt.managers.io_struct import (NodeFailure, NodeHeartbeat, NodeHello, NodeReady,
                                    NodeShutdown, NodeWelcome)
from srt.node_hub import HEARTBEAT_S, LINK_TIMEOUT_S, describe_node
from srt.port_args import PortArgs
from srt.server_args import ServerArgs
from srt.utils import configure_logging

logger = logging.getLogger("srt.node")


@dataclass
class Outcome:
    code: int  # the exit status
    reason: str


class LinkToNode0:
    """The control link as the Supervisor's remote (RemoteNodes): node 0 counts as failed when
    silent for LINK_TIMEOUT_S. A thread receives and heartbeats; `done` is set with the outcome
    when node 0 says stop or goes silent. Sends are serialized by a lock (ZMQ sockets are not
    thread-safe)."""

    def __init__(self, args: ServerArgs, host: str, port: int) -> None:
        assert args.node_secret is not None
        self.args = args
        self.ctx = zmq.Context()
        self.addr = node_link.connect_addr(host, node_link.control_port(port))
        self.link = node_link.LinkClient(self.ctx, self.addr, args.node_secret,
                                         node_link.CONTROL, args.node_rank)
        self.lock = threading.Lock()
        self.last_seen = time.monotonic()
        self.outcome: Outcome | None = None
        self.done = threading.Event()
        self._stopped = False

    def join(self) -> bool:
        """Say hello every second until node 0 welcomes this node, for up to --dist-timeout."""
        hello = NodeHello(self.args.node_rank, self.args.tp_size, self.args.nnodes,
                          socket.gethostname())
        deadline = time.monotonic() + self.args.dist_timeout
        while time.monotonic() < deadline:
            self.send(hello)
            with self.lock:
                msg = self.link.recv(int(HEARTBEAT_S * 1000))
            if isinstance(msg, NodeWelcome):
                self.last_seen = time.monotonic()
                return True
        return False

    def start(self) -> None:
        threading.Thread(target=self._run, daemon=True, name="node-link").start()

    def send(self, msg: object) -> None:
        with self.lock:
            self.link.send(msg)

    def finish(self, code: int, reason: str) -> None:
        if self.outcome is None:
            self.outcome = Outcome(code, reason)
        self.done.set()

    def _run(self) -> None:
        next_beat = 0.0
        while not self._stopped:
            with self.lock:
                msg = self.link.recv(100)
            now = time.monotonic()
            if msg is not None:
                self.last_seen = now
                if isinstance(msg, NodeShutdown):
                    self.finish(0, "node 0 stopped")
            if now - self.last_seen > LINK_TIMEOUT_S:
                self.finish(1, f"node 0 ({self.addr}) stopped answering: nothing from it for "
                                f"{LINK_TIMEOUT_S:g} s")
            if now >= next_beat:
                next_beat = now + HEARTBEAT_S
                self.send(NodeHeartbeat())

    # RemoteNodes
    def ready(self) -> bool:
        return True

    def failure(self) -> str | None:
        failed = self.outcome is not None and self.outcome.code != 0
        return self.outcome.reason if failed else None

    def stop(self) -> None:
        self._stopped = True


def run_node(args: ServerArgs) -> int:
    """Run node `args.node_rank` (> 0) until node 0 stops it; returns the exit status (2 for a
    bad configuration)."""
    configure_logging(args.log_level, f"node {args.node_rank}")
    try:
        args = prepare_args(args)
    except (OSError, ValueError) as e:
        logger.error("%s", e)
        return 2
    from srt.model_process.process import run_model_process

    me = describe_node(args, args.node_rank)
    host, port = args.dist_init
    link = LinkToNode0(args, host, port)
    logger.info("%s: joining node 0 at %s", me, link.addr)
    if not link.join():
        logger.error("%s: node 0 at %s did not admit this node within --dist-timeout %g s (not "
                     "started yet, or its node secret differs)", me, link.addr, args.dist_timeout)
        return 1
    link.start()
    ports = PortArgs.create(args.tp_size, (host, port), args.ranks_per_node)
    supervisor = Supervisor(args.watchdog_timeout, f"{me} launcher")
    supervisor.add_remote(link)

    def on_signal(signum: int, _: object) -> None:
        link.finish(0, f"stopped by {signal.Signals(signum).name}")

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    try:
        for rank in args.local_tp_ranks:
            supervisor.start(f"model process (TP rank {rank})", run_model_process, args, ports,
                             rank, env=cpu_threads.child_env())
        supervisor.wait_ready()
    except RuntimeError as e:
        logger.error("%s", e)
        _tell(link, f"{e}")
        supervisor.stop()
        shutil.rmtree(ports.ipc_dir, ignore_errors=True)
        return 1
    link.send(NodeReady())
    logger.info("%s is ready", me)

    def on_failure(failure: Failure) -> None:
        if link.outcome is None:  # not a failure this node was told of
            _tell(link, failure.reason)
        link.finish(1, failure.reason)

    supervisor.watch(on_failure)
    while not link.done.wait(0.5):  # a timeout, so that signal handlers run promptly
        pass
    outcome = link.outcome
    assert outcome is not None
    log = logger.info if outcome.code == 0 else logger.error
    log("%s stops: %s", me, outcome.reason)
    if outcome.code == 0 and outcome.reason != "node 0 stopped":
        _tell(link, outcome.reason)
    supervisor.stop()
    shutil.rmtree(ports.ipc_dir, ignore_errors=True)
    return outcome.code


def _tell(link: LinkToNode0, reason: str) -> None:
    """Tell node 0 why this node fails; a moment for the frame to leave (LINGER is 0)."""
    try:
        link.send(NodeFailure(reason))
        time.sleep(0.2)
    except zmq.ZMQError:
        pass  # node 0's end is gone: it notices this node's silence instead
