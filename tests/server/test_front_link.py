"""The speech path between the `--devices` front and an engine process (server/front/link.py): an engine process's app
(uvicorn, tiny CustomVoice model on the CPU) with its core socket, spoken to by the front's client. The audio
crosses unchanged (float32, equal to the same request run in-process), refusals arrive as the API errors a
direct request gets, and a cancelled request or a front that goes away frees its row. A WebSocket session crosses
as its ASGI events, to a route of the engine's app and back (tests/server/test_front.py compares whole sessions
through the front with the same sessions sent to the engine directly)."""

from __future__ import annotations

import asyncio
import pickle
import random

import numpy as np
import pytest

pytest.importorskip("fastapi")

import httpx  # noqa: E402

from q3tts.engine import EngineError  # noqa: E402
from q3tts.server import ServerConfig  # noqa: E402
from q3tts.server.errors import APIError  # noqa: E402
from q3tts.server.front.link import (  # noqa: E402
    AUDIO,
    MESSAGE,
    SOCKET_END,
    CoreClient,
    CoreServer,
    CoreUnavailable,
    Parser,
    pack,
    pack_message,
    socket_scope,
)
from q3tts.server.front.messages import Finished, Refused, Speak, SpeakAll, decode, encode  # noqa: E402
from q3tts.server.schemas import SpeechRequest  # noqa: E402
from q3tts.server.speech import RefusedAt, Speech  # noqa: E402
from q3tts.tiny import tiny_checkpoint  # noqa: E402
from tests.server.harness import FRAME, SEED, ServerThread, frames  # noqa: E402


@pytest.fixture(scope="module")
def engine_process(tmp_path_factory):
    folder = tiny_checkpoint("tiny", tmp_path_factory.mktemp("cache"))
    config = ServerConfig(model=str(folder), served_model_name="tiny", device="cpu", max_running=2, max_waiting=4,
                          max_context=1024, core_socket=str(tmp_path_factory.mktemp("core") / "engine.sock"))
    with ServerThread(config) as running:
        yield running


def _body(**fields) -> SpeechRequest:
    return SpeechRequest(**{"model": "tiny", "voice": "ryan", "input": "Hello from the engine process.",
                            "max_new_tokens": 9, "seed": SEED, "response_format": "pcm", **fields})


async def _audio(stream) -> np.ndarray:
    return np.concatenate([chunk async for chunk in stream.achunks()])


def test_audio_crosses_unchanged(engine_process):
    async def both():
        client = await CoreClient.connect(engine_process.config.core_socket)
        remote = await client.speak(_body(), "core-test")
        got = await _audio(remote.stream)
        local = await engine_process.app.state.service.speak(_body(), "in-process")  # the same request, here
        want = await _audio(local.stream)
        client.close()
        return remote, got, local, want

    remote, got, local, want = asyncio.run(both())
    assert got.dtype == np.float32 and len(got) == frames(9) * FRAME
    assert np.array_equal(got, want)
    assert (remote.input_tokens, remote.sample_rate) == (local.input_tokens, 24000)
    assert remote.stream.finish_reason == local.stream.finish_reason == "length"


def test_refusals_are_the_api_errors_of_a_direct_request(engine_process):
    async def refused(body: SpeechRequest) -> APIError:
        client = await CoreClient.connect(engine_process.config.core_socket)
        try:
            with pytest.raises(APIError) as e:
                await client.speak(body, "refused")
            return e.value
        finally:
            client.close()

    for body in (_body(voice="nobody"), _body(model="another-model"), _body(input="x" * 5000)):
        error = asyncio.run(refused(body))
        direct = httpx.post(engine_process.url + "/v1/audio/speech", json=body.model_dump(exclude_unset=True))
        assert error.status == direct.status_code and error.status in (400, 404)
        assert error.body() == direct.json()


def test_cancel_and_a_front_that_goes_away_free_the_row(engine_process):
    async def run():
        client = await CoreClient.connect(engine_process.config.core_socket)
        cancelled = await client.speak(_body(max_new_tokens=900), "cancelled")
        await anext(cancelled.stream.achunks())
        cancelled.stream.cancel()
        abandoned = await client.speak(_body(max_new_tokens=900), "abandoned")
        await anext(abandoned.stream.achunks())
        assert engine_process.engine.num_running >= 1
        client.close()  # the front's connection drops: the engine process cancels what it carried
        await asyncio.sleep(0.05)
        with pytest.raises(CoreUnavailable):
            await client.speak(_body(), "after")

    asyncio.run(run())
    engine_process.wait_idle()
    assert engine_process.engine.metrics.requests_cancelled >= 2


def test_a_failure_of_ours_is_an_error_not_a_hang(tmp_path):
    """An unexpected exception in the engine process, before the audio or during it, reaches the front as a 500
    or a failed stream (as from one process), not as silence."""
    class Breaking:
        finish_reason = None

        async def achunks(self):
            yield np.zeros(1920, dtype=np.float32)
            raise RuntimeError("broken mid-stream")

        def cancel(self):
            pass

    class BreakingSpeaker:
        async def speak(self, body, request_id):
            if body.input == "before":
                raise RuntimeError("broken before")
            return Speech(Breaking(), 3, 24000)

    async def run():
        server = CoreServer(BreakingSpeaker(), str(tmp_path / "engine.sock"))
        await server.start()
        client = await CoreClient.connect(server.path)
        with pytest.raises(APIError) as e:
            await asyncio.wait_for(client.speak(_body(input="before"), "r1"), 5)
        assert (e.value.status, e.value.code) == (500, "internal_error")
        speech = await asyncio.wait_for(client.speak(_body(input="during"), "r2"), 5)
        chunks = speech.stream.achunks()
        assert len(await anext(chunks)) == 1920
        with pytest.raises(EngineError, match="broken mid-stream"):
            await asyncio.wait_for(anext(chunks), 5)
        client.close()
        await server.drain(1)

    asyncio.run(run())


def test_messages_split_anywhere_are_read_whole():
    rng = random.Random(0)
    messages = [(MESSAGE, 1, encode(Speak("a", _body()))), (AUDIO, 1, np.arange(3840, dtype=np.float32).tobytes()),
                (AUDIO, 7, b""), (MESSAGE, 2**32 - 1, encode(Finished("stop")))]
    data = b"".join(pack(*m) for m in messages)
    assert pack_message(7, Finished(None)) == pack(MESSAGE, 7, encode(Finished(None)))
    parser, got, at = Parser(), [], 0
    while at < len(data):
        step = rng.randint(1, 40)
        got += parser.feed(data[at:at + step])
        at += step
    assert got == messages and not parser.buffer


def test_the_body_crosses_as_the_front_validated_it():
    """A typed message: the engine process gets the front's SpeechRequest itself (fields, and which the client set),
    parsed and validated once; anything but a link message is refused."""
    body = _body(temperature=0.5)
    got = decode(encode(Speak("r1", body)))
    assert isinstance(got, Speak) and got.request_id == "r1"
    assert got.body == body and got.body.model_fields_set == body.model_fields_set
    error = APIError(404, "no such voice", param="voice", code="voice_not_found", headers={"x": "1"})
    back = decode(encode(Refused.of(error))).error()
    assert (back.status, back.message, back.param, back.code, back.headers) == (404, "no such voice", "voice",
                                                                                "voice_not_found", {"x": "1"})
    turns = decode(encode(SpeakAll("r2", (body, _body()), (7, 8))))  # (a dialogue's turns, one stream each)
    assert isinstance(turns, SpeakAll) and turns.bodies == (body, _body()) and turns.numbers == (7, 8)
    refused = decode(encode(Refused.of(error, index=1))).error()  # (of those spoken together: which one)
    assert isinstance(refused, RefusedAt) and refused.index == 1 and refused.error.param == "voice"
    with pytest.raises(ValueError, match="not a link message"):
        decode(pickle.dumps({"body": "{}"}))


def test_a_websocket_session_runs_on_the_engines_app(tmp_path):
    """The app (an ASGI callable) gets the scope the front gave, with the front's request id, a websocket.connect
    and then the client's events in order; its events come back in order, then the end (1000; 1011 when it
    failed). A front that goes away is a client gone (1006) to every session; the engine's drain closes them
    with 1012 (the front's client is told) and the routes see their client gone."""
    seen: dict[str, list] = {}

    async def app(scope, receive, send):
        got = seen.setdefault(scope["query_string"].decode(), [])
        got.append((scope["path"], dict(scope["headers"])[b"x-request-id"], scope["subprotocols"]))
        while (event := await receive())["type"] != "websocket.disconnect":
            got.append(event)
            if event["type"] == "websocket.connect":
                await send({"type": "websocket.accept", "subprotocol": None})
            elif event.get("text") == "fail":
                raise RuntimeError("a route that fails")
            else:
                await send({"type": "websocket.send", "text": event["text"].upper()})
        got.append(event)

    scope = {"type": "websocket", "path": "/v1/audio/speech/ws", "raw_path": b"/v1/audio/speech/ws",
             "query_string": b"", "headers": [(b"x-request-id", b"from-the-client"), (b"host", b"x")],
             "subprotocols": ["nari.speech.v1"], "app": object(), "state": {"request_id": "r"}}

    async def events(socket, n):
        return [await asyncio.wait_for(socket.events.get(), 5) for _ in range(n)]

    async def run():
        server = CoreServer(None, str(tmp_path / "engine.sock"), app)
        await server.start()
        client = await CoreClient.connect(server.path)
        for query in (b"a", b"b"):
            socket = client.open_socket(socket_scope({**scope, "query_string": query}, f"front-{query.decode()}"))
            for text in ("one", "two"):
                socket.send({"type": "websocket.receive", "text": text})
            accepted, one, two = await events(socket, 3)
            assert accepted["type"] == "websocket.accept" and (one["text"], two["text"]) == ("ONE", "TWO")
            if query == b"a":
                socket.send({"type": "websocket.disconnect", "code": 1000})
                assert await events(socket, 1) == [{"type": SOCKET_END, "code": 1000}]
            else:
                socket.send({"type": "websocket.receive", "text": "fail"})
                assert await events(socket, 1) == [{"type": SOCKET_END, "code": 1011}]
            socket.close()
        assert seen["a"][0] == ("/v1/audio/speech/ws", b"front-a", ["nari.speech.v1"])
        assert [e["type"] for e in seen["a"][1:]] == ["websocket.connect", "websocket.receive", "websocket.receive",
                                                      "websocket.disconnect"]
        # a front that goes away: its open sessions' routes see their client gone
        socket = client.open_socket(socket_scope({**scope, "query_string": b"c"}, "front-c"))
        await events(socket, 1)
        client.close()
        for _ in range(100):
            if seen["c"][-1]["type"] == "websocket.disconnect":
                break
            await asyncio.sleep(0.02)
        assert seen["c"][-1] == {"type": "websocket.disconnect", "code": 1006}
        assert await asyncio.wait_for(socket.events.get(), 5) is None  # (the front's side: the engine is gone)
        # the engine's drain: the front is told to close with 1012, the route sees its client gone
        client = await CoreClient.connect(server.path)
        socket = client.open_socket(socket_scope({**scope, "query_string": b"d"}, "front-d"))
        await events(socket, 1)
        await server.drain(5)
        closed, end = await events(socket, 2)
        assert closed["type"] == "websocket.close" and closed["code"] == 1012 and end["type"] == SOCKET_END
        assert seen["d"][-1] == {"type": "websocket.disconnect", "code": 1012}

    asyncio.run(run())


def test_a_client_that_floods_a_relayed_session_loses_it(tmp_path, monkeypatch):
    """Client events pile up unread (a route that reads slower than its client sends): past MAX_UNREAD_EVENTS the
    front is told to close the session with 1008 and the route, once it has read what came, sees its client gone;
    nothing more is kept for it."""
    monkeypatch.setattr("q3tts.server.front.link.MAX_UNREAD_EVENTS", 50)
    reading, got = asyncio.Event(), []

    async def app(scope, receive, send):
        await reading.wait()
        while (event := await receive())["type"] != "websocket.disconnect":
            got.append(event)
        got.append(event)

    async def run():
        server = CoreServer(None, str(tmp_path / "engine.sock"), app)
        await server.start()
        client = await CoreClient.connect(server.path)
        socket = client.open_socket(socket_scope({"type": "websocket", "path": "/x", "headers": []}, "flood"))
        for i in range(200):
            socket.send({"type": "websocket.receive", "text": str(i)})
        closed = await asyncio.wait_for(socket.events.get(), 5)
        assert closed["type"] == "websocket.close" and closed["code"] == 1008
        reading.set()
        assert (await asyncio.wait_for(socket.events.get(), 5))["type"] == SOCKET_END
        assert got[0]["type"] == "websocket.connect" and got[-1] == {"type": "websocket.disconnect", "code": 1008}
        assert [e["text"] for e in got[1:-1]] == [str(i) for i in range(49)]  # (the connect is the 50th unread)
        client.close()
        await server.drain(1)

    asyncio.run(run())
