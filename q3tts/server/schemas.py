"""Request bodies. `SpeechRequest` is OpenAI's `/v1/audio/speech` plus Qwen3-TTS fields under vLLM-Omni's names;
`StreamConfig` is the first message of the WebSocket protocol (the same voice and sampling settings).

Ranges are checked here so that a bad value is refused with its field's name before anything runs; what depends
on the loaded checkpoint (speaker names, languages, task type) is checked by the speech service.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field
from pydantic_core import PydanticCustomError

from ..errors import quote
from .body import json_type
from .time_stretch import MAX_SPEED, MIN_SPEED

AudioFormat = Literal["mp3", "opus", "aac", "flac", "wav", "pcm"]
TaskType = Literal["CustomVoice", "VoiceDesign", "Base"]
TASK_TYPES: dict[str, TaskType] = {"custom_voice": "CustomVoice", "voice_design": "VoiceDesign", "base": "Base"}


class VoiceRef(BaseModel):
    model_config = ConfigDict(extra="forbid")
    id: str = Field(min_length=1)


def check_voice(value: object) -> object:
    """`voice` as a name or id, or {"id": ...}, with the actual fault named: pydantic reports a union's first
    member's error ("voice.str: Input should be a valid string") whatever was wrong."""
    if value is None or isinstance(value, (str, VoiceRef)):
        return value
    if not isinstance(value, dict):
        raise PydanticCustomError("invalid_value", 'must be a string (a voice name or id) or {"id": ...}, not '
                                  + json_type(value))
    unknown = [key for key in value if key != "id"]
    if unknown:
        raise PydanticCustomError("invalid_value", f'unknown key {quote(unknown[0])} (an object voice takes only '
                                  f'"id")')
    if "id" not in value:
        raise PydanticCustomError("missing", 'an object voice needs "id" (a voice name or id)')
    if not isinstance(value["id"], str):
        raise PydanticCustomError("invalid_value", f'"id" must be a string, not {json_type(value["id"])}')
    if not value["id"]:
        raise PydanticCustomError("invalid_value", '"id" is empty')
    return value


class SpeechSettings(BaseModel):
    """Everything about how to speak, shared by HTTP requests and WebSocket sessions. Strict: a value of the wrong
    JSON type is refused, never converted ("yes" is not True, "5" is not 5)."""

    model_config = ConfigDict(extra="forbid", strict=True)

    # CustomVoice: a preset speaker; Base: a stored voice's id or name
    voice: Annotated[str | VoiceRef | None, BeforeValidator(check_voice)] = None
    instructions: str | None = None  # -> instruct (style on 1.7B CustomVoice, the voice itself on VoiceDesign)
    response_format: AudioFormat = "mp3"
    speed: float = Field(1.0, ge=MIN_SPEED, le=MAX_SPEED, allow_inf_nan=False)
    task_type: TaskType | None = None
    language: str = "auto"
    ref_audio: str | None = None  # Base: http(s) URL, data URL or base64 audio (instead of a stored voice)
    ref_text: str | None = None
    x_vector_only_mode: bool = False
    non_streaming_mode: bool | None = None
    # Codec frames + 1 (12.5 frames per second); at least 2, so that every response holds audio (N gives at most
    # N - 1 frames, as the official API).
    max_new_tokens: int | None = Field(None, ge=2)
    seed: int | None = Field(None, ge=0, lt=2**63)
    do_sample: bool | None = None
    temperature: float | None = Field(None, gt=0, allow_inf_nan=False)
    top_k: int | None = Field(None, ge=0)
    top_p: float | None = Field(None, gt=0, le=1, allow_inf_nan=False)
    repetition_penalty: float | None = Field(None, gt=0, allow_inf_nan=False)
    subtalker_dosample: bool | None = None
    subtalker_temperature: float | None = Field(None, gt=0, allow_inf_nan=False)
    subtalker_top_k: int | None = Field(None, ge=0)
    subtalker_top_p: float | None = Field(None, gt=0, le=1, allow_inf_nan=False)

    @property
    def voice_id(self) -> str | None:
        return self.voice.id if isinstance(self.voice, VoiceRef) else self.voice

    def sampling(self) -> dict[str, object]:
        """The sampling fields the client set (others take the checkpoint's generation_config values)."""
        names = ("max_new_tokens", "do_sample", "temperature", "top_k", "top_p", "repetition_penalty",
                 "subtalker_dosample", "subtalker_temperature", "subtalker_top_k", "subtalker_top_p")
        return {name: getattr(self, name) for name in names if getattr(self, name) is not None}


class SpeechRequest(SpeechSettings):
    model: str | None = None
    input: str
    stream_format: Literal["audio", "sse"] = "audio"


class StreamConfig(SpeechSettings):
    type: Literal["session.config"]
    response_format: AudioFormat = "pcm"
