"""`TTS.live` (q3tts/api/live.py): the same AudioChunks as `stream`, sync and async; every limit and bad input is a
RequestError naming its argument."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from q3tts import TTS, EngineConfig, RequestError
from q3tts.api import live as live_module
from q3tts.tiny import tiny_checkpoint

KWARGS = {"speaker": "ryan", "language": "english", "seed": 4, "max_new_tokens": 12}
TEXT = "Good morning, seven bright stars."


@pytest.fixture(scope="module")
def tts(tmp_path_factory) -> TTS:
    tts = TTS.from_pretrained(tiny_checkpoint("tiny", tmp_path_factory.mktemp("cache")), device="cpu",
                              engine_config=EngineConfig(max_rows=2))
    yield tts
    tts.close()


def chunks_of(stream) -> list:
    return [(c.index, c.start_frame, c.num_frames, c.is_last, c.pcm) for c in stream]


def test_sync_and_async_chunks_are_streams(tts):
    expected = chunks_of(tts.stream(TEXT, non_streaming_mode=False, **KWARGS))
    live = tts.live(**KWARGS)
    for word in TEXT.split(" "):
        live.append(word if word == "Good" else " " + word)
    live.end()
    got = chunks_of(live)

    async def read_async():
        request = tts.live(**KWARGS)
        request.append(TEXT)
        request.end()
        return [(c.index, c.start_frame, c.num_frames, c.is_last, c.pcm) async for c in request]

    for chunks in (got, asyncio.run(read_async())):
        assert [c[:4] for c in chunks] == [c[:4] for c in expected]
        np.testing.assert_allclose(np.concatenate([c[4] for c in chunks]),
                                   np.concatenate([c[4] for c in expected]), atol=1e-5)


def test_bad_input_and_limits(tts, monkeypatch):
    live = tts.live(**KWARGS)
    with pytest.raises(RequestError, match="string") as e:
        live.append(3)
    assert e.value.param == "text"
    with pytest.raises(RequestError, match="at most 4096 characters") as e:
        live.append("a" * 4097)
    assert e.value.code == "too_long"  # (the servers' WebSockets answer input_too_long by this code)
    with pytest.raises(RequestError, match="not valid Unicode"):
        live.append("\ud800")
    with pytest.raises(RequestError, match="empty"):
        live.end()
    live.append(" \u200b\u200f")  # (nothing to speak: as no text)
    with pytest.raises(RequestError, match="empty"):
        live.end()
    live.append("Hello there.")
    live.end()
    with pytest.raises(RequestError, match="after end") as e:
        live.append(" More.")
    assert e.value.code == "invalid_value"
    live.cancel()

    cancelled = tts.live(**KWARGS)
    cancelled.cancel()
    with pytest.raises(RequestError, match="cancelled"):
        cancelled.append("Hello")
    assert list(cancelled) == []

    monkeypatch.setattr(live_module, "MAX_TEXT_TOKENS", 5)
    long = tts.live(**KWARGS)
    with pytest.raises(RequestError, match="over 5 tokens") as e:
        long.append("one two three four five six seven eight nine ten ")
    assert (e.value.param, e.value.code) == ("text", "too_long")
    with pytest.raises(RequestError, match="cancelled"):
        long.append("more")


@pytest.mark.parametrize("wait", [0, -1, "5", True])
def test_max_text_wait_must_be_positive_seconds(tts, wait):
    with pytest.raises(RequestError, match="max_text_wait_s") as e:
        tts.live(max_text_wait_s=wait, **KWARGS)
    assert e.value.param == "max_text_wait_s"


def test_mode_arguments_are_checked_at_once(tts):
    with pytest.raises(RequestError, match="unknown speaker"):
        tts.live(speaker="nobody")
    with pytest.raises(RequestError, match="did you mean"):
        tts.live(speaker="ryan", temprature=0.5)


def test_a_text_feeding_mode_other_than_streaming_text_is_refused_by_name(tts):
    """(`live(non_streaming_mode=True)` was a TypeError from inside: "got multiple values for keyword argument".)"""
    with pytest.raises(RequestError, match="streaming-text mode") as e:
        tts.live(non_streaming_mode=True, **KWARGS)
    assert e.value.param == "non_streaming_mode"
    tts.live(non_streaming_mode=False, **KWARGS).cancel()
