"""Per-request context as plain ASGI middleware (no buffering, so streams and disconnects pass through):
an `x-request-id` on every response (an incoming one is honoured when it is sane), the request counter, and a
last-resort 500 in the standard error shape for failures before a response started."""

from __future__ import annotations

import logging
import re
import uuid

from starlette.datastructures import Headers, MutableHeaders
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from .errors import SERVER, APIError
from .metrics import ServerMetrics

log = logging.getLogger("q3tts.server")
HEADER = "x-request-id"
_SANE_ID = re.compile(r"[A-Za-z0-9._:\-]{1,128}")


def request_id_of(scope: Scope) -> str:
    return scope.get("state", {}).get("request_id", "")


class RequestContextMiddleware:
    def __init__(self, app: ASGIApp, metrics: ServerMetrics):
        self.app, self.metrics = app, metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket"):
            return await self.app(scope, receive, send)
        incoming = Headers(scope=scope).get(HEADER, "")
        request_id = incoming if _SANE_ID.fullmatch(incoming) else f"req_{uuid.uuid4().hex}"
        scope.setdefault("state", {})["request_id"] = request_id
        started = False

        async def send_with_id(message: Message) -> None:
            nonlocal started
            if message["type"] in ("http.response.start", "websocket.http.response.start"):
                started = True
                MutableHeaders(scope=message).append(HEADER, request_id)
                self._count(scope, message["status"])
            elif message["type"] == "websocket.accept":
                message.setdefault("headers", [])
                message["headers"] = [*message["headers"], (HEADER.encode(), request_id.encode())]
            await send(message)

        try:
            await self.app(scope, receive, send_with_id)
        except Exception:
            if started or scope["type"] != "http":
                raise  # the stream is cut (the client sees an incomplete response)
            log.exception("unhandled error in %s %s [%s]", scope.get("method"), scope.get("path"), request_id)
            self.metrics.count_error("internal_error")
            error = APIError(500, "internal server error", type=SERVER, code="internal_error")
            await error.response()(scope, receive, send_with_id)

    def _count(self, scope: Scope, status: int) -> None:
        route = scope.get("route")
        path = getattr(route, "path", None) or "unmatched"
        self.metrics.requests.labels(path, scope.get("method", "WS"), str(status)).inc()
