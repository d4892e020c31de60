"""A request's voice and language in the server's terms, resolved once per request (or WebSocket session) before
any audio is made: a preset speaker (CustomVoice), a description (VoiceDesign) or a cloned voice (Base: a stored
voice, reference audio, a speaker embedding, or the default voice), through the alias table of OpenAI's voice
names and the server's own (voice_aliases.py), and `language` as the model names it (languages.py).

Checked against the checkpoint's mode before any reference audio is fetched or encoded.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import logging
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from ..errors import RequestError, quote
from ..request.audio import AudioError
from ..request.embedding import embedding_tensor
from ..request.fetch import FetchError, FetchPolicy, fetch
from ..request.voice import Voice
from ..request.voice_blend import is_mix, mixed_embedding, parse_mix
from . import errors
from .config import ServerConfig
from .languages import kokoro_language, model_language
from .schemas import TASK_TYPES, SpeechSettings
from .voice_aliases import OPENAI_VOICES, VoiceAliases, is_voice_file
from .voice_store import VoiceStore, VoiceStoreError

log = logging.getLogger("q3tts.server")
PLACEHOLDER_VOICES = ("", "default")  # `voice` where none applies (VoiceDesign, ref_audio); OpenAI needs one
DOWNLOAD_THREADS = 8  # reference downloads at once; more wait their turn
CLONING = ("ref_audio", "ref_text", "references", "speaker_embedding", "x_vector_only_mode")


@dataclass
class VoiceChoice:
    """A request's (or a WebSocket session's) voice and language, resolved once."""

    speaker: str | None = None
    voice: Voice | None = None
    instruct: str | None = None
    language: str = "auto"


class VoiceResolver:
    """Resolves requests' voices for one loaded checkpoint (`tts`), its stored voices and the server's aliases.
    `in_worker(fn, *args)` runs blocking work (a stored voice's file) on the service's threads; `api_error` turns a
    RequestError into the API's error."""

    def __init__(self, tts: Any, config: ServerConfig, voices: VoiceStore,
                 in_worker: Callable[..., Awaitable[Any]], api_error: Callable[[RequestError], errors.APIError]):
        self.tts, self.config, self.voices, self.in_worker, self.api_error = tts, config, voices, in_worker, api_error
        model = tts.config
        self.kind = model.tts_model_type
        self.aliases = VoiceAliases.for_checkpoint(self.kind, model.supported_speakers, config.voice_aliases,
                                                   config.default_voice)
        self.default_voice: Voice | None = None  # Base: the default voice, when it is a file (load_default_voice)
        # Reference downloads wait on other servers: threads of their own, so that slow ones never hold the default
        # pool, where the audio encoders run (each ends at its deadline: fetch.py).
        self._downloads = ThreadPoolExecutor(DOWNLOAD_THREADS, thread_name_prefix="q3tts-fetch")

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

    def close(self) -> None:
        self._downloads.shutdown(wait=False)

    @property
    def task_type(self) -> str:
        return TASK_TYPES[self.kind]

    async def resolve(self, s: SpeechSettings) -> VoiceChoice:
        self._check_mode_fields(s)
        language = self.language(s)
        name = self._named(s)
        speaker = self._speaker(name) if self.kind == "custom_voice" else None
        instruct = self._description(name, s.instructions) if self.kind == "voice_design" else s.instructions
        try:
            instruct = self.tts.builder.check_mode(speaker, self.kind == "base", instruct)
            if speaker is not None:
                speaker = self.tts.builder.speaker(speaker)
        except RequestError as e:
            raise self._missing(e) from e
        voice = await self._base_voice(s, name) if self.kind == "base" else None
        return VoiceChoice(speaker, voice, instruct, language)

    def language(self, s: SpeechSettings) -> str:
        supported = self.tts.config.supported_languages
        if s.lang_code is not None:
            return kokoro_language(s.lang_code, supported)
        return model_language(s.language, supported)

    def _check_mode_fields(self, s: SpeechSettings) -> None:
        if s.task_type is not None and s.task_type != self.task_type:
            raise errors.bad_request(f"task_type {quote(s.task_type)} does not match the loaded {self.task_type} "
                                     f"checkpoint {self.config.model_id!r}", param="task_type")
        cloning = [n for n in CLONING if getattr(s, n) not in (None, False)]
        if self.kind != "base" and cloning:
            raise errors.bad_request(f"{cloning[0]} is for voice cloning, which needs a Base checkpoint (this one is "
                                     f"{self.task_type})", param=cloning[0])

    def _named(self, s: SpeechSettings) -> str | None:
        """`voice`, unless it is a placeholder where no name applies (OpenAI's client always sends one): "" or
        "default", or one of OpenAI's names beside what gives the voice itself (reference audio, a VoiceDesign
        description)."""
        name = s.voice_id
        if name in (None, *PLACEHOLDER_VOICES):
            return None
        gives_voice = s.reference[0] is not None or s.speaker_embedding is not None or (
            self.kind == "voice_design" and bool((s.instructions or "").strip()))
        return None if gives_voice and name.lower() in OPENAI_VOICES else name

    def _speaker(self, name: str | None) -> str | None:
        if name is None:
            return self.aliases.default
        return self.aliases.target(name) or name

    def _description(self, name: str | None, instructions: str | None) -> str | None:
        if name is not None and self.aliases.target(name) is None:
            raise errors.bad_request("a VoiceDesign checkpoint has no named voices: describe the voice in "
                                     "`instructions` and omit `voice` (or pass 'default' or one of OpenAI's voice "
                                     "names)", param="voice")
        if (instructions or "").strip():
            return instructions
        return self.aliases.target(name) if name is not None else self.aliases.default or instructions

    def _missing(self, e: RequestError) -> errors.APIError:
        error = self.api_error(e)
        if e.code == "missing":
            error.message += "; or start the server with a default voice (q3tts serve --default-voice)"
        return error

    # ---- Base: voice cloning ------------------------------------------------------------------------------

    async def _base_voice(self, s: SpeechSettings, name: str | None) -> Voice:
        ref_audio, ref_text = s.reference
        if s.speaker_embedding is not None:
            if name is not None or ref_audio is not None:
                raise errors.bad_request("speaker_embedding is the voice itself: send it without `voice` or "
                                         "reference audio", param="speaker_embedding")
            return self._embedding_voice(s.speaker_embedding)
        if ref_audio is not None:
            if name is not None:
                raise errors.bad_request("pass either `voice` (a stored voice) or `ref_audio`, not both",
                                         param="voice")
            return await self._clone(ref_audio, ref_text, s.x_vector_only_mode)
        if ref_text is not None or s.x_vector_only_mode:
            raise errors.bad_request("ref_text and x_vector_only_mode apply only with ref_audio (a stored voice "
                                     "keeps its own)", param="ref_text" if ref_text is not None else
                                     "x_vector_only_mode")
        if name is None:
            return await self._default_voice()
        return await self._stored_or_alias(name)

    async def _stored_or_alias(self, name: str, mixes: bool = True) -> Voice:
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
                return await self._default_voice()
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
            named = [(quote(name), await self._stored_or_alias(name, mixes=False), weight) for name, weight in terms]
            return self.tts.builder.voice(Voice.from_embedding(*mixed_embedding(named, param)))
        except RequestError as e:
            raise errors.bad_request(e.message.removeprefix(f"{param}: "), param=param) from e

    async def _default_voice(self) -> Voice:
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

    def _embedding_voice(self, embedding: list[float]) -> Voice:
        """vLLM-Omni's precomputed `speaker_embedding`: a voice in x-vector-only mode."""
        size = self.tts.config.talker_config.hidden_size
        if len(embedding) != size:
            raise errors.bad_request(f"speaker_embedding has {len(embedding)} values; this checkpoint's speaker "
                                     f"embeddings have {size}", param="speaker_embedding")
        try:
            return self.tts.builder.voice(Voice.from_embedding(embedding_tensor(embedding, "speaker_embedding"),
                                                               self.tts.config.tts_model_size))
        except RequestError as e:
            raise errors.bad_request(e.message.replace("the voice's ref_spk_embedding", "speaker_embedding"),
                                     param="speaker_embedding") from e

    async def _clone(self, ref_audio: str, ref_text: str | None, x_vector_only: bool) -> Voice:
        source = audio_source(ref_audio)
        if isinstance(source, str) and not source.startswith("data:"):
            source = await self._download(source)
        return await self.create_voice(source, ref_text, x_vector_only, "ref_audio")

    async def _download(self, url: str) -> bytes:
        """A ref_audio URL's bytes, as this server's settings allow (off by default)."""
        c = self.config
        if not c.ref_audio_urls:
            raise errors.bad_request("ref_audio URLs are turned off on this server (q3tts serve "
                                     "--allow-ref-audio-urls or --ref-audio-hosts turns them on): send the audio "
                                     "as base64 or upload it to /v1/audio/voices", param="ref_audio",
                                     code="urls_disabled")
        policy = FetchPolicy(max_bytes=c.max_upload_bytes, timeout_s=c.ref_audio_timeout_s, hosts=c.ref_audio_hosts,
                             allow_private=False)
        started = time.monotonic()

        def download() -> bytes:  # (the time limit counts from the request: waiting for a thread included)
            return fetch(url, replace(policy, timeout_s=max(policy.timeout_s - (time.monotonic() - started), 0.0)))

        try:
            return await asyncio.get_running_loop().run_in_executor(self._downloads, download)
        except FetchError as e:
            raise errors.bad_request(str(e), param="ref_audio", code="download_failed") from e

    async def create_voice(self, source: str | bytes, ref_text: str | None, x_vector_only: bool,
                           param: str) -> Voice:
        """Clones a voice from reference audio (Base checkpoints), in a worker thread."""
        if self.kind != "base":
            raise errors.bad_request(f"voice cloning needs a Base checkpoint; this one is {self.task_type}",
                                     param=param)
        try:
            return await asyncio.to_thread(self.tts.create_voice, source, ref_text, x_vector_only)
        except AudioError as e:
            raise errors.bad_request(str(e), param=param) from e
        except RequestError as e:
            raise self.api_error(e) from e

    def listing(self) -> dict:
        """The aliases and the default voice, for `GET /v1/audio/voices`."""
        return {"aliases": self.aliases.listing(), "default_voice": self.aliases.default}


def audio_source(ref_audio: str) -> str | bytes:
    """A URL or data URL as it is; anything else must be base64 audio (never a path on this machine)."""
    text = ref_audio.strip()
    if text.startswith(("http://", "https://", "data:")):
        return text
    try:
        return base64.b64decode("".join(text.split()), validate=True)
    except (binascii.Error, ValueError) as e:
        raise errors.bad_request("ref_audio must be an http(s) URL, a data: URL or base64-encoded audio",
                                 param="ref_audio") from e
