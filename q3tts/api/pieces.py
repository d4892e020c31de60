"""Long texts: spoken as pieces, back to back.

A text longer than `LONG_TEXT_CHARS` is cut at sentence ends (`text_segmenter.split_text`) into pieces of at most
`PIECE_CHARS` characters, each its own request with the same voice, instruction, language, sampling and seed.
`PieceStream` plays them in order while the next piece is already generating, so that it is ready when the
previous one ends; each piece's first 10 ms are ramped from the previous piece's last sample, so the join has no
step (no click).
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterator

import numpy as np

from ..engine import EngineError, QueueFull, RequestStream
from ..engine.stream import FRAME_SAMPLES, Channel

LONG_TEXT_CHARS = 600  # longer texts are spoken as pieces
PIECE_CHARS = 300
RAMP_SAMPLES = 240  # 10 ms at 24 kHz
QUEUE_WAIT_S = 60.0  # how long a piece may wait for room in a full queue


def ramp(previous: float, pcm: np.ndarray) -> np.ndarray:
    """`pcm` with its start moved smoothly to continue from `previous` (the last sample before it)."""
    n = min(RAMP_SAMPLES, len(pcm))
    if n == 0:
        return pcm
    out = pcm.copy()
    out[:n] += (previous - pcm[0]) * np.linspace(1.0, 0.0, n, endpoint=False, dtype=np.float32)
    return out


def join(wavs: list[np.ndarray]) -> np.ndarray:
    """Pieces' audio as one utterance, each join ramped (one piece: as it is)."""
    if len(wavs) == 1:
        return wavs[0]
    out = [wavs[0]]
    for wav in wavs[1:]:
        out.append(ramp(float(out[-1][-1]) if len(out[-1]) else 0.0, wav))
    return np.concatenate(out)


class PieceStream:
    """The frames of a long text's pieces in order, as one stream (the interface of `RequestStream`):
    `submit(k)` queues piece k; one piece is generated ahead of the one playing."""

    def __init__(self, submit: Callable[[int], RequestStream], num_pieces: int, ahead: int = 1):
        self._submit, self.num_pieces, self.ahead = submit, num_pieces, ahead
        self._streams: deque[RequestStream] = deque()
        self._next = self._playing = 0
        self._blocked_since: float | None = None  # when a piece first found the queue full
        self._last: float | None = None  # the last sample played
        self._piece_start = True
        self.channels: list[Channel] = []
        self._fill(first=True)

    @property
    def channel(self) -> Channel:
        """The piece playing now (after the end: the last piece)."""
        return self.channels[min(len(self.channels) - 1, self._playing)] if self.channels else None

    @property
    def request_id(self) -> str:
        return self.channels[0].request_id

    @property
    def finish_reason(self) -> str | None:
        return self.channel.finish_reason if self.channels else None

    @property
    def finished(self) -> bool:
        return self._next == self.num_pieces and all(s.finished for s in self._streams)

    def _fill(self, first: bool = False) -> None:
        """Keeps the playing piece and `ahead` more submitted. The first piece meets a full queue with QueueFull
        as any request does; a later one tries again at every frame, for up to QUEUE_WAIT_S."""
        while self._next < self.num_pieces and len(self._streams) <= self.ahead:
            try:
                stream = self._submit(self._next)
            except QueueFull:
                now = time.monotonic()
                self._blocked_since = self._blocked_since or now
                if first:
                    raise
                if now - self._blocked_since > QUEUE_WAIT_S:
                    raise EngineError(f"piece {self._next + 1} of {self.num_pieces} found the queue full for "
                                      f"{QUEUE_WAIT_S:g} s") from None
                return
            self._blocked_since = None
            self._streams.append(stream)
            self.channels.append(stream.channel)
            self._next += 1

    def cancel(self) -> None:
        self._next = self.num_pieces
        for stream in self._streams:
            stream.cancel()

    close = cancel

    def __iter__(self) -> Iterator[np.ndarray]:
        for chunk in self.chunks():
            yield from chunk.reshape(-1, FRAME_SAMPLES)

    async def __aiter__(self) -> AsyncIterator[np.ndarray]:
        async for chunk in self.achunks():
            for frame in chunk.reshape(-1, FRAME_SAMPLES):
                yield frame

    def chunks(self) -> Iterator[np.ndarray]:
        """The pieces' audio as the engine hands it out (RequestStream.chunks)."""
        while self._streams or self._next < self.num_pieces:
            if not self._streams:  # the next piece waits for room in the queue
                self._fill()
                time.sleep(0.01)
                continue
            for chunk in self._streams[0].chunks():
                yield self._take(chunk)
            self._next_piece()

    async def achunks(self) -> AsyncIterator[np.ndarray]:
        while self._streams or self._next < self.num_pieces:
            if not self._streams:
                self._fill()
                await asyncio.sleep(0.01)
                continue
            async for chunk in self._streams[0].achunks():
                yield self._take(chunk)
            self._next_piece()

    def _take(self, chunk: np.ndarray) -> np.ndarray:
        """Audio of the playing piece: its start ramped from the last piece's end; the next piece queued."""
        if self._piece_start and self._last is not None:
            chunk = ramp(self._last, chunk)
        self._piece_start, self._last = False, float(chunk[-1])
        self._fill()
        return chunk

    def _next_piece(self) -> None:
        self._streams.popleft()
        self._playing += 1
        self._piece_start = True
        self._fill()

    def read_all(self) -> np.ndarray:
        frames = list(self)
        return np.concatenate(frames) if frames else np.zeros(0, dtype=np.float32)

    async def aread_all(self) -> np.ndarray:
        frames = [frame async for frame in self]
        return np.concatenate(frames) if frames else np.zeros(0, dtype=np.float32)
