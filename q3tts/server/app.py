"""The app factory and its lifespan: load the checkpoint (a failure stops start-up), then build and warm the
engine in the background while `/health` already answers and `/ready` says 503; `serve` runs it with uvicorn.

One process serves one model on one device. With `core_socket` set, it is an engine process behind a front
(front/app.py: `q3tts serve` on a GPU, or `--devices`), which sends it speech requests over that socket (front/link.py).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI

from . import errors
from .auth import HideQueryKeys
from .config import ServerConfig
from .front.link import CoreServer
from .guard import RequestGuard
from .metrics import ServerMetrics
from .middleware import HideCancelledTracebacks, KeepTransport, RequestContextMiddleware
from .routes import dialogue, nari, playground, speech, status, voices, websocket
from .service import SpeechService
from .voice_store import VoiceStore

log = logging.getLogger("q3tts.server")
MAX_HEADER_BYTES = 64 * 1024  # a request's line and headers (nginx takes 32 KiB, Node.js 16 KiB)
_HIDE_QUERY_KEYS = HideQueryKeys()
_HIDE_CANCELLED_TRACEBACKS = HideCancelledTracebacks()


def create_app(config: ServerConfig, tts: Any = None, start_ready: bool = False) -> FastAPI:
    """The ASGI app for `config.model` (or an already loaded `tts`, e.g. in tests). `start_ready`: start-up
    returns only once the engine is warm, and fails if it cannot start (for hosts such as Ray Serve that send
    traffic as soon as start-up returns and replace a replica whose start-up failed)."""
    metrics = ServerMetrics()

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        front = asyncio.create_task(_exit_with_front(config.front_pid)) if config.front_pid else None
        failed = "the model did not load"
        try:
            model = tts if tts is not None else await asyncio.to_thread(_load, config)
            failed = "the server cannot start"  # (the voice settings do not suit this checkpoint)
            service = SpeechService(model, config, VoiceStore(config.voices_dir), observer=metrics)
            await asyncio.to_thread(service.resolver.named.load_default_voice)
        except (ValueError, OSError, RuntimeError, MemoryError) as e:  # a checkpoint that does not load, no memory
            give_up = getattr(app.state, "give_up", None)
            if start_ready or give_up is None:
                raise
            log.error("%s: %s", failed, e)  # (one line, and serve() exits 1)
            if front is not None:
                front.cancel()
            give_up()
            yield
            return
        metrics.engine_source = lambda: service.engine
        app.state.service, app.state.speaker = service, service
        service.on_give_up = getattr(app.state, "give_up", None)  # (serve(): the process exits)
        core = CoreServer(service, config.core_socket, app) if config.core_socket else None
        if core is not None:
            await core.start()
        starting = asyncio.create_task(service.start())
        if start_ready:
            await starting
            if not service.ready:
                await service.stop()
                raise RuntimeError(service.failure or "the engine did not start")
        try:
            yield
        finally:
            starting.cancel()
            if front is not None:
                front.cancel()
            if core is not None:  # (uvicorn drained its own connections; the front's streams finish here)
                await core.drain(config.drain_timeout_s)
            await service.stop()

    app = FastAPI(title="q3tts", summary="Qwen3-TTS speech server", lifespan=lifespan)
    app.state.config, app.state.metrics, app.state.started_at = config, metrics, int(time.time())
    app.state.draining = False  # True from SIGTERM on (serve(); the front sets its own: front/app.py)
    errors.install_handlers(app, on_error=metrics.count_error)
    app.add_middleware(RequestGuard, config=config, on_error=metrics.count_error)
    app.add_middleware(RequestContextMiddleware, metrics=metrics)  # outermost: ids and counts for every answer
    for module in (speech, dialogue, voices, websocket, nari, status, playground):
        app.include_router(module.router)
    return app


async def _exit_with_front(front: int) -> None:
    """An engine process ends when its front does: a front killed before it could stop its engines would otherwise
    leave them holding their GPUs. (It becomes another process's child then. The front passes its id: the parent
    read here would already be that other process if the front died while this one was still starting.)"""
    while os.getppid() == front:
        await asyncio.sleep(1.0)
    log.error("the front (process %d) is gone: this engine process stops", front)
    os.kill(os.getpid(), signal.SIGTERM)  # (uvicorn's own shutdown: streams drain, the engine stops)


def _load(config: ServerConfig) -> Any:
    from ..api.tts import TTS

    log.info("loading %s", config.model)
    return TTS.from_pretrained(config.model, device=config.device, dtype=config.dtype, lora=config.lora,
                               engine_config=config.engine_config())


def serve(config: ServerConfig, log_level: str = "info") -> None:
    """Runs the server until SIGINT/SIGTERM: then it stops accepting connections, streams in flight finish for up
    to `drain_timeout_s`, and the process exits 0. If the model does not load, or the engine fails for good, it
    exits 1."""
    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    app = create_app(config)

    def draining() -> None:
        app.state.draining = True
        service = getattr(app.state, "service", None)
        if service is not None:
            service.draining = True

    # An engine process behind a front: the front logs the clients' requests; the engine's own HTTP answers the
    # front's polls (20 a second), and its address is not one to connect to.
    behind_front = config.core_socket is not None
    level = "warning" if behind_front and log_level == "info" else log_level
    server = uvicorn_server(app, config, level, draining, access_log=not behind_front)
    app.state.give_up = server.give_up  # (the service calls it when its engine cannot be rebuilt)
    server.run()
    if server.gave_up:
        raise SystemExit(1)


def _header_timeout(seconds: float) -> dict:
    """uvicorn's HTTP protocol (httptools) with a deadline for each request's line and headers: uvicorn has none,
    so a connection that sends nothing, or its headers a byte at a time, was held open for good (thousands of them
    exhaust the process's file descriptors). As a body's parts, they must arrive within --body-timeout. And a bound
    on their size, MAX_HEADER_BYTES (answered 431): httptools has none, and held a request's 20 MB of headers in
    memory (uvicorn's h11 protocol stops at 16 KiB)."""
    try:
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
    except ImportError:  # (no httptools: uvicorn's h11 protocol, as it is)
        return {}

    class HeaderTimeoutProtocol(HttpToolsProtocol):
        header_timer: asyncio.TimerHandle | None = None
        header_bytes = 0  # received since the request began, while its headers are still incomplete

        def _arm(self) -> None:
            self._disarm()
            self.header_timer = self.loop.call_later(seconds, self._expired)
            self.header_bytes = 0

        def _disarm(self) -> None:
            if self.header_timer is not None:
                self.header_timer.cancel()
                self.header_timer = None

        def _expired(self) -> None:
            if not self.transport.is_closing():
                self.transport.close()

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._arm()

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            if self.header_timer is None or self.transport.is_closing():  # (the headers are whole: a body follows)
                return
            self.header_bytes += len(data)
            if self.header_bytes > MAX_HEADER_BYTES:
                self._disarm()
                self.transport.write(_headers_too_large())
                self.transport.close()

        def on_message_begin(self) -> None:
            super().on_message_begin()
            self._arm()

        def on_headers_complete(self) -> None:
            self._disarm()
            super().on_headers_complete()

        def connection_lost(self, exc) -> None:
            self._disarm()
            super().connection_lost(exc)

    return {"http": HeaderTimeoutProtocol}


def _headers_too_large() -> bytes:
    """A 431 in the error shape, as the whole response of a connection that is closed after it."""
    body = json.dumps(errors.error_body(f"the request's line and headers exceed this server's {MAX_HEADER_BYTES} "
                                        "bytes", errors.INVALID_REQUEST, code="headers_too_large")).encode()
    return (b"HTTP/1.1 431 Request Header Fields Too Large\r\ncontent-type: application/json\r\n"
            b"content-length: %d\r\nconnection: close\r\n\r\n" % len(body)) + body


def uvicorn_options(config: ServerConfig) -> dict[str, Any]:
    """uvicorn's settings for the connections (tests/server/harness.py serves with them too). A WebSocket message
    may hold what a request body may (a base64 reference in session.config; uvicorn's default limit is 16 MiB). No
    per-message deflate: the messages are PCM, which it cannot shrink, and small JSON events, and it would cost a
    zlib pass over every one on both sides."""
    return dict(ws_max_size=config.max_body_bytes, ws_per_message_deflate=False,
                **_header_timeout(config.body_timeout_s))


def uvicorn_server(app: Any, config: ServerConfig, log_level: str, on_signal: Callable[[], None],
                   **options: Any) -> Any:
    """uvicorn's server for `app` on config.host:port, draining for up to config.drain_timeout_s on SIGINT/SIGTERM
    (after `on_signal()`); `give_up()` stops it, `gave_up` then says so (the caller exits 1 for its supervisor).
    uvicorn drains on SIGTERM, then raises the signal again under the handler it found: a no-op one is installed,
    so that a clean drain exits 0 (supervisors read a signal death as a crash). Its request lines show no
    `?api_key=` value; a stream cut at the drain timeout is one line (middleware.py), not a traceback."""
    import uvicorn

    class Server(uvicorn.Server):
        gave_up = False

        def handle_exit(self, sig, frame) -> None:
            on_signal()
            super().handle_exit(sig, frame)

        def give_up(self) -> None:
            self.gave_up = self.should_exit = True

    server = Server(uvicorn.Config(KeepTransport(app), host=config.host, port=config.port, log_level=log_level,
                                   timeout_graceful_shutdown=config.drain_timeout_s, **uvicorn_options(config),
                                   **options))
    for name in ("uvicorn.access", "uvicorn.error"):  # (after uvicorn.Config has configured its loggers)
        logging.getLogger(name).addFilter(_HIDE_QUERY_KEYS)  # (once: addFilter skips a filter it holds)
    logging.getLogger("uvicorn.error").addFilter(_HIDE_CANCELLED_TRACEBACKS)
    signal.signal(signal.SIGTERM, lambda *_: None)
    return server
