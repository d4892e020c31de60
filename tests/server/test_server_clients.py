"""What the clients of other speech servers send and expect, against q3tts serving tiny models on the CPU: the
bodies of tts-bench's five HTTP targets, the openai SDK's voice names, model ids and custom-voice API, the fields
of vLLM-Omni's, SGLang-Omni's, Kokoro-FastAPI's and nari's speech requests, language codes, `sample_rate`, the
open-ended streamed WAV, the voice alias table and default voice on each kind of checkpoint, and vLLM-Omni's
WebSocket protocol (docs/http-api.md). Cost: three tiny models, ~100 requests of 3 frames, about a minute."""

from __future__ import annotations

import base64
import io
import json
import struct
import typing
import wave

import numpy as np
import pytest

pytest.importorskip("fastapi")

import httpx  # noqa: E402
import openai  # noqa: E402
import soundfile as sf  # noqa: E402
from openai.types.audio import speech_create_params  # noqa: E402
from openai.types.audio.speech_model import SpeechModel  # noqa: E402
from websockets.exceptions import ConnectionClosed  # noqa: E402
from websockets.sync.client import connect  # noqa: E402

from q3tts.server import ServerConfig  # noqa: E402
from q3tts.server.voice_aliases import DESCRIPTIONS, OPENAI_VOICES, SPEAKERS  # noqa: E402
from q3tts.tiny import tiny_checkpoint  # noqa: E402
from tests.server.harness import FRAME, SEED, ServerThread, decoded_samples, frames, load_tiny, pcm_samples  # noqa: E402

MAX_NEW = 4  # 3 frames = 0.24 s per request
TEXT = "Hello world, this is a test."
SAMPLES = frames(MAX_NEW) * FRAME
OVERRIDE = {"alloy": "ryan"}  # the server's own alias over the default table (alloy -> vivian)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    folder = tiny_checkpoint("tiny", tmp_path_factory.mktemp("cache"))
    config = ServerConfig(model=str(folder), served_model_name="tiny", device="cpu", max_running=4, max_waiting=16,
                          max_context=512, max_input_chars=200, voice_aliases={**OVERRIDE, "Boss": "uncle_fu"},
                          default_voice="aiden")
    with ServerThread(config) as running:
        yield running


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def _post(server, **body) -> httpx.Response:
    fields = {"input": TEXT, "max_new_tokens": MAX_NEW, "seed": SEED, "response_format": "pcm", **body}
    return httpx.post(server.url + "/v1/audio/speech", json={k: v for k, v in fields.items() if v is not ...},
                      timeout=60)


def _audio(server, **body) -> bytes:
    response = _post(server, **body)
    assert response.status_code == 200, response.text
    return response.content


def _refused(response: httpx.Response, status: int, param: str, code: str | None = None) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["param"] == param and (code is None or error["code"] == code), error
    return error


# ---- tts-bench ---------------------------------------------------------------------------------------------

# tts-bench 0.1.0 (nari-labs/benchmarks, targets.py: TARGET_CONTRACTS and build_request): every HTTP target sends
# model, input, voice, language, stream: true, non_streaming_mode: false and its contract's fields; --request-param
# adds ours (max_new_tokens, seed)
TTS_BENCH = {"vllm-omni": {"response_format": "pcm", "stream_format": "audio"},
             "sglang-omni": {"response_format": "pcm"}, "voxserve": {"response_format": "pcm"},
             "mstar": {"response_format": "wav"}, "nari": {"response_format": "pcm"}}
PCM_TYPES, WAV_TYPES = {"audio/pcm", "audio/l16", "application/octet-stream", "audio/raw"}, {"audio/wav", "audio/x-wav"}


@pytest.mark.parametrize("target", TTS_BENCH)
def test_tts_bench_targets_get_complete_audio(server, target):
    """Every request of tts-bench's targets was refused (`stream`), SGLang-Omni's wanted x-sample-rate, and M*'s
    streamed WAV declared 0xFFFFFFDB data bytes (24.9 h to Python's wave): now raw audio, the header, and the
    standard open-ended sizes."""
    body = {"model": "Qwen/Qwen3-TTS-12Hz-1.7B-CustomVoice", "voice": "vivian", "language": "English", "stream": True,
            "non_streaming_mode": False, **TTS_BENCH[target]}
    response = _post(server, **body)
    assert response.status_code == 200, response.text
    kind = response.headers["content-type"].split(";")[0]
    assert response.headers["x-sample-rate"] == "24000"
    data = response.content
    if target != "mstar":
        assert kind in PCM_TYPES and len(data) == 2 * SAMPLES
        return
    assert kind in WAV_TYPES and struct.unpack("<I", data[4:8])[0] == struct.unpack("<I", data[40:44])[0] == 0xFFFFFFFF
    with wave.open(io.BytesIO(data)) as wav:
        assert (wav.getnchannels(), wav.getsampwidth(), wav.getframerate()) == (1, 2, 24000)
        assert wav.readframes(10**9) == _post(server, **{**body, "response_format": "pcm"}).content


# ---- the openai SDK ----------------------------------------------------------------------------------------

def _sdk_voices() -> set[str]:
    literal = next(a for a in typing.get_args(speech_create_params.Voice) if typing.get_origin(a) is typing.Literal)
    return set(typing.get_args(literal))


def test_every_openai_voice_name_is_a_preset_speaker(server, client):
    """Pipecat sends nothing but OpenAI's names, LiveKit's default is `ash`: each is a preset speaker (the default
    table, or the server's own alias) and sounds as that speaker does."""
    assert _sdk_voices() == set(OPENAI_VOICES)
    table = {**SPEAKERS, **OVERRIDE}
    speakers = {s: _audio(server, voice=s) for s in set(table.values())}
    assert len(set(speakers.values())) == len(speakers)  # (each speaker sounds its own)
    for name in OPENAI_VOICES:
        audio = client.audio.speech.create(model="gpt-4o-mini-tts", voice=name, input=TEXT, response_format="pcm",
                                           extra_body={"max_new_tokens": MAX_NEW, "seed": SEED}).content
        assert audio == speakers[table[name]], name
    assert _audio(server, voice="BOSS") == _audio(server, voice="uncle_fu")  # (aliases in any case)
    assert _audio(server, voice=...) == _audio(server, voice="default") == _audio(server, voice="aiden")


def test_the_voice_list_has_the_aliases_and_the_default(server):
    listed = httpx.get(server.url + "/v1/audio/voices").json()
    aliases = {a["name"]: a["speaker"] for a in listed["aliases"]}
    assert aliases == {**SPEAKERS, **OVERRIDE, "boss": "uncle_fu"} and listed["default_voice"] == "aiden"
    assert [v["type"] for v in listed["data"]] == ["preset"] * 9 and listed["uploaded_voices"] == []
    assert {"vivian", "alloy", "boss"} <= set(listed["voices"])
    for voice in listed["data"]:  # (each listed voice can be fetched by its id; a preset cannot be deleted)
        assert httpx.get(f"{server.url}/v1/audio/voices/{voice['id']}").json() == voice
    refused = httpx.delete(server.url + "/v1/audio/voices/vivian")
    assert refused.status_code == 400 and "preset" in refused.json()["error"]["message"]
    # In any case, as a request's voice names them (GET "Vivian" was 404 though "voice": "Vivian" speaks)
    assert httpx.get(server.url + "/v1/audio/voices/Vivian").json() == httpx.get(
        server.url + "/v1/audio/voices/vivian").json()
    assert httpx.delete(server.url + "/v1/audio/voices/VIVIAN").status_code == 400


@pytest.mark.parametrize("model", [*typing.get_args(SpeechModel), "tts-1-hd-1106", "gpt-4o-mini-tts-2026-03-20",
                                   "tiny", "tiny-v1", "Qwen/Qwen3-TTS-12Hz-1.7B-CustomVoice",
                                   "qwen3-tts-12hz-1.7b-customvoice"])
def test_openai_model_ids_and_the_checkpoints_names_are_served(server, model):
    assert len(_audio(server, model=model, voice="ryan")) == 2 * SAMPLES


@pytest.mark.parametrize("model", ["tiny", "tts-1", "Qwen/Qwen3-TTS-12Hz-1.7B-CustomVoice"])
def test_the_served_model_can_be_retrieved_by_any_of_its_names(server, client, model):
    """The openai SDK's models.retrieve was a bare 404 "Not Found" for the model the server serves."""
    retrieved = client.models.retrieve(model)
    assert retrieved.id == "tiny" and retrieved.object == "model"
    assert retrieved.model_dump(exclude_unset=True) == httpx.get(server.url + "/v1/models").json()["data"][0]
    with pytest.raises(openai.NotFoundError) as refused:
        client.models.retrieve("Qwen/Qwen3-TTS-12Hz-0.6B-Base")
    assert refused.value.body["code"] == "model_not_found" and "'tiny'" in refused.value.body["message"]


def test_another_model_is_a_404_naming_what_is_served(server):
    error = _refused(_post(server, model="Qwen/Qwen3-TTS-12Hz-0.6B-Base", voice="ryan"), 404, "model",
                     "model_not_found")
    assert "'tiny'" in error["message"] and "Qwen/Qwen3-TTS-12Hz-1.7B-CustomVoice" in error["message"]


# ---- languages ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("language", ["en", "EN", "en-US", "en_gb", "eng", "English", "zh-CN", "zh-Hans-CN", "ja",
                                      "pt-BR", "auto", None])
def test_languages_as_names_codes_and_tags(server, language):
    assert len(_audio(server, voice="ryan", language=language)) == 2 * SAMPLES


@pytest.mark.parametrize("body, param, says", [
    ({"language": "xx"}, "language", "supported: auto, chinese (zh), english (en),"),
    ({"language": "en-"}, "language", "a BCP-47 tag such as en-US"), ({"language": "hi-IN"}, "language", "(en)"),
    ({"lang_code": "h"}, "lang_code", "this model takes a (english), b (english), e (spanish)"),
    ({"lang_code": "a", "language": "en"}, "lang_code", "send one of them")])
def test_an_unknown_language_lists_the_supported_ones(server, body, param, says):
    assert says in _refused(_post(server, voice="ryan", **body), 400, param)["message"]


def test_kokoro_lang_code(server):
    english = _audio(server, voice="ryan", language="english")
    assert _audio(server, voice="ryan", lang_code="a") == english != _audio(server, voice="ryan", lang_code="j")


# ---- sample_rate and audio on the wire ---------------------------------------------------------------------

@pytest.mark.parametrize("fmt, rate", [("pcm", 16000), ("pcm", 44100), ("wav", 8000), ("flac", 22050),
                                       ("mp3", 22050), ("opus", 16000), ("aac", 48000)])
def test_sample_rate_resamples(server, fmt, rate):
    response = _post(server, voice="ryan", response_format=fmt, sample_rate=rate)
    assert response.status_code == 200, response.text
    assert response.headers["x-sample-rate"] == str(rate)
    expected = SAMPLES * rate / 24000
    if fmt == "pcm":
        assert len(pcm_samples(response.content)) == expected
        return
    samples, decoded_rate = decoded_samples(response.content)
    assert decoded_rate == (48000 if fmt == "opus" else rate)  # (Opus decodes at 48 kHz whatever it was made at)
    assert abs(samples / decoded_rate - expected / rate) <= 0.08, (samples, decoded_rate)


@pytest.mark.parametrize("body, says", [({"sample_rate": 96000}, "less than or equal to 48000"),
                                        ({"sample_rate": 4000}, "greater than or equal to 8000"),
                                        ({"sample_rate": 22050, "response_format": "opus"}, "opus takes 8000, 12000"),
                                        ({"sample_rate": "16000"}, "valid integer"),
                                        ({"sample_rate": 16000.0}, "valid integer")])
def test_a_sample_rate_out_of_range_is_refused_naming_the_range(server, body, says):
    assert says in _refused(_post(server, voice="ryan", **body), 400, "sample_rate")["message"]


def test_volume_multiplier_scales_the_samples(server):
    plain = pcm_samples(_audio(server, voice="ryan")).astype(np.int32)
    half = pcm_samples(_audio(server, voice="ryan", volume_multiplier=0.5)).astype(np.int32)
    assert np.abs(plain - 2 * half).max() <= 2 and np.abs(plain).max() > 100


# ---- other servers' fields ---------------------------------------------------------------------------------

@pytest.mark.parametrize("body", [
    {"stream": False}, {"stream_format": None, "speed": None, "x_vector_only_mode": None},
    {"voice": ..., "speaker": "ryan"}, {"instruct": "Speak slowly."}, {"initial_codec_chunk_frames": 1},
    {"stream_chunk_schedule": [1, 2, 4], "stream_first_chunk_frames": 1, "skip_fixed_bootstrap_audio": False},
    {"normalization_options": {"normalize": False}, "download_format": "mp3", "return_download_link": False},
    {"word_timestamps": False, "ignore_eos": False, "extra_params": {}, "stage_params": None, "ref_audio_2": None},
    {"voice": "narrator", "voice_aliases": {"Narrator": "ryan"}},
    {"voice": "narrator", "voice_aliases": {"narrator": {"voice": "ryan", "rate": 1.0}}},
])
def test_fields_of_other_apis_are_accepted(server, body):
    assert len(_audio(server, **{"voice": "ryan", **body})) == 2 * SAMPLES


@pytest.mark.parametrize("body, param, code", [
    ({"temprature": 0.5}, "temprature", "invalid_value"),  # a misspelled field is never taken for another API's
    ({"stream": "true"}, "stream", "invalid_value"),
    ({"stream_format": "chunks"}, "stream_format", "invalid_value"),
    ({"word_timestamps": True}, "word_timestamps", "unsupported"),
    ({"ignore_eos": True}, "ignore_eos", "unsupported"),
    ({"extra_params": {"x": 1}}, "extra_params", "unsupported"),
    ({"ref_audio_2": "AAAA"}, "ref_audio_2", "unsupported"),
    ({"ssml": True}, "ssml", "unsupported"),
    ({"speaker": "vivian"}, "speaker", "invalid_value"),  # beside `voice`
    ({"speaker": 5, "voice": ...}, "speaker", "invalid_value"),
    ({"instruct": "Loud.", "instructions": "Soft."}, "instruct", "invalid_value"),
    ({"initial_codec_chunk_frames": -1}, "initial_codec_chunk_frames", "invalid_value"),
    ({"stream_chunk_schedule": [0]}, "stream_chunk_schedule.0", "invalid_value"),
    ({"volume_multiplier": 11}, "volume_multiplier", "invalid_value"),
    ({"references": [{"audio": "AAAA"}]}, "references", "invalid_value"),  # cloning, on a CustomVoice checkpoint
    ({"speaker_embedding": [0.5]}, "speaker_embedding", "invalid_value"),
    ({"normalization_options": {"normalise": True}}, "normalization_options.normalise", "invalid_value"),
    ({"voice_aliases": {"narr": "ryan", "NARR": "vivian"}}, "voice_aliases", "invalid_value"),  # (one name twice)
])
def test_what_no_api_has_or_q3tts_cannot_do_is_a_400_naming_it(server, body, param, code):
    _refused(_post(server, **{"voice": "ryan", **body}), 400, param, code)


@pytest.mark.parametrize("target, param, says", [
    ({"voice": "ryan", "rate": 5}, "voice_aliases.n.rate", "must be from 0.25 to 4"),
    ({"voice": "ryan", "rate": "2"}, "voice_aliases.n.rate", "Input should be a valid number"),
    ({"rate": 2}, "voice_aliases.n.voice", "Field required"),
    ({"voice": "ryan", "x": 1}, "voice_aliases.n.x", "unknown field"),
    (5, "voice_aliases.n", 'must be a voice (a string) or {"voice": ..., "rate": ...}, not a number'),
    (["ryan"], "voice_aliases.n", "not an array"),
    ("", "voice_aliases.n", "String should have at least 1 character"),
    ("r" * 257, "voice_aliases.n", "String should have at most 256 characters"),
])
def test_a_bad_alias_is_refused_for_its_own_fault(server, target, param, says):
    """The alias of the value's JSON type is checked, at the field: pydantic's union named its members
    ("voice_aliases.n.str: Input should be a valid string" for an object whose rate was out of range)."""
    error = _refused(_post(server, voice="n", voice_aliases={"n": target}), 400, param)
    assert error["message"] == f"{param}: {says}" or says in error["message"], error
    assert "str" not in error["param"] and "KokoroAlias" not in error["message"], error


@pytest.mark.parametrize("speed", [5, 0.1])
def test_a_speed_out_of_range_is_refused_naming_the_range(server, speed):
    error = _refused(_post(server, voice="ryan", speed=speed), 400, "speed")
    assert error["message"] == "speed: must be from 0.25 to 4", error


def test_an_alias_name_of_the_wrong_length_is_refused(server):
    error = _refused(_post(server, voice="ryan", voice_aliases={"": "ryan"}), 400, "voice_aliases")
    assert "names are 1-256 characters" in error["message"], error


def test_stream_true_gets_raw_audio_and_sse_when_asked(server):
    assert _post(server, voice="ryan", stream=True).headers["content-type"] == "audio/pcm"
    sse = _post(server, voice="ryan", stream=True, stream_format="sse")
    assert sse.headers["content-type"].startswith("text/event-stream") and sse.headers["x-sample-rate"] == "24000"


# ---- Base: OpenAI's names, its custom-voice API, the default voice -----------------------------------------

@pytest.fixture(scope="module")
def reference_wav() -> bytes:
    t = np.arange(24000) / 24000
    wav = 0.3 * np.sin(2 * np.pi * 180 * t) * (1 + np.sin(2 * np.pi * 4 * t))
    out = io.BytesIO()
    sf.write(out, wav.astype(np.float32), 24000, format="WAV")
    return out.getvalue()


@pytest.fixture(scope="module")
def base_tts(tmp_path_factory):
    return load_tiny("tiny-base", tmp_path_factory.mktemp("cache"))


@pytest.fixture(scope="module")
def base_server(base_tts):
    config = ServerConfig(model="tiny-base", device="cpu", max_running=2, max_context=512)
    with ServerThread(config, base_tts) as running:
        yield running


def test_openai_names_on_base_need_a_voice_of_that_name(base_server, reference_wav):
    """On a Base checkpoint `ash` is a clear 400 saying how to make it work; the openai SDK's
    `audio.voices.create` (audio_sample, consent, name) makes one, answered in OpenAI's voice shape."""
    error = _refused(_post(base_server, voice="ash"), 400, "voice", "voice_not_configured")
    assert "--voice-alias ash=" in error["message"] and "--default-voice" in error["message"]
    sdk = openai.OpenAI(base_url=base_server.url + "/v1", api_key="unused", max_retries=0)
    voice = sdk.audio.voices.create(audio_sample=("ref.wav", reference_wav, "audio/wav"), consent="cons_1234",
                                    name="ash")
    assert (voice.object, voice.type, voice.name) == ("audio.voice", "audio_sample", "ash")
    assert voice.id.startswith("voice_") and voice.created_at > 0 and voice.x_vector_only_mode  # (no transcript)
    assert len(_audio(base_server, voice="ash")) == 2 * SAMPLES
    assert _audio(base_server, voice={"id": voice.id}) == _audio(base_server, voice="ash")
    assert sdk.audio.voices.delete(voice.id).deleted
    _refused(_post(base_server, voice="ash"), 400, "voice", "voice_not_configured")


@pytest.mark.parametrize("fields, files, param", [
    ({"consent": "c", "name": "x"}, {"file": "a.wav", "audio_sample": "b.wav"}, "file"),  # both
    ({"type": "prompt", "name": "x", "prompt": "A calm voice."}, {}, "type"),
    ({"consent": "c" * 300, "name": "x"}, {"audio_sample": "a.wav"}, "consent"),
    ({"type": "sample", "name": "x"}, {"audio_sample": "a.wav"}, "type"),
])
def test_the_custom_voice_form_is_strict(base_server, reference_wav, fields, files, param):
    parts = [(field, (name, reference_wav, "audio/wav")) for field, name in files.items()]
    response = httpx.post(base_server.url + "/v1/audio/voices", files=parts or None, data=fields, timeout=60)
    _refused(response, 400, param)


def test_speaker_embedding_and_references_clone_inline(base_server, base_tts, reference_wav):
    size = base_tts.config.talker_config.hidden_size
    embedding = base_tts.create_voice(reference_wav, None, True).ref_spk_embedding.flatten().tolist()
    by_embedding = _audio(base_server, voice="alloy", speaker_embedding=embedding)  # (the SDK's name: no voice)
    inline = {"ref_audio": base64.b64encode(reference_wav).decode(), "x_vector_only_mode": True}
    assert by_embedding == _audio(base_server, **inline)
    assert by_embedding == _audio(base_server, references=[{"audio": inline["ref_audio"]}], x_vector_only_mode=True)
    error = _refused(_post(base_server, speaker_embedding=[0.5] * (size + 1)), 400, "speaker_embedding")
    assert f"have {size}" in error["message"]
    _refused(_post(base_server, references=[{"audio": "AAAA"}], ref_audio="AAAA"), 400, "references")


@pytest.mark.parametrize("body, param, says", [
    ({"references": [{}]}, "references.0", "the reference has no audio"),
    ({"references": [{"text": "Hello."}]}, "references.0", "the reference has no audio"),
    ({"references": [{"audio_path": "/etc/passwd"}]}, "references.0.audio_path",
     "references.0.audio_path must be an http(s) URL, a data: URL or base64-encoded audio"),
    ({"references": [{"data": "http://example.com/a.wav"}]}, "references.0.data", "URLs are turned off"),
    ({"references": [{"audio": "AAAA", "data": "AAAA"}]}, "references.0", "not audio and data together"),
    ({"ref_audio": "/etc/passwd"}, "ref_audio", "ref_audio must be an http(s) URL"),
    ({"ref_audio": "bm90IGF1ZGlvIGF0IGFsbA==", "x_vector_only_mode": True}, "ref_audio",
     "ref_audio: not a readable audio file"),  # (base64 of "not audio at all"; it was "audio bytes: ...")
    ({"references": [{"data": "bm90IGF1ZGlvIGF0IGFsbA=="}], "x_vector_only_mode": True}, "references.0.data",
     "references.0.data: not a readable audio file"),
    ({"instruct": "Happy."}, "instruct", "Base checkpoints take no instructions"),
    ({"instructions": "Happy."}, "instructions", "Base checkpoints take no instructions"),
])
def test_base_errors_name_the_field_as_sent(base_server, body, param, says):
    """A reference in `references` is named as its item and key, an alias (`instruct`) as the client spelled it
    (they were ref_audio, instructions, and `voice` for a reference with no audio)."""
    error = _refused(_post(base_server, **body), 400, param)
    assert says in error["message"], error


def test_a_websocket_session_names_the_alias_it_was_sent(base_server):
    with connect(base_server.ws_url + "/v1/audio/speech/stream") as ws:
        ws.send(json.dumps({"type": "session.config", "instruct": "Happy.", "max_new_tokens": MAX_NEW}))
        (error,) = _until(ws, "error")
    assert error["error"]["param"] == "instruct" and "no instructions" in error["message"], error


def test_a_default_voice_from_a_recording(base_tts, reference_wav, tmp_path):
    """`--default-voice ref.wav`: cloned at start-up; OpenAI's names without a stored voice of theirs, and requests
    that name none, speak in it."""
    path = tmp_path / "ref.wav"
    path.write_bytes(reference_wav)
    config = ServerConfig(model="tiny-base", device="cpu", max_running=2, max_context=512, warmup=False,
                          default_voice=str(path), voice_aliases={"narrator": "nobody-stored"})
    with ServerThread(config, base_tts) as running:
        inline = _audio(running, ref_audio=base64.b64encode(reference_wav).decode(), x_vector_only_mode=True)
        assert _audio(running, voice="nova") == _audio(running, voice=...) == inline
        assert httpx.get(running.url + "/v1/audio/voices").json()["default_voice"] == str(path)
        _refused(_post(running, voice="narrator"), 404, "voice", "voice_not_found")  # an alias of nothing stored


# ---- VoiceDesign -------------------------------------------------------------------------------------------

def test_openai_names_on_voice_design_are_descriptions(tmp_path):
    config = ServerConfig(model="tiny-voice-design", device="cpu", max_running=2, max_context=512, warmup=False)
    with ServerThread(config, load_tiny("tiny-voice-design", tmp_path)) as running:
        onyx = _audio(running, voice="onyx")
        assert onyx == _audio(running, instructions=DESCRIPTIONS["onyx"]) != _audio(running, voice="nova")
        mine = "A child's high, excited voice."
        assert _audio(running, voice="onyx", instructions=mine) == _audio(running, instructions=mine) != onyx
        _refused(_post(running, voice="bob", instructions=mine), 400, "voice")
        error = _refused(_post(running), 400, "instructions", "missing")
        assert "--default-voice" in error["message"]


# ---- vLLM-Omni's WebSocket ---------------------------------------------------------------------------------

def _until(ws, kind: str) -> list:
    """Messages up to and including the first event of `kind`."""
    received = []
    while True:
        message = ws.recv(timeout=60)
        received.append(message if isinstance(message, bytes) else json.loads(message))
        if isinstance(received[-1], dict) and received[-1]["type"] in (kind, "error"):
            return received


def test_a_vllm_omni_client_works_unchanged(server):
    """vLLM-Omni's example client's session (its defaults: speaker Vivian, wav, one whole file per utterance),
    a second utterance on the same connection with streamed pcm cut at sentences, then session.close."""
    with connect(server.ws_url + "/v1/audio/speech/stream") as ws:
        ws.send(json.dumps({"type": "session.config", "speaker": "Vivian", "task_type": "CustomVoice",
                            "language": "Auto", "response_format": "wav", "speed": 1.0, "max_new_tokens": MAX_NEW,
                            "seed": SEED}))
        for message in ({"type": "input.text", "text": "Hello there. "}, {"type": "input.text", "text": "Bye."},
                        {"type": "input.done"}):
            ws.send(json.dumps(message))
        start, audio, done, finished = _until(ws, "session.done")
        assert start == {"type": "audio.start", "utterance_index": 0, "sentence_index": 0,
                         "sentence_text": "Hello there. Bye.", "format": "wav", "sample_rate": 24000, "channels": 1}
        assert done == {"type": "audio.done", "utterance_index": 0, "sentence_index": 0, "total_bytes": len(audio),
                        "error": False}
        assert finished == {"type": "session.done", "utterance_index": 0, "total_sentences": 1}
        riff, data = struct.unpack("<I", audio[4:8])[0], struct.unpack("<I", audio[40:44])[0]
        assert (riff, data) == (len(audio) - 8, len(audio) - 44)  # a whole file: its true sizes
        with wave.open(io.BytesIO(audio)) as wav:
            assert wav.getnframes() == frames(MAX_NEW) * FRAME

        ws.send(json.dumps({"type": "session.config", "voice": "vivian", "response_format": "pcm",
                            "stream_audio": True, "split_granularity": "sentence", "max_new_tokens": MAX_NEW,
                            "seed": SEED}))
        ws.send(json.dumps({"type": "input.text", "text": "One sentence. And two."}))
        ws.send(json.dumps({"type": "input.done"}))
        second = _until(ws, "session.done")
        events = [m for m in second if isinstance(m, dict)]
        assert [(e["type"], e.get("sentence_index")) for e in events] == [
            ("audio.start", 0), ("audio.done", 0), ("audio.start", 1), ("audio.done", 1), ("session.done", None)]
        assert events[-1] == {"type": "session.done", "utterance_index": 1, "total_sentences": 2}
        pcm = b"".join(m for m in second if isinstance(m, bytes))
        assert len(pcm) == 2 * 2 * SAMPLES and events[1]["total_bytes"] + events[3]["total_bytes"] == len(pcm)
        ws.send(json.dumps({"type": "session.close"}))
        with pytest.raises(ConnectionClosed):
            ws.recv(timeout=30)
        assert ws.close_code == 1000


@pytest.mark.parametrize("second, param", [
    ({"type": "input.flush"}, "type"),  # q3tts's, not vLLM-Omni's
    ({"type": "session.config", "voice": "ryan"}, "type"),  # mid-utterance
])
def test_vllm_omni_session_errors_carry_its_message_and_the_error_object(server, second, param):
    with connect(server.ws_url + "/v1/audio/speech/stream") as ws:
        ws.send(json.dumps({"type": "session.config", "voice": "ryan", "max_new_tokens": MAX_NEW}))
        ws.send(json.dumps({"type": "input.text", "text": "Half a sentence"}))
        ws.send(json.dumps(second))
        (error,) = _until(ws, "error")
        with pytest.raises(ConnectionClosed):
            ws.recv(timeout=30)
        assert ws.close_code == 1008
    assert error["message"] == error["error"]["message"] and error["error"]["param"] == param


def test_a_q3tts_session_refuses_vllm_omnis_settings(server):
    with connect(server.ws_url + "/v1/audio/speech/stream") as ws:
        ws.send(json.dumps({"type": "session.config", "protocol": "q3tts", "voice": "ryan", "stream_audio": True}))
        (error,) = _until(ws, "error")
    assert error["error"]["param"] == "protocol"


def test_a_vllm_omni_utterance_is_at_most_an_input_long(server):
    """split_granularity "none" speaks the utterance as one request: at most --max-input-chars (200 here)."""
    with connect(server.ws_url + "/v1/audio/speech/stream") as ws:
        ws.send(json.dumps({"type": "session.config", "voice": "ryan", "split_granularity": "none"}))
        ws.send(json.dumps({"type": "input.text", "text": "word " * 40}))
        ws.send(json.dumps({"type": "input.text", "text": "more"}))
        (error,) = _until(ws, "error")
    assert (error["error"]["param"], error["error"]["code"]) == ("text", "input_too_long")
    assert "over 200 characters" in error["message"]


def test_a_vllm_omni_utterance_is_spoken_live_from_its_first_words(server):
    """segmentation live (the default): an utterance's audio streams before a sentence end or input.done was
    sent, as one segment (sentence_index 0) whose audio.start carries the text received by then."""
    with connect(server.ws_url + "/v1/audio/speech/stream") as ws:
        ws.send(json.dumps({"type": "session.config", "voice": "ryan", "response_format": "pcm",
                            "stream_audio": True, "max_new_tokens": 8}))
        for text in ("Hello there", " my friend"):
            ws.send(json.dumps({"type": "input.text", "text": text}))
        start, first = json.loads(ws.recv(timeout=60)), ws.recv(timeout=60)
        assert (start["type"], start["utterance_index"], start["sentence_index"]) == ("audio.start", 0, 0)
        assert "Hello there my friend".startswith(start["sentence_text"]) and isinstance(first, bytes)
        ws.send(json.dumps({"type": "input.done"}))
        received = _until(ws, "session.done")
        ws.send(json.dumps({"type": "session.close"}))
    events = [m for m in received if isinstance(m, dict)]
    assert [e["type"] for e in events] == ["audio.done", "session.done"] and events[1]["total_sentences"] == 1
    assert events[0]["total_bytes"] == len(first) + sum(len(m) for m in received if isinstance(m, bytes))
