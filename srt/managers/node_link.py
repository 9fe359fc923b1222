"""Authenticated ZMQ links between nodes: every frame carries an HMAC-SHA256 under the secret
all nodes share (SRT_NODE_SECRET or --node-secret-file).

Ports, from --dist-init-addr HOST:PORT (node 0's address, known to every node):

    PORT      torch.distributed rendezvous of the TP group (rank 0's TCPStore)
    PORT + 1  control channel: node 0's launcher binds a ROUTER on HOST; the launcher of every
              other node connects a DEALER (join, heartbeats, failure, shutdown)
    PORT + 2  step channel: node 0's router process binds a ROUTER on HOST; every rank of another
              node connects a DEALER and receives its StepInputs on it

Node 0 binds and the others connect: every node knows HOST already (the rendezvous lives
there), so no node has to find out or announce an address of its own and only node 0's ports
need to be open. The bound side is a ROUTER rather than a PUSH because a ROUTER sends each frame
to one peer by id, and a peer gets an id only by a correctly signed first frame: a stranger who
connects receives nothing (a bound PUSH would hand it its round-robin share of the frames).

Why an HMAC per frame and not ZMQ's CURVE: CURVE needs a libsodium key pair per node, the public
keys exchanged ahead of time, and a pyzmq built with libsodium; an HMAC needs one shared secret
and hashlib. What it gives: authenticity and integrity (a frame not signed with the secret is
dropped and logged; a replayed one is dropped by its sequence number). What it does not give:
secrecy (prompts' token ids cross in the clear), and torch.distributed's own rendezvous and
collectives are not authenticated by torch either, so nodes belong on a private network.

A frame is three ZMQ parts: header = channel (1 byte) + sender (int32) + seq (uint64), the
io_struct payload, and mac = HMAC-SHA256(secret, header + payload). Sender 0 is node 0's side;
the other side signs with its node rank (control channel) or TP rank (step channel), always >= 1.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import struct
import time
from dataclasses import dataclass, field
from typing import Any

import zmq

from srt.managers import io_struct

logger = logging.getLogger(__name__)

CONTROL = 1
STEP = 2
_HEADER = struct.Struct("!BiQ")
_CHANNEL_NAMES = {CONTROL: "control", STEP: "step"}
NODE0 = 0  # the sender id of node 0's side
MAX_SENDER = 1 << 16  # node ranks and TP ranks are below it


class LinkError(RuntimeError):
    """A peer that should be there is not (never said hello, or its connection is gone)."""


def control_port(dist_init_port: int) -> int:
    return dist_init_port + 1


def step_port(dist_init_port: int) -> int:
    return dist_init_port + 2


def bind_addr(host: str, port: int) -> str:
    """The interface address to bind: the host resolved to an IP (ZMQ binds interfaces, not
    names), never a wildcard."""
    import socket

    return f"tcp://{socket.gethostbyname(host)}:{port}"


def connect_addr(host: str, port: int) -> str:
    return f"tcp://{host}:{port}"


@dataclass
class Signer:
    """Signs this side's frames on one channel with increasing sequence numbers."""

    secret: bytes
    channel: int
    sender: int
    seq: int = 0

    def seal(self, msg: Any) -> list[bytes]:
        self.seq += 1
        header = _HEADER.pack(self.channel, self.sender, self.seq)
        payload = io_struct.encode(msg)
        return [header, payload, _mac(self.secret, header, payload)]


@dataclass
class Verifier:
    """Checks frames of one channel: the mac under the secret, then a sequence number above the
    last one accepted from that connection. `open` returns (sender, message) or None (dropped,
    logged); `refused` counts the dropped frames by the sender they claimed."""

    secret: bytes
    channel: int
    last_seq: dict[bytes, int] = field(default_factory=dict)  # by connection
    refused: dict[int, int] = field(default_factory=dict)
    _last_log: float = 0.0

    def open(self, parts: list[bytes], conn: bytes = b"") -> tuple[int, Any] | None:
        claimed = -1
        if len(parts) == 3 and len(parts[0]) == _HEADER.size:
            channel, claimed, seq = _HEADER.unpack(parts[0])
            good = (channel == self.channel
                    and hmac.compare_digest(parts[2], _mac(self.secret, parts[0], parts[1])))
            if good and seq <= self.last_seq.get(conn, 0):
                self._drop(claimed, f"replayed or reordered (sequence number {seq})")
                return None
            if good:
                try:
                    msg = io_struct.decode(parts[1])
                except ValueError as e:  # signed by a peer with the secret, yet not ours
                    self._drop(claimed, f"undecodable ({e})")
                    return None
                self.last_seq[conn] = seq
                return claimed, msg
        self._drop(claimed, "its HMAC does not match this node's secret (is the other node's "
                   "SRT_NODE_SECRET / --node-secret-file the same?)")
        return None

    def _drop(self, claimed: int, why: str) -> None:
        if not 0 <= claimed < MAX_SENDER:  # strangers must not grow the table without bound
            claimed = -1
        self.refused[claimed] = self.refused.get(claimed, 0) + 1
        now = time.monotonic()
        if now - self._last_log >= 1.0:  # a stranger must not flood the log
            self._last_log = now
            logger.warning("dropped a frame on the %s link claiming to come from %s: %s "
                           "(%d dropped from it so far)", _CHANNEL_NAMES[self.channel],
                           _sender_name(self.channel, claimed), why, self.refused[claimed])


def _mac(secret: bytes, header: bytes, payload: bytes) -> bytes:
    return hmac.new(secret, header + payload, hashlib.sha256).digest()


def _sender_name(channel: int, sender: int) -> str:
    if sender < 0:
        return "an unknown sender"
    if sender == NODE0:
        return "node 0"
    return f"{'node' if channel == CONTROL else 'TP rank'} {sender}"


class LinkServer:
    """Node 0's bound end of a channel (a ROUTER). A peer is known by the sender id of its first
    verified frame; the first connection to claim an id keeps it (a later claim is dropped).
    Not thread-safe: one thread uses it."""

    def __init__(self, ctx: zmq.Context, addr: str, secret: str, channel: int) -> None:
        self._sock = ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a gone peer raises, never drops
        self._sock.bind(addr)
        self._signer = Signer(secret.encode(), channel, NODE0)
        self.verifier = Verifier(secret.encode(), channel)
        self._ids: dict[int, bytes] = {}  # sender id -> ZMQ routing id
        self._senders: dict[bytes, int] = {}

    def recv(self, timeout_ms: int) -> tuple[int, Any] | None:
        """The next verified (sender, message) within timeout_ms, or None."""
        deadline = time.monotonic() + timeout_ms / 1000
        while True:
            left = max(0, int((deadline - time.monotonic()) * 1000))
            if not self._sock.poll(left):
                return None
            routing_id, *parts = self._sock.recv_multipart()
            opened = self.verifier.open(parts, routing_id)
            if opened is None:
                continue
            sender, msg = opened
            known = self._senders.get(routing_id)
            if known is None and sender not in self._ids and sender != NODE0:
                self._ids[sender] = routing_id
                self._senders[routing_id] = sender
            elif known != sender:
                logger.warning("dropped a signed frame from a second connection claiming to be "
                               "%s", _sender_name(self.verifier.channel, sender))
                continue
            return sender, msg

    def knows(self, sender: int) -> bool:
        return sender in self._ids

    def send(self, peer: int, msg: Any, wait_s: float = 0.0) -> None:
        """Send to a peer; if it has not said hello yet, read frames for up to wait_s until it
        has (frames read meanwhile are only used to learn peers). LinkError if it never does or
        its connection is gone."""
        deadline = time.monotonic() + wait_s
        while peer not in self._ids:
            left = deadline - time.monotonic()
            if left <= 0:
                raise LinkError(f"{_sender_name(self.verifier.channel, peer)} has not "
                                f"connected to the {_CHANNEL_NAMES[self.verifier.channel]} "
                                "link")
            self.recv(int(min(left, 0.2) * 1000))
        try:
            self._sock.send_multipart([self._ids[peer], *self._signer.seal(msg)])
        except zmq.ZMQError as e:
            raise LinkError(f"{_sender_name(self.verifier.channel, peer)} is unreachable: "
                            f"{e}") from None

    def sender(self, peer: int, wait_s: float) -> "PeerSender":
        return PeerSender(self, peer, wait_s)

    def close(self) -> None:
        self._sock.close()


@dataclass
class PeerSender:
    """`send(msg)` to one peer of a LinkServer: what the router holds for a rank of another
    node, beside the PushSockets of its own ranks."""

    server: LinkServer
    peer: int
    wait_s: float

    def send(self, msg: Any) -> None:
        self.server.send(self.peer, msg, self.wait_s)


class LinkClient:
    """Another node's connected end of a channel (a DEALER): signs as `sender`, accepts only
    frames node 0 signed. recv() has PullSocket's contract. Not thread-safe."""

    def __init__(self, ctx: zmq.Context, addr: str, secret: str, channel: int,
                 sender: int) -> None:
        if sender == NODE0:
            raise ValueError("sender id 0 is node 0's")
        self._sock = ctx.socket(zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.connect(addr)
        self._signer = Signer(secret.encode(), channel, sender)
        self.verifier = Verifier(secret.encode(), channel)

    def send(self, msg: Any) -> None:
        self._sock.send_multipart(self._signer.seal(msg), copy=False)

    def recv(self, timeout_ms: int | None = None) -> Any | None:
        """The next message node 0 signed, blocking up to timeout_ms (forever when None); None
        when nothing (valid) arrived."""
        deadline = None if timeout_ms is None else time.monotonic() + timeout_ms / 1000
        while True:
            left = None if deadline is None else max(0, int((deadline - time.monotonic()) * 1000))
            if left is not None and not self._sock.poll(left):
                return None
            opened = self.verifier.open(self._sock.recv_multipart())
            if opened is not None and opened[0] == NODE0:
                return opened[1]
            if opened is not None:
                logger.warning("dropped a signed frame that does not come from node 0")

    def close(self) -> None:
        self._sock.close()
