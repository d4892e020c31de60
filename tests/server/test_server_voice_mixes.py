"""Voices built from numbers over HTTP and the WebSocket: vLLM-Omni's `speaker_embedding` (a list of floats or
base64 of little-endian float32), on the tiny Base checkpoint."""

from __future__ import annotations

import base64
import json

import numpy as np
import pytest

pytest.importorskip("fastapi")

import httpx  # noqa: E402

from q3tts.server import ServerConfig  # noqa: E402
from tests.equivalence.test_equivalence import speech_like  # noqa: E402
from tests.server.harness import FRAME, SEED, ServerThread, frames, load_tiny  # noqa: E402

MAX_NEW = 5


@pytest.fixture(scope="module")
def tts(tmp_path_factory):
    return load_tiny("tiny-base", tmp_path_factory.mktemp("cache"))


@pytest.fixture(scope="module")
def server(tts, tmp_path_factory):
    config = ServerConfig(model="tiny-base", device="cpu", max_running=4, max_context=512,
                          voices_dir=tmp_path_factory.mktemp("voices"), warmup=False)
    with ServerThread(config, tts) as running:
        yield running


@pytest.fixture(scope="module")
def embedding(tts) -> np.ndarray:
    voice = tts.create_voice((speech_like(1.0, 24000, 5), 24000), x_vector_only=True)
    return voice.ref_spk_embedding.numpy()


def _post(server, body: dict | str) -> httpx.Response:
    content = body if isinstance(body, str) else json.dumps(
        {"input": "Hello there.", "response_format": "pcm", "seed": SEED, "max_new_tokens": MAX_NEW, **body})
    return httpx.post(server.url + "/v1/audio/speech", content=content, timeout=60,
                      headers={"content-type": "application/json"})


def _audio(server, **body) -> bytes:
    response = _post(server, body)
    assert response.status_code == 200, response.text
    return response.content


def _refused(response: httpx.Response, param: str, says: str = "") -> dict:
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and says in error["message"], error
    return error


def _base64(values: np.ndarray) -> str:
    return base64.b64encode(np.asarray(values, dtype="<f4").tobytes()).decode()


# ---- speaker_embedding ---------------------------------------------------------------------------------------

def test_speaker_embedding_as_floats_or_base64_is_the_same_voice(server, embedding):
    as_list = _audio(server, speaker_embedding=embedding.tolist())
    assert len(as_list) == 2 * frames(MAX_NEW) * FRAME
    assert _audio(server, speaker_embedding=_base64(embedding)) == as_list
    assert _audio(server, speaker_embedding=(embedding + 0.5).tolist()) != as_list  # (the voice is the embedding)


@pytest.mark.parametrize("body, param, says", [
    ({"speaker_embedding": [0.5] * 65}, "speaker_embedding", "has 65 values; this checkpoint's speaker embeddings "
                                                             "have 64"),
    ({"speaker_embedding": _base64(np.zeros(63))}, "speaker_embedding", "has 63 values"),
    ({"speaker_embedding": "not base64!"}, "speaker_embedding", "base64 of little-endian float32"),
    ({"speaker_embedding": base64.b64encode(b"abcdef").decode()}, "speaker_embedding", "not whole float32"),
    ({"speaker_embedding": [1e39] * 64}, "speaker_embedding", "NaN or infinite"),  # (beyond float32)
    ({"speaker_embedding": [0.1] * 64, "voice": "narrator"}, "speaker_embedding", "without `voice`"),
    ({"speaker_embedding": [0.1] * 64, "ref_audio": "AAAA"}, "speaker_embedding", "reference audio"),
    ({"speaker_embedding": ["x"] * 64}, "speaker_embedding.0", ""),
])
def test_bad_speaker_embeddings_are_refused_naming_the_field(server, body, param, says):
    _refused(_post(server, body), param, says)


def test_nan_in_the_json_body_is_refused(server):
    body = '{"input": "Hi.", "speaker_embedding": [NaN' + ", 0.1" * 63 + "]}"
    _refused(_post(server, body), "speaker_embedding", "NaN or infinite")


def test_speaker_embedding_needs_a_base_checkpoint(tmp_path):
    custom = load_tiny("tiny", tmp_path)
    with ServerThread(ServerConfig(model="tiny", device="cpu", max_running=1, warmup=False), custom) as other:
        _refused(_post(other, {"voice": "ryan", "speaker_embedding": [0.1] * 96}), "speaker_embedding",
                 "needs a Base checkpoint")


def _websocket(server, config: dict) -> tuple[bytes, list[dict]]:
    from websockets.sync.client import connect

    with connect(server.ws_url + "/v1/audio/speech/stream") as ws:
        ws.send(json.dumps({"type": "session.config", "protocol": "q3tts", "seed": SEED, "max_new_tokens": MAX_NEW,
                            "response_format": "pcm", **config}))
        ws.send(json.dumps({"type": "input.text", "text": "Hello there."}))
        ws.send(json.dumps({"type": "input.done"}))
        audio, events = b"", []
        while (message := ws.recv(timeout=60)) is not None:
            if isinstance(message, bytes):
                audio += message
                continue
            events.append(json.loads(message))
            if events[-1]["type"] in ("session.done", "error"):
                break
    return audio, events


def test_speaker_embedding_on_the_websocket(server, embedding):
    audio, events = _websocket(server, {"speaker_embedding": _base64(embedding)})
    assert events[-1]["type"] == "session.done" and len(audio) == 2 * frames(MAX_NEW) * FRAME
    assert audio == _audio(server, speaker_embedding=embedding.tolist())
    _, events = _websocket(server, {"speaker_embedding": [0.5] * 3})
    assert events[-1]["type"] == "error" and "speaker_embedding" in json.dumps(events[-1])
