"""Puts the protective layers on the FastAPI app and adds the operations routes.

Middleware order, outermost first: metrics (counts every answer, refusals too), CORS (only with
--cors-allow-origins), authentication (normalizes the path the app then routes on), body size,
the lifecycle gate (503 while draining or failed, srt/http/lifecycle.py).
Routes added here: `GET /metrics`, `GET /health_generate`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from typing import Any

from srt.http.auth import AuthMiddleware, AuthPolicy
from srt.http.errors import error_response, install_error_handlers
from srt.http.health import ReadinessProbe
from srt.http.lifecycle import Lifecycle, LifecycleGate
from srt.http.limits import BodySizeMiddleware, QueueGate, RequestLimits
from srt.http.request_log import Observers, RequestLog
from srt.http.schemas import describe

logger = logging.getLogger("srt.http")

SECRET_ARGS = ("api_key", "admin_api_key", "node_secret")
STATS_TIMEOUT_S = 5.0


class _CORS:
    """Starlette's CORS middleware, except that a preflight from an origin that is not allowed
    goes on to the app (and gets its 401/405 in the envelope) instead of a plain-text 400."""

    def __init__(self, app: Any, origins: list[str]) -> None:
        from starlette.middleware.cors import CORSMiddleware

        self.app = app
        self.cors = CORSMiddleware(app, allow_origins=origins, allow_methods=["*"],
                                   allow_headers=["*"], allow_credentials=False)

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["method"] == "OPTIONS":
            headers = {k.lower(): v for k, v in scope.get("headers", [])}
            origin = headers.get(b"origin")
            if origin is not None and not self.cors.is_allowed_origin(
                    origin.decode("latin-1")):
                await self.app(scope, receive, send)
                return
        await self.cors(scope, receive, send)


class HttpLayer:
    """What the route handlers call: `admit` each request body before any per-item work."""

    def __init__(self, args: Any, tm: Any, supervisor: Any) -> None:
        from srt.metrics import ServerMetrics

        self.args = args
        self.limits = RequestLimits.from_args(args)
        self.queue = QueueGate(args.max_queued_requests, lambda: len(tm.states))
        self.request_log = RequestLog(args.log_requests)
        self.metrics = ServerMetrics.create()
        self.probe = ReadinessProbe(tm, supervisor)
        tm.observer = Observers(self.metrics, self.request_log)

    def admit(self, endpoint: str, body: Any) -> None:
        """Limits, then the queue; raises ApiError (400 limit_exceeded, 503 queue_full)."""
        check = {"/generate": self.limits.check_generate,
                 "/v1/completions": self.limits.check_completion,
                 "/v1/chat/completions": self.limits.check_chat}[endpoint]
        samples = check(body)
        self.queue.admit(samples)
        self.request_log.received(endpoint, body)

    def public_args(self) -> dict[str, Any]:
        """The server arguments as /get_server_info reports them: keys only as set or not."""
        out = dataclasses.asdict(self.args)
        for name in SECRET_ARGS:
            out[name] = "<set>" if out[name] else None
        return out


def install(app: Any, args: Any, tm: Any, supervisor: Any, lifecycle: Lifecycle) -> HttpLayer:
    from fastapi.responses import JSONResponse, Response

    from srt.metrics import MetricsMiddleware

    layer = HttpLayer(args, tm, supervisor)
    install_error_handlers(app)
    describe(app)

    @app.get("/health_generate")
    async def health_generate() -> Any:
        ready, reason = await layer.probe.check()
        if ready:
            return JSONResponse({"status": "ok"})
        return error_response(503, reason, None, "not_ready")

    @app.get("/metrics")
    async def metrics() -> Any:
        m = layer.metrics
        if m is None:
            return error_response(503, "metrics need the prometheus-client package "
                                  "(pip install prometheus-client)", None, "metrics_unavailable")
        try:
            m.update_model_stats(await asyncio.wait_for(tm.get_stats(), STATS_TIMEOUT_S))
        except asyncio.TimeoutError:
            logger.warning("/metrics: the model process did not report its stats in %.0f s",
                           STATS_TIMEOUT_S)
        body, content_type = m.render()
        return Response(body, media_type=content_type)

    app.add_middleware(LifecycleGate, lifecycle=lifecycle)
    app.add_middleware(BodySizeMiddleware, max_bytes=args.max_request_body_bytes)
    app.add_middleware(AuthMiddleware, policy=AuthPolicy.from_args(args))
    if args.cors_allow_origins:
        origins = [o.strip() for o in args.cors_allow_origins.split(",") if o.strip()]
        app.add_middleware(_CORS, origins=origins)
    if layer.metrics is not None:
        paths = lambda: {getattr(r, "path", None) for r in app.routes}  # noqa: E731
        app.add_middleware(MetricsMiddleware, metrics=layer.metrics, routes=paths)
    return layer
