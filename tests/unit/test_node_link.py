"""The signed node links (srt/managers/node_link.py) over real ZMQ sockets on 127.0.0.1: frames
with a wrong secret, tampered or replayed are dropped; a peer's id belongs to the first
connection that signs it."""

from __future__ import annotations

import socket
from typing import Iterator

import pytest
import zmq

from srt.managers import node_link
from srt.managers.io_struct import NodeHello, NodeShutdown, RankHello

SECRET = "the-shared-secret"


@pytest.fixture
def ctx() -> Iterator[zmq.Context]:
    c = zmq.Context()
    yield c
    c.destroy(linger=0)


@pytest.fixture
def port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _server(ctx: zmq.Context, port: int) -> node_link.LinkServer:
    return node_link.LinkServer(ctx, node_link.bind_addr("127.0.0.1", port), SECRET,
                                node_link.CONTROL)


def _client(ctx: zmq.Context, port: int, sender: int, secret: str = SECRET,
            channel: int = node_link.CONTROL) -> node_link.LinkClient:
    return node_link.LinkClient(ctx, node_link.connect_addr("127.0.0.1", port), secret, channel,
                                sender)


def test_signed_frames_go_both_ways(ctx: zmq.Context, port: int) -> None:
    server, client = _server(ctx, port), _client(ctx, port, 1)
    client.send(NodeHello(1, 2, 2, "h"))
    assert server.recv(5000) == (1, NodeHello(1, 2, 2, "h"))
    server.send(1, NodeShutdown())
    assert client.recv(5000) == NodeShutdown()


def test_wrong_secret_and_wrong_channel_are_dropped(ctx: zmq.Context, port: int) -> None:
    server = _server(ctx, port)
    wrong_secret = _client(ctx, port, 1, secret="another-secret")
    wrong_channel = _client(ctx, port, 2, channel=node_link.STEP)
    wrong_secret.send(NodeHello(1, 2, 2))
    wrong_channel.send(RankHello(2))
    assert server.recv(1000) is None
    assert server.verifier.refused == {1: 1, 2: 1}
    assert not server.knows(1) and not server.knows(2)
    with pytest.raises(node_link.LinkError, match="node 1 has not connected"):
        server.send(1, NodeShutdown(), wait_s=0.2)


def test_tampered_and_replayed_frames_are_dropped(ctx: zmq.Context, port: int) -> None:
    server = _server(ctx, port)
    raw = ctx.socket(zmq.DEALER)
    raw.connect(node_link.connect_addr("127.0.0.1", port))
    signer = node_link.Signer(SECRET.encode(), node_link.CONTROL, 1)
    first = signer.seal(NodeHello(1, 2, 2))
    raw.send_multipart(first)
    assert server.recv(5000) == (1, NodeHello(1, 2, 2))
    raw.send_multipart(first)  # replayed
    header, payload, mac = signer.seal(NodeHello(1, 4, 2))
    tampered = payload.replace(b"\x04", b"\x08")  # tp_size 4 -> 8
    assert tampered != payload
    raw.send_multipart([header, tampered, mac])
    assert server.recv(1000) is None
    assert server.verifier.refused == {1: 2}
    raw.close()


def test_first_connection_keeps_the_id(ctx: zmq.Context, port: int) -> None:
    server = _server(ctx, port)
    first, second = _client(ctx, port, 1), _client(ctx, port, 1)
    first.send(NodeHello(1, 2, 2))
    assert server.recv(5000) == (1, NodeHello(1, 2, 2))
    second.send(NodeHello(1, 2, 2))
    assert server.recv(1000) is None  # a second claim to node 1
    server.send(1, NodeShutdown())
    assert first.recv(5000) == NodeShutdown()
    assert second.recv(300) is None


def test_sender_zero_is_node0s(ctx: zmq.Context, port: int) -> None:
    with pytest.raises(ValueError):
        _client(ctx, port, 0)
