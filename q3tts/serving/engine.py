"""The serving engine: continuous batching of many requests on one model, streaming their audio.

A background thread runs the frame loop. At every frame boundary it drops cancelled requests, admits waiting
ones chosen by the scheduler (batched prefill into free rows), advances every running row by one frame (the
captured LM frame and codec step), and hands each row's new 80 ms of PCM to its request while the next frame
runs. Finished and cancelled rows leave at once; the last row moves into the hole so that the running rows
stay 0..B-1. Each request's output depends only on its own prompt, parameters and seed.

Use from asyncio (`submit` inside a running loop, then `async for pcm in stream`) or from plain threads
(`for pcm in stream`).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import queue
import sys
import threading
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from ..engine.readback import Readback
from ..prompt import Prompt, PromptSpec, build_prompt
from ..sampling import SamplingParams
from .scheduler import QueueFull, Scheduler, Sequence

log = logging.getLogger("q3tts.engine")
_END = object()
_ids = itertools.count()


@dataclass
class ServingConfig:
    max_running: int = 64  # rows of the batch
    max_waiting: int = 256  # queued requests before new ones are refused
    max_context: int = 4096  # talker positions per request (prompt + frames)
    max_prefill_tokens: int = 4096  # prefill tokens admitted per frame boundary
    prefill_seconds_per_token: float = 1e-4  # stall estimate the scheduler weighs against the streams' lead
    safety_seconds: float = 0.04  # lead kept beyond a stall: the next frame comes about two frame steps later
    # The interpreter's thread switch interval while the engine runs: after each frame the engine thread may wait
    # this long for the GIL if another thread (the server, its clients) is busy. Python's 5 ms default is half a
    # frame step; None leaves it alone.
    switch_interval: float | None = 0.001

    def __post_init__(self):
        if self.max_running < 1 or self.max_waiting < 0 or self.max_context < 64:
            raise ValueError("max_running >= 1, max_waiting >= 0 and max_context >= 64 are required")


class EngineError(RuntimeError):
    """The engine failed while running a request."""


@dataclass
class EngineMetrics:
    """Counters the engine thread updates; `observers` are called from it (keep them cheap)."""

    frames: int = 0
    requests_finished: int = 0
    requests_cancelled: int = 0
    errors: int = 0
    observers: list = field(default_factory=list)  # objects with on_first_audio(s) / on_finish(audio_s, wall_s)

    def notify(self, event: str, *args: float) -> None:
        for observer in self.observers:
            getattr(observer, event, lambda *_: None)(*args)


class RequestStream:
    """One request's audio: iterate (sync or async) for float32 PCM frames of 1920 samples; `cancel()` stops
    it and frees its row."""

    def __init__(self, engine: AsyncEngine, request_id: str):
        self.engine, self.request_id = engine, request_id
        try:
            self._loop = asyncio.get_running_loop()
            self._queue: asyncio.Queue | queue.SimpleQueue = asyncio.Queue()
        except RuntimeError:
            self._loop, self._queue = None, queue.SimpleQueue()
        self.submitted = time.perf_counter()
        self.admitted: float | None = None  # seconds from submission to admission into the batch (host clock)
        self.first_audio: float | None = None  # seconds from submission to the first frame
        self.finished = False

    def cancel(self) -> None:
        self.engine.cancel(self.request_id)

    def _put(self, item) -> None:
        _post([(self, item)])

    def __iter__(self):
        while (item := self._queue.get()) is not _END:
            if isinstance(item, BaseException):
                raise item
            yield item

    def __aiter__(self):
        return self._aiter()

    async def _aiter(self):
        while (item := await self._queue.get()) is not _END:
            if isinstance(item, BaseException):
                raise item
            yield item

    async def read_all(self) -> np.ndarray:
        frames = [f async for f in self]
        return np.concatenate(frames) if frames else np.zeros(0, dtype=np.float32)


@dataclass
class _Payload:
    prompt: Prompt
    params: SamplingParams
    ref_codes: torch.Tensor | None
    stream: RequestStream
    finished: bool = False


class AsyncEngine:
    def __init__(self, tts, config: ServingConfig | None = None):
        self.config = config or ServingConfig()
        self.tts = tts
        c = self.config
        engine = tts.prepare_engine(max_rows=c.max_running, max_context=c.max_context)
        self.runner, self.codec = engine.runner, engine.codec
        self.scheduler = Scheduler(c.max_running, c.max_waiting, c.max_prefill_tokens, c.prefill_seconds_per_token,
                                   c.safety_seconds)
        self.metrics = EngineMetrics()
        self.rows: list[Sequence] = []  # rows[i]: the sequence in batch row i
        self._cv = threading.Condition()
        self._stopping = False
        self._thread: threading.Thread | None = None
        self.healthy = True
        self._prompt_stream = torch.cuda.Stream() if self.runner.device.type == "cuda" else None

    # ---- public ------------------------------------------------------------------------------------------

    def start(self) -> None:
        if self._thread is None:
            self._saved_switch_interval = sys.getswitchinterval()
            if self.config.switch_interval is not None:
                sys.setswitchinterval(min(self._saved_switch_interval, self.config.switch_interval))
            self._thread = threading.Thread(target=self._run, name="q3tts-engine", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        """Stops the engine for good: requests still running or waiting end with EngineError."""
        with self._cv:
            self._stopping = True
            self._cv.notify()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
            sys.setswitchinterval(self._saved_switch_interval)
        else:
            self._fail_all(EngineError("the engine was stopped"))

    def prepare(self, spec: PromptSpec) -> Prompt:
        """Builds a request's prompt embeddings on a stream of its own, so that they do not queue behind the
        frames the engine has in flight (call from any thread, then `submit`)."""
        if self._prompt_stream is None:
            return build_prompt(self.tts.model.talker, self.tts.config, spec)
        with torch.cuda.stream(self._prompt_stream):
            prompt = build_prompt(self.tts.model.talker, self.tts.config, spec)
        self._prompt_stream.synchronize()
        return prompt

    def submit(self, prompt: Prompt, params: SamplingParams, ref_codes: torch.Tensor | None = None,
               request_id: str | None = None) -> RequestStream:
        """Queues a request; raises QueueFull when the queue is at its limit and ValueError when the request
        cannot fit the engine's context."""
        if not self.healthy:
            raise EngineError("the engine has failed; restart the server")
        if self._stopping:
            raise EngineError("the engine was stopped")
        if len(prompt.trailing_ids) > self.runner.config.max_trailing:  # refused here, not in the engine thread
            raise ValueError(f"text too long for this engine ({len(prompt.trailing_ids)} text tokens after the "
                             f"prompt; at most {self.runner.config.max_trailing})")
        need = prompt.embeds.shape[0] + params.max_new_tokens
        if need > self.config.max_context:
            raise ValueError(f"prompt ({prompt.embeds.shape[0]} positions) + max_new_tokens "
                             f"({params.max_new_tokens}) exceed this server's {self.config.max_context} positions")
        request_id = request_id or f"req-{next(_ids)}"
        stream = RequestStream(self, request_id)
        seq = Sequence(request_id, prompt.embeds.shape[0], time.perf_counter(),
                       payload=_Payload(prompt, params, ref_codes, stream))
        with self._cv:
            self.scheduler.add(seq)
            self._cv.notify()
        return stream

    def cancel(self, request_id: str) -> None:
        with self._cv:
            seq = self.scheduler.cancel(request_id)
            if seq is not None and seq not in self.rows:  # still waiting: done now
                self._close(seq)
            self._cv.notify()

    @property
    def num_running(self) -> int:
        return len(self.rows)

    @property
    def num_waiting(self) -> int:
        return self.scheduler.num_waiting

    # ---- the frame loop (engine thread) ------------------------------------------------------------------

    def _run(self) -> None:
        try:
            self._loop()
            self._fail_all(EngineError("the engine was stopped"))
        except Exception as e:  # the device is in an unknown state: fail everything, refuse new work
            log.exception("engine failed")
            self.healthy = False
            self.metrics.errors += 1
            self._fail_all(EngineError(f"engine failed: {e}"))

    def _fail_all(self, error: EngineError) -> None:
        """Ends every running and waiting request's stream with `error` (the engine takes no more work)."""
        with self._cv:
            for seq in [*self.rows, *self.scheduler.waiting]:
                if not seq.payload.finished:
                    seq.payload.stream._put(error)
                self._close(seq)

    def _loop(self) -> None:
        # Each iteration: admit, launch frame n, deliver frame n - 1 (read back earlier) while frame n runs, wait
        # for frame n. Waiting for the frame just launched (rather than keeping the next one queued behind it)
        # lets a request that arrived during frame n join frame n + 1: one frame step sooner to its first audio,
        # for a GPU gap of the launch's host work between frames.
        readback = Readback(self.runner, depth=1, pcm=self.codec.pcm, pcm_stream=self.codec.pcm_stream)
        ready = None  # (frame out, row map) of the last frame, delivered after the next launch
        while True:
            with self._cv:
                while not (self._stopping or self.rows or self.scheduler.waiting or ready):
                    self._cv.wait()
                if self._stopping:
                    return
                for seq in [s for s in self.rows if s.cancelled]:
                    self.metrics.requests_cancelled += 1
                    self._finish(seq)
                admitted = self.scheduler.admit(time.perf_counter())
            row_map = None
            if admitted or self.rows:
                start = len(self.rows)
                if admitted:
                    self._admit(admitted)
                B = len(self.rows)
                self.runner.step(B)
                if admitted:  # host work while the frame runs; the codec's stream orders it before the decode
                    self.codec.start(list(range(start, B)), [s.payload.ref_codes for s in admitted])
                self.codec.step(B)
                readback.push(B)
                row_map = list(self.rows)
            if ready is not None:
                self._deliver(*ready)
            ready = (readback.pop(), row_map) if row_map is not None else None

    def _admit(self, seqs: list[Sequence]) -> None:
        """Prefills `seqs` into the next free rows (the codec state is started after the frame's launch)."""
        start = len(self.rows)
        rows = list(range(start, start + len(seqs)))
        payloads = [s.payload for s in seqs]
        now = time.perf_counter()
        for p in payloads:
            p.stream.admitted = now - p.stream.submitted
        self.runner.add_rows(rows, [p.prompt for p in payloads], [p.params for p in payloads])
        self.rows.extend(seqs)

    def _deliver(self, out, row_map: list[Sequence]) -> None:
        now = time.perf_counter()
        emitted, done, pcm = out.emitted.tolist(), out.done.tolist(), out.pcm.numpy()
        outbox: list[tuple[RequestStream, object]] = []  # posted once per event loop, in order
        for i, seq in enumerate(row_map):
            payload = seq.payload
            if payload.finished:
                continue
            if emitted[i]:
                seq.frames += 1
                self.metrics.frames += 1
                if seq.first_audio is None:
                    seq.first_audio = now
                    payload.stream.first_audio = now - payload.stream.submitted
                    self.metrics.notify("on_first_audio", payload.stream.first_audio)
                outbox.append((payload.stream, pcm[i]))
            if done[i]:
                self.metrics.requests_finished += 1
                self.metrics.notify("on_finish", seq.frames * 0.08, now - payload.stream.submitted)
                with self._cv:
                    self._finish(seq, outbox)
        _post(outbox)

    def _finish(self, seq: Sequence, outbox: list | None = None) -> None:
        """Frees the sequence's row (the last row moves into it) and ends its stream (through `outbox` if
        given). Call with the lock."""
        row = self.rows.index(seq)
        last = len(self.rows) - 1
        self.runner.release_rows([row])
        if row != last:
            self.runner.move_row(last, row)
            self.codec.move_row(last, row)
            self.rows[row] = self.rows[last]
        self.rows.pop()
        self.scheduler.finish(seq.request_id)
        self._close(seq, outbox)

    @staticmethod
    def _close(seq: Sequence, outbox: list | None = None) -> None:
        if not seq.payload.finished:
            seq.payload.finished = True
            seq.payload.stream.finished = True
            if outbox is None:
                seq.payload.stream._put(_END)
            else:
                outbox.append((seq.payload.stream, _END))


def _post(outbox: list[tuple[RequestStream, object]]) -> None:
    """Hands each item to its stream, one wake-up per event loop (a frame step delivers to every running row;
    one `call_soon_threadsafe` each would write to the loop's wake-up pipe and take the GIL once per row)."""
    by_loop: dict = {}
    for stream, item in outbox:
        if stream._loop is None:
            stream._queue.put(item)
        else:
            by_loop.setdefault(stream._loop, []).append((stream._queue, item))
    for loop, items in by_loop.items():
        loop.call_soon_threadsafe(_put_all, items)


def _put_all(items: list) -> None:
    for q, item in items:
        q.put_nowait(item)


__all__ = ["AsyncEngine", "EngineError", "QueueFull", "RequestStream", "ServingConfig"]
