"""Long texts: spoken as pieces cut at sentence ends, the same voice and seed, joined without a step."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from q3tts import TTS
from q3tts.api.pieces import LONG_TEXT_CHARS, PIECE_CHARS, RAMP_SAMPLES, ramp
from q3tts.request.text_segmenter import split_text
from q3tts.tiny import tiny_checkpoint

TEXT = " ".join(f"This is sentence number {i} of a long answer, and it goes on for a while." for i in range(14))
KW = {"speaker": "ryan", "seed": 3, "max_new_tokens": 5}


@pytest.fixture(scope="module")
def tts(tmp_path_factory) -> TTS:
    return TTS.from_pretrained(tiny_checkpoint("tiny", tmp_path_factory.mktemp("cache")), device="cpu")


def test_long_text_is_spoken_as_pieces(tts):
    assert len(TEXT) > LONG_TEXT_CHARS
    pieces = split_text(TEXT, PIECE_CHARS)
    requests = tts.pieces(TEXT, **KW)
    assert len(requests) == len(pieces) >= 3 and all(len(p) <= PIECE_CHARS for p in pieces)
    alone = [tts.synthesize(p, **KW) for p in pieces]  # each piece with the same voice and seed
    audio = tts.synthesize(TEXT, **KW)
    assert audio.shape == (sum(len(a) for a in alone),) == (len(pieces) * 4 * 1920,)
    start = 0
    for k, piece in enumerate(alone):
        got = audio[start:start + len(piece)]
        expected = piece if k == 0 else ramp(float(alone[k - 1][-1]), piece)
        assert np.abs(got - expected).max() < 1e-5, k
        if k:  # the join has no step: the piece starts where the last one ended
            assert abs(float(got[0]) - float(audio[start - 1])) < 1e-6
            assert np.abs(got[RAMP_SAMPLES:] - piece[RAMP_SAMPLES:]).max() < 1e-5
        start += len(piece)


def test_long_text_streams_the_same_audio(tts):
    offline = tts.synthesize(TEXT, **KW)
    streamed = np.concatenate([c.pcm for c in tts.stream(TEXT, **KW)])

    async def collect():
        return np.concatenate([c.pcm async for c in tts.astream(TEXT, **KW)])

    for audio in (streamed, asyncio.run(collect())):  # pieces decode in other batches: last-bit differences
        assert audio.shape == offline.shape and np.abs(audio - offline).max() < 1e-5


def test_a_closed_long_stream_frees_its_rows(tts):
    import gc
    import time

    before = tts.engine.metrics.requests_cancelled
    stream = tts.stream(TEXT, **{**KW, "max_new_tokens": 500})
    next(iter(stream))
    stream.close()
    del stream
    gc.collect()
    deadline = time.time() + 30
    while tts.engine.num_running or tts.engine.num_waiting:
        assert time.time() < deadline
        time.sleep(0.02)
    assert tts.engine.metrics.requests_cancelled >= before + 2  # the playing piece and the one ahead
