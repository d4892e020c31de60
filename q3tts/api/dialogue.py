"""Dialogues: a script of turns rendered as one audio. Every turn is validated first (nothing runs if one is bad),
then all of them are submitted at once: they generate as rows of one batch, so a script takes about as long as its
longest turn, not the sum (bench/dialogue.py). Their audio is joined in script order, each turn followed by its
pause; streamed, a turn's frames are handed out once the turns before it are out.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from ..errors import RequestError
from ..request.builder import Request
from ..request.dialogue import Turn, check_turns, turn_error
from .pieces import join

if TYPE_CHECKING:
    from ..engine import RequestStream
    from .render import Renderer


class DialogueHost(Protocol):
    """What a dialogue needs of `TTS` (which it cannot import: `TTS.dialogue` calls it)."""

    sample_rate: int
    renderer: Renderer

    def pieces(self, text: str, **kwargs: Any) -> list[Request]: ...

    def synthesize_all(self, requests: list[Request]) -> list[np.ndarray]: ...


def dialogue_requests(tts: DialogueHost, turns: Any,
                      defaults: dict[str, Any]) -> tuple[list[Turn], list[list[Request]]]:
    """The checked turns and each one's requests (a long turn is spoken in pieces); RequestError naming the
    turn's index and field."""
    turns = check_turns(turns)
    requests = []
    for i, turn in enumerate(turns):
        own = {"speaker": turn.speaker, "voice": turn.voice, "instruct": turn.instruct, "language": turn.language}
        kwargs = {**defaults, **{k: v for k, v in own.items() if v is not None}}
        try:
            requests.append(tts.pieces(turn.text, **kwargs))
        except RequestError as e:
            if e.param in defaults and own.get(e.param) is None:  # (a default's fault, named as the caller passed it)
                raise
            raise turn_error(i, e) from e
    return turns, requests


def render_dialogue(tts: DialogueHost, turns: Any, defaults: dict[str, Any]) -> np.ndarray:
    turns, requests = dialogue_requests(tts, turns, defaults)
    wavs = iter(tts.synthesize_all([r for pieces in requests for r in pieces]))
    out = []
    for turn, pieces in zip(turns, requests):
        out += [join([next(wavs) for _ in pieces]), _silence(tts, turn.pause)]
    return np.concatenate(out)


def stream_dialogue(tts: DialogueHost, turns: Any, defaults: dict[str, Any]) -> Iterator[np.ndarray]:
    turns, requests = dialogue_requests(tts, turns, defaults)  # (checked now, not at the first next())
    streams = tts.renderer.submit_all([r for pieces in requests for r in pieces])
    return _frames_in_order(tts, turns, [len(p) for p in requests], streams)


def _frames_in_order(tts: DialogueHost, turns: list[Turn], counts: list[int],
                     streams: list[RequestStream]) -> Iterator[np.ndarray]:
    try:
        at = 0
        for turn, count in zip(turns, counts):
            for stream in streams[at:at + count]:
                yield from stream
            at += count
            if turn.pause:
                yield _silence(tts, turn.pause)
    finally:  # (left early, or failed: the turns still generating free their rows)
        for stream in streams:
            stream.cancel()


def _silence(tts: DialogueHost, seconds: float) -> np.ndarray:
    return np.zeros(round(seconds * tts.sample_rate), dtype=np.float32)
