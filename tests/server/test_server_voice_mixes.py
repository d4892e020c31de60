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


def _websocket(server, config: dict, text: bool = True) -> tuple[bytes, list[dict]]:
    """One session; `text=False`: the config alone (a refused one, after which the server closes)."""
    from websockets.sync.client import connect

    with connect(server.ws_url + "/v1/audio/speech/stream") as ws:
        ws.send(json.dumps({"type": "session.config", "protocol": "q3tts", "seed": SEED, "max_new_tokens": MAX_NEW,
                            "response_format": "pcm", **config}))
        if text:
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
    _, events = _websocket(server, {"speaker_embedding": [0.5] * 3}, text=False)
    assert events[-1]["type"] == "error" and "speaker_embedding" in json.dumps(events[-1])


# ---- blends: "a(2)+b(1)" and POST /v1/audio/voices/combine ---------------------------------------------------

def _wav(seed: int) -> bytes:
    import io

    import soundfile as sf

    out = io.BytesIO()
    sf.write(out, speech_like(1.0, 24000, seed), 24000, format="WAV")
    return out.getvalue()


@pytest.fixture(scope="module")
def stored(server) -> dict[str, dict]:
    """Two x-vector voices and an in-context one, uploaded."""
    voices = {}
    for name, seed, fields in (("amy", 1, {"x_vector_only_mode": "true"}), ("bob", 2, {"x_vector_only_mode": "true"}),
                               ("carol", 3, {"ref_text": "Good morning."})):
        response = httpx.post(server.url + "/v1/audio/voices", files={"file": ("r.wav", _wav(seed), "audio/wav")},
                              data={"name": name, **fields}, timeout=60)
        assert response.status_code == 201, response.text
        voices[name] = response.json()
    return voices


def _embedding_of(server, name: str) -> np.ndarray:
    return server.app.state.service.voices.get(name)[1].ref_spk_embedding.double().numpy()


def test_a_mix_in_voice_is_the_weighted_mean(server, stored):
    """Kokoro's "amy(2)+bob(1)": the same audio as the mean embedding sent as speaker_embedding; weights are
    normalised; ids and names both work."""
    mean = ((2 * _embedding_of(server, "amy") + _embedding_of(server, "bob")) / 3).astype(np.float32)
    mixed = _audio(server, voice="amy(2)+bob(1)")
    assert mixed == _audio(server, speaker_embedding=mean.tolist())
    assert mixed == _audio(server, voice=f"{stored['amy']['id']}(4) + bob(2)")
    assert mixed != _audio(server, voice="amy(1)+bob(2)") and _audio(server, voice="amy+bob") != mixed


def test_aliases_of_a_mix(server, tts, stored):
    """Kokoro's per-request voice_aliases and the server's --voice-alias may name a mix; an alias inside a mix that
    is itself a mix is refused (no mix of mixes)."""
    mixed = _audio(server, voice="amy(2)+bob(1)")
    assert _audio(server, voice="duo", voice_aliases={"duo": "amy(2)+bob(1)"}) == mixed
    config = ServerConfig(model="tiny-base", device="cpu", max_running=2, max_context=512, warmup=False,
                          voices_dir=server.config.voices_dir, voice_aliases={"duo": "amy(2)+bob(1)"})
    with ServerThread(config, tts) as aliased:
        assert _audio(aliased, voice="Duo") == mixed
        response = _post(aliased, {"voice": "duo+amy"})
        assert response.status_code == 404 and "alias of the stored voice" in response.json()["error"]["message"]


@pytest.mark.parametrize("voice, status, says", [
    ("amy+carol", 400, "'carol' is an in-context voice: its reference recording's codes and transcript cannot be "
                       "mixed"),
    ("amy(0)+bob", 400, "the weight of 'amy' must be a finite number > 0"),
    ("amy(x)+bob", 400, "'x' of 'amy' is not a number"),
    ("amy(2", 400, "a mix is names with optional weights"),
    ("amy+nobody", 404, "'nobody' not found"),
])
def test_bad_mixes_are_refused_naming_voice(server, stored, voice, status, says):
    response = _post(server, {"voice": voice})
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["param"] == "voice" and says in error["message"], error


def test_combine_stores_the_blend_as_a_voice(server, stored):
    response = httpx.post(server.url + "/v1/audio/voices/combine", json="amy(2)+bob(1)", timeout=60)
    assert response.status_code == 201, response.text
    combined = response.json()
    assert combined["voice"] == combined["name"] == "amy(2)+bob(1)" and combined["x_vector_only_mode"]
    assert combined["id"].startswith("voice_") and "amy(2)+bob(1)" in combined["voices"]
    assert _audio(server, voice=combined["id"]) == _audio(server, voice="amy(2)+bob(1)")
    listed = httpx.post(server.url + "/v1/audio/voices/combine?name=pair", json=["amy", "bob"], timeout=60).json()
    assert listed["name"] == "pair" and _audio(server, voice="pair") == _audio(server, voice="amy(1)+bob(1)")
    assert httpx.get(server.url + "/v1/audio/voices/pair").json()["id"] == listed["id"]


def test_a_blend_has_one_type_wherever_it_is_read(server, stored):
    """combine answered "blend" and GET and the list "cloned" (the store keeps no such difference)."""
    made = httpx.post(server.url + "/v1/audio/voices/combine?name=trio", json=["amy", "bob"], timeout=60).json()
    fetched = httpx.get(server.url + "/v1/audio/voices/trio").json()
    listed = next(v for v in httpx.get(server.url + "/v1/audio/voices").json()["data"] if v.get("name") == "trio")
    assert made["type"] == fetched["type"] == listed["type"] == "cloned", (made, fetched, listed)


@pytest.mark.parametrize("body, query, status, param, says", [
    ({"voices": ["amy"]}, "", 400, "voices", "a JSON string such as"),
    ([], "", 400, "voices", "a JSON string such as"),
    (["amy", "bob(2)"], "", 400, "voices", "a JSON string such as"),
    ("amy+carol", "", 400, "voices", "in-context voice"),
    ("amy+nobody", "", 404, "voice", "'nobody' not found"),
    ("amy+bob", "?name=a/b", 400, "name", "1-64 letters"),
    ("amy+bob", "?name=amy", 409, "name", "already exists"),
])
def test_combine_refusals(server, stored, body, query, status, param, says):
    response = httpx.post(server.url + "/v1/audio/voices/combine" + query, json=body, timeout=60)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["param"] == param and says in error["message"], error


def test_combine_reads_only_json_and_one_name(server, stored):
    """As /v1/audio/speech: a body that is not labelled JSON is a 415; a second ?name= is refused (the last one
    was kept, silently)."""
    url = server.url + "/v1/audio/voices/combine"
    plain = httpx.post(url + "?name=tp", content=b'["amy", "bob"]', headers={"content-type": "text/plain"})
    assert plain.status_code == 415 and plain.json()["error"]["code"] == "unsupported_media_type", plain.text
    twice = httpx.post(url + "?name=first&name=second", json=["amy", "bob"], timeout=60)
    assert twice.status_code == 400 and twice.json()["error"]["param"] == "name", twice.text
    assert httpx.get(server.url + "/v1/audio/voices/second").status_code == 404


def test_combine_refuses_what_it_would_have_misread(server, stored):
    """A misspelt ?name= was ignored (the blend stored under the mix's name), and a body that is not UTF-8 was read
    with its bad bytes replaced ("voice 'am\ufffd' not found"); an empty one was "not valid JSON"."""
    url = server.url + "/v1/audio/voices/combine"
    names = {v["name"] for v in httpx.get(server.url + "/v1/audio/voices").json()["data"]}
    misspelt = httpx.post(url + "?nmae=duo", json=["amy", "bob"], timeout=60)
    assert misspelt.status_code == 400, misspelt.text
    error = misspelt.json()["error"]
    assert error["param"] == "nmae" and "unknown query parameter 'nmae'; combine takes only ?name=" in error["message"]
    latin1 = httpx.post(url, content='"amy+b\u00f6b"'.encode("latin-1"), headers={"content-type": "application/json"})
    assert latin1.status_code == 400 and latin1.json()["error"]["code"] == "invalid_encoding", latin1.text
    empty = httpx.post(url, content=b"", headers={"content-type": "application/json"})
    assert empty.status_code == 400 and empty.json()["error"]["code"] == "empty_body", empty.text
    assert 'the request body is empty; send a JSON string such as "a(2)+b(1)"' in empty.json()["error"]["message"]
    assert {v["name"] for v in httpx.get(server.url + "/v1/audio/voices").json()["data"]} == names


def test_combine_needs_a_base_checkpoint(tmp_path):
    custom = load_tiny("tiny", tmp_path)
    with ServerThread(ServerConfig(model="tiny", device="cpu", max_running=1, warmup=False), custom) as other:
        response = httpx.post(other.url + "/v1/audio/voices/combine", json="ryan+vivian", timeout=60)
        assert response.status_code == 400 and "needs a Base checkpoint" in response.json()["error"]["message"]
