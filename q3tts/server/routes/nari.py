"""`WS /v1/audio/speech/ws`: nari-qwen3-tts's `nari.speech.v1` protocol, live text into one generation.

The client offers the subprotocol `nari.speech.v1` (else the server closes with 1002). Events (JSON text frames;
docs/websocket.md has them field by field):
  server: `session.created {protocol, audio: {encoding: "pcm_s16le", sample_rate, channels: 1}}`
  client: `request.start {model?, voice, language, instructions | instruct | instruction, seed, sampling...}`
  server: `request.configured`
  client: `input_text.append {sequence, text}` (sequence 0, 1, ... across appends and the end)
  server: `input_text.ack {event, sequence, request_id}` (request_id null until the generation started), and
          `response.started {request_id, audio}` before the first audio, once the first text token is final
  client: `input_text.end {sequence}` or `response.cancel`
  server: binary frames (16-bit little-endian mono PCM at the model's 24 kHz), then
          `response.done {request_id, stop_reason: "stop" | "cancelled", audio_chunks}`, close 1000.
Errors: `error {request_id, error: {type, code, message, param}}`, then close 1008 (1009: text over a limit, 1011:
a server failure). The text goes into a live request (`q3tts.api.live`): the codes are the whole text's.
"""

from __future__ import annotations

import asyncio
import json
import logging
import uuid
from collections.abc import Awaitable
from contextlib import suppress
from typing import Any, Literal

from fastapi import APIRouter, WebSocket, WebSocketDisconnect
from pydantic import ValidationError

from ...api.live import LiveRequest
from ...engine import EngineError
from ...engine.live import LiveTextTimeout
from ...errors import RequestError
from .. import errors
from ..auth import websocket_authorized
from ..middleware import close_with, drop_connection, request_id_of
from ..schemas import SpeechSettings
from ..service import SpeechService

log = logging.getLogger("q3tts.server")
router = APIRouter()
PROTOCOL = "nari.speech.v1"
LIVE_TEXT_FACTOR = 16  # a session's text may reach this many times --max-input-chars
TEXT_WAIT_S = 30.0  # how long a started generation (or a request whose prompt is not built yet) waits for text
# The fields of the events after request.start (nari-qwen3-tts's own schemas forbid any other, as request.start's do)
EVENT_FIELDS = {"input_text.append": ("type", "sequence", "text"), "input_text.end": ("type", "sequence"),
                "response.cancel": ("type",)}


class NariStart(SpeechSettings):
    """`request.start`: the fields of /v1/audio/speech but `input`, nari's instruction names, raw PCM only."""

    type: Literal["request.start"]
    model: str | None = None
    instruct: str | None = None
    instruction: str | None = None
    response_format: Literal["pcm", "pcm16", "pcm_s16le"] = "pcm"


class ProtocolError(Exception):
    def __init__(self, code: str, message: str, close_code: int = 1008, param: str | None = None):
        super().__init__(message)
        self.code, self.message, self.close_code, self.param = code, message, close_code, param


@router.websocket("/v1/audio/speech/ws")
async def nari_speech(websocket: WebSocket) -> None:
    if not await websocket_authorized(websocket):
        return
    if PROTOCOL not in websocket.scope.get("subprotocols", []):
        await websocket.accept()
        await websocket.close(code=1002, reason=f"required subprotocol: {PROTOCOL}")
        return
    await websocket.accept(subprotocol=PROTOCOL)
    await NariSession(websocket, websocket.app.state.service).run()


def refuse_unspoken(start: NariStart, rate: int) -> None:
    """Settings of /v1/audio/speech that this protocol's raw PCM, as made, cannot honour: refused, not ignored."""
    asked = {"speed": start.speed != 1.0, "volume_multiplier": start.volume_multiplier != 1.0,
             "sample_rate": start.sample_rate not in (None, rate), "non_streaming_mode": bool(start.non_streaming_mode)}
    for name, is_asked in asked.items():
        if is_asked:
            why = ("the text is spoken as it arrives, in streaming-text mode" if name == "non_streaming_mode" else
                   f"the audio is the model's 16-bit PCM at {rate} Hz, as made")
            raise ProtocolError("invalid_request", f"request.start: {name} is not supported by {PROTOCOL} ({why}); "
                                "/v1/audio/speech/stream takes it", param=name)


class NariSession:
    """One connection: one request.start, its text, its audio."""

    def __init__(self, websocket: WebSocket, service: SpeechService):
        self.websocket, self.service = websocket, service
        self.sends = BoundedSends(websocket, service.config.send_timeout_s)
        self.request_id: str | None = None
        self.live: LiveRequest | None = None
        self.audio: asyncio.Task | None = None
        self.sequence = 0  # the next one expected
        self.chars = 0

    @property
    def audio_format(self) -> dict[str, Any]:
        return {"encoding": "pcm_s16le", "sample_rate": self.service.tts.sample_rate, "channels": 1}

    async def run(self) -> None:
        try:
            await self.sends.json({"type": "session.created", "protocol": PROTOCOL, "audio": self.audio_format})
            stop_reason = await self._events()
            if stop_reason == "stop" and self.audio is not None:
                stop_reason = await self._play_out()
            chunks = await self.audio if self.audio is not None else 0
            await self.sends.json({"type": "response.done", "request_id": self.request_id,
                                   "stop_reason": stop_reason, "audio_chunks": chunks})
            await self.sends.send(self.websocket.close(code=1000))
        except ProtocolError as e:
            await self._fail(e.code, e.message, e.close_code, e.param)
        except errors.APIError as e:
            await self._fail(e.code or "invalid_request", e.message, 1011 if e.status >= 500 else 1008, e.param,
                              e.type)
        except LiveTextTimeout as e:
            await self._fail("input_timeout", f"{e}: send text sooner, or input_text.end", 1008, "text")
        except EngineError as e:
            await self._fail("generation_failed", str(e), 1011, error_type="server_error")
        except WebSocketDisconnect:
            pass
        except asyncio.TimeoutError:  # (_send's: the waits for the client's events raise ProtocolError)
            log.warning("websocket %s: the client stopped reading; session closed", request_id_of(self.websocket.scope))
            drop_connection(self.websocket.scope)  # (a close frame would wait behind what the client does not read)
        finally:
            if self.live is not None:
                self.live.cancel()
            if self.audio is not None and not self.audio.done():
                self.audio.cancel()
                with suppress(BaseException):
                    await self.audio

    async def _fail(self, code: str, message: str, close_code: int, param: str | None = None,
                    error_type: str = "invalid_request_error") -> None:
        await self.sends.error(self.request_id, code, message, close_code, param, error_type)

    async def _events(self) -> str:
        """Handles the client's events until the text ends or the client cancels; returns the stop reason."""
        while True:
            event = await self._next_event()
            kind = event.get("type")
            if kind == "request.start":
                await self._start(event)
            elif kind == "input_text.append":
                await self._append(event)
            elif kind == "input_text.end":
                await self._end(event)
                return "stop"
            elif kind == "response.cancel":
                if self.live is None:
                    raise ProtocolError("invalid_state", "response.cancel before request.start")
                self.live.cancel()
                return "cancelled"
            else:
                raise ProtocolError("unknown_event", f"unsupported event type {str(kind)[:40]!r}")

    async def _play_out(self) -> str:
        """After input_text.end: the audio plays out while the client's events are still read, so that a
        response.cancel stops it (a listener who interrupts) and anything else is refused as out of order, not
        dropped unread. Returns the stop reason."""
        receiving = asyncio.ensure_future(self._receive())
        try:
            await asyncio.wait({self.audio, receiving}, return_when=asyncio.FIRST_COMPLETED)
            if not receiving.done():
                return "stop"
            kind = receiving.result().get("type")
            if kind == "response.cancel":
                self.live.cancel()
                return "cancelled"
            if kind in ("request.start", "input_text.append", "input_text.end"):
                raise ProtocolError("invalid_state", f"{kind} after input_text.end")
            raise ProtocolError("unknown_event", f"unsupported event type {str(kind)[:40]!r}")
        finally:
            receiving.cancel()

    async def _next_event(self) -> dict[str, Any]:
        """The client's next event, waited for within bounds: request.start within --body-timeout of connecting,
        text within TEXT_WAIT_S until the generation starts; once it runs, a failure of its audio (its text came
        too late, the engine failed, the client stopped reading) ends the wait, raised here."""
        if self.audio is None:
            timeout = self.service.config.body_timeout_s if self.live is None else TEXT_WAIT_S
            try:
                return await asyncio.wait_for(self._receive(), timeout)
            except asyncio.TimeoutError:
                if self.live is None:
                    raise ProtocolError("request_timeout", f"no request.start within {timeout:g} s of "
                                        "connecting") from None
                raise ProtocolError("input_timeout", f"no text for {timeout:g} s: send text sooner, or "
                                    "input_text.end", param="text") from None
        receiving = asyncio.ensure_future(self._receive())
        try:
            await asyncio.wait({self.audio, receiving}, return_when=asyncio.FIRST_COMPLETED)
            if not receiving.done():
                self.audio.result()  # (its failure; audio that ended early, at max_new_tokens, waits for the end)
            return await receiving
        finally:
            receiving.cancel()

    async def _receive(self) -> dict[str, Any]:
        message = await self.websocket.receive()
        if message["type"] == "websocket.disconnect":
            raise WebSocketDisconnect(message.get("code", 1000))
        if message.get("text") is None:
            raise ProtocolError("invalid_event", "events are JSON text frames")
        try:
            event = json.loads(message["text"])
        except ValueError as e:
            # (split: an over-long integer's message ends in advice to the server's programmer, not the client)
            raise ProtocolError("invalid_event", f"invalid JSON: {str(e).split(';')[0]}") from e
        if not isinstance(event, dict):
            raise ProtocolError("invalid_event", "an event is a JSON object")
        fields = EVENT_FIELDS.get(event.get("type"))
        unknown = sorted(set(event) - set(fields)) if fields else None
        if unknown:  # (a misspelt field would be dropped unread)
            raise ProtocolError("invalid_request", f"{event['type']}: unknown field {unknown[0][:40]!r}; it takes "
                                f"{', '.join(fields)}", param=unknown[0][:40])
        return event

    async def _start(self, event: dict[str, Any]) -> None:
        if self.live is not None:
            raise ProtocolError("invalid_state", "the request was already started (one per connection)")
        try:
            start = NariStart.model_validate(event)
        except ValidationError as e:
            error = e.errors()[0]
            raise ProtocolError("invalid_request", f"request.start: {error['msg']}",
                                param=".".join(map(str, error["loc"])) or None) from e
        service = self.service
        names = [n for n in (start.instructions, start.instruct, start.instruction) if n is not None]
        if len(names) > 1:
            raise ProtocolError("invalid_request", "set one of instructions, instruct and instruction",
                                param="instructions")
        start.instructions = names[0] if names else None
        if start.instruction is not None:  # (an error names it as sent)
            start.name_fields({"instructions": "instruction"})
        refuse_unspoken(start, service.tts.sample_rate)
        service.check_limits(start)
        service.check_ready()
        service.check_model(start.model)
        choice = await service.resolve_voice(start)
        seed = start.seed if start.seed is not None else service.random_seed()
        self.live = service.live(start, choice, seed, TEXT_WAIT_S, pcm_format="int16")
        self.request_id = f"ws-{uuid.uuid4().hex}"
        await self.sends.json({"type": "request.configured"})

    def _check_sequence(self, event: dict[str, Any], kind: str) -> int:
        if self.live is None or self.live.ended:
            raise ProtocolError("invalid_state", f"{kind} " + ("before request.start" if self.live is None
                                                               else "after input_text.end"))
        sequence = event.get("sequence")
        if not isinstance(sequence, int) or isinstance(sequence, bool) or sequence != self.sequence:
            raise ProtocolError("invalid_sequence", f"expected sequence {self.sequence}, got {sequence!r}",
                                param="sequence")
        self.sequence += 1
        return sequence

    async def _append(self, event: dict[str, Any]) -> None:
        sequence = self._check_sequence(event, "input_text.append")
        if self.audio is not None and self.audio.done():  # (its text would be acknowledged and never spoken)
            stream = self.live.stream
            reason = stream.frames.finish_reason if stream is not None else None
            raise ProtocolError("invalid_state", f"the generation already ended (finish reason {reason!r}: "
                                "max_new_tokens reached or the model's end of speech); this text would not be "
                                "spoken", param="text")
        text = event.get("text")
        if not isinstance(text, str) or not text:
            raise ProtocolError("invalid_request", "input_text.append needs a non-empty string `text`", param="text")
        limit = self.service.config.max_input_chars
        self.chars += len(text)
        if len(text) > limit or self.chars > LIVE_TEXT_FACTOR * limit:
            raise ProtocolError("input_too_large", f"text over this server's limit ({limit} characters per append, "
                                f"{LIVE_TEXT_FACTOR * limit} per request)", 1009, "text")
        await self._live_call(self.live.append, text)
        await self._start_audio()
        await self._ack("input_text.append", sequence)

    async def _end(self, event: dict[str, Any]) -> None:
        sequence = self._check_sequence(event, "input_text.end")
        await self._live_call(self.live.end)
        await self._start_audio()
        await self._ack("input_text.end", sequence)

    async def _live_call(self, method, *args: Any) -> None:
        try:
            await self.service.preparation.feed_live(self.live, method, *args)
        except RequestError as e:
            too_long = e.code == "too_long"
            raise ProtocolError("input_too_large" if too_long else "invalid_request", e.message,
                                1009 if too_long else 1008, e.param) from e

    async def _ack(self, kind: str, sequence: int) -> None:
        await self.sends.json({"type": "input_text.ack", "event": kind, "sequence": sequence,
                               "request_id": self.request_id if self.audio is not None else None})

    async def _start_audio(self) -> None:
        """Once the first text token is final: response.started, and the audio task."""
        if self.audio is not None or not self.live.started:
            return
        await self.sends.json({"type": "response.started", "request_id": self.request_id,
                               "audio": self.audio_format})
        self.audio = asyncio.ensure_future(self._send_audio())

    async def _send_audio(self) -> int:
        chunks = 0
        async for chunk in self.live:
            if len(chunk.pcm):
                await self.sends.send(self.websocket.send_bytes(chunk.pcm.tobytes()))
                chunks += 1
        return chunks


class BoundedSends:
    """A connection's sends, each within --send-timeout (a client that stops reading loses the session, and its row,
    raised as asyncio.TimeoutError), and its error event."""

    def __init__(self, websocket: WebSocket, send_timeout_s: float):
        self.websocket, self.send_timeout_s = websocket, send_timeout_s

    async def send(self, sending: Awaitable[None]) -> None:
        await asyncio.wait_for(sending, self.send_timeout_s)

    async def json(self, event: dict[str, Any]) -> None:
        await self.send(self.websocket.send_json(event))

    async def error(self, request_id: str | None, code: str, message: str, close_code: int, param: str | None = None,
                    error_type: str = "invalid_request_error") -> None:
        await close_with(self.websocket, {"type": "error", "request_id": request_id,
                                          "error": {"type": error_type, "code": code, "message": message,
                                                    "param": param}}, close_code, self.send_timeout_s)
