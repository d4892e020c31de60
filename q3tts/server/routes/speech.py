"""`POST /v1/audio/speech`: OpenAI's speech endpoint, streamed as the audio is generated.

`stream_format="audio"` (default) sends the encoded audio as a chunked body (`x-sample-rate` says its rate:
the model's 24 kHz, or `sample_rate`); `"sse"` sends server-sent events
`{"type": "speech.audio.delta", "audio": <base64 of the encoded bytes>}` and a final
`{"type": "speech.audio.done", "finish_reason": ..., "usage": {...}}` (input tokens = text tokens, output tokens =
codec frames; finish_reason "eos", "length", or "runaway" / "repetition" when the runaway guard ended it).
A failure mid-stream ends an SSE stream with `{"type": "error", "error": {...}}` and cuts an audio stream
(no final chunk, so the client sees an incomplete body). A client that goes away cancels its generation.
"""

from __future__ import annotations

import asyncio
import base64
import json
import logging
from collections.abc import AsyncIterator, Callable

from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse
from starlette.types import Message, Receive, Scope, Send

from ...engine import EngineError
from ...engine.stream import FRAME_SAMPLES
from ..audio_encoding import MEDIA_TYPES, AudioEncoder, encode_async, flush_async, make_encoder
from ..body import check_query, openapi_body, read_json
from ..errors import SERVER, error_body
from ..middleware import drop_connection, logged, request_id_of
from ..schemas import SpeechRequest
from ..speech import Speaker, Speech, SpeechStream

log = logging.getLogger("q3tts.server")
router = APIRouter()  # authentication: guard.py


class CancellingStreamingResponse(StreamingResponse):
    """Calls `on_close` however the response ends: finished, failed, cancelled by a client disconnect, or cut
    because the client stopped reading for `send_timeout_s` (its stream would otherwise hold a row)."""

    def __init__(self, content: AsyncIterator[bytes], on_close: Callable[[], None], send_timeout_s: float,
                 **kwargs):
        super().__init__(content, **kwargs)
        self.on_close, self.send_timeout_s = on_close, send_timeout_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async def send_in_time(message: Message) -> None:
            try:
                await asyncio.wait_for(send(message), self.send_timeout_s)
            except asyncio.TimeoutError as e:
                log.warning("request %s: the client stopped reading for %g s; stream cut", request_id_of(scope),
                            self.send_timeout_s)
                drop_connection(scope)
                logged(e)
                raise

        try:
            await super().__call__(scope, receive, send_in_time)
        finally:
            self.on_close()


@router.post("/v1/audio/speech", openapi_extra=openapi_body(SpeechRequest, "/v1/audio/speech"))
async def create_speech(request: Request) -> StreamingResponse:
    """Validate everything, submit, then stream; no byte is sent before the request is accepted. The speaker is
    the speech service (one process) or the front's, which hands the request to an engine process (front/link.py)."""
    check_query(request.query_params, SpeechRequest)
    body = read_json(SpeechRequest, request.headers.get("content-type"), await request.body())
    speaker: Speaker = request.app.state.speaker
    speech: Speech = await speaker.speak(body, request_id_of(request.scope))
    stream, state = speech.stream, request.app.state
    rate = body.sample_rate or speech.sample_rate
    encoder = make_encoder(body.response_format, speech.sample_rate, body.speed, rate, body.volume_multiplier)
    on_failure, send_timeout_s = state.metrics.count_error, state.config.send_timeout_s
    headers = {"x-sample-rate": str(rate)}  # (SGLang-Omni's clients read it; for pcm it is the only statement)
    if body.stream_format == "sse":
        events = sse_events(stream, encoder, speech.input_tokens, on_failure)
        return CancellingStreamingResponse(events, stream.cancel, send_timeout_s, media_type="text/event-stream",
                                           headers={"Cache-Control": "no-cache", **headers})
    return CancellingStreamingResponse(audio_bytes(stream, encoder, on_failure), stream.cancel, send_timeout_s,
                                       media_type=MEDIA_TYPES[body.response_format], headers=headers)


async def audio_bytes(stream: SpeechStream, encoder: AudioEncoder,
                      on_failure: Callable[[str], None]) -> AsyncIterator[bytes]:
    try:
        async for pcm in stream.achunks():  # one write per hand-out, not per frame
            if data := await encode_async(encoder, pcm):
                yield data
    except EngineError as e:
        on_failure("stream_failed")
        log.error("request %s failed mid-stream: %s", stream.request_id, e)
        logged(e)
        raise
    if data := await flush_async(encoder):
        yield data


async def sse_events(stream: SpeechStream, encoder: AudioEncoder, input_tokens: int,
                     on_failure: Callable[[str], None]) -> AsyncIterator[bytes]:
    frames = 0
    try:
        async for pcm in stream.achunks():
            frames += len(pcm) // FRAME_SAMPLES
            if data := await encode_async(encoder, pcm):
                yield _event({"type": "speech.audio.delta", "audio": base64.b64encode(data).decode()})
    except EngineError as e:
        on_failure("stream_failed")
        log.error("request %s failed mid-stream (the engine logged why)", stream.request_id)
        yield _event({"type": "error", **error_body(str(e), SERVER, code="engine_error")})
        return
    if data := await flush_async(encoder):
        yield _event({"type": "speech.audio.delta", "audio": base64.b64encode(data).decode()})
    usage = {"input_tokens": input_tokens, "output_tokens": frames, "total_tokens": input_tokens + frames}
    yield _event({"type": "speech.audio.done", "finish_reason": stream.finish_reason, "usage": usage})


def _event(payload: dict) -> bytes:
    return f"data: {json.dumps(payload)}\n\n".encode()
