"""The `--devices` front's client to its engines (q3tts/server/front/upstream.py), against a raw asyncio HTTP server:
keep-alive reuse, a connection the engine closed while idle, a body broken off, an engine that is not there, a
reader that leaves early."""

from __future__ import annotations

import asyncio
import socket

import pytest

from q3tts.server.front import upstream


class Engine:
    """Answers each request with `chunks` as a chunked body; counts connections; `mode` breaks things."""

    def __init__(self, chunks: list[bytes], mode: str = "ok"):
        self.chunks, self.mode, self.connections, self.disconnects = chunks, mode, 0, 0

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = int(next(line.split(b":")[1] for line in head.split(b"\r\n")
                                  if line.lower().startswith(b"content-length")))
                await reader.readexactly(length)
                if self.mode == "interim":
                    writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
                writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: audio/pcm\r\ntransfer-encoding: chunked\r\n\r\n")
                for i, chunk in enumerate(self.chunks):
                    if self.mode == "break" and i == 1:
                        writer.close()
                        return
                    writer.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
                    await writer.drain()
                    await asyncio.sleep(0.01)
                writer.write(b"0\r\n\r\n")
                await writer.drain()
                if self.mode == "close-after":
                    writer.close()
                    return
        except (asyncio.IncompleteReadError, ConnectionError):
            self.disconnects += 1


async def serve(engine: Engine):
    server = await asyncio.start_server(engine.handle, "127.0.0.1", 0)
    return server, upstream.Pool("127.0.0.1", server.sockets[0].getsockname()[1])


def test_keep_alive_and_a_connection_closed_while_idle():
    async def main():
        for mode, connections in (("ok", 1), ("close-after", 3), ("interim", 1)):
            engine = Engine([b"a" * 10, b"b" * 20000, b"c"], mode)
            server, pool = await serve(engine)
            for _ in range(3):
                response = await pool.request("POST", "/v1/audio/speech", [("x-request-id", "r")], b"{}")
                assert response.status == 200 and ("content-type", "audio/pcm") in response.headers
                assert await response.read() == b"a" * 10 + b"b" * 20000 + b"c"
                await asyncio.sleep(0.05)  # the engine's close reaches us while the connection is idle
            assert engine.connections == connections
            assert len(pool.idle) == (0 if mode == "close-after" else 1)  # closed ones leave the pool
            pool.close()
            server.close()

    asyncio.run(main())


def test_a_body_broken_off_raises():
    async def main():
        server, pool = await serve(Engine([b"a", b"b", b"c"], "break"))
        response = await pool.request("POST", "/", body=b"x")
        with pytest.raises(upstream.UpstreamError):
            await response.read()
        server.close()

    asyncio.run(main())


def test_an_engine_that_is_not_there():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]

    async def main():
        with pytest.raises(upstream.ConnectError):
            await upstream.Pool("127.0.0.1", port).request("GET", "/ready")

    asyncio.run(main())


def test_a_reader_that_leaves_closes_the_connection():
    async def main():
        engine = Engine([b"a"] * 50)
        server, pool = await serve(engine)
        response = await pool.request("POST", "/", body=b"x")
        body = response.body()
        assert await body.__anext__() == b"a"
        await body.aclose()
        await asyncio.sleep(0.1)
        assert engine.disconnects == 1 and not pool.idle
        server.close()

    asyncio.run(main())
