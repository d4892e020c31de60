"""Incremental audio encoders: float32 mono PCM in (any number of samples per call), encoded bytes out, ready
to send at once. Every format streams: the client can play the first bytes while the rest is generated.

- `pcm`: raw signed 16-bit little-endian mono at the model's rate (24 kHz) or the asked `sample_rate`, no header.
- `wav`: a WAV header whose RIFF and data sizes are 0xFFFFFFFF, the standard "open-ended" value that readers take
  for "until the data ends" (streaming WAV), then 16-bit PCM; a WAV sent whole (`whole=True`: the WebSocket's
  one file per segment) carries its true sizes.
- `mp3`, `opus` (in Ogg, pages flushed every 20 ms), `aac` (ADTS): PyAV encoders writing to a non-seekable sink
  that is drained after every call. Lossy encoders add their codec's priming/padding (under one 80 ms frame of
  audio).
- `flac`: sent whole when the audio ends. FLAC's header carries the total sample count, which libsndfile (and
  with it soundfile) needs to read the file; a streamed FLAC can only say "unknown".

`make_encoder(format, sample_rate, speed, out_rate, volume)` builds one; before encoding, `volume != 1` scales the
samples, `speed != 1` time-stretches (see time_stretch.py) and `out_rate` resamples (soxr, streaming, HQ).
`encode_async` runs the costly ones (PyAV: ~0.2-2 ms per 80 ms frame) in a worker thread, so many streams
encode on many cores instead of stalling the event loop. Pure: no server, no engine; unit-tested on its own.
"""

from __future__ import annotations

import asyncio
import io
import struct
from typing import Protocol

import av
import numpy as np
import soxr

from ..request.audio import to_int16
from .time_stretch import TimeStretch

FORMATS = ("mp3", "opus", "aac", "flac", "wav", "pcm")
MEDIA_TYPES = {"mp3": "audio/mpeg", "opus": "audio/ogg", "aac": "audio/aac", "flac": "audio/flac",
               "wav": "audio/wav", "pcm": "audio/pcm"}
# format -> (container, codec, container options)
_PYAV = {"mp3": ("mp3", "libmp3lame", {}), "opus": ("ogg", "libopus", {"page_duration": "20000"}),
         "aac": ("adts", "aac", {}), "flac": ("flac", "flac", {})}
_STREAMING_SIZE = 0xFFFFFFFF  # WAV sizes for "unknown length": readers play until the data ends
_WAV_HEADER_BYTES = 44
_WHOLE = ("flac",)  # formats whose header must hold the length: written to memory, sent at the end


class AudioEncoder(Protocol):
    offload: bool  # worth a worker thread (PyAV releases the GIL, so many streams encode on many cores)

    def encode(self, pcm: np.ndarray) -> bytes: ...

    def flush(self) -> bytes: ...


class PCMEncoder:
    offload = False

    def encode(self, pcm: np.ndarray) -> bytes:
        return to_int16(pcm).tobytes()

    def flush(self) -> bytes:
        return b""


class WAVEncoder:
    """16-bit PCM after a WAV header: streamed (open-ended sizes, the header with the first bytes) or, `whole`,
    held until flush and sent with its true sizes."""

    offload = False

    def __init__(self, sample_rate: int, whole: bool = False):
        self.sample_rate, self.whole = sample_rate, whole
        self.started = False
        self.parts: list[bytes] = []

    def header(self, data_bytes: int | None = None) -> bytes:
        rate, channels, bits = self.sample_rate, 1, 16
        block = channels * bits // 8
        riff = _STREAMING_SIZE if data_bytes is None else _WAV_HEADER_BYTES - 8 + data_bytes
        data = _STREAMING_SIZE if data_bytes is None else data_bytes
        return (b"RIFF" + struct.pack("<I", riff) + b"WAVE"
                + b"fmt " + struct.pack("<IHHIIHH", 16, 1, channels, rate, rate * block, block, bits)
                + b"data" + struct.pack("<I", data))

    def encode(self, pcm: np.ndarray) -> bytes:
        samples = to_int16(pcm).tobytes()
        if self.whole:
            self.parts.append(samples)
            return b""
        head = b"" if self.started else self.header()
        self.started = True
        return head + samples

    def flush(self) -> bytes:
        if self.whole:
            data, self.parts = b"".join(self.parts), []
            return self.header(len(data)) + data
        return b"" if self.started else self.encode(np.zeros(0, dtype=np.float32))


class _Sink:
    """A write-only, non-seekable file for PyAV: muxers then never seek back, and we drain what they wrote."""

    def __init__(self):
        self.parts: list[bytes] = []

    def write(self, data) -> int:
        self.parts.append(bytes(data))
        return len(data)

    def drain(self) -> bytes:
        out = b"".join(self.parts)
        self.parts.clear()
        return out


class _Whole(io.BytesIO):
    """A seekable in-memory file whose bytes are handed out only once the container is closed (its header
    rewritten)."""

    def __init__(self):
        super().__init__()
        self.closed_container = False

    def drain(self) -> bytes:
        return self.getvalue() if self.closed_container else b""


class PyAVEncoder:
    offload = True

    def __init__(self, fmt: str, sample_rate: int):
        container, codec, options = _PYAV[fmt]
        self.sample_rate, self.pts = sample_rate, 0
        self.sink = _Whole() if fmt in _WHOLE else _Sink()
        self.container = av.open(self.sink, mode="w", format=container, options=options)
        self.stream = self.container.add_stream(codec, rate=sample_rate)
        self.stream.layout = "mono"
        self.closed = False

    def encode(self, pcm: np.ndarray) -> bytes:
        if len(pcm):
            frame = av.AudioFrame.from_ndarray(to_int16(pcm)[None, :], format="s16", layout="mono")
            frame.sample_rate, frame.pts = self.sample_rate, self.pts
            self.pts += len(pcm)
            self._mux(self.stream.encode(frame))
        return self.sink.drain()

    def flush(self) -> bytes:
        if not self.closed:
            self.closed = True
            self._mux(self.stream.encode(None))
            self.container.close()
            if isinstance(self.sink, _Whole):
                self.sink.closed_container = True
        return self.sink.drain()

    def _mux(self, packets: list) -> None:
        for packet in packets:
            self.container.mux(packet)


class Gain:
    """`volume_multiplier`: the samples scaled (clipped to 16 bits when encoded)."""

    def __init__(self, factor: float):
        self.factor = np.float32(factor)

    def process(self, pcm: np.ndarray) -> np.ndarray:
        return pcm * self.factor

    def flush(self) -> np.ndarray:
        return np.zeros(0, dtype=np.float32)


class Resample:
    """`sample_rate`: soxr's streaming resampler (HQ); the output is round(n x out / in) samples in all."""

    def __init__(self, in_rate: int, out_rate: int):
        self.stream = soxr.ResampleStream(in_rate, out_rate, 1, dtype="float32", quality="HQ")

    def process(self, pcm: np.ndarray) -> np.ndarray:
        return self.stream.resample_chunk(np.ascontiguousarray(pcm, dtype=np.float32))

    def flush(self) -> np.ndarray:
        return self.stream.resample_chunk(np.zeros(0, dtype=np.float32), last=True)


class Stage(Protocol):
    def process(self, pcm: np.ndarray) -> np.ndarray: ...

    def flush(self) -> np.ndarray: ...


class StagedEncoder:
    """Samples through `stages` in order (gain, time stretch, resampling), then encoded."""

    offload = True

    def __init__(self, encoder: AudioEncoder, stages: list[Stage]):
        self.encoder, self.stages = encoder, stages

    def encode(self, pcm: np.ndarray) -> bytes:
        for stage in self.stages:
            pcm = stage.process(pcm)
        return self.encoder.encode(pcm)

    def flush(self) -> bytes:
        """Each stage's tail through the stages after it."""
        out = b""
        for i, stage in enumerate(self.stages):
            tail = stage.flush()
            for later in self.stages[i + 1:]:
                tail = later.process(tail)
            out += self.encoder.encode(tail)
        return out + self.encoder.flush()


def make_encoder(fmt: str, sample_rate: int, speed: float = 1.0, out_rate: int | None = None, volume: float = 1.0,
                 whole: bool = False) -> AudioEncoder:
    """An encoder of audio at `sample_rate` into `fmt` at `out_rate` (default: the same), after `volume` and
    `speed`; `whole`: a WAV is sent at the end with its true sizes."""
    if fmt not in FORMATS:
        raise ValueError(f"unsupported response_format {fmt!r}; supported: {list(FORMATS)}")
    rate = out_rate or sample_rate
    if fmt == "pcm":
        encoder: AudioEncoder = PCMEncoder()
    elif fmt == "wav":
        encoder = WAVEncoder(rate, whole)
    else:
        encoder = PyAVEncoder(fmt, rate)
    stages: list[Stage] = []
    if volume != 1.0:
        stages.append(Gain(volume))
    if speed != 1.0:
        stages.append(TimeStretch(speed, sample_rate))
    if rate != sample_rate:
        stages.append(Resample(sample_rate, rate))
    return StagedEncoder(encoder, stages) if stages else encoder


async def encode_async(encoder: AudioEncoder, pcm: np.ndarray) -> bytes:
    """`encoder.encode(pcm)`, off the event loop when the encoder is costly (mp3 is ~2 ms per 80 ms frame)."""
    return await asyncio.to_thread(encoder.encode, pcm) if encoder.offload else encoder.encode(pcm)


async def flush_async(encoder: AudioEncoder) -> bytes:
    return await asyncio.to_thread(encoder.flush) if encoder.offload else encoder.flush()
