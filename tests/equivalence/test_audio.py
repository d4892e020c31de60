"""Reference-audio input: loading, mono, resampling and the mel front end against the official path (librosa);
clear errors for unusable audio."""

from __future__ import annotations

import base64
import functools
import http.server
import io
import json
import threading
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf
import torch

import q3tts.request.audio
from q3tts.errors import RequestError
from q3tts.models.mel import mel_filterbank, mel_spectrogram
from q3tts.request.audio import AudioError, load_audio, resample, to_mono_24k

RESAMPLE_CASES = [  # (sample rate, shape with time last, dtype)
    (16000, (20817,), np.float32),
    (44100, (57331,), np.float32),
    (48000, (62400,), np.float32),
    (22050, (28665,), np.float32),
    (8000, (10401,), np.float32),
    (44100, (2, 30011), np.float32),
    (16000, (3, 9001), np.float64),
]
MEL_LENGTHS = [385, 1000, 1280, 4801, 48123]


def voice(num_samples: int, sr: int, seed: int, channels: int = 0) -> np.ndarray:
    """A speech-like test signal (voiced harmonics with a syllable envelope, plus noise), peak about 0.5."""
    rng = np.random.default_rng(seed)
    t = np.arange(num_samples) / sr
    f0 = 110 + 40 * rng.random() + 15 * np.sin(2 * np.pi * 3 * t)
    phase = 2 * np.pi * np.cumsum(f0) / sr
    tone = sum(np.sin(k * phase + rng.random() * 6) / k for k in range(1, 12))
    envelope = 0.5 + 0.5 * np.sin(2 * np.pi * 4 * t + rng.random() * 6) ** 2
    wav = 0.15 * tone * envelope + 0.02 * rng.standard_normal(num_samples)
    if channels:
        wav = np.stack([wav * (1 - 0.3 * c) + 0.01 * rng.standard_normal(num_samples) for c in range(channels)], 1)
    return wav


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args) -> None:
        pass


@pytest.fixture(scope="module")
def http_root(tmp_path_factory):
    """A local http server (no network needed) serving a folder: yields (folder, base URL)."""
    root = tmp_path_factory.mktemp("served")
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(_QuietHandler, directory=root))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield root, f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def _write_files(root: Path, served: Path) -> dict[str, Path]:
    files = {
        "pcm16_16k.wav": (voice(17000, 16000, 1), 16000, "PCM_16"),
        "float_44k.wav": (voice(50000, 44100, 2), 44100, "FLOAT"),
        "mono_48k.flac": (voice(60000, 48000, 3), 48000, "PCM_24"),
        "stereo_22k.wav": (voice(30000, 22050, 4, channels=2), 22050, "PCM_16"),
        "mono_48k.ogg": (voice(40000, 48000, 5), 48000, "VORBIS"),
    }
    paths = {}
    for name, (wav, sr, subtype) in files.items():
        paths[name] = root / name
        sf.write(paths[name], wav, sr, subtype=subtype)
    (served / "float_44k.wav").write_bytes(paths["float_44k.wav"].read_bytes())
    return paths


def _write_arrays(root: Path) -> dict[str, list]:
    """Saves the resampling and mel inputs; returns their part of the oracle's cases.json."""
    for i, (sr, shape, dtype) in enumerate(RESAMPLE_CASES):
        rows = [voice(shape[-1], sr, 10 * i + c) for c in range(shape[0] if len(shape) == 2 else 1)]
        np.save(root / f"resample_{i}.npy", np.stack(rows).reshape(shape).astype(dtype))
    mels = [voice(n, 24000, 20 + i)[None] for i, n in enumerate(MEL_LENGTHS)]
    mels.append(np.stack([voice(3000, 24000, s) for s in (30, 31)]))  # a batch of two
    for i, wav in enumerate(mels):
        np.save(root / f"mel_{i}.npy", wav.astype(np.float32))
    return {"resample": [{"input": f"resample_{i}.npy", "sr": sr, "target_sr": 24000}
                         for i, (sr, _, _) in enumerate(RESAMPLE_CASES)],
            "mel": [f"mel_{i}.npy" for i in range(len(mels))]}


def _write_sources(root: Path, paths: dict[str, Path], base_url: str) -> list[dict]:
    """Saves the loader inputs that are not files; returns the oracle's load cases."""
    (root / "b64.txt").write_text(base64.b64encode(paths["pcm16_16k.wav"].read_bytes()).decode())
    data_url = "data:audio/wav;base64," + base64.b64encode(paths["stereo_22k.wav"].read_bytes()).decode()
    (root / "dataurl.txt").write_text(data_url)
    np.save(root / "stereo_44k.npy", voice(40000, 44100, 6, channels=2).astype(np.float32))
    np.save(root / "mono_24k.npy", voice(30000, 24000, 7).astype(np.float32))
    return [*({"kind": "str", "text": str(path)} for path in paths.values()),
            {"kind": "str", "text_file": "dataurl.txt"},
            {"kind": "str", "text": f"{base_url}/float_44k.wav"},
            {"kind": "tuple", "array": "stereo_44k.npy", "sr": 44100},
            {"kind": "tuple", "array": "mono_24k.npy", "sr": 24000}]


@pytest.fixture(scope="module")
def official(oracle, tmp_path_factory, http_root):
    """Runs every official audio check in one oracle process; yields (folder, cases, file paths, outputs)."""
    root = tmp_path_factory.mktemp("audio_oracle")
    served, base_url = http_root
    paths = _write_files(root, served)
    cases = {**_write_arrays(root), "load": _write_sources(root, paths, base_url)}
    (root / "cases.json").write_text(json.dumps(cases))
    oracle.run("speaker_audio.py", root)
    with np.load(root / "out.npz") as out:
        yield root, cases, paths, dict(out)


def _source(root: Path, case: dict):
    if case["kind"] == "tuple":
        return np.load(root / case["array"]), case["sr"]
    return (root / case["text_file"]).read_text() if "text_file" in case else case["text"]


def test_filterbank_equals_librosa(official):
    _, _, _, out = official
    ours = mel_filterbank()
    assert ours.dtype == np.float32 and ours.shape == (128, 513)
    np.testing.assert_array_equal(ours, out["filterbank"])


def test_mel_spectrogram_matches_official(official):
    root, cases, _, out = official
    for i, name in enumerate(cases["mel"]):
        wav = np.load(root / name)
        ours = mel_spectrogram(torch.from_numpy(wav)).numpy()
        ref = out[f"mel_{i}"]
        assert ours.shape == ref.shape == (wav.shape[0], wav.shape[1] // 256, 128)
        scale = np.abs(ref).max()
        assert np.abs(ours - ref).max() <= 1e-5 * scale, (name, np.abs(ours - ref).max())


def test_resample_matches_librosa(official):
    root, cases, _, out = official
    for i, case in enumerate(cases["resample"]):
        y = np.load(root / case["input"])
        ours = resample(y, case["sr"], case["target_sr"])
        ref = out[f"resample_{i}"]
        assert ours.dtype == ref.dtype == y.dtype and ours.shape == ref.shape
        np.testing.assert_array_equal(ours, ref, err_msg=str(case))


def test_load_audio_matches_official(official):
    root, cases, _, out = official
    for i, case in enumerate(cases["load"]):
        wav, sr = load_audio(_source(root, case))
        assert sr == int(out[f"load_sr_{i}"]), case
        assert wav.dtype == np.float32 and wav.ndim == 1
        np.testing.assert_array_equal(wav, out[f"load_{i}"], err_msg=str(case))
        wav24 = to_mono_24k(_source(root, case))
        np.testing.assert_array_equal(wav24, out[f"load24k_{i}"], err_msg=str(case))
        if case.get("array") == "stereo_44k.npy":  # official bug: the model's loader crashes on 2-D arrays
            assert "does not support item assignment" in str(out[f"load_error_{i}"])
        if f"tokenizer24k_{i}" in out:  # the speech tokenizer's own loader takes the same route
            np.testing.assert_array_equal(wav24, out[f"tokenizer24k_{i}"], err_msg=str(case))


def test_load_audio_other_routes_match_official(official):
    """Routes the official API lacks (Path objects, raw bytes, torch tensors) give what its nearest route gives."""
    root, cases, paths, out = official
    index = {case.get("text"): i for i, case in enumerate(cases["load"])}
    for name in ("pcm16_16k.wav", "stereo_22k.wav", "mono_48k.flac"):
        i = index[str(paths[name])]
        for source in (paths[name], paths[name].read_bytes()):
            wav, sr = load_audio(source)
            assert sr == int(out[f"load_sr_{i}"])
            np.testing.assert_array_equal(wav, out[f"load_{i}"])
    # Raw base64 nearly always holds "/", which the official loader takes for a path (and fails on).
    i = index[str(paths["pcm16_16k.wav"])]
    for text in ((root / "b64.txt").read_text(), base64.encodebytes(paths["pcm16_16k.wav"].read_bytes()).decode()):
        assert "/" in text
        wav, sr = load_audio(text)
        assert sr == int(out[f"load_sr_{i}"])
        np.testing.assert_array_equal(wav, out[f"load_{i}"])
    i = next(i for i, case in enumerate(cases["load"]) if case.get("array") == "stereo_44k.npy")
    wav, sr = load_audio((torch.from_numpy(np.load(root / "stereo_44k.npy")), 44100))
    np.testing.assert_array_equal(wav, out[f"load_{i}"])


def test_resample_same_rate_is_identity():
    y = voice(1000, 24000, 0).astype(np.float32)
    assert resample(y, 24000, 24000) is y
    assert to_mono_24k((y, 24000)).dtype == np.float32


# ------------------------------------------------------------------------------------------------ errors


def _raises(source, *fragments: str) -> str:
    with pytest.raises(AudioError) as info:
        load_audio(source)
    message = str(info.value)
    for fragment in fragments:
        assert fragment in message, message
    return message


def test_audio_error_is_a_request_error_naming_ref_audio():
    """As README says: bad reference audio raises q3tts.RequestError (a ValueError) whose .param names it."""
    assert issubclass(AudioError, RequestError) and issubclass(AudioError, ValueError)
    with pytest.raises(RequestError) as info:
        load_audio(b"not audio at all")
    assert isinstance(info.value, AudioError)
    assert (info.value.param, info.value.code) == ("ref_audio", "invalid_value")


def test_missing_file_names_the_path(tmp_path, monkeypatch):
    missing = tmp_path / "nope.wav"
    _raises(str(missing), "not found", str(missing))
    _raises(missing, "not found", str(missing))
    monkeypatch.chdir(tmp_path)  # a relative name, in a folder known to be empty (not wherever pytest runs)
    _raises("hello.wav", "not found", "hello.wav", "base64")


def test_unreadable_file_names_the_path(tmp_path):
    bad = tmp_path / "garbage.wav"
    bad.write_bytes(b"this is not a RIFF file at all" * 10)
    _raises(str(bad), str(bad), "not a readable audio file")
    _raises(tmp_path, "is a folder", str(tmp_path))


def test_unreadable_bytes():
    message = _raises(b"definitely not audio", "audio bytes", "not a readable audio file", "Format not recognised")
    assert "BytesIO" not in message  # (soundfile's own words name the in-memory file object)
    _raises(b"", "0 bytes")


def test_bad_base64_and_data_url():
    _raises("a" * 301, "neither an existing file nor valid base64")  # long and slash-free: taken as base64
    _raises(base64.b64encode(b"not audio, just text " * 20).decode(), "base64 audio", "not a readable audio file")
    _raises("data:audio/wav,plain-text", "data:audio/wav;base64,")
    _raises("data:audio/wav;base64,", "0 bytes")


def test_unreachable_url():
    _raises("http://127.0.0.1:1/voice.wav", "could not download", "http://127.0.0.1:1/voice.wav")


def test_url_not_found(http_root):
    _, base_url = http_root
    _raises(f"{base_url}/missing.wav", "could not download", "404")


def test_empty_audio(tmp_path):
    empty = tmp_path / "empty.wav"
    sf.write(empty, np.zeros(0, np.float32), 16000)
    _raises(str(empty), "empty (0 samples)", str(empty))
    _raises((np.zeros(0, np.float32), 16000), "empty (0 samples)")


def test_silent_audio(tmp_path):
    silent = tmp_path / "silent.wav"
    sf.write(silent, np.zeros(16000, np.float32), 16000, subtype="PCM_16")
    _raises(str(silent), "silent", str(silent))
    _raises((np.full(8000, 1e-8, np.float32), 8000), "silent", "audible speech")
    left = voice(8000, 8000, 0)
    _raises((np.stack([left, -left], 1), 8000), "silent")  # cancels out in the mono down-mix


def test_non_finite_audio():
    for bad in (np.nan, np.inf, -np.inf):
        wav = voice(8000, 16000, 0).astype(np.float32)
        wav[100] = bad
        _raises((wav, 16000), "NaN or infinite")


def test_bad_sample_rate():
    wav = voice(8000, 16000, 0)
    for sr in (0, -16000, 22050.5, "fast", None):
        _raises((wav, sr), "sample rate must be")


def test_bare_array_needs_a_sample_rate():
    message = _raises(voice(8000, 16000, 0), "pass a tuple (audio, sr)")
    assert message == "For numpy waveform input, pass a tuple (audio, sr)."  # the official wording
    _raises(torch.zeros(100), "pass a tuple (audio, sr)")


def test_bad_array_shapes_and_types():
    _raises((voice(8000, 16000, 0, channels=2).T, 16000), "channels-last", "(2, 8000)")
    _raises((np.zeros((2, 3, 4)), 16000), "1-D", "(2, 3, 4)")
    _raises((np.array(["a", "b"]), 16000), "real numbers")
    _raises((np.zeros(10),), "(array, sample_rate)")
    _raises(3.5, "unsupported audio input", "float")


def test_mel_spectrogram_rejects_too_short_audio():
    with pytest.raises(AudioError, match="too short"):
        mel_spectrogram(torch.zeros(1, 384))
    assert mel_spectrogram(torch.zeros(1, 385)).shape == (1, 1, 128)


def test_sample_rates_and_lengths_beyond_any_voice_reference_are_refused():
    """A sample rate of 1 Hz made a second of samples into 6.7 hours to resample and encode, and a few compressed
    megabytes can hold hours: both are refused before any work (a file's length from its header, unread)."""
    tone = (0.3 * np.sin(np.arange(2000) / 5)).astype(np.float32)
    _raises((tone, 1), "sample rate 1 Hz is outside 1000..768000 Hz")
    _raises((tone, 10**7), "outside 1000..768000 Hz")
    long = io.BytesIO()
    sf.write(long, np.resize(tone, 601 * 1000), 1000, format="WAV")
    _raises(long.getvalue(), "audio bytes: 601 s of audio; a voice reference may be at most 600 s")
    _raises((np.resize(tone, 601 * 1000), 1000), "audio array: 601 s of audio")
    wav, sr = load_audio((np.resize(tone, 600 * 1000), 1000))  # the limit itself is fine
    assert sr == 1000 and wav.shape == (600 * 1000,)


def test_a_file_at_a_sample_rate_beyond_any_voice_reference_is_named(tmp_path):
    """Its rate is refused from the header, before its length is judged at that rate (a 1 Hz file of 2,000
    samples would otherwise read as 33 minutes of audio), and the message names the file."""
    slow = tmp_path / "slow.wav"
    sf.write(slow, (0.3 * np.sin(np.arange(2000) / 5)).astype(np.float32), 1, format="WAV")
    _raises(str(slow), f"{slow}: sample rate 1 Hz is outside 1000..768000 Hz")


def tone_flac(seconds: int, sample_rate: int, channels: int) -> bytes:
    """A FLAC file of a constant level: a few hundred bytes a second, however many samples it decodes to."""
    out = io.BytesIO()
    second = np.full((sample_rate, channels), 1000, dtype=np.int16)
    with sf.SoundFile(out, "w", sample_rate, channels, format="FLAC", subtype="PCM_16") as f:
        for _ in range(seconds):
            f.write(second)
    return out.getvalue()


def test_audio_that_decodes_to_too_many_samples_is_refused_unread(monkeypatch):
    """Within 600 s and 768 kHz, a file can still decode to far too much (a 222 KB FLAC of 599 s at 96 kHz
    stereo took ~3 GB): frames x channels beyond 600 s of 48 kHz mono are refused from the header, unread."""
    flac = tone_flac(160, 96_000, 2)  # 30.7 M samples in 58 KB
    monkeypatch.setattr(sf.SoundFile, "read", lambda *args, **kwargs: pytest.fail("decoded"))
    limit = "a voice reference may hold at most 28800000 (600 s of mono at 48 kHz"
    _raises(flac, "audio bytes: 160 s of 2-channel audio at 96000 Hz is 30720000 samples", limit)
    _raises(base64.b64encode(flac).decode(), "base64 audio: 160 s of 2-channel audio", limit)
    stereo = np.broadcast_to(np.float32(0.1), (14_400_001, 2))  # 300 s at 48 kHz, no memory behind it
    _raises((stereo, 48_000), "audio array: 300 s of 2-channel audio at 48000 Hz is 28800002 samples", limit)


def test_the_decoded_samples_limit_counts_every_channel(monkeypatch):
    monkeypatch.setattr(q3tts.request.audio, "MAX_REFERENCE_SAMPLES", 4000)
    tone = (0.3 * np.sin(np.arange(2000) / 5)).astype(np.float32)
    wav, sr = load_audio((np.stack([tone, tone], axis=1), 16000))  # 4,000 samples: the limit itself is fine
    assert (sr, wav.shape) == (16000, (2000,))
    _raises((np.stack([tone, tone, tone], axis=1), 16000), "is 6000 samples", "at most 4000")
    file = io.BytesIO()
    sf.write(file, np.resize(tone, 4001), 16000, format="WAV")
    _raises(file.getvalue(), "audio bytes: 0 s of 1-channel audio at 16000 Hz is 4001 samples")
