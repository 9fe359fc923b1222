"""The HTTP port's claim (srt/http/listen.py)."""

from __future__ import annotations

import socket

import pytest

from srt.http.listen import bind_listeners


def test_bound_port_refuses_until_served_and_keeps_others_off() -> None:
    socks = bind_listeners("127.0.0.1", 0)
    try:
        assert len(socks) == 1
        port = socks[0].getsockname()[1]
        # not listening: a client is refused at once
        with socket.socket() as c, pytest.raises(ConnectionRefusedError):
            c.connect(("127.0.0.1", port))
        # the kernel's own picks (what the TP rendezvous and gloo take) avoid it
        picked = set()
        for _ in range(200):
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                picked.add(s.getsockname()[1])
        assert port not in picked
        # an explicit bind without SO_REUSEADDR fails
        with socket.socket() as s, pytest.raises(OSError):
            s.bind(("127.0.0.1", port))
        # once listening it serves
        socks[0].listen()
        with socket.create_connection(("127.0.0.1", port), timeout=5):
            pass
    finally:
        for s in socks:
            s.close()


def test_taken_port_raises_naming_the_address() -> None:
    with socket.socket() as other:
        other.bind(("127.0.0.1", 0))
        other.listen()
        port = other.getsockname()[1]
        with pytest.raises(OSError, match=f"cannot serve on 127.0.0.1:{port}: .*in use"):
            bind_listeners("127.0.0.1", port)


def test_unresolvable_host_is_an_os_error() -> None:
    with pytest.raises(OSError, match="cannot resolve --host"):
        bind_listeners("no-such-host.invalid", 0)
