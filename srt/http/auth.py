"""API-key authentication as a raw ASGI middleware, on the normalized path.

Contract:
- Every request's path is normalized first (empty and `.` segments dropped, `..` resolved, no
  trailing slash; the server library has already percent-decoded it once, so `%2F` is a `/`
  here) and the request is routed on that same normalized path: what is checked is what runs.
- A path in `exempt` needs no key. A path in `admin_paths` needs the admin key when one is set,
  else the API key. Every other path needs the API key or the admin key when an API key is set.
  The method does not matter (HEAD and OPTIONS too), nor does the `Host` header.
- Keys are compared in constant time; a wrong key is a 401, an API key on an admin route a 403.
  Neither a key nor an Authorization header is ever logged.
"""

from __future__ import annotations

import hmac
import logging
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote

from srt.http.errors import send_error
from srt.logsafe import escape

logger = logging.getLogger("srt.http")

# Routes that change the server's state for everyone.
ADMIN_PATHS = frozenset({"/flush_cache", "/abort_request", "/load_lora_adapter",
                         "/unload_lora_adapter", "/v1/load_lora_adapter",
                         "/v1/unload_lora_adapter"})


def normalize_path(path: str) -> str:
    """`//v1//completions/`, `/v1/./completions`, `/x/../v1/completions` -> `/v1/completions`."""
    parts: list[str] = []
    for seg in path.split("/"):
        if seg in ("", "."):
            continue
        if seg == "..":
            if parts:
                parts.pop()
            continue
        parts.append(seg)
    return "/" + "/".join(parts)


def _matches(presented: bytes, key: str | None) -> bool:
    return key is not None and hmac.compare_digest(presented, key.encode())


@dataclass(frozen=True)
class AuthPolicy:
    api_key: str | None
    admin_api_key: str | None
    exempt: frozenset[str]
    admin_paths: frozenset[str] = ADMIN_PATHS

    @classmethod
    def from_args(cls, args: Any) -> "AuthPolicy":
        exempt = frozenset(normalize_path(p.strip()) for p in args.auth_exempt_paths.split(",")
                           if p.strip())
        return cls(args.api_key, args.admin_api_key, exempt)

    def decide(self, path: str, presented: bytes | None) -> tuple[int, str] | None:
        """None when the request may proceed, else (status, message)."""
        if path in self.exempt:
            return None
        admin_route = path in self.admin_paths
        needed = (self.admin_api_key or self.api_key) if admin_route else (
            self.api_key)
        if needed is None:
            return None
        if presented is None:
            return 401, "missing API key: send 'Authorization: Bearer <key>'"
        # Both comparisons always run, so timing does not tell which key was near.
        is_admin = _matches(presented, self.admin_api_key)
        is_user = _matches(presented, self.api_key)
        if admin_route and self.admin_api_key is not None:
            if is_admin:
                return None
            return (403, "this route needs the admin key") if is_user else (
                401, "invalid API key")
        return None if (is_admin or is_user) else (401, "invalid API key")


def bearer_token(headers: list[tuple[bytes, bytes]]) -> bytes | None:
    """The token of the first Authorization header if it is a Bearer one, else None."""
    for name, value in headers:
        if name.lower() == b"authorization":
            scheme, _, token = value.strip().partition(b" ")
            token = token.strip()
            return token if scheme.lower() == b"bearer" and token else None
    return None


class AuthMiddleware:
    """Normalizes the path, then lets a request through or answers 401/403 (the envelope)."""

    def __init__(self, app: Any, policy: AuthPolicy) -> None:
        self.app = app
        self.policy = policy

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = normalize_path(scope["path"])
        if path != scope["path"]:
            scope = dict(scope, path=path, raw_path=quote(path).encode())
        verdict = self.policy.decide(path, bearer_token(scope.get("headers", [])))
        if verdict is None:
            await self.app(scope, receive, send)
            return
        status, message = verdict
        client = scope.get("client") or ("?", 0)
        logger.info("refused %s %s from %s: %d", escape(scope.get("method", "")), escape(path),
                    escape(str(client[0])), status)
        headers = {"WWW-Authenticate": "Bearer"} if status == 401 else None
        code = "invalid_api_key" if status == 401 else "admin_key_required"
        await send_error(send, status, message, None, code, headers)
