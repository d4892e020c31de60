"""Operational behaviour: bearer auth, the bounded queue (429), a client disconnect freeing its row, /ready
before warm-up, and an engine failure in the middle of streams."""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
import time

import pytest

pytest.importorskip("fastapi")

import httpx  # noqa: E402
import openai  # noqa: E402
from websockets.exceptions import ConnectionClosed, InvalidStatus  # noqa: E402
from websockets.sync.client import connect  # noqa: E402

from q3tts.server import ServerConfig  # noqa: E402
from tests.server.harness import SEED, ServerThread, load_tiny  # noqa: E402

KEY = "secret-key"
LONG = {"input": "A long story that takes a while.", "voice": "ryan", "response_format": "pcm", "seed": SEED,
        "max_new_tokens": 400}


@pytest.fixture(scope="module")
def tts(tmp_path_factory):
    return load_tiny("tiny", tmp_path_factory.mktemp("cache"))


@pytest.fixture(scope="module")
def guarded(tts):
    """One row, one queue slot, an API key."""
    config = ServerConfig(model="tiny", device="cpu", max_running=1, max_waiting=1, max_context=512, api_key=KEY)
    with ServerThread(config, tts) as running:
        yield running


def _auth(key: str = KEY) -> dict:
    return {"Authorization": f"Bearer {key}"}


@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer wrong"}, {"Authorization": f"Basic {KEY}"}])
def test_api_key_is_required_on_v1(guarded, headers):
    for method, path in (("GET", "/v1/models"), ("POST", "/v1/audio/speech"), ("GET", "/v1/audio/voices")):
        response = httpx.request(method, guarded.url + path, headers=headers, json={})
        assert response.status_code == 401 and response.headers["www-authenticate"] == "Bearer"
        assert response.json()["error"]["type"] == "authentication_error"
        assert response.json()["error"]["code"] == "invalid_api_key"


def test_health_is_open_and_the_key_works(guarded):
    assert httpx.get(guarded.url + "/health").status_code == 200
    assert httpx.get(guarded.url + "/metrics").status_code == 200
    assert httpx.get(guarded.url + "/v1/models", headers=_auth()).status_code == 200
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=guarded.url + "/v1", api_key="wrong", max_retries=0).models.list()


def test_websocket_needs_the_key(guarded):
    try:
        with connect(guarded.ws_url + "/v1/audio/speech/stream") as ws:
            event = json.loads(ws.recv(timeout=10))  # servers without denial responses: an error event
            assert event["error"]["code"] == "invalid_api_key"
    except InvalidStatus as e:
        assert e.response.status_code == 401 and json.loads(e.response.body)["error"]["code"] == "invalid_api_key"
    with connect(guarded.ws_url + "/v1/audio/speech/stream", additional_headers=_auth()) as ws:
        ws.send(json.dumps({"type": "session.config", "protocol": "q3tts", "voice": "ryan"}))
        assert json.loads(ws.recv(timeout=10))["type"] == "session.created"


def test_query_keys_stay_out_of_the_request_log(tts, capfd):
    """A browser's WebSocket can only send its key as `?api_key=`: uvicorn's request lines (WebSocket ones on
    uvicorn.error, HTTP ones on uvicorn.access) printed it, and every wrong guess too."""
    import signal

    from q3tts.server.app import create_app, uvicorn_server
    from tests.server.harness import free_port

    config = ServerConfig(model="tiny", device="cpu", max_running=1, warmup=False, api_key="topsecret123",
                          port=free_port())
    handler = signal.getsignal(signal.SIGTERM)
    try:
        server = uvicorn_server(create_app(config, tts), config, "info", lambda: None)  # as `q3tts serve` runs it
    finally:
        signal.signal(signal.SIGTERM, handler)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    _wait(lambda: server.started)
    stream = f"ws://127.0.0.1:{config.port}/v1/audio/speech/stream"
    try:
        with connect(stream + "?api_key=topsecret123"):
            pass
        with contextlib.suppress(InvalidStatus), connect(stream + "?x=1&api_key=guess-one") as ws:
            ws.recv(timeout=10)  # (servers without denial responses: an error event)
        assert httpx.get(f"http://127.0.0.1:{config.port}/v1/models?api_key=guess-two").status_code == 401
    finally:
        server.should_exit = True
        thread.join(timeout=30)
    log = "".join(capfd.readouterr())  # (uvicorn's access lines go to stdout, the others to stderr)
    assert "topsecret123" not in log and "guess-" not in log, log
    assert '"WebSocket /v1/audio/speech/stream?api_key=***" [accepted]' in log, log
    assert '"WebSocket /v1/audio/speech/stream?x=1&api_key=***" 401' in log, log
    assert '"GET /v1/models?api_key=*** HTTP/1.1" 401' in log, log
    assert "without completing handshake" not in log, log  # (uvicorn's ERROR line for a refused handshake)


def test_a_client_that_stopped_reading_loses_its_connection_too(tts):
    """Cut at --send-timeout, the stream's connection is reset, what was queued for the client dropped: closed the
    usual way it waited, forever, for the client to read megabytes (socket and buffers held). The client's
    stalled reading is simulated inside the server (a kernel's buffers would take megabytes to fill on the CPU)."""
    import signal
    import socket

    from q3tts.server.app import create_app, uvicorn_server
    from tests.server.harness import free_port

    class StalledClient:  # every body chunk after the first waits forever to be sent
        def __init__(self, app):
            self.app = app

        async def __call__(self, scope, receive, send):
            chunks = 0

            async def stalled(message):
                nonlocal chunks
                if message["type"] == "http.response.body" and message.get("body"):
                    chunks += 1
                    if chunks > 1:
                        await asyncio.sleep(3600)
                await send(message)

            await self.app(scope, receive, stalled)

    config = ServerConfig(model="tiny", device="cpu", max_running=1, warmup=False, send_timeout_s=0.5,
                          port=free_port())
    handler = signal.getsignal(signal.SIGTERM)
    try:
        server = uvicorn_server(StalledClient(create_app(config, tts)), config, "warning", lambda: None)
    finally:
        signal.signal(signal.SIGTERM, handler)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    _wait(lambda: server.started)
    try:
        with socket.create_connection(("127.0.0.1", config.port)) as s:
            body = json.dumps({**LONG, "max_new_tokens": 60}).encode()
            s.sendall(b"POST /v1/audio/speech HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                      b"Content-Length: %d\r\n\r\n" % len(body) + body)
            s.settimeout(30)
            with pytest.raises(ConnectionResetError):
                while s.recv(65536):  # (the first chunk, then the reset)
                    pass
    finally:
        server.should_exit = True
        thread.join(timeout=30)


def test_the_guards_refusals_are_counted(tts):
    """401, 413 and 408 are answered before the app runs (guard.py; the WebSocket's 401 in auth.py): they had no
    q3tts_errors_total series."""
    import socket

    config = ServerConfig(model="tiny", device="cpu", max_running=1, warmup=False, api_key=KEY, max_body_bytes=1000,
                          body_timeout_s=0.3)
    with ServerThread(config, tts) as server:
        assert httpx.get(server.url + "/v1/models").status_code == 401
        with contextlib.suppress(InvalidStatus), connect(server.ws_url + "/v1/audio/speech/stream") as ws:
            ws.recv(timeout=10)
        assert httpx.post(server.url + "/v1/audio/speech", headers=_auth(), content=b"x" * 1001).status_code == 413
        with socket.create_connection(("127.0.0.1", config.port)) as s:  # 10 of 100 bytes, then nothing
            s.sendall(b"POST /v1/audio/speech HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + KEY.encode()
                      + b"\r\nContent-Length: 100\r\n\r\n{\"input\": ")
            s.settimeout(10)
            assert b" 408 " in s.recv(4096).split(b"\r\n")[0]
        with connect(server.ws_url + "/v1/audio/speech/stream", additional_headers=_auth()) as ws:  # silent
            event = json.loads(ws.recv(timeout=10))  # (a session's config is due as a body's part is: once never)
            with pytest.raises(ConnectionClosed):
                ws.recv(timeout=10)
        assert event["error"]["code"] == "request_timeout" and ws.close_code == 1008, event
        text = httpx.get(server.url + "/metrics").text
    counts = {line.split()[0]: float(line.split()[1]) for line in text.splitlines()
              if line.startswith("q3tts_errors_total{")}
    assert counts == {'q3tts_errors_total{code="invalid_api_key"}': 2.0,
                      'q3tts_errors_total{code="request_too_large"}': 1.0,
                      'q3tts_errors_total{code="request_timeout"}': 2.0}, counts
    # The refused WebSocket is one session in q3tts_requests_total (counted as it ends, not also as it is refused).
    assert 'q3tts_requests_total{method="WS",route="/v1/audio/speech/stream",status="401"} 1.0' in text, text


def test_headers_have_a_size_limit_and_bodies_do_not_count_toward_it(tts):
    """httptools has no bound on a request's headers: 20 MB of them were read into memory and answered 200."""
    import socket

    from q3tts.server.app import MAX_HEADER_BYTES

    config = ServerConfig(model="tiny", device="cpu", max_running=1, warmup=False)
    with ServerThread(config, tts) as server:
        with socket.create_connection(("127.0.0.1", config.port)) as s:
            s.settimeout(10)
            s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")
            for _ in range(MAX_HEADER_BYTES // 1000 + 1):
                s.sendall(b"X-Filler: " + b"a" * 1000 + b"\r\n")
            head, _, body = s.recv(4096).partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 431 "), head
        assert json.loads(body)["error"]["code"] == "headers_too_large"
        filler = {f"x-filler-{i}": "a" * 1000 for i in range(MAX_HEADER_BYTES // 1100)}  # (just under the limit)
        assert httpx.get(server.url + "/health", headers=filler).status_code == 200
        big_body = json.dumps({"input": "a" * 4 * MAX_HEADER_BYTES, "voice": "ryan"})  # (sent with its headers)
        response = httpx.post(server.url + "/v1/audio/speech", content=big_body,
                              headers={"content-type": "application/json"})
        assert response.status_code == 400 and response.json()["error"]["code"] == "input_too_long", response.text


def test_clients_close_codes_do_not_mint_metric_labels_and_probes_may_use_head(tts):
    """A session the client closes with a code of its own choosing (3000-4999) is counted under one label, not one
    series per code; load balancers' HEAD probes of /health and /ready are answered."""
    config = ServerConfig(model="tiny", device="cpu", max_running=1, warmup=False)
    with ServerThread(config, tts) as server:
        for code in (4000, 4001, 4002, 1000):
            with connect(server.ws_url + "/v1/audio/speech/stream") as ws:
                ws.send(json.dumps({"type": "session.config", "protocol": "q3tts", "voice": "ryan"}))
                ws.recv(timeout=10)
                ws.close(code=code)
        for path in ("/health", "/ready"):
            assert httpx.head(server.url + path).status_code == 200
        deadline = time.monotonic() + 10
        while True:
            lines = [line for line in httpx.get(server.url + "/metrics").text.splitlines()
                     if line.startswith('q3tts_requests_total{method="WS"')]
            if len(lines) == 2 or time.monotonic() > deadline:
                break
            time.sleep(0.05)
    assert sorted(line.split("status=")[1] for line in lines) == ['"1000"} 1.0', '"other"} 3.0'], lines


def test_queue_full_is_429_and_disconnects_free_rows(guarded):
    """A runs in the only row, B waits in the only queue slot, C is refused; closing A and B mid-stream
    cancels both and the engine ends idle."""
    cancelled_before = guarded.engine.metrics.requests_cancelled
    http = httpx.Client(base_url=guarded.url, headers=_auth(), timeout=60)
    with http, http.stream("POST", "/v1/audio/speech", json=LONG) as a:
        next(a.iter_bytes())  # A is generating
        with http.stream("POST", "/v1/audio/speech", json=LONG) as b:
            assert b.status_code == 200 and guarded.engine.num_waiting == 1
            c = http.post("/v1/audio/speech", json=LONG)
            assert c.status_code == 429 and int(c.headers["retry-after"]) >= 1
            assert c.json()["error"] == {"message": c.json()["error"]["message"], "type": "rate_limit_error",
                                         "param": None, "code": "queue_full"}
    guarded.wait_idle()
    assert guarded.engine.metrics.requests_cancelled >= cancelled_before + 1  # B may be dropped while waiting
    metrics = httpx.get(guarded.url + "/metrics").text
    assert 'q3tts_errors_total{code="queue_full"} 1.0' in metrics


def test_openai_streaming_client_disconnect_frees_the_row(guarded):
    client = openai.OpenAI(base_url=guarded.url + "/v1", api_key=KEY, max_retries=0)
    with client.audio.speech.with_streaming_response.create(
            model="tiny", voice="ryan", input=LONG["input"], response_format="pcm",
            extra_body={"max_new_tokens": 400, "seed": SEED}) as response:
        chunks = response.iter_bytes()
        next(chunks), next(chunks)
        assert guarded.engine.num_running == 1
    guarded.wait_idle()
    assert guarded.engine.num_running == 0


def test_websocket_disconnect_mid_segment_frees_the_row(guarded):
    with connect(guarded.ws_url + "/v1/audio/speech/stream", additional_headers=_auth()) as ws:
        ws.send(json.dumps({"type": "session.config", "protocol": "q3tts",
                            "voice": "ryan", "seed": SEED, "max_new_tokens": 400}))
        ws.send(json.dumps({"type": "input.text", "text": LONG["input"]}))
        ws.send(json.dumps({"type": "input.done"}))
        while not isinstance(ws.recv(timeout=30), bytes):
            pass
        assert guarded.engine.num_running == 1
    guarded.wait_idle()


def test_not_ready_until_the_engine_is_warm(tmp_path):
    """While the engine is being built (graphs captured) and warmed up, /ready is 503 and requests get 503."""
    tts = load_tiny("tiny", tmp_path)
    gate = threading.Event()
    original = tts.prepare_engine

    def slow_prepare(*args, **kwargs):
        gate.wait(30)
        return original(*args, **kwargs)

    tts.prepare_engine = slow_prepare
    try:
        with ServerThread(ServerConfig(model="tiny", device="cpu", max_running=1), tts, wait_ready=False) as server:
            assert httpx.get(server.url + "/health").status_code == 200
            assert httpx.get(server.url + "/ready").json() == {"ready": False}
            early = httpx.post(server.url + "/v1/audio/speech", json={"input": "Hi.", "voice": "ryan"})
            assert early.status_code == 503 and early.json()["error"]["code"] == "model_not_ready"
            assert "retry-after" in early.headers
            gate.set()
            server.wait_until_ready()
            assert server.engine.metrics.requests_finished == 1  # the warm-up request
    finally:
        del tts.prepare_engine


def test_engine_failure_mid_stream_and_recovery(tmp_path):
    """An audio stream is cut (no clean end), an SSE stream ends with an error event; the server rebuilds its
    engine (/ready 503 meanwhile) and serves again. After the last allowed rebuild it gives up: /health 503 and
    503 for new work (`q3tts serve` then exits so that a supervisor restarts it)."""
    server = ServerThread(ServerConfig(model="tiny", device="cpu", max_running=2), load_tiny("tiny", tmp_path))

    def broken_step(num_rows: int) -> None:
        raise RuntimeError("injected device failure")

    with server, httpx.Client(base_url=server.url, timeout=60) as http:
        with http.stream("POST", "/v1/audio/speech", json=LONG) as audio, \
                http.stream("POST", "/v1/audio/speech", json={**LONG, "stream_format": "sse"}) as sse:
            audio_chunks, sse_lines = audio.iter_bytes(), sse.iter_lines()
            next(audio_chunks), next(sse_lines)
            server.engine.runner.step = broken_step
            with pytest.raises(httpx.RemoteProtocolError):
                for _ in audio_chunks:
                    pass
            events = [json.loads(line[6:]) for line in sse_lines if line.startswith("data: ")]
        assert events[-1]["type"] == "error" and events[-1]["error"]["code"] == "engine_error"
        service = server.app.state.service
        _wait(lambda: service.restarts == 1 and http.get("/ready").status_code == 200)
        again = http.post("/v1/audio/speech", json={**LONG, "max_new_tokens": 5})
        assert again.status_code == 200 and len(again.content) == 2 * 4 * 1920
        for restarts in range(2, 5):  # fails again and again: rebuilt up to MAX_RESTARTS times, then given up
            _wait(lambda: http.get("/ready").status_code == 200)
            service.engine.runner.step = broken_step
            with contextlib.suppress(httpx.RemoteProtocolError):  # cut mid-stream
                http.post("/v1/audio/speech", json={**LONG, "max_new_tokens": 5})
            _wait(lambda restarts=restarts: service.restarts == restarts)
        _wait(lambda: http.get("/health").status_code == 503)
        assert http.get("/ready").status_code == 503
        refused = http.post("/v1/audio/speech", json=LONG)
        assert refused.status_code == 503 and refused.json()["error"]["code"] == "engine_error"


def _wait(condition, timeout: float = 30) -> None:
    deadline = time.time() + timeout
    while not condition():
        assert time.time() < deadline, "timed out"
        time.sleep(0.05)
