"""A Base checkpoint's voices by name: stored voices (voice_store.py) by id or name, the server's aliases of them,
Kokoro's mixes of them ("a(2)+b(1)": their blend, voice_blend.py), and the default voice. Split from the resolver
(voice_choice.py), which turns a request's fields into a voice and asks this for a name's."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from ..errors import RequestError, quote
from ..request.voice import Voice
from ..request.voice_blend import is_mix, mixed_embedding, parse_mix
from . import errors
from .voice_aliases import VoiceAliases, is_voice_file
from .voice_store import VoiceStore, VoiceStoreError

log = logging.getLogger("q3tts.server")


class NamedVoices:
    """The voices a name gives on one loaded checkpoint (`tts`): its stored `voices`, through the server's
    `aliases`. `in_worker(fn, *args)` runs blocking work (a stored voice's file) on the service's threads."""

    def __init__(self, tts: Any, kind: str, aliases: VoiceAliases, voices: VoiceStore,
                 in_worker: Callable[..., Awaitable[Any]]):
        self.tts, self.kind, self.aliases, self.voices, self.in_worker = tts, kind, aliases, voices, in_worker
        self.default_voice: Voice | None = None  # Base: the default voice, when it is a file (load_default_voice)

    def load_default_voice(self) -> None:
        """A Base checkpoint's default voice given as a file: a saved voice, or a recording cloned from its
        speaker embedding alone (a transcript takes `q3tts voice create --ref-text`). ValueError if unusable."""
        value = self.aliases.default
        if self.kind != "base" or value is None or not is_voice_file(value):
            return
        path = Path(value).expanduser()
        try:
            voice = Voice.load(path) if path.suffix == ".safetensors" else self.tts.create_voice(str(path), None, True)
            self.default_voice = self.tts.builder.voice(voice)
        except RequestError as e:
            raise ValueError(f"default_voice {value}: {e.message}") from None
        log.info("default voice: %s", path)

    async def stored_or_alias(self, name: str, mixes: bool = True) -> Voice:
        """A stored voice by id or name; else the stored voice an alias names; else, for one of OpenAI's names,
        the default voice. `mixes`: a mix ("a(2)+b(1)"), or an alias of one, is their blend (not within a mix)."""
        if (found := await self._stored(name)) is not None:
            return found
        if is_mix(name) and mixes:
            return await self.mixed(name, "voice")
        target = self.aliases.target(name)
        if target is not None and target != name:
            if (found := await self._stored(target)) is not None:
                return found
            if is_mix(target) and mixes:  # (an alias of a blend: --voice-alias narrator="amy(2)+bob(1)")
                return await self.mixed(target, "voice")
            raise errors.not_found(f"voice {quote(name)} is an alias of the stored voice {quote(target)}, which does "
                                   "not exist", param="voice", code="voice_not_found")
        if target is not None:  # one of OpenAI's names, with no stored voice of that name
            if self.aliases.default is not None:
                return await self.default()
            raise errors.bad_request(
                f"voice {quote(name)} is one of OpenAI's voice names, and this Base checkpoint clones voices: upload "
                f"a voice named {quote(name)} (POST /v1/audio/voices), map the name to a stored voice (q3tts serve "
                f"--voice-alias {name}=NAME), or give the server a default voice (--default-voice)", param="voice",
                code="voice_not_configured")
        raise errors.not_found(f"voice {quote(name)} not found", param="voice", code="voice_not_found")

    async def mixed(self, text: str, param: str) -> Voice:
        """Kokoro's mix of stored voices, "a(2)+b(1)" (each a stored voice or an alias of one): their blend
        (voice_blend.py)."""
        try:
            terms = parse_mix(text, param)
            named = [(quote(name), await self.stored_or_alias(name, mixes=False), weight) for name, weight in terms]
            return self.tts.builder.voice(Voice.from_embedding(*mixed_embedding(named, param)))
        except RequestError as e:
            raise errors.bad_request(e.message.removeprefix(f"{param}: "), param=param) from e

    async def default(self) -> Voice:
        """The default voice (q3tts serve --default-voice): a file loaded at start, or a stored voice."""
        if self.default_voice is not None:
            return self.default_voice
        default = self.aliases.default
        if default is None:
            raise errors.bad_request("this Base checkpoint clones voices: pass `voice` (an id from POST "
                                     "/v1/audio/voices) or `ref_audio`, or start the server with a default voice "
                                     "(q3tts serve --default-voice)", param="voice", code="missing")
        if (found := await self._stored(default)) is None:
            raise errors.not_found(f"the default voice {quote(default)} (--default-voice) is not a stored voice",
                                   param="voice", code="voice_not_found")
        return found

    async def _stored(self, key: str) -> Voice | None:
        try:
            found = await self.in_worker(self.voices.get, key)
        except VoiceStoreError as e:
            raise errors.APIError(500, str(e), type=errors.SERVER, param="voice", code="voice_unreadable") from None
        return None if found is None else found[1]
