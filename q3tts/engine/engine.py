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
from .config import ContextLimit, EngineConfig
from .kv_blocks import OutOfBlocks
from .live import TEXT_TIMEOUT, LiveFeed, LiveTextTimeout, ParkedRow
from .prompt import Prompt
from .rows import RowTable, SlotTable, remove_rows
from .runner.codec import CodecRunner
from .runner.graphs import side_stream
from .runner.model_runner import ModelRunner, SwappedRow
from .runner.readback import FrameOut, Readback
from .scheduler import QueueFull, Scheduler
from .sequence import Sequence
from .stream import END, Channel, Delivery, Dispatcher, Frames, RequestStream

log = logging.getLogger("q3tts.engine")
_ids = itertools.count()
_THREADS_LOCK = threading.Lock()  # one_cpu_thread_on_gpu


class EngineError(RuntimeError):
    """The engine failed or was stopped while running a request."""


@dataclass
class EngineMetrics:
    """Counters the engine thread updates; `observers` are called from it (keep them cheap)."""

    frames: int = 0
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


class Engine:
    """One model's engine: the model runner and the codec runner on one device, their rows shared, driven by
    one thread. Built once per loaded model (`TTS.engine`); thread-safe to submit to from anywhere."""

    def __init__(self, model: Qwen3TTSModel, decoder: CodecDecoder, config: EngineConfig | None = None):
        self.config = config = config or EngineConfig()
        self.device = model.talker.codec_head.weight.device
        with device_scope(self.device):  # Triton launches on the current device, whatever the tensors'
            self.runner = ModelRunner(model, config, kv_blocks=2 if self.device.type == "cuda" else None)
            self.codec = CodecRunner(decoder, self.runner.state.codes, self.runner.config.buckets,
                                     cache_bytes=int(config.prefix_cache_gb * 2**30))
            self._size_kv_cache()  # (on a GPU: sized after a profiling run)
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
        limit, setting = self.context_limit()
        if prompt.num_positions + params.max_new_tokens > limit:
            raise RequestError(f"the prompt ({prompt.num_positions} positions) and max_new_tokens "
                               f"({params.max_new_tokens}) exceed the {limit} positions a request may hold here"
                               + (f" ({setting})" if setting else ""), param="max_new_tokens")

    @staticmethod
    def _ready(seq: Sequence, prompt: Prompt) -> None:
        """The request's prompt is known: it may be admitted."""
        p = seq.payload
        p.prompt, p.max_positions = prompt, prompt.num_positions + p.params.max_new_tokens
        seq.num_positions, seq.ready = prompt.num_positions, True

    def _wake(self) -> None:
        """A live request's text changed (called from the caller's thread)."""
        with self._cv:
            self._fed = True
            self._cv.notify()

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

    @property
    def num_parked(self) -> int:
        """Live rows waiting for their next text, off the batch (their KV blocks kept)."""
        return len(self._parked)

    @property
    def num_live(self) -> int:
        """Live requests whose text has not ended (parked or not)."""
        return len(self._live)

    # ---- start-up -----------------------------------------------------------------------------------------

    def _size_kv_cache(self) -> None:
        """Allocates the KV cache from the memory budget (see engine/config.py). On CUDA, what the largest batch
        needs besides the cache is measured first by running it once (a profiling run, as vLLM does)."""
        cfg, runner = self.config, self.runner
        if self.device.type != "cuda":
            return  # the runner's default cache
        peak = self._profile_peak_bytes()
        free, total = torch.cuda.mem_get_info(self.device)
        fraction = cfg.gpu_memory_utilization or 0.9
        # The graphs' pool will hold about the profiled peak; cuBLAS workspaces and fragmentation the margin.
        available = fraction * total - (total - free) - 1.2 * peak - 256 * 2**20 - 2 * cfg.prefix_cache_gb * 2**30
        if cfg.gpu_memory_utilization is not None and available < 16 * runner.kv_bytes_per_block:
            raise MemoryError(f"gpu_memory_utilization {cfg.gpu_memory_utilization} leaves no room for the KV cache "
                              f"({(total - free) / 2**30:.1f} of {total / 2**30:.1f} GiB in use, {peak / 2**30:.1f} "
                              f"GiB needed to run {cfg.max_rows} rows): raise it or lower max_rows")
        blocks = cfg.kv_blocks(runner.kv_bytes_per_block, runner.max_context, available)
        try:
            runner.allocate_kv_cache(blocks)
        except torch.OutOfMemoryError as e:
            raise MemoryError(f"the KV cache ({blocks * runner.kv_bytes_per_block / 2**30:.2f} GiB) does not fit "
                              f"this device: lower kv_cache_gb or gpu_memory_utilization") from e
        log.info("KV cache: %d blocks of %d positions (%.2f GiB)", blocks, cfg.block_size,
                 blocks * runner.kv_bytes_per_block / 2**30)

    def _capture_graphs(self) -> None:
        """On a GPU, in the engine's thread: the language model's graphs on a stream of their own, the codec's on
        the codec's stream (graphs.py)."""
        if self.device.type != "cuda":
            return
        torch.cuda.set_device(self.device)  # a new thread starts on device 0
        if self.config.use_graphs:
            self.runner.capture_graphs(side_stream(avoid=self.codec.pcm_stream))
            self.codec.capture_graphs()

    @torch.no_grad()
    def _profile_peak_bytes(self) -> int:
        """GPU memory the largest frame, prefill and codec step take beyond what is allocated now."""
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        base = torch.cuda.memory_allocated(self.device)
        largest = self.config.buckets[-1]
        self.runner.frame(largest)
        if self.config.prefill_buckets:
            self.runner.prefill(self.config.prefill_buckets[-1])
        self.codec.step(largest)
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device) - base
        self.runner.reset_state()
        self.codec.stream.reset(list(range(self.config.max_rows)))
        torch.cuda.empty_cache()
        return peak

    # ---- the frame loop (engine thread) ------------------------------------------------------------------

    def _run(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        one_cpu_thread_on_gpu(self.device)
        self.host_threads = torch.get_num_threads()
        try:
            with torch.no_grad():
                self._capture_graphs()
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

    # ---- live text (engine/live.py) -----------------------------------------------------------------------

    def _serve_live(self, ends: list) -> None:
        """Before a frame's launch: live requests whose prompt was built become admissible; those that waited too
        long for text end; parked rows whose next text arrived come back; running rows get the text that arrived,
        and those whose next text has not arrived are parked. Call with the lock."""
        self._fed, now = False, time.perf_counter()
        for seq in list(self._live.values()):
            p = seq.payload
            if not seq.ready and p.live.prompt is not None:
                self._ready(seq, p.live.prompt)
            if (not seq.ready or p.parked is not None) and p.live.expired(now):
                self._time_out(seq, ends)
        for seq in [seq for seq in self._parked if self._has_text(seq, seq.payload.parked.frame)]:
            self._unpark(seq)
        waiting = []
        for row, seq in enumerate(self.rows):
            if seq.payload.live is not None:
                self._write_text(row, seq)
                if not self._has_text(seq, int(self.table.positions[row]) - seq.payload.prompt.num_positions):
                    waiting.append(seq)
        if waiting:
            self._park(waiting)

    @staticmethod
    def _has_text(seq: Sequence, frame: int) -> bool:
        """Whether the live request's text for `frame` arrived (frame n adds trailing text id n, TTS_PAD after)."""
        feed = seq.payload.live
        return feed.ended or frame < len(feed.ids)

    def _write_text(self, row: int, seq: Sequence) -> None:
        """The row's trailing text that arrived since the last boundary, to the device; at the end TTS_EOS (unless
        the prompt holds it: `LiveFeed.whole`), and the runaway guard's limit for the whole text."""
        p = seq.payload
        if p.text_done:
            return
        feed = p.live
        ended, count = feed.ended, len(feed.ids)  # (ended first: once it is set, every id is in)
        ids = feed.ids[p.written:count] + ([self.runner.model.config.tts_eos_token_id]
                                           if ended and not feed.whole else [])
        if p.written + len(ids) > self.config.max_trailing:
            raise RuntimeError("a live request's text outgrew max_trailing (q3tts.api.live bounds it)")
        if ids:
            self.runner.set_trailing(row, p.written, ids)
            p.written += len(ids)
        if ended:
            p.text_done = True
            if feed.stop_after is not None:
                self.slots.stop_after[p.slot] = feed.stop_after

    def _park(self, seqs: list[Sequence]) -> None:
        """Takes these live rows off the batch until their text arrives (their held frames go out now)."""
        for seq in seqs:
            row, p = self.rows.index(seq), seq.payload
            seq.num_positions = int(self.table.positions[row])
            state, blocks = self.runner.park(row)
            p.parked = ParkedRow(state, blocks, self.codec.swap_out(row), seq.num_positions - p.prompt.num_positions)
            self._flush.append(p.slot)
            self._compact([seq], released=False)
            self._parked.append(seq)

    def _unpark(self, seq: Sequence) -> None:
        """A parked row back into the next free row, as it was; its new text written."""
        row, p, kv = len(self.rows), seq.payload, self.runner.kv
        parked, p.parked = p.parked, None
        self._parked.remove(seq)
        self.runner.unpark(row, parked.state, parked.blocks)
        self.codec.swap_in(row, parked.codec)
        self.rows.append(seq)
        self.table.set(row, seq.num_positions, p.max_positions, len(kv.rows[row]) * kv.block_size, p.slot)

    def _time_out(self, seq: Sequence, ends: list) -> None:
        """A live request that waited longer than its limit for text ends, its stream with LiveTextTimeout."""
        p = seq.payload
        error = LiveTextTimeout(f"no text arrived for {p.live.max_wait_s:g} s (the live request's max_text_wait_s)")
        self.metrics.finish_reasons[TEXT_TIMEOUT] += 1
        if p.parked is None:  # (waiting for its first text: not admitted)
            self.scheduler.cancel(seq.request_id)
            self._end(seq, TEXT_TIMEOUT, error)
            return
        self._leave([(seq, TEXT_TIMEOUT)], ends)
        ends.insert(len(ends) - 1, (p.channel, error))

    def _next_text_deadline(self) -> float | None:
        """Seconds until the first live request waiting for text (not admitted yet, or parked) waits too long."""
        now = time.perf_counter()
        waits = [seq.payload.live.arrived + seq.payload.live.max_wait_s - now for seq in self._live.values()
                 if not seq.ready or seq.payload.parked is not None]
        return max(min(waits), 0.0) + 1e-3 if waits else None

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

    def _join(self, resumed: list[Sequence], admitted: list[Sequence]) -> None:
        """Brings preempted requests back into the next free rows, then prefills the admitted ones after them
        (the scheduler admitted only what the free KV blocks hold). Call with the lock."""
        kv = self.runner.kv
        for seq in resumed:
            row, p = len(self.rows), seq.payload
            self.runner.swap_in(row, p.swapped[0])
            self.runner.grow(row, min(seq.num_positions + 1, p.max_positions))
            self.rows.append(seq)
            self.table.set(row, seq.num_positions, p.max_positions, len(kv.rows[row]) * kv.block_size, p.slot)
        if admitted:
            start = len(self.rows)
            now = time.perf_counter()
            for seq in admitted:
                seq.payload.channel.admitted = now - seq.payload.channel.submitted
            self.runner.add_rows(list(range(start, start + len(admitted))), [s.payload.prompt for s in admitted],
                                 [s.payload.params for s in admitted])
            for row, seq in enumerate(admitted, start):
                self._open(row, seq)
            self.rows.extend(admitted)

    def _open(self, row: int, seq: Sequence) -> None:
        """The admitted request's slot, and its row's entry."""
        p, kv = seq.payload, self.runner.kv
        p.slot = self.slots.open(seq, p.channel, p.params.max_new_tokens, p.stop_after, p.stop_on_repeats,
                                 seq.realtime)
        self.delivery.ensure(self.slots.size)
        self.delivery.start(p.slot)
        self.table.set(row, seq.num_positions, p.max_positions, len(kv.rows[row]) * kv.block_size, p.slot)

    def _start_codec(self, start: int, resumed: list[Sequence], admitted: list[Sequence]) -> None:
        """Codec state of the rows that joined at `start..` (on the codec's stream: after the decode in flight,
        before their first)."""
        for row, seq in enumerate(resumed, start):
            self.codec.swap_in(row, seq.payload.swapped[1])
            seq.payload.swapped = None
        if admitted:
            first = start + len(resumed)
            tails = self.codec.start(list(range(first, first + len(admitted))),
                                     [s.payload.ref_codes for s in admitted])
            for seq, tail in zip(admitted, tails):
                seq.payload.channel.ref_tail = tail

    def _grow(self) -> None:
        """Gives every running row the KV blocks of its next frame, oldest request first; when none are free,
        the newest running request is preempted (swapped out) until they are. Call with the lock."""
        kv, table, B = self.runner.kv, self.table, len(self.rows)
        wanted = table.wanted(B)
        needy = np.flatnonzero(table.capacity[:B] < wanted)
        if not len(needy):
            return
        blocks = -(-wanted[needy] // kv.block_size)
        if int((blocks - table.capacity[needy] // kv.block_size).sum()) <= kv.num_free:  # (the usual case)
            self.runner.grow_rows(needy.tolist(), wanted[needy].tolist())
            table.capacity[needy] = blocks * kv.block_size
            return
        for seq in sorted((self.rows[row] for row in needy.tolist()), key=lambda s: s.order):
            while seq.request_id in self.scheduler.running:
                row = self.rows.index(seq)
                try:
                    self.runner.grow(row, int(table.wanted(row + 1)[row]))
                    table.capacity[row] = len(kv.rows[row]) * kv.block_size
                    break
                except OutOfBlocks:
                    self._swap_out(self.scheduler.preempt())

    def _swap_out(self, seq: Sequence) -> None:
        if seq.payload.parked is not None:  # (its text had not arrived: its blocks go to host memory too)
            parked, seq.payload.parked = seq.payload.parked, None
            self._parked.remove(seq)
            seq.payload.swapped = (self.runner.swap_out_parked(parked.state, parked.blocks), parked.codec)
            self.metrics.preemptions += 1
            return
        row = self.rows.index(seq)
        seq.num_positions = int(self.table.positions[row])  # (the scheduler weighs its return by it)
        seq.payload.swapped = (self.runner.swap_out(row), self.codec.swap_out(row))
        self._flush.append(seq.payload.slot)
        self._compact([seq], released=False)
        self.metrics.preemptions += 1
        log.info("preempted %s (KV cache full, %d rows running)", seq.request_id, len(self.rows))

    def _settle(self, out: FrameOut, slots: np.ndarray, ends: list
                ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Takes frame n's codes and flags (`slots`: its rows' requests): each live request's frame is counted
        (and its run of identical frames); finished requests leave (their last audio went out with frame n - 1).
        Returns (the frame's codes, and the index in the frame and slot of each frame produced), which `_audio`
        hands out. Call with the lock."""
        emitted, done, codes = out.emitted.numpy(), out.done.numpy(), out.codes.numpy()
        t = self.slots
        live = t.live[slots]
        index = np.flatnonzero(live & emitted)
        produced = slots[index]
        t.record(produced, codes[index])
        self.metrics.frames += len(index)
        over = (t.frames[slots] >= t.stop_after[slots]) | (t.repeats[slots] >= t.stop_on_repeats[slots])
        ending = np.flatnonzero(live & (done | over))
        if len(ending):
            self._finish([(int(slots[i]), bool(done[i])) for i in ending.tolist()], ends)
        return codes, index, produced

    def _finish(self, finished: list[tuple[int, bool]], ends: list) -> None:
        """The requests in these (slot, done) leave with their finish reasons, in order. Call with the lock."""
        t, now, leaving = self.slots, time.perf_counter(), []
        for slot, done in finished:
            frames = int(t.frames[slot])
            reason = _finish_reason(done, frames, int(t.max_new[slot]), int(t.stop_after[slot]),
                                    int(t.repeats[slot]), int(t.stop_on_repeats[slot]))
            self.metrics.requests_finished += 1
            self.metrics.finish_reasons[reason] += 1
            self.metrics.notify("on_finish", frames * 0.08, now - t.channels[slot].submitted)
            leaving.append((t.seqs[slot], reason))
        self._leave(leaving, ends)

    def _audio(self, pcm: np.ndarray, codes: np.ndarray, index: np.ndarray, slots: np.ndarray) -> None:
        """Each produced frame (row index[i] of pcm [n, 1920] and codes [n, 16], for slots[i]) to its stream's held
        frames, as its codes only for a stream cancelled or failed meanwhile (`muted`); first audio noted."""
        if not len(index):
            return
        t = self.slots
        audio = ~t.muted[slots]
        self.delivery.add(pcm, codes, slots, index, audio)
        first = slots[audio & np.isnan(t.first_audio[slots])]
        if len(first):
            now = time.perf_counter()
            t.first_audio[first] = now
            for slot in first.tolist():
                channel = t.channels[slot]
                channel.first_audio = now - channel.submitted
                self.metrics.notify("on_first_audio", channel.first_audio)

    def _hand_out(self, produced: np.ndarray | None) -> Frames | None:
        """The frames that go out now (engine/stream.py `Delivery`): of the streams that got one, and all held by
        streams that end or were preempted (`_flush`) at this boundary."""
        delivery = self.delivery
        slots = produced if produced is not None else np.zeros(0, dtype=np.int64)
        go, held, counts = delivery.hand_out(slots, time.perf_counter(), self._flush)
        self._flush = []
        if not len(go):
            return None
        channels = self.slots.channels
        return Frames([channels[slot] for slot in go.tolist()], held, counts, tuple(delivery.ring))

    def _min_lead(self, now: float) -> float:
        """The scheduler's smallest lead over real time of the running streams (`Sequence.lead`), from the slots."""
        return self.slots.min_lead(self.table.slot[:len(self.rows)], now)

    def _drop_abandoned(self) -> None:
        """Ends the requests whose streams were dropped unread or whose event loop closed. Call with the lock."""
        while self._dropped:
            self._cancel(self._dropped.popleft())

    def _leave_cancelled(self, ends: list) -> None:
        """The running requests cancelled since the last boundary leave, in their rows' order (a preempted one
        when it is back in a row). Call with the lock."""
        waiting = [seq for seq in dict.fromkeys(self._cancelling) if not seq.payload.channel.finished]
        running = sorted((seq for seq in waiting if seq.payload.swapped is None and seq.payload.parked is None),
                         key=self.rows.index) + [seq for seq in waiting if seq.payload.parked is not None]
        self._cancelling = [seq for seq in waiting if seq.payload.swapped is not None]
        if running:
            self.metrics.requests_cancelled += len(running)
            self._leave([(seq, "cancelled") for seq in running], ends)

    def _leave(self, leaving: list[tuple[Sequence, str]], ends: list) -> None:
        """Frees the rows of these (sequence, finish reason), in order, and ends their streams through `ends`. A
        request preempted at this boundary has no row: it leaves the swapped ones. Call with the lock."""
        self._compact([seq for seq, _ in leaving if seq.payload.swapped is None and seq.payload.parked is None])
        for seq, reason in leaving:
            if seq.payload.swapped is not None:
                self.scheduler.swapped.remove(seq)
            if seq.payload.parked is not None:
                self._parked.remove(seq)
                self.runner.kv.release_blocks(seq.payload.parked.blocks)
                seq.payload.parked = None
            self.scheduler.finish(seq.request_id)
            self._end(seq, reason, outbox=ends)

    def _compact(self, leaving: list[Sequence], released: bool = True) -> None:
        """Removes the rows of `leaving` (`rows.remove_rows`: as one after the other, the running rows staying
        0..B-1 and each request's row, so its batch neighbours, as before) with one batch of device copies
        (`released`: their KV blocks are freed here, else they were)."""
        if leaving:
            gone, moves = remove_rows(self.rows, leaving)
            self.runner.remove_rows(gone if released else [], moves)
            self.codec.move_rows(moves)
            self.table.move(moves)

    def _end(self, seq: Sequence, reason: str, error: BaseException | None = None, outbox: list | None = None
             ) -> None:
        """Ends the request's stream (through `outbox` if given; its held frames go out first there). Call with the
        lock."""
        channel, p = seq.payload.channel, seq.payload
        if channel.finished:
            return
        channel.finished, channel.finish_reason = True, reason
        p.swapped = None
        self._live.pop(seq.request_id, None)
        frames = None
        if p.slot is not None:
            seq.frames = int(self.slots.frames[p.slot])  # (what the slot counted, on the sequence from now on)
            first = self.slots.first_audio[p.slot]
            seq.first_audio = None if np.isnan(first) else float(first)
            self.slots.close(p.slot, muted=reason in ("cancelled", "error"))
            if outbox is not None:
                self._flush.append(p.slot)  # (what it holds goes out before its end)
            elif self.delivery.count[p.slot] and self._owns_delivery():  # (ended at once: what it holds, as codes)
                _, held, counts = self.delivery.take(p.slot)
                frames = Frames([channel], held, counts, tuple(self.delivery.ring))
            p.slot = None
        items = [(channel, error)] if error is not None else []
        items.append((channel, END))
        if outbox is None:
            self._dispatcher.put(frames, items)  # (after what the engine handed out before: in order)
        else:
            outbox.extend(items)

    def _owns_delivery(self) -> bool:
        """Whether this thread may touch the hand-out state (the engine thread's, outside the lock too): the engine
        thread, or any once it ended. (Another thread ending a request at once leaves what it holds: a preempted
        request's frames went out at its preemption.)"""
        return threading.current_thread() is self._thread or not self._thread.is_alive()


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


def _finish_reason(done: bool, frames: int, max_new: int, stop_after: int, repeats: int, stop_on_repeats: int
                   ) -> str | None:
    """Why a request ends after this frame, if it does (`frames` delivered so far, `repeats` identical frames in a
    row; the runaway guard's limits NEVER when unset)."""
    if done:
        return "length" if frames + 1 >= max_new else "eos"
    if frames >= stop_after:
        return "runaway"
    if repeats >= stop_on_repeats:
        return "repetition"
    return None


def _stop_at_exit(ref: weakref.ref) -> None:
    engine = ref()
    if engine is not None:
        engine.stop()


__all__ = ["Engine", "EngineError", "EngineMetrics", "QueueFull", "RequestStream"]
