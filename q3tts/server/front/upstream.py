"""The `--devices` front's HTTP/1.1 client to its engine processes: keep-alive connections per engine, responses
parsed by httptools (C), bodies handed on chunk by chunk as they arrive.

A general client (httpx) costs the front ~10 ms of CPU per relayed stream, most of it in its connection pool's
bookkeeping, and the front relays every request of every GPU from one event loop; this one costs a fraction of
that (docs/perf-notes.md, entry 34). Reading from an engine pauses while more than HIGH_WATER bytes wait for a
slow client, so a stalled reader holds memory for at most that much (and the engine's own send timeout ends it).
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import AsyncIterator

import httptools

CONNECT_TIMEOUT_S = 5.0
HIGH_WATER = 1 << 20  # body bytes buffered per response before reading from the engine pauses


class ConnectError(OSError):
    """The engine could not be reached: nothing was sent, another engine may take the request."""


class UpstreamError(OSError):
    """The engine's connection broke before or during its answer."""


class Response:
    """An engine's answer: status and headers once `head` is done, then `body()`."""

    def __init__(self, connection: _Connection):
        self.connection = connection
        self.status = 0
        self.headers: list[tuple[str, str]] = []
        self.head: asyncio.Future = asyncio.get_running_loop().create_future()
        self.chunks: deque[bytes] = deque()
        self.buffered = 0
        self.complete = False
        self.error: BaseException | None = None
        self.waiter: asyncio.Future | None = None

    def wake(self) -> None:
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_result(None)

    async def body(self) -> AsyncIterator[bytes]:
        """The body as it arrives; raises UpstreamError if the engine breaks it off. Leaving early closes the
        connection (the engine sees the client go and ends the request)."""
        try:
            while True:
                while self.chunks:
                    chunk = self.chunks.popleft()
                    self.buffered -= len(chunk)
                    self.connection.resume()
                    yield chunk
                if self.complete:
                    return
                if self.error is not None:
                    raise UpstreamError(f"the engine broke its answer off: {self.error}") from self.error
                self.waiter = asyncio.get_running_loop().create_future()
                await self.waiter
        finally:
            self.connection.release(self)

    async def read(self) -> bytes:
        return b"".join([chunk async for chunk in self.body()])


class _Connection(asyncio.Protocol):
    def __init__(self, pool: Pool):
        self.pool = pool
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.response: Response | None = None
        self.closed = False
        self.paused = False
        self.interim = False

    # asyncio.Protocol
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        if self.response is None:  # nothing was asked on this connection: an engine out of step
            self.close()
            return
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as e:
            self._fail(e)
            self.close()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self in self.pool.idle:  # the engine closed it while idle (its keep-alive timeout)
            self.pool.idle.remove(self)
        if self.response is not None and not self.response.complete:
            self._fail(exc or ConnectionResetError("the engine closed the connection"))

    # httptools callbacks
    def on_header(self, name: bytes, value: bytes) -> None:
        self.response.headers.append((name.decode("latin-1").lower(), value.decode("latin-1")))

    def on_headers_complete(self) -> None:
        status = self.parser.get_status_code()
        if 100 <= status < 200:  # an interim answer (100 Continue): the real one follows
            self.interim = True
            self.response.headers.clear()
            return
        self.response.status = status
        self.response.head.set_result(None)

    def on_body(self, body: bytes) -> None:
        response = self.response
        response.chunks.append(body)
        response.buffered += len(body)
        if response.buffered > HIGH_WATER and not self.paused:
            self.paused = True
            self.transport.pause_reading()
        response.wake()

    def on_message_complete(self) -> None:
        if self.interim:
            self.interim = False
            return
        self.response.complete = True
        self.response.wake()
        if not self.parser.should_keep_alive():
            self.close()

    # ours
    def _fail(self, error: BaseException) -> None:
        response = self.response
        if response is None or response.complete:
            return
        response.error = error
        if not response.head.done():
            response.head.set_exception(UpstreamError(f"the engine closed the connection: {error}"))
        response.wake()

    def resume(self) -> None:
        if self.paused and self.response.buffered <= HIGH_WATER // 2 and not self.closed:
            self.paused = False
            self.transport.resume_reading()

    def release(self, response: Response) -> None:
        """The response was read to its end (the connection goes back to the pool) or left (it is closed)."""
        if self.response is not response:
            return
        self.response = None
        if response.complete and not self.closed:
            self.pool.idle.append(self)
        else:
            self.close()

    def close(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.close()


class Pool:
    """Keep-alive connections to one engine (host:port)."""

    def __init__(self, host: str, port: int):
        self.host, self.port = host, port
        self.idle: list[_Connection] = []

    async def request(self, method: str, target: str, headers: list[tuple[str, str]] = (), body: bytes = b""
                      ) -> Response:
        """Sends the request and waits for the answer's status and headers. Raises ConnectError when the engine
        cannot be reached, UpstreamError when the connection breaks before the answer begins (a connection that
        the engine closed while idle is replaced once)."""
        head = [f"{method} {target} HTTP/1.1\r\nhost: {self.host}:{self.port}\r\ncontent-length: {len(body)}\r\n"]
        head += [f"{name}: {value}\r\n" for name, value in headers]
        data = "".join(head).encode("latin-1") + b"\r\n" + body
        for attempt in range(2):
            reused = bool(self.idle)
            connection = await self._connection()
            connection.response = response = Response(connection)
            connection.transport.write(data)
            try:
                await response.head
                return response
            except BaseException as e:  # broken, or cancelled while waiting: the connection is not reusable
                connection.response = None
                connection.close()
                if not isinstance(e, UpstreamError) or not reused or attempt:
                    raise
        raise AssertionError("unreachable")

    async def _connection(self) -> _Connection:
        while self.idle:
            connection = self.idle.pop()
            if not connection.closed:
                return connection
        loop = asyncio.get_running_loop()
        try:
            _, connection = await asyncio.wait_for(
                loop.create_connection(lambda: _Connection(self), self.host, self.port), CONNECT_TIMEOUT_S)
        except (OSError, asyncio.TimeoutError) as e:
            raise ConnectError(f"cannot reach {self.host}:{self.port}: {e}") from e
        return connection

    def close(self) -> None:
        while self.idle:
            self.idle.pop().close()


async def get(pool: Pool, target: str, timeout: float) -> tuple[int, bytes]:
    """(status, body) of a small GET, within `timeout` seconds."""
    async def fetch() -> tuple[int, bytes] | OSError:
        try:
            response = await pool.request("GET", target)
            return response.status, await response.read()
        except OSError as e:  # returned: when the wait is cancelled as this fails, nothing is left unretrieved
            return e

    result = await asyncio.wait_for(fetch(), timeout)
    if isinstance(result, OSError):
        raise result
    return result
