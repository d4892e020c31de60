"""What a route calls to speak, and what it reads back, named once for their several implementations.

A `Speaker` takes a validated request body and answers with its `Speech` once the request is accepted (or raises
the API error a refusal gets), or several bodies (a dialogue's turns) answered together, all of them checked before
any is submitted (a refusal is `RefusedAt`, naming which): the speech service in one process (service.py), the
front's engine processes (front/app.py: `Backends`, each `Backend`, over its `CoreClient` in front/link.py).
`app.state.speaker` is the app's. A `SpeechStream` is the accepted request's audio: the engine's `RequestStream`,
a long input's `PieceStream` (q3tts.api.pieces), or an engine process's `RemoteStream` (front/link.py).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from .errors import APIError
from .schemas import SpeechRequest


class SpeechStream(Protocol):
    """A request's audio as the routes read it: float32 PCM chunks at the speech's sample rate, then why it ended."""

    @property
    def request_id(self) -> str: ...

    @property
    def finish_reason(self) -> str | None:
        """"stop" (the model ended it), "length" (max_new_tokens), ...; None until the stream has ended."""
        ...

    def achunks(self) -> AsyncIterator[np.ndarray]:
        """The audio as it is handed out; raises EngineError if the engine fails mid-stream."""
        ...

    def cancel(self) -> None:
        """Ends the request (its row is freed); nothing if it has ended."""
        ...


@dataclass
class Speech:
    """A request the engine accepted: its audio stream, its text tokens and the audio's sample rate."""

    stream: SpeechStream
    input_tokens: int
    sample_rate: int


class RefusedAt(Exception):
    """Request `index` of several spoken together (`Speaker.speak_all`) was refused with `error`; none of them
    was submitted."""

    def __init__(self, index: int, error: APIError):
        super().__init__(f"request {index}: {error.message}")
        self.index, self.error = index, error


class Speaker(Protocol):
    """What a route calls to speak."""

    async def speak(self, body: SpeechRequest, request_id: str) -> Speech:
        """The request, checked and submitted: its Speech once accepted, or the APIError of its refusal."""
        ...

    async def speak_all(self, bodies: list[SpeechRequest], request_id: str) -> list[Speech]:
        """The requests (`{request_id}.{i}`) spoken together: every one checked and prepared before any is
        submitted, so that a refusal (RefusedAt, the first by index) leaves the engine untouched; the server's
        own refusals (a full queue, a failed engine) are plain APIErrors."""
        ...
