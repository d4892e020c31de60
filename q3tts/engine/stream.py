"""A request's output as its caller sees it: 1920-sample PCM frames arriving from the engine thread.

The engine thread writes into a `Channel` (a plain queue, or, for a request submitted from an event loop, an
inbox that the loop's thread alone touches: each frame boundary's items for that loop go there in one call); the
caller holds a `RequestStream` around it. A stream that is cancelled, closed, or dropped without being read to
the end frees its row at the next frame boundary; so does one whose event loop closes.

Frames go out as soon as they are made while the reader is less than `hold_s` (EngineConfig.stream_hold_s) of
audio ahead of real-time playback; beyond that they are held and go out together, `hold_s` of audio at a time
(`deliver` states the rule per channel; `Delivery` applies it to every stream of a frame boundary at once, as the
engine does). A stream generated at 10x real time then wakes its reader ~10x less often after its first second:
the reader (an event loop writing HTTP chunks, say) shares the interpreter with the engine thread.
"""

from __future__ import annotations

import asyncio
import collections
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from typing import NamedTuple

import numpy as np
import torch

from .sequence import FRAME_SECONDS

END = object()  # the last item of every channel
FRAME_SAMPLES = 1920  # one codec frame: 80 ms at 24 kHz


class Channel:
    """Where the engine thread puts one request's frames (and the engine's record of the request)."""

    def __init__(self, request_id: str, loop: asyncio.AbstractEventLoop | None):
        self.request_id, self.loop = request_id, loop
        self.queue: queue.SimpleQueue | None = queue.SimpleQueue() if loop is None else None
        # With an event loop (its thread only): items not read yet, and the reader's future while it waits for one
        self.inbox: collections.deque = collections.deque()
        self.waiter: asyncio.Future | None = None
        self.submitted = time.perf_counter()
        self.admitted: float | None = None  # seconds from submission to admission into the batch (host clock)
        self.first_audio: float | None = None  # seconds from submission to the first frame
        self.codes: list[np.ndarray] = []  # [16] per delivered frame
        self.ref_tail: torch.Tensor | None = None  # see CodecRunner.start
        self.finish_reason: str | None = None  # "eos", "length", "cancelled" or "error"
        self.finished = False
        # `deliver`'s state: frames held back, frames handed out, when the first was
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


class Delivery:
    """`deliver`'s rule for every stream of a frame boundary at once, its state per slot (engine/rows.py) in
    arrays. The frames a slot holds are named, not kept: (boundary, row) pairs in `held`, each boundary's PCM and
    codes in a ring of the last few (`ring`): a boundary costs the engine thread a few vector operations whatever
    its rows, and the hand-out thread reads the frames out (`Frames`). `count`: the frames a slot holds; `posted`:
    those it handed out; `first_post`: when its first hand-out was (NaN before)."""

    def __init__(self, hold_s: float, size: int):
        self.hold_s, self.most = hold_s, max(1, round(hold_s / FRAME_SECONDS))
        self.ring: list[tuple[np.ndarray, np.ndarray] | None] = [None] * (self.most + 2)  # (a held frame is newer)
        self.boundary = 0
        self.held = np.zeros((0, self.most, 2), dtype=np.int64)
        self.count = np.zeros(0, dtype=np.int64)
        self.posted = np.zeros(0, dtype=np.int64)
        self.first_post = np.zeros(0)
        self.ensure(size)

    def ensure(self, size: int) -> None:
        """Room for slots 0..size-1."""
        grow = size - len(self.count)
        if grow > 0:
            self.held = np.concatenate([self.held, np.zeros((grow, self.most, 2), dtype=np.int64)])
            self.count, self.posted = (np.concatenate([a, np.zeros(grow, dtype=np.int64)])
                                       for a in (self.count, self.posted))
            self.first_post = np.concatenate([self.first_post, np.full(grow, np.nan)])

    def start(self, slot: int) -> None:
        """A new stream in `slot`."""
        self.count[slot] = self.posted[slot] = 0
        self.first_post[slot] = np.nan

    def add(self, pcm: np.ndarray, codes: np.ndarray, slots: np.ndarray, rows: np.ndarray, audio: np.ndarray
            ) -> None:
        """A boundary's frames: pcm [n, 1920] and codes [n, 16], row rows[i] of them for slots[i] (distinct), its
        audio unless not audio[i] (then its codes only: its stream ended, its audio unwanted)."""
        k = self.boundary
        self.ring[k % len(self.ring)], self.boundary = (pcm, codes), k + 1
        held = self.count[slots]
        self.held[slots, held, 0] = k
        self.held[slots, held, 1] = np.where(audio, rows, -1 - rows)
        self.count[slots] = held + 1

    def hand_out(self, slots: np.ndarray, now: float, forced: list[int] | None = None
                 ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The slots among `slots` (distinct) whose held frames go out now (their readers are less than hold_s
        ahead of real-time playback, or they hold hold_s of audio) and those of `forced` that hold any (their
        streams end, or their rows were preempted): (slots, their held frames [n, most, 2], their counts)."""
        count = self.count[slots]
        ahead = self.posted[slots] * FRAME_SECONDS - (now - self.first_post[slots])  # (NaN before a first hand-out)
        go = slots[(count > 0) & (~(ahead >= self.hold_s) | (count >= self.most))]
        parts = [(go, self.held[go], self.count[go])]
        self._sent(go, now)
        if forced:
            more = np.unique(forced)
            more = more[self.count[more] > 0]
            parts.append((more, self.held[more], self.count[more]))
            self._sent(more, now)
        return tuple(np.concatenate(part) for part in zip(*parts)) if len(parts) > 1 else parts[0]

    def take(self, slot: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The slot's held frames as codes only (its stream ends at once: their audio is not handed out)."""
        held, count = self.held[slot:slot + 1].copy(), self.count[slot:slot + 1].copy()
        held[0, :, 1] = np.where(held[0, :, 1] >= 0, -1 - held[0, :, 1], held[0, :, 1])
        self.count[slot] = 0
        return np.array([slot]), held, count

    def _sent(self, slots: np.ndarray, now: float) -> None:
        self.posted[slots] += self.count[slots]
        self.count[slots] = 0
        self.first_post[slots] = np.where(np.isnan(self.first_post[slots]), now, self.first_post[slots])


class Frames(NamedTuple):
    """A boundary's hand-outs as the engine thread names them (`Delivery.hand_out`): for hand-out i, its channel
    and its counts[i] frames as (boundary, row) pairs in held[i] (a row r < 0: row -1 - r's codes only), each
    boundary's (PCM, codes) in `ring` (Delivery.ring as it was)."""

    channels: list[Channel]
    held: np.ndarray  # [n, most, 2]
    counts: np.ndarray  # [n]
    ring: tuple

    def read(self) -> list[tuple[Channel, np.ndarray]]:
        """(channel, its frames joined) per hand-out with audio, after each frame's codes went to its channel's
        `codes`: all frames copied at once into one buffer, each hand-out a slice of it (they are rows of the
        boundaries' PCM buffers, mostly read from memory that no cache holds any more: before, the readers' event
        loops copied them, and that copy was most of what they spent per chunk)."""
        ring, depth, rows, sizes = self.ring, len(self.ring), [], []
        for channel, held, n in zip(self.channels, self.held, self.counts.tolist()):
            codes, before = channel.codes, len(rows)
            for boundary, row in held[:n].tolist():
                pcm, frame_codes = ring[boundary % depth]
                if row >= 0:
                    rows.append(pcm[row])
                    codes.append(frame_codes[row])
                else:
                    codes.append(frame_codes[-1 - row])
            sizes.append(len(rows) - before)
        joined, out, start = np.concatenate(rows) if rows else None, [], 0
        for channel, size in zip(self.channels, sizes):
            if size:
                end = start + size * FRAME_SAMPLES
                out.append((channel, joined[start:end]))
                start = end
        return out


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


class Dispatcher:
    """Posts the engine's hand-outs from a thread of its own, in the order given: each boundary's frames read out
    (`Frames.read`: their codes to their channels, their PCM joined in one copy, the interpreter's lock released
    while numpy copies), then one wake-up per event loop (`post`). Per frame, that is neither the engine thread's
    work nor the readers' event loops'. Channels whose event loop closed go to `on_closed`."""

    def __init__(self, on_closed: Callable[[Channel], None]):
        self.on_closed = on_closed
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="q3tts-hand-out", daemon=True)
        self._thread.start()

    def put(self, frames: Frames | None, items: list[tuple[Channel, object]] = ()) -> None:
        """`frames`' hand-outs, then `items` (ends and errors)."""
        if frames is not None or items:
            if self._thread.is_alive():
                self._queue.put((frames, items))
            else:  # (closed)
                self._post((frames, items))

    def close(self) -> None:
        """Posts what was put, then stops."""
        if self._thread.is_alive():
            self._queue.put(None)
            if self._thread is not threading.current_thread():
                self._thread.join()

    def _run(self) -> None:
        while (batch := self._queue.get()) is not None:
            self._post(batch)

    def _post(self, batch: tuple[Frames | None, list]) -> None:
        frames, items = batch
        for channel in post((frames.read() if frames is not None else []) + list(items)):
            self.on_closed(channel)


def _put_all(items: list[tuple[Channel, object]]) -> None:
    """(In the channels' event loop.) Each item to its reader's future if it waits, else to its inbox."""
    for channel, item in items:
        waiter = channel.waiter
        if waiter is not None:
            channel.waiter = None
            if not waiter.done():  # (done: cancelled with its reader)
                waiter.set_result(item)
                continue
        channel.inbox.append(item)


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
            chunk = self._take(self._channel.queue.get())
            if chunk is not None:
                yield chunk

    async def achunks(self) -> AsyncIterator[np.ndarray]:
        """`chunks` for a stream submitted from an event loop."""
        channel = self._channel
        if channel.loop is None:
            raise TypeError("this stream was submitted without an event loop: iterate it with `for`")
        inbox = channel.inbox
        while not self._ended:
            if inbox:
                item = inbox.popleft()
            else:  # (one future per wait, set by `_put_all`: an asyncio.Queue took ~3x the calls)
                channel.waiter = waiter = channel.loop.create_future()
                item = await waiter
            chunk = self._take(item)
            if chunk is not None:
                yield chunk

    def _take(self, item: object) -> np.ndarray | None:
        if item is END:
            self._ended = True
            return None
        if isinstance(item, BaseException):
            self._ended = True
            raise item
        if isinstance(item, np.ndarray):  # (a hand-out joined by the engine's Dispatcher)
            return item
        return item[0] if len(item) == 1 else np.concatenate(item)  # (a hand-out: frames, `deliver`)

    def read_all(self) -> np.ndarray:
        """The whole audio (blocks until the request ends)."""
        return _join(list(self))

    async def aread_all(self) -> np.ndarray:
        return _join([frame async for frame in self])


def _join(frames: list[np.ndarray]) -> np.ndarray:
    return np.concatenate(frames) if frames else np.zeros(0, dtype=np.float32)
