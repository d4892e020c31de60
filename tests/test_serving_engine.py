"""The continuous-batching engine on the CPU (tiny model, eager path)."""

from __future__ import annotations

import asyncio
import dataclasses
import sys
import threading
import time

import numpy as np
import pytest

from q3tts import TTS
from q3tts.prompt import build_prompt
from q3tts.serving.engine import AsyncEngine, EngineError, QueueFull, ServingConfig
from q3tts.tiny import tiny_checkpoint

TEXTS = ["Hello world.", "Thank you very much.", "Good morning, seven bright stars.", "One two three four.",
         "The quick brown fox.", "Good evening."]
SPEAKERS = ["ryan", "eric", "serena", "vivian", "aiden", "dylan"]


@pytest.fixture(scope="module")
def tts(tmp_path_factory) -> TTS:
    return TTS.from_pretrained(tiny_checkpoint("tiny", tmp_path_factory.mktemp("cache")), device="cpu")


@pytest.fixture
def engine(tts):
    eng = AsyncEngine(tts, ServingConfig(max_running=4, max_waiting=8, max_context=256))
    eng.start()
    yield eng
    eng.stop()


def _request(tts: TTS, i: int, greedy: bool, max_new: int = 16):
    spec, params = tts._request(TEXTS[i], SPEAKERS[i], None, None, "english", None, 100 + i,
                                {"max_new_tokens": max_new} | ({"do_sample": False, "subtalker_dosample": False}
                                                               if greedy else {}))
    return build_prompt(tts.model.talker, tts.config, spec), params


def _alone(tts: TTS, i: int, greedy: bool, max_new: int = 16) -> np.ndarray:
    """The request's audio from the offline reference path, as if it were alone."""
    spec, params = tts._request(TEXTS[i], SPEAKERS[i], None, None, "english", None, 100 + i,
                                {"max_new_tokens": max_new} | ({"do_sample": False, "subtalker_dosample": False}
                                                               if greedy else {}))
    return tts._synthesize([spec], [params])[0]


@pytest.mark.parametrize("greedy", [True, False])
def test_each_request_gets_its_own_audio(tts, engine, greedy):
    """Six requests with distinct voices and seeds, four rows: they join as rows free up; every request's
    audio equals its solo rendering (so none received another's, and the batch did not change it)."""
    async def run():
        streams = [engine.submit(*_request(tts, i, greedy)) for i in range(len(TEXTS))]
        return await asyncio.gather(*(s.read_all() for s in streams))

    outputs = asyncio.run(run())
    for i, audio in enumerate(outputs):
        ref = _alone(tts, i, greedy)
        assert audio.shape == ref.shape and float(np.abs(audio - ref).max()) < 1e-5, i
    assert engine.num_running == 0 and engine.metrics.requests_finished >= 6


def test_requests_join_a_running_batch(tts, engine):
    """A request submitted while another streams joins at a frame boundary and both stay exact."""
    first = engine.submit(*_request(tts, 0, True, max_new=40))
    frames = []
    for k, frame in enumerate(first):  # sync iteration from this thread
        frames.append(frame)
        if k == 5:
            second = engine.submit(*_request(tts, 1, True, max_new=20))
    assert np.abs(np.concatenate(frames) - _alone(tts, 0, True, 40)).max() < 1e-5
    assert np.abs(np.concatenate(list(second)) - _alone(tts, 1, True, 20)).max() < 1e-5


def test_cancel_frees_the_row(tts, engine):
    stream = engine.submit(*_request(tts, 2, False, max_new=200))
    got = []
    for frame in stream:
        got.append(frame)
        if len(got) == 3:
            stream.cancel()
    deadline = time.time() + 10
    while engine.num_running and time.time() < deadline:
        time.sleep(0.01)
    assert 3 <= len(got) < 199 and engine.num_running == 0 and engine.metrics.requests_cancelled == 1
    after = engine.submit(*_request(tts, 3, True))
    assert np.abs(np.concatenate(list(after)) - _alone(tts, 3, True)).max() < 1e-5


def test_bounded_queue_and_context_limit(tts):
    eng = AsyncEngine(tts, ServingConfig(max_running=1, max_waiting=1, max_context=256))  # not started
    eng.submit(*_request(tts, 0, True))
    with pytest.raises(QueueFull):
        eng.submit(*_request(tts, 1, True))
    prompt, params = _request(tts, 2, True, max_new=300)
    with pytest.raises(ValueError, match="exceed this server's 256 positions"):
        eng.submit(prompt, params)
    prompt, params = _request(tts, 2, True)
    long_text = dataclasses.replace(prompt, trailing_ids=[0] * (eng.runner.config.max_trailing + 1))
    with pytest.raises(ValueError, match="text too long"):  # refused at submission, not in the engine thread
        eng.submit(long_text, params)


def test_submit_from_many_threads(tts, engine):
    results = {}

    def worker(i):
        results[i] = np.concatenate(list(engine.submit(*_request(tts, i, True))))

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for i in range(4):
        assert np.abs(results[i] - _alone(tts, i, True)).max() < 1e-5


def test_stop_ends_open_streams(tts):
    """Stopping the engine ends every running and waiting request with EngineError (no consumer waits forever),
    later submissions are refused, and the interpreter's switch interval is given back."""
    switch_interval = sys.getswitchinterval()
    eng = AsyncEngine(tts, ServingConfig(max_running=1, max_waiting=4, max_context=512))
    eng.start()
    assert sys.getswitchinterval() == min(switch_interval, 0.001)
    streams = [eng.submit(*_request(tts, i, True, max_new=400)) for i in range(2)]
    frames = iter(streams[0])
    next(frames)  # the first request is running, the second waiting
    outcomes = {}

    def consume(name, it):
        try:
            list(it)
            outcomes[name] = "ended"
        except EngineError as e:
            outcomes[name] = str(e)

    readers = [threading.Thread(target=consume, args=(n, it), daemon=True)
               for n, it in (("running", frames), ("waiting", iter(streams[1])))]
    for r in readers:
        r.start()
    eng.stop()
    for r in readers:
        r.join(timeout=30)
    assert outcomes == {"running": "the engine was stopped", "waiting": "the engine was stopped"}
    with pytest.raises(EngineError, match="stopped"):
        eng.submit(*_request(tts, 2, True))
    assert sys.getswitchinterval() == switch_interval
