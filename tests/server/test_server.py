"""The HTTP server end to end: uvicorn on localhost, the tiny CustomVoice model on the CPU, the official `openai`
client. Speech in every format (plain and streamed), SSE, /v1/models, health/metrics, request ids, error shapes
and the WebSocket text-streaming protocol."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import time

import numpy as np
import pytest

pytest.importorskip("fastapi")

import httpx  # noqa: E402
import openai  # noqa: E402
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402
from websockets.exceptions import ConnectionClosed  # noqa: E402
from websockets.sync.client import connect  # noqa: E402

from q3tts.server import ServerConfig  # noqa: E402
from q3tts.tiny import tiny_checkpoint  # noqa: E402
from tests.server.harness import (  # noqa: E402
    FRAME,
    SEED,
    ServerThread,
    decoded_samples,
    events_until_close,
    frames,
    pcm_samples,
)

MAX_NEW = 9  # 8 frames = 0.64 s per request
TEXT = "Hello world, this is a test."


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    folder = tiny_checkpoint("tiny", tmp_path_factory.mktemp("cache"))
    config = ServerConfig(model=str(folder), served_model_name="tiny", device="cpu", max_running=2, max_waiting=4,
                          max_context=512, max_input_chars=200)
    with ServerThread(config) as running:
        yield running


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def _speech(**overrides) -> dict:
    return {"model": "tiny", "voice": "ryan", "input": TEXT, "extra_body": {"max_new_tokens": MAX_NEW, "seed": SEED},
            **overrides}


@pytest.mark.parametrize("fmt", ["mp3", "opus", "aac", "flac", "wav", "pcm"])
def test_every_format_plain_and_streamed(client, fmt):
    plain = client.audio.speech.create(**_speech(response_format=fmt)).content
    with client.audio.speech.with_streaming_response.create(**_speech(response_format=fmt)) as response:
        assert response.headers["content-type"].startswith("audio/")
        chunks = list(response.iter_bytes())
    streamed = b"".join(chunks)
    expected = frames(MAX_NEW) * FRAME
    assert len(chunks) >= 2 or fmt == "flac"  # delivered in pieces as it is generated (FLAC: whole, at the end)
    if fmt != "opus":  # seeded: the same audio (Ogg streams get a random serial number)
        assert streamed == plain
    if fmt == "pcm":
        assert len(plain) == 2 * expected
        return
    samples, rate = decoded_samples(plain)
    assert rate == (48000 if fmt == "opus" else 24000)
    assert abs(samples / rate - expected / 24000) <= 0.08, (samples, rate)
    if fmt == "wav":
        assert plain[:4] == b"RIFF" and len(plain) == 44 + 2 * expected


def test_default_format_is_mp3_and_speed_stretches(client):
    response = client.audio.speech.create(**_speech())
    assert response.response.headers["content-type"] == "audio/mpeg"
    fast = client.audio.speech.create(**_speech(response_format="pcm", speed=2.0)).content
    assert abs(len(pcm_samples(fast)) - frames(MAX_NEW) * FRAME / 2) < 0.05 * frames(MAX_NEW) * FRAME


@pytest.mark.parametrize("speed", [0.25, 0.5, 0.75, 1.5, 4.0])
def test_speed_delivers_the_whole_length(server, speed):
    """25 frames at speed 0.25 / 0.5 / 0.75 lost 55 / 34 / 16 ms of their end (time_stretch.py)."""
    body = {"input": TEXT, "voice": "ryan", "response_format": "pcm", "speed": speed, "seed": SEED,
            "max_new_tokens": 26}
    response = httpx.post(server.url + "/v1/audio/speech", json=body, timeout=60)
    missing = frames(26) * FRAME / speed - len(pcm_samples(response.content))
    assert response.status_code == 200 and abs(missing) <= 0.003 * 24000, f"{missing / 24:.1f} ms missing"


def test_instructions_steer_a_1_7b_custom_voice(client):
    audio = client.audio.speech.create(**_speech(response_format="pcm", instructions="Speak slowly and warmly."))
    assert len(pcm_samples(audio.content)) == frames(MAX_NEW) * FRAME


def test_sse_stream(server):
    body = {"input": TEXT, "voice": "ryan", "response_format": "pcm", "stream_format": "sse", "max_new_tokens": MAX_NEW,
            "seed": SEED}
    with httpx.stream("POST", server.url + "/v1/audio/speech", json=body, timeout=60) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        events = [json.loads(line[6:]) for line in response.iter_lines() if line.startswith("data: ")]
    deltas = [e for e in events if e["type"] == "speech.audio.delta"]
    audio = b"".join(base64.b64decode(e["audio"]) for e in deltas)
    assert len(deltas) == frames(MAX_NEW) and len(audio) == 2 * frames(MAX_NEW) * FRAME
    assert events[-1]["type"] == "speech.audio.done" and events[-1]["finish_reason"] == "length"
    usage = events[-1]["usage"]
    assert usage["output_tokens"] == frames(MAX_NEW) and usage["input_tokens"] > 0
    assert usage["total_tokens"] == usage["input_tokens"] + usage["output_tokens"]


def test_models_health_ready(server, client):
    models = client.models.list().data
    assert [m.id for m in models] == ["tiny"] and models[0].task_type == "CustomVoice"
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}
    assert httpx.get(server.url + "/ready").json() == {"ready": True}


def test_metrics_after_requests(server, client):
    for _ in range(2):  # the same voice twice: the second reuses its prompt prefix (after the warm-up's voice)
        client.audio.speech.create(**_speech(response_format="pcm"))
    text = httpx.get(server.url + "/metrics").text
    for name in ("q3tts_queue_depth", "q3tts_running_streams", "q3tts_time_to_first_audio_seconds_bucket",
                 "q3tts_real_time_factor_bucket", "q3tts_frames_generated_total", "q3tts_requests_total",
                 "q3tts_errors_total", "q3tts_engine_requests_finished_total"):
        assert name in text, name
    samples = {line.split(" ")[0]: float(line.split(" ")[1]) for line in text.splitlines()
               if line and not line.startswith("#")}
    assert samples["q3tts_frames_generated_total"] >= frames(MAX_NEW)
    assert samples["q3tts_time_to_first_audio_seconds_count"] >= 1
    assert samples['q3tts_requests_total{method="POST",route="/v1/audio/speech",status="200"}'] >= 1
    assert samples["q3tts_prefix_cache_hits_total"] >= 1 and samples["q3tts_prefix_cache_misses_total"] >= 1
    assert "q3tts_codec_references_reused_total" in samples and "q3tts_codec_references_decoded_total" in samples


def test_request_id_is_set_and_honoured(server):
    assert httpx.get(server.url + "/health").headers["x-request-id"].startswith("req_")
    mine = {"x-request-id": "client-id.42"}
    assert httpx.get(server.url + "/v1/models", headers=mine).headers["x-request-id"] == "client-id.42"
    refused = httpx.post(server.url + "/v1/audio/speech", json={"input": "", "voice": "ryan"}, headers=mine)
    assert refused.status_code == 400 and refused.headers["x-request-id"] == "client-id.42"
    hostile = httpx.get(server.url + "/health", headers={"x-request-id": "bad id\twith spaces"})
    assert hostile.headers["x-request-id"].startswith("req_")


@pytest.mark.parametrize("body, status, param, code", [
    ({"input": "   "}, 400, "input", "invalid_value"),
    ({"input": "x" * 201}, 400, "input", "input_too_long"),
    ({"voice": "nobody"}, 404, "voice", "voice_not_found"),
    ({"voice": None}, 400, "voice", "missing"),
    ({"task_type": "Base"}, 400, "task_type", "invalid_value"),
    ({"task_type": "Nonsense"}, 400, "task_type", "invalid_value"),
    ({"response_format": "ogg"}, 400, "response_format", "invalid_value"),
    ({"speed": 5.0}, 400, "speed", "invalid_value"),
    ({"temperature": 0}, 400, "temperature", "invalid_value"),
    ({"top_p": 1.5}, 400, "top_p", "invalid_value"),
    ({"top_k": -1}, 400, "top_k", "invalid_value"),
    ({"max_new_tokens": 600}, 400, "max_new_tokens", "invalid_value"),
    ({"max_new_tokens": 1}, 400, "max_new_tokens", "invalid_value"),  # no audio at all: refused
    ({"language": "klingon"}, 400, "language", "invalid_value"),
    ({"ref_audio": "data:audio/wav;base64,AAAA"}, 400, "ref_audio", "invalid_value"),
    ({"x_vector_only_mode": True}, 400, "x_vector_only_mode", "invalid_value"),
    ({"model": "other-model"}, 404, "model", "model_not_found"),
    ({"unknown_field": 1}, 400, "unknown_field", "invalid_value"),
    ({"input": None}, 400, "input", "invalid_value"),
])
def test_bad_requests_are_refused_before_any_audio(server, body, status, param, code):
    response = httpx.post(server.url + "/v1/audio/speech", json={"input": TEXT, "voice": "ryan", **body})
    assert response.status_code == status, response.text
    assert response.headers["content-type"] == "application/json"
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert (error["param"], error["code"], error["type"]) == (param, code, "invalid_request_error")


def test_errors_quote_at_most_40_characters_of_an_unknown_field(server):
    """An unknown key is its own location in the validation error: a megabyte-long one got a 2 MB answer (the key
    in both `message` and `param`). Over HTTP and in the WebSocket's config alike."""
    key = "k" * 1_000_000
    response = httpx.post(server.url + "/v1/audio/speech", json={"input": TEXT, "voice": "ryan", key: 1})
    assert response.status_code == 400 and len(response.content) < 500, len(response.content)
    with connect(server.ws_url + "/v1/audio/speech/stream", max_size=None) as ws:
        ws.send(json.dumps({"type": "session.config", "protocol": "q3tts", "voice": "ryan", key: 1}))
        events, _ = events_until_close(ws)
    for error in (response.json()["error"], events[0]["error"]):
        assert error["param"] == f"'{'k' * 40}'... (1000000 characters)", error["param"][:100]
        assert error["message"] == f"{error['param']}: unknown field (docs/http-api.md lists the fields each API " \
                                   "sends)", error["message"][:100]
        assert error["code"] == "invalid_value"


def test_a_misspelt_field_is_answered_with_the_closest_one(server):
    """A typo is refused (nothing a client sent is dropped silently) with the field it probably meant, over HTTP
    and in the WebSocket's config."""
    response = httpx.post(server.url + "/v1/audio/speech", json={"inptu": TEXT, "voice": "ryan"})
    assert response.status_code == 400
    assert response.json()["error"]["message"] == "inptu: unknown field; did you mean 'input'?"
    with connect(server.ws_url + "/v1/audio/speech/stream") as ws:
        ws.send(json.dumps({"type": "session.config", "protocol": "q3tts", "voice": "ryan", "instruction": "Calm."}))
        events, _ = events_until_close(ws)
    assert events[0]["error"]["message"] == "instruction: unknown field; did you mean 'instructions'?"


def test_text_that_is_not_unicode_is_a_bad_request(server):
    """JSON can carry a lone surrogate ("\\ud800"), which no tokenizer takes: a 400 naming the field, not a 500."""
    for field, rest in (("input", {"voice": "ryan"}), ("instructions", {"voice": "ryan", "input": "Hello."})):
        body = json.dumps({**rest, field: "Hi \ud800 there"}).encode()  # (ensure_ascii: sent as \\ud800)
        response = httpx.post(server.url + "/v1/audio/speech", content=body,
                              headers={"content-type": "application/json"})
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["param"] == field and "not valid Unicode" in error["message"], error


def test_websocket_text_that_is_not_unicode_names_its_field(server):
    """A lone surrogate in an input.text message is refused as it arrives, naming `text` (it once surfaced when its
    segment was spoken, naming the HTTP API's `input`)."""
    with connect(server.ws_url + "/v1/audio/speech/stream") as ws:
        ws.send(json.dumps({"type": "session.config", "protocol": "q3tts",
                            "voice": "ryan", "seed": SEED, "max_new_tokens": 2}))
        assert json.loads(ws.recv(timeout=30))["type"] == "session.created"
        ws.send(json.dumps({"type": "input.text", "text": "Hi \ud800 there."}))
        with contextlib.suppress(ConnectionClosed):  # (the server may have refused the text and closed already)
            ws.send(json.dumps({"type": "input.done"}))
        events, _ = events_until_close(ws)
    error = events[-1]["error"]
    assert (error["param"], error["message"]) == ("text", "text is not valid Unicode: surrogates not allowed at "
                                                          "character 3"), error


def test_messages_name_the_http_fields(server):
    """The request builder names its arguments as Python spells them (`text`, `instruct`); the API's messages name
    the fields the client sent, as `param` does."""
    blank = httpx.post(server.url + "/v1/audio/speech", json={"input": "   ", "voice": "ryan"}).json()["error"]
    assert (blank["param"], blank["message"]) == ("input", "input is empty"), blank
    hidden = httpx.post(server.url + "/v1/audio/speech", json={"input": "\u200b\u200b", "voice": "ryan"})
    hidden = hidden.json()["error"]
    assert (hidden["param"], hidden["message"]) == (
        "input", "input has nothing to speak: only spaces and invisible characters (U+200B)"), hidden
    body = json.dumps({"input": "Hello.", "voice": "ryan", "instructions": "\udfff"}).encode()
    bad = httpx.post(server.url + "/v1/audio/speech", content=body, headers={"content-type": "application/json"})
    error = bad.json()["error"]
    assert error["param"] == "instructions" and error["message"].startswith("instructions is not valid Unicode")


@pytest.mark.parametrize("voice, says, code", [
    ({"id": ""}, 'voice: "id" is empty', "invalid_value"),
    ({"id": 5}, 'voice: "id" must be a string, not a number', "invalid_value"),
    ({"id": "vivian", "x": 1}, "voice: unknown key 'x'", "invalid_value"),
    ({}, 'voice: an object voice needs "id"', "missing"),
    (5, 'voice: must be a string (a voice name or id) or {"id": ...}, not a number', "invalid_value"),
    (["ryan"], 'voice: must be a string (a voice name or id) or {"id": ...}, not an array', "invalid_value"),
])
def test_a_bad_voice_is_refused_for_what_is_wrong_with_it(server, voice, says, code):
    """`voice` is a string or {"id": ...}: pydantic reported the union's first member, "voice.str: Input should be
    a valid string", whatever was wrong. Over HTTP and in the WebSocket's config alike."""
    response = httpx.post(server.url + "/v1/audio/speech", json={"input": TEXT, "voice": voice})
    assert response.status_code == 400, response.text
    with connect(server.ws_url + "/v1/audio/speech/stream") as ws:
        ws.send(json.dumps({"type": "session.config", "protocol": "q3tts", "voice": voice}))
        events, _ = events_until_close(ws)
    for error in (response.json()["error"], events[0]["error"]):
        assert (error["param"], error["code"]) == ("voice", code) and error["message"].startswith(says), error


JSON_BODY = json.dumps({"input": TEXT, "voice": "ryan"}).encode()


@pytest.mark.parametrize("content, content_type, status, code, says", [
    (JSON_BODY, "text/plain", 415, "unsupported_media_type", "must be JSON (Content-Type: application/json)"),
    (JSON_BODY, "application/x-www-form-urlencoded", 415, "unsupported_media_type", "must be JSON"),
    (JSON_BODY, None, 415, "unsupported_media_type", "came with no Content-Type"),
    (b"", "application/json", 400, "empty_body", "the request body is empty"),
    (b"", None, 415, "unsupported_media_type", "must be JSON"),
    (b'{"input": "caf\xe9", "voice": "ryan"}', "application/json", 400, "invalid_encoding", "not valid UTF-8"),
    (b"[" * 100_000 + b"]" * 100_000, "application/json", 400, "invalid_json", "nested too deeply"),
    (b'["hi"]', "application/json", 400, "invalid_value", "must be a JSON object, not an array"),
], ids=["text/plain", "form-urlencoded", "no content type", "empty", "empty, no content type", "not UTF-8",
        "deep", "an array"])
def test_a_body_that_is_not_json_is_refused_for_its_reason(server, content, content_type, status, code, says):
    """A JSON body sent as text/plain, form-urlencoded or without a content type was refused with "Input should be
    a valid dictionary", an empty one with "Field required", one that is not UTF-8 with a null code."""
    headers = {"content-type": content_type} if content_type else {}
    response = httpx.post(server.url + "/v1/audio/speech", content=content, headers=headers)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert (error["param"], error["code"]) == (None, code) and says in error["message"], error


def test_a_key_sent_twice_is_refused(server):
    """{"input": "a", "input": "b"} kept the last value silently (json.loads does), over HTTP and in the
    WebSocket's messages."""
    body = b'{"input": "First text.", "voice": "ryan", "input": "Second text."}'
    response = httpx.post(server.url + "/v1/audio/speech", content=body, headers={"content-type": "application/json"})
    assert response.status_code == 400, response.text
    with connect(server.ws_url + "/v1/audio/speech/stream") as ws:
        ws.send('{"type": "session.config", "protocol": "q3tts", "voice": "ryan", "voice": "vivian"}')
        events, _ = events_until_close(ws)
    for error, key in ((response.json()["error"], "input"), (events[0]["error"], "voice")):
        assert (error["param"], error["code"]) == (key, "duplicate_key"), error
        assert f"the key '{key}' appears more than once" in error["message"], error


def test_a_body_that_starts_with_a_byte_order_mark_is_read(server):
    """JSON parsers commonly skip a UTF-8 BOM; it was "Unexpected UTF-8 BOM (decode using utf-8-sig)"."""
    body = json.dumps({"input": TEXT, "voice": "ryan", "max_new_tokens": MAX_NEW, "response_format": "pcm"})
    response = httpx.post(server.url + "/v1/audio/speech", content=b"\xef\xbb\xbf" + body.encode(),
                          headers={"content-type": "application/json"})
    assert response.status_code == 200 and len(pcm_samples(response.content)) == frames(MAX_NEW) * FRAME


def test_an_object_field_is_called_a_json_object(server):
    """Not pydantic's "a valid dictionary or instance of KokoroNormalization" (a class the client never sees)."""
    response = httpx.post(server.url + "/v1/audio/speech", json={"input": "Hi.", "normalization_options": 5})
    error = response.json()["error"]
    assert error["message"] == "normalization_options: Input should be a JSON object", error


def test_json_with_a_charset_is_json(server):
    body = json.dumps({"input": TEXT, "voice": "ryan", "max_new_tokens": MAX_NEW, "response_format": "pcm"})
    response = httpx.post(server.url + "/v1/audio/speech", content=body.encode(),
                          headers={"content-type": "application/json; charset=utf-8"})
    assert response.status_code == 200 and len(pcm_samples(response.content)) == frames(MAX_NEW) * FRAME


def test_malformed_json_and_unknown_routes_use_the_error_shape(server):
    bad = httpx.post(server.url + "/v1/audio/speech", content=b"{not json",
                     headers={"content-type": "application/json"})
    assert bad.status_code == 400 and set(bad.json()["error"]) == {"message", "type", "param", "code"}
    error = bad.json()["error"]
    assert (error["param"], error["code"]) == (None, "invalid_json") and "not valid JSON" in error["message"]
    missing = httpx.get(server.url + "/v1/nothing-here")
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "not_found"
    wrong_method = httpx.get(server.url + "/v1/audio/speech")
    assert wrong_method.status_code == 405 and wrong_method.json()["error"]["code"] == "method_not_allowed"


def test_a_field_sent_in_the_query_is_refused_not_ignored(server):
    """?voice=vivian was ignored (only the body is read) and the body's voice spoken; other query parameters pass,
    as OpenAI's API lets them (Azure's clients add ?api-version=)."""
    body = {"input": TEXT, "voice": "ryan", "max_new_tokens": MAX_NEW, "response_format": "pcm"}
    for path in ("/v1/audio/speech?voice=vivian", "/v1/audio/dialogue?voice=vivian"):
        response = httpx.post(server.url + path, json=body if "speech" in path else {"turns": [body]})
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["param"] == "voice" and "voice is sent in the query" in error["message"], error
    passed = httpx.post(server.url + "/v1/audio/speech?api-version=2025-01-01", json=body)
    assert passed.status_code == 200 and len(pcm_samples(passed.content)) == frames(MAX_NEW) * FRAME


def test_a_wrong_route_or_method_says_what_is_there(server):
    """The router's refusals said only "Not Found" and "Method Not Allowed"."""
    misspelt = httpx.post(server.url + "/v1/audio/speeches", json={"input": TEXT})
    assert misspelt.status_code == 404
    assert misspelt.json()["error"]["message"] == "no route '/v1/audio/speeches' (docs/server.md lists the routes)"
    wrong_method = httpx.get(server.url + "/v1/audio/speech")
    assert wrong_method.status_code == 405 and wrong_method.headers["allow"] == "POST"
    assert wrong_method.json()["error"]["message"] == "'/v1/audio/speech' takes POST, not GET"
    plain = httpx.get(server.url + "/v1/audio/speech/stream")
    assert plain.status_code == 404
    assert plain.json()["error"]["message"] == ("'/v1/audio/speech/stream' is a WebSocket route: open it as a "
                                                "WebSocket (ws:// or wss://)")


def test_openai_client_sees_errors(client):
    with pytest.raises(openai.NotFoundError) as err:
        client.audio.speech.create(**_speech(voice="nobody"))
    assert err.value.body["code"] == "voice_not_found"


def test_websocket_streams_text_in_and_audio_out(server):
    with connect(server.ws_url + "/v1/audio/speech/stream") as ws:
        ws.send(json.dumps({"type": "session.config", "protocol": "q3tts",
                            "voice": "ryan", "seed": SEED, "max_new_tokens": 6,
                            "segmentation": "sentence"}))
        created = json.loads(ws.recv(timeout=30))
        assert created["type"] == "session.created" and created["sample_rate"] == 24000 and created["seed"] == SEED
        for piece in ["Hello there", ", my friend. This", " is the second"]:
            ws.send(json.dumps({"type": "input.text", "text": piece}))
        early = [ws.recv(timeout=60) for _ in range(2)]  # speech starts while the text is still incomplete
        assert json.loads(early[0])["type"] == "segment.started" and isinstance(early[1], bytes)
        ws.send(json.dumps({"type": "input.text", "text": " sentence! And a third"}))
        ws.send(json.dumps({"type": "input.done"}))
        events, audio = events_until_close(ws)
        assert ws.close_code == 1000
    audio = early[1] + audio
    started = [json.loads(early[0])] + [e for e in events if e["type"] == "segment.started"]
    done = [e for e in events if e["type"] == "segment.done"]
    assert [e["text"] for e in started] == ["Hello there, my friend.", "This is the second sentence!", "And a third"]
    assert [e["frames"] for e in done] == [frames(6)] * 3
    final = events[-1]
    assert final["type"] == "session.done" and final["segments"] == 3
    assert final["usage"]["output_tokens"] == 3 * frames(6) and len(audio) == 2 * 3 * frames(6) * FRAME


@pytest.mark.parametrize("speed", [0.5, 2.0])
def test_websocket_audio_seconds_are_the_seconds_delivered(server, speed):
    """`audio_seconds` counts the audio as sent, after `speed` (at 2.0 it said 1.2 s for 0.6 s delivered)."""
    with connect(server.ws_url + "/v1/audio/speech/stream") as ws:
        ws.send(json.dumps({"type": "session.config", "protocol": "q3tts",
                            "voice": "ryan", "seed": SEED, "max_new_tokens": 6,
                            "speed": speed, "segmentation": "sentence"}))
        ws.send(json.dumps({"type": "input.text", "text": "One sentence here. And another one."}))
        ws.send(json.dumps({"type": "input.done"}))
        events, audio = events_until_close(ws)
    done = [e for e in events if e["type"] == "segment.done"]
    assert [e["audio_seconds"] for e in done] == [round(frames(6) * 0.08 / speed, 3)] * 2
    delivered = len(audio) / 2 / 24000
    assert events[-1]["type"] == "session.done" and abs(events[-1]["audio_seconds"] - delivered) <= 0.001
    assert abs(delivered - 2 * frames(6) * 0.08 / speed) <= 0.001


@pytest.mark.parametrize("first, code", [
    ({"type": "session.config", "protocol": "q3tts", "voice": "nobody"}, "voice_not_found"),
    ({"type": "session.config", "protocol": "q3tts", "voice": "ryan", "temperature": -1}, "invalid_value"),
    ({"type": "something.else"}, "invalid_value"),
    ({"type": "session.config", "voice": "ryan", "split_granularity": "sentence", "text_input_mode": "buffered"},
     "invalid_value"),  # (two names of one setting: neither is dropped silently)
])
def test_websocket_bad_config_gets_an_error_event(server, first, code):
    with connect(server.ws_url + "/v1/audio/speech/stream") as ws:
        ws.send(json.dumps(first))
        events, _ = events_until_close(ws)
        assert ws.close_code == 1008
    assert events[0]["type"] == "error" and events[0]["error"]["code"] == code
    assert set(events[0]["error"]) == {"message", "type", "param", "code"}


@pytest.mark.parametrize("first, sent", [
    ({"type": "input.text", "text": "Hi."}, "'input.text'"),  # (its `text` is no session.config field)
    ({"type": "input.done"}, "'input.done'"),
    ({"voice": "ryan"}, "one with no type"),
])
def test_websocket_a_first_message_other_than_the_config_is_refused_for_its_type(server, first, sent):
    with connect(server.ws_url + "/v1/audio/speech/stream") as ws:
        ws.send(json.dumps(first))
        events, _ = events_until_close(ws)
        assert ws.close_code == 1008
    error = events[0]["error"]
    assert error["param"] == "type" and error["message"] == f"the first message must be session.config, not {sent}"


def test_websocket_q3tts_refuses_a_second_config_as_out_of_order(server):
    config = {"type": "session.config", "protocol": "q3tts", "voice": "ryan", "max_new_tokens": 4}
    with connect(server.ws_url + "/v1/audio/speech/stream") as ws:
        ws.send(json.dumps(config))
        assert json.loads(ws.recv(timeout=30))["type"] == "session.created"
        ws.send(json.dumps(config))
        events, _ = events_until_close(ws)
        assert ws.close_code == 1008
    error = events[-1]["error"]
    assert error["param"] == "type" and error["message"].startswith("session.config is sent once, first"), error


def test_websocket_bad_message_mid_session(server):
    with connect(server.ws_url + "/v1/audio/speech/stream") as ws:
        ws.send(json.dumps({"type": "session.config", "protocol": "q3tts",
                            "voice": "ryan", "seed": SEED, "max_new_tokens": 4}))
        ws.recv(timeout=30)
        ws.send("not json")
        events, _ = events_until_close(ws)
        assert ws.close_code == 1008
    assert events[-1]["type"] == "error" and events[-1]["error"]["type"] == "invalid_request_error"


def test_websocket_text_after_input_done_is_refused_not_dropped(server):
    """q3tts's protocol: the session ends once the text before input.done is spoken; text sent meanwhile is an
    error event, not silently lost."""
    with connect(server.ws_url + "/v1/audio/speech/stream") as ws:
        for message in ({"type": "session.config", "protocol": "q3tts", "voice": "ryan", "seed": SEED,
                         "max_new_tokens": 40}, {"type": "input.text", "text": "Hello there."}, {"type": "input.done"},
                        {"type": "input.text", "text": "These words come too late."}):
            ws.send(json.dumps(message))
        events, _ = events_until_close(ws)
        assert ws.close_code == 1008
    assert events[-1]["type"] == "error" and "after input.done" in events[-1]["error"]["message"], events[-1]
    assert events[-1]["error"]["param"] == "type"


@pytest.mark.parametrize("segmentation", ["live", "sentence"])
def test_websocket_a_session_with_no_words_is_refused(server, segmentation):
    with connect(server.ws_url + "/v1/audio/speech/stream") as ws:
        for message in ({"type": "session.config", "protocol": "q3tts", "voice": "ryan", "segmentation": segmentation},
                        {"type": "input.text", "text": "   "}, {"type": "input.done"}):
            ws.send(json.dumps(message))
        events, _ = events_until_close(ws)
        assert ws.close_code == 1008
    assert events[-1]["type"] == "error" and "text is empty" in events[-1]["error"]["message"], events[-1]


def _sessions_counted(url: str) -> dict[str, float]:
    """q3tts_requests_total of the WebSocket route, by status."""
    text = httpx.get(url + "/metrics").text
    return {s.labels["status"]: s.value for f in text_string_to_metric_families(text) if f.name == "q3tts_requests"
            for s in f.samples if s.name == "q3tts_requests_total" and s.labels["method"] == "WS"
            and s.labels["route"] == "/v1/audio/speech/stream"}


def test_websocket_sessions_are_counted_once_by_how_they_ended(server):
    """Each session counts once in q3tts_requests_total, with the close code it ended with (a session that ran to
    its end had no series at all)."""
    before = _sessions_counted(server.url)
    with connect(server.ws_url + "/v1/audio/speech/stream") as ws:  # to the end: 1000
        for message in ({"type": "session.config", "protocol": "q3tts",
                         "voice": "ryan", "seed": SEED, "max_new_tokens": 3},
                        {"type": "input.text", "text": "Hi."}, {"type": "input.done"}):
            ws.send(json.dumps(message))
        assert events_until_close(ws)[0][-1]["type"] == "session.done" and ws.close_code == 1000
    with connect(server.ws_url + "/v1/audio/speech/stream") as ws:  # refused config: 1008
        ws.send(json.dumps({"type": "session.config", "protocol": "q3tts", "voice": "nobody"}))
        events_until_close(ws)
    with connect(server.ws_url + "/v1/audio/speech/stream") as ws:  # the client leaves: its code
        ws.send(json.dumps({"type": "session.config", "protocol": "q3tts", "voice": "ryan"}))
        ws.recv(timeout=30)
        ws.close(code=1001)
    expected = {status: before.get(status, 0) + 1 for status in ("1000", "1008", "1001")}
    deadline = time.monotonic() + 10
    while sum((counted := _sessions_counted(server.url)).values()) < sum(before.values()) + 3:  # (as each ends)
        assert time.monotonic() < deadline, counted
        time.sleep(0.05)
    assert counted == {**before, **expected}


def test_cli_serve_builds_the_server_config(monkeypatch, tmp_path):
    import q3tts.server
    from q3tts.cli import main

    seen = {}
    monkeypatch.setattr(q3tts.server, "serve", lambda config, log_level: seen.update(config=config, level=log_level))
    monkeypatch.setenv("Q3TTS_API_KEY", "from-env")
    assert main(["serve", "tiny-base", "--port", "9000", "--max-running", "8", "--max-waiting", "3",
                 "--voices-dir", str(tmp_path), "--device", "cpu", "--log-level", "warning",
                 "--voice-alias", "alloy=narrator", "--voice-alias", "ash = host", "--default-voice", "narrator"]) == 0
    config = seen["config"]
    assert (config.model, config.port, config.max_running, config.max_waiting) == ("tiny-base", 9000, 8, 3)
    assert config.api_key == "from-env" and config.voices_dir == tmp_path and seen["level"] == "warning"
    assert (config.voice_aliases, config.default_voice) == ({"alloy": "narrator", "ash": "host"}, "narrator")
    assert main(["serve", "tiny", "--max-waiting", "0"]) == 1  # refused with a message, not a traceback


@pytest.mark.parametrize("flags, says", [
    (["--voice-alias", "alloy"], "--voice-alias: 'alloy': expected NAME=VOICE"),
    (["--voice-alias", "alloy=nobody"], "--voice-alias: alloy='nobody': not a speaker of this checkpoint (speakers: "),
    (["--voice-alias", "a=ryan", "--voice-alias", "a=vivian"], "--voice-alias: 'a' is given twice"),
    (["--default-voice", "nobody"], "--default-voice 'nobody': not a speaker of this checkpoint nor an alias"),
    (["--default-voice", "/no/such/voice.wav"], "--default-voice '/no/such/voice.wav': no such file"),
])
def test_cli_serve_refuses_voices_the_checkpoint_lacks(flags, says, capsys):
    """Before the model loads, in one line naming the flag."""
    from q3tts.cli import main

    assert main(["serve", "tiny", "--device", "cpu", *flags]) == 1
    assert says in capsys.readouterr().err


def test_runaway_guard_is_on_by_default(tmp_path):
    """The server ends audio far beyond what its text needs (here a tight guard: 2 frames + 1 per 10 text
    tokens), says why in the SSE done event and counts it in /metrics."""
    from q3tts import RunawayGuard
    from tests.server.harness import load_tiny

    assert ServerConfig(model="tiny").runaway_guard == RunawayGuard()
    config = ServerConfig(model="tiny", device="cpu", max_running=1, warmup=False,
                          runaway_guard=RunawayGuard(frames_per_token=0.1, min_frames=2))
    with ServerThread(config, load_tiny("tiny", tmp_path)) as guarded:
        body = {"input": TEXT, "voice": "ryan", "response_format": "pcm", "stream_format": "sse",
                "max_new_tokens": 100, "seed": SEED}
        with httpx.stream("POST", guarded.url + "/v1/audio/speech", json=body, timeout=60) as response:
            events = [json.loads(line[6:]) for line in response.iter_lines() if line.startswith("data: ")]
        assert events[-1]["finish_reason"] == "runaway", events[-1]
        assert 2 <= events[-1]["usage"]["output_tokens"] < 10
        assert 'q3tts_requests_ended_total{reason="runaway"} 1.0' in httpx.get(guarded.url + "/metrics").text


def test_a_long_input_is_spoken_as_pieces(server):
    """An input longer than one generation should hold is cut at sentence ends and streamed back to back."""
    from q3tts.api.pieces import PIECE_CHARS
    from q3tts.request.text_segmenter import split_text

    text = " ".join(f"Sentence {i} of a long input, spoken piece by piece." for i in range(14))
    pieces = len(split_text(text, PIECE_CHARS))
    assert len(text) <= 4096 and pieces >= 2
    body = {"input": text, "voice": "ryan", "response_format": "pcm", "stream_format": "sse", "max_new_tokens": 4,
            "seed": SEED}
    config = ServerConfig(model="tiny", device="cpu", max_running=2, warmup=False)  # max_input_chars 4096
    with ServerThread(config, server.app.state.service.tts) as long_server, \
            httpx.stream("POST", long_server.url + "/v1/audio/speech", json=body, timeout=120) as response:
        events = [json.loads(line[6:]) for line in response.iter_lines() if line.startswith("data: ")]
    assert events[-1]["type"] == "speech.audio.done" and events[-1]["usage"]["output_tokens"] == 3 * pieces
    audio = b"".join(base64.b64decode(e["audio"]) for e in events if e["type"] == "speech.audio.delta")
    assert len(audio) == 2 * 3 * pieces * FRAME


def test_websocket_whitespace_does_not_count_as_waiting_text(server):
    """Text is counted against the waiting limit (16 x max_input_chars = 3,200 here) while it waits: the
    whitespace that segments lose once counted forever, so a long session was refused at last (~11 rounds of
    300 spaces here) with nothing waiting."""
    with connect(server.ws_url + "/v1/audio/speech/stream") as ws:
        ws.send(json.dumps({"type": "session.config", "protocol": "q3tts",
                            "voice": "ryan", "seed": SEED, "max_new_tokens": 2, "segmentation": "sentence"}))
        assert json.loads(ws.recv(timeout=30))["type"] == "session.created"
        for _ in range(14):
            ws.send(json.dumps({"type": "input.text", "text": "Hi." + " " * 300}))
            ws.send(json.dumps({"type": "input.flush"}))
            while not isinstance(event := ws.recv(timeout=30), str) or json.loads(event)["type"] != "segment.done":
                assert isinstance(event, bytes) or json.loads(event)["type"] != "error", event
        ws.send(json.dumps({"type": "input.done"}))
        events, _ = events_until_close(ws)
    assert events[-1]["type"] == "session.done" and events[-1]["segments"] == 14, events[-1]


LIVE_WORDS = ["Hello", " there", " my", " friend", " this", " has", " no", " sentence", " end"]


def test_websocket_speaks_live_text_from_the_first_words(server):
    """segmentation live (the default): audio comes before any sentence end or input.done was sent, and the
    session's audio is the whole text's, spoken by one live request (TTS.live)."""
    with connect(server.ws_url + "/v1/audio/speech/stream") as ws:
        ws.send(json.dumps({"type": "session.config", "protocol": "q3tts", "voice": "ryan", "language": "english",
                            "seed": SEED, "max_new_tokens": 12}))
        assert json.loads(ws.recv(timeout=30))["type"] == "session.created"
        for word in LIVE_WORDS[:3]:
            ws.send(json.dumps({"type": "input.text", "text": word}))
        started = json.loads(ws.recv(timeout=60))
        first = ws.recv(timeout=60)  # no punctuation, no input.done yet: the live generation speaks already
        assert started["type"] == "segment.started" and started["segment"] == 0 and isinstance(first, bytes)
        assert "".join(LIVE_WORDS[:3]).startswith(started["text"])  # the text received when the audio started
        for word in LIVE_WORDS[3:]:
            ws.send(json.dumps({"type": "input.text", "text": word}))
        ws.send(json.dumps({"type": "input.done"}))
        events, audio = events_until_close(ws)
    done = [e for e in events if e["type"] == "segment.done"]
    assert [(e["segment"], e["text"]) for e in done] == [(0, "".join(LIVE_WORDS))]
    assert events[-1]["type"] == "session.done" and events[-1]["segments"] == 1
    live = server.app.state.service.tts.live(speaker="ryan", language="english", seed=SEED, max_new_tokens=12,
                                             pcm_format="int16", runaway_guard=server.config.runaway_guard)
    for word in LIVE_WORDS:
        live.append(word)
    live.end()
    expected = b"".join(chunk.pcm.tobytes() for chunk in live)
    assert done[0]["frames"] == len(expected) // 2 // FRAME
    assert np.abs(pcm_samples(first + audio).astype(int) - pcm_samples(expected)).max() <= 1


def test_websocket_sentence_segmentation_still_cuts(server):
    """segmentation sentence: one segment per sentence, each started once its sentence is complete."""
    with connect(server.ws_url + "/v1/audio/speech/stream") as ws:
        ws.send(json.dumps({"type": "session.config", "protocol": "q3tts", "voice": "ryan", "seed": SEED,
                            "max_new_tokens": 3, "segmentation": "sentence"}))
        for text in ("One sentence here.", " And", " another one"):
            ws.send(json.dumps({"type": "input.text", "text": text}))
        ws.send(json.dumps({"type": "input.done"}))
        events, _ = events_until_close(ws)
    started = [e["text"] for e in events if e["type"] == "segment.started"]
    assert started == ["One sentence here.", "And another one"] and events[-1]["segments"] == 2


@pytest.mark.parametrize("config", [{"non_streaming_mode": True},
                                    {"protocol": "vllm-omni", "split_granularity": "sentence"}])
def test_websocket_live_segmentation_refuses_what_needs_cuts(server, config):
    """Live text runs in streaming-text mode, one generation: non_streaming_mode (which needs the whole text) and
    vLLM-Omni's cutting settings need segmentation sentence, and an explicit live with them is refused."""
    with connect(server.ws_url + "/v1/audio/speech/stream") as ws:
        ws.send(json.dumps({"type": "session.config", "protocol": "q3tts", "voice": "ryan", "segmentation": "live",
                            **config}))
        error = json.loads(ws.recv(timeout=30))
        with pytest.raises(ConnectionClosed):
            ws.recv(timeout=30)
    assert error["type"] == "error" and error["error"]["param"] == "segmentation" and ws.close_code == 1008
    assert "set segmentation to sentence" in error["message"]


def test_websocket_non_streaming_mode_defaults_to_sentence_cuts(server):
    with connect(server.ws_url + "/v1/audio/speech/stream") as ws:
        ws.send(json.dumps({"type": "session.config", "protocol": "q3tts", "voice": "ryan", "seed": SEED,
                            "max_new_tokens": 3, "non_streaming_mode": True}))
        for message in ({"type": "input.text", "text": "First one. Second one."}, {"type": "input.done"}):
            ws.send(json.dumps(message))
        events, _ = events_until_close(ws)
    assert events[-1]["type"] == "session.done" and events[-1]["segments"] == 2


def test_websocket_live_text_over_the_limit_is_refused_naming_text(server):
    """segmentation live: one input.text over --max-input-chars (200 here) is refused as it arrives."""
    with connect(server.ws_url + "/v1/audio/speech/stream") as ws:
        ws.send(json.dumps({"type": "session.config", "protocol": "q3tts", "voice": "ryan", "max_new_tokens": 3}))
        ws.send(json.dumps({"type": "input.text", "text": "word " * 41}))
        events, _ = events_until_close(ws)
    error = events[-1]
    assert error["type"] == "error" and (error["error"]["param"], error["error"]["code"]) == ("text", "input_too_long")
    assert ws.close_code == 1008


def test_websocket_vllm_omni_live_utterances_waiting_are_bounded_together(server):
    """vLLM-Omni, segmentation live: utterances sent faster than they are spoken wait, each a live generation with
    its text; together they are held to 16 times --max-input-chars (200 here), as cut segments are (each was
    bounded alone: a client could queue any number)."""
    with connect(server.ws_url + "/v1/audio/speech/stream") as ws:
        ws.send(json.dumps({"type": "session.config", "voice": "ryan", "seed": SEED, "max_new_tokens": 40,
                            "stream_audio": True, "response_format": "pcm"}))
        for _ in range(20):  # 3,800 characters
            ws.send(json.dumps({"type": "input.text", "text": "word " * 38}))
            ws.send(json.dumps({"type": "input.done"}))
        events, _ = events_until_close(ws)
        assert ws.close_code == 1008
    error = events[-1]
    assert error["type"] == "error" and (error["error"]["param"], error["error"]["code"]) == ("text", "input_too_long")
    assert "waiting to be spoken" in error["error"]["message"], error
    server.wait_idle()


def test_websocket_an_error_the_client_does_not_read_drops_the_connection(server, monkeypatch):
    """The error event waits at most --send-timeout for a client that does not read (it waited for ever)."""
    from starlette.websockets import WebSocket

    async def never_sent(self, data, mode="text"):
        await asyncio.sleep(3600)

    monkeypatch.setattr(server.config, "send_timeout_s", 0.5)
    monkeypatch.setattr(WebSocket, "send_json", never_sent)
    with connect(server.ws_url + "/v1/audio/speech/stream") as ws:
        ws.send(json.dumps({"type": "session.config", "voice": "nobody"}))
        with pytest.raises(ConnectionClosed):
            ws.recv(timeout=10)


@pytest.mark.parametrize("message, field", [({"type": "input.text", "text": "Hi there.", "voice": "vivian"}, "voice"),
                                            ({"type": "input.done", "speed": 2}, "speed")])
def test_websocket_q3tts_refuses_a_field_its_message_does_not_take(server, message, field):
    """A setting sent with the text (a voice, a speed) was silently ignored: the session spoke on with its config's."""
    with connect(server.ws_url + "/v1/audio/speech/stream") as ws:
        for sent in ({"type": "session.config", "protocol": "q3tts", "voice": "ryan", "max_new_tokens": 3},
                     {"type": "input.text", "text": "Hello. "}, message):
            ws.send(json.dumps(sent))
        events, _ = events_until_close(ws)
        assert ws.close_code == 1008
    error = events[-1]
    assert error["type"] == "error" and error["error"]["param"] == field and repr(field) in error["message"], error


def test_websocket_text_after_the_generation_ended_is_refused_saying_why(server):
    """Live text that comes after the generation reached max_new_tokens is refused naming the reason (it said
    "text appended to a cancelled live request", which the client never asked for)."""
    with connect(server.ws_url + "/v1/audio/speech/stream") as ws:
        for sent in ({"type": "session.config", "protocol": "q3tts", "voice": "ryan", "seed": SEED,
                      "max_new_tokens": 3}, {"type": "input.text", "text": "Hello there, how are you"}):
            ws.send(json.dumps(sent))
        while not (isinstance(message := ws.recv(timeout=60), str) and json.loads(message)["type"] == "segment.done"):
            pass
        ws.send(json.dumps({"type": "input.text", "text": " these words come too late."}))
        events, _ = events_until_close(ws)
    error = events[-1]["error"]
    assert error["param"] == "text" and "'length'" in error["message"] and "cancelled" not in error["message"], error
