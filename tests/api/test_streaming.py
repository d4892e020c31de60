"""TTS.stream: exact chunked audio (no crossfade), chunk schedule, formats, voice priming, asyncio."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import soundfile as sf

from q3tts import TTS
from q3tts.request.audio import to_int16
from q3tts.tiny import tiny_checkpoint
from tests.equivalence.test_equivalence import speech_like

SAMPLE = {"max_new_tokens": 40, "seed": 4}


# On the CPU: exact fp32 (on a GPU, cuDNN's TF32 convolutions round differently per call shape).
@pytest.fixture(scope="module")
def custom(tmp_path_factory) -> TTS:
    return TTS.from_pretrained(tiny_checkpoint("tiny", tmp_path_factory.mktemp("cache")), device="cpu")


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> TTS:
    return TTS.from_pretrained(tiny_checkpoint("tiny-base", tmp_path_factory.mktemp("cache")), device="cpu")


def test_stream_equals_offline_decode(custom):
    chunks = list(custom.stream("Hello world, this is a streaming test.", speaker="ryan", **SAMPLE))
    assert [c.start_s for c in chunks] == [c.start_frame * 0.08 for c in chunks]
    offline = custom.synthesize("Hello world, this is a streaming test.", speaker="ryan", **SAMPLE)
    audio = np.concatenate([c.pcm for c in chunks])
    assert audio.shape == offline.shape == (39 * 1920,)
    assert float(np.abs(audio - offline).max()) < 1e-5
    # The default schedule: 1, 2, 4, 8, then 16 frames per chunk; the last chunk holds the rest.
    assert [c.num_frames for c in chunks] == [1, 2, 4, 8, 16, 8]
    assert [c.index for c in chunks] == list(range(6)) and [c.is_last for c in chunks] == [False] * 5 + [True]
    assert [c.start_frame for c in chunks] == [0, 1, 3, 7, 15, 31]
    assert all(a.elapsed_s <= b.elapsed_s for a, b in zip(chunks, chunks[1:]))


def test_custom_schedule_and_int16(custom):
    chunks = list(custom.stream("Thank you.", speaker="eric", chunk_schedule=(3, 5), pcm_format="int16",
                                **SAMPLE))
    assert [c.num_frames for c in chunks] == [3] + [5] * 7 + [1]
    exact = list(custom.stream("Thank you.", speaker="eric", chunk_schedule=(3,), **SAMPLE))
    one_number = list(custom.stream("Thank you.", speaker="eric", chunk_schedule=3, **SAMPLE))  # the same
    assert [c.num_frames for c in one_number] == [c.num_frames for c in exact]
    # 39 frames fill the schedule exactly: the end is known only after the last chunk, an empty closing one.
    assert [c.num_frames for c in exact] == [3] * 13 + [0] and exact[-1].is_last and not exact[-2].is_last
    assert exact[-1].start_s == pytest.approx(39 * 0.08) and exact[-1].pcm.shape == (0,)
    audio = np.concatenate([c.pcm for c in chunks])
    assert audio.dtype == np.int16
    offline = custom.synthesize("Thank you.", speaker="eric", **SAMPLE)
    assert np.abs(audio.astype(np.int32) - to_int16(offline).astype(np.int32)).max() <= 1


def test_voice_clone_stream_is_primed_and_leaks_no_reference(base, tmp_path):
    ref = tmp_path / "ref.wav"
    sf.write(ref, speech_like(1.2, 24000, 8), 24000)
    voice = base.create_voice(str(ref), "Good morning.")
    audio = np.concatenate([c.pcm for c in base.stream("Hello there.", voice=voice, **SAMPLE)])
    offline = base.synthesize("Hello there.", voice=voice, **SAMPLE)
    # Both start exactly at the first generated frame (the drop-in generate_voice_clone keeps the official cut,
    # which can keep one more sample: tests/api/test_entry_points.py).
    assert audio.shape == offline.shape == (39 * 1920,)
    assert float(np.abs(audio - offline).max()) < 1e-5


def test_bad_input_raises_before_the_stream_opens(custom):
    with pytest.raises(ValueError, match="text is empty"):
        custom.stream("  ", speaker="ryan")
    with pytest.raises(ValueError, match="pcm_format"):
        custom.stream("Hi.", speaker="ryan", pcm_format="mp3")
    with pytest.raises(ValueError, match="chunk schedule"):
        custom.stream("Hi.", speaker="ryan", chunk_schedule=(0,))
    with pytest.raises(ValueError, match=r"chunk schedule must be frame counts \(a tuple, or one number\), got '3'"):
        custom.stream("Hi.", speaker="ryan", chunk_schedule="3")
    with pytest.raises(TypeError, match="non_streaming_mode must be True, False or None, got 'no'"):
        custom.stream("Hi.", speaker="ryan", non_streaming_mode="no")  # (bool("no") would have been True)


def test_astream_yields_the_same_chunks(custom):
    async def collect():
        return [c async for c in custom.astream("Good evening.", speaker="serena", **SAMPLE)]

    chunks = asyncio.run(collect())
    sync = list(custom.stream("Good evening.", speaker="serena", **SAMPLE))
    assert [c.num_frames for c in chunks] == [c.num_frames for c in sync]
    assert np.array_equal(np.concatenate([c.pcm for c in chunks]), np.concatenate([c.pcm for c in sync]))


def test_a_stream_is_read_once(custom):
    """Read again, a stream says so (it yielded one empty chunk marked last, as if the speech were empty)."""
    stream = custom.stream("Good evening.", speaker="serena", **SAMPLE)
    assert sum(c.num_frames for c in stream) > 0
    with pytest.raises(RuntimeError, match="read already"):
        next(iter(stream))

    async def twice():
        again = custom.astream("Good evening.", speaker="serena", **SAMPLE)
        assert [c async for c in again]
        return [c async for c in again]

    with pytest.raises(RuntimeError, match="read already"):
        asyncio.run(twice())


def test_an_astream_closed_before_its_first_iteration_submits_nothing(custom, monkeypatch):
    stream = custom.astream("Good evening.", speaker="serena", **SAMPLE)  # (no running loop: submitted when read)
    stream.close()

    def refuse(*args, **kwargs):
        raise AssertionError("a closed stream submitted its request")

    monkeypatch.setattr(custom, "submit_pieces", refuse)

    async def read():
        return [c async for c in stream]

    assert asyncio.run(read()) == []
    with pytest.raises(RuntimeError, match="closed before its request was submitted"):
        _ = stream.frames


def test_stream_ending_on_eos(tmp_path):
    """A request that ends on its own (EOS) streams exactly its offline frames (the EOS frame never reaches
    the codec)."""
    import shutil

    from safetensors.torch import load_file, save_file

    folder = shutil.copytree(tiny_checkpoint("tiny"), tmp_path / "eos")
    tensors = load_file(folder / "model.safetensors")
    tensors["talker.codec_head.weight"][2150] *= 40.0  # EOS becomes likely after the first 2 steps
    save_file(tensors, folder / "model.safetensors")
    tts = TTS.from_pretrained(folder, device="cpu")
    kwargs = {"speaker": "ryan", "max_new_tokens": 60, "seed": 1}
    offline = tts.synthesize("Hello world, how are you today?", **kwargs)
    assert 2 * 1920 <= offline.shape[0] < 59 * 1920  # ended by EOS, not by the length limit
    audio = np.concatenate([c.pcm for c in tts.stream("Hello world, how are you today?", **kwargs)])
    assert audio.shape == offline.shape and float(np.abs(audio - offline).max()) < 1e-5
