"""`POST /v1/audio/dialogue`: a script of turns spoken as one audio stream, in every format the speech endpoint
streams (`response_format`, `stream_format` "audio" or "sse").

The body is the speech request's settings (voice, language, sampling, format: the defaults of every turn) and
`turns`, each `{"voice" (or "speaker"), "input" (or "text"), "instructions" (or "instruct"), "language",
"pause"}`. Each turn is a speech request of its own, and every turn is checked whole (its fields, its voice
resolved, its prompt built and fitted to the engine: `Speaker.speak_all`) before any is submitted, so a bad turn is
refused before anything runs. Errors name the turn: `turns[2].voice`. All turns are then queued at once, so they
generate together (as rows of one batch; behind a front, on one engine process) and are sent in script order, each
followed by its pause's silence.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any, Literal

import numpy as np
from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse
from pydantic import Field, ModelWrapValidatorHandler, PrivateAttr, ValidationError, model_validator

from ...errors import quote
from ...request.dialogue import MAX_PAUSE_S
from .. import errors
from ..audio_encoding import MEDIA_TYPES, make_encoder
from ..body import check_query, openapi_body, read_json
from ..middleware import request_id_of
from ..schemas import KokoroAlias, SpeechRequest, SpeechSettings, Strict, VoiceField, VoiceRef
from ..speech import RefusedAt, Speaker, Speech
from .speech import CancellingStreamingResponse, audio_bytes, sse_events

router = APIRouter()  # authentication: guard.py
MAX_TURNS = 64
TURN_ALIASES = {"speaker": "voice", "text": "input", "instruct": "instructions"}


class DialogueTurn(Strict):
    voice: VoiceField = None
    input: str
    instructions: str | None = None
    language: str | None = None
    pause: float = Field(0.0, ge=0, le=MAX_PAUSE_S, allow_inf_nan=False)  # seconds of silence after the turn
    _sent_as: dict[str, str] = PrivateAttr(default_factory=dict)  # field -> the other name the client sent

    @model_validator(mode="wrap")
    @classmethod
    def _other_names(cls, data: Any, handler: ModelWrapValidatorHandler[DialogueTurn]) -> DialogueTurn:
        if not isinstance(data, dict):
            return handler(data)
        data = dict(data)
        sent_as = {name: alias for alias, name in TURN_ALIASES.items() if alias in data}
        for name, alias in sent_as.items():
            data[name] = data.pop(alias)
        turn = handler(data)
        turn._sent_as = sent_as
        return turn


class DialogueRequest(SpeechSettings):
    model: str | None = None
    turns: list[DialogueTurn] = Field(min_length=1, max_length=MAX_TURNS)
    stream_format: Literal["audio", "sse"] = "audio"

    @model_validator(mode="before")
    @classmethod
    def _one_name_each(cls, data: Any) -> Any:
        # Here, not in DialogueTurn: only the request knows which turn it is, for the error's param.
        turns = data.get("turns") if isinstance(data, dict) else None
        for i, turn in enumerate(turns if isinstance(turns, list) else []):
            sent = turn.keys() if isinstance(turn, dict) else set()
            both = [alias for alias, name in TURN_ALIASES.items() if {alias, name} <= sent]
            if both:
                raise errors.bad_request(f"turn {i}: {both[0]} is another name for {TURN_ALIASES[both[0]]}: send one "
                                         "of them", param=f"turns[{i}].{both[0]}")
        return data


class DialogueStream:
    """The turns' streams read in script order, with each turn's pause (the interface the speech route reads)."""

    def __init__(self, streams: list[Any], pauses: list[int], request_id: str):
        self.streams, self.pauses, self.request_id = streams, pauses, request_id

    async def achunks(self) -> AsyncIterator[np.ndarray]:
        for stream, pause in zip(self.streams, self.pauses):
            async for pcm in stream.achunks():
                yield pcm
            if pause:
                yield np.zeros(pause, dtype=np.float32)

    @property
    def finish_reason(self) -> str | None:
        return self.streams[-1].finish_reason

    def cancel(self) -> None:
        for stream in self.streams:
            stream.cancel()


@router.post("/v1/audio/dialogue", openapi_extra=openapi_body(DialogueRequest, "/v1/audio/dialogue"))
async def create_dialogue(request: Request) -> StreamingResponse:
    check_query(request.query_params, DialogueRequest)
    body = read_json(DialogueRequest, request.headers.get("content-type"), await request.body())
    turns = [_turn_request(body, i) for i in range(len(body.turns))]  # (every turn's fields, before any runs)
    request_id = request_id_of(request.scope)
    speaker: Speaker = request.app.state.speaker
    try:  # (every turn checked and prepared before any is submitted)
        speeches: list[Speech] = await speaker.speak_all(turns, request_id)
    except RefusedAt as e:
        raise _renamed(body.turns[e.index], e.index, e.error) from None
    rate = speeches[0].sample_rate
    pauses = [round(t.pause * rate) for t in body.turns]
    stream = DialogueStream([s.stream for s in speeches], pauses, request_id)
    state = request.app.state
    out_rate = body.sample_rate or rate
    encoder = make_encoder(body.response_format, rate, body.speed, out_rate, body.volume_multiplier)
    headers = {"x-sample-rate": str(out_rate)}
    if body.stream_format == "sse":
        events = sse_events(stream, encoder, sum(s.input_tokens for s in speeches), state.metrics.count_error)
        return CancellingStreamingResponse(events, stream.cancel, state.config.send_timeout_s,
                                           media_type="text/event-stream", headers={"Cache-Control": "no-cache",
                                                                                    **headers})
    return CancellingStreamingResponse(audio_bytes(stream, encoder, state.metrics.count_error), stream.cancel,
                                       state.config.send_timeout_s, media_type=MEDIA_TYPES[body.response_format],
                                       headers=headers)


def _turn_request(body: DialogueRequest, i: int) -> SpeechRequest:
    """Turn `i` as a speech request: the body's settings, the turn's own fields over them."""
    turn = body.turns[i]
    settings = body.model_dump(exclude={"turns"}, exclude_unset=True)
    own = {"voice": _turn_voice(body, i), "instructions": turn.instructions, "language": turn.language}
    data = {**settings, **{k: v for k, v in own.items() if v is not None}, "input": turn.input}
    try:
        request = SpeechRequest.model_validate(data)
    except ValidationError as e:
        raise _renamed(turn, i, errors.from_validation(e)) from None
    except errors.APIError as e:
        raise _renamed(turn, i, e) from None
    # Later errors name a field as the client sent it: the turn's, else the body's default
    defaults = {name: body.sent_name(name) for name in ("voice", "instructions") if own[name] is None}
    request.name_fields({**defaults, **turn._sent_as})
    return request


def _turn_voice(body: DialogueRequest, i: int) -> str | VoiceRef | None:
    """Turn i's voice, through the body's `voice_aliases` as the body's own voice is. A target's `rate` is refused:
    it multiplies the speed, and a dialogue has one (the body's)."""
    turn = body.turns[i]
    name = turn.voice.id if isinstance(turn.voice, VoiceRef) else turn.voice
    target = body.alias_target(name)
    if isinstance(target, KokoroAlias) and target.rate not in (None, 1.0):
        sent = turn._sent_as.get("voice", "voice")
        raise _renamed(turn, i, errors.bad_request(
            f"{sent} {quote(name)} is an alias with a rate, which would change the speed of the whole dialogue: "
            "give the alias without its rate, or set speed", param=sent))
    if target is None:
        return turn.voice
    return target if isinstance(target, str) else target.voice


def _renamed(turn: DialogueTurn, i: int, e: errors.APIError) -> errors.APIError:
    """The error as turn i's: "turn 2: ...", param turns[2].<field>; one about a default the body sent (its
    `voice`, say, for a turn that names none) stays the body's field, as sent."""
    field = (e.param or "").split(".")[0]
    field = TURN_ALIASES.get(field, field)  # (as the client sent it: `text`, say)
    if field and getattr(turn, field, None) is None:  # (None: the turn takes the body's; see _turn_request)
        return e
    e.message, e.param = f"turn {i}: {e.message}", f"turns[{i}].{e.param}" if e.param else f"turns[{i}]"
    return e
