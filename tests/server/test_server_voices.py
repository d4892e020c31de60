"""Voice upload, listing, use and deletion against the tiny Base (voice cloning) model, plus per-request
reference audio."""

from __future__ import annotations

import base64
import gzip
import io
import json

import numpy as np
import pytest

pytest.importorskip("fastapi")

import httpx  # noqa: E402
import openai  # noqa: E402
import soundfile as sf  # noqa: E402

from q3tts.server import ServerConfig  # noqa: E402
from q3tts.server.voice_store import VoiceStore  # noqa: E402
from tests.equivalence.test_audio import tone_flac  # noqa: E402
from tests.server.harness import FRAME, SEED, ServerThread, frames, load_tiny, pcm_samples  # noqa: E402

MAX_NEW = 7


@pytest.fixture(scope="module")
def voices_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("voices")


@pytest.fixture(scope="module")
def server(tmp_path_factory, voices_dir):
    tts = load_tiny("tiny-base", tmp_path_factory.mktemp("cache"))
    config = ServerConfig(model="tiny-base", device="cpu", max_running=2, max_waiting=4, max_context=512,
                          voices_dir=voices_dir)
    with ServerThread(config, tts) as running:
        yield running


@pytest.fixture(scope="module")
def reference_wav() -> bytes:
    """A second of a voice-like signal as a WAV file (tiny models only need audible, varied audio)."""
    t = np.arange(24000) / 24000
    noise = 0.01 * np.random.default_rng(0).standard_normal(len(t))
    wav = 0.3 * np.sin(2 * np.pi * 180 * t) * (1 + np.sin(2 * np.pi * 4 * t)) + noise
    out = io.BytesIO()
    sf.write(out, wav.astype(np.float32), 24000, format="WAV")
    return out.getvalue()


def _upload(server, wav: bytes, **fields) -> httpx.Response:
    return httpx.post(server.url + "/v1/audio/voices", files={"file": ("ref.wav", wav, "audio/wav")}, data=fields,
                      timeout=60)


def test_upload_use_and_delete_a_voice(server, voices_dir, reference_wav):
    created = _upload(server, reference_wav, ref_text="Hello, this is my voice.", name="narrator")
    assert created.status_code == 201, created.text
    voice = created.json()
    assert voice["id"].startswith("voice_") and voice["name"] == "narrator" and not voice["x_vector_only_mode"]
    assert (voices_dir / f"{voice['id']}.safetensors").exists() and VoiceStore(voices_dir).get(voice["id"])

    listed = httpx.get(server.url + "/v1/audio/voices").json()
    assert listed["task_type"] == "Base" and [v["id"] for v in listed["data"]] == [voice["id"]]

    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    for key in (voice["id"], "narrator", {"id": voice["id"]}):
        audio = client.audio.speech.create(model="tiny-base", voice=key, input="Good morning to you.",
                                           response_format="pcm", extra_body={"max_new_tokens": MAX_NEW, "seed": SEED})
        assert len(pcm_samples(audio.content)) == frames(MAX_NEW) * FRAME

    deleted = httpx.delete(server.url + f"/v1/audio/voices/{voice['id']}")
    assert deleted.json() == {"id": voice["id"], "object": "audio.voice.deleted", "deleted": True}
    assert not (voices_dir / f"{voice['id']}.safetensors").exists()
    with pytest.raises(openai.NotFoundError):
        client.audio.speech.create(model="tiny-base", voice=voice["id"], input="Gone.", response_format="pcm")
    assert httpx.delete(server.url + f"/v1/audio/voices/{voice['id']}").status_code == 404


def test_x_vector_only_upload_needs_no_transcript(server, reference_wav):
    created = _upload(server, reference_wav, x_vector_only_mode="true")
    assert created.status_code == 201 and created.json()["x_vector_only_mode"]
    assert httpx.get(server.url + f"/v1/audio/voices/{created.json()['id']}").json()["id"] == created.json()["id"]


def test_openai_client_with_inline_reference_audio(server, reference_wav):
    """OpenAI's client always sends a voice: 'default' stands for "none" when ref_audio carries the voice."""
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    audio = client.audio.speech.create(model="tiny-base", voice="default", input="Cloned inline.",
                                       response_format="pcm", extra_body={
                                           "ref_audio": base64.b64encode(reference_wav).decode(),
                                           "x_vector_only_mode": True, "max_new_tokens": MAX_NEW, "seed": SEED})
    assert len(pcm_samples(audio.content)) == frames(MAX_NEW) * FRAME


def test_inline_reference_audio(server, reference_wav):
    body = {"input": "Inline reference.", "response_format": "pcm", "max_new_tokens": MAX_NEW, "seed": SEED,
            "task_type": "Base", "ref_audio": base64.b64encode(reference_wav).decode(), "x_vector_only_mode": True}
    response = httpx.post(server.url + "/v1/audio/speech", json=body, timeout=60)
    assert response.status_code == 200 and len(pcm_samples(response.content)) == frames(MAX_NEW) * FRAME
    data_url = "data:audio/wav;base64," + base64.b64encode(reference_wav).decode()
    response = httpx.post(server.url + "/v1/audio/speech", timeout=60,
                          json={**body, "ref_audio": data_url, "x_vector_only_mode": False, "ref_text": "Hi."})
    assert response.status_code == 200


@pytest.mark.parametrize("fields, status, param", [
    ({}, 400, "ref_text"),  # in-context cloning needs the transcript
    ({"ref_text": "hi", "name": "bad/name"}, 400, "name"),
])
def test_bad_uploads(server, reference_wav, fields, status, param):
    response = _upload(server, reference_wav, **fields)
    assert response.status_code == status and response.json()["error"]["param"] == param


@pytest.mark.parametrize("fields, files, param, says", [
    ({"foo": "bar"}, None, "foo", "unknown field 'foo'"),
    ({"nam": "alice"}, None, "nam", "unknown field 'nam'"),  # a typo: the voice got no name
    ({}, [("file", ("a.wav", b"A", "audio/wav")), ("file", ("b.wav", b"B", "audio/wav"))], "file", "2 times"),
    ({"name": ["alice", "bob"]}, None, "name", "name is sent 2 times"),
    ({"x_vector_only_mode": "yes"}, None, "x_vector_only_mode", "must be true or false, not 'yes'"),
    ({"x_vector_only_mode": "1"}, None, "x_vector_only_mode", "must be true or false"),
    ({"x_vector_only_mode": ["true", "false"]}, None, "x_vector_only_mode", "2 times"),
    ({"file": "ref.wav"}, [], "file", "a file part"),
])
def test_upload_form_fields_are_strict(server, reference_wav, fields, files, param, says):
    """As JSON bodies refuse unknown fields: an unknown or repeated form field, or a boolean other than true/false,
    is refused naming the field (FastAPI's form parameters ignored the first, kept the last of the second and read
    "yes" as true), and nothing is stored."""
    before = len(httpx.get(server.url + "/v1/audio/voices").json()["data"])
    files = [("file", ("ref.wav", reference_wav, "audio/wav"))] if files is None else files
    response = httpx.post(server.url + "/v1/audio/voices", files=files or None,
                          data={"x_vector_only_mode": "true", **fields}, timeout=60)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert (error["param"], error["type"]) == (param, "invalid_request_error") and says in error["message"], error
    assert len(httpx.get(server.url + "/v1/audio/voices").json()["data"]) == before


def test_upload_fields_in_the_query_are_refused_not_dropped(server, reference_wav):
    """combine takes ?name=; an upload's name sent so was ignored and the voice stored unnamed."""
    before = httpx.get(server.url + "/v1/audio/voices").json()["data"]
    response = httpx.post(server.url + "/v1/audio/voices?name=queried", files={"file": ("ref.wav", reference_wav)},
                          data={"x_vector_only_mode": "true"}, timeout=60)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "name" and "a voice upload takes its fields in the form" in error["message"], error
    assert httpx.get(server.url + "/v1/audio/voices").json()["data"] == before


def test_an_upload_that_is_no_form_is_415(server, reference_wav):
    """A bare recording or JSON posted as a voice upload: 415 naming the form it needs (once 400 "file: Field
    required")."""
    for content, kind in ((reference_wav, "audio/wav"), (b'{"file": "x"}', "application/json")):
        response = httpx.post(server.url + "/v1/audio/voices", content=content, headers={"content-type": kind})
        assert response.status_code == 415, response.text
        assert "multipart form" in response.json()["error"]["message"] and kind in response.json()["error"]["message"]


def test_an_unreadable_or_cut_off_form_says_so(server, reference_wav):
    """A form with no boundary has a code like every error; one cut off mid-file is incomplete, not "send the
    recording as file" (the file part was sent)."""
    url = server.url + "/v1/audio/voices"
    error = httpx.post(url, content=b"xx", headers={"content-type": "multipart/form-data"}).json()["error"]
    assert error["code"] == "invalid_body", error
    part = b'--B\r\nContent-Disposition: form-data; name="file"; filename="a.wav"\r\n\r\n' + reference_wav
    cut = httpx.post(url, content=part[:1000], headers={"content-type": "multipart/form-data; boundary=B"})
    assert cut.status_code == 400 and cut.json()["error"]["code"] == "incomplete_form", cut.text
    assert "incomplete" in cut.json()["error"]["message"]
    whole = httpx.post(url, content=part + b'\r\n--B\r\nContent-Disposition: form-data; name="x_vector_only_mode"'
                       b'\r\n\r\ntrue\r\n--B--\r\n', headers={"content-type": "multipart/form-data; boundary=B"},
                       timeout=60)
    assert whole.status_code == 201, whole.text


def test_return_timing_says_timestamps_are_not_supported(server):
    response = httpx.post(server.url + "/v1/audio/speech", json={"input": "Hi.", "return_timing": True}, timeout=60)
    error = response.json()["error"]
    assert error["param"] == "return_timing" and "timestamps are not supported" in error["message"], error


def test_upload_booleans_are_true_or_false(server, reference_wav):
    for flag, expected in (("true", True), ("false", False), ("True", True)):
        created = _upload(server, reference_wav, x_vector_only_mode=flag, ref_text="Hello, this is my voice.")
        assert created.status_code == 201 and created.json()["x_vector_only_mode"] is expected, created.text


def test_upload_errors_name_the_http_fields(server, reference_wav):
    """The request builder's message in the API's spelling: `false`, not Python's `False`."""
    error = _upload(server, reference_wav, x_vector_only_mode="false").json()["error"]
    assert error["param"] == "ref_text" and "(x_vector_only_mode=false)" in error["message"], error


def test_unreadable_audio_and_duplicate_names(server, reference_wav):
    garbage = _upload(server, b"not audio at all", x_vector_only_mode="true")
    assert garbage.status_code == 400 and garbage.json()["error"]["param"] == "file"
    # (named by its field: it was "audio bytes: ...", the audio loader's name for what it read)
    assert garbage.json()["error"]["message"].startswith("file: not a readable audio file"), garbage.text
    assert _upload(server, reference_wav, x_vector_only_mode="true", name="twin").status_code == 201
    duplicate = _upload(server, reference_wav, x_vector_only_mode="true", name="twin")
    assert duplicate.status_code == 409 and duplicate.json()["error"]["code"] == "voice_exists"


@pytest.mark.parametrize("name, says", [("default", "means no voice"), (" carl ", "starts or ends with a space"),
                                         ("   ", "starts or ends with a space"), ("", "1-64 letters"),
                                         ("..", "only dots"), (".", "only dots")])
def test_a_name_no_request_could_select_is_refused(server, reference_wav, name, says):
    """An empty name was read as none (the voice stored under its id); "." and ".." could not be fetched or deleted
    by name (a client resolves /v1/audio/voices/.. to /v1/audio/)."""
    stored = httpx.get(server.url + "/v1/audio/voices").json()["data"]
    refused = _upload(server, reference_wav, x_vector_only_mode="true", name=name)
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "name", refused.text
    assert says in refused.json()["error"]["message"]
    assert httpx.get(server.url + "/v1/audio/voices").json()["data"] == stored


def test_a_compressed_body_is_refused_not_misread(server):
    """(Read as if plain, a gzip body failed as "not valid UTF-8"; a plain one labelled gzip was taken.)"""
    body = json.dumps({"input": "Hi.", "voice": "ryan"}).encode()
    for data in (gzip.compress(body), body):
        response = httpx.post(server.url + "/v1/audio/speech", content=data, timeout=60,
                              headers={"Content-Type": "application/json", "Content-Encoding": "gzip"})
        assert response.status_code == 415, response.text
        assert response.json()["error"]["code"] == "unsupported_content_encoding"


def test_audio_that_decodes_to_too_many_samples_is_refused(server):
    """58 KB of FLAC (160 s of a tone at 96 kHz, stereo: 30.7 M samples) is refused from its header, uploaded or
    inline, with the limit named (the 222 KB file of 599 s made the server allocate ~3 GB)."""
    flac = tone_flac(160, 96_000, 2)
    limit = "is 30720000 samples; a voice reference may hold at most 28800000"
    upload = httpx.post(server.url + "/v1/audio/voices", files={"file": ("tone.flac", flac, "audio/flac")},
                        data={"x_vector_only_mode": "true"}, timeout=60)
    assert upload.status_code == 400, upload.text
    assert upload.json()["error"]["param"] == "file" and limit in upload.json()["error"]["message"]
    for ref_audio in (base64.b64encode(flac).decode(), "data:audio/flac;base64," + base64.b64encode(flac).decode()):
        inline = httpx.post(server.url + "/v1/audio/speech", timeout=60, json={
            "input": "Hi.", "ref_audio": ref_audio, "x_vector_only_mode": True, "response_format": "pcm"})
        assert inline.status_code == 400, inline.text
        assert inline.json()["error"]["param"] == "ref_audio" and limit in inline.json()["error"]["message"]


@pytest.mark.parametrize("body, status, param", [
    ({"voice": "voice_doesnotexist"}, 404, "voice"),
    ({}, 400, "voice"),
    ({"voice": "x", "instructions": "whisper"}, 400, "instructions"),
    ({"ref_audio": "/etc/passwd"}, 400, "ref_audio"),  # never read as a path on the server
    ({"task_type": "CustomVoice", "voice": "ryan"}, 400, "task_type"),
    ({"voice": "x", "ref_text": "stored voices keep their own"}, 400, "ref_text"),
    ({"voice": "x", "ref_audio": "AAAA"}, 400, "voice"),
])
def test_base_request_errors(server, body, status, param):
    response = httpx.post(server.url + "/v1/audio/speech", json={"input": "Hi.", **body}, timeout=60)
    assert response.status_code == status and response.json()["error"]["param"] == param


def test_websocket_with_a_stored_voice(server, reference_wav):
    from websockets.sync.client import connect

    voice = _upload(server, reference_wav, x_vector_only_mode="true").json()["id"]
    with connect(server.ws_url + "/v1/audio/speech/stream") as ws:
        ws.send(json.dumps({"type": "session.config", "protocol": "q3tts",
                            "voice": voice, "seed": SEED, "max_new_tokens": 5}))
        ws.send(json.dumps({"type": "input.text", "text": "One sentence. And another."}))
        ws.send(json.dumps({"type": "input.done"}))
        audio = b""
        while (message := ws.recv(timeout=60)) and (isinstance(message, bytes) or '"session.done"' not in message):
            audio += message if isinstance(message, bytes) else b""
    assert len(audio) == 2 * frames(5) * FRAME  # segmentation live: the two sentences are one generation


def test_voice_uploads_are_refused_by_other_checkpoints(tmp_path):
    tts = load_tiny("tiny", tmp_path)
    with ServerThread(ServerConfig(model="tiny", device="cpu", max_running=1, warmup=False), tts) as other:
        response = _upload(other, b"RIFF", x_vector_only_mode="true")
        assert response.status_code == 400 and "Base checkpoint" in response.json()["error"]["message"]
        presets = httpx.get(other.url + "/v1/audio/voices").json()["data"]
        assert {v["id"] for v in presets} >= {"ryan", "serena"} and all(v["type"] == "preset" for v in presets)


def test_voice_design_checkpoint(tmp_path):
    """VoiceDesign: the voice is described in `instructions`; named voices are refused."""
    tts = load_tiny("tiny-voice-design", tmp_path)
    with ServerThread(ServerConfig(model="tiny-voice-design", device="cpu", max_running=1, max_context=512),
                      tts) as design:
        client = openai.OpenAI(base_url=design.url + "/v1", api_key="unused", max_retries=0)
        audio = client.audio.speech.create(model="tiny-voice-design", voice="default", input="Described voice.",
                                           instructions="A deep, calm male voice.", response_format="pcm",
                                           extra_body={"max_new_tokens": MAX_NEW, "seed": SEED})
        assert len(pcm_samples(audio.content)) == frames(MAX_NEW) * FRAME
        for body, param in (({"voice": "ryan", "instructions": "calm"}, "voice"), ({}, "instructions")):
            response = httpx.post(design.url + "/v1/audio/speech", json={"input": "Hi.", **body})
            assert response.status_code == 400 and response.json()["error"]["param"] == param


def test_ref_audio_urls_are_off_by_default_and_limited_when_on(server, reference_wav, tmp_path):
    """A ref_audio URL is refused unless the server allows URLs; allowed, a loopback address is refused unless its
    host is on the allow-list, and a download beyond the upload limit is refused."""
    import functools
    import http.server
    import threading

    (tmp_path / "ref.wav").write_bytes(reference_wav)
    (tmp_path / "big.wav").write_bytes(b"x" * 300_000)
    (tmp_path / "tone.flac").write_bytes(tone_flac(160, 96_000, 2))  # 58 KB, 30.7 M samples
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=tmp_path)
    handler.log_message = lambda *args: None
    files = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=files.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{files.server_address[1]}"
    body = {"input": "Hi.", "ref_audio": f"{url}/ref.wav", "x_vector_only_mode": True, "response_format": "pcm",
            "max_new_tokens": MAX_NEW, "seed": SEED}
    refused = httpx.post(server.url + "/v1/audio/speech", json=body, timeout=60)
    assert refused.status_code == 400 and refused.json()["error"]["code"] == "urls_disabled"
    tts = server.app.state.service.tts
    public_only = ServerConfig(model="tiny-base", device="cpu", max_running=1, allow_ref_audio_urls=True)
    with ServerThread(public_only, tts) as other:
        loopback = httpx.post(other.url + "/v1/audio/speech", json=body, timeout=60)
        assert loopback.status_code == 400 and "private, loopback" in loopback.json()["error"]["message"]
    listed = ServerConfig(model="tiny-base", device="cpu", max_running=1, ref_audio_hosts=("127.0.0.1",),
                          max_upload_bytes=200_000)
    with ServerThread(listed, tts) as other:
        ok = httpx.post(other.url + "/v1/audio/speech", json=body, timeout=60)
        assert ok.status_code == 200 and len(pcm_samples(ok.content)) == frames(MAX_NEW) * FRAME
        big = httpx.post(other.url + "/v1/audio/speech", json={**body, "ref_audio": f"{url}/big.wav"}, timeout=60)
        assert big.status_code == 400 and "the limit is 200000" in big.json()["error"]["message"]
        tone = httpx.post(other.url + "/v1/audio/speech", json={**body, "ref_audio": f"{url}/tone.flac"}, timeout=60)
        assert tone.status_code == 400 and tone.json()["error"]["param"] == "ref_audio"
        assert "may hold at most 28800000" in tone.json()["error"]["message"]
    files.shutdown()
