"""`EngineHost`: a loaded model's one engine, built on first use, and the way requests get onto it (prompts built
on a CUDA stream of their own, those asked for by several threads at once in one batch, then submitted). `TTS` is
one; every entry point, the drop-in's included, submits through these methods."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Self

import torch

from ..engine import Engine, EngineConfig, RequestStream
from ..engine.config import ContextLimit
from ..engine.prompt import Prompt
from ..models.qwen3_tts import Qwen3TTSModel
from ..models.speech_tokenizer import SpeechTokenizer
from ..request.builder import Request
from ..request.prompt import build_prompts
from .pieces import PieceStream


class EngineHost:
    """A model and the engine that serves it. `reference`: the offline entry points run the eager reference loop
    (`q3tts.reference`) instead; the engine still serves streams."""

    def __init__(self, model: Qwen3TTSModel, speech_tokenizer: SpeechTokenizer, engine_config: EngineConfig | None,
                 reference: bool):
        self.model = model
        self.speech_tokenizer = speech_tokenizer
        self.device = model.talker.codec_head.weight.device
        self.engine_config = engine_config or EngineConfig()
        self.reference = reference
        self._engine: Engine | None = None
        self._engine_lock = threading.Lock()
        self._prompt_stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self._prompts = PromptCombiner(lambda requests: self.prepare_many(requests))  # (looked up per call)

    @property
    def engine(self) -> Engine:
        """The model's engine, built on first use (on a GPU that captures its CUDA graphs: seconds)."""
        if self._engine is None:
            with self._engine_lock:
                if self._engine is None:
                    self._engine = Engine(self.model, self.speech_tokenizer.decoder, self.engine_config)
        return self._engine

    def prepare_engine(self) -> Engine:
        """Builds the engine now (fused weights, KV cache sized from the memory budget, CUDA graphs of every batch
        bucket) and starts its thread, rather than on the first request."""
        self.engine.start()
        return self.engine

    @property
    def has_engine(self) -> bool:
        """Whether the engine is built (it is built on first use)."""
        return self._engine is not None

    def configure_engine(self, config: EngineConfig) -> None:
        """Sets the engine's settings before it is built (after `close()`, for the next one)."""
        with self._engine_lock:
            if self._engine is not None:
                raise RuntimeError("the engine is already built: close() it first")
            self.engine_config = config

    def close(self) -> None:
        """Stops the engine (requests still open end with EngineError) and lets it go; the model stays loaded and
        the next request builds a new engine."""
        with self._engine_lock:
            engine, self._engine = self._engine, None
        if engine is not None:
            engine.stop()

    def context_limit(self) -> ContextLimit:
        """The positions one request may hold, and the setting that bounds them (the request builder's length
        rule takes it as a value): the engine's (built if need be), or on the reference loop the model's own."""
        if self.reference:
            return ContextLimit(self.model.config.talker_config.max_position_embeddings, None)
        return self.engine.context_limit()

    def prepare(self, request: Request) -> Prompt:
        """The request's prompt embeddings (see `prepare_many`), built with those that other threads ask for
        meanwhile (`PromptCombiner`: 64 live sessions whose first words come together build their prompts in a
        few batches, not one after another)."""
        return self._prompts.build(request)

    @property
    def num_prompts_waiting(self) -> int:
        """Prompts that threads wait for while a batch is being built (`prepare`)."""
        return self._prompts.num_waiting

    def prepare_many(self, requests: list[Request]) -> list[Prompt]:
        """The requests' prompt embeddings, built together (`q3tts.request.prompt.build_prompts`: in bf16/fp16 their
        text is projected in one call) on a CUDA stream of their own (so that they do not queue behind the frames the
        engine has in flight)."""
        specs = [r.spec for r in requests]
        if self._prompt_stream is None:
            return build_prompts(self.model.talker, self.model.config, specs)
        with torch.cuda.stream(self._prompt_stream):
            prompts = build_prompts(self.model.talker, self.model.config, specs)
        self._prompt_stream.synchronize()
        return prompts

    def submit(self, request: Request, request_id: str | None = None, asyncio_loop: bool = False,
               prompt: Prompt | None = None, realtime: bool = True) -> RequestStream:
        """Queues a request on the engine; returns its stream of 1920-sample float32 frames (`asyncio_loop=True`
        from a running event loop: read it with `async for`). `prompt`: the request's prompt if already built
        (`prepare`). `realtime=False`: the audio is read whole, not played as it comes (no lead to keep ahead of
        playback when the engine admits others). Raises QueueFull when the engine's queue is at its limit."""
        guard = request.guard
        return self.engine.submit(prompt or self.prepare(request), request.params, request.spec.ref_codes, request_id,
                                  asyncio_loop, stop_after=guard.frame_limit(request.text_tokens) if guard else None,
                                  stop_on_repeats=guard.repeated_frames if guard else None, realtime=realtime)

    def submit_pieces(self, requests: list[Request], asyncio_loop: bool = False) -> RequestStream | PieceStream:
        """One request's stream, or the pieces of a long text's as one stream (each submitted when the one before
        has been read)."""
        if len(requests) == 1:
            return self.submit(requests[0], asyncio_loop=asyncio_loop)
        return PieceStream(lambda k: self.submit(requests[k], asyncio_loop=asyncio_loop), len(requests))

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class PromptCombiner:
    """`prepare_many` for requests that come one at a time from many threads: a thread whose request arrives while
    a batch is being built waits, and the first of those waiting then builds every request that arrived meanwhile
    (one batch, one synchronization of the prompt stream) and hands each thread its prompt; a lone request is
    built at once, in its own thread. A batch that fails is built again request by request, so that one bad
    request fails alone. (`q3tts.server.service.PromptBatcher` is the same rule for an event loop's requests.)"""

    def __init__(self, prepare_many: Callable[[list[Request]], list[Prompt]]):
        self._prepare_many = prepare_many
        self._lock = threading.Lock()
        self._waiting: list[WantedPrompt] = []
        self._building = False

    @property
    def num_waiting(self) -> int:
        """Requests waiting for the next batch (the one being built not counted)."""
        return len(self._waiting)

    def build(self, request: Request) -> Prompt:
        wanted = WantedPrompt(request)
        with self._lock:
            self._waiting.append(wanted)
            leads, self._building = not self._building, True
        if not leads:
            try:
                wanted.ready.wait()  # (set when its prompt is built, or when it is to build the next batch)
            except BaseException:  # (interrupted, Ctrl-C in the main thread: it leaves, its turn passes on)
                self._leave(wanted)
                raise
        if wanted.outcome is None:
            self._build_next()
        if isinstance(wanted.outcome, BaseException):
            raise wanted.outcome
        return wanted.outcome

    def _build_next(self) -> None:
        """Builds every request waiting (this thread's among them), then wakes the first to arrive since, to build
        the next batch."""
        with self._lock:
            batch, self._waiting = self._waiting, []
        requests, outcomes = [w.request for w in batch], None
        try:
            try:
                outcomes = self._prepare_many(requests)
            except Exception as e:
                outcomes = [e] if len(batch) == 1 else [_outcome(self._prepare_many, r) for r in requests]
        except BaseException as e:  # (interrupted: the batch's other threads must not wait for ever)
            outcomes = [e] * len(batch)
            raise
        finally:
            with self._lock:
                for w, outcome in zip(batch, outcomes):
                    w.outcome = outcome
                    w.ready.set()
                self._pass_on()

    def _leave(self, wanted: WantedPrompt) -> None:
        with self._lock:
            if wanted in self._waiting:
                self._waiting.remove(wanted)
            if wanted.ready.is_set() and wanted.outcome is None:  # (it was to build the next batch)
                self._pass_on()

    def _pass_on(self) -> None:
        """The first request waiting builds the next batch; none: the next to come does. Call with the lock."""
        if self._waiting:
            self._waiting[0].ready.set()
        else:
            self._building = False


class WantedPrompt:
    """One thread's request in `PromptCombiner`: its prompt (or error) once built."""

    def __init__(self, request: Request):
        self.request = request
        self.ready = threading.Event()
        self.outcome: Prompt | BaseException | None = None


def _outcome(prepare_many: Callable[[list[Request]], list[Prompt]], request: Request) -> Prompt | Exception:
    try:
        return prepare_many([request])[0]
    except Exception as e:
        return e
