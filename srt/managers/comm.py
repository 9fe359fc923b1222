"""Typed ZMQ PUSH/PULL wrappers: a socket wrapped once with the io_struct codec.

Nobody else touches raw sockets but `node_link.py` (the signed links between nodes). Addresses
are `ipc://` paths in the server's private temporary directory (or `tcp://127.0.0.1:port`);
never a wildcard address.
"""

from __future__ import annotations

from typing import Any

import zmq
import zmq.asyncio

from srt.managers import io_struct


class PushSocket:
    """Sends messages; connects to (or binds) one address."""

    def __init__(self, ctx: zmq.Context, addr: str, bind: bool = False) -> None:
        self._sock = ctx.socket(zmq.PUSH)
        self._sock.setsockopt(zmq.LINGER, 0)
        if bind:
            self._sock.bind(addr)
        else:
            self._sock.connect(addr)

    def send(self, msg: Any) -> None:
        self._sock.send(io_struct.encode(msg), copy=False)

    def send_all(self, msgs: list[Any]) -> None:
        """Encode every message first, so that either all are sent or none is."""
        for data in [io_struct.encode(m) for m in msgs]:
            self._sock.send(data, copy=False)

    def close(self) -> None:
        self._sock.close()


class PullSocket:
    """Receives messages on a bound address."""

    def __init__(self, ctx: zmq.Context, addr: str) -> None:
        self._sock = ctx.socket(zmq.PULL)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.bind(addr)

    def recv(self, timeout_ms: int | None = None) -> Any | None:
        """Block up to timeout_ms (forever when None); None when nothing arrived."""
        if timeout_ms is not None and not self._sock.poll(timeout_ms):
            return None
        return io_struct.decode(self._sock.recv())

    def pending(self) -> bool:
        """Whether a message is queued (no wait)."""
        return bool(self._sock.poll(0))

    @property
    def zmq_socket(self) -> zmq.Socket:
        """The socket, for a zmq.Poller over several."""
        return self._sock

    def drain(self) -> list[Any]:
        """Everything queued right now, without blocking."""
        out = []
        while True:
            try:
                data = self._sock.recv(zmq.NOBLOCK)
            except zmq.Again:
                return out
            out.append(io_struct.decode(data))

    def close(self) -> None:
        self._sock.close()


class AsyncPullSocket:
    """PULL socket for the HTTP process's asyncio loop."""

    def __init__(self, ctx: zmq.asyncio.Context, addr: str) -> None:
        self._sock = ctx.socket(zmq.PULL)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.bind(addr)

    async def recv(self) -> Any:
        return io_struct.decode(await self._sock.recv())

    def close(self) -> None:
        self._sock.close()
