"""Audio streaming: PCM chunks while the frames are being generated.

Each frame is decoded exactly and incrementally as soon as it exists (`engine/runner/codec.py`), so chunk boundaries
need no crossfade: the concatenated chunks are the offline decode. The chunk schedule only groups frames for the
caller: the default sends the first frame's 80 ms alone (lowest time to first audio), then chunks of 2, 4, 8 and
16 frames, which keeps far ahead of real time. The end of a request is known only after its last frame, so when
the frames fill the schedule exactly the last chunk is an empty one with `is_last=True`.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable, Iterable, Iterator
from dataclasses import dataclass

import numpy as np

from ..engine.sequence import FRAME_SECONDS
from ..engine.stream import RequestStream
from ..errors import RequestError
from ..request.audio import to_int16

DEFAULT_SCHEDULE = (1, 2, 4, 8, 16)
PCM_FORMATS = ("float32", "int16")


@dataclass
class AudioChunk:
    pcm: np.ndarray  # float32 in [-1, 1], or int16
    sample_rate: int
    index: int  # 0, 1, ...
    start_frame: int  # first codec frame in this chunk (80 ms each)
    num_frames: int
    elapsed_s: float  # wall time from the request to this chunk being ready
    is_last: bool

    @property
    def start_s(self) -> float:
        """Where this chunk starts in the utterance, in seconds."""
        return self.start_frame * FRAME_SECONDS


def check_chunking(schedule: tuple[int, ...] | int, pcm_format: str) -> tuple[int, ...]:
    if pcm_format not in PCM_FORMATS:
        raise RequestError(f"pcm_format must be 'float32' or 'int16', got {pcm_format!r}", "pcm_format")
    if isinstance(schedule, int) and not isinstance(schedule, bool):
        schedule = (schedule,)  # every chunk this many frames
    if isinstance(schedule, (str, bytes)) or not isinstance(schedule, Iterable):
        raise RequestError(f"chunk schedule must be frame counts (a tuple, or one number), got {schedule!r}",
                           "chunk_schedule")
    schedule = tuple(schedule)
    if not schedule or any(not isinstance(n, int) or isinstance(n, bool) or n < 1 for n in schedule):
        raise RequestError(f"chunk schedule must be positive frame counts, got {schedule!r}", "chunk_schedule")
    return schedule


class AudioStream:
    """One request's audio as `AudioChunk`s: `for chunk in tts.stream(...)`, or `async for chunk in
    tts.astream(...)`. `close()` (or leaving the loop and dropping the stream) frees the request's row."""

    def __init__(self, open_frames: Callable[[], RequestStream], schedule: tuple[int, ...], pcm_format: str,
                 sample_rate: int, started: float, submit_now: bool = True):
        """open_frames: submits the request (now, or at the first `async for` if `submit_now` is False)."""
        self._open, self._frames = open_frames, open_frames() if submit_now else None
        self._closed = self._read = False
        self.schedule, self.pcm_format, self.sample_rate, self.started = schedule, pcm_format, sample_rate, started

    @property
    def frames(self) -> RequestStream:
        """The underlying stream of 1920-sample frames (its `channel` has the request's timings and codes)."""
        if self._frames is None:
            if self._closed:
                raise RuntimeError("the stream was closed before its request was submitted")
            self._frames = self._open()
        return self._frames

    def close(self) -> None:
        self._closed = True
        if self._frames is not None:
            self._frames.cancel()

    def _start_reading(self) -> None:
        """A stream is read once: its chunks are handed out as they come, not kept."""
        if self._read:
            raise RuntimeError("this stream was read already: its audio is handed out once (keep the chunks, or "
                               "make a new request)")
        self._read = True

    def __iter__(self) -> Iterator[AudioChunk]:
        if self._frames is None and not self._closed:  # (an astream made outside a running loop)
            raise TypeError("this stream is for asyncio (`tts.astream`): read it with `async for` inside a running "
                            "event loop, or use `tts.stream` with `for`")
        self._start_reading()
        chunker = _Chunker(self)
        try:
            for frame in self.frames:
                if (chunk := chunker.add(frame)) is not None:
                    yield chunk
            yield chunker.last()
        finally:
            self.close()

    async def __aiter__(self) -> AsyncIterator[AudioChunk]:
        if self._closed and self._frames is None:
            return  # closed before its request was submitted: nothing to generate
        self._start_reading()
        chunker = _Chunker(self)
        try:
            async for frame in self.frames:
                if (chunk := chunker.add(frame)) is not None:
                    yield chunk
            yield chunker.last()
        finally:
            self.close()


class _Chunker:
    """Groups frames into chunks by the stream's schedule (the last value repeats)."""

    def __init__(self, stream: AudioStream):
        self.stream, self.pending, self.index, self.frame = stream, [], 0, 0

    def add(self, frame: np.ndarray) -> AudioChunk | None:
        self.pending.append(frame)
        schedule = self.stream.schedule
        if len(self.pending) < schedule[min(self.index, len(schedule) - 1)]:
            return None
        return self._chunk(is_last=False)

    def last(self) -> AudioChunk:
        return self._chunk(is_last=True)

    def _chunk(self, is_last: bool) -> AudioChunk:
        s, frames = self.stream, self.pending
        pcm = np.concatenate(frames) if frames else np.zeros(0, dtype=np.float32)
        if s.pcm_format == "int16":
            pcm = to_int16(pcm)
        chunk = AudioChunk(pcm=pcm, sample_rate=s.sample_rate, index=self.index, start_frame=self.frame,
                           num_frames=len(frames), elapsed_s=time.perf_counter() - s.started, is_last=is_last)
        self.index, self.frame, self.pending = self.index + 1, self.frame + len(frames), []
        return chunk
