"""`POST /v1/audio/dialogue` on a real server (tiny CustomVoice model): turns in script order with their pauses,
in every response format and as SSE; every refusal names the turn and field, and comes before the engine has been
given any turn (its /metrics count of submitted requests does not move)."""

from __future__ import annotations

import json

import numpy as np
import pytest

pytest.importorskip("fastapi")

import httpx  # noqa: E402
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from q3tts.server import ServerConfig  # noqa: E402
from tests.server.harness import FRAME, SEED, ServerThread, decoded_samples, frames, load_tiny, pcm_samples  # noqa: E402

MAX_NEW = 5
TURNS = [{"voice": "ryan", "input": "Hello there.", "pause": 0.25},
         {"speaker": "vivian", "text": "Hi! How are you?", "language": "english"},
         {"voice": "ryan", "input": "Fine, thanks.", "instructions": "Cheerful.", "pause": 0.1}]
SAMPLES = 3 * frames(MAX_NEW) * FRAME + 6000 + 2400


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tts = load_tiny("tiny", tmp_path_factory.mktemp("cache"))
    config = ServerConfig(model="tiny", device="cpu", max_running=4, max_context=512, warmup=False)
    with ServerThread(config, tts) as running:
        yield running


def _post(server, path: str = "/v1/audio/dialogue", **body) -> httpx.Response:
    body = {"response_format": "pcm", "seed": SEED, "max_new_tokens": MAX_NEW, **body}
    return httpx.post(server.url + path, json=body, timeout=120)


def _submitted(server) -> float:
    """Requests the engine (behind a front: every engine) has been given, from /metrics."""
    text = httpx.get(server.url + "/metrics", timeout=30).text
    return sum(sample.value for family in text_string_to_metric_families(text)
               for sample in family.samples if sample.name == "q3tts_engine_requests_submitted_total"
               and sample.labels.get("engine", "all") == "all")


def test_turns_in_order_with_their_pauses(server):
    response = _post(server, turns=TURNS)
    assert response.status_code == 200, response.text
    audio = pcm_samples(response.content)
    alone = [pcm_samples(_post(server, "/v1/audio/speech", voice=t.get("voice", t.get("speaker")),
                               input=t.get("input", t.get("text")),
                               **{k: t[k] for k in ("language", "instructions") if k in t}).content) for t in TURNS]
    expected = np.concatenate([alone[0], np.zeros(6000, "<i2"), alone[1], alone[2], np.zeros(2400, "<i2")])
    assert audio.shape == expected.shape == (SAMPLES,)
    assert np.abs(audio.astype(int) - expected).max() <= 2  # (another batch: float rounding, a step of int16 at most)


@pytest.mark.parametrize("fmt", ["wav", "mp3", "opus", "aac", "flac"])
def test_every_format(server, fmt):
    response = _post(server, turns=TURNS[:2], response_format=fmt)
    assert response.status_code == 200, response.text
    samples, rate = decoded_samples(response.content)
    expected_s = (2 * frames(MAX_NEW) * FRAME + 6000) / 24000
    assert abs(samples / rate - expected_s) < 0.1  # (codec padding; opus decodes at 48 kHz)


def test_sse_and_a_default_voice_for_turns_that_name_none(server):
    response = _post(server, turns=[{"input": "Hello."}, {"input": "Again.", "voice": "vivian"}], voice="ryan",
                     stream_format="sse")
    events = [json.loads(line[6:]) for line in response.text.splitlines() if line.startswith("data: ")]
    assert [e["type"] for e in events][-1] == "speech.audio.done" and len(events) >= 2


@pytest.mark.parametrize("turns, status, param, says", [
    ([TURNS[0], {"voice": "nobody", "input": "Hi."}], 404, "turns[1].voice", "turn 1: "),
    ([TURNS[0], TURNS[1], {"voice": "nobody", "input": "Hi."}, TURNS[2]], 404, "turns[2].voice", "turn 2: "),
    ([TURNS[0], {"voice": "ryan", "input": ""}], 400, "turns[1].input", "turn 1: "),
    ([TURNS[0], {"voice": "ryan", "input": "Hi.", "pause": 11}], 400, "turns.1.pause", ""),
    ([{"voice": "ryan", "input": "Hi.", "speakr": "x"}], 400, "turns.0.speakr", ""),
    ([{"voice": "ryan"}], 400, "turns.0.input", ""),
    ([{"voice": "ryan", "speaker": "vivian", "input": "Hi."}], 400, "turns[0].speaker", "turn 0: speaker is another"),
    ([TURNS[0], {"voice": "ryan", "input": "Hi.", "text": "x"}], 400, "turns[1].text", "turn 1: text is another"),
    ([TURNS[0], {"voice": "ryan", "input": "Hi.", "instruct": "x", "instructions": "y"}], 400,
     "turns[1].instruct", "turn 1: instruct is another"),
    ([TURNS[0], {"voice": "ryan", "input": "Hi.", "language": "klingon"}], 400, "turns[1].language", "turn 1: "),
    ([TURNS[0], {"voice": "ryan", "text": ""}], 400, "turns[1].text", "turn 1: text "),  # (it was input)
    ([TURNS[0], {"speaker": "nobody", "input": "Hi."}], 404, "turns[1].speaker", "turn 1: "),
    ([TURNS[0], {"voice": "ryan", "input": "Hi.", "instruct": "a" * 2001}], 400, "turns[1].instruct",
     "turn 1: instruct is 2001 characters"),
    ([], 400, "turns", ""),
    (["hi"], 400, "turns.0", "turns.0: Input should be a JSON object"),
])
def test_bad_turns_are_refused_naming_the_turn(server, turns, status, param, says):
    submitted = _submitted(server)
    response = _post(server, turns=turns)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["param"] == param and says in error["message"], error
    assert _submitted(server) == submitted  # (no turn before the bad one was queued, even briefly)


@pytest.mark.parametrize("defaults, status, param", [
    ({"language": "xx"}, 400, "language"),
    ({"voice": "nobody"}, 404, "voice"),
    ({"instructions": "a" * 2001}, 400, "instructions"),
    ({"instruct": "a" * 2001}, 400, "instruct"),  # (as sent: it was instructions)
])
def test_a_bad_default_is_named_as_the_body_sent_it(server, defaults, status, param):
    """A top-level default that turn 0 takes is the body's field, not turns[0]'s (the turn did not send it)."""
    response = _post(server, turns=[{"input": "Hi."}, {"voice": "ryan", "input": "Hi."}],
                     **{"voice": "vivian", **defaults})
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["param"] == param and not error["message"].startswith("turn "), error


def test_a_turn_takes_the_voice_forms_the_speech_request_takes(server):
    """`voice` as {"id": ...} (OpenAI's custom voices) was "turns.0.voice: Input should be a valid string" in a
    turn, though the body's own `voice` (and the speech route's) takes it."""
    by_name = _post(server, turns=TURNS[:1])
    by_object = _post(server, turns=[{**TURNS[0], "voice": {"id": "ryan"}}])
    assert by_object.status_code == 200, by_object.text
    assert by_object.content == by_name.content
    error = _post(server, turns=[{**TURNS[0], "voice": {"id": 5}}]).json()["error"]
    assert error["param"] == "turns.0.voice" and '"id" must be a string' in error["message"], error


def test_the_bodys_voice_aliases_name_the_turns_voices_too(server):
    """A dialogue's `voice_aliases` were applied to the body's voice alone: a turn that named one was "unknown
    speaker"."""
    aliased = _post(server, voice_aliases={"Narrator": "ryan"}, turns=[{**TURNS[0], "voice": "narrator"}])
    assert aliased.status_code == 200, aliased.text
    assert aliased.content == _post(server, turns=TURNS[:1]).content
    paced = _post(server, voice_aliases={"narrator": {"voice": "ryan", "rate": 1.5}},
                  turns=[TURNS[1], {**TURNS[0], "voice": "narrator"}])
    assert paced.status_code == 400, paced.text  # (a rate multiplies the speed, which is the whole dialogue's)
    error = paced.json()["error"]
    assert error["param"] == "turns[1].voice" and "turn 1: voice 'narrator' is an alias with a rate" in error["message"]


def test_a_front_serves_dialogues_as_one_process_does(tmp_path_factory):
    """Behind `q3tts serve`'s front (a GPU's default) each turn goes to an engine process as a speech request."""
    from q3tts.tiny import tiny_checkpoint
    from tests.server.test_front import FrontThread

    folder = tiny_checkpoint("tiny", tmp_path_factory.mktemp("cache"))
    config = ServerConfig(model=str(folder), served_model_name="tiny", device="cpu", max_running=4, max_context=512,
                          core_socket=str(tmp_path_factory.mktemp("core") / "engine.sock"), warmup=False)
    with ServerThread(config) as engine, FrontThread(engine) as front:
        direct, relayed = _post(engine, turns=TURNS), _post(front, turns=TURNS)
        assert relayed.status_code == direct.status_code == 200 and relayed.content == direct.content
        submitted = _submitted(front)
        assert submitted == _submitted(engine) >= 2 * len(TURNS)
        error = _post(front, turns=[*TURNS[:2], {"voice": "nobody", "input": "Hi."}]).json()["error"]
        assert error["param"] == "turns[2].voice" and error["message"].startswith("turn 2: ")
        assert _submitted(front) == submitted  # (checked on the engine before it was given any turn)
