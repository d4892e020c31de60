"""The engine: continuous batching of every request of one loaded model, streaming their audio.

Every entry point submits here (the drop-in official methods, `TTS.synthesize`, `stream`, the server). A
background thread runs the frame loop; at every frame boundary it:
  1. gives each row the KV block it needs for the next frame, preempting the newest request when the cache is
     full (its row is swapped to host memory and comes back later exactly where it stopped);
  2. launches the next frame (the captured LM frame and codec step);
  3. while that frame runs: settles the frame just finished (rows that ended leave, the last row moving into
     the hole so the running rows stay 0..B-1; cancelled and dropped requests too), hands its 80 ms of PCM to
     each request (a stream far enough ahead of real time gets its frames in groups: stream.py), then brings
     back preempted requests and admits waiting ones as the scheduler decides (batched prefill, queued behind
     the frame).
Each request's codes depend only on its own prompt, parameters and seed, never on what else is in the batch (its
audio too, up to float rounding: the codec decodes the batch's rows together, ~1e-6).
A live request (engine/live.py) gets its text at the boundaries too: a row whose next text token has not arrived
leaves the batch (parked) until it does, holding its KV blocks.
"""

from __future__ import annotations

import asyncio
import atexit
import collections
import contextlib
import itertools
import logging
import sys
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from ..errors import RequestError
from ..models.codec_decoder import CodecDecoder
from ..models.qwen3_tts import Qwen3TTSModel
from ..sampling import SamplingParams
from .admission import Admission
from .config import ContextLimit, EngineConfig
from .live import LiveFeed, ParkedRow
from .live_rows import LiveRows
from .prompt import Prompt
from .rows import RowTable, SlotTable
from .runner.codec import CodecRunner
from .runner.memory import capture_graphs, size_kv_cache
from .runner.model_runner import ModelRunner
from .runner.readback import FrameOut, Readback
from .runner.row_state import SwappedRow
from .scheduler import QueueFull, Scheduler
from .sequence import Sequence
from .settlement import Settlement
from .stream import Channel, Delivery, Dispatcher, RequestStream

log = logging.getLogger("q3tts.engine")
_ids = itertools.count()
_THREADS_LOCK = threading.Lock()  # one_cpu_thread_on_gpu


class EngineError(RuntimeError):
    """The engine failed or was stopped while running a request."""


@dataclass
class EngineMetrics:
    """Counters the engine thread updates; `observers` are called from it (keep them cheap)."""

    frames: int = 0
    requests_submitted: int = 0  # (counted by `submit`, on the caller's thread, under the engine's lock)
    requests_finished: int = 0
    requests_cancelled: int = 0
    preemptions: int = 0
    errors: int = 0
    max_batch: int = 0  # the most rows that ran one frame together
    finish_reasons: collections.Counter = field(default_factory=collections.Counter)  # eos, length, runaway, ...
    observers: list = field(default_factory=list)  # objects with on_first_audio(s) / on_finish(audio_s, wall_s)

    def notify(self, event: str, *args: float) -> None:
        for observer in self.observers:
            getattr(observer, event, lambda *_: None)(*args)


@dataclass
class _Payload:
    prompt: Prompt | None  # (a live request's: None until its first text arrived)
    params: SamplingParams
    ref_codes: torch.Tensor | None
    channel: Channel
    max_positions: int  # prompt + max_new_tokens: the row never writes KV beyond
    stop_after: int | None = None  # the runaway guard's frame limit
    stop_on_repeats: int | None = None  # ... and how many identical frames in a row end the request
    slot: int | None = None  # its slot in the engine's SlotTable, from its admission to its end
    swapped: tuple[SwappedRow, list[torch.Tensor]] | None = None  # while preempted
    live: LiveFeed | None = None  # a live request's text (engine/live.py)
    written: int = 0  # live: trailing ids on the device so far (TTS_EOS included once written)
    text_done: bool = False  # live: all of it is on the device
    parked: ParkedRow | None = None  # live: while waiting for text off the batch


class Engine(LiveRows, Admission, Settlement):
    """One model's engine: the model runner and the codec runner on one device, their rows shared, driven by
    one thread. Built once per loaded model (`TTS.engine`); thread-safe to submit to from anywhere. Its parts:
    live text at the boundaries (live_rows.py), rows joining and preempted (admission.py), frames settled and
    handed out, requests leaving (settlement.py); here the public side and the frame loop that calls them."""

    def __init__(self, model: Qwen3TTSModel, decoder: CodecDecoder, config: EngineConfig | None = None):
        self.config = config = config or EngineConfig()
        self.device = model.talker.codec_head.weight.device
        with device_scope(self.device):  # Triton launches on the current device, whatever the tensors'
            self.runner = ModelRunner(model, config, kv_blocks=2 if self.device.type == "cuda" else None)
            self.codec = CodecRunner(decoder, self.runner.state.codes, self.runner.config.buckets,
                                     cache_bytes=int(config.prefix_cache_gb * 2**30))
            size_kv_cache(self.runner, self.codec, config)  # (on a GPU: after a profiling run)
        self.scheduler = Scheduler(config.max_rows, config.max_waiting, self.runner.kv, config.max_prefill_tokens,
                                   config.prefill_seconds_per_token, config.safety_seconds,
                                   lambda seq: self.runner.prefill_tokens(seq.payload.prompt), self._min_lead)
        self.metrics = EngineMetrics()
        self.rows: list[Sequence] = []  # rows[i]: the sequence in batch row i
        # Their host state as arrays (engine/rows.py): by row, by request (slot), and the slots' stream hand-out
        self.table = RowTable(config.max_rows)
        self.slots = SlotTable(2 * config.max_rows)
        self.delivery = Delivery(config.stream_hold_s, self.slots.size)
        self.healthy = True
        self.host_threads = 0  # torch's CPU threads in the engine's thread (set by it: 1 on a GPU)
        self._cv = threading.Condition()
        self._dropped: collections.deque[str] = collections.deque()  # ended by RequestStream finalizers
        self._dispatcher = Dispatcher(lambda channel: self._dropped.append(channel.request_id))
        self._flush: list[int] = []  # slots ended or preempted since the last hand-out: their held frames go out now
        self._cancelling: list[Sequence] = []  # running requests cancelled: they leave at the next boundary
        self._launched: float | None = None  # when the last frame was launched (None: none running since)
        self._frame_seconds = 0.0  # the time between two launches with no prefill between: how long a frame takes
        self._joined = False  # requests joined (prefilled or swapped in) since the last launch
        self._stopping = False
        self._live: dict[str, Sequence] = {}  # live requests not ended, by id
        self._parked: list[Sequence] = []  # live rows waiting for text, off the batch
        self._fed = False  # a live request's text changed since the last boundary
        self._saved_switch_interval: float | None = None
        # The thread captures the CUDA graphs, then runs the frame loop (graphs.py says why there).
        self._built, self._build_error = threading.Event(), None
        self._thread = threading.Thread(target=self._run, name="q3tts-engine", daemon=True)
        self._thread.start()
        self._built.wait()
        if self._build_error is not None:
            self._dispatcher.close()
            raise self._build_error
        atexit.register(_stop_at_exit, weakref.ref(self))

    # ---- limits -------------------------------------------------------------------------------------------

    def context_limit(self) -> ContextLimit:
        """The talker positions one request may hold: the least of max_context, what the KV cache holds for one
        request alone, and the model's limit."""
        cfg = self.config
        kv_setting = "gpu_memory_utilization" if cfg.gpu_memory_utilization and not cfg.kv_cache_gb \
            else "kv_cache_gb"
        limits = [(self.runner.model.talker.config.max_position_embeddings, None),
                  (self.runner.max_context, "max_context"),
                  (self.runner.kv.capacity_positions - cfg.block_size, kv_setting)]
        return ContextLimit(*min(limits, key=lambda limit: limit[0]))

    # ---- public -------------------------------------------------------------------------------------------

    def start(self) -> None:
        """Marks the engine as running (`submit` does too): the interpreter's thread switch interval is lowered
        (`EngineConfig.switch_interval`) until `stop`."""
        with self._cv:
            if self._saved_switch_interval is not None or self._stopping or self.config.switch_interval is None:
                return
            self._saved_switch_interval = sys.getswitchinterval()
            sys.setswitchinterval(min(self._saved_switch_interval, self.config.switch_interval))

    def stop(self) -> None:
        """Stops the engine for good: requests still running or waiting end with EngineError."""
        with self._cv:
            self._stopping = True
            self._cv.notify()
        if self._thread is not threading.current_thread():
            self._thread.join()
        if self._saved_switch_interval is not None:
            sys.setswitchinterval(self._saved_switch_interval)
            self._saved_switch_interval = None
        self._fail_all(EngineError("the engine was stopped"))
        self._dispatcher.close()

    def submit(self, prompt: Prompt, params: SamplingParams, ref_codes: torch.Tensor | None = None,
               request_id: str | None = None, asyncio_loop: bool = False, stop_after: int | None = None,
               stop_on_repeats: int | None = None, realtime: bool = True, live: LiveFeed | None = None
               ) -> RequestStream:
        """Queues a request and returns its stream. With `asyncio_loop=True` (call from a running event loop)
        the stream is read with `async for`, otherwise with `for` from any thread. `realtime=False`: its audio is
        read whole, not played as it comes (the scheduler keeps no lead for it). `stop_after` frames, or
        `stop_on_repeats` identical frames in a row, end it early (finish reason "runaway" / "repetition"). Raises
        QueueFull when the queue is at its limit, RequestError when the request cannot fit this engine,
        EngineError when the engine has failed or was stopped. `live`: the request's text arrives while it runs
        (engine/live.py; `prompt` is None: the feed brings it); `stop_after` is then the feed's, at its end."""
        if not self.healthy:
            raise EngineError("the engine has failed (its error ended the requests it was running): TTS.close() lets "
                              "it go, and the next request builds a new one")
        if live is None:
            self.check_prompt(prompt, params)
        request_id = request_id or f"req-{next(_ids)}"
        channel = Channel(request_id, asyncio.get_running_loop() if asyncio_loop else None)
        payload = _Payload(None, params, ref_codes, channel, 0, stop_after, stop_on_repeats, live=live)
        seq = Sequence(request_id, 0, time.perf_counter(), payload=payload, realtime=realtime, ready=False)
        if live is None:
            self._ready(seq, prompt)
        self.start()
        with self._cv:
            if self._stopping:
                raise EngineError("the engine was stopped")
            self.scheduler.add(seq)
            self.metrics.requests_submitted += 1
            if live is not None:
                self._live[request_id] = seq
                live.wake = self._wake
                self._fed = True  # (its text may have come before)
            self._cv.notify()
        return RequestStream(channel, self.cancel, self._dropped.append)

    def check_prompt(self, prompt: Prompt, params: SamplingParams) -> None:
        """Raises RequestError if the prompt's text or its positions cannot fit this engine."""
        if len(prompt.trailing_ids) > self.config.max_trailing:
            raise RequestError(f"text is too long for this engine ({len(prompt.trailing_ids)} text tokens after "
                               f"the prompt; at most {self.config.max_trailing})", param="text")
        limit, setting = context = self.context_limit()
        if params.max_new_tokens > context.room(prompt.num_positions):
            raise RequestError(f"the prompt ({prompt.num_positions} positions) and max_new_tokens "
                               f"({params.max_new_tokens}) exceed the {limit} positions a request may hold here"
                               + (f" ({setting})" if setting else ""), param="max_new_tokens")

    @staticmethod
    def _ready(seq: Sequence, prompt: Prompt) -> None:
        """The request's prompt is known: it may be admitted."""
        p = seq.payload
        p.prompt, p.max_positions = prompt, prompt.num_positions + p.params.max_new_tokens
        seq.num_positions, seq.ready = prompt.num_positions, True

    def cancel(self, request_id: str) -> None:
        """Ends a request: a waiting one now, a running one at the next frame boundary. On the engine's own thread
        (a stream's `finally` run by the garbage collector there, perhaps inside the loop's critical section,
        whose lock is re-entrant) it goes through the drop queue instead, as a dropped stream's does."""
        if threading.current_thread() is self._thread:
            self._dropped.append(request_id)
            return
        with self._cv:
            self._cancel(request_id)
            self._cv.notify()

    def _cancel(self, request_id: str) -> None:
        """`cancel`'s work, with the lock: a waiting or swapped request ends now, a running one (in a row, or
        parked) leaves at the next boundary."""
        seq = self.scheduler.cancel(request_id)
        if seq is not None and seq not in self.rows and seq.payload.parked is None:
            self.metrics.requests_cancelled += 1
            self._end(seq, "cancelled")
        elif seq is not None:
            self._cancelling.append(seq)

    @property
    def num_running(self) -> int:
        return len(self.rows)

    @property
    def num_waiting(self) -> int:
        return self.scheduler.num_waiting

    # ---- the frame loop (engine thread) ------------------------------------------------------------------

    def _run(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        one_cpu_thread_on_gpu(self.device)
        self.host_threads = torch.get_num_threads()
        try:
            with torch.no_grad():
                capture_graphs(self.runner, self.codec, self.config)
        except BaseException as e:  # raised by the constructor
            self._build_error = e
        self._built.set()
        if self._build_error is not None:
            return
        try:
            with torch.no_grad():
                self._loop()
        except Exception as e:  # the device is in an unknown state: fail everything, refuse new work
            log.exception("engine failed")
            self.healthy = False
            self.metrics.errors += 1
            self._fail_all(EngineError(f"engine failed: {e}"))

    def _fail_all(self, error: EngineError) -> None:
        """Ends every running, waiting and preempted request's stream with `error`."""
        with self._cv:
            seqs = [*self.rows, *self._parked, *self.scheduler.waiting, *self.scheduler.swapped]
            self.scheduler.waiting.clear()
            self.scheduler.swapped.clear()
            for seq in seqs:
                self._end(seq, "error", error)

    def _loop(self) -> None:
        # Each iteration: grow, launch frame n + 1 for the rows as they are, then, while it runs: settle frame n
        # (its codes and flags, read back last time: rows that ended leave, having run frame n + 1 as padding),
        # hand out frame n's audio once its decode is done (the decode runs beside frame n + 1's language model,
        # on the codec's stream), admit (their prefill queues behind frame n + 1: they join frame n + 2), post
        # the hand-out (the hand-out thread reads the frames out to the streams) and wait for frame n + 1's
        # codes. The host's bookkeeping thus overlaps the device's frame instead of following it. An idle engine
        # admits first and launches at once. The rows' state is arrays (engine/rows.py): a boundary's work is a
        # few vector operations plus Python for the rows that change (join, leave, grow a block).
        readback = Readback(self.runner, depth=2, pcm=self.codec.pcm, pcm_stream=self.codec.pcm_stream)
        last: tuple[FrameOut, np.ndarray] | None = None
        while True:
            ends: list[tuple[Channel, object]] = []
            produced = None
            with self._cv:
                while not (self._stopping or self.rows or self.scheduler.has_work() or last or self._dropped
                           or self._fed or self._cancelling):
                    timeout = self._next_text_deadline()
                    if not self._cv.wait(timeout) and timeout is not None:
                        break  # a live request waited too long for its text
                if self._stopping:
                    return
                if self._live:
                    self._serve_live(ends)
                if self.rows:
                    self._grow()
            row_slots = self._launch(readback) if self.rows else None
            if row_slots is None:
                self._launched, self._frame_seconds = None, 0.0
            with self._cv:
                if last is not None:
                    produced = self._settle(*last, ends)
                self._drop_abandoned()
                if self._cancelling:
                    self._leave_cancelled(ends)
            if produced is not None:
                self._audio(readback.pop_pcm().numpy(), *produced)
            with self._cv:
                frames = self._hand_out(produced[2] if produced else None)
                self.slots.boundary()
                start = len(self.rows)
                resumed, admitted = self.scheduler.admit(time.perf_counter(), self._frame_seconds)
                self._joined = self._joined or bool(resumed or admitted)
                self._join(resumed, admitted)
                self._start_codec(start, resumed, admitted)
                # Posted after the admissions, as the wait for the device begins (the hand-out thread and the readers'
                # event loops then take the interpreter's lock while this thread does not need it), and with the lock
                # (a stream ended at once from another thread gets its end after this)
                self._dispatcher.put(frames, ends)
            last = (readback.pop(wait_pcm=False), row_slots) if row_slots is not None else None

    def _launch(self, readback: Readback) -> np.ndarray:
        """Launches the next frame of rows 0..B-1 and its decode; returns the rows' slots in that frame."""
        now = time.perf_counter()
        if self._launched is not None and not self._joined:  # (a prefill between would count as a slow frame)
            self._frame_seconds = now - self._launched
        self._launched, self._joined = now, False
        B = len(self.rows)
        self.runner.step(B)
        self.codec.step(B)
        readback.push(B)
        self.metrics.max_batch = max(self.metrics.max_batch, B)
        self.table.advance(B)
        return self.table.slot[:B].copy()


def device_scope(device: torch.device) -> contextlib.AbstractContextManager:
    """`device` as the thread's current CUDA device meanwhile (Triton kernels launch there, and PyTorch's current
    stream is that device's): needed off cuda:0 in any thread that launches work."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


def one_cpu_thread_on_gpu(device: torch.device) -> None:
    """For a thread that drives work on `device`: on a GPU its CPU tensors are bookkeeping, so it runs torch's CPU
    ops on one thread and keeps no OpenMP team of its own. A team stays alive with its thread, and every other
    thread's parallel CPU op (a burst's prompts, say) ran 3-5x slower beside it (docs/perf-notes.md, entry 72). Per
    thread: the other threads' settings are untouched. On the CPU the thread keeps every CPU thread."""
    if device.type != "cuda":
        return
    torch.get_num_threads()  # this thread's lazy start-up, which would take the default below, happens first
    with _THREADS_LOCK:  # (two engines starting together: neither reads the other's passing 1 as the default)
        default = _in_new_thread(torch.get_num_threads)  # what threads started later get
        torch.set_num_threads(1)
        # torch.set_num_threads also makes its value the default of threads started later (each reads it when it
        # first computes): put that back from another thread, so that the one thread stays this thread's own.
        _in_new_thread(torch.set_num_threads, default)


def _in_new_thread(fn: Callable[..., Any], *args: Any) -> Any:
    result = []
    thread = threading.Thread(target=lambda: result.append(fn(*args)), name="q3tts-threads")
    thread.start()
    thread.join()
    return result[0]


def _stop_at_exit(ref: weakref.ref) -> None:
    engine = ref()
    if engine is not None:
        engine.stop()


__all__ = ["Engine", "EngineError", "EngineMetrics", "QueueFull", "RequestStream"]
