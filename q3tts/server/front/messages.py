"""The typed messages between a front and an engine process (link.py), as vLLM's `EngineCoreRequest` /
`EngineCoreOutputs` and mini-sglang's `message/`: one dataclass per message, the body inside `Speak` the
`SpeechRequest` the front validated (the engine process reads it as it is: parsed and validated once).

A WebSocket session crosses as its ASGI events (`SocketOpen`, then `SocketEvent`s both ways): the front speaks the
WebSocket protocol with the client and the engine process runs the session's route on those events, with no
WebSocket (and no HTTP) between the two.

On the socket a message is pickled: both ends are this package, in processes of one user, behind a socket only that
user can reach (link.py). The audio, the one message of the hot path, is not one of these: its float32 bytes cross
as they are (link.AUDIO).
"""

from __future__ import annotations

import pickle
from dataclasses import dataclass, field

from .. import errors
from ..schemas import SpeechRequest
from ..speech import RefusedAt


@dataclass(frozen=True)
class Speak:
    """Front -> engine: a request to speak."""

    request_id: str
    body: SpeechRequest


@dataclass(frozen=True)
class SpeakAll:
    """Front -> engine: requests spoken together (a dialogue's turns; `Speaker.speak_all`), request i on stream
    `numbers[i]`: each is answered on its own stream, all `Accepted` or all `Refused` (the error of one, `index`)."""

    request_id: str
    bodies: tuple[SpeechRequest, ...]
    numbers: tuple[int, ...]


@dataclass(frozen=True)
class Cancel:
    """Front -> engine: the client went away; free the request's row."""


@dataclass(frozen=True)
class SocketOpen:
    """Front -> engine: a WebSocket session the front accepted, run by the engine's own routes as if it had come to
    its HTTP port (`scope`: what of the ASGI scope crosses, `link.socket_scope`); its events follow."""

    scope: dict


@dataclass(frozen=True)
class SocketEvent:
    """Either way, one ASGI event of a session of `SocketOpen`: the client's (websocket.receive, websocket.disconnect)
    to the engine, its app's (websocket.accept, websocket.send, websocket.close, and `SOCKET_END` once the app
    returned) to the front."""

    event: dict


@dataclass(frozen=True)
class Accepted:
    """Engine -> front: the request is submitted; its audio follows."""

    input_tokens: int
    sample_rate: int


@dataclass(frozen=True)
class Refused:
    """Engine -> front: the API error a direct request would have got (the stream ends)."""

    status: int
    message: str
    type: str
    param: str | None = None
    code: str | None = None
    headers: dict[str, str] = field(default_factory=dict)
    index: int | None = None  # (SpeakAll: the request refused, of those spoken together)

    @classmethod
    def of(cls, e: errors.APIError, index: int | None = None) -> Refused:
        return cls(e.status, e.message, e.type, e.param, e.code, e.headers, index)

    def error(self) -> errors.APIError | RefusedAt:
        error = errors.APIError(self.status, self.message, type=self.type, param=self.param, code=self.code,
                                headers=self.headers)
        return error if self.index is None else RefusedAt(self.index, error)


@dataclass(frozen=True)
class Finished:
    """Engine -> front: the audio is complete (`reason`: the stream's finish reason)."""

    reason: str | None


@dataclass(frozen=True)
class Failed:
    """Engine -> front: the engine failed mid-stream (the client's stream ends with an error)."""

    message: str


Message = Speak | SpeakAll | Cancel | SocketOpen | SocketEvent | Accepted | Refused | Finished | Failed
MESSAGES = (Speak, SpeakAll, Cancel, SocketOpen, SocketEvent, Accepted, Refused, Finished, Failed)


def encode(message: Message) -> bytes:
    return pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)


def decode(payload: bytes) -> Message:
    """The message in `payload`; ValueError if it holds something else."""
    message = pickle.loads(payload)
    if not isinstance(message, MESSAGES):
        raise ValueError(f"not a link message: {type(message).__name__}")
    return message
