"""A request's output as its caller sees it: 1920-sample PCM frames arriving from the engine thread.

The engine thread writes into a `Channel` (a plain queue, or an asyncio queue of the event loop the request was
submitted from); the caller holds a `RequestStream` around it. A stream that is cancelled, closed, or dropped
without being read to the end frees its row at the next frame boundary; so does one whose event loop closes.
"""

from __future__ import annotations

import asyncio
import queue
import time
from collections.abc import AsyncIterator, Callable, Iterator

import numpy as np
import torch

END = object()  # the last item of every channel


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

    def cancel(self) -> None:
        if not self._channel.finished:
            self._cancel(self._channel.request_id)

    close = cancel

    def __del__(self):
        if not self._channel.finished:
            self._drop(self._channel.request_id)

    def __iter__(self) -> Iterator[np.ndarray]:
        if self._channel.loop is not None:
            raise TypeError("this stream was submitted for asyncio: iterate it with `async for`")
        while not self._ended:
            yield from self._take(self._channel.queue.get())

    def __aiter__(self) -> AsyncIterator[np.ndarray]:
        if self._channel.loop is None:
            raise TypeError("this stream was submitted without an event loop: iterate it with `for`")
        return self._aiter()

    async def _aiter(self) -> AsyncIterator[np.ndarray]:
        while not self._ended:
            for frame in self._take(await self._channel.queue.get()):
                yield frame

    def _take(self, item: object) -> list[np.ndarray]:
        if item is END:
            self._ended = True
            return []
        if isinstance(item, BaseException):
            self._ended = True
            raise item
        return [item]

    def read_all(self) -> np.ndarray:
        """The whole audio (blocks until the request ends)."""
        return _join(list(self))

    async def aread_all(self) -> np.ndarray:
        return _join([frame async for frame in self])


def _join(frames: list[np.ndarray]) -> np.ndarray:
    return np.concatenate(frames) if frames else np.zeros(0, dtype=np.float32)
