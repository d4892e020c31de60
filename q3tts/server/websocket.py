"""`WS /v1/audio/speech/stream`: text in as it is produced (e.g. by an LLM), audio out as soon as a segment of
it is complete.

Protocol (client -> server: JSON text frames):
1. `{"type": "session.config", ...}` first: the fields of `/v1/audio/speech` except `input`, `model` and
   `stream_format` (voice, language, instructions, task_type, ref_audio/ref_text, response_format (default
   "pcm"), speed, seed, sampling fields; `max_new_tokens` applies per segment).
2. `{"type": "input.text", "text": "..."}`, any number: text deltas, in order.
3. `{"type": "input.flush"}` (optional): speak the buffered text now, even mid-sentence.
4. `{"type": "input.done"}`: no more text; the rest is spoken and the session ends.

Server -> client:
- `{"type": "session.created", "request_id", "sample_rate", "response_format", "seed"}` once the config is
  accepted.
- `{"type": "segment.started", "segment": i, "text": "..."}` when a segment's synthesis starts.
- Binary frames: the session's audio as ONE continuous stream in `response_format` (pcm: 16-bit LE mono at
  `sample_rate`; other formats: one file/stream across all segments), in order.
- `{"type": "segment.done", "segment": i, "text", "frames", "audio_seconds"}` after the segment's audio (a lossy
  encoder or the time stretch may hold back a few ms of it until the next segment or the end); `audio_seconds`,
  here and in `session.done`, is the audio as delivered, after `speed`.
- `{"type": "session.done", "segments", "audio_seconds", "usage": {"input_tokens", "output_tokens",
  "total_tokens"}}`, then the server closes with 1000.
- `{"type": "error", "error": {"message", "type", "param", "code"}}`, then the server closes: 1008 for bad
  input, 1013 when the queue is full, 1011 for server failures.
- On SIGTERM the server closes the sessions open with 1012 (service restart) at once: unlike HTTP streams they
  are not drained (uvicorn's shutdown).

Segments are cut at sentence and clause boundaries (text_segmenter.py) and spoken one after another with the
same voice and the same seed (drawn once per session unless given). A client that disconnects cancels the
segment being generated.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable
from contextlib import suppress
from typing import Any

from fastapi import APIRouter, WebSocket, WebSocketDisconnect
from pydantic import ValidationError

from ..engine import EngineError
from ..engine.sequence import FRAME_SECONDS
from ..engine.stream import FRAME_SAMPLES
from ..errors import RequestError, quote
from ..request import check_unicode
from ..text_segmenter import TextSegmenter
from . import errors
from .audio_encoding import encode_async, flush_async, make_encoder
from .auth import websocket_authorized
from .body import parse_json
from .middleware import drop_connection, request_id_of
from .schemas import StreamConfig
from .service import SpeechService, VoiceChoice

log = logging.getLogger("q3tts.server")
router = APIRouter()
MAX_SEGMENT_CHARS = 300
PENDING_TEXT_FACTOR = 16  # text received but not yet spoken may reach this many times --max-input-chars


@router.websocket("/v1/audio/speech/stream")
async def speech_stream(websocket: WebSocket) -> None:
    if not await websocket_authorized(websocket):
        return
    await websocket.accept()
    service: SpeechService = websocket.app.state.service
    try:
        session = await StreamSession.open(websocket, service)
        await session.run()
        await websocket.close(code=1000)
    except errors.APIError as e:
        websocket.app.state.metrics.count_error(e.code)
        await send_error(websocket, e)
    except EngineError as e:
        websocket.app.state.metrics.count_error("stream_failed")
        await send_error(websocket, errors.engine_failed(str(e)))
    except WebSocketDisconnect:
        log.info("websocket %s: client went away", request_id_of(websocket.scope))
    except asyncio.TimeoutError:
        log.warning("websocket %s: the client stopped reading; session closed", request_id_of(websocket.scope))
        drop_connection(websocket.scope)  # (a close frame would wait behind what the client does not read)


class StreamSession:
    def __init__(self, websocket: WebSocket, service: SpeechService, config: StreamConfig, choice: VoiceChoice,
                 seed: int):
        self.websocket, self.service, self.config, self.choice, self.seed = websocket, service, config, choice, seed
        self.encoder = make_encoder(config.response_format, service.tts.sample_rate, config.speed)
        self.segmenter = TextSegmenter(max_chars=min(MAX_SEGMENT_CHARS, service.config.max_input_chars))
        self.segments: asyncio.Queue[str | None] = asyncio.Queue()
        self.request_id = request_id_of(websocket.scope)
        self.num_segments = self.frames = self.input_tokens = 0
        self.queued_chars = 0  # segments waiting to be spoken (the segmenter's buffer holds the rest)
        self.max_pending_chars = PENDING_TEXT_FACTOR * service.config.max_input_chars

    @classmethod
    async def open(cls, websocket: WebSocket, service: SpeechService) -> StreamSession:
        """Reads and validates the config message (due within body_timeout_s: a connection that sends nothing
        is not held open), resolves the voice once, and announces the session."""
        timeout = service.config.body_timeout_s
        try:
            message = await asyncio.wait_for(_receive_json(websocket), timeout)
        except asyncio.TimeoutError:
            raise errors.APIError(408, f"no session.config message within {timeout:g} s of connecting",
                                  code="request_timeout") from None
        try:
            config = StreamConfig.model_validate(message)
        except ValidationError as e:
            raise errors.from_validation(e) from e
        service.check_limits(config)
        service.check_ready()
        choice = await service.resolve_voice(config)
        session = cls(websocket, service, config, choice, config.seed if config.seed is not None
                      else service.random_seed())
        await session._send(websocket.send_json({"type": "session.created", "request_id": session.request_id,
                                                  "sample_rate": service.tts.sample_rate,
                                                  "response_format": config.response_format, "seed": session.seed}))
        return session

    async def run(self) -> None:
        """Reads text and speaks segments concurrently; the first failure of either ends both."""
        reader = asyncio.create_task(self._read_text())
        speaker = asyncio.create_task(self._speak_all())
        try:
            done, _ = await asyncio.wait({reader, speaker}, return_when=asyncio.FIRST_EXCEPTION)
            for task in done:
                task.result()
            await speaker
        finally:
            for task in (reader, speaker):
                task.cancel()

    async def _read_text(self) -> None:
        while True:
            message = await _receive_json(self.websocket)
            kind = message.get("type")
            if kind == "input.text":
                text = message.get("text")
                if not isinstance(text, str):
                    raise errors.bad_request("input.text needs a string `text`", param="text")
                try:  # (refused here, naming this field, not when its segment is spoken)
                    check_unicode(text, "text")
                except RequestError as e:
                    raise errors.bad_request(e.message, param="text") from None
                if self.queued_chars + len(self.segmenter.buffer) + len(text) > self.max_pending_chars:
                    raise errors.bad_request(f"more than {self.max_pending_chars} characters of text are waiting "
                                             "to be spoken; send more as the audio arrives", param="text",
                                             code="input_too_long")
                self._queue(self.segmenter.push(text))
            elif kind in ("input.flush", "input.done"):
                self._queue(self.segmenter.flush())
                if kind == "input.done":
                    self.segments.put_nowait(None)
                    return
            else:
                raise errors.bad_request(f"unknown message type {quote(kind)} (expected input.text, input.flush or "
                                         "input.done)", param="type")

    def _queue(self, segments: list[str]) -> None:
        for segment in segments:
            self.queued_chars += len(segment)
            self.segments.put_nowait(segment)

    async def _speak_all(self) -> None:
        while (text := await self.segments.get()) is not None:
            await self._speak(text)
        if tail := await flush_async(self.encoder):
            await self._send(self.websocket.send_bytes(tail))
        usage = {"input_tokens": self.input_tokens, "output_tokens": self.frames,
                 "total_tokens": self.input_tokens + self.frames}
        await self._send(self.websocket.send_json({"type": "session.done", "segments": self.num_segments,
                                                   "audio_seconds": self._seconds(self.frames), "usage": usage}))

    async def _speak(self, text: str) -> None:
        index, frames = self.num_segments, 0
        self.queued_chars -= len(text)
        job = await self.service.prepare(text, self.config, self.choice, self.seed)
        stream = self.service.submit(job, f"{self.request_id}.{index}")
        self.num_segments += 1
        self.input_tokens += job.input_tokens
        await self._send(self.websocket.send_json({"type": "segment.started", "segment": index, "text": text}))
        try:
            async for pcm in stream.achunks():
                frames += len(pcm) // FRAME_SAMPLES
                if data := await encode_async(self.encoder, pcm):
                    await self._send(self.websocket.send_bytes(data))
        finally:
            stream.cancel()
        self.frames += frames
        await self._send(self.websocket.send_json({"type": "segment.done", "segment": index, "text": text,
                                                   "frames": frames, "audio_seconds": self._seconds(frames),
                                                   "finish_reason": stream.finish_reason}))

    async def _send(self, sending: Awaitable[None]) -> None:
        """A client that stops reading loses the session (and its row) after send_timeout_s."""
        await asyncio.wait_for(sending, self.service.config.send_timeout_s)

    def _seconds(self, frames: int) -> float:
        """The seconds `frames` last as delivered, time-stretched by `speed` (time_stretch.py: to the sample)."""
        return round(frames * FRAME_SECONDS / self.config.speed, 3)


async def _receive_json(websocket: WebSocket) -> dict[str, Any]:
    message = await websocket.receive()
    if message["type"] == "websocket.disconnect":
        raise WebSocketDisconnect(message.get("code", 1000))
    if message.get("text") is None:
        raise errors.bad_request("messages must be JSON text frames")
    data = parse_json(message["text"])
    if not isinstance(data, dict):
        raise errors.bad_request("messages must be JSON objects with a `type`")
    return data


async def send_error(websocket: WebSocket, error: errors.APIError) -> None:
    code = 1013 if error.status == 429 else 1011 if error.status >= 500 else 1008
    with suppress(Exception):  # the client may be gone already
        await websocket.send_json({"type": "error", **error.body()})
        await websocket.close(code=code)
