"""The HTTP port, claimed before anything else starts.

The server binds --host:--port first, before the model processes are spawned, and hands the
bound sockets to uvicorn once it is ready. So a port that is taken fails the start in a second
(not after a model load), and nothing the server starts itself (the TP group's rendezvous, gloo's
connections, which take ports the kernel picks) can land on the HTTP port while the model loads.

The sockets are bound, not listening: until the server is ready a client is refused at once, as
it would be with no server, instead of waiting in a backlog nobody reads.
"""

from __future__ import annotations

import socket


def bind_listeners(host: str, port: int) -> list[socket.socket]:
    """One bound TCP socket per address `host` resolves to (as asyncio's create_server binds
    them: SO_REUSEADDR, IPv6 sockets IPv6-only). An empty host means every interface.

    Raises OSError naming host:port when any address cannot be bound (nothing stays bound)."""
    try:
        infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM,
                                   flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise OSError(f"cannot resolve --host {host!r}: {e}") from e
    socks: list[socket.socket] = []
    seen: set[tuple] = set()
    try:
        for family, type_, proto, _, addr in infos:
            if (family, addr) in seen:
                continue
            seen.add((family, addr))
            s = socket.socket(family, type_, proto)
            socks.append(s)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6 and hasattr(socket, "IPPROTO_IPV6"):
                s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            try:
                s.bind(addr)
            except OSError as e:
                raise OSError(e.errno, f"cannot serve on {host}:{port}: {e.strerror}") from e
    except BaseException:
        for s in socks:
            s.close()
        raise
    return socks
