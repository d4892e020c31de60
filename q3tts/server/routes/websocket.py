"""`WS /v1/audio/speech/stream`: text in as it is produced (e.g. by an LLM), audio out from its first words. Two
protocols on this one path, chosen by the session's first message: vLLM-Omni's (the
default, so that its clients work unchanged) and q3tts's own (`"protocol": "q3tts"`). docs/http-api.md has both.

Client -> server (JSON text frames), both protocols:
1. `{"type": "session.config", ...}` first: the fields of `/v1/audio/speech` except `input` and `stream_format`
   (voice, language, instructions, task_type, ref_audio/ref_text, response_format, sample_rate, speed, seed,
   sampling fields; `max_new_tokens` applies per segment), `protocol` and `segmentation`.
2. `{"type": "input.text", "text": "..."}`, any number: text deltas, in order.
3. `{"type": "input.done"}`: no more text (q3tts: the rest is spoken and the session ends; vLLM-Omni: the
   utterance ends, and the connection stays open for the next one).

vLLM-Omni protocol (defaults: response_format "wav", one whole file per segment):
- session.config also takes `stream_audio` (true: each segment's pcm as it is made, in one or more binary
  frames), `split_granularity` (segmentation "sentence": "none": the utterance as one request, "sentence" (the
  default), "clause") or its
  other name `text_input_mode` ("buffered" = none, "commitment" = sentence); it may be sent again between
  utterances to change the session. `{"type": "session.close"}` ends the connection (segments already cut are
  still spoken).
- Server: `{"type": "audio.start", "utterance_index", "sentence_index", "sentence_text", "format", "sample_rate",
  "channels"}`, then the segment's audio (a binary frame: the whole file, whose WAV header holds its true sizes;
  with stream_audio, pcm frames as generated), then `{"type": "audio.done", "utterance_index", "sentence_index",
  "total_bytes", "error": false}`; after input.done's segments, `{"type": "session.done", "utterance_index",
  "total_sentences"}`.

q3tts protocol (default response_format "pcm"):
- `{"type": "input.flush"}` (optional): speak the buffered text now, even mid-sentence.
- Server: `{"type": "session.created", "request_id", "sample_rate", "response_format", "seed"}` once the config is
  accepted; `{"type": "segment.started", "segment": i, "text"}` when a segment's synthesis starts; binary frames:
  the session's audio as ONE continuous stream in `response_format` (pcm: 16-bit LE mono at `sample_rate`; other
  formats: one file/stream across all segments), in order; `{"type": "segment.done", "segment": i, "text",
  "frames", "audio_seconds", "finish_reason"}` after the segment's audio (a lossy encoder or the time stretch may
  hold back a few ms of it until the next segment or the end; `audio_seconds`, here and in `session.done`, is the
  audio as delivered, after `speed`); `{"type": "session.done", "segments", "audio_seconds", "usage":
  {"input_tokens", "output_tokens", "total_tokens"}}`, then the server closes with 1000.
- segmentation "sentence": segments are cut at sentence and clause boundaries (text_segmenter.py).

Segmentation (session.config `segmentation`, docs/websocket.md):
- "live" (the default): one generation per session (vLLM-Omni: per utterance), a live request (q3tts.api.live)
  fed with each delta as it arrives, in streaming-text mode: one segment (index 0), its start event sent with the
  first audio and the text received by then, its done event with the whole text. input.flush does nothing (nothing
  is buffered); session.close ends the utterance's text (what came is spoken).
- "sentence": segments cut as below, each its own generation. The default where cuts are asked for
  (non_streaming_mode true, which needs each segment's whole text; vLLM-Omni's split_granularity/text_input_mode);
  "live" with them is refused (schemas.StreamConfig).

Both: `{"type": "error", "message", "error": {"message", "type", "param", "code"}}`, then the server closes: 1008
for bad input, 1013 when the queue is full, 1011 for server failures. On SIGTERM the server closes the sessions
open with 1012 (service restart) at once: unlike HTTP streams they are not drained (uvicorn's shutdown). Segments
are spoken one after another with the same voice and the same seed (drawn once per session unless given). A
client that disconnects cancels the segment being generated.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
from fastapi import APIRouter, WebSocket, WebSocketDisconnect
from pydantic import ValidationError

from ...api.live import LiveRequest
from ...engine import EngineError
from ...engine.live import LiveTextTimeout
from ...engine.sequence import FRAME_SECONDS
from ...engine.stream import FRAME_SAMPLES
from ...errors import RequestError, quote
from ...request.builder import check_unicode
from ...request.text_segmenter import TextSegmenter
from .. import errors
from ..audio_encoding import AudioEncoder, encode_async, flush_async, make_encoder
from ..auth import websocket_authorized
from ..body import parse_json
from ..middleware import close_with, drop_connection, request_id_of
from ..schemas import StreamConfig
from ..service import SpeechService, VoiceChoice

log = logging.getLogger("q3tts.server")
router = APIRouter()
MAX_SEGMENT_CHARS = 300
TEXT_WAIT_S = 30.0  # segmentation live: how long the generation waits for its next text
PENDING_TEXT_FACTOR = 16  # text received but not yet spoken may reach this many times --max-input-chars
UTTERANCE_END, SESSION_END = object(), object()  # the speaker's queue: besides (text, setup) segments
Q3TTS_FIELDS = {"input.text": ("type", "text"), "input.flush": ("type",), "input.done": ("type",)}  # after the config


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
    except LiveTextTimeout as e:
        websocket.app.state.metrics.count_error("input_timeout")
        await send_error(websocket, errors.APIError(408, f"{e}: send text sooner, or input.done",
                                                    code="input_timeout", param="text"))
    except EngineError as e:
        websocket.app.state.metrics.count_error("stream_failed")
        await send_error(websocket, errors.engine_failed(str(e)))
    except WebSocketDisconnect:
        log.info("websocket %s: client went away", request_id_of(websocket.scope))
    except asyncio.TimeoutError:
        log.warning("websocket %s: the client stopped reading; session closed", request_id_of(websocket.scope))
        drop_connection(websocket.scope)  # (a close frame would wait behind what the client does not read)


@dataclass
class Setup:
    """What a segment is spoken with: the session's config, its voice and its seed (a vLLM-Omni session may
    change them between utterances)."""

    config: StreamConfig
    choice: VoiceChoice
    seed: int

    @property
    def sample_rate(self) -> int | None:
        return self.config.sample_rate

    def seconds(self, frames: int) -> float:
        """The seconds `frames` last as delivered, time-stretched by `speed` (time_stretch.py: to the sample)."""
        return round(frames * FRAME_SECONDS / self.config.speed, 3)

    def encoder(self, model_rate: int, whole: bool = False) -> AudioEncoder:
        c = self.config
        return make_encoder(c.response_format, model_rate, c.speed, c.sample_rate or model_rate, c.volume_multiplier,
                            whole)


class WholeText:
    """vLLM-Omni's split_granularity "none": the utterance's text as one segment at input.done."""

    def __init__(self):
        self.buffer = ""

    def push(self, delta: str) -> list[str]:
        self.buffer += delta
        return []

    def flush(self) -> list[str]:
        text, self.buffer = self.buffer.strip(), ""
        return [text] if text else []


def make_segmenter(config: StreamConfig, is_q3tts: bool, max_input_chars: int) -> TextSegmenter | WholeText | None:
    """How text is cut into segments: none with segmentation live; else q3tts at sentences and clauses, vLLM-Omni by
    its split_granularity (none: the utterance whole, at most --max-input-chars)."""
    if config.segmentation == "live":
        return None
    longest = min(MAX_SEGMENT_CHARS, max_input_chars)
    granularity = "q3tts" if is_q3tts else config.granularity
    if granularity == "none":
        return WholeText()
    clause_min_chars = {"sentence": longest, "clause": 1}.get(granularity, min(40, longest))
    return TextSegmenter(clause_min_chars=clause_min_chars, max_chars=longest)


@dataclass
class LiveUtterance:
    """segmentation live: the session's (vLLM-Omni: the utterance's) one generation, and the text it was given."""

    live: LiveRequest
    setup: Setup
    text: str = ""
    started: bool = False  # its start event was sent
    finish_reason: str | None = None  # set once its audio ended

    async def audio(self, start: Callable[[], Awaitable[None]]) -> AsyncIterator[tuple[np.ndarray, int]]:
        """The generation's audio (pcm, frames); `start()` (the start event, with the text received by then) at
        the first chunk."""
        async for chunk in self.live:
            if not self.started:
                self.started = True
                await start()
            yield chunk.pcm, chunk.num_frames


class LiveTextFeed:
    """segmentation live: the text side of the session's (vLLM-Omni: each utterance's) one generation: opened at the
    utterance's first word (whitespace before it is held and given with it) and queued for the speaker, each
    delta checked against this server's limits and appended, ended at input.done or session.close."""

    def __init__(self, service: SpeechService, items: asyncio.Queue[Any]):
        self.service, self.items = service, items
        self.current: LiveUtterance | None = None  # the open utterance's generation
        self.held_space = ""  # whitespace before the utterance's first word
        self.pending_chars = 0  # the text of the utterances queued or being spoken (vLLM-Omni: several at once)

    async def push(self, text: str, setup: Setup) -> None:
        """A text delta into the open utterance's generation (opened with `setup` at its first word)."""
        if self.current is None:
            if not text.strip():
                self.held_space += text
                return
            live = self.service.live(setup.config, setup.choice, setup.seed, TEXT_WAIT_S)
            self.current = LiveUtterance(live, setup)
            self.items.put_nowait(self.current)
            text, self.held_space = self.held_space + text, ""
        if self.current.finish_reason is not None:  # (the live request is cancelled: its append would say so)
            raise errors.bad_request(f"the generation already ended (finish reason {self.current.finish_reason!r}: "
                                     "max_new_tokens reached or the model's end of speech); this text would not be "
                                     "spoken: send input.done", param="text")
        limit = self.service.config.max_input_chars
        if len(text) > limit or self.pending_chars + len(text) > PENDING_TEXT_FACTOR * limit:
            raise errors.bad_request(f"text over this server's limit ({limit} characters per input.text, "
                                     f"{PENDING_TEXT_FACTOR * limit} waiting to be spoken: send more as the audio "
                                     "arrives)", param="text", code="input_too_long")
        await self._call(self.current.live.append, text)
        self.current.text += text
        self.pending_chars += len(text)

    def spoken(self, utterance: LiveUtterance) -> None:
        """An utterance's audio ended: its text no longer waits."""
        self.pending_chars -= len(utterance.text)

    async def end(self) -> None:
        """The open utterance's text ends (what came is spoken); the next text opens another."""
        if self.current is not None:
            await self._call(self.current.live.end)
        self.current, self.held_space = None, ""

    async def _call(self, method: Callable[..., None], *args: Any) -> None:
        """The live request's append or end (in a worker thread until its prompt is built: Preparation.feed_live),
        its RequestError in the API's shape (one over a limit: input_too_long)."""
        try:
            await self.service.preparation.feed_live(self.current.live, method, *args)
        except RequestError as e:
            raise errors.bad_request(e.message, param=e.param or "text",
                                     code="input_too_long" if e.code == "too_long" else "invalid_value") from e


class StreamSession:
    def __init__(self, websocket: WebSocket, service: SpeechService, setup: Setup):
        self.websocket, self.service, self.setup = websocket, service, setup
        self.is_q3tts = setup.config.protocol == "q3tts"
        self.model_rate = service.tts.sample_rate
        self.segmenter = make_segmenter(setup.config, self.is_q3tts, service.config.max_input_chars)
        self.max_pending_chars = PENDING_TEXT_FACTOR * service.config.max_input_chars
        self.items: asyncio.Queue[Any] = asyncio.Queue()
        self.live_text = LiveTextFeed(service, self.items)  # segmentation live
        self.request_id = request_id_of(websocket.scope)
        self.num_segments = self.frames = self.input_tokens = 0
        self.utterance = self.utterance_segments = 0  # vLLM-Omni: input.done cycles, segments of the current one
        self.utterance_open = False  # text has come since the last input.done
        self.queued_chars = 0  # segments waiting to be spoken (the segmenter's buffer holds the rest)
        # q3tts: one encoder across the session (one continuous stream); vLLM-Omni: one per segment
        self.encoder = setup.encoder(self.model_rate) if self.is_q3tts else None

    @classmethod
    async def open(cls, websocket: WebSocket, service: SpeechService) -> StreamSession:
        """Reads and validates the config message (due within body_timeout_s: a connection that sends nothing
        is not held open), resolves the voice once, and announces the session (q3tts)."""
        timeout = service.config.body_timeout_s
        try:
            message = await asyncio.wait_for(_receive_json(websocket), timeout)
        except asyncio.TimeoutError:
            raise errors.APIError(408, f"no session.config message within {timeout:g} s of connecting",
                                  code="request_timeout") from None
        kind = message.get("type")
        if kind != "session.config":  # (before its fields: those of another message do not matter)
            sent = "one with no type" if kind is None else quote(kind)
            raise errors.bad_request(f"the first message must be session.config, not {sent}", param="type")
        session = cls(websocket, service, await _setup(service, message))
        if session.is_q3tts:
            setup = session.setup
            await session._send_json({"type": "session.created", "request_id": session.request_id,
                                      "sample_rate": setup.sample_rate or session.model_rate,
                                      "response_format": setup.config.response_format, "seed": setup.seed})
        return session

    async def run(self) -> None:
        """Reads text and speaks segments concurrently; the first failure of either ends both, and the session
        ends once the speaking does (q3tts: messages after input.done are still read meanwhile, and refused)."""
        reader = asyncio.create_task(self._read())
        speaker = asyncio.create_task(self._speak_all())
        try:
            done, _ = await asyncio.wait({reader, speaker}, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                task.result()
            await speaker
        finally:
            for task in (reader, speaker):
                task.cancel()
                # (one cut off mid-send as the session ends, at a shutdown say, may end with the send's
                # WebSocketDisconnect rather than its cancellation, after this: the session's end already says so,
                # where asyncio would log it with a traceback as never retrieved)
                task.add_done_callback(_retrieve)

    # ---- reading ------------------------------------------------------------------------------------------

    async def _read(self) -> None:
        ended = False
        while True:
            message = await _receive_json(self.websocket)
            kind = message.get("type")
            if ended:  # (q3tts: the rest is being spoken)
                raise errors.bad_request(f"{quote(kind)} after input.done: the session ends once its text is "
                                         "spoken (open another for more)", param="type")
            if self.is_q3tts:
                _check_fields(kind, message)
            if kind == "input.text":
                await self._text(message.get("text"))
            elif kind == "input.done":
                if self.is_q3tts and not self.utterance_open:  # (as HTTP refuses an empty input)
                    raise errors.bad_request("the session's text is empty: send input.text with words before "
                                             "input.done", param="text")
                await self._end_utterance()
                self.items.put_nowait(SESSION_END if self.is_q3tts else UTTERANCE_END)
                ended = self.is_q3tts
            elif kind == "input.flush" and self.is_q3tts:
                if self.segmenter is not None:  # (live: the text is spoken as it comes already)
                    self._queue(self.segmenter.flush())
            elif kind == "session.config" and not self.is_q3tts:
                await self._reconfigure(message)
            elif kind == "session.config":  # (q3tts: one generation per session, configured before it starts)
                raise errors.bad_request("session.config is sent once, first: open another session for other "
                                         "settings", param="type")
            elif kind == "session.close" and not self.is_q3tts:
                await self.live_text.end()  # (live: the text received is spoken)
                self.items.put_nowait(SESSION_END)  # (text not yet cut into segments is dropped)
                return
            else:
                expected = "input.text, input.flush or input.done" if self.is_q3tts else \
                    "session.config, input.text, input.done or session.close"
                raise errors.bad_request(f"unknown message type {quote(kind)} (expected {expected})", param="type")

    async def _text(self, text: Any) -> None:
        if not isinstance(text, str):
            raise errors.bad_request("input.text needs a string `text`", param="text")
        try:  # (refused here, naming this field, not when its segment is spoken)
            check_unicode(text, "text")
        except RequestError as e:
            raise errors.bad_request(e.message, param="text") from None
        if self.segmenter is None:
            await self.live_text.push(text, self.setup)
            self.utterance_open = self.live_text.current is not None
            return
        buffered = len(self.segmenter.buffer) + len(text)
        if isinstance(self.segmenter, WholeText) and buffered > self.service.config.max_input_chars:
            raise errors.bad_request(f"the utterance is over {self.service.config.max_input_chars} characters: send "
                                     "input.done sooner, or set split_granularity to sentence", param="text",
                                     code="input_too_long")
        if self.queued_chars + buffered > self.max_pending_chars:
            raise errors.bad_request(f"more than {self.max_pending_chars} characters of text are waiting to be "
                                     "spoken; send more as the audio arrives", param="text", code="input_too_long")
        self.utterance_open = self.utterance_open or bool(text.strip())
        self._queue(self.segmenter.push(text))

    async def _end_utterance(self) -> None:
        """input.done: the cut text's last segment, or the live generation's end."""
        if self.segmenter is not None:
            self._queue(self.segmenter.flush())
        await self.live_text.end()
        self.utterance_open = False

    def _queue(self, segments: list[str]) -> None:
        for segment in segments:
            self.queued_chars += len(segment)
            self.items.put_nowait((segment, self.setup))

    async def _reconfigure(self, message: dict[str, Any]) -> None:
        """vLLM-Omni: a new session.config between utterances changes what the next segments are spoken with."""
        if self.utterance_open or (self.segmenter is not None and self.segmenter.buffer.strip()):
            raise errors.bad_request("session.config cannot change the session while an utterance is open: send "
                                     "input.done first", param="type")
        setup = await _setup(self.service, message)
        if setup.config.protocol != "vllm-omni":
            raise errors.bad_request("a session keeps its protocol", param="protocol")
        self.setup = setup
        self.segmenter = make_segmenter(setup.config, self.is_q3tts, self.service.config.max_input_chars)

    # ---- speaking -----------------------------------------------------------------------------------------

    async def _speak_all(self) -> None:
        while (item := await self.items.get()) is not SESSION_END:
            if item is UTTERANCE_END:
                await self._send_json({"type": "session.done", "utterance_index": self.utterance,
                                       "total_sentences": self.utterance_segments})
                self.utterance, self.utterance_segments = self.utterance + 1, 0
            elif isinstance(item, LiveUtterance):
                await self._speak_live(item)
            else:
                await self._speak(*item)
        if not self.is_q3tts:
            return
        if tail := await flush_async(self.encoder):
            await self._send(self.websocket.send_bytes(tail))
        usage = {"input_tokens": self.input_tokens, "output_tokens": self.frames,
                 "total_tokens": self.input_tokens + self.frames}
        await self._send_json({"type": "session.done", "segments": self.num_segments,
                               "audio_seconds": self.setup.seconds(self.frames), "usage": usage})

    async def _speak(self, text: str, setup: Setup) -> None:
        index = self.num_segments if self.is_q3tts else self.utterance_segments
        self.queued_chars -= len(text)
        job = await self.service.preparation.prepare(text, setup.config, setup.choice, setup.seed)
        stream = self.service.submit(job, f"{self.request_id}.{self.num_segments}")
        self.num_segments += 1
        self.utterance_segments += 1
        self.input_tokens += job.input_tokens
        await self._send_json(self._started(index, text, setup))
        try:
            frames, sent = await self._send_audio(((pcm, len(pcm) // FRAME_SAMPLES) async for pcm in stream.achunks()),
                                                  setup)
        finally:
            stream.cancel()
        self.frames += frames
        await self._send_json(self._done(index, text, frames, sent, setup, stream.finish_reason))

    async def _speak_live(self, item: LiveUtterance) -> None:
        """segmentation live: the generation's audio as one segment (index 0), its start event at the first
        audio with the text received by then, its done event with the whole text."""
        setup, live = item.setup, item.live
        index = self.num_segments if self.is_q3tts else self.utterance_segments
        self.num_segments += 1
        self.utterance_segments += 1

        async def start() -> None:
            await self._send_json(self._started(index, item.text, setup))

        try:
            frames, sent = await self._send_audio(item.audio(start), setup)
        finally:
            live.cancel()
            finish_reason = live.stream.frames.finish_reason if live.stream is not None else None
            item.finish_reason = finish_reason or "stop"  # (before any await: later text is refused saying why)
            self.live_text.spoken(item)
        if not item.started:
            await self._send_json(self._started(index, item.text, setup))
        self.frames += frames
        self.input_tokens += live.num_tokens
        await self._send_json(self._done(index, item.text, frames, sent, setup, finish_reason))

    async def _send_audio(self, audio: AsyncIterator[tuple[np.ndarray, int]], setup: Setup) -> tuple[int, int]:
        """One segment's audio (pcm, frames) through its encoder to the client: streamed, or (vLLM-Omni's
        stream_audio false) held for one message; a vLLM-Omni segment's own encoder then adds its tail. Returns
        the frames and the bytes sent."""
        streamed = self.is_q3tts or setup.config.stream_audio
        encoder = self.encoder or setup.encoder(self.model_rate, whole=not streamed)
        frames, sent, held = 0, 0, []
        async for pcm, n in audio:
            frames += n
            if not (data := await encode_async(encoder, pcm)):
                continue
            sent += len(data)
            if streamed:
                await self._send(self.websocket.send_bytes(data))
            else:
                held.append(data)
        if not self.is_q3tts:  # the segment's own encoder: its tail, and (not streamed) the whole file
            tail = await flush_async(encoder)
            sent += len(tail)
            if data := b"".join(held) + tail:
                await self._send(self.websocket.send_bytes(data))
        return frames, sent

    def _started(self, index: int, text: str, setup: Setup) -> dict[str, Any]:
        if self.is_q3tts:
            return {"type": "segment.started", "segment": index, "text": text}
        return {"type": "audio.start", "utterance_index": self.utterance, "sentence_index": index,
                "sentence_text": text, "format": setup.config.response_format,
                "sample_rate": setup.sample_rate or self.model_rate, "channels": 1}

    def _done(self, index: int, text: str, frames: int, sent: int, setup: Setup,
              finish_reason: str | None) -> dict[str, Any]:
        if self.is_q3tts:
            return {"type": "segment.done", "segment": index, "text": text, "frames": frames,
                    "audio_seconds": setup.seconds(frames), "finish_reason": finish_reason}
        return {"type": "audio.done", "utterance_index": self.utterance, "sentence_index": index,
                "total_bytes": sent, "error": False}

    async def _send_json(self, event: dict[str, Any]) -> None:
        await self._send(self.websocket.send_json(event))

    async def _send(self, sending: Awaitable[None]) -> None:
        """A client that stops reading loses the session (and its row) after send_timeout_s."""
        await asyncio.wait_for(sending, self.service.config.send_timeout_s)


def _retrieve(task: asyncio.Task) -> None:
    if not task.cancelled():
        task.exception()


async def _setup(service: SpeechService, message: dict[str, Any]) -> Setup:
    """A session.config message validated, its model checked and its voice resolved."""
    try:
        config = StreamConfig.model_validate(message)
    except ValidationError as e:
        raise errors.from_validation(e, StreamConfig) from e
    service.check_limits(config)
    service.check_ready()
    service.check_model(config.model)
    choice = await service.resolve_voice(config)
    return Setup(config, choice, config.seed if config.seed is not None else service.random_seed())


def _check_fields(kind: Any, message: dict[str, Any]) -> None:
    """q3tts's messages after the config carry only their own fields: another (a voice, a speed) is refused, not
    ignored (the session's settings are its session.config's)."""
    known = Q3TTS_FIELDS.get(kind)
    unknown = next((key for key in message if key not in known), None) if known else None
    if unknown is not None:
        fields = " and ".join(f"`{name}`" for name in known)
        raise errors.bad_request(f"{kind} takes {fields}, not {quote(unknown)} (the session's settings are those of "
                                 "its session.config)", param=errors.field(unknown))


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
    """The error event (vLLM-Omni's `message` beside the API's error object), then the close code; a client that
    does not read them within send_timeout_s has its connection dropped (the route would wait on it for ever)."""
    code = 1013 if error.status == 429 else 1011 if error.status >= 500 else 1008
    await close_with(websocket, {"type": "error", "message": error.message, **error.body()}, code,
                     websocket.app.state.config.send_timeout_s)
