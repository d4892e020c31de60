"""Per-request context as plain ASGI middleware (no buffering, so streams and disconnects pass through):
an `x-request-id` on every response (an incoming one is honoured when it is sane), the request counter (HTTP
requests and WebSocket sessions, each once), a 415 for a compressed request body, a last-resort 500 in the
standard error shape for failures before a response started, and one line for a request the server cancelled (at
the drain timeout) instead of uvicorn's traceback."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import socket
import struct
import uuid

from starlette.datastructures import Headers, MutableHeaders
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from .errors import SERVER, APIError
from .metrics import ServerMetrics

log = logging.getLogger("q3tts.server")
HEADER = "x-request-id"
_SANE_ID = re.compile(r"[A-Za-z0-9._:\-]{1,128}")
BODY_TAIL_BYTES = 256  # room for a closing boundary (at most 70 characters) and a short epilogue after it
SERVICE_RESTART = 1012  # the close code of the WebSocket sessions open at SIGTERM (uvicorn closes them at once)
RELAYED = "relayed_by_front"  # (scope state) a session an engine process runs for the front, which logs its end


def request_id_of(scope: Scope) -> str:
    return scope.get("state", {}).get("request_id", "")


class KeepTransport:
    """The outermost ASGI layer: notes the connection's transport in the scope (uvicorn's `send` is a method of
    the object that holds it), so that `drop_connection` can end a connection whose client stopped reading. Closing
    it the usual way would wait, forever, for the client to take the megabytes still queued for it; the app's
    stream, and its row, are freed either way."""

    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        transport = getattr(getattr(send, "__self__", None), "transport", None)
        if transport is not None:
            scope["q3tts.transport"] = transport
        await self.app(scope, receive, send)


def drop_connection(scope: Scope) -> None:
    """Ends the request's connection at once, what is queued for the client discarded (see KeepTransport)."""
    transport = scope.get("q3tts.transport")
    if transport is None:
        return
    sock = transport.get_extra_info("socket")
    if sock is not None:  # linger 0: the close resets the connection instead of still sending what the kernel holds
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    transport.abort()


async def close_with(websocket, event: dict, code: int, timeout_s: float) -> None:
    """Sends a WebSocket's last event (an error) and closes it with `code`, each within `timeout_s`; a client that
    is gone or does not read has its connection dropped instead (the close frame would wait behind what it does
    not read)."""
    with contextlib.suppress(Exception):
        await asyncio.wait_for(websocket.send_json(event), timeout_s)
        await asyncio.wait_for(websocket.close(code=code), timeout_s)
        return
    drop_connection(websocket.scope)


class HideCancelledTracebacks(logging.Filter):
    """Drops uvicorn's "Exception in ASGI application" for a request it cancelled (still running at the drain
    timeout): its traceback says no more than the line RequestContextMiddleware logged for that request; the same
    for a stream ended by an error already told in one line (`logged`: a client that stopped reading, an engine
    that failed or went away mid-stream: once ~75 lines of traceback per stream); and its
    "ASGI callable returned without completing handshake" after a WebSocket refused with a denial response (auth:
    uvicorn's websockets-sansio protocol logs it though the client got its 401; anyone could fill the log with
    ERROR lines so)."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = str(record.msg)
        error = record.exc_info[1] if record.exc_info else None
        told = (isinstance(error, asyncio.CancelledError) or getattr(error, LOGGED, False)) and \
            message.startswith("Exception in ASGI application")
        return not (told or message.startswith("ASGI callable returned without completing handshake"))


LOGGED = "q3tts_logged"  # set on an exception that ends a response and was logged in one line already


def logged(error: BaseException) -> BaseException:
    """`error`, marked as told in one line: uvicorn's traceback for it is dropped (HideCancelledTracebacks)."""
    setattr(error, LOGGED, True)
    return error


class RequestContextMiddleware:
    def __init__(self, app: ASGIApp, metrics: ServerMetrics):
        self.app, self.metrics = app, metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket"):
            return await self.app(scope, receive, send)
        incoming = Headers(scope=scope).get(HEADER, "")
        request_id = incoming if _SANE_ID.fullmatch(incoming) else f"req_{uuid.uuid4().hex}"
        scope.setdefault("state", {})["request_id"] = request_id
        try:
            if scope["type"] == "websocket":
                return await self._session(scope, receive, send, request_id)
            await self._request(scope, receive, send, request_id)
        except asyncio.CancelledError as e:  # (uvicorn's, at the drain timeout: HideCancelledTracebacks drops its own)
            log.warning("%s %s [%s] cancelled before it ended (%s): its connection is closed",
                        scope.get("method", "WebSocket"), scope.get("path"), request_id, e or "no reason given")
            raise

    async def _request(self, scope: Scope, receive: Receive, send: Send, request_id: str) -> None:
        """An HTTP request, counted as its response starts."""
        started = False

        async def send_with_id(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                MutableHeaders(scope=message).append(HEADER, request_id)
                self._count(scope, message["status"])
            await send(message)

        encoding = Headers(scope=scope).get("content-encoding", "identity").strip().lower()
        if encoding not in ("", "identity"):  # (read as if plain, a gzip body would fail as "not UTF-8")
            error = APIError(415, f"Content-Encoding {encoding!r} is not supported: send the body uncompressed",
                             code="unsupported_content_encoding")
            return await error.response()(scope, receive, send_with_id)
        if Headers(scope=scope).get("content-type", "").lower().startswith("multipart/"):
            receive = _noting_the_tail(scope, receive)
        try:
            await self.app(scope, receive, send_with_id)
        except Exception:
            if started:
                raise  # the stream is cut (the client sees an incomplete response)
            log.exception("unhandled error in %s %s [%s]", scope.get("method"), scope.get("path"), request_id)
            self.metrics.count_error("internal_error")
            error = APIError(500, "internal server error", type=SERVER, code="internal_error")
            await error.response()(scope, receive, send_with_id)

    async def _session(self, scope: Scope, receive: Receive, send: Send, request_id: str) -> None:
        """A WebSocket session, counted once as it ends: with the close code it ended with (the server's, else the
        client's), or the HTTP status of a refused handshake."""
        status: int | str | None = None
        accepted = False

        async def receive_noting_close() -> Message:
            nonlocal status
            message = await receive()
            if message["type"] == "websocket.disconnect" and status is None:
                status = _client_close_code(message.get("code", 1005))
            return message

        async def send_with_id(message: Message) -> None:
            nonlocal status, accepted
            if message["type"] == "websocket.accept":
                accepted = True
                message["headers"] = [*message.get("headers", []), (HEADER.encode(), request_id.encode())]
            elif message["type"] == "websocket.http.response.start":
                MutableHeaders(scope=message).append(HEADER, request_id)
                status = message["status"]
            elif message["type"] == "websocket.close" and status is None:
                status = message.get("code", 1000) if accepted else 403  # (before the handshake: uvicorn's 403)
            await send(message)

        failed = True
        try:
            await self.app(scope, receive_noting_close, send_with_id)
            failed = False
        finally:
            status = status or _unclosed_status(scope, accepted, failed)
            self._count(scope, status)
            if status == SERVICE_RESTART and not scope["state"].get(RELAYED):
                log.warning("WebSocket %s [%s]: closed with %d, the server is shutting down", scope["path"],
                            request_id, SERVICE_RESTART)

    def _count(self, scope: Scope, status: int | str) -> None:
        route = scope.get("route")
        path = getattr(route, "path", None) or "unmatched"
        self.metrics.requests.labels(path, scope.get("method", "WS"), str(status)).inc()


def _noting_the_tail(scope: Scope, receive: Receive) -> Receive:
    """`receive`, keeping the body's last bytes in the scope's state (`body_tail`): the form parser ends a cut-off
    multipart body without a word (its unfinished part left out), and only its missing closing boundary tells."""
    state = scope.setdefault("state", {})
    state["body_tail"] = b""

    async def receive_noting_tail() -> Message:
        message = await receive()
        if message["type"] == "http.request":
            state["body_tail"] = (state["body_tail"] + message.get("body", b""))[-BODY_TAIL_BYTES:]
        return message
    return receive_noting_tail


def _client_close_code(code: int) -> int | str:
    """A close code the client chose, as a metric label: the protocol's own (1000-1015) as they are, the others
    (3000-4999 are the application's to pick) as one label, so a client cannot mint label values."""
    return code if isinstance(code, int) and 1000 <= code <= 1015 else "other"


def _unclosed_status(scope: Scope, accepted: bool, failed: bool) -> int:
    """How a WebSocket session ended that the app saw no close of: refused before the handshake (uvicorn answers
    500); closed by uvicorn at SIGTERM while the app did not read (1012); the app failed (1011); or it returned with
    the session open (uvicorn drops the connection: 1006)."""
    if not accepted:
        return 500
    if getattr(scope["app"].state, "draining", False):
        return SERVICE_RESTART
    return 1011 if failed else 1006
