"""The openai SDK (pinned in the dev extras) against real `q3tts serve` processes: every response format whole and
streamed, every voice name and speech model id the SDK's own types list, its custom-voice API on a Base checkpoint,
and the fields other servers' clients send through `extra_body` (`stream`, `language` codes, `sample_rate`).

Every request ends with the whole request's audio (FRAMES frames: see harness.py), decoded."""

from __future__ import annotations

import base64
import json
import struct
import sys
import typing
from pathlib import Path

import httpx
import openai
import pytest
from openai.types.audio import speech_create_params, speech_model

from tests.clients.conftest import SERVED_MODEL_NAME
from tests.clients.harness import (
    EXAMPLES,
    FRAMES,
    SAMPLE_RATE,
    SECONDS,
    TEXT,
    assert_complete_audio,
    run_client,
    voice_sample,
)


def literals(tp: object) -> list[str]:
    """The string literals of a typing construct (a Literal, or a Union holding some), in order."""
    if typing.get_origin(tp) is typing.Literal:
        return list(typing.get_args(tp))
    return [value for arg in typing.get_args(tp) for value in literals(arg)]


HINTS = typing.get_type_hints(speech_create_params.SpeechCreateParams)
FORMATS = literals(HINTS["response_format"])
VOICES = literals(speech_create_params.Voice)
MODELS = literals(speech_model.SpeechModel)


def test_the_sdk_types_list_what_the_issue_names():
    """The lists the tests below walk, read from the installed SDK (a newer SDK's additions are then tested too)."""
    assert set(FORMATS) == {"mp3", "opus", "aac", "flac", "wav", "pcm"}
    assert {"alloy", "ash", "ballad", "cedar", "coral", "echo", "fable", "marin", "nova", "onyx", "sage", "shimmer",
            "verse"} <= set(VOICES)
    assert {"tts-1", "tts-1-hd", "gpt-4o-mini-tts", "gpt-4o-mini-tts-2025-12-15"} <= set(MODELS)


@pytest.fixture(scope="module")
def client(custom_voice_server) -> openai.OpenAI:
    return openai.OpenAI(base_url=custom_voice_server.url + "/v1", api_key="not-needed", max_retries=0, timeout=60)


def speak(client: openai.OpenAI, **kwargs) -> tuple[bytes, httpx.Headers]:
    """One streamed speech request: (the body, the response headers)."""
    request = {"model": "gpt-4o-mini-tts", "voice": "alloy", "input": TEXT, "response_format": "pcm", **kwargs}
    with client.audio.speech.with_streaming_response.create(**request) as response:
        return b"".join(response.iter_bytes()), response.headers


@pytest.mark.parametrize("fmt", FORMATS)
def test_every_format_whole(client, fmt):
    response = client.audio.speech.create(model="gpt-4o-mini-tts", voice="alloy", input=TEXT, response_format=fmt)
    assert response.response.headers["x-sample-rate"] == str(SAMPLE_RATE)
    assert_complete_audio(response.content, fmt)


@pytest.mark.parametrize("fmt", FORMATS)
def test_every_format_streamed(client, fmt):
    data, headers = speak(client, response_format=fmt)
    assert headers["x-sample-rate"] == str(SAMPLE_RATE)
    assert_complete_audio(data, fmt)


def test_a_streamed_wav_has_the_open_ended_header(client):
    """RIFF and data sizes 0xFFFFFFFF, the standard marks of a stream of unknown length (tts-bench's M* target and
    Python's `wave` read a size of 0xFFFFFFDB as 24.9 hours of audio to wait for)."""
    data, _ = speak(client, response_format="wav")
    assert data[:4] == b"RIFF" and data[8:12] == b"WAVE"
    assert struct.unpack("<I", data[4:8])[0] == 0xFFFFFFFF
    offset = 12
    while data[offset:offset + 4] != b"data":
        offset += 8 + struct.unpack("<I", data[offset + 4:offset + 8])[0]
    assert struct.unpack("<I", data[offset + 4:offset + 8])[0] == 0xFFFFFFFF
    assert len(data) - offset - 8 == round(SECONDS * SAMPLE_RATE) * 2


@pytest.mark.parametrize("voice", VOICES)
def test_every_openai_voice_speaks(client, voice):
    data, _ = speak(client, voice=voice)
    assert_complete_audio(data, "pcm")


def test_the_voice_list_shows_every_openai_voice(custom_voice_server):
    listed = httpx.get(custom_voice_server.url + "/v1/audio/voices", timeout=30).json()
    assert set(VOICES) <= set(strings_in(listed)), sorted(set(VOICES) - set(strings_in(listed)))


def strings_in(value: object) -> list[str]:
    if isinstance(value, str):
        return [value]
    items = value.values() if isinstance(value, dict) else value if isinstance(value, list) else []
    return [s for item in items for s in strings_in(item)]


@pytest.mark.parametrize("model", [*MODELS, SERVED_MODEL_NAME, "tiny-clients", "Qwen/Qwen3-TTS-12Hz-1.7B-CustomVoice"])
def test_every_model_id_is_served(client, model):
    """OpenAI's ids (the dated snapshots included), the served name, the checkpoint folder's name, and the hub id of
    a released checkpoint of the tiny model's kind and size."""
    data, _ = speak(client, model=model)
    assert_complete_audio(data, "pcm")


def test_an_unknown_model_is_refused_naming_it(client):
    with pytest.raises(openai.NotFoundError) as e:
        speak(client, model="gpt-5-tts")
    assert e.value.body["param"] == "model"


@pytest.mark.parametrize("language", ["en", "EN", "en-US", "en-us", "zh-CN", "ja", "English", "english"])
def test_language_takes_codes_and_names(client, language):
    data, _ = speak(client, extra_body={"language": language})
    assert_complete_audio(data, "pcm")


def test_an_unknown_language_is_refused_listing_the_supported(client):
    with pytest.raises(openai.BadRequestError) as e:
        speak(client, extra_body={"language": "xx"})
    assert e.value.body["param"] == "language"
    assert "english" in e.value.body["message"].lower()


@pytest.mark.parametrize("fmt", ["pcm", "wav", "mp3"])
def test_stream_true_without_stream_format_gets_raw_audio(client, fmt):
    """vLLM-Omni's and SGLang-Omni's clients send `stream: true` and expect the audio itself back."""
    data, headers = speak(client, response_format=fmt, extra_body={"stream": True})
    assert not headers["content-type"].startswith("text/event-stream")
    assert_complete_audio(data, fmt)


@pytest.mark.parametrize("stream", [None, True])
def test_sse_carries_the_whole_audio(client, stream):
    extra = {} if stream is None else {"extra_body": {"stream": stream}}
    request = {"model": "gpt-4o-mini-tts", "voice": "alloy", "input": TEXT, "response_format": "pcm",
               "stream_format": "sse", **extra}
    with client.audio.speech.with_streaming_response.create(**request) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        events = [json.loads(line[6:]) for line in response.iter_lines() if line.startswith("data: ")]
    assert [e["type"] for e in events[-1:]] == ["speech.audio.done"]
    assert {e["type"] for e in events[:-1]} == {"speech.audio.delta"}
    pcm = b"".join(base64.b64decode(e["audio"]) for e in events[:-1])
    assert_complete_audio(pcm, "pcm")
    assert events[-1]["usage"]["output_tokens"] == FRAMES


@pytest.mark.parametrize("fmt", ["pcm", "wav", "flac", "mp3"])
@pytest.mark.parametrize("rate", [8000, 16000, 48000])
def test_sample_rate_resamples(client, fmt, rate):
    data, headers = speak(client, response_format=fmt, extra_body={"sample_rate": rate})
    assert headers["x-sample-rate"] == str(rate)
    assert_complete_audio(data, fmt, sample_rate=rate)


@pytest.mark.parametrize("rate", [100, 10_000_000])
def test_a_sample_rate_out_of_range_is_refused_naming_it(client, rate):
    with pytest.raises(openai.BadRequestError) as e:
        speak(client, extra_body={"sample_rate": rate})
    assert e.value.body["param"] == "sample_rate"


@pytest.mark.parametrize("extra, param", [({"temprature": 0.5}, "temprature"), ({"max_new_tokens": "5"},
                                          "max_new_tokens"), ({"stream": "yes"}, "stream")])
def test_what_no_api_has_stays_refused(client, extra, param):
    """A misspelled field is not silently ignored, and types stay strict."""
    with pytest.raises(openai.BadRequestError) as e:
        speak(client, extra_body=extra)
    assert e.value.body["param"] == param


# ---- a Base checkpoint: OpenAI's voice names and the custom-voice API ------------------------------------------

@pytest.fixture(scope="module")
def base_client(base_server) -> openai.OpenAI:
    return openai.OpenAI(base_url=base_server.url + "/v1", api_key="not-needed", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def default_voice_audio(base_server) -> bytes:
    """A request that names no voice speaks with the server's --default-voice (a recording)."""
    body = {"model": "tts-1", "input": TEXT, "response_format": "pcm"}
    response = httpx.post(base_server.url + "/v1/audio/speech", json=body, timeout=60)
    assert response.status_code == 200, response.text
    assert_complete_audio(response.content, "pcm")
    return response.content


@pytest.mark.parametrize("voice", VOICES)
def test_every_openai_voice_speaks_on_base_with_the_default_voice(base_client, default_voice_audio, voice):
    """An OpenAI name with no stored voice of that name is the default voice (greedy: the same bytes)."""
    assert speak(base_client, voice=voice)[0] == default_voice_audio


def test_voices_create_as_the_sdk_sends_it(base_client):
    voice = base_client.audio.voices.create(audio_sample=("sample.wav", voice_sample(), "audio/wav"),
                                            consent="cons_1234", name="narrator")
    assert (voice.object, voice.name, voice.type) == ("audio.voice", "narrator", "audio_sample")
    assert voice.id and isinstance(voice.created_at, int)
    for chosen in ({"id": voice.id}, voice.id, "narrator"):
        data, _ = speak(base_client, voice=chosen)
        assert_complete_audio(data, "pcm")
    deleted = base_client.audio.voices.delete(voice.id)
    assert (deleted.id, deleted.deleted, deleted.object) == (voice.id, True, "audio.voice.deleted")
    with pytest.raises(openai.NotFoundError):
        speak(base_client, voice=voice.id)


def test_a_stored_voice_named_like_an_openai_voice_is_that_voice(base_client):
    """Greedy decoding: the same voice gives the same bytes, another voice other bytes."""
    before, _ = speak(base_client, voice="shimmer")
    voice = base_client.audio.voices.create(audio_sample=("sample.wav", voice_sample(pitch_hz=120), "audio/wav"),
                                            consent="cons_1234", name="shimmer")
    after, _ = speak(base_client, voice="shimmer")
    assert_complete_audio(after, "pcm")
    assert after != before and after == speak(base_client, voice={"id": voice.id})[0]
    base_client.audio.voices.delete(voice.id)
    assert speak(base_client, voice="shimmer")[0] == before


@pytest.fixture(scope="module")
def voice_design_client(voice_design_server) -> openai.OpenAI:
    return openai.OpenAI(base_url=voice_design_server.url + "/v1", api_key="not-needed", max_retries=0, timeout=60)


@pytest.mark.parametrize("voice", VOICES)
def test_every_openai_voice_speaks_on_voice_design(voice_design_client, voice):
    """Each name stands for a default description of a voice; `instructions`, when given, describe it instead
    (greedy: other bytes)."""
    data, _ = speak(voice_design_client, voice=voice)
    assert_complete_audio(data, "pcm")
    described, _ = speak(voice_design_client, voice=voice, instructions="A deep, slow voice.")
    assert_complete_audio(described, "pcm")
    assert described != data


def test_the_streaming_example_writes_the_whole_audio(custom_voice_server, tmp_path):
    """examples/openai_stream_to_file.py, as its docstring runs it."""
    out = tmp_path / "hello.wav"
    run_client(Path(sys.executable), EXAMPLES / "openai_stream_to_file.py", TEXT, "-o", out,
               "--base-url", custom_voice_server.url + "/v1")
    assert_complete_audio(out.read_bytes(), "wav")
