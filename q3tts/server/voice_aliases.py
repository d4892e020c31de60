"""Voice names beyond the checkpoint's own: OpenAI's built-in voices (clients such as Pipecat send nothing else),
the server's own aliases (`q3tts serve --voice-alias alloy=vivian`, `ServerConfig(voice_aliases=...)`) and its
default voice (`--default-voice`), for a request that names none.

What an alias stands for depends on the checkpoint: on CustomVoice a preset speaker (OpenAI's names map to
`SPEAKERS` unless overridden), on VoiceDesign a description of the voice (`DESCRIPTIONS`; a request's
`instructions` win), on Base a stored voice's name or id (OpenAI's names map to a stored voice of that name, else
to the default voice). `GET /v1/audio/voices` lists the table.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import quote

# The voice names of the openai SDK's `audio.speech.create(voice=...)` type (openai 3.57)
OPENAI_VOICES = ("alloy", "ash", "ballad", "coral", "echo", "fable", "onyx", "nova", "sage", "shimmer", "verse",
                 "marin", "cedar")
# CustomVoice: OpenAI's voices as the released checkpoints' preset speakers, by character (the dialect speakers
# dylan and eric are left out: with language "auto" they speak their dialect, also in English text)
SPEAKERS = {"alloy": "vivian", "ash": "ryan", "ballad": "aiden", "coral": "serena", "echo": "aiden", "fable": "ryan",
            "onyx": "uncle_fu", "nova": "vivian", "sage": "serena", "shimmer": "sohee", "verse": "ryan",
            "marin": "ono_anna", "cedar": "uncle_fu"}
# VoiceDesign: OpenAI's voices described in words
DESCRIPTIONS = {
    "alloy": "A clear, balanced and friendly voice of a young adult woman, speaking at a natural, even pace.",
    "ash": "A confident, warm male voice, speaking clearly at a relaxed pace.",
    "ballad": "An expressive, gentle male voice with a soft, melodic delivery.",
    "coral": "A warm, cheerful female voice, friendly and engaging, speaking at a lively pace.",
    "echo": "A calm, smooth male voice with a resonant midrange, speaking evenly.",
    "fable": "An animated male storyteller's voice with a slight British accent.",
    "onyx": "A deep, authoritative male voice with a low, rich timbre, speaking slowly and steadily.",
    "nova": "A bright, energetic young female voice, upbeat and clear.",
    "sage": "A calm, thoughtful female voice, soft-spoken and reassuring.",
    "shimmer": "A light, gentle female voice with a soothing, airy quality.",
    "verse": "A versatile, expressive male voice, natural and conversational.",
    "marin": "A natural, friendly female voice with a clear, professional tone.",
    "cedar": "A warm, grounded male voice with a natural, conversational tone.",
}
NAME = re.compile(r"[\w.\- ]{1,64}")  # an alias's name, as a stored voice's
MAX_TARGET_CHARS = 2000  # a description (VoiceDesign), as --max-instructions-chars' default


def parse_aliases(texts: list[str]) -> dict[str, str]:
    """`NAME=VOICE` items (the command line's --voice-alias, Ray Serve's voice_aliases) as {name: voice}."""
    aliases: dict[str, str] = {}
    for text in texts:
        name, sep, target = text.partition("=")
        if not sep:
            raise ValueError(f"voice_aliases: {quote(text)}: expected NAME=VOICE, e.g. alloy=vivian")
        if name.strip() in aliases:
            raise ValueError(f"voice_aliases: {quote(name.strip())} is given twice")
        aliases[name.strip()] = target.strip()
    return aliases


def check_aliases(aliases: dict[str, str]) -> dict[str, str]:
    """The aliases with lower-case names (names are matched in any case), each name and target checked."""
    checked: dict[str, str] = {}
    for name, target in aliases.items():
        if not isinstance(name, str) or not NAME.fullmatch(name):
            raise ValueError(f"voice_aliases: the name {quote(name)} must be 1-64 letters, digits, spaces, '.', '_' "
                             "or '-'")
        if not isinstance(target, str) or not target.strip() or len(target) > MAX_TARGET_CHARS:
            raise ValueError(f"voice_aliases: {name}={quote(target)}: the voice must be a non-empty text of at most "
                             f"{MAX_TARGET_CHARS} characters")
        if name.lower() in checked:
            raise ValueError(f"voice_aliases: {quote(name)} is given twice")
        checked[name.lower()] = target.strip()
    return checked


def is_voice_file(value: str) -> bool:
    """Whether a --default-voice names a file (a saved voice or a recording) rather than a stored voice."""
    return "/" in value or "\\" in value or Path(value).suffix.lower() in (".safetensors", ".wav", ".flac", ".mp3",
                                                                           ".ogg", ".m4a")


@dataclass
class VoiceAliases:
    """The alias table of one checkpoint: lower-case name -> target (a speaker, a description or a stored voice),
    and the default voice (None: a request must name one)."""

    kind: str  # the checkpoint's tts_model_type: custom_voice, voice_design or base
    targets: dict[str, str] = field(default_factory=dict)
    default: str | None = None

    @classmethod
    def for_checkpoint(cls, kind: str, speakers: list[str], overrides: dict[str, str],
                       default: str | None) -> VoiceAliases:
        """OpenAI's voices in this kind's default table, then `overrides`; a ValueError names an alias or default
        that this checkpoint cannot use."""
        overrides = check_aliases(overrides)
        if kind == "custom_voice":
            fallback = speakers[0] if speakers else None  # (a fine-tuned checkpoint with other speakers)
            table = {name: SPEAKERS[name] if SPEAKERS[name] in speakers else fallback for name in OPENAI_VOICES}
            table = {k: v for k, v in table.items() if v is not None}
            for name, target in overrides.items():
                if target.lower() not in speakers:
                    raise ValueError(f"voice_aliases: {name}={quote(target)}: not a speaker of this checkpoint "
                                     f"(speakers: {', '.join(speakers)})")
            overrides = {k: v.lower() for k, v in overrides.items()}
        elif kind == "voice_design":
            table = dict(DESCRIPTIONS)
        else:  # base: a stored voice of that name (else the default voice: service.py)
            table = {name: name for name in OPENAI_VOICES}
        aliases = cls(kind, {**table, **overrides}, default)
        if default is not None:
            aliases.check_default(speakers)
        return aliases

    def check_default(self, speakers: list[str]) -> None:
        value = self.default
        if not value.strip():
            raise ValueError("default_voice is empty")
        if self.kind == "custom_voice":
            target = self.targets.get(value.lower(), value).lower()
            if target not in speakers:
                raise ValueError(f"default_voice {quote(value)}: not a speaker of this checkpoint nor an alias of one "
                                 f"(speakers: {', '.join(speakers)})")
            self.default = target
        elif self.kind == "base" and is_voice_file(value) and not Path(value).expanduser().is_file():
            raise ValueError(f"default_voice {quote(value)}: no such file (a saved voice from `q3tts voice create`, a "
                             "recording, or the name of a stored voice)")

    def target(self, name: str) -> str | None:
        return self.targets.get(name.lower())

    def listing(self) -> list[dict]:
        """The table as `GET /v1/audio/voices` lists it."""
        key = {"custom_voice": "speaker", "voice_design": "description", "base": "stored_voice"}[self.kind]
        return [{"name": name, "type": "alias", key: target} for name, target in self.targets.items()]
