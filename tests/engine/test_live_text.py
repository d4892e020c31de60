"""Live text in the engine (engine/live.py, api/live.py) on the CPU: a request fed text while it runs gives the
codes of its whole text in streaming-text mode, whatever the chunking and the timing; rows waiting for text park
beside ordinary rows without changing them; cancel, time-outs and preemption free what a waiting row holds."""

from __future__ import annotations

import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import soundfile as sf

from q3tts import TTS, EngineConfig
from q3tts.engine.live import LiveTextTimeout
from q3tts.tiny import tiny_checkpoint
from tests.equivalence.test_equivalence import speech_like

TEXT = "Hello world, a test: 3.14\nand  new lines!"
GREEDY = {"do_sample": False, "subtalker_dosample": False}
MAX_NEW = 24


def load(name: str, cache, **config) -> TTS:
    return TTS.from_pretrained(tiny_checkpoint(name, cache), device="cpu",
                               engine_config=EngineConfig(**{"max_rows": 4, "block_size": 16, **config}))


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    cache, ref = tmp_path_factory.mktemp("cache"), tmp_path_factory.mktemp("ref") / "ref.wav"
    sf.write(ref, speech_like(1.5, 24000, 7), 24000)
    custom, design, base = load("tiny", cache), load("tiny-voice-design", cache), load("tiny-base", cache)
    voice = base.create_voice(str(ref), x_vector_only=True)
    in_context = base.create_voice(str(ref), ref_text="Good morning.")
    modes = {"custom_voice": (custom, {"speaker": "ryan", "language": "english"}),
             "voice_design": (design, {"instruct": "A calm, low voice."}),
             "x_vector": (base, {"voice": voice}), "in_context": (base, {"voice": in_context})}
    yield modes
    for tts in (custom, design, base):
        tts.close()


def whole(tts: TTS, text: str, max_new: int = MAX_NEW, **kwargs) -> tuple[np.ndarray, np.ndarray]:
    stream = tts.stream(text, non_streaming_mode=False, max_new_tokens=max_new, **kwargs)
    audio = np.concatenate([chunk.pcm for chunk in stream])
    return np.stack(stream.frames.channel.codes), audio


def chunked(rng: random.Random, text: str) -> list[str]:
    if rng.random() < 0.3:
        return list(text)  # one character at a time
    cuts = sorted(rng.sample(range(1, len(text)), rng.randint(1, min(12, len(text) - 1))))
    return [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]


def live(tts: TTS, chunks: list[str], delays: list[float], max_new: int = MAX_NEW, **kwargs
         ) -> tuple[np.ndarray, np.ndarray]:
    """The live request's codes and audio, its text appended from another thread with these delays."""
    request = tts.live(max_new_tokens=max_new, **kwargs)

    def feed():
        for chunk, delay in zip(chunks, delays):
            time.sleep(delay)
            request.append(chunk)
        request.end()

    feeder = threading.Thread(target=feed)
    feeder.start()
    audio = np.concatenate([chunk.pcm for chunk in request])
    feeder.join()
    return np.stack(request.stream.frames.channel.codes), audio


@pytest.mark.parametrize("mode, text", [("custom_voice", TEXT), ("voice_design", TEXT), ("x_vector", TEXT),
                                        ("in_context", TEXT + " " + TEXT), ("in_context", "Short.")])
@pytest.mark.parametrize("greedy", [True, False])
def test_live_text_gives_the_whole_texts_codes(models, mode, text, greedy):
    """(An in-context voice's prompt holds the text beside its reference frames: the long text runs past them
    and trails, the short one fits within.)"""
    tts, kwargs = models[mode]
    kwargs = {**kwargs, "seed": 11, **(GREEDY if greedy else {})}
    codes, audio = whole(tts, text, **kwargs)
    rng = random.Random(len(text) + greedy)
    for _ in range(2):
        chunks = chunked(rng, text)
        delays = [rng.choice([0.0, 0.0, 0.001, 0.01, 0.03]) for _ in chunks]
        live_codes, live_audio = live(tts, chunks, delays, **kwargs)
        np.testing.assert_array_equal(live_codes, codes)
        np.testing.assert_allclose(live_audio, audio, atol=1e-5)
    assert not tts.engine.num_parked and tts.engine.runner.kv.num_free == tts.engine.runner.kv.num_blocks - 1


def test_parked_rows_beside_ordinary_rows(models):
    """Two ordinary streams and a live request fed slowly (its row parks and comes back many times) run together:
    every one's codes are its own alone."""
    tts, kwargs = models["custom_voice"]
    texts = ["Thank you very much.", "The quick brown fox jumps over a lazy dog."]
    alone = [whole(tts, text, **kwargs, seed=5)[0] for text in texts]
    expected = whole(tts, TEXT, **kwargs, seed=5)[0]
    streams = [tts.stream(text, non_streaming_mode=False, max_new_tokens=MAX_NEW, **kwargs, seed=5) for text in texts]
    words = TEXT.split(" ")
    chunks = [words[0]] + [" " + w for w in words[1:]]
    got = {}
    reader = threading.Thread(target=lambda: got.update(live=live(tts, chunks, [0.02] * len(chunks), **kwargs,
                                                                  seed=5)[0]))
    reader.start()
    for i, stream in enumerate(streams):
        list(stream)
        np.testing.assert_array_equal(np.stack(stream.frames.channel.codes), alone[i])
    reader.join()
    np.testing.assert_array_equal(got["live"], expected)


def wait_until(condition, timeout: float = 30.0) -> None:
    end = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < end, "timed out"
        time.sleep(0.005)


def test_cancel_while_waiting_frees_the_row(models):
    tts, kwargs = models["custom_voice"]
    engine = tts.engine
    request = tts.live(max_new_tokens=MAX_NEW, **kwargs)
    request.append("Hello world, this is")
    frames = iter(request)
    next(frames)  # running; it parks once its text is used up
    wait_until(lambda: engine.num_parked)
    request.cancel()
    assert list(frames)[-1].is_last
    assert request.stream.frames.channel.finish_reason == "cancelled"
    wait_until(lambda: not engine.num_parked and not engine.num_live)
    assert engine.runner.kv.num_free == engine.runner.kv.num_blocks - 1


def test_dropped_stream_while_waiting_frees_the_row(models):
    tts, kwargs = models["custom_voice"]
    engine = tts.engine
    request = tts.live(max_new_tokens=MAX_NEW, **kwargs)
    request.append("Hello world, this is")
    frames = iter(request)
    next(frames)
    wait_until(lambda: engine.num_parked)
    frames.close()  # the reader goes away (a client disconnecting)
    wait_until(lambda: not engine.num_parked and not engine.num_live)
    assert engine.runner.kv.num_free == engine.runner.kv.num_blocks - 1


@pytest.mark.parametrize("first_text", ["", "Hello world, this is"])
def test_a_row_that_waits_too_long_for_text_ends(models, first_text):
    """Parked (or waiting for its first word): after max_text_wait_s the stream raises LiveTextTimeout; its
    blocks are freed; the wait never counted as frames."""
    tts, kwargs = models["custom_voice"]
    engine = tts.engine
    request = tts.live(max_new_tokens=MAX_NEW, max_text_wait_s=0.3, **kwargs)
    if first_text:
        request.append(first_text)
    started = time.monotonic()
    with pytest.raises(LiveTextTimeout, match="max_text_wait_s"):
        list(request)
    assert time.monotonic() - started >= 0.3
    assert request.stream.frames.channel.finish_reason == "text_timeout"
    wait_until(lambda: not engine.num_parked and not engine.num_live)
    assert engine.runner.kv.num_free == engine.runner.kv.num_blocks - 1


def test_parked_rows_are_preempted_and_come_back_exactly(tmp_path_factory):
    """A KV cache too small for all: parked live rows hold their blocks, count in the budget and are swapped out
    like running ones; their codes stay the whole text's."""
    cache = tmp_path_factory.mktemp("cache")
    probe = load("tiny", cache)
    tc = probe.config.talker_config
    per_position = 2 * tc.num_hidden_layers * tc.num_key_value_heads * tc.head_dim * 4
    probe.close()
    tts = load("tiny", cache, kv_cache_gb=6 * 16 * per_position / 2**30)
    kwargs = {"speaker": "ryan", "language": "english", "seed": 3}
    texts = [TEXT, "Good morning, seven bright stars shine above quiet hills and rivers.", TEXT[::-1]]
    expected = [whole(tts, text, 40, **kwargs)[0] for text in texts]
    results = [None] * len(texts)

    def run(i):
        words = texts[i].split(" ")
        results[i] = live(tts, [words[0]] + [" " + w for w in words[1:]], [0.01] * len(words), 40, **kwargs)[0]

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(texts))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert tts.engine.metrics.preemptions > 0
    for got, want in zip(results, expected):
        np.testing.assert_array_equal(got, want)
    assert tts.engine.runner.kv.num_free == tts.engine.runner.kv.num_blocks - 1
    tts.close()


def test_live_requests_started_together_give_their_own_codes(models, monkeypatch):
    """Their first words come together from four threads: their prompts are built in one batch after the first
    (api/engine_host.py, PromptCombiner), and each request's codes are those it gives alone."""
    tts, voice = models["custom_voice"]
    batches, hold = [], threading.Event()
    original = tts.prepare_many

    def prepare_many(requests):
        batches.append(len(requests))
        if hold.is_set() and len(batches) == 1:  # (the first of the threads started together: the others come)
            wait_until(lambda: tts.num_prompts_waiting >= 3, 10)
        return original(requests)

    monkeypatch.setattr(tts, "prepare_many", prepare_many)
    texts = [f"Live request number {i}." for i in range(4)]
    start = threading.Barrier(len(texts))

    def run(i: int, together: bool) -> np.ndarray:
        request = tts.live(max_new_tokens=8, seed=i, **voice)
        stream = iter(request)  # (submitted now: its row waits for the first words)
        if together:
            start.wait()
        request.append(texts[i])
        request.end()
        for _ in stream:
            pass
        return np.stack(request.stream.frames.channel.codes)

    alone = [run(i, False) for i in range(len(texts))]
    assert batches == [1] * len(texts)
    batches.clear()
    hold.set()
    with ThreadPoolExecutor(len(texts)) as pool:
        together = list(pool.map(lambda i: run(i, True), range(len(texts))))
    assert batches == [1, 3]
    for a, b in zip(alone, together):
        np.testing.assert_array_equal(a, b)
