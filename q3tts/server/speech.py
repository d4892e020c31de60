"""`POST /v1/audio/speech`: OpenAI's speech endpoint, streamed as the audio is generated.

`stream_format="audio"` (default) sends the encoded audio as a chunked body; `"sse"` sends server-sent events
`{"type": "speech.audio.delta", "audio": <base64 of the encoded bytes>}` and a final
`{"type": "speech.audio.done", "usage": {...}}` (input tokens = text tokens, output tokens = codec frames).
A failure mid-stream ends an SSE stream with `{"type": "error", "error": {...}}` and cuts an audio stream
(no final chunk, so the client sees an incomplete body). A client that goes away cancels its generation.
"""

from __future__ import annotations

import base64
import json
import logging
from collections.abc import AsyncIterator, Callable

from fastapi import APIRouter, Depends, Request
from fastapi.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from ..engine import EngineError, RequestStream
from .audio_encoding import MEDIA_TYPES, AudioEncoder, encode_async, flush_async, make_encoder
from .auth import require_api_key
from .errors import SERVER, error_body
from .middleware import request_id_of
from .schemas import SpeechRequest
from .service import SpeechService

log = logging.getLogger("q3tts.server")
router = APIRouter(dependencies=[Depends(require_api_key)])


class CancellingStreamingResponse(StreamingResponse):
    """Calls `on_close` however the response ends: finished, failed, or cancelled by a client disconnect."""

    def __init__(self, content: AsyncIterator[bytes], on_close: Callable[[], None], **kwargs):
        super().__init__(content, **kwargs)
        self.on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.on_close()


@router.post("/v1/audio/speech")
async def create_speech(body: SpeechRequest, request: Request) -> StreamingResponse:
    """Validate everything, submit, then stream; no byte is sent before the request is accepted."""
    service: SpeechService = request.app.state.service
    service.check_ready()
    service.check_model(body.model)
    choice = await service.resolve_voice(body)
    job = await service.prepare(body.input, body, choice)
    encoder = make_encoder(body.response_format, service.tts.sample_rate, body.speed)
    stream = service.submit(job, request_id_of(request.scope))
    on_failure = request.app.state.metrics.count_error
    if body.stream_format == "sse":
        events = sse_events(stream, encoder, job.input_tokens, on_failure)
        return CancellingStreamingResponse(events, stream.cancel, media_type="text/event-stream",
                                           headers={"Cache-Control": "no-cache"})
    return CancellingStreamingResponse(audio_bytes(stream, encoder, on_failure), stream.cancel,
                                       media_type=MEDIA_TYPES[body.response_format])


async def audio_bytes(stream: RequestStream, encoder: AudioEncoder,
                      on_failure: Callable[[str], None]) -> AsyncIterator[bytes]:
    try:
        async for pcm in stream:
            if data := await encode_async(encoder, pcm):
                yield data
    except EngineError:
        on_failure("stream_failed")
        log.error("request %s failed mid-stream (the engine logged why)", stream.request_id)
        raise
    if data := await flush_async(encoder):
        yield data


async def sse_events(stream: RequestStream, encoder: AudioEncoder, input_tokens: int,
                     on_failure: Callable[[str], None]) -> AsyncIterator[bytes]:
    frames = 0
    try:
        async for pcm in stream:
            frames += 1
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
    yield _event({"type": "speech.audio.done", "usage": usage})


def _event(payload: dict) -> bytes:
    return f"data: {json.dumps(payload)}\n\n".encode()
