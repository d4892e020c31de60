"""Every entry point runs on the model's one engine and gives the reference loop's audio (greedy, and sampled
with a seed); concurrent callers batch; closed or abandoned streams free their rows; the checkpoint's defaults
work. CPU, tiny checkpoints, fp32."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import threading
import time
import warnings

import numpy as np
import pytest
import soundfile as sf

from q3tts import TTS, RequestError
from q3tts.api.render import official_extra
from q3tts.tiny import tiny_checkpoint
from tests.equivalence.test_equivalence import speech_like

GREEDY = {"do_sample": False, "subtalker_dosample": False}


def load(name: str, cache, **kwargs) -> TTS:
    return TTS.from_pretrained(tiny_checkpoint(name, cache), device="cpu", **kwargs)


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("cache")


@pytest.fixture(scope="module")
def pairs(cache):
    """(engine path, reference path) per tiny checkpoint, loaded on first use."""
    loaded: dict[str, tuple[TTS, TTS]] = {}

    def get(name: str) -> tuple[TTS, TTS]:
        if name not in loaded:
            loaded[name] = (load(name, cache), load(name, cache, reference=True))
        return loaded[name]

    return get


@pytest.fixture(scope="module")
def ref_wav(tmp_path_factory):
    path = tmp_path_factory.mktemp("ref") / "ref.wav"
    sf.write(path, speech_like(1.0, 24000, 5), 24000)
    return path


TOL = {"cpu": 1e-5, "cuda": 1e-4}  # fp32; on a GPU cuDNN and cuBLAS round differently per call shape


def same(ours: list[np.ndarray], reference: list[np.ndarray]) -> None:
    assert len(ours) == len(reference)
    for i, (a, b) in enumerate(zip(ours, reference)):
        assert a.shape == b.shape, (i, a.shape, b.shape)
        assert float(np.abs(a - b).max(initial=0.0)) < TOL[CURRENT["device"]], i


CURRENT = {"device": "cpu"}  # the GPU tests (tests/gpu/test_gpu.py) run these checks with "cuda"


def joined(chunks) -> np.ndarray:
    return np.concatenate([c.pcm for c in chunks])


def codes_diverge(ours_codes: list[np.ndarray], ref: TTS, text: str, **kwargs) -> list[int]:
    """Frames whose codes differ from the reference loop's (a diagnosis for a failed audio comparison)."""
    from q3tts.reference import generate_codes
    from q3tts.request.prompt import build_prompt

    r = ref.request(text, **kwargs)
    codes = generate_codes(ref.model.talker, [build_prompt(ref.model.talker, ref.config, r.spec)], [r.params])[0]
    ours = np.stack(ours_codes) if ours_codes else np.zeros((0, 16), dtype=np.int64)
    if ours.shape != codes.shape:
        return [-1]
    return np.nonzero((ours != codes.numpy()).any(1))[0].tolist()


@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "sampled"])
def test_custom_voice_entry_points(pairs, sampled):
    check_custom_voice(*pairs("tiny"), sampled)


def check_custom_voice(ours: TTS, ref: TTS, sampled: bool) -> None:
    kw = {"max_new_tokens": 12, "seed": 5} | ({} if sampled else GREEDY)
    texts, speakers = ["Hello world.", "Thank you very much.", "Good morning."], ["ryan", "eric", "serena"]
    for tts in (ours, ref):
        assert tts.reference is (tts is ref)
    same(ours.generate_custom_voice(texts, speakers, language="english", **kw)[0],
         ref.generate_custom_voice(texts, speakers, language="english", **kw)[0])
    same([ours.synthesize(texts[0], speaker="ryan", instruct="Slowly.", **kw)],
         [ref.synthesize(texts[0], speaker="ryan", instruct="Slowly.", **kw)])
    requests = [ours.request(t, speaker=s, **kw) for t, s in zip(texts, speakers)]
    same(ours.synthesize_all(requests), ref.synthesize_all(requests))
    expected = ref.synthesize(texts[1], speaker="eric", **kw)
    same([joined(ours.stream(texts[1], speaker="eric", **kw))], [expected])

    async def collect():
        return joined([c async for c in ours.astream(texts[1], speaker="eric", **kw)])

    same([asyncio.run(collect())], [expected])
    assert ours.engine.metrics.max_batch >= 3  # the list ran as rows of one batch


def test_custom_voice_without_a_speaker(pairs):
    """The drop-in `generate_custom_voice`, as the official one, takes speaker None or "" (no speaker position in
    the prompt: the voice comes from the instruction alone) without a warning; our own API still asks for a
    speaker, and a speaker that is neither a name nor None/"" is refused, as the official validator refuses it.
    (tests/equivalence/test_equivalence.py compares the codes with the official implementation's.)"""
    ours, ref = pairs("tiny")
    kw = {"max_new_tokens": 10, "seed": 3} | GREEDY
    texts, speakers = ["Hello world.", "Thank you very much.", "Good morning."], [None, "", "ryan"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        wavs = ours.generate_custom_voice(texts, speakers, instruct="Slowly.", **kw)[0]
    same(wavs, ref.generate_custom_voice(texts, speakers, instruct="Slowly.", **kw)[0])
    same(ours.generate_custom_voice(texts[0], None, **kw)[0], ref.generate_custom_voice(texts[0], "", **kw)[0])
    with_speaker = ours.generate_custom_voice(texts[0], "ryan", instruct="Slowly.", **kw)[0][0]
    assert not np.array_equal(wavs[0], with_speaker)
    for tts in (ours, ref):
        for speaker in (None, ""):
            with pytest.raises(RequestError, match="needs `speaker`") as missing:
                tts.request(texts[0], speaker=speaker, **kw)
            assert missing.value.param == "speaker" and missing.value.code == "missing"
    for speaker, says in ((0, "speaker must be a string, one of .*; got int"),
                          (False, "speaker must be a string, one of .*; got bool"), (" ", "unknown speaker ' '")):
        with pytest.raises(RequestError, match=says) as unknown:
            ours.generate_custom_voice(texts[0], speaker, **kw)
        assert unknown.value.param == "speaker"


@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "sampled"])
def test_voice_design_entry_points(pairs, sampled):
    check_voice_design(*pairs("tiny-voice-design"), sampled)


def check_voice_design(ours: TTS, ref: TTS, sampled: bool) -> None:
    kw = {"max_new_tokens": 10, "seed": 9} | ({} if sampled else GREEDY)
    args = (["One two three.", "Numbers: 42."], ["A young woman, excited.", ""])  # the official API allows ""
    same(ours.generate_voice_design(*args, **kw)[0], ref.generate_voice_design(*args, **kw)[0])
    same([ours.synthesize("Hello.", instruct="A calm voice.", **kw)],
         [ref.synthesize("Hello.", instruct="A calm voice.", **kw)])


@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "sampled"])
def test_voice_clone_entry_points(pairs, ref_wav, sampled):
    check_voice_clone(*pairs("tiny-base"), ref_wav, sampled)


def check_voice_clone(ours: TTS, ref: TTS, ref_wav, sampled: bool) -> None:
    """In-context and x-vector clones. The drop-in method keeps the official cut of the reference's share
    (which here keeps one sample of the reference's audio: the case is chosen so, else the test is idle); ours
    (synthesize, stream) starts exactly at the first generated frame."""
    voice = ours.create_voice(str(ref_wav), "Good morning.")
    frames = next(t for t in range(8, 40) if official_extra(voice.ref_code.shape[0], t, 1920))
    kw = {"max_new_tokens": frames + 1, "seed": 3} | ({} if sampled else GREEDY)
    dropin = ours.generate_voice_clone("Hello there.", ref_audio=str(ref_wav), ref_text="Good morning.", **kw)[0]
    same(dropin, ref.generate_voice_clone("Hello there.", ref_audio=str(ref_wav), ref_text="Good morning.", **kw)[0])
    assert dropin[0].shape == (frames * 1920 + 1,)
    offline = ours.synthesize("Hello there.", voice=voice, **kw)
    same([offline], [ref.synthesize("Hello there.", voice=voice, **kw)])
    same([offline], [dropin[0][1:]])
    same([joined(ours.stream("Hello there.", voice=voice, **kw))], [offline])
    xvec = ours.create_voice(str(ref_wav), x_vector_only=True)
    same(ours.generate_voice_clone(["Hi.", "Thank you."], voice_clone_prompt=xvec, **kw)[0],
         ref.generate_voice_clone(["Hi.", "Thank you."], voice_clone_prompt=xvec, **kw)[0])


def test_concurrent_streams_from_threads_batch(cache, pairs):
    check_concurrent_streams(load("tiny", cache), pairs("tiny")[1])


def check_concurrent_streams(tts: TTS, ref: TTS) -> None:
    """Streams opened from several threads run as rows of one batch, and each equals its solo rendering."""
    speakers = ["ryan", "eric", "serena", "vivian"]
    kw = {"max_new_tokens": 30, "seed": 2}
    barrier, results = threading.Barrier(len(speakers)), {}

    def worker(speaker):
        stream = tts.stream("Good evening, everyone.", speaker=speaker, **kw)
        barrier.wait()
        results[speaker] = joined(stream)
        codes[speaker] = stream.frames.channel.codes

    codes = {}

    threads = [threading.Thread(target=worker, args=(s,)) for s in speakers]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert tts.engine.metrics.max_batch >= 2
    for s in speakers:
        assert codes_diverge(codes[s], ref, "Good evening, everyone.", speaker=s, **kw) == [], s
        same([results[s]], [ref.synthesize("Good evening, everyone.", speaker=s, **kw)])
    tts.close()


def test_two_generators_advanced_in_one_thread_both_finish(pairs):
    check_two_generators(*pairs("tiny"))


def check_two_generators(ours: TTS, ref: TTS) -> None:
    kw = {"max_new_tokens": 20, "seed": 4, "chunk_schedule": (2,)}
    streams = ours.stream("First one.", speaker="ryan", **kw), ours.stream("Second.", speaker="eric", **kw)
    got: dict[str, list] = {"a": [], "b": []}
    pending = {"a": iter(streams[0]), "b": iter(streams[1])}
    while pending:
        for name, it in list(pending.items()):
            try:
                got[name].append(next(it))
            except StopIteration:
                del pending[name]
    kw.pop("chunk_schedule")
    assert codes_diverge(streams[0].frames.channel.codes, ref, "First one.", speaker="ryan", **kw) == []
    assert codes_diverge(streams[1].frames.channel.codes, ref, "Second.", speaker="eric", **kw) == []
    same([joined(got["a"]), joined(got["b"])],
         [ref.synthesize("First one.", speaker="ryan", **kw), ref.synthesize("Second.", speaker="eric", **kw)])


def test_closed_or_abandoned_streams_free_their_rows(cache):
    check_closed_streams(load("tiny", cache))


def check_closed_streams(tts: TTS) -> None:
    """A closed astream, an abandoned one and an abandoned stream each free their row (engine counters)."""
    engine = tts.prepare_engine()
    long = {"speaker": "ryan", "max_new_tokens": 2000, "seed": 1}

    async def close_early():
        async with contextlib.aclosing(tts.astream("A long answer.", **long).__aiter__()) as chunks:
            async for _ in chunks:
                break

    async def abandon():
        async for _ in tts.astream("A long answer.", **long):
            break

    for run in (close_early, abandon):
        before = engine.metrics.requests_cancelled
        asyncio.run(run())
        gc.collect()
        wait_until(lambda: engine.num_running == 0 and engine.num_waiting == 0)
        assert engine.metrics.requests_cancelled == before + 1, run.__name__
    next(iter(tts.stream("A long answer.", **long)))  # the stream and its generator are dropped at once
    gc.collect()
    wait_until(lambda: engine.num_running == 0)
    assert engine.metrics.requests_cancelled == 3 and engine.healthy
    tts.close()


def test_checkpoint_defaults_beyond_the_engine_context(cache):
    """The tiny checkpoints carry the released generation_config's max_new_tokens (8192). With an engine holding
    fewer positions per request, the default is lowered to what fits and the request runs; an explicit value that
    does not fit is refused, naming the settings to change."""
    tts = load("tiny", cache, max_context=96)
    assert tts.generation_config.max_new_tokens == 8192
    request = tts.request("Hello.", speaker="ryan", seed=1)
    assert request.params.max_new_tokens == 96 - request.num_positions
    audio = tts.synthesize("Hello.", speaker="ryan", seed=1)
    assert audio.shape == ((96 - request.num_positions - 1) * 1920,)  # a random model never says EOS
    with pytest.raises(RequestError, match="lower max_new_tokens to at most .* or raise max_context") as e:
        tts.request("Hello.", speaker="ryan", max_new_tokens=500)
    assert e.value.param == "max_new_tokens"
    with pytest.raises(RequestError, match="shorten the text") as e:
        tts.request("word " * 200, speaker="ryan")
    assert e.value.param == "text"
    tts.close()


def wait_until(condition, timeout: float = 30) -> None:
    deadline = time.time() + timeout
    while not condition():
        assert time.time() < deadline, "timed out"
        time.sleep(0.01)
