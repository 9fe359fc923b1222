"""Node 0's end of the control channel to the other nodes (several machines, --nnodes > 1).

A thread owns node 0's bound control link (srt/managers/node_link.py). It admits each node that
says a signed NodeHello with the same --tp-size and --nnodes (NodeWelcome; only then does that
node start its ranks, so nothing unauthenticated joins the TP group's rendezvous), sends every
admitted node a heartbeat each second, and records NodeReady and NodeFailure. The Supervisor
(srt/launcher.py) reads `ready()` and `failure()`; `stop()` sends NodeShutdown to every node.

Failures, each naming the node and its TP ranks: a node that does not join within
--dist-timeout; during start-up, frames claiming to be from a node that fail the HMAC check (a
wrong or missing secret: refused at once, so a stranger on the network can stop a start-up but
never join); a node that reports a failure; a node silent for LINK_TIMEOUT_S (its machine,
network or launcher gone).
"""

from __future__ import annotations

import logging
import threading
import time

import zmq

from srt.managers import node_link
from srt.managers.io_struct import (NodeFailure, NodeHeartbeat, NodeHello, NodeReady,
                                    NodeShutdown, NodeWelcome)
from srt.server_args import ServerArgs

logger = logging.getLogger(__name__)

HEARTBEAT_S = 1.0
# No frame from a node for this long and it is gone; both ends use it. Well below 30 s, well
# above a busy event loop's or a garbage collection's pause.
LINK_TIMEOUT_S = 10.0


def describe_node(args: ServerArgs, node: int) -> str:
    ranks = range(node * args.ranks_per_node, (node + 1) * args.ranks_per_node)
    names = f"TP rank {ranks[0]}" if len(ranks) == 1 else f"TP ranks {ranks[0]}-{ranks[-1]}"
    return f"node {node} ({names})"


class NodeHub:
    """Admits, watches and stops the other nodes; see the module docstring. Thread-safe: the
    link is used by its own thread only; the others read plain attributes."""

    def __init__(self, args: ServerArgs, dist_init: tuple[str, int]) -> None:
        assert args.node_secret is not None
        self.args = args
        host, port = dist_init
        self.ctx = zmq.Context()
        self.link = node_link.LinkServer(
            self.ctx, node_link.bind_addr(host, node_link.control_port(port)), args.node_secret,
            node_link.CONTROL)
        self.nodes = range(1, args.nnodes)
        self.join_deadline = time.monotonic() + args.dist_timeout
        self.joined: set[int] = set()
        self.ready_nodes: set[int] = set()
        self.last_seen: dict[int, float] = {}
        self._failure: str | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="node-hub")
        self._thread.start()
        logger.info("waiting for %d other node(s) on %s:%d (up to %g s)", len(self.nodes), host,
                    node_link.control_port(port), args.dist_timeout)

    def ready(self) -> bool:
        return len(self.ready_nodes) == len(self.nodes)

    def failure(self) -> str | None:
        return self._failure

    def stop(self) -> None:
        if self._thread.is_alive():
            self._stop.set()
            self._thread.join(5.0)

    def _fail(self, reason: str) -> None:
        if self._failure is None:
            self._failure = reason

    def _run(self) -> None:
        next_beat = 0.0
        try:
            while not self._stop.is_set():
                got = self.link.recv(100)
                now = time.monotonic()
                if got is not None:
                    self._handle(*got, now)
                self._check(now)
                if now >= next_beat:
                    next_beat = now + HEARTBEAT_S
                    self._to_all(NodeHeartbeat())
            self._to_all(NodeShutdown())
            time.sleep(0.2)  # LINGER is 0: give the shutdown frames a moment to leave
        except Exception as e:  # noqa: BLE001 - the supervisor must hear of it
            logger.exception("the node link failed")
            self._fail(f"the link to the other nodes failed: {e}")
        finally:
            self.link.close()

    def _to_all(self, msg: object) -> None:
        for node in sorted(self.joined):
            self._to(node, msg)

    def _to(self, node: int, msg: object) -> None:
        try:
            self.link.send(node, msg)
        except node_link.LinkError as e:
            logger.warning("%s", e)  # its silence is noticed by _check

    def _handle(self, node: int, msg: object, now: float) -> None:
        if node not in self.nodes:
            logger.warning("ignored a signed frame from node %d: --nnodes is %d", node,
                           self.args.nnodes)
            return
        self.last_seen[node] = now
        name = describe_node(self.args, node)
        if isinstance(msg, NodeHello):
            if (msg.tp_size, msg.nnodes) != (self.args.tp_size, self.args.nnodes):
                self._fail(f"{name} runs --tp-size {msg.tp_size} --nnodes {msg.nnodes}, node 0 "
                           f"--tp-size {self.args.tp_size} --nnodes {self.args.nnodes}")
                return
            if node not in self.joined:
                logger.info("%s joined from %s", name, msg.hostname or "?")
            self.joined.add(node)
            self._to(node, NodeWelcome())  # again for a repeated hello (one was lost)
        elif isinstance(msg, NodeReady):
            logger.info("%s is ready", name)
            self.ready_nodes.add(node)
        elif isinstance(msg, NodeFailure):
            self._fail(f"{name} failed: {msg.reason}")

    def _check(self, now: float) -> None:
        starting = not self.ready()
        for node in self.nodes:
            name = describe_node(self.args, node)
            if starting and node not in self.joined and self.link.verifier.refused.get(node):
                self._fail(f"{name} was refused: its frames fail the HMAC check of this node's "
                           "secret (SRT_NODE_SECRET / --node-secret-file must be the same on "
                           "every node)")
            elif node not in self.joined and now > self.join_deadline:
                self._fail(f"{name} did not join within --dist-timeout {self.args.dist_timeout:g}"
                           f" s (is it started with --dist-init-addr {self.args.dist_init_addr}"
                           " and the same secret?)")
            elif node in self.joined and now - self.last_seen[node] > LINK_TIMEOUT_S:
                self._fail(f"{name} stopped answering: nothing from it for {LINK_TIMEOUT_S:g} s "
                           "(its launcher, machine or network is gone)")
