"""nari's `nari.speech.v1` WebSocket (`/v1/audio/speech/ws`, server/routes/nari.py) end to end: a real server,
a real WebSocket client. The audio is the live request's, so the whole text's codes in streaming-text mode."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

pytest.importorskip("websockets")
from websockets.exceptions import ConnectionClosed  # noqa: E402
from websockets.sync.client import connect  # noqa: E402

from q3tts.server.config import ServerConfig  # noqa: E402
from q3tts.tiny import tiny_checkpoint  # noqa: E402
from tests.engine.test_live_text import wait_until  # noqa: E402
from tests.server.harness import ServerThread, events_until_close, load_tiny, pcm_samples  # noqa: E402

TEXT = "Hello world, this is live text."
START = {"type": "request.start", "model": "tiny", "voice": "ryan", "language": "english", "seed": 9,
         "max_new_tokens": 16}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    cache = tmp_path_factory.mktemp("cache")
    config = ServerConfig(model=str(tiny_checkpoint("tiny", cache)), served_model_name="tiny", device="cpu",
                          max_running=2, max_waiting=4, max_context=512, max_input_chars=200)
    with ServerThread(config, load_tiny("tiny", cache)) as running:
        yield running


def session(server):
    return connect(server.ws_url + "/v1/audio/speech/ws", subprotocols=["nari.speech.v1"])


@contextlib.contextmanager
def started(server, start: dict = START):
    """A session past session.created, its request.start sent and configured."""
    with session(server) as ws:
        ws.recv(timeout=30)
        ws.send(json.dumps(start))
        assert json.loads(ws.recv(timeout=30))["type"] == "request.configured"
        yield ws


def speak(server, words: list[str], delay: float = 0.0, start: dict = START) -> tuple[list[dict], bytes, int]:
    with session(server) as ws:
        assert ws.subprotocol == "nari.speech.v1"
        created = json.loads(ws.recv(timeout=30))
        assert created == {"type": "session.created", "protocol": "nari.speech.v1",
                           "audio": {"encoding": "pcm_s16le", "sample_rate": 24000, "channels": 1}}
        ws.send(json.dumps(start))
        assert json.loads(ws.recv(timeout=30)) == {"type": "request.configured"}
        for sequence, word in enumerate(words):
            ws.send(json.dumps({"type": "input_text.append", "sequence": sequence, "text": word}))
            time.sleep(delay)
        ws.send(json.dumps({"type": "input_text.end", "sequence": len(words)}))
        events, audio = events_until_close(ws)
        return events, audio, ws.close_code


def test_live_text_session_speaks_the_whole_texts_audio(server):
    tts = server.app.state.service.tts
    stream = tts.stream(TEXT, speaker="ryan", language="english", seed=9, max_new_tokens=16,
                        non_streaming_mode=False, runaway_guard=server.config.runaway_guard, pcm_format="int16")
    expected = np.concatenate([c.pcm for c in stream])
    words = TEXT.split(" ")
    events, audio, code = speak(server, [words[0]] + [" " + w for w in words[1:]], delay=0.01)
    assert code == 1000
    kinds = [e["type"] for e in events]
    assert kinds.count("input_text.ack") == len(words) + 1 and kinds.count("response.started") == 1
    started = next(e for e in events if e["type"] == "response.started")
    assert started["audio"]["sample_rate"] == 24000 and started["request_id"].startswith("ws-")
    acks = [e for e in events if e["type"] == "input_text.ack"]
    assert [a["sequence"] for a in acks] == list(range(len(words) + 1))
    assert acks[-1]["event"] == "input_text.end" and acks[-1]["request_id"] == started["request_id"]
    done = events[-1]
    assert done["type"] == "response.done" and done["stop_reason"] == "stop"
    assert done["request_id"] == started["request_id"] and done["audio_chunks"] > 0
    np.testing.assert_allclose(pcm_samples(audio), expected, atol=2)


def test_sessions_started_together_build_their_prompts_in_one_batch(server, monkeypatch):
    """Four sessions' first words at once: the appends that build their prompts wait in one batch (q3tts.api's
    PromptCombiner, on threads of their own: server/service.py Preparation), not one after another on the two
    prepare threads; each session's audio is the one it gives alone."""
    tts = server.app.state.service.tts
    expected = np.concatenate([c.pcm for c in tts.stream(
        TEXT, speaker="ryan", language="english", seed=9, max_new_tokens=16, non_streaming_mode=False,
        runaway_guard=server.config.runaway_guard, pcm_format="int16")])
    batches, original = [], tts.prepare_many

    def prepare_many(requests):
        batches.append(len(requests))
        if len(batches) == 1:  # (the first session's prompt: the others come meanwhile)
            wait_until(lambda: tts.num_prompts_waiting >= 3, 20)  # (the other sessions' prompts wait)
        return original(requests)

    monkeypatch.setattr(tts, "prepare_many", prepare_many)
    with ThreadPoolExecutor(4) as pool:
        spoken = list(pool.map(lambda _: speak(server, [TEXT]), range(4)))
    assert batches == [1, 3]
    for events, audio, code in spoken:
        assert code == 1000 and events[-1]["type"] == "response.done"
        np.testing.assert_allclose(pcm_samples(audio), expected, atol=2)


def test_cancel_ends_the_response(server):
    with started(server) as ws:
        ws.send(json.dumps({"type": "input_text.append", "sequence": 0, "text": "Hello there, this waits "}))
        time.sleep(0.3)
        ws.send(json.dumps({"type": "response.cancel"}))
        events, _ = events_until_close(ws)
        assert events[-1]["type"] == "response.done" and events[-1]["stop_reason"] == "cancelled"
        assert ws.close_code == 1000
    server.wait_idle()


def test_cancel_after_the_text_ends_stops_the_audio(server):
    """A listener who interrupts: response.cancel after input_text.end, while the audio plays out, stops it."""
    with started(server, {**START, "max_new_tokens": 400}) as ws:
        ws.send(json.dumps({"type": "input_text.append", "sequence": 0, "text": "A long answer to be cut short."}))
        ws.send(json.dumps({"type": "input_text.end", "sequence": 1}))
        while not isinstance(ws.recv(timeout=30), bytes):  # (the first audio)
            pass
        ws.send(json.dumps({"type": "response.cancel"}))
        events, audio = events_until_close(ws)
        assert events[-1]["type"] == "response.done" and events[-1]["stop_reason"] == "cancelled", events[-1]
        assert ws.close_code == 1000
    server.wait_idle()


def test_disconnect_frees_the_row(server):
    with started(server) as ws:
        ws.send(json.dumps({"type": "input_text.append", "sequence": 0, "text": "Hello there, this waits "}))
        time.sleep(0.3)
    # (the server learns of the disconnect, cancels the live request and the engine lets its parked row go, each in
    # its own time: waited for, as wait_idle counts running and waiting requests only)
    wait_until(lambda: not server.engine.num_parked and not server.engine.num_live, 20)
    server.wait_idle()


@pytest.mark.parametrize("events, code, close", [
    ([{"type": "input_text.append", "sequence": 1, "text": "Hi "}], "invalid_sequence", 1008),
    ([{"type": "input_text.append", "sequence": 0, "text": "Hi "},
      {"type": "input_text.append", "sequence": 0, "text": "again "}], "invalid_sequence", 1008),
    ([{"type": "input_text.append", "sequence": 0, "text": "x" * 201}], "input_too_large", 1009),
    ([{"type": "input_text.append", "sequence": 0, "text": "Hi "}, {"type": "input_text.end", "sequence": 1},
      {"type": "input_text.append", "sequence": 2, "text": "late"}], "invalid_state", 1008),
    ([{"type": "input_text.append", "sequence": 0, "text": "Hi "}, {"type": "input_text.end", "sequence": 1},
      {"type": "nonsense"}], "unknown_event", 1008),
    ([{"type": "input_text.end", "sequence": 0}], "invalid_request", 1008),
    ([{"type": "nonsense"}], "unknown_event", 1008),
    ([{"type": "input_text.append", "sequence": 0, "text": ""}], "invalid_request", 1008),
])
def test_bad_input_is_an_error_event(server, events, code, close):
    with started(server) as ws:
        for event in events:
            ws.send(json.dumps(event))
        got, _ = events_until_close(ws)
        assert got[-1]["type"] == "error" and got[-1]["error"]["code"] == code, got[-1]
        assert ws.close_code == close
    server.wait_idle()


@pytest.mark.parametrize("event, field", [
    ({"type": "input_text.append", "sequence": 0, "text": "Hi ", "txt": "there"}, "txt"),
    ({"type": "input_text.end", "sequence": 0, "flush": True}, "flush"),
    ({"type": "response.cancel", "reason": "barge-in"}, "reason"),
])
def test_an_unknown_field_is_named_not_dropped(server, event, field):
    """(nari-qwen3-tts's schemas forbid unknown fields; q3tts read the ones it knew and dropped the rest unread.)"""
    with started(server) as ws:
        ws.send(json.dumps(event))
        got, _ = events_until_close(ws)
        error = got[-1]["error"]
        assert error["code"] == "invalid_request" and error["param"] == field, got[-1]
        assert error["message"].startswith(f"{event['type']}: unknown field '{field}'; it takes type")
        assert ws.close_code == 1008
    server.wait_idle()


def test_bad_start_and_missing_subprotocol(server):
    with session(server) as ws:
        ws.recv(timeout=30)
        ws.send(json.dumps({**START, "voice": "nobody"}))
        got, _ = events_until_close(ws)
        assert got[-1]["type"] == "error" and ws.close_code == 1008
        assert "nobody" in got[-1]["error"]["message"]
    with connect(server.ws_url + "/v1/audio/speech/ws") as ws:
        with pytest.raises(ConnectionClosed):
            ws.recv(timeout=30)
        assert ws.close_code == 1002


def test_an_over_long_number_is_invalid_json_without_pythons_advice(server):
    with session(server) as ws:
        ws.recv(timeout=30)
        ws.send(json.dumps(START)[:-1] + ', "sequence": 1' + "0" * 5000 + "}")
        got, _ = events_until_close(ws)
    message = got[-1]["error"]["message"]
    assert got[-1]["error"]["code"] == "invalid_event" and "sys." not in message and "4300" in message, message


def test_the_server_does_not_deflate_websocket_messages(server):
    """PCM does not compress and the events are small: per-message deflate would only cost a zlib pass over every
    message on both sides (the websockets client offers it by default; the server declines)."""
    with session(server) as ws:
        assert "permessage-deflate" in ws.request.headers.get("Sec-WebSocket-Extensions", "")
        assert ws.response.headers.get("Sec-WebSocket-Extensions") is None


def _events_within(ws, seconds: float) -> list[dict]:
    """The session's JSON events until the server closes it, which must happen within `seconds`."""
    events, deadline = [], time.monotonic() + seconds
    with pytest.raises(ConnectionClosed):
        while True:
            message = ws.recv(timeout=max(deadline - time.monotonic(), 0.01))
            if isinstance(message, str):
                events.append(json.loads(message))
    return events


def test_text_that_stops_coming_is_an_input_timeout_while_the_client_waits(server, monkeypatch):
    """The generation waits TEXT_WAIT_S for its next text, then ends: the client, which only listens, gets the
    input_timeout error (it got nothing, and the session stayed open, until it sent something)."""
    monkeypatch.setattr("q3tts.server.routes.nari.TEXT_WAIT_S", 1.0)
    with started(server) as ws:
        ws.send(json.dumps({"type": "input_text.append", "sequence": 0, "text": "Hello there, this waits "}))
        events = _events_within(ws, 20)
        assert ws.close_code == 1008
    error = events[-1]["error"]
    assert events[-1]["type"] == "error" and error["code"] == "input_timeout" and error["param"] == "text", events[-1]
    server.wait_idle()


@pytest.mark.parametrize("sent", [[], [START]])
def test_a_request_that_never_starts_is_closed(server, monkeypatch, sent):
    """No request.start within --body-timeout, or no text within TEXT_WAIT_S of it: an error, not a connection
    held open for ever."""
    monkeypatch.setattr(server.config, "body_timeout_s", 0.5)
    monkeypatch.setattr("q3tts.server.routes.nari.TEXT_WAIT_S", 0.5)
    with session(server) as ws:
        ws.recv(timeout=30)
        for event in sent:
            ws.send(json.dumps(event))
        events = _events_within(ws, 10)
        assert ws.close_code == 1008
    assert events[-1]["error"]["code"] == ("input_timeout" if sent else "request_timeout"), events[-1]


def test_a_client_that_stops_reading_loses_its_session_and_row(server, monkeypatch):
    """Audio the client does not read (a send that never completes) ends the session after --send-timeout and
    frees its row, as on /v1/audio/speech/stream (it held both until the client left)."""
    from starlette.websockets import WebSocket

    async def never_sent(self, data):
        await asyncio.sleep(3600)

    monkeypatch.setattr(server.config, "send_timeout_s", 0.5)
    with started(server, {**START, "max_new_tokens": 400}) as ws:
        monkeypatch.setattr(WebSocket, "send_bytes", never_sent)
        ws.send(json.dumps({"type": "input_text.append", "sequence": 0, "text": "A long answer nobody hears."}))
        ws.send(json.dumps({"type": "input_text.end", "sequence": 1}))
        _events_within(ws, 20)
    server.wait_idle()


@pytest.mark.parametrize("field, value", [("speed", 2.0), ("volume_multiplier", 3.0), ("sample_rate", 16000),
                                          ("non_streaming_mode", True)])
def test_settings_the_raw_pcm_cannot_honour_are_refused_not_ignored(server, field, value):
    with session(server) as ws:
        ws.recv(timeout=30)
        ws.send(json.dumps({**START, field: value}))
        got, _ = events_until_close(ws)
        assert ws.close_code == 1008
    error = got[-1]["error"]
    assert error["code"] == "invalid_request" and error["param"] == field and field in error["message"], error


def test_an_error_names_instruction_as_sent(server):
    with session(server) as ws:
        ws.recv(timeout=30)
        ws.send(json.dumps({**START, "instruction": "x" * 5000}))
        got, _ = events_until_close(ws)
    error = got[-1]["error"]
    assert error["param"] == "instruction" and error["message"].startswith("instruction is 5000"), error


def test_text_after_the_generation_ended_is_refused_not_acknowledged_and_dropped(server):
    """An append after the generation reached max_new_tokens was acknowledged and never spoken."""
    with started(server, {**START, "max_new_tokens": 3}) as ws:
        ws.send(json.dumps({"type": "input_text.append", "sequence": 0, "text": "Hello there, how are you"}))
        while not isinstance(ws.recv(timeout=30), bytes):  # (its audio started)
            pass
        server.wait_idle()  # (it ended, at max_new_tokens)
        time.sleep(0.2)
        ws.send(json.dumps({"type": "input_text.append", "sequence": 1, "text": " these words come too late."}))
        got, _ = events_until_close(ws)
        assert ws.close_code == 1008
    error = got[-1]["error"]
    assert error["code"] == "invalid_state" and error["param"] == "text" and "'length'" in error["message"], error
