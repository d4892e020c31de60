"""The server's incremental audio encoders and time stretch, on their own (no model, no server)."""

from __future__ import annotations

import io
import struct

import av
import numpy as np
import pytest
import soundfile as sf

pytest.importorskip("fastapi")

from q3tts.server.audio_encoding import FORMATS, make_encoder  # noqa: E402
from q3tts.server.time_stretch import atempo_factors  # noqa: E402

SR = 24000
FRAME = 1920


def _speechlike(num_frames: int) -> list[np.ndarray]:
    t = np.arange(num_frames * FRAME) / SR
    wav = (0.3 * np.sin(2 * np.pi * 220 * t) * (1 + 0.5 * np.sin(2 * np.pi * 3 * t))).astype(np.float32)
    return np.split(wav, num_frames)


def _encode(fmt: str, frames: list[np.ndarray], speed: float = 1.0) -> list[bytes]:
    encoder = make_encoder(fmt, SR, speed)
    return [encoder.encode(f) for f in frames] + [encoder.flush()]


def _decode(data: bytes) -> tuple[np.ndarray, int]:
    container = av.open(io.BytesIO(data))
    frames = list(container.decode(audio=0))
    pcm = np.concatenate([f.to_ndarray().reshape(f.samples, -1)[:, 0] for f in frames])
    return pcm, frames[0].sample_rate


@pytest.mark.parametrize("num_frames", [1, 10])
@pytest.mark.parametrize("fmt", [f for f in FORMATS if f != "pcm"])
def test_every_format_decodes_to_the_right_duration(fmt, num_frames):
    """With PyAV (ffmpeg) and, for every format libsndfile knows (all but AAC), with soundfile; the shortest
    response the server sends (one 80 ms frame) included."""

    parts = _encode(fmt, _speechlike(num_frames))
    pcm, rate = _decode(b"".join(parts))
    seconds = len(pcm) / rate
    assert rate == (48000 if fmt == "opus" else SR)  # libopus decodes at 48 kHz; the stream says 24 kHz
    assert abs(seconds - num_frames * 0.08) <= 0.08, seconds
    if fmt != "aac":
        wav, rate = sf.read(io.BytesIO(b"".join(parts)))
        assert rate == SR and abs(len(wav) / SR - num_frames * 0.08) <= 0.08, len(wav)
    if fmt == "flac":  # sent whole: its header must carry the sample count
        assert not any(parts[:-1]) and sf.info(io.BytesIO(parts[-1])).frames == num_frames * FRAME
    elif num_frames == 10:
        assert sum(1 for p in parts if p) >= 3, "the encoder must emit bytes as it goes, not only at the end"


def test_pcm_is_exact_16_bit_little_endian():
    """pcm and wav carry rint(x * 32768), clipped: the samples soundfile writes in a 16-bit FLAC of the same float
    audio (FFmpeg's conversion too), within 1 LSB of its 16-bit WAV (which floors); they were once round(x * 32767),
    2 LSB off near full scale and -1.0 as -32767."""
    frames = _speechlike(3)
    frames[0][:6] = [1.0, -1.0, 1.5, -1.5, 0.5 / 32768, -1e-15]  # (full scale and beyond: clipped)
    audio = np.concatenate(frames)
    written = {}
    for fmt in ("FLAC", "WAV"):
        data = io.BytesIO()
        sf.write(data, audio, 24000, format=fmt, subtype="PCM_16")
        written[fmt] = sf.read(io.BytesIO(data.getvalue()), dtype="int16")[0].astype("<i2")
    expected = written["FLAC"]
    assert b"".join(_encode("pcm", frames)) == expected.tobytes()
    assert np.abs(expected.astype(int) - written["WAV"]).max() == 1
    assert b"".join(_encode("wav", frames))[44:] == expected.tobytes()


def test_wav_is_a_streaming_header_then_exact_pcm():
    frames = _speechlike(3)
    parts = _encode("wav", frames)
    data = b"".join(parts)
    assert data[:4] == b"RIFF" and data[8:16] == b"WAVEfmt " and len(parts[0]) == 44 + 2 * FRAME
    channels, rate, bits = struct.unpack("<H", data[22:24])[0], struct.unpack("<I", data[24:28])[0], data[34]
    assert (channels, rate, bits) == (1, SR, 16)
    assert data[44:] == b"".join(_encode("pcm", frames))
    pcm, decoded_rate = _decode(data)
    assert decoded_rate == SR and np.array_equal(pcm, np.frombuffer(data[44:], dtype="<i2"))


def test_wav_of_no_audio_is_still_a_valid_header():
    assert len(b"".join(_encode("wav", []))) == 44


@pytest.mark.parametrize("speed", [0.25, 0.5, 1.5, 2.0, 4.0])
def test_speed_stretches_the_duration_and_streams(speed):
    frames = _speechlike(25)
    parts = _encode("pcm", frames, speed)
    samples = len(b"".join(parts)) // 2
    assert abs(samples - 25 * FRAME / speed) <= 0.02 * 25 * FRAME / speed + 200
    assert sum(1 for p in parts[:-1] if p) >= 10


@pytest.mark.parametrize("speed", [0.25, 0.3, 0.5, 0.75, 1.25, 1.5, 2.0, 3.0, 4.0])
def test_speed_keeps_the_end_of_the_audio(speed):
    """atempo's end of stream emits its last fragment only, which at slow speeds stopped 16-55 ms short of the
    end (0.75 / 0.5 / 0.25). The output is `len / speed` to the sample, and the audio runs to its last ms."""
    rng = np.random.default_rng(0)
    noisy = [f + 0.05 * rng.standard_normal(FRAME).astype(np.float32) for f in _speechlike(25)]
    for chunks in (_speechlike(25), noisy, np.split(np.concatenate(noisy), 5)):
        out = np.frombuffer(b"".join(_encode("pcm", chunks, speed)), dtype="<i2")
        assert abs(len(out) - 25 * FRAME / speed) <= 0.003 * SR, (len(out) - 25 * FRAME / speed) / SR
        last_sound = np.flatnonzero(np.abs(out) > 100)[-1]
        assert len(out) - last_sound <= 0.02 * SR, (len(out) - last_sound) / SR


def test_speed_keeps_the_pitch():
    """Time stretch, not resampling: the dominant frequency stays at 220 Hz."""
    t = np.arange(25 * FRAME) / SR
    tone = (0.3 * np.sin(2 * np.pi * 220 * t)).astype(np.float32)
    out = np.frombuffer(b"".join(_encode("pcm", np.split(tone, 25), 2.0)), dtype="<i2").astype(np.float32)
    spectrum = np.abs(np.fft.rfft(out * np.hanning(len(out))))
    assert abs(np.argmax(spectrum) * SR / len(out) - 220) < 5


def test_atempo_factors_stay_in_range():
    for speed in (0.25, 0.3, 0.5, 1.0, 2.5, 4.0):
        factors = atempo_factors(speed)
        assert all(0.5 <= f <= 2.0 for f in factors) and abs(np.prod(factors) - speed) < 1e-9
    with pytest.raises(ValueError):
        atempo_factors(5.0)


def test_unknown_format_is_refused():
    with pytest.raises(ValueError, match="unsupported response_format"):
        make_encoder("ogg", SR)


def test_a_streamed_wav_is_open_ended_and_a_whole_one_has_its_true_sizes():
    """Streamed: RIFF and data sizes 0xFFFFFFFF, the standard "until the data ends" (0xFFFFFFDB read as 24.9 hours
    to Python's wave, and a strict reader failed at the end: "data chunk ended before its declared size"). Whole
    (the WebSocket's one file per segment): the true sizes."""
    import wave

    streamed = b"".join(_encode("wav", _speechlike(2)))
    assert struct.unpack("<I", streamed[4:8]) == struct.unpack("<I", streamed[40:44]) == (0xFFFFFFFF,)
    encoder = make_encoder("wav", SR, whole=True)
    assert [encoder.encode(f) for f in _speechlike(2)] == [b"", b""]
    whole = encoder.flush()
    assert struct.unpack("<II", whole[4:8] + whole[40:44]) == (len(whole) - 8, len(whole) - 44)
    assert whole[44:] == streamed[44:]
    with wave.open(io.BytesIO(whole)) as wav:
        assert (wav.getnframes(), wav.getframerate()) == (2 * FRAME, SR)


@pytest.mark.parametrize("rate", [8000, 16000, 22050, 44100, 48000])
@pytest.mark.parametrize("speed", [1.0, 2.0])
def test_resampling_streams_every_sample(rate, speed):
    """`sample_rate`: soxr's stream, after the time stretch: round(n x rate / 24000 / speed) samples in all, out
    as the audio comes, the tone kept."""
    encoder = make_encoder("pcm", SR, speed, out_rate=rate)
    parts = [encoder.encode(f) for f in _speechlike(10)] + [encoder.flush()]
    pcm = np.frombuffer(b"".join(parts), dtype="<i2")
    assert abs(len(pcm) - round(10 * FRAME * rate / SR / speed)) <= 1 and sum(1 for p in parts if p) >= 5
    spectrum = np.abs(np.fft.rfft(pcm[len(pcm) // 4: 3 * len(pcm) // 4]))
    assert abs(np.argmax(spectrum) * rate / (len(pcm) // 2) - 220) < 10  # (the pitch kept: 220 Hz)


def test_volume_scales_before_encoding():
    loud, quiet = (np.frombuffer(b"".join(make_encoder("pcm", SR, volume=v).encode(f) for f in _speechlike(2)),
                                 dtype="<i2").astype(int) for v in (1.0, 0.25))
    assert np.abs(loud - 4 * quiet).max() <= 4 and np.abs(loud).max() > 5000
