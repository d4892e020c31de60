"""`EngineHost`: a loaded model's one engine, built on first use, and the way requests get onto it (prompts built
on a CUDA stream of their own, then submitted). `TTS` is one; every entry point, the drop-in's included, submits
through these methods."""

from __future__ import annotations

import threading
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
        """The request's prompt embeddings (see `prepare_many`)."""
        return self.prepare_many([request])[0]

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
