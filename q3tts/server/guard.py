"""What every HTTP request passes before the app reads a byte of its body (plain ASGI, no buffering):

- authentication: with `--api-key`, a /v1/* request without the bearer token is answered 401 at once, its body
  never read (the WebSocket checks its handshake itself: websocket.py);
- the body's size: a `Content-Length` above `max_body_bytes` is answered 413 at once; a body sent without one
  is cut off at the limit with 413;
- the body's pace: each part must arrive within `body_timeout_s`, else 408 (a client that trickles its body holds
  no worker and, not yet submitted, no row).
"""

from __future__ import annotations

import asyncio

from starlette.datastructures import Headers
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from .auth import is_authorized, unauthorized
from .config import ServerConfig
from .errors import APIError


class BodyRefused(Exception):
    def __init__(self, error: APIError):
        super().__init__(error.message)
        self.error = error


class RequestGuard:
    def __init__(self, app: ASGIApp, config: ServerConfig):
        self.app, self.config = app, config

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = Headers(scope=scope)
        if scope["path"].startswith("/v1/") and not is_authorized(self.config.api_key, headers.get("authorization")):
            return await unauthorized().response()(scope, receive, send)
        length = headers.get("content-length")
        if length is not None and (not length.isdigit() or int(length) > self.config.max_body_bytes):
            return await self._too_large().response()(scope, receive, send)
        started = False

        async def send_tracked(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, self._guarded(receive), send_tracked)
        except BodyRefused as e:
            if started:
                raise
            await e.error.response()(scope, receive, send)

    def _guarded(self, receive: Receive) -> Receive:
        received, body_done = 0, False

        async def guarded_receive() -> Message:
            nonlocal received, body_done
            if body_done:  # afterwards only a disconnect can come: no deadline
                return await receive()
            try:
                message = await asyncio.wait_for(receive(), self.config.body_timeout_s)
            except asyncio.TimeoutError:
                raise BodyRefused(APIError(408, f"the request body did not arrive within "
                                                f"{self.config.body_timeout_s:g} s", code="request_timeout")) from None
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                body_done = not message.get("more_body", False)
                if received > self.config.max_body_bytes:
                    raise BodyRefused(self._too_large())
            return message

        return guarded_receive

    def _too_large(self) -> APIError:
        return APIError(413, f"the request body exceeds this server's {self.config.max_body_bytes} bytes",
                        code="request_too_large")
