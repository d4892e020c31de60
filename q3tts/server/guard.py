"""What every HTTP request passes before the app reads a byte of its body (plain ASGI, no buffering):

- authentication: with `--api-key`, a /v1/* request without the bearer token is answered 401 at once, its body
  never read (the WebSocket checks its handshake itself: websocket.py);
- the body's size: a `Content-Length` above `max_body_bytes` is answered 413 at once; a body sent without one
  is cut off at the limit with 413;
- the body's pace: each part must arrive within `body_timeout_s`, and the whole body within BODY_DEADLINE_PARTS
  times that, else 408 (a client that trickles its body holds no worker and, not yet submitted, no row; and its
  buffered body not for long);
- a client that leaves before its body is whole: nothing more is done (no answer, nobody to read it).
The body is read here, whole (it is bounded), and handed to the app from memory: FastAPI would turn a failure
while it reads the body into a 400. Its refusals are counted by `on_error(code)`, as the app's own are.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from starlette.datastructures import Headers
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from .auth import is_authorized, unauthorized
from .config import ServerConfig
from .errors import APIError

BODY_DEADLINE_PARTS = 10  # the whole body must arrive within this many body timeouts (300 s by default)


class RequestGuard:
    def __init__(self, app: ASGIApp, config: ServerConfig,
                 on_error: Callable[[str | None], None] = lambda code: None):
        self.app, self.config, self.on_error = app, config, on_error

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = Headers(scope=scope)
        if scope["path"].startswith("/v1/") and not is_authorized(self.config.api_key, headers.get("authorization")):
            return await self._refuse(unauthorized(), scope, receive, send)
        length = headers.get("content-length")
        if length is not None and (not length.isdigit() or int(length) > self.config.max_body_bytes):
            return await self._refuse(self._too_large(), scope, receive, send)
        try:
            body = await self._read_body(receive)
        except _Refused as e:
            return await self._refuse(e.error, scope, receive, send)
        if body[-1]["type"] != "http.request":  # the client left mid-body: not the server's error
            return
        await self.app(scope, _replay(body, receive), send)

    async def _refuse(self, error: APIError, scope: Scope, receive: Receive, send: Send) -> None:
        self.on_error(error.code)
        await error.response()(scope, receive, send)

    async def _read_body(self, receive: Receive) -> list[Message]:
        """The request's body messages, read within the limits (the app then reads them from memory)."""
        messages, received = [], 0
        timeout = self.config.body_timeout_s
        deadline = asyncio.get_running_loop().time() + BODY_DEADLINE_PARTS * timeout
        while True:
            left = deadline - asyncio.get_running_loop().time()
            try:
                message = await asyncio.wait_for(receive(), min(timeout, max(left, 0.0)))
            except asyncio.TimeoutError:
                whole = BODY_DEADLINE_PARTS * timeout
                late = f"within {timeout:g} s" if left > timeout else f"whole within {whole:g} s"
                raise _Refused(APIError(408, f"the request body did not arrive {late}",
                                        code="request_timeout")) from None
            messages.append(message)
            if message["type"] != "http.request":  # the client left
                return messages
            received += len(message.get("body", b""))
            if received > self.config.max_body_bytes:
                raise _Refused(self._too_large())
            if not message.get("more_body", False):
                return messages

    def _too_large(self) -> APIError:
        return APIError(413, f"the request body exceeds this server's {self.config.max_body_bytes} bytes",
                        code="request_too_large")


class _Refused(Exception):
    def __init__(self, error: APIError):
        super().__init__(error.message)
        self.error = error


def _replay(messages: list[Message], receive: Receive) -> Receive:
    """A `receive` that gives the body read already, then waits on the client (for its disconnect)."""
    pending = list(messages)

    async def replayed() -> Message:
        return pending.pop(0) if pending else await receive()

    return replayed
