"""A request's output as its caller sees it: 1920-sample PCM frames arriving from the engine thread.

The engine thread writes into a `Channel` (a plain queue, or an asyncio queue of the event loop the request was
submitted from); the caller holds a `RequestStream` around it. A stream that is cancelled, closed, or dropped
without being read to the end frees its row at the next frame boundary; so does one whose event loop closes.

Frames go out as soon as they are made while the reader is less than `hold_s` (EngineConfig.stream_hold_s) of
audio ahead of real-time playback; beyond that they are held and go out together, `hold_s` of audio at a time
(`deliver`). A stream generated at 10x real time then wakes its reader ~10x less often after its first second:
the reader (an event loop writing HTTP chunks, say) shares the interpreter with the engine thread.
"""

from __future__ import annotations

import asyncio
import queue
import time
from collections.abc import AsyncIterator, Callable, Iterator

import numpy as np
import torch

from .sequence import FRAME_SECONDS

END = object()  # the last item of every channel
FRAME_SAMPLES = 1920  # one codec frame: 80 ms at 24 kHz


class Channel:
    """Where the engine thread puts one request's frames (and the engine's record of the request)."""

    def __init__(self, request_id: str, loop: asyncio.AbstractEventLoop | None):
        self.request_id, self.loop = request_id, loop
        self.queue: asyncio.Queue | queue.SimpleQueue = asyncio.Queue() if loop is not None else queue.SimpleQueue()
        self.submitted = time.perf_counter()
        self.admitted: float | None = None  # seconds from submission to admission into the batch (host clock)
        self.first_audio: float | None = None  # seconds from submission to the first frame
        self.codes: list[np.ndarray] = []  # [16] per delivered frame
        self.ref_tail: torch.Tensor | None = None  # see CodecRunner.start
        self.finish_reason: str | None = None  # "eos", "length", "cancelled" or "error"
        self.finished = False
        # delivery (engine thread only): frames held back, frames handed out, when the first was
        self.held: list[np.ndarray] = []
        self.posted_frames = 0
        self.first_post: float | None = None


def deliver(items: list[tuple[Channel, object]], now: float, hold_s: float,
            flush: list[Channel] = ()) -> list[tuple[Channel, object]]:
    """`items` (frames of 1920 samples, errors, END) as the channels should get them: each stream's frames one
    at a time while its reader is less than `hold_s` of audio ahead of real-time playback (counted from its
    first frame), otherwise held until `hold_s` of audio is held; an end, and every channel in `flush` (a row
    preempted: no frame comes for a while), hands out what is held first. A hand-out is a list of k frames,
    joined into one array by the reader (`RequestStream`): the copy is the reader's thread's work, not the engine
    thread's."""
    out: list[tuple[Channel, object]] = []
    touched: dict[Channel, None] = dict.fromkeys(flush)
    for channel, item in items:
        if isinstance(item, np.ndarray):
            channel.held.append(item)
            touched[channel] = None
        else:
            _hand_out(channel, out, now)
            out.append((channel, item))
    most = max(1, round(hold_s / FRAME_SECONDS))
    for channel in touched:
        if not channel.held:
            continue
        ahead = (float("-inf") if channel.first_post is None
                 else channel.posted_frames * FRAME_SECONDS - (now - channel.first_post))
        if ahead < hold_s or len(channel.held) >= most or channel in flush:
            _hand_out(channel, out, now)
    return out


def _hand_out(channel: Channel, out: list, now: float) -> None:
    if channel.held:  # (a frame is a row of a PCM array no one else writes: frames go out as views)
        out.append((channel, channel.held))
        channel.first_post = channel.first_post or now
        channel.posted_frames += len(channel.held)
        channel.held = []


def post(items: list[tuple[Channel, object]]) -> list[Channel]:
    """Hands each item to its channel, one wake-up per event loop (a frame step delivers to every running row;
    one `call_soon_threadsafe` each would write to the loop's wake-up pipe and take the GIL once per row).
    Returns the channels whose event loop is closed: nobody can read them any more."""
    by_loop: dict[asyncio.AbstractEventLoop, list] = {}
    for channel, item in items:
        if channel.loop is None:
            channel.queue.put(item)
        else:
            by_loop.setdefault(channel.loop, []).append((channel, item))
    dead = []
    for loop, loop_items in by_loop.items():
        try:
            loop.call_soon_threadsafe(_put_all, loop_items)
        except RuntimeError:  # the loop is closed
            dead.extend(channel for channel, _ in loop_items)
    return dead


def _put_all(items: list[tuple[Channel, object]]) -> None:
    for channel, item in items:
        channel.queue.put_nowait(item)


class RequestStream:
    """One request's audio: iterate (`for pcm in stream`, or `async for` when submitted from a running event
    loop with `asyncio=True`) for float32 PCM frames of 1920 samples. `cancel()` (or `close()`) stops it and
    frees its row; so does dropping the stream before its end."""

    def __init__(self, channel: Channel, cancel: Callable[[str], None], drop: Callable[[str], None]):
        """cancel: ends the request now (takes the engine's lock); drop: asks the engine thread to end it at its
        next frame boundary (safe from a finalizer, which may run on any thread at any moment)."""
        self._channel, self._cancel, self._drop = channel, cancel, drop
        self._ended = False  # the end was read: iterating again yields nothing

    @property
    def request_id(self) -> str:
        return self._channel.request_id

    @property
    def channel(self) -> Channel:
        """The engine's record of the request (timings, codes, finish reason)."""
        return self._channel

    @property
    def finished(self) -> bool:
        return self._channel.finished

    @property
    def finish_reason(self) -> str | None:
        return self._channel.finish_reason

    def cancel(self) -> None:
        if not self._channel.finished:
            self._cancel(self._channel.request_id)

    close = cancel

    def __del__(self):
        if not self._channel.finished:
            self._drop(self._channel.request_id)

    def __iter__(self) -> Iterator[np.ndarray]:
        for chunk in self.chunks():
            yield from chunk.reshape(-1, FRAME_SAMPLES)

    def __aiter__(self) -> AsyncIterator[np.ndarray]:
        if self._channel.loop is None:
            raise TypeError("this stream was submitted without an event loop: iterate it with `for`")
        return self._aiter()

    async def _aiter(self) -> AsyncIterator[np.ndarray]:
        async for chunk in self.achunks():
            for frame in chunk.reshape(-1, FRAME_SAMPLES):
                yield frame

    def chunks(self) -> Iterator[np.ndarray]:
        """The audio as the engine hands it out: whole frames, one or several joined (see the module's
        docstring); fewer, larger pieces than iterating frame by frame, for writers that pay per write."""
        if self._channel.loop is not None:
            raise TypeError("this stream was submitted for asyncio: iterate it with `async for`")
        while not self._ended:
            yield from self._take(self._channel.queue.get())

    async def achunks(self) -> AsyncIterator[np.ndarray]:
        """`chunks` for a stream submitted from an event loop."""
        if self._channel.loop is None:
            raise TypeError("this stream was submitted without an event loop: iterate it with `for`")
        while not self._ended:
            for chunk in self._take(await self._channel.queue.get()):
                yield chunk

    def _take(self, item: object) -> list[np.ndarray]:
        if item is END:
            self._ended = True
            return []
        if isinstance(item, BaseException):
            self._ended = True
            raise item
        return [item[0] if len(item) == 1 else np.concatenate(item)]  # (a hand-out: frames, `deliver`)

    def read_all(self) -> np.ndarray:
        """The whole audio (blocks until the request ends)."""
        return _join(list(self))

    async def aread_all(self) -> np.ndarray:
        return _join([frame async for frame in self])


def _join(frames: list[np.ndarray]) -> np.ndarray:
    return np.concatenate(frames) if frames else np.zeros(0, dtype=np.float32)
