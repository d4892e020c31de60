"""The front of `q3tts serve` on a GPU (router.py over core.py) answers a speech request exactly as one process
does: a front and an engine process's app (uvicorn, tiny CustomVoice model on the CPU) in this process, each
request sent to both, status, headers and bytes compared."""

from __future__ import annotations

import json
import threading
import time

import pytest

pytest.importorskip("fastapi")

import httpx  # noqa: E402
import uvicorn  # noqa: E402
from websockets.exceptions import ConnectionClosed  # noqa: E402
from websockets.sync.client import connect  # noqa: E402

from q3tts.server import ServerConfig  # noqa: E402
from q3tts.server.front.app import Backend, Backends, create_router_app  # noqa: E402
from q3tts.tiny import tiny_checkpoint  # noqa: E402
from tests.server.harness import SEED, ServerThread, events_until_close, free_port  # noqa: E402

TEXT = "Hello world, this is a test."


class FrontThread:
    """The front over one running engine server (its HTTP port and core socket), on a free localhost port."""

    def __init__(self, engine: ServerThread):
        config = ServerConfig(model=engine.config.model, served_model_name="tiny", max_input_chars=200,
                              port=free_port())
        backends = Backends([Backend(0, "cpu", engine.url, engine.config.core_socket)])
        self.url = f"http://127.0.0.1:{config.port}"
        self.server = uvicorn.Server(uvicorn.Config(create_router_app(config, backends), host="127.0.0.1",
                                                    port=config.port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, name="front", daemon=True)

    def __enter__(self) -> FrontThread:
        self.thread.start()
        deadline = time.time() + 60
        while not self.server.started or httpx.get(self.url + "/ready").status_code != 200:
            assert self.thread.is_alive() and time.time() < deadline, "the front did not get ready"
            time.sleep(0.05)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    folder = tiny_checkpoint("tiny", tmp_path_factory.mktemp("cache"))
    config = ServerConfig(model=str(folder), served_model_name="tiny", device="cpu", max_running=2, max_waiting=8,
                          max_context=512, max_input_chars=200,
                          core_socket=str(tmp_path_factory.mktemp("core") / "engine.sock"))
    with ServerThread(config) as engine, FrontThread(engine) as front:
        yield engine, front


@pytest.mark.parametrize("case", [
    {"response_format": "pcm"}, {"response_format": "wav"}, {"response_format": "flac"}, {"response_format": "mp3"},
    {"response_format": "pcm", "speed": 1.5}, {"response_format": "aac", "stream_format": "sse"},
    {"voice": "nobody"}, {"model": "another"}, {"input": "x" * 300}, {"max_new_tokens": 100_000},
    {"language": "klingon"}, {"instructions": "Whisper.", "task_type": "Base"}, {"ref_audio": "aGVsbG8="},
    {"speed": 9.0}, {"response_format": "ogg"}, {"seed": "5"}, {"input": None},
    # what other servers' clients send (tests/server/test_server_clients.py)
    {"stream": True, "non_streaming_mode": False, "language": "en-US", "model": "Qwen/Qwen3-TTS-12Hz-1.7B-CustomVoice",
     "response_format": "pcm"}, {"voice": "alloy", "response_format": "wav", "sample_rate": 16000},
    {"speaker": "vivian", "voice": None, "volume_multiplier": 0.5, "response_format": "pcm"},
    {"voice": "boss", "voice_aliases": {"Boss": {"voice": "ryan", "rate": 1.25}}, "response_format": "pcm"},
    {"temprature": 0.5}, {"word_timestamps": True}, {"sample_rate": 22050, "response_format": "opus"}])
def test_the_front_answers_as_one_process(servers, case):
    engine, front = servers
    body = {"model": "tiny", "voice": "ryan", "input": TEXT, "max_new_tokens": 9, "seed": SEED, **case}
    direct = httpx.post(engine.url + "/v1/audio/speech", json=body, timeout=60)
    fronted = httpx.post(front.url + "/v1/audio/speech", json=body, timeout=60)
    assert fronted.status_code == direct.status_code
    assert fronted.headers["content-type"] == direct.headers["content-type"]
    assert fronted.headers.get("retry-after") == direct.headers.get("retry-after")
    assert fronted.headers.get("x-sample-rate") == direct.headers.get("x-sample-rate")
    assert fronted.content == direct.content
    if direct.status_code == 200:
        assert len(direct.content) > 1000
    else:
        assert direct.json()["error"]["param"]


def _vllm_omni_session(url: str) -> list:
    """Two utterances of vLLM-Omni's protocol, then session.close: every message, in order."""
    received = []
    with connect(url.replace("http", "ws") + "/v1/audio/speech/stream") as ws:
        ws.send(json.dumps({"type": "session.config", "voice": "alloy", "max_new_tokens": 4, "seed": SEED}))
        for text in ("One. Two.", "Three."):
            ws.send(json.dumps({"type": "input.text", "text": text}))
            ws.send(json.dumps({"type": "input.done"}))
        ws.send(json.dumps({"type": "session.close"}))
        try:
            while True:
                received.append(ws.recv(timeout=60))
        except ConnectionClosed:
            received.append(ws.close_code)
    return received


def test_the_front_forwards_voice_combination(servers):
    """POST /v1/audio/voices/combine was the one voices route the front did not forward: a 405 (GET, DELETE) there,
    whatever the engine would have answered."""
    engine, front = servers
    direct, relayed = (httpx.post(server.url + "/v1/audio/voices/combine", json=["amy", "bob"], timeout=60)
                       for server in (engine, front))
    assert relayed.status_code == direct.status_code == 400, relayed.text
    assert relayed.json() == direct.json() and "needs a Base checkpoint" in relayed.json()["error"]["message"]


def test_the_front_forwards_model_retrieval(servers):
    engine, front = servers
    for path in ("/v1/models/tiny", "/v1/models/Qwen/Qwen3-TTS-12Hz-1.7B-CustomVoice", "/v1/models/another"):
        direct, relayed = (httpx.get(server.url + path, timeout=30) for server in (engine, front))
        assert (relayed.status_code, relayed.json()) == (direct.status_code, direct.json()), path
    assert relayed.status_code == 404 and relayed.json()["error"]["code"] == "model_not_found"


def test_the_front_relays_vllm_omnis_websocket_protocol(servers):
    engine, front = servers
    direct = _vllm_omni_session(engine.url)
    assert direct[-1] == 1000 and sum(isinstance(m, bytes) for m in direct) == 2
    assert _vllm_omni_session(front.url) == direct


def _nari_session(url: str) -> tuple[list[str], bytes, int]:
    """A nari.speech.v1 session: (its events' types in order, its audio, the close code)."""
    with connect(url.replace("http://", "ws://") + "/v1/audio/speech/ws", subprotocols=["nari.speech.v1"]) as ws:
        assert ws.subprotocol == "nari.speech.v1"
        ws.send(json.dumps({"type": "request.start", "voice": "ryan", "language": "english", "seed": SEED,
                            "max_new_tokens": 12}))
        words = TEXT.split(" ")
        for i, word in enumerate(words):
            ws.send(json.dumps({"type": "input_text.append", "sequence": i, "text": word if i == 0 else " " + word}))
        ws.send(json.dumps({"type": "input_text.end", "sequence": len(words)}))
        events, audio = events_until_close(ws)
        return [e["type"] for e in events], audio, ws.close_code


def test_the_front_relays_naris_live_text_protocol(servers):
    """The live text travels to the engine process with the session; the audio is the same bytes."""
    engine, front = servers
    direct = _nari_session(engine.url)
    assert direct[2] == 1000 and direct[0][-1] == "response.done" and direct[1]
    relayed = _nari_session(front.url)
    assert relayed[1:] == direct[1:] and sorted(relayed[0]) == sorted(direct[0])
    with connect(front.url.replace("http://", "ws://") + "/v1/audio/speech/ws") as ws:  # no subprotocol
        with pytest.raises(ConnectionClosed):
            ws.recv(timeout=30)
        assert ws.close_code == 1002


def test_a_client_that_leaves_a_relayed_session_frees_its_row(servers):
    """The session runs on the engine's route (link.py); a client that goes away mid-audio ends it there: the
    engine's row is freed, and the next session through the front works."""
    engine, front = servers
    with connect(front.url.replace("http://", "ws://") + "/v1/audio/speech/ws", subprotocols=["nari.speech.v1"]) as ws:
        ws.send(json.dumps({"type": "request.start", "voice": "ryan", "language": "english", "seed": SEED,
                            "max_new_tokens": 400}))
        ws.send(json.dumps({"type": "input_text.append", "sequence": 0, "text": TEXT}))
        while not isinstance(ws.recv(timeout=60), bytes):  # its audio has started
            pass
        assert engine.engine.num_running == 1
    engine.wait_idle(timeout=30)
    assert _nari_session(front.url)[2] == 1000
