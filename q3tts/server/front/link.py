"""The speech path between a front and its engine processes (`q3tts serve` on a GPU, or with `--devices`): one
Unix socket per engine, every stream of that engine multiplexed over it.

The front does the HTTP work (requests, body checks, encoding, chunked writes to every client) and the engine
process does the model's (voices, prompts, the engine thread), so that the engine thread's per-frame Python
never waits for the interpreter lock behind thousands of chunk writes a second. Over the socket the front sends
a request's validated body (`Speak`, messages.py; a dialogue's turns together: `SpeakAll`, each on its own stream) and
may cancel it (`Cancel`); the engine answers `Accepted` (the audio will follow) or `Refused` (the API error a direct
request would get), then sends the stream's float32 PCM as
the engine hands it out (AUDIO, unchanged) and its end (`Finished` with the finish reason, or `Failed` with the
engine's error). A WebSocket session the front accepted crosses on a stream of its own as ASGI events
(`SocketOpen`, then `SocketEvent`s both ways): the engine process runs its own route for it (`_EngineSide._socket`),
so that the session's messages pass one WebSocket stack, the front's, instead of a relay's two (perf-notes 123).
Every message is a 9-byte header (kind: MESSAGE or AUDIO, stream number, payload length) and its
payload. The socket lives in a folder
only its user can enter: whoever reaches it may speak without the API key, as the front itself does.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import struct
from collections.abc import AsyncIterator, Coroutine
from typing import Any

import numpy as np

from ...engine import EngineError
from ...engine.stream import END
from .. import errors
from ..middleware import RELAYED
from ..schemas import SpeechRequest
from ..speech import RefusedAt, Speaker, Speech, SpeechStream
from .messages import (
    Accepted,
    Cancel,
    Failed,
    Finished,
    Message,
    Refused,
    SocketEvent,
    SocketOpen,
    Speak,
    SpeakAll,
    decode,
    encode,
)

log = logging.getLogger("q3tts.server")
MESSAGE, AUDIO = range(2)  # a typed message (messages.py), a stream's PCM
HEADER = struct.Struct("<BII")  # kind, stream number, payload bytes
CONNECT_TIMEOUT_S = 5.0
SOCKET_END = "q3tts.socket.end"  # a relayed session's last event: its route returned (`code`: how the front closes)
# A relayed session's client events its route has not read yet, at most: a client that sends faster than its route
# reads (a TCP connection's buffers would have held it back) loses the session (1008) instead of growing them.
MAX_UNREAD_EVENTS = 65536
# What of a WebSocket's ASGI scope crosses to the engine (not the app, the router, the transport or the state)
SCOPE_KEYS = ("type", "asgi", "http_version", "scheme", "path", "raw_path", "root_path", "query_string", "headers",
              "subprotocols", "client", "server")


class CoreUnavailable(OSError):
    """The engine process could not be reached, or went away before it answered: another engine may take the
    request (this one dropped it with the connection)."""


def pack(kind: int, number: int, payload: bytes = b"") -> bytes:
    return HEADER.pack(kind, number, len(payload)) + payload


def pack_message(number: int, message: Message) -> bytes:
    return pack(MESSAGE, number, encode(message))


class Parser:
    """Splits a byte stream into messages (kind, stream number, payload)."""

    def __init__(self):
        self.buffer = bytearray()

    def feed(self, data: bytes) -> list[tuple[int, int, bytes]]:
        """The messages `data` completes (a partial one waits for the rest)."""
        buffer, messages = self.buffer, []
        buffer += data
        offset, end = 0, len(buffer)
        while end - offset >= HEADER.size:
            kind, number, size = HEADER.unpack_from(buffer, offset)
            if end - offset - HEADER.size < size:
                break
            start = offset + HEADER.size
            offset = start + size
            messages.append((kind, number, bytes(buffer[start:offset])))
        del buffer[:offset]
        return messages


class _Writer:
    """Writes a connection's messages, those of one event-loop turn in one system call (an engine hand-out
    reaches every running stream in the same turn)."""

    def __init__(self, transport: asyncio.Transport):
        self.transport, self.pending, self.scheduled = transport, [], False

    def send(self, message: bytes) -> None:
        self.pending.append(message)
        if not self.scheduled:
            self.scheduled = True
            asyncio.get_running_loop().call_soon(self._flush)

    def _flush(self) -> None:
        self.scheduled = False
        if not self.transport.is_closing():
            self.transport.write(b"".join(self.pending))
        self.pending.clear()


# ---- the engine process's side --------------------------------------------------------------------------------

class CoreServer:
    """Listens on `path` in the engine process and speaks what arrives through `speaker` (the speech service); the
    WebSocket sessions relayed to it run on `app` (the engine process's ASGI app: its routes and middleware)."""

    def __init__(self, speaker: Speaker, path: str, app: Any = None):
        self.speaker, self.path, self.app = speaker, path, app
        self.server: asyncio.AbstractServer | None = None
        self.connections: set[_EngineSide] = set()

    async def start(self) -> None:
        if os.path.exists(self.path):
            os.unlink(self.path)  # left by an engine process that was killed: the front starts it again
        self.server = await asyncio.get_running_loop().create_unix_server(lambda: _EngineSide(self), self.path)

    async def drain(self, timeout_s: float) -> None:
        """Stops listening and lets the streams in flight finish for up to `timeout_s`."""
        if self.server is not None:
            self.server.close()
        for connection in self.connections:  # (sessions are closed at once, as uvicorn closes its own: 1012)
            connection.close_sockets(1012)
        tasks = [t for c in self.connections for t in c.tasks.values()]
        if tasks:
            await asyncio.wait(tasks, timeout=timeout_s)
        for connection in list(self.connections):
            connection.transport.close()


class _EngineSide(asyncio.Protocol):
    def __init__(self, server: CoreServer):
        self.server, self.parser = server, Parser()
        self.tasks: dict[int, asyncio.Task] = {}  # per stream number: preparing, then streaming
        self.streams: dict[int, SpeechStream] = {}  # submitted
        self.sockets: dict[int, asyncio.Queue] = {}  # relayed WebSocket sessions: the client's events for the route

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport
        self.out = _Writer(transport)  # type: ignore[arg-type]
        self.server.connections.add(self)

    def data_received(self, data: bytes) -> None:
        for kind, number, payload in self.parser.feed(data):
            try:
                message = decode(payload) if kind == MESSAGE else None
            except Exception:
                message = None
            if isinstance(message, Speak):
                self._start(number, self._speak(number, message))
            elif isinstance(message, SpeakAll):
                self._start(number, self._speak_all(message))
            elif isinstance(message, Cancel):
                self._cancel(number)
            elif isinstance(message, SocketOpen) and self.server.app is not None and number not in self.tasks:
                inbox = self.sockets[number] = asyncio.Queue()  # (now: the events that follow in this read)
                inbox.put_nowait({"type": "websocket.connect"})
                self._start(number, self._socket(number, message.scope, inbox))
            elif isinstance(message, SocketEvent):
                if (inbox := self.sockets.get(number)) is not None:  # (else its route returned: nobody reads it)
                    self._to_route(number, inbox, message.event)
            else:
                log.error("the front sent what an engine does not take (kind %d): closing its connection", kind)
                self.transport.close()
                return

    def connection_lost(self, exc: Exception | None) -> None:
        self.server.connections.discard(self)
        for inbox in self.sockets.values():  # the front went away: its sessions' clients with it
            inbox.put_nowait({"type": "websocket.disconnect", "code": 1006})
        for number in list(self.tasks):  # nobody reads these streams
            if number not in self.sockets:
                self._cancel(number)

    def _to_route(self, number: int, inbox: asyncio.Queue, event: dict) -> None:
        unread = inbox.qsize()
        if unread < MAX_UNREAD_EVENTS:
            inbox.put_nowait(event)
        elif unread == MAX_UNREAD_EVENTS:  # (once: the route sees its client gone after what it has)
            log.warning("a WebSocket session from the front sent %d messages its route had not read: closed",
                        unread)
            self._close_socket(number, inbox, 1008, "messages sent faster than the server reads them")

    def close_sockets(self, code: int) -> None:
        """Closes every relayed session now."""
        for number, inbox in self.sockets.items():
            self._close_socket(number, inbox, code)

    def _close_socket(self, number: int, inbox: asyncio.Queue, code: int, reason: str = "") -> None:
        """The front closes the session's client with `code`; the route, after what it has, sees its client gone."""
        self.out.send(pack_message(number, SocketEvent({"type": "websocket.close", "code": code, "reason": reason})))
        inbox.put_nowait({"type": "websocket.disconnect", "code": code})

    def _start(self, number: int, work: Coroutine[Any, Any, None]) -> None:
        task = self.tasks[number] = asyncio.get_running_loop().create_task(work)
        task.add_done_callback(lambda t, n=number: self.tasks.pop(n) if self.tasks.get(n) is t else None)

    def _cancel(self, number: int) -> None:
        stream = self.streams.get(number)
        if stream is not None:
            stream.cancel()
        elif (task := self.tasks.get(number)) is not None:
            task.cancel()  # still preparing

    async def _speak(self, number: int, request: Speak) -> None:
        try:
            speech = await self.server.speaker.speak(request.body, request.request_id)
        except Exception as e:
            self.out.send(pack_message(number, _refusal(number, e)))
            return
        self.streams[number] = speech.stream
        await self._send(number, speech)

    async def _speak_all(self, request: SpeakAll) -> None:
        """Every request checked before any is submitted (`Speaker.speak_all`); then each streams on its own."""
        try:
            speeches = await self.server.speaker.speak_all(list(request.bodies), request.request_id)
        except Exception as e:
            refused = _refusal(request.numbers[0], e)
            for number in request.numbers:
                self.out.send(pack_message(number, refused))
            return
        for number, speech in zip(request.numbers, speeches):
            self.streams[number] = speech.stream  # (before its task runs: a Cancel meanwhile finds it)
            self._start(number, self._send(number, speech))

    async def _socket(self, number: int, scope: dict, inbox: asyncio.Queue) -> None:
        """A WebSocket session the front accepted, run by the app's route on the events the front sends (`inbox`,
        a websocket.connect first, as a server's); the route's events go back as they come. A route that fails
        ends the session as uvicorn ends it, with 1011."""
        out = self.out

        async def send(event: dict) -> None:  # (a function: the app's middleware looks for a transport on a method's
            out.send(pack_message(number, SocketEvent(event)))  # object, and this link's is not the client's)

        code = 1000
        try:
            await self.server.app({**scope, "state": {RELAYED: True}, "extensions": {}}, inbox.get, send)
        except Exception:
            log.exception("a WebSocket session from the front failed")
            code = 1011
        finally:
            del self.sockets[number]
            out.send(pack_message(number, SocketEvent({"type": SOCKET_END, "code": code})))

    async def _send(self, number: int, speech: Speech) -> None:
        """An accepted request's audio, then its end."""
        stream = speech.stream
        self.out.send(pack_message(number, Accepted(speech.input_tokens, speech.sample_rate)))
        try:
            async for pcm in stream.achunks():
                self.out.send(pack(AUDIO, number, pcm.tobytes()))
            self.out.send(pack_message(number, Finished(stream.finish_reason)))
        except EngineError as e:
            self.out.send(pack_message(number, Failed(str(e))))
        except Exception as e:
            log.exception("request %d from the front failed mid-stream", number)
            self.out.send(pack_message(number, Failed(f"internal error: {e}")))
        finally:
            del self.streams[number]
            stream.cancel()  # (nothing if it ended; a task cancelled with the connection frees its row)


def _refusal(number: int, e: Exception) -> Refused:
    """A request's refusal: its API error (of request `index`, for RefusedAt), else a 500 (a failure of ours: the
    client gets one, as from one process, not a hang)."""
    if isinstance(e, RefusedAt):
        return Refused.of(e.error, e.index)
    if isinstance(e, errors.APIError):
        return Refused.of(e)
    log.error("request %d from the front failed before its audio", number, exc_info=e)
    return Refused.of(errors.APIError(500, "internal server error", type=errors.SERVER, code="internal_error"))


# ---- the front's side -----------------------------------------------------------------------------------------

class CoreClient(asyncio.Protocol):
    """The front's connection to one engine process."""

    def __init__(self):
        self.parser, self.numbers = Parser(), itertools.count()
        self.streams: dict[int, RemoteStream] = {}
        self.sockets: dict[int, RemoteSocket] = {}
        self.closed = False

    @classmethod
    async def connect(cls, path: str) -> CoreClient:
        try:
            _, client = await asyncio.wait_for(asyncio.get_running_loop().create_unix_connection(cls, path),
                                               CONNECT_TIMEOUT_S)
        except (OSError, asyncio.TimeoutError) as e:
            raise CoreUnavailable(f"cannot reach the engine at {path}: {e}") from e
        return client

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport

    async def speak(self, body: SpeechRequest, request_id: str) -> Speech:
        """The request on this engine: its Speech once accepted; the engine's APIError if refused;
        CoreUnavailable if the connection is gone or breaks first."""
        stream = self._open(request_id)
        self.transport.write(pack_message(stream.number, Speak(request_id, body)))
        try:
            accepted: Accepted = await stream.accepted
        except asyncio.CancelledError:  # the client went away while the engine prepared it
            stream.cancel()
            raise
        return Speech(stream, accepted.input_tokens, accepted.sample_rate)

    async def speak_all(self, bodies: list[SpeechRequest], request_id: str) -> list[Speech]:
        """The requests spoken together on this engine (`Speaker.speak_all`): their Speeches once all are
        accepted; RefusedAt if the engine refused one (it submitted none); CoreUnavailable as `speak`."""
        streams = [self._open(f"{request_id}.{i}") for i in range(len(bodies))]
        numbers = tuple(s.number for s in streams)
        self.transport.write(pack_message(numbers[0], SpeakAll(request_id, tuple(bodies), numbers)))
        try:
            accepted: list[Accepted] = [await s.accepted for s in streams]
        except BaseException:  # refused, the engine gone, or the client went away while the engine prepared them
            for stream in streams:
                stream.cancel()
            raise
        return [Speech(s, a.input_tokens, a.sample_rate) for s, a in zip(streams, accepted)]

    def open_socket(self, scope: dict) -> RemoteSocket:
        """A WebSocket session (its ASGI `scope`, `socket_scope`) run by the engine's route: its events to and from
        it (`RemoteSocket`)."""
        if self.closed:
            raise CoreUnavailable("the engine's connection is closed")
        socket = RemoteSocket(self, next(self.numbers) & 0xFFFFFFFF)
        self.sockets[socket.number] = socket
        self.transport.write(pack_message(socket.number, SocketOpen(scope)))
        return socket

    def _open(self, request_id: str) -> RemoteStream:
        if self.closed:
            raise CoreUnavailable("the engine's connection is closed")
        stream = RemoteStream(self, next(self.numbers) & 0xFFFFFFFF, request_id)
        self.streams[stream.number] = stream
        return stream

    def close(self) -> None:
        self.transport.close()

    def data_received(self, data: bytes) -> None:
        for kind, number, payload in self.parser.feed(data):
            stream = self.streams.get(number)
            if stream is None:
                if (socket := self.sockets.get(number)) is not None:
                    socket.events.put_nowait(decode(payload).event)  # type: ignore[union-attr]
                continue  # (else cancelled here: what was under way when the engine heard of it)
            if kind == AUDIO:
                stream.queue.put_nowait(np.frombuffer(payload, dtype=np.float32))
                continue
            message = decode(payload)
            if isinstance(message, Accepted):
                stream.accepted.set_result(message)
            elif isinstance(message, Refused):
                stream.end(accepted=message.error())
            elif isinstance(message, Finished):
                stream.finish_reason = message.reason
                stream.end(END)
            elif isinstance(message, Failed):
                stream.end(EngineError(message.message))

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        for socket in self.sockets.values():
            socket.events.put_nowait(None)
        for stream in list(self.streams.values()):
            stream.end(EngineError("the engine process went away mid-stream"),
                       accepted=CoreUnavailable("the engine process went away before it answered"))


class RemoteStream:
    """A request's audio from an engine process (the interface of `RequestStream` the routes use)."""

    def __init__(self, client: CoreClient, number: int, request_id: str):
        self.client, self.number, self.request_id = client, number, request_id
        self.accepted: asyncio.Future = asyncio.get_running_loop().create_future()
        self.queue: asyncio.Queue = asyncio.Queue()
        self.finish_reason: str | None = None
        self.finished = False

    def end(self, item: object = None, accepted: BaseException | None = None) -> None:
        """The last message of the stream: before acceptance, `accepted` is raised to `speak`; after it, `item`
        (END or an error) ends the audio."""
        self.finished = True
        self.client.streams.pop(self.number, None)
        if not self.accepted.done():
            self.accepted.set_exception(accepted or CoreUnavailable("the engine ended the request unanswered"))
            self.accepted.exception()  # (retrieved: no warning if `speak` was cancelled meanwhile)
        elif item is not None:
            self.queue.put_nowait(item)

    async def achunks(self) -> AsyncIterator[np.ndarray]:
        while True:
            item = await self.queue.get()
            if item is END:
                return
            if isinstance(item, BaseException):
                raise item
            yield item

    def cancel(self) -> None:
        if not self.finished:
            self.finished = True
            self.client.streams.pop(self.number, None)
            if not self.client.closed:
                self.client.transport.write(pack_message(self.number, Cancel()))


class RemoteSocket:
    """A WebSocket session run by an engine process's route (`CoreClient.open_socket`): `send` gives it the client's
    ASGI events, `events` holds its own as they come (None: the engine went away), `close` forgets it."""

    def __init__(self, client: CoreClient, number: int):
        self.client, self.number = client, number
        self.events: asyncio.Queue = asyncio.Queue()

    def send(self, event: dict) -> None:
        if not self.client.closed:
            self.client.transport.write(pack_message(self.number, SocketEvent(event)))

    def close(self) -> None:
        self.client.sockets.pop(self.number, None)


def socket_scope(scope: dict, request_id: str) -> dict:
    """What of a WebSocket's ASGI scope the engine's route is given (`SCOPE_KEYS`), the front's request id in its
    x-request-id header (the engine logs the session under it)."""
    out = {key: scope[key] for key in SCOPE_KEYS if key in scope}
    out["headers"] = [(k, v) for k, v in scope.get("headers", []) if k != b"x-request-id"]
    out["headers"].append((b"x-request-id", request_id.encode("latin-1")))
    return out
