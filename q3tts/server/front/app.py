"""The front of `q3tts serve` on GPUs: one GPU (the default there), or every GPU of a host behind one endpoint
(`q3tts serve MODEL --devices cuda:0,cuda:1`, or `--data-parallel 2`).

One `q3tts serve` process per device (its own engine and interpreter: no engine's host loop waits on another's lock)
on a loopback port, and this front in the main process. The front authenticates and bounds requests (guard.py), runs
the speech route itself (parsing, encoding and writing every client's chunks: the HTTP work) and hands each speech
request to the least-loaded ready engine over that engine's socket (link.py), whose process does the model's work
alone; a WebSocket session goes over that socket too (the front speaks the protocol, the engine's route runs on its
events), the other routes it relays over HTTP. The least-loaded engine: the fewest requests and
sessions the front has under way there (the front carries them all). A request whose engine cannot be reached goes
to the next one. Voices live in one folder that every engine reads and changes (each change under the folder's
lock: voice_store.py). An engine that exits or says it is unhealthy leaves the rotation (streams it was sending end
cut off; the rest keep serving), and an engine process that exited is started again (up to MAX_RESTARTS times each),
unless it never was ready (a start-up failure); one that answered and then answers nothing for max(--send-timeout,
MIN_HUNG_S) is killed first. With no engine left the front exits 1. /ready is 200 only when every engine is
ready, /health while any serves; /metrics has each engine's metrics with an `engine` label ("0", "1", ...), their
sums (`engine="all"`) and the front's own HTTP counters (`q3tts_router_*`).
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.parse
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import TypeVar

from fastapi import FastAPI, Request, WebSocket
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families

from .. import errors
from ..app import uvicorn_server
from ..auth import websocket_authorized
from ..config import ServerConfig
from ..guard import RequestGuard
from ..metrics import CONTENT_TYPE, ServerMetrics
from ..middleware import RequestContextMiddleware, drop_connection, request_id_of
from ..routes import dialogue, playground, speech
from ..routes.nari import PROTOCOL as NARI_PROTOCOL
from ..routes.websocket import send_error
from ..schemas import SpeechRequest
from ..speech import Speech
from . import upstream
from .link import SOCKET_END, CoreClient, CoreUnavailable, socket_scope
from .upstream import Pool

log = logging.getLogger("q3tts.server")
T = TypeVar("T")
POLL_S = 0.1
MAX_RESTARTS = 5  # times each engine process is started again after it exited, before it is left out for good
MIN_HUNG_S = 5.0  # an engine that answered and then answers no poll for max(this, --send-timeout) is killed
# Not passed on: hop-by-hop headers, and those the proxy sets itself.
HOP_HEADERS = {"connection", "keep-alive", "transfer-encoding", "te", "upgrade", "content-length", "host", "expect"}


@dataclass
class Backend:
    """One engine process and what the front knows of it."""

    index: int
    device: str
    url: str
    core_path: str | None = None  # its speech socket (link.py)
    process: subprocess.Popen | None = None
    ready: bool = False
    was_ready: bool = False  # ever: an engine that exits before is not started again
    healthy: bool = True
    sessions: int = 0  # WebSocket sessions relayed to it now
    metrics: str = ""  # its /metrics at the last scrape (what the front reports if it does not answer the next)
    command: list[str] = field(default_factory=list)  # how to start its process (again)
    env: dict[str, str] | None = None
    restarts: int = 0
    answered: bool = False  # a poll of this process (since it was last started) was answered
    silent_since: float | None = None  # when its polls stopped being answered (None: the last one was)
    pool: Pool = field(init=False, repr=False)  # keep-alive connections to it
    core: CoreClient | None = field(default=None, repr=False)  # its speech connection, opened once it is ready

    def __post_init__(self):
        host, port = self.url.removeprefix("http://").rsplit(":", 1)
        self.pool = Pool(host, int(port))

    @property
    def in_flight(self) -> int:
        """Speech requests the engine holds (submitted, not yet finished) and WebSocket sessions, from the front's
        own count: exact at every moment, unlike a poll of the engine's gauges."""
        return (len(self.core.streams) if self.core is not None else 0) + self.sessions

    async def connect(self) -> CoreClient:
        """Its speech connection, opened if there is none (an engine started again listens on the same path)."""
        if self.core is None or self.core.closed:
            self.core = await CoreClient.connect(self.core_path)
        return self.core

    async def speak(self, body: SpeechRequest, request_id: str) -> Speech:
        return await (await self.connect()).speak(body, request_id)

    async def speak_all(self, bodies: list[SpeechRequest], request_id: str) -> list[Speech]:
        return await (await self.connect()).speak_all(bodies, request_id)

    def start(self) -> None:
        self.process = subprocess.Popen(self.command, env=self.env)
        self.answered, self.silent_since = False, None  # (it answers nothing while it loads its model)

    @property
    def alive(self) -> bool:
        return self.healthy and (self.process is None or self.process.poll() is None)


class Backends:
    def __init__(self, backends: list[Backend], hung_s: float = 30.0):
        self.all = backends
        self.hung_s = max(hung_s, MIN_HUNG_S)
        self.stopping = False  # set on SIGTERM/SIGINT: engines that exit now are not started again
        self.on_give_up: Callable[[], None] | None = None  # called once no engine is left (serve_devices: exit 1)

    async def speak(self, body: SpeechRequest, request_id: str) -> Speech:
        """The request on the least-loaded ready engine; on the next one if that one cannot be reached or goes
        away before it answers (it dropped the request with the connection)."""
        return await self._on_an_engine(lambda backend: backend.speak(body, request_id))

    async def speak_all(self, bodies: list[SpeechRequest], request_id: str) -> list[Speech]:
        """The requests (a dialogue's turns) on one engine, as `speak`: checked there before any is submitted,
        they generate as rows of its batch."""
        return await self._on_an_engine(lambda backend: backend.speak_all(bodies, request_id))

    async def _on_an_engine(self, speak: Callable[[Backend], Awaitable[T]]) -> T:
        if self.stopping:
            raise errors.shutting_down()
        tried: tuple[Backend, ...] = ()
        while True:
            backend = self.pick(exclude=tried)
            try:
                return await speak(backend)
            except CoreUnavailable as e:
                backend.ready = False  # until the next poll says otherwise
                log.error("engine %d (%s) did not take a request (%s): trying another", backend.index,
                          backend.device, e)
                tried += (backend,)

    def pick(self, exclude: tuple[Backend, ...] = ()) -> Backend:
        """The least-loaded ready engine (not in `exclude`); 503 if there is none."""
        candidates = [b for b in self.all if b.alive and b.ready and b not in exclude]
        if not candidates:
            if any(b.alive for b in self.all):
                raise errors.not_ready()
            raise errors.engine_failed("no engine is serving")
        return min(candidates, key=lambda b: (b.in_flight, b.index))

    async def poll_forever(self) -> None:
        while True:
            await asyncio.gather(*(self._poll(b) for b in self.all))
            await asyncio.sleep(POLL_S)

    async def _poll(self, backend: Backend) -> None:
        if backend.process is not None and backend.process.poll() is not None:
            backend.ready = False
            if not backend.was_ready:  # a start-up failure (checkpoint, memory, settings): it would fail again
                if backend.healthy:
                    log.error("engine %d (%s) exited with %s before it was ready (its log above says why): left out",
                              backend.index, backend.device, backend.process.returncode)
                backend.healthy = False
            elif backend.command and backend.restarts < MAX_RESTARTS and not self.stopping:
                backend.restarts += 1
                log.error("engine %d (%s) exited with %s: out of rotation, started again (%d of %d)", backend.index,
                          backend.device, backend.process.returncode, backend.restarts, MAX_RESTARTS)
                backend.start()
                backend.healthy = True
            elif backend.healthy:
                log.error("engine %d (%s) exited with %s after %d restarts: left out", backend.index,
                          backend.device, backend.process.returncode, backend.restarts)
                backend.healthy = False
            if not any(b.alive for b in self.all) and not self.stopping and self.on_give_up is not None:
                log.error("no engine is left to serve: exiting")
                self.stopping = True
                self.on_give_up()
            return
        try:
            (ready, _), (health, _) = await asyncio.gather(
                *(upstream.get(backend.pool, path, timeout=2) for path in ("/ready", "/health")))
        except (OSError, asyncio.TimeoutError):
            backend.ready = False
            self._silent(backend)
            return
        backend.answered, backend.silent_since = True, None
        if backend.healthy and health != 200:
            log.error("engine %d (%s) is unhealthy: out of rotation", backend.index, backend.device)
        backend.healthy, backend.ready = health == 200, ready == 200
        if backend.ready and not backend.was_ready:
            log.info("engine %d (%s) ready", backend.index, backend.device)
        backend.was_ready = backend.was_ready or backend.ready
        if backend.ready and backend.core_path:
            with contextlib.suppress(CoreUnavailable):  # (connected before its first request; else at it)
                await backend.connect()

    def _silent(self, backend: Backend) -> None:
        """An engine that answered before and has answered no poll for `hung_s` since is hung (stopped,
        deadlocked): its streams would stall for good and nothing would restart it, so it is killed; the next poll
        starts it again (or, if it never became ready, leaves it out)."""
        now = time.monotonic()
        if backend.silent_since is None:
            backend.silent_since = now
        elif (now - backend.silent_since > self.hung_s and backend.answered and backend.process is not None
              and backend.process.poll() is None):
            log.error("engine %d (%s) has answered nothing for %.0f s: killed, to be started again", backend.index,
                      backend.device, now - backend.silent_since)
            backend.process.kill()
            backend.silent_since = None

    async def scrape(self) -> list[str]:
        """Every engine's /metrics now (an engine that does not answer: its last)."""
        async def one(backend: Backend) -> str:
            with contextlib.suppress(OSError, asyncio.TimeoutError):
                status, text = await upstream.get(backend.pool, "/metrics", timeout=2)
                if status == 200:
                    backend.metrics = text.decode()
            return backend.metrics

        return await asyncio.gather(*(one(b) for b in self.all))

    async def close(self) -> None:
        for backend in self.all:
            backend.pool.close()
            if backend.core is not None:
                backend.core.close()


def create_router_app(config: ServerConfig, backends: Backends) -> FastAPI:
    metrics = ServerMetrics(namespace="q3tts_router", engine=False)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        poller = asyncio.create_task(backends.poll_forever())
        # As the engine process does (service.py): what exists now lives as long as the process, out of the
        # garbage collector's sight; a full collection over it would hold every stream's next chunk back.
        gc.collect()
        gc.freeze()
        try:
            yield
        finally:
            poller.cancel()
            await backends.close()

    app = FastAPI(title="q3tts", summary="Qwen3-TTS speech server (one engine per device)", lifespan=lifespan)
    app.state.config, app.state.metrics, app.state.draining = config, metrics, False
    app.state.speaker = backends
    errors.install_handlers(app, on_error=metrics.count_error)
    app.add_middleware(RequestGuard, config=config, on_error=metrics.count_error)
    app.add_middleware(RequestContextMiddleware, metrics=metrics)
    app.include_router(playground.router)
    app.include_router(speech.router)
    app.include_router(dialogue.router)

    @app.api_route("/v1/audio/voices", methods=["GET", "POST"])
    @app.post("/v1/audio/voices/combine")
    @app.api_route("/v1/audio/voices/{voice_id}", methods=["GET", "DELETE"])
    @app.get("/v1/models")
    @app.get("/v1/models/{model:path}")
    async def voices_and_models(request: Request) -> Response:
        """To the least-loaded ready engine: they share the voices folder, whose changes each makes under its lock
        (voice_store.py), so uploads go on while one engine is restarted."""
        backend = backends.pick()
        try:
            return await _forward(backend, request, await request.body())
        except OSError as e:
            log.error("engine %d (%s) did not answer %s %s: %s", backend.index, backend.device, request.method,
                      request.url.path, e)
            raise errors.APIError(503, f"engine {backend.index} did not answer; retry", type=errors.SERVER,
                                  code="engine_error", headers={"Retry-After": "1"}) from e

    @app.api_route("/health", methods=["GET", "HEAD"])
    async def health() -> JSONResponse:
        serving = sum(b.alive for b in backends.all)
        return JSONResponse({"status": "ok" if serving else "unhealthy", "engines": len(backends.all),
                             "serving": serving}, status_code=200 if serving else 503)

    @app.api_route("/ready", methods=["GET", "HEAD"])
    async def ready() -> JSONResponse:
        ok = not app.state.draining and all(b.alive and b.ready for b in backends.all)
        engines = [{"device": b.device, "ready": b.alive and b.ready, "restarts": b.restarts} for b in backends.all]
        return JSONResponse({"ready": ok, "engines": engines}, status_code=200 if ok else 503)

    @app.get("/metrics")
    async def all_metrics() -> Response:
        return Response(generate_latest(metrics.registry) + merged_metrics(await backends.scrape()),
                        media_type=CONTENT_TYPE)

    @app.websocket("/v1/audio/speech/stream")
    async def speech_stream(websocket: WebSocket) -> None:
        if not await websocket_authorized(websocket):
            return
        await websocket.accept()
        try:
            backend = backends.pick()
            backend.sessions += 1
            try:
                await _relay(backend, websocket)
            finally:
                backend.sessions -= 1
        except errors.APIError as e:
            metrics.count_error(e.code)
            await send_error(websocket, e)

    @app.websocket("/v1/audio/speech/ws")
    async def nari_speech(websocket: WebSocket) -> None:
        """nari's nari.speech.v1 (server/routes/nari.py), relayed to an engine process as the session above: the
        live text travels with it."""
        if not await websocket_authorized(websocket):
            return
        if NARI_PROTOCOL not in websocket.scope.get("subprotocols", []):
            await websocket.accept()
            await websocket.close(code=1002, reason=f"required subprotocol: {NARI_PROTOCOL}")
            return
        await websocket.accept(subprotocol=NARI_PROTOCOL)
        try:
            backend = backends.pick()
            backend.sessions += 1
            try:
                await _relay(backend, websocket)
            finally:
                backend.sessions -= 1
        except errors.APIError as e:
            metrics.count_error(e.code)
            await send_error(websocket, e)

    return app


def _raw_target(scope) -> str:
    """The path and query as the client sent them, still percent-encoded (a decoded path, "my voice" or "José",
    is no valid request target for the engine)."""
    path = scope.get("raw_path") or urllib.parse.quote(scope["path"]).encode()
    query = scope.get("query_string", b"")
    return (path + (b"?" + query if query else b"")).decode("latin-1")


async def _forward(backend: Backend, request: Request, body: bytes) -> Response:
    """The request on `backend`, its answer streamed back as it comes (status and headers first)."""
    headers = [(k, v) for k, v in request.headers.items() if k not in HOP_HEADERS | {"x-request-id"}]
    headers.append(("x-request-id", request_id_of(request.scope)))  # one id in the front's and the engine's logs
    response = await backend.pool.request(request.method, _raw_target(request.scope), headers, body)
    passed = [(k, v) for k, v in response.headers if k not in HOP_HEADERS | {"x-request-id", "date", "server"}]

    async def chunks() -> AsyncIterator[bytes]:
        try:
            async for chunk in response.body():
                yield chunk
        except upstream.UpstreamError:
            log.error("engine %d (%s) broke a stream off", backend.index, backend.device)
            raise  # the client's response ends cut off (no final chunk): an error, not a short success

    relayed = StreamingResponse(chunks(), status_code=response.status)
    relayed.raw_headers = [(k.encode("latin-1"), v.encode("latin-1")) for k, v in passed]
    return relayed


async def _relay(backend: Backend, websocket: WebSocket) -> None:
    """A WebSocket session the front accepted, run by `backend`'s own route over its speech connection (link.py:
    the client's ASGI events there, the route's back), until either side closes."""
    request_id = request_id_of(websocket.scope)
    try:
        socket = (await backend.connect()).open_socket(socket_scope(websocket.scope, request_id))
    except CoreUnavailable as e:
        log.error("engine %d (%s) could not take a WebSocket session: %s", backend.index, backend.device, e)
        raise errors.engine_failed(f"engine {backend.index} could not take the session") from e
    send_timeout_s = websocket.app.state.config.send_timeout_s
    engine_ended, client_code = False, 1006  # (1006: the client did not close; it stopped reading, or the front stops)

    async def client_to_engine() -> None:
        nonlocal client_code
        while (event := await websocket.receive())["type"] != "websocket.disconnect":
            socket.send(event)
        client_code = event.get("code", 1000)

    async def engine_to_client() -> None:
        nonlocal engine_ended
        while (event := await socket.events.get()) is not None:
            kind = event["type"]
            if kind == "websocket.send":
                try:  # (a client that stops reading loses the session after send_timeout_s, as from one process)
                    await asyncio.wait_for(websocket.send(event), send_timeout_s)
                except asyncio.TimeoutError:
                    log.warning("websocket %s: the client stopped reading; session closed", request_id)
                    drop_connection(websocket.scope)
                    return
            elif kind in ("websocket.close", SOCKET_END):  # (websocket.accept: the front accepted it already)
                engine_ended = True
                with contextlib.suppress(Exception):
                    await websocket.close(event.get("code", 1000), event.get("reason"))
                return
        log.error("engine %d (%s) went away mid-session", backend.index, backend.device)
        raise errors.engine_failed(f"engine {backend.index} ended the session without closing it")

    tasks = [asyncio.create_task(client_to_engine()), asyncio.create_task(engine_to_client())]
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in tasks:
            task.cancel()
        if not engine_ended:  # (the client left, stopped reading or failed a send, or the front stops: the route
            socket.send({"type": "websocket.disconnect", "code": client_code})  # ends and frees its row)
        socket.close()
    ended = await asyncio.gather(*tasks, return_exceptions=True)
    if isinstance(ended[1], errors.APIError):
        raise ended[1]


def merged_metrics(texts: list[str]) -> bytes:
    """The engines' /metrics as one exposition: each sample with `engine="<index>"`, and `engine="all"` the sum
    over engines (every q3tts engine metric is a count or a histogram: sums are meaningful)."""
    families: dict[str, Metric] = {}
    totals: dict[tuple, float] = {}
    for index, text in enumerate(texts):
        for family in text_string_to_metric_families(text):
            if family.name.endswith("_created"):
                continue
            merged = families.setdefault(family.name, Metric(family.name, family.documentation, family.type))
            for sample in family.samples:
                if sample.name.endswith("_created"):
                    continue
                merged.add_sample(sample.name, {"engine": str(index), **sample.labels}, sample.value)
                key = (family.name, sample.name, tuple(sorted(sample.labels.items())))
                totals[key] = totals.get(key, 0.0) + sample.value
    for (family, name, labels), value in totals.items():
        families[family].add_sample(name, {"engine": "all", **dict(labels)}, value)

    class Merged:
        def collect(self):
            return families.values()

    registry = CollectorRegistry()
    registry.register(Merged())
    return generate_latest(registry)


# An engine process drains this much longer than its front: when a signal reaches both at once (Ctrl-C in a
# terminal signals the whole process group; systemd's stop, the whole control group), the front cuts what still
# streams at its own drain timeout (a line each), and an engine never cuts first (the front would log each cut as
# an engine's failure, with a traceback).
ENGINE_DRAIN_MARGIN_S = 5.0


def engine_args(config: ServerConfig, log_level: str) -> list[str]:
    """`q3tts serve` flags that give an engine process the front's settings (its device, port and address
    are added per engine; the API key travels in the environment, not on a command line others can read)."""
    args = ["--max-running", config.max_running, "--max-waiting", config.max_waiting,
            "--max-input-chars", config.max_input_chars, "--body-timeout", config.body_timeout_s,
            "--drain-timeout", config.drain_timeout_s + ENGINE_DRAIN_MARGIN_S, "--send-timeout", config.send_timeout_s,
            "--max-body-bytes", config.max_body_bytes, "--prefix-cache-gb", config.prefix_cache_gb,
            "--log-level", log_level]
    for flag, value in (("--dtype", config.dtype), ("--lora", config.lora), ("--max-context", config.max_context),
                        ("--kv-cache-gb", config.kv_cache_gb),
                        ("--gpu-memory-utilization", config.gpu_memory_utilization),
                        ("--served-model-name", config.served_model_name),
                        ("--default-voice", config.default_voice),
                        ("--ref-audio-hosts", ",".join(config.ref_audio_hosts) or None)):
        if value is not None:
            args += [flag, value]
    for name, target in config.voice_aliases.items():
        args += ["--voice-alias", f"{name}={target}"]
    if config.allow_ref_audio_urls:
        args.append("--allow-ref-audio-urls")
    if config.runaway_guard is None:
        args.append("--no-runaway-guard")
    return [str(a) for a in args]


def start_backends(config: ServerConfig, devices: list[str], log_level: str, scratch: str) -> list[Backend]:
    """One `q3tts serve` per device on a loopback port, all sharing one voices folder (without `voices_dir`, one
    in `scratch`, a folder only this user may enter, which also holds the engines' sockets)."""
    voices_dir = config.voices_dir or os.path.join(scratch, "voices")
    env = {**os.environ, "Q3TTS_API_KEY": config.api_key or ""}
    backends = []
    for index, device in enumerate(devices):
        port, core_path = _free_port(), os.path.join(scratch, f"engine{index}.sock")
        cmd = [sys.executable, "-m", "q3tts.cli", "serve", config.model, *engine_args(config, log_level),
               "--device", device, "--host", "127.0.0.1", "--port", str(port), "--voices-dir", str(voices_dir),
               "--core-socket", core_path, "--front-pid", str(os.getpid())]
        backend = Backend(index, device, f"http://127.0.0.1:{port}", core_path, command=cmd, env=env)
        log.info("engine %d (%s): starting its process (requests reach it through this front)", index, device)
        backend.start()
        backends.append(backend)
    return backends


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve_devices(config: ServerConfig, devices: list[str], log_level: str = "info") -> None:
    """The front on config.host:config.port over one engine process per device, until SIGINT/SIGTERM: then the
    front and every engine drain (streams in flight finish for up to drain_timeout_s) and the process exits 0."""
    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    scratch = tempfile.mkdtemp(prefix="q3tts-")  # (mode 0700) removed at exit, with uploaded voices if kept here
    backends = start_backends(config, devices, log_level, scratch)
    front = Backends(backends, hung_s=config.send_timeout_s)
    app = create_router_app(config, front)

    def draining() -> None:
        app.state.draining = front.stopping = True

    server = uvicorn_server(app, config, log_level, draining)
    front.on_give_up = server.give_up  # (no engine is left)
    try:
        server.run()
    finally:
        for b in backends:
            if b.process.poll() is None:
                b.process.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + config.drain_timeout_s + ENGINE_DRAIN_MARGIN_S + 5
        for b in backends:
            with contextlib.suppress(subprocess.TimeoutExpired):
                b.process.wait(timeout=max(deadline - time.monotonic(), 1))
            if b.process.poll() is None:
                b.process.kill()
        shutil.rmtree(scratch, ignore_errors=True)
    if server.gave_up:
        raise SystemExit(1)
