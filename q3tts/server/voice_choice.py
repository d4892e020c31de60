"""A request's voice and language in the server's terms, resolved once per request (or WebSocket session) before
any audio is made: a preset speaker (CustomVoice), a description (VoiceDesign) or a cloned voice (Base: a stored
voice, reference audio, a speaker embedding, or the default voice), through the alias table of OpenAI's voice
names and the server's own (voice_aliases.py; a name's stored voice, mix or default: named_voices.py), and
`language` as the model names it (languages.py).

Checked against the checkpoint's mode before any reference audio is fetched or encoded.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import Any

from ..errors import RequestError, quote
from ..request.audio import AudioError
from ..request.embedding import embedding_tensor
from ..request.fetch import FetchError, FetchPolicy, fetch
from ..request.voice import Voice
from . import errors
from .config import ServerConfig
from .languages import kokoro_language, model_language
from .named_voices import NamedVoices
from .schemas import REFERENCE_AUDIO_CHOICE, TASK_TYPES, SpeechSettings
from .voice_aliases import OPENAI_VOICES, VoiceAliases
from .voice_store import VoiceStore

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
        self.named = NamedVoices(tts, self.kind, self.aliases, voices, in_worker)  # (Base: voices by name)
        # Reference downloads wait on other servers: threads of their own, so that slow ones never hold the default
        # pool, where the audio encoders run (each ends at its deadline: fetch.py).
        self._downloads = ThreadPoolExecutor(DOWNLOAD_THREADS, thread_name_prefix="q3tts-fetch")

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
        if s.references and ref_audio is None:
            raise errors.bad_request(f"references.0: the reference has no audio: give it {REFERENCE_AUDIO_CHOICE}",
                                     param="references.0", code="missing")
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
            return await self.named.default()
        return await self.named.stored_or_alias(name)

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
        except AudioError as e:  # ("audio bytes: ...", the loader's name for bytes: here they are the field's)
            message = str(e)
            if message.startswith("audio bytes: "):
                message = f"{param}: {message.removeprefix('audio bytes: ')}"
            raise errors.bad_request(message, param=param) from e
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
