"""Reference-audio input: loading (path, bytes, base64, URL, array), mono down-mix, resampling.

Everything here reproduces the official `qwen_tts` 0.1.1 input path without librosa: `resample` is
`librosa.resample` (soxr_hq, then `fix_length`). (The speaker encoder's mel front end is
`q3tts.models.mel`.) Bad input raises `AudioError` with a
message that says what was wrong, before any model runs.
"""

from __future__ import annotations

import base64
import binascii
import io
import math
import os
import re
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import numpy as np
import soundfile as sf
import soxr
import torch

from ..errors import AudioError
from .fetch import FetchError, FetchPolicy, fetch

SILENCE_THRESHOLD = 1e-6  # peak |x| below this carries no voice to clone
MIN_SAMPLE_RATE, MAX_SAMPLE_RATE = 1000, 768_000  # Hz: outside, a mistake (sample rate 1 made 24,000 samples 6.7 h)
MAX_REFERENCE_SECONDS = 600  # a voice reference's length (an in-context one must also fit the context: ~43 min)
# Samples (frames x channels) a reference may decode to: 600 s of 48 kHz mono, 115 MB as float32. Seconds alone do not
# bound it: a 222 KB FLAC of a tone (599 s, 96 kHz, stereo) took ~3 GB to decode and mix down.
MAX_REFERENCE_SAMPLES = MAX_REFERENCE_SECONDS * 48_000
URL_TIMEOUT_S = 30.0

def to_int16(pcm: np.ndarray) -> np.ndarray:
    """Float audio as 16-bit samples (little-endian): rint(x * 32768), clipped, as FFmpeg converts and as soundfile
    writes a 16-bit FLAC (its 16-bit WAV floors instead: at most 1 LSB apart). The server's pcm / wav / flac bytes and
    `stream(pcm_format="int16")`. (Per 80 ms chunk of every stream, in the server's event loop: kept to three
    float32 passes; perf-notes 104-105.)"""
    wide = np.multiply(pcm, np.float32(32768.0), dtype=np.float32)
    np.rint(wide, out=wide)
    np.clip(wide, -32768.0, 32767.0, out=wide)
    return wide.astype("<i2")


# ----------------------------------------------------------------------------------------------- loading


def load_audio(source: Any) -> tuple[np.ndarray, int]:
    """Reads reference audio into `(float32 mono waveform [N], sample_rate)`, as the official loader does.

    `source` is a file path (str or Path), a file's raw bytes, a base64 string or `data:audio/...;base64,...`
    URL, an http(s) URL, or an `(array, sr)` tuple whose array (numpy or torch) is 1-D or channels-last 2-D.
    Channels are averaged. Integer arrays are converted as they are, not scaled to ±1 (as official). Raises
    `AudioError` for anything unusable.
    """
    if isinstance(source, tuple):
        wav, sr = _from_tuple(source)
    elif isinstance(source, (bytes, bytearray, memoryview)):
        wav, sr = _read_bytes(bytes(source), "audio bytes")
    elif isinstance(source, os.PathLike):
        wav, sr = _read_file(Path(source))
    elif isinstance(source, str):
        wav, sr = _from_string(source)
    elif isinstance(source, (np.ndarray, torch.Tensor)):
        raise AudioError("For numpy waveform input, pass a tuple (audio, sr).")
    else:
        raise AudioError(f"unsupported audio input of type {type(source).__name__}: pass a file path, URL, "
                         "base64 string, raw file bytes, or an (array, sample_rate) tuple")
    return _checked(_to_mono(wav), sr, _describe(source))


def resample(wav: np.ndarray, sr: int, target_sr: int) -> np.ndarray:
    """`librosa.resample(wav, orig_sr=sr, target_sr=target_sr)` with librosa 0.11 defaults, bit for bit.

    Time is the last axis (any leading axes are channels, as in librosa). soxr "HQ" resamples each row, then
    the length is cut or zero-padded to `ceil(n * target_sr / sr)` and the input dtype is kept.
    """
    if not np.issubdtype(wav.dtype, np.floating):
        raise AudioError(f"resample needs floating-point samples, got {wav.dtype}")
    if wav.ndim == 0:
        raise AudioError("resample needs at least one dimension of samples")
    if not np.isfinite(wav).all():
        raise AudioError("audio contains NaN or infinite samples")
    if sr <= 0 or target_sr <= 0:
        raise AudioError(f"sample rates must be positive, got {sr} -> {target_sr}")
    if sr == target_sr:
        return wav
    n_samples = int(np.ceil(wav.shape[-1] * (float(target_sr) / sr)))
    # Row by row through apply_along_axis, exactly as librosa calls soxr (its output depends on the memory layout
    # soxr sees, so the call must match, not just the algorithm).
    out = np.apply_along_axis(soxr.resample, axis=-1, arr=wav, in_rate=sr, out_rate=target_sr, quality="soxr_hq")
    return np.asarray(_fix_length(out, n_samples), dtype=wav.dtype)


def to_mono_24k(source: Any, target_sr: int = 24000) -> np.ndarray:
    """Loads `source` (see `load_audio`) and resamples it to `target_sr`: float32 mono `[N]`."""
    wav, sr = load_audio(source)
    return resample(wav, sr, target_sr).astype(np.float32, copy=False)


def _from_tuple(source: tuple) -> tuple[np.ndarray, int]:
    if len(source) != 2:
        raise AudioError(f"an audio tuple must be (array, sample_rate), got {len(source)} items")
    array, sr = source
    if isinstance(array, torch.Tensor):
        array = array.detach().to("cpu", torch.float32).numpy()
    array = np.asarray(array)
    if not (np.issubdtype(array.dtype, np.floating) or np.issubdtype(array.dtype, np.integer)):
        raise AudioError(f"audio array must hold real numbers, got dtype {array.dtype}")
    if array.ndim not in (1, 2):
        raise AudioError(f"audio array must be 1-D [samples] or 2-D [samples, channels], got shape {array.shape}")
    if array.ndim == 2 and 0 < array.shape[0] < array.shape[1]:
        raise AudioError(f"2-D audio must be channels-last [samples, channels], got shape {array.shape}; "
                         "transpose it")
    sr = _sample_rate(sr)
    _check_length(array.shape[0], array.shape[1] if array.ndim == 2 else 1, sr, "audio array")
    return array.astype(np.float32), sr


def _sample_rate(sr: Any) -> int:
    try:
        value = float(sr)
    except (TypeError, ValueError):
        raise AudioError(f"sample rate must be a number, got {sr!r}") from None
    if isinstance(sr, bool) or not math.isfinite(value) or value <= 0 or not value.is_integer():
        raise AudioError(f"sample rate must be a positive integer (Hz), got {sr!r}")
    if not MIN_SAMPLE_RATE <= value <= MAX_SAMPLE_RATE:
        raise AudioError(f"sample rate {int(value)} Hz is outside {MIN_SAMPLE_RATE}..{MAX_SAMPLE_RATE} Hz")
    return int(value)


def _from_string(text: str) -> tuple[np.ndarray, int]:
    # Same decisions, in the same order, as the official `_load_audio_to_np`: URL, then base64, then path.
    if not text.strip():  # (as a path, "" is the current folder)
        raise AudioError("the reference audio is an empty string (give a file path, a URL or base64 audio)")
    if _is_url(text):
        return _read_bytes(_fetch(text), f"audio at {text}")
    if _is_probably_base64(text):
        return _read_bytes(_decode_base64(text), "base64 audio")
    path = _existing_path(text)
    if path is not None:
        return _read_file(path)
    if _BASE64_TEXT.fullmatch(text):
        # Official quirk: raw base64 holding "/" (almost any real file) is taken for a path and fails; decode it.
        return _read_bytes(_decode_base64(text), "base64 audio")
    raise AudioError(f"audio file not found: {_short(text)!r} (a string is read as a file path, an http(s) URL, "
                     "a data:audio/...;base64,... URL, or a base64-encoded audio file)")


def _existing_path(text: str) -> Path | None:
    try:
        path = Path(text).expanduser()
        return path if path.exists() else None
    except (OSError, ValueError, RuntimeError):  # name too long, NUL byte, unknown user in ~name
        return None


def _short(text: str, limit: int = 160) -> str:
    return text if len(text) <= limit else f"{text[:limit - 20]}...({len(text)} characters)"


def _is_url(text: str) -> bool:
    try:
        url = urlparse(text)
    except ValueError:
        return False
    return url.scheme in ("http", "https") and bool(url.netloc)


_BASE64_TEXT = re.compile(r"[A-Za-z0-9+/\s]{256,}={0,2}\s*")


def _is_probably_base64(text: str) -> bool:
    # The official heuristic (a long string without path separators, or a data URL: official takes only
    # "data:audio", any other data URL would fail as a path there; here it gets a clear error if not base64).
    return text.startswith("data:") or ("/" not in text and "\\" not in text and len(text) > 256)


def _decode_base64(text: str) -> bytes:
    payload = text
    if text.strip().startswith("data:"):
        header, sep, payload = text.partition(",")
        if not sep or ";base64" not in header:
            raise AudioError(f"a data URL must look like data:audio/wav;base64,<data>; got {_short(text)!r}")
    try:
        data = base64.b64decode(payload)  # not validating, as official: stray characters are skipped
    except (binascii.Error, ValueError) as e:
        raise AudioError(f"string is neither an existing file nor valid base64 audio ({e}): {_short(text)!r}") from e
    if not data:
        raise AudioError("base64 audio decodes to 0 bytes")
    return data


def _fetch(url: str) -> bytes:
    try:
        return fetch(url, FetchPolicy(timeout_s=URL_TIMEOUT_S))
    except FetchError as e:
        raise AudioError(str(e)) from e


def _read_bytes(data: bytes, what: str) -> tuple[np.ndarray, int]:
    if not data:
        raise AudioError(f"{what}: 0 bytes, not an audio file")
    with io.BytesIO(data) as f:
        return _read_sound(f, what)


def _read_file(path: Path) -> tuple[np.ndarray, int]:
    if not path.is_file():
        what = "audio path is a folder, not a file" if path.is_dir() else "audio file not found"
        raise AudioError(f"{what}: {str(path)!r}")
    return _read_sound(str(path), str(path))


def _read_sound(file: Any, what: str) -> tuple[np.ndarray, int]:
    """`sf.read(file, dtype="float32", always_2d=False)`, once the header says the length and the decoded size are
    acceptable (a few compressed kilobytes can hold hours)."""
    try:
        with sf.SoundFile(file) as f:
            try:
                _sample_rate(f.samplerate)
            except AudioError as e:
                raise AudioError(f"{what}: {e}") from None
            _check_length(f.frames, f.channels, f.samplerate, what)
            return f.read(dtype="float32", always_2d=False), f.samplerate
    except AudioError:
        raise
    except (sf.LibsndfileError, RuntimeError, TypeError, ValueError) as e:
        raise AudioError(f"{what}: not a readable audio file (WAV, FLAC, OGG, MP3 ...): {_reason(e)}") from e


def _check_length(frames: int, channels: int, sr: int, what: str) -> None:
    """Refuses what is too long to be a voice reference, or too large to decode (before any sample is decoded)."""
    if frames > MAX_REFERENCE_SECONDS * sr:
        raise AudioError(f"{what}: {frames / sr:.0f} s of audio; a voice reference may be at most "
                         f"{MAX_REFERENCE_SECONDS} s (a few seconds of clear speech is what cloning needs)")
    if frames * channels > MAX_REFERENCE_SAMPLES:
        raise AudioError(f"{what}: {frames / sr:.0f} s of {channels}-channel audio at {sr} Hz is "
                         f"{frames * channels} samples; a voice reference may hold at most {MAX_REFERENCE_SAMPLES} "
                         f"({MAX_REFERENCE_SECONDS} s of mono at 48 kHz; a few seconds of clear speech is what "
                         "cloning needs)")


def _reason(error: Exception) -> str:
    """libsndfile's own words ('Format not recognised.'), without soundfile's 'Error opening <_io.BytesIO ...>'."""
    return getattr(error, "error_string", None) or str(error)


def _to_mono(wav: np.ndarray) -> np.ndarray:
    # Channels last, averaged in float32 (librosa.to_mono and the official tuple route agree on this).
    if wav.ndim > 1:
        wav = np.mean(wav, axis=-1)
    return np.ascontiguousarray(wav, dtype=np.float32)


def _checked(wav: np.ndarray, sr: int, what: str) -> tuple[np.ndarray, int]:
    # (`sr` was checked where it was read: _from_tuple, _read_sound)
    if wav.size == 0:
        raise AudioError(f"{what}: audio is empty (0 samples)")
    if not np.isfinite(wav).all():
        raise AudioError(f"{what}: audio contains NaN or infinite samples")
    peak = float(np.abs(wav).max())
    if peak < SILENCE_THRESHOLD:
        raise AudioError(f"{what}: audio is silent (peak |x| = {peak:.3g} over {wav.size} samples); "
                         "a voice reference needs audible speech")
    return wav, sr


def _describe(source: Any) -> str:
    if isinstance(source, os.PathLike):
        return str(source)
    if isinstance(source, str):
        return _short(source)
    if isinstance(source, tuple):
        return "audio array"
    return "audio bytes"


def _fix_length(data: np.ndarray, size: int) -> np.ndarray:
    """`librosa.util.fix_length` on the last axis: truncate, or zero-pad at the end."""
    n = data.shape[-1]
    if n > size:
        return data[..., :size]
    if n < size:
        return np.pad(data, [(0, 0)] * (data.ndim - 1) + [(0, size - n)], mode="constant")
    return data
