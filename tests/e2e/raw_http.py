"""A bare HTTP/1.1 client on a socket: sends the request target exactly as given (HTTP
libraries normalize paths, which would hide the cases the server must handle itself)."""

from __future__ import annotations

import json
import socket
from dataclasses import dataclass
from typing import Any


@dataclass
class RawResponse:
    status: int
    headers: dict[str, str]  # lower-case names
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body)


def request(port: int, method: str, target: str, headers: dict[str, str] | None = None,
            body: bytes = b"", chunked: bool = False, timeout: float = 60.0) -> RawResponse:
    """One request on a fresh connection (Connection: close); the answer read to EOF.
    `headers` may override Host; Content-Length is added for a body unless `chunked`."""
    hdrs = {"Host": f"127.0.0.1:{port}", "Connection": "close"}
    hdrs.update(headers or {})
    if chunked:
        hdrs["Transfer-Encoding"] = "chunked"
        payload = f"{len(body):x}\r\n".encode() + body + b"\r\n0\r\n\r\n" if body else b"0\r\n\r\n"
    else:
        if body or method in ("POST", "PUT", "PATCH"):
            hdrs.setdefault("Content-Length", str(len(body)))
        payload = body
    head = f"{method} {target} HTTP/1.1\r\n" + "".join(f"{k}: {v}\r\n" for k, v in hdrs.items())
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        s.sendall(head.encode("latin-1") + b"\r\n" + payload)
        data = b""
        while True:
            try:
                chunk = s.recv(65536)
            except ConnectionResetError:
                break
            if not chunk:
                break
            data += chunk
    head_bytes, _, rest = data.partition(b"\r\n\r\n")
    lines = head_bytes.decode("latin-1").split("\r\n")
    status = int(lines[0].split(" ")[1])
    out_headers: dict[str, str] = {}
    for line in lines[1:]:
        name, _, value = line.partition(":")
        out_headers[name.strip().lower()] = value.strip()
    if out_headers.get("transfer-encoding") == "chunked":
        rest = _dechunk(rest)
    return RawResponse(status, out_headers, rest)


def _dechunk(data: bytes) -> bytes:
    out = b""
    while data:
        size_line, _, data = data.partition(b"\r\n")
        size = int(size_line.split(b";")[0], 16)
        if size == 0:
            break
        out += data[:size]
        data = data[size + 2:]
    return out
