"""Request bodies. `SpeechRequest` is OpenAI's `/v1/audio/speech` plus the fields of the other speech servers'
requests that clients send (vLLM-Omni, SGLang-Omni, Kokoro-FastAPI, nari-qwen3-tts; docs/http-api.md has the
table); `StreamConfig` is the first message of the WebSocket protocol (the same voice and sampling settings).

A field of those APIs is honoured where q3tts can (`speaker` is `voice`, `instruct` is `instructions`,
`sample_rate` resamples, ...), accepted and ignored where it only tunes another server's delivery (`stream`: q3tts
always streams), and accepted only at the value that asks for nothing where it asks for what q3tts does not do
(`word_timestamps: true` is a 400 that says so). Any other key is a 400 naming it, so a misspelled field is never
taken for an unknown one. Ranges are checked here, so that a bad value is refused with its field's name before
anything runs; what depends on the loaded checkpoint (speaker names, languages, task type) is checked by the speech
service.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ModelWrapValidatorHandler,
    PrivateAttr,
    TypeAdapter,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

from ..errors import RequestError, quote
from ..request.embedding import decode_base64
from . import errors
from .body import json_type
from .time_stretch import MAX_SPEED, MIN_SPEED

AudioFormat = Literal["mp3", "opus", "aac", "flac", "wav", "pcm"]
TaskType = Literal["CustomVoice", "VoiceDesign", "Base"]
TASK_TYPES: dict[str, TaskType] = {"custom_voice": "CustomVoice", "voice_design": "VoiceDesign", "base": "Base"}
MIN_SAMPLE_RATE, MAX_SAMPLE_RATE = 8000, 48000  # `sample_rate`: the audio is resampled (soxr) to it
# The rates the lossy encoders take (libmp3lame, libopus, FFmpeg's aac); wav, pcm and flac take any in the range
ENCODER_RATES = {"mp3": (8000, 11025, 12000, 16000, 22050, 24000, 32000, 44100, 48000),
                 "opus": (8000, 12000, 16000, 24000, 48000),
                 "aac": (8000, 11025, 12000, 16000, 22050, 24000, 32000, 44100, 48000)}
# Other APIs' names for a field: alias -> field (vLLM-Omni and SGLang-Omni's `speaker`, nari's `instruct`)
ALIASES = {"speaker": "voice", "instruct": "instructions"}
# Fields the other APIs declare optional: null there means the default, as here
NULL_IS_DEFAULT = ("speed", "language", "stream_format", "x_vector_only_mode", "stream", "volume_multiplier",
                   "word_timestamps", "ignore_eos", "return_download_link", "return_timing", "allow_voice_tags", "ssml",
                   "skip_fixed_bootstrap_audio", "stream_audio", "split_granularity", "text_input_mode")


def check_rate(fmt: str, rate: int | None) -> None:
    """A lossy format's encoder takes only its own rates."""
    if rate is not None and fmt in ENCODER_RATES and rate not in ENCODER_RATES[fmt]:
        rates = ", ".join(map(str, ENCODER_RATES[fmt]))
        raise errors.bad_request(f"sample_rate: {fmt} takes {rates} Hz, not {rate}", param="sample_rate")


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


# A request's `voice`: a name or id, or {"id": ...} (OpenAI's custom voices), checked by check_voice
VoiceField = Annotated[str | VoiceRef | None, BeforeValidator(check_voice)]


def check_embedding(value: object) -> object:
    """`speaker_embedding` as numbers: base64 decoded, NaN and infinities (which Python's JSON reads) refused."""
    if isinstance(value, str):
        try:
            return decode_base64(value)
        except RequestError as e:
            raise PydanticCustomError("invalid_value", e.message.removeprefix("speaker_embedding: ")) from None
    if isinstance(value, list) and any(isinstance(x, float) and not math.isfinite(x) for x in value):
        raise PydanticCustomError("invalid_value", "holds NaN or infinite values")
    return value


def by_json_type(members: dict[str, Any], what: str) -> BeforeValidator:
    """A union read as its member for the value's JSON type (`members`: json_type's name -> type), so that an error is
    that member's, at the field: pydantic's own union reports every member's failure, each under the member's name
    ("voice_aliases.n.str: Input should be a valid string" for an object whose `rate` is out of range)."""
    adapters = {kind: TypeAdapter(member) for kind, member in members.items()}

    def check(value: Any) -> Any:
        adapter = adapters.get(json_type(value))
        if adapter is None:
            raise PydanticCustomError("invalid_value", f"must be {what}, not {json_type(value)}")
        return adapter.validate_python(value, strict=True)  # (its ValidationError's errors: at this field)
    return BeforeValidator(check)


def only(is_noop: Callable[[Any], bool], why: str) -> AfterValidator:
    """A field accepted only at the value that asks for nothing; any other is refused saying why."""
    def check(value: Any) -> Any:
        if not is_noop(value):
            raise PydanticCustomError("unsupported", why)
        return value
    return AfterValidator(check)


def _empty(value: Any) -> bool:
    return not value


Frames = Annotated[int, Field(ge=1, le=128)]


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


def speed_range(why: str = "") -> BeforeValidator:
    """A number out of the speed's range, refused naming the range (pydantic names only the bound it passed)."""
    def check(value: object) -> object:
        if isinstance(value, (int, float)) and not isinstance(value, bool) and not MIN_SPEED <= value <= MAX_SPEED:
            raise PydanticCustomError("invalid_value", f"must be from {MIN_SPEED:g} to {MAX_SPEED:g}{why}")
        return value
    return BeforeValidator(check)


AliasVoice = Annotated[str, Field(min_length=1, max_length=256)]


class KokoroAlias(Strict):
    """Kokoro-FastAPI's `voice_aliases` target with a pace: {"voice": ..., "rate": ...}."""

    voice: AliasVoice
    rate: Annotated[float | None, speed_range(" (it multiplies speed)")] = Field(
        None, ge=MIN_SPEED, le=MAX_SPEED, allow_inf_nan=False)


AliasTarget = Annotated[str | KokoroAlias, by_json_type({"a string": AliasVoice, "an object": KokoroAlias},
                                                        'a voice (a string) or {"voice": ..., "rate": ...}')]


REFERENCE_AUDIO_KEYS = ("audio_path", "ref_audio", "audio", "data")
REFERENCE_AUDIO_CHOICE = f"one of {', '.join(REFERENCE_AUDIO_KEYS[:-1])} and {REFERENCE_AUDIO_KEYS[-1]}"


class Reference(Strict):
    """An item of `references` (vLLM-Omni's and SGLang-Omni's voice-cloning form): the same as `ref_audio` (one of
    the audio keys: an http(s) URL, a data: URL or base64 audio) and `ref_text`."""

    audio_path: str | None = None
    ref_audio: str | None = None
    audio: str | None = None
    data: str | None = None
    media_type: str | None = Field(None, max_length=100)  # of `data` given as bare base64 (SGLang-Omni)
    text: str | None = None
    vq_codes: Annotated[list | None, only(lambda v: v is None, "precomputed codec codes are for other models; give "
                                          "the reference audio")] = None

    @property
    def source(self) -> str | None:
        key = self.audio_key
        value = getattr(self, key) if key is not None else None
        if value is not None and key == "data" and self.media_type and not value.startswith("data:"):
            return f"data:{self.media_type};base64,{value}"
        return value

    @property
    def audio_key(self) -> str | None:
        """Which of the audio keys the client sent (None: none)."""
        return next((key for key in REFERENCE_AUDIO_KEYS if getattr(self, key) is not None), None)

    @model_validator(mode="after")
    def _one_audio(self) -> Reference:
        given = [key for key in REFERENCE_AUDIO_KEYS if getattr(self, key) is not None]
        if len(given) > 1:  # (at references.<i>, where pydantic places it)
            raise PydanticCustomError("invalid_value", f"a reference takes {REFERENCE_AUDIO_CHOICE}, not "
                                      f"{' and '.join(given)} together")
        return self


class KokoroNormalization(Strict):
    """Kokoro-FastAPI's text normalisation switches: accepted and ignored (Qwen3-TTS reads text as written)."""

    normalize: bool = True
    unit_normalization: bool = False
    url_normalization: bool = True
    email_normalization: bool = True
    optional_pluralization_normalization: bool = True
    phone_normalization: bool = True
    replace_remaining_symbols: bool = True


class PeerFields(Strict):
    """Fields of the other servers' speech requests that tune only their own delivery (accepted, checked, ignored:
    q3tts streams every frame as it is decoded) or ask for what Qwen3-TTS does not do (accepted at their no-op
    value only)."""

    stream: bool = True  # q3tts always streams
    initial_codec_chunk_frames: int | None = Field(None, ge=0)  # vLLM-Omni, SGLang-Omni
    stream_chunk_schedule: list[Frames] | None = Field(None, min_length=1, max_length=32)  # nari
    stream_chunk_frames: Frames | None = None
    stream_first_chunk_frames: Frames | None = None
    stream_steady_chunk_frames: Frames | None = None
    skip_fixed_bootstrap_audio: bool = True  # nari: q3tts sends every frame, as the official model makes it
    normalization_options: KokoroNormalization | None = None
    download_format: AudioFormat | None = None  # Kokoro: only with return_download_link
    word_timestamps: Annotated[bool, only(_empty, "word timestamps need a forced aligner, which q3tts does not "
                                                  "run")] = False
    ignore_eos: Annotated[bool, only(_empty, "generation ends at the model's end of speech or at max_new_tokens; "
                                             "set max_new_tokens")] = False
    return_download_link: Annotated[bool, only(_empty, "q3tts keeps no files to download")] = False
    return_timing: Annotated[bool, only(_empty, "timestamps are not supported: q3tts returns the audio alone")] = False
    allow_voice_tags: Annotated[bool, only(_empty, "one voice per request: [voice:name] tags are not "
                                                   "supported")] = False
    ssml: Annotated[bool, only(_empty, "the model reads plain text, not SSML")] = False
    extra_params: Annotated[dict[str, Any] | None, only(_empty, "q3tts has no model-specific parameters beyond "
                                                                "this request's fields")] = None
    stage_params: Annotated[dict[str, Any] | None, only(_empty, "q3tts has no per-stage parameters; give the "
                                                                "sampling fields")] = None
    ref_audio_2: Annotated[str | None, only(lambda v: v is None, "a second speaker (MOSS-TTSD) is not supported: "
                                                                 "Qwen3-TTS speaks one voice")] = None
    ambient_sound: Annotated[str | None, only(lambda v: v is None, "ambient sound (MOSS-SoundEffect) is not "
                                                                   "supported")] = None
    duration_seconds: Annotated[float | None, only(lambda v: v is None, "a target duration is not supported; "
                                                                        "bound the length with max_new_tokens "
                                                                        "(12.5 per second)")] = None
    token_count: Annotated[int | None, only(lambda v: v is None, "a target duration is not supported; bound the "
                                                                 "length with max_new_tokens")] = None
    duration_tokens: Annotated[int | None, only(lambda v: v is None, "a target duration is not supported; bound "
                                                                     "the length with max_new_tokens")] = None


class SpeechSettings(PeerFields):
    """Everything about how to speak, shared by HTTP requests and WebSocket sessions. Strict: a value of the wrong
    JSON type is refused, never converted ("yes" is not True, "5" is not 5)."""

    # CustomVoice: a preset speaker; Base: a stored voice's id or name; any: an alias (voice_aliases.py)
    voice: VoiceField = None
    instructions: str | None = None  # -> instruct (style on 1.7B CustomVoice, the voice itself on VoiceDesign)
    response_format: AudioFormat = "mp3"
    sample_rate: int | None = Field(None, ge=MIN_SAMPLE_RATE, le=MAX_SAMPLE_RATE)  # None: the model's (24 kHz)
    speed: Annotated[float, speed_range()] = Field(1.0, ge=MIN_SPEED, le=MAX_SPEED, allow_inf_nan=False)
    volume_multiplier: float = Field(1.0, ge=0, le=10, allow_inf_nan=False)  # Kokoro-FastAPI
    task_type: TaskType | None = None
    language: str = "auto"  # a name, ISO 639 code or BCP-47 tag (languages.py)
    lang_code: str | None = Field(None, max_length=8)  # Kokoro-FastAPI's one-letter code
    ref_audio: str | None = None  # Base: http(s) URL, data URL or base64 audio (instead of a stored voice)
    ref_text: str | None = None
    references: list[Reference] | None = Field(None, min_length=1, max_length=1)  # ref_audio + ref_text, as a list
    # Base: x-vector only; a list of floats or base64 of little-endian float32 (vLLM-Omni)
    speaker_embedding: Annotated[list[float] | None, BeforeValidator(check_embedding)] = Field(
        None, min_length=1, max_length=8192)
    x_vector_only_mode: bool = False
    voice_aliases: dict[str, AliasTarget] | None = Field(None, max_length=64)  # Kokoro: this request's own
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
    _sent_as: dict[str, str] = PrivateAttr(default_factory=dict)  # field -> the other API's name the client sent
    _aliases: dict[str, str | KokoroAlias] = PrivateAttr(default_factory=dict)  # voice_aliases by lowered name

    @model_validator(mode="wrap")
    @classmethod
    def _other_names(cls, data: Any, handler: ModelWrapValidatorHandler[SpeechSettings]) -> SpeechSettings:
        """Other APIs' names and nulls as this API's fields (before validation, so that errors name the field the
        client sent): `speaker` -> `voice`, `instruct` -> `instructions`, null -> the default. The names sent are
        kept, for the errors of later checks (`names_as_sent`)."""
        if not isinstance(data, dict):
            return handler(data)
        sent_as: dict[str, str] = {}
        data = {k: v for k, v in data.items() if not (v is None and k in NULL_IS_DEFAULT and k in cls.model_fields)}
        for alias, name in ALIASES.items():
            if alias not in data:
                continue
            value = data.pop(alias)
            if value is None:
                continue
            if not isinstance(value, str):
                raise errors.bad_request(f"{alias} must be a string, not {json_type(value)}", param=alias)
            if data.get(name) is not None:
                raise errors.bad_request(f"{alias} is another name for {name}: send one of them", param=alias)
            data[name], sent_as[name] = value, alias
        if data.get("lang_code") is not None and data.get("language") is not None:
            raise errors.bad_request("lang_code is Kokoro's name for language: send one of them", param="lang_code")
        settings = handler(data)
        settings._sent_as = sent_as
        return settings

    @model_validator(mode="after")
    def _rate_of_format(self) -> SpeechSettings:
        check_rate(self.response_format, self.sample_rate)
        return self

    @model_validator(mode="after")
    def _request_aliases(self) -> SpeechSettings:
        """Kokoro-FastAPI's `voice_aliases`, this request's own names for voices (matched in any case; a target's
        `rate` multiplies `speed`, held within its range, as Kokoro does), applied here and dropped, so that the
        front and the engine process read the request alike."""
        if not self.voice_aliases:
            return self
        self._aliases = {name.lower(): target for name, target in self.voice_aliases.items()}
        target = self.alias_target(self.voice_id)
        self.voice_aliases = None
        if target is not None:
            self.voice = target if isinstance(target, str) else target.voice
            rate = 1.0 if isinstance(target, str) or target.rate is None else target.rate
            self.speed = min(max(self.speed * rate, MIN_SPEED), MAX_SPEED)
        return self

    @field_validator("voice_aliases")
    @classmethod
    def _alias_names(cls, aliases: dict | None) -> dict | None:
        seen: dict[str, str] = {}
        for name in aliases or {}:
            if not 0 < len(name) <= 256:  # (a voice's length: AliasTarget's, at voice_aliases.<name>)
                raise PydanticCustomError("invalid_value", f"{quote(name)}: names are 1-256 characters")
            if name.lower() in seen:  # (else the one given last would win, the other dropped)
                raise PydanticCustomError("invalid_value", f"{quote(seen[name.lower()])} and {quote(name)} are one "
                                          "name (names match in any case): give it once")
            seen[name.lower()] = name
        return aliases

    def alias_target(self, voice: str | None) -> str | KokoroAlias | None:
        """What `voice` names by this request's own `voice_aliases` (any case), else None; kept after they are
        applied to `voice` and dropped, for the voices a dialogue's turns name (routes/dialogue.py)."""
        return self._aliases.get((voice or "").lower())

    @property
    def voice_id(self) -> str | None:
        return self.voice.id if isinstance(self.voice, VoiceRef) else self.voice

    def sent_name(self, name: str) -> str:
        """A field's name as the client sent it: the other API's name it came by (`instruct`), or the key of
        `references` that gave ref_audio or ref_text (`references.0.audio_path`)."""
        if self.references and name in ("ref_audio", "ref_text"):
            key = self.references[0].audio_key if name == "ref_audio" else "text"
            return f"references.0.{key}" if key is not None else "references.0"
        return self._sent_as.get(name, name)

    def name_fields(self, sent_as: dict[str, str]) -> None:
        """The names the client sent these fields by, where they came from elsewhere (a dialogue's turn)."""
        self._sent_as = {**self._sent_as, **sent_as}

    @contextmanager
    def names_as_sent(self) -> Iterator[None]:
        """An APIError raised inside names its field as the client sent it (`sent_name`), in `param` and at the
        start of its message ("instructions is 2001 characters" -> "instruct is ...", "ref_audio: ..." ->
        "references.0.data: ...")."""
        try:
            yield
        except errors.APIError as e:
            sent = self.sent_name(e.param) if e.param else None
            if sent is not None and sent != e.param:
                if e.message.startswith((f"{e.param} ", f"{e.param}: ")):
                    e.message = sent + e.message[len(e.param):]
                e.param = sent
            raise

    @property
    def reference(self) -> tuple[str | None, str | None]:
        """(ref_audio, ref_text), from those fields or from `references`."""
        if not self.references:
            return self.ref_audio, self.ref_text
        if self.ref_audio is not None or self.ref_text is not None:
            raise errors.bad_request("give the reference as ref_audio and ref_text or as references, not both",
                                     param="references")
        item = self.references[0]
        return item.source, item.text

    def sampling(self) -> dict[str, object]:
        """The sampling fields the client set (others take the checkpoint's generation_config values)."""
        names = ("max_new_tokens", "do_sample", "temperature", "top_k", "top_p", "repetition_penalty",
                 "subtalker_dosample", "subtalker_temperature", "subtalker_top_k", "subtalker_top_p")
        return {name: getattr(self, name) for name in names if getattr(self, name) is not None}


class SpeechRequest(SpeechSettings):
    model: str | None = None
    input: str
    # "audio" unless "sse" is asked for: a body with `stream: true` and no stream_format gets raw audio, as the
    # clients of SGLang-Omni, nari and M* expect (vLLM-Omni sends SSE then)
    stream_format: Literal["audio", "sse"] = "audio"


class StreamConfig(SpeechSettings):
    """The WebSocket's session.config: websocket.py. Its defaults depend on `protocol`."""

    type: Literal["session.config"]
    protocol: Literal["vllm-omni", "q3tts"] = "vllm-omni"  # which server events the session gets
    model: str | None = None
    stream_audio: bool = False  # vllm-omni: audio as it is made (pcm), else one whole file per segment
    split_granularity: Literal["none", "sentence", "clause"] | None = None  # vllm-omni; None: text_input_mode's
    text_input_mode: Literal["buffered", "commitment"] = "buffered"  # vllm-omni's other name for it
    # live: one generation per session (vLLM-Omni: per utterance) fed as text arrives; sentence: cut into segments
    segmentation: Literal["live", "sentence"] | None = None  # None: live, but sentence where cuts are asked for

    @model_validator(mode="before")
    @classmethod
    def _format_of_protocol(cls, data: Any) -> Any:
        """The default response_format: vLLM-Omni's (wav) or q3tts's (pcm)."""
        if isinstance(data, dict) and data.get("response_format") is None:
            data = {**data, "response_format": "pcm" if data.get("protocol") == "q3tts" else "wav"}
        return data

    @model_validator(mode="after")
    def _protocol_settings(self) -> StreamConfig:
        if self.stream_audio and self.response_format != "pcm":
            raise errors.bad_request("stream_audio needs response_format pcm (a whole file per segment otherwise)",
                                     param="stream_audio")
        if self.protocol == "q3tts" and (self.stream_audio or self.split_granularity is not None
                                         or "text_input_mode" in self.model_fields_set):
            raise errors.bad_request("stream_audio, split_granularity and text_input_mode are vLLM-Omni's session "
                                     "settings; a q3tts session streams one audio stream and cuts text at sentences "
                                     "and clauses", param="protocol")
        if self.split_granularity is not None and "text_input_mode" in self.model_fields_set:
            raise errors.bad_request("split_granularity and text_input_mode are two names of one setting: send one",
                                     param="text_input_mode")
        cuts = self.split_granularity is not None or "text_input_mode" in self.model_fields_set
        if self.segmentation == "live" and (self.non_streaming_mode or cuts):
            field = "non_streaming_mode" if self.non_streaming_mode else "split_granularity / text_input_mode"
            raise errors.bad_request(f"segmentation live speaks the text as it arrives, in streaming-text mode: it "
                                     f"cannot be combined with {field}; set segmentation to sentence",
                                     param="segmentation")
        if self.segmentation is None:
            self.segmentation = "sentence" if self.non_streaming_mode or cuts else "live"
        return self

    @property
    def granularity(self) -> str:
        """How text is cut into requests (segmentation sentence): none (the whole utterance), sentence or clause;
        vLLM-Omni's split_granularity, or text_input_mode's, else sentence."""
        if self.split_granularity is not None:
            return self.split_granularity
        if "text_input_mode" in self.model_fields_set:
            return "sentence" if self.text_input_mode == "commitment" else "none"
        return "sentence"
