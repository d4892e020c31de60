"""Audio streaming: PCM chunks while the frames are being generated.

Each frame is decoded exactly and incrementally as soon as it exists (`engine/codec_runner.py`), so chunk
boundaries need no crossfade: the concatenated chunks are the offline decode. The chunk schedule only groups
frames for the caller: the default sends the first frame's 80 ms alone (lowest time to first audio), then
chunks of 2, 4, 8 and 16 frames, which keeps far ahead of real time.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass

import numpy as np
import torch

from .engine.codec_runner import CodecRunner
from .engine.readback import Readback
from .engine.runner import EngineConfig, ModelRunner
from .prompt import Prompt
from .sampling import SamplingParams

DEFAULT_SCHEDULE = (1, 2, 4, 8, 16)


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
        return self.start_frame * len(self.pcm) / max(self.num_frames, 1) / self.sample_rate


class Engine:
    """The fast path for one model: language-model runner and codec runner, sharing rows."""

    def __init__(self, model, decoder, config: EngineConfig):
        self.runner = ModelRunner(model, config)
        self.codec = CodecRunner(decoder, self.runner.state.codes, self.runner.config.buckets)
        self.sample_rate = 24000
        self.lock = threading.Lock()

    def capture_graphs(self) -> None:
        self.runner.capture_graphs()
        self.codec.capture_graphs()


def stream_one(engine: Engine, prompt: Prompt, params: SamplingParams, ref_codes: torch.Tensor | None,
               schedule: tuple[int, ...] = DEFAULT_SCHEDULE, pcm_format: str = "float32",
               started: float | None = None) -> Iterator[AudioChunk]:
    """Streams one request through row 0 of the engine (one request at a time; the serving engine batches).
    Arguments are checked now; the returned generator does the work."""
    if pcm_format not in ("float32", "int16"):
        raise ValueError(f"pcm_format must be 'float32' or 'int16', got {pcm_format!r}")
    if not schedule or any(not isinstance(n, int) or n < 1 for n in schedule):
        raise ValueError(f"chunk schedule must be positive frame counts, got {schedule!r}")
    return _stream(engine, prompt, params, ref_codes, schedule, pcm_format,
                   started if started is not None else time.perf_counter())


def _stream(engine: Engine, prompt: Prompt, params: SamplingParams, ref_codes: torch.Tensor | None,
            schedule: tuple[int, ...], pcm_format: str, started: float) -> Iterator[AudioChunk]:
    runner, codec = engine.runner, engine.codec
    with engine.lock:
        runner.add_rows([0], [prompt], [params])
        codec.start([0], [ref_codes])
        readback = Readback(runner, depth=2, pcm=codec.pcm, pcm_stream=codec.pcm_stream)

        def launch() -> None:
            runner.step(1)
            codec.step(1)
            readback.push(1)

        pending: list[np.ndarray] = []
        frame = index = 0
        try:
            launch()
            launch()  # the GPU stays one frame ahead of the host
            while True:
                out = readback.pop()
                finished = bool(out.done[0])
                if not finished:
                    launch()
                if out.emitted[0]:
                    pending.append(out.pcm[0].numpy())
                if finished or len(pending) >= schedule[min(index, len(schedule) - 1)]:
                    yield _chunk(pending, index, frame, started, finished, engine.sample_rate, pcm_format)
                    frame, index, pending = frame + len(pending), index + 1, []
                if finished:
                    break
        finally:
            while readback.pending:
                readback.pop()
            runner.release_rows([0])


def _chunk(frames: list[np.ndarray], index: int, start_frame: int, started: float, is_last: bool,
           sample_rate: int, pcm_format: str) -> AudioChunk:
    pcm = np.concatenate(frames) if frames else np.zeros(0, dtype=np.float32)
    if pcm_format == "int16":
        pcm = (np.clip(pcm, -1.0, 1.0) * 32767.0).round().astype(np.int16)
    return AudioChunk(pcm=pcm, sample_rate=sample_rate, index=index, start_frame=start_frame, num_frames=len(frames),
                      elapsed_s=time.perf_counter() - started, is_last=is_last)


async def astream(chunks: Iterator[AudioChunk]) -> AsyncIterator[AudioChunk]:
    """Runs a chunk generator in a worker thread and yields its chunks to the event loop as they come."""
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue = asyncio.Queue()
    end = object()

    def produce():
        try:
            for chunk in chunks:
                loop.call_soon_threadsafe(queue.put_nowait, chunk)
        except BaseException as e:  # delivered to the consumer
            loop.call_soon_threadsafe(queue.put_nowait, e)
        finally:
            loop.call_soon_threadsafe(queue.put_nowait, end)

    worker = threading.Thread(target=produce, daemon=True)
    worker.start()
    while (item := await queue.get()) is not end:
        if isinstance(item, BaseException):
            raise item
        yield item
