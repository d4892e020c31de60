"""Dialogues in Python (`TTS.dialogue`, `TTS.stream_dialogue`) and scripts (JSON lines, Kokoro's [voice:name]
tags), on the tiny CustomVoice checkpoint."""

from __future__ import annotations

import re
import time

import numpy as np
import pytest

from q3tts import TTS
from q3tts.errors import RequestError
from q3tts.request.dialogue import Turn, read_script
from q3tts.tiny import tiny_checkpoint

GREEDY = {"do_sample": False, "subtalker_dosample": False, "max_new_tokens": 5}
FRAME = 1920
TURNS = [{"speaker": "ryan", "text": "Hello there.", "pause": 0.25},
         {"speaker": "vivian", "text": "Hi! How are you?", "language": "english"},
         Turn(text="Fine, thanks.", speaker="ryan", instruct="Cheerful.", pause=0.1)]


@pytest.fixture(scope="module")
def tts(tmp_path_factory) -> TTS:
    return TTS.from_pretrained(tiny_checkpoint("tiny", tmp_path_factory.mktemp("cache")))


def test_a_dialogue_is_its_turns_in_order_with_their_pauses(tts):
    audio = tts.dialogue(TURNS, **GREEDY)
    alone = [tts.synthesize("Hello there.", speaker="ryan", **GREEDY),
             tts.synthesize("Hi! How are you?", speaker="vivian", language="english", **GREEDY),
             tts.synthesize("Fine, thanks.", speaker="ryan", instruct="Cheerful.", **GREEDY)]
    expected = np.concatenate([alone[0], np.zeros(6000, np.float32), alone[1], alone[2], np.zeros(2400, np.float32)])
    assert audio.shape == expected.shape == (3 * 4 * FRAME + 8400,)
    np.testing.assert_allclose(audio, expected, atol=1e-5)


def test_the_stream_is_the_same_audio_in_script_order(tts):
    frames = list(tts.stream_dialogue(TURNS, **GREEDY))
    streamed, whole = np.concatenate(frames), tts.dialogue(TURNS, **GREEDY)
    assert streamed.shape == whole.shape
    np.testing.assert_allclose(streamed, whole, atol=1e-3)  # (the engine's incremental decode: docs/faithfulness.md)
    assert np.all(streamed[4 * FRAME:4 * FRAME + 6000] == 0)  # the pause after turn 0


def test_closing_the_stream_early_frees_every_turn(tts):
    stream = tts.stream_dialogue(TURNS * 3, **GREEDY)
    next(stream)
    stream.close()
    engine, deadline = tts.engine, time.monotonic() + 10
    while (engine.num_running or engine.num_waiting) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not engine.num_running and not engine.num_waiting


@pytest.mark.parametrize("turns, param, says", [
    ([TURNS[0], {"speaker": "nobody", "text": "Hi."}], "turns[1].speaker", "turn 1: unknown speaker 'nobody'"),
    ([TURNS[0], {"speaker": "ryan", "text": "  "}], "turns[1].text", "turn 1: text is empty"),
    ([{"speaker": "ryan"}], "turns[0].text", "turn 0: `text` is missing"),
    ([{"speaker": "ryan", "text": "Hi.", "pause": -1}], "turns[0].pause", "turn 0: pause is seconds"),
    ([{"speaker": "ryan", "text": "Hi.", "pause": "1"}], "turns[0].pause", "turn 0: pause is seconds"),
    ([TURNS[0], {"speaker": "ryan", "text": "Hi.", "speakr": "x"}], "turns[1].speakr", "unknown field 'speakr'"),
    ([{"speaker": "ryan", "text": 5}], "turns[0].text", "text must be a string"),
    ([{"text": "Hi."}], "turns[0].speaker", "needs `speaker`"),
    ([TURNS[0], {"speaker": "ryan", "text": "Hi.", "language": "klingon"}], "turns[1].language", "turn 1:"),
    ([], "turns", "1 to 256 turns"),
    ("Hello", "turns", "must be a list"),
])
def test_bad_turns_are_refused_before_anything_runs(tts, turns, param, says):
    with pytest.raises(RequestError, match=re.escape(says)) as e:
        tts.dialogue(turns, **GREEDY)
    assert e.value.param == param
    assert not tts.engine.num_running and not tts.engine.num_waiting


@pytest.mark.parametrize("defaults, says", [({"temprature": 0.5}, "did you mean `temperature`"),
                                            ({"max_new_tokens": 1}, "max_new_tokens must be at least 2"),
                                            ({"language": "klingon"}, "unsupported language 'klingon'")])
def test_a_bad_default_is_named_as_passed_not_as_the_first_turns(tts, defaults, says):
    """(A default's fault was turns[0].<name>, "turn 0: ...": the first turn, which had no such field.)"""
    with pytest.raises(RequestError, match=re.escape(says)) as e:
        tts.dialogue(TURNS, **{**GREEDY, **defaults})
    assert e.value.param == next(iter(defaults)) and not str(e.value).startswith("turn 0")


def test_scripts_as_json_lines_and_kokoro_tags(tmp_path):
    jsonl = tmp_path / "script.jsonl"
    jsonl.write_text('{"speaker": "ryan", "text": "Hello."}\n\n{"speaker": "vivian", "text": "Hi.", "pause": 0.5}\n')
    assert read_script(jsonl, "custom_voice") == [Turn("Hello.", "ryan"), Turn("Hi.", "vivian", pause=0.5)]
    tagged = tmp_path / "script.txt"
    tagged.write_text("Welcome. [voice:ryan] Hello there.\n[voice: vivian ]Hi!\n[voice:ryan]")
    assert read_script(tagged, "custom_voice") == [Turn("Welcome."), Turn("Hello there.", "ryan"),
                                                   Turn("Hi!", "vivian")]
    assert read_script(tagged, "base")[1] == Turn("Hello there.", voice="ryan")
    with pytest.raises(RequestError, match="VoiceDesign checkpoint has none"):
        read_script(tagged, "voice_design")
    (tmp_path / "bad.jsonl").write_text('{"text": "Hi."}\n{oops\n')
    with pytest.raises(RequestError, match=re.escape("bad.jsonl:2: not a JSON object")):
        read_script(tmp_path / "bad.jsonl", "custom_voice")


def test_the_turns_generate_together(tts):
    """All turns are rows of one batch at once (the engine's largest batch), not one after another."""
    tts.engine.metrics.max_batch = 0
    tts.dialogue([{"speaker": "ryan", "text": f"Turn {i}."} for i in range(4)], **GREEDY)
    assert tts.engine.metrics.max_batch == 4
