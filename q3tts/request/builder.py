"""One request, validated once: what to say, in which voice, how to sample.

`RequestBuilder.build` (behind `TTS.request` and every entry point) checks everything a caller can get wrong
against the loaded checkpoint, before any compute: the mode (speaker, voice, instruction), the language, the text,
the voice and the sampling arguments; `RequestBuilder.fit` then applies the length budget, given the engine's
context limit as a value (`q3tts.engine.config.ContextLimit`). Errors are
`RequestError`s naming the argument at fault; the command line and the HTTP server translate them into their own
terms and never check again.

The length rule, applied here and nowhere else: a request needs prompt + `max_new_tokens` talker positions, at
most the engine's per-request context (`EngineConfig.max_context`, itself at most the model's 32,768 positions
and what the KV cache holds). An explicit `max_new_tokens` that does not fit is an error naming the setting to
change; the checkpoint's default (`generation_config.json`: 8,192 frames for the released models) is lowered to
what fits.
"""

from __future__ import annotations

import difflib
import numbers
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any

import torch

from ..config import GenerationConfig, ModelConfig
from ..engine.config import ContextLimit
from ..errors import RequestError, RequestTypeError, quote, warn_caller
from ..sampling import SamplingParams
from .prompt import PromptSpec, prompt_length
from .text_tokenizer import TextTokenizer, assistant_text, instruct_text, ref_text
from .voice import Voice, size_name

MAX_TEXT_TOKENS = 4096  # per request; documented in the README
SAMPLING_ARGS = frozenset(f.name for f in fields(SamplingParams))
MIN_FRAMES = 2  # a request must have room for at least this many max_new_tokens


_KIND_NAMES = {"base": "Base", "custom_voice": "CustomVoice", "voice_design": "VoiceDesign"}
_KIND_METHODS = {"base": "generate_voice_clone (a reference recording)", "voice_design": "generate_voice_design (a "
                 "voice described in words)", "custom_voice": "generate_custom_voice (a preset speaker)"}


@dataclass(frozen=True)
class RunawayGuard:
    """Ends a request whose audio grows far beyond what its text can need, or that repeats itself: at most
    `frames_per_token` frames (80 ms each) per text token plus `min_frames`, and at most `repeated_frames`
    identical frames in a row. Speech takes 3-4 frames per token; the defaults allow 20 plus 10 s, and 5 s of one
    frame repeated. On by default in `q3tts serve`; off unless given in the Python API (the drop-in methods
    keep the official behaviour: `max_new_tokens` only)."""

    frames_per_token: float = 20.0
    min_frames: int = 125
    repeated_frames: int = 64

    def __post_init__(self):
        if not self.frames_per_token > 0 or self.min_frames < 1 or self.repeated_frames < 2:
            raise RequestError("runaway_guard needs frames_per_token > 0, min_frames >= 1 and repeated_frames >= 2",
                               "runaway_guard")

    def frame_limit(self, text_tokens: int) -> int:
        return self.min_frames + int(self.frames_per_token * max(text_tokens, 1))


@dataclass(frozen=True)
class Request:
    """A validated request (build it with `TTS.request`): the prompt's tokens and voice, and its sampling."""

    spec: PromptSpec
    params: SamplingParams
    num_positions: int  # the prompt's length in talker positions
    guard: RunawayGuard | None = None
    explicit_max_new_tokens: bool = False  # given by the caller (else the checkpoint's default: lowered to fit)

    @property
    def text_tokens(self) -> int:
        return len(self.spec.input_ids) - 8  # the text without the chat template's tokens


GREEDY_UNUSED = {"do_sample": ("temperature", "top_k", "top_p"),
                 "subtalker_dosample": ("subtalker_temperature", "subtalker_top_k", "subtalker_top_p")}


class RequestBuilder:
    """Validates requests for one loaded checkpoint."""

    def __init__(self, config: ModelConfig, text_tokenizer: TextTokenizer, generation_config: GenerationConfig):
        self.config, self.text_tokenizer, self.generation_config = config, text_tokenizer, generation_config

    @property
    def kind(self) -> str:
        return self.config.tts_model_type

    def require(self, kind: str, method: str) -> None:
        """Raises RequestError if this checkpoint is not of `kind` (base, custom_voice, voice_design), naming the
        checkpoints `method` needs and what this one offers instead."""
        if self.kind != kind:
            size = {"0b6": "0.6B", "1b7": "1.7B"}.get(self.config.tts_model_size, self.config.tts_model_size)
            example = f"Qwen/Qwen3-TTS-12Hz-{'1.7B' if kind == 'voice_design' else size}-{_KIND_NAMES[kind]}"
            raise RequestError(f"{method} needs a {_KIND_NAMES[kind]} checkpoint (e.g. {example}); this one is "
                               f"{size}-{_KIND_NAMES[self.kind]}: use {_KIND_METHODS[self.kind]}", "model")

    def build(self, text: str, *, speaker: str | None = None, voice: Voice | str | Path | None = None,
              instruct: str | None = None, language: str | None = "auto", non_streaming_mode: bool | None = None,
              seed: int | None = None, sampling: dict[str, Any] | None = None, official: bool = False,
              runaway_guard: RunawayGuard | None = None) -> Request:
        """One request in whatever mode the checkpoint offers, its length not yet fitted to the engine's context
        (`fit`). `official`: the official API's leniencies (an empty voice-design instruction; a CustomVoice request
        without a speaker)."""
        _check_known(sampling or {}, ("speaker", "voice", "instruct", "language", "non_streaming_mode", "seed"))
        if isinstance(voice, (str, Path)):
            voice = Voice.load(voice)
        instruct = self.check_mode(speaker, voice is not None, instruct, official)
        if non_streaming_mode is None:
            non_streaming_mode = self.kind != "base"
        elif isinstance(non_streaming_mode, str) or non_streaming_mode not in (True, False):
            raise RequestTypeError(f"non_streaming_mode must be True, False or None, got {quote(non_streaming_mode)}",
                                   "non_streaming_mode")
        speaker = None if _is_no_speaker(speaker) else self.speaker(speaker)
        spec = self._spec(text, self.language(language), bool(non_streaming_mode), instruct, speaker,
                          self.voice(voice) if voice is not None else None)
        arguments = {**(sampling or {}), "seed": seed}
        return Request(spec, self.sampling(arguments), prompt_length(self.config, spec), runaway_guard,
                       arguments.get("max_new_tokens") is not None)

    def check_mode(self, speaker: str | None, has_voice: bool, instruct: str | None, official: bool = False
                   ) -> str | None:
        """Whether speaker / voice / instruction suit this checkpoint's mode; returns the instruction to use."""
        kind = self.kind
        if kind == "base" and not has_voice:
            raise RequestError("this Base checkpoint clones voices: pass `voice` (see TTS.create_voice)", "voice",
                               "missing")
        if kind != "base" and has_voice:
            raise RequestError(f"this {kind} checkpoint cannot clone voices; use a Base checkpoint", "voice")
        # The official `generate_custom_voice` takes None or "" for a speaker and builds the prompt without a
        # speaker position (the voice then comes from the instruction alone, as in VoiceDesign): the drop-in does too.
        if kind == "custom_voice" and _is_no_speaker(speaker) and not official:
            raise RequestError(f"this CustomVoice checkpoint needs `speaker`, one of {self.config.supported_speakers}",
                               "speaker", "missing")
        if kind != "custom_voice" and not _is_no_speaker(speaker):
            raise RequestError(f"`speaker` needs a CustomVoice checkpoint (this one is {kind})", "speaker")
        if instruct is not None and not isinstance(instruct, str):
            raise RequestTypeError(f"instruct must be a string, got {type(instruct).__name__}", "instruct")
        if instruct:
            check_unicode(instruct, "instruct")
        if kind == "voice_design" and not (instruct or "").strip() and not official:
            raise RequestError("this VoiceDesign checkpoint needs `instruct`, a description of the voice", "instruct",
                               "missing")
        if instruct and kind == "base":
            raise RequestError("Base checkpoints take no `instruct`", "instruct")
        if instruct and not self.config.supports_instruct:  # (the official drop-in drops it before: official.py)
            raise RequestError("this 0.6B CustomVoice checkpoint does not follow `instruct` (1.7B ones do)",
                               "instruct")
        return instruct or None

    def language(self, language: str | None) -> str:
        supported = self.config.supported_languages
        language = "auto" if language is None else language
        if not isinstance(language, str) or language.lower() not in supported:
            raise RequestError(f"unsupported language {quote(language)}; supported: {supported}", "language")
        return language.lower()

    def speaker(self, speaker: str) -> str:
        supported = self.config.supported_speakers
        if not isinstance(speaker, str) or speaker.lower() not in supported:
            raise RequestError(f"unknown speaker {quote(speaker)}; supported: {supported}", "speaker", "not_found")
        return speaker.lower()

    def voice(self, voice: Voice) -> Voice:
        if not isinstance(voice, Voice):
            raise RequestTypeError(f"expected a Voice / VoiceClonePromptItem, got {type(voice).__name__}", "voice")
        hidden, size = self.config.talker_config.hidden_size, self.config.tts_model_size
        embedding = voice.ref_spk_embedding
        if (not isinstance(embedding, torch.Tensor) or not embedding.is_floating_point()
                or embedding.shape not in ((embedding.numel(),), (1, embedding.numel()))):
            raise RequestError(f"the voice's ref_spk_embedding must be a float tensor [{hidden}] (or [1, {hidden}]), "
                               f"got {_describe(embedding)}", "voice")
        if embedding.numel() != hidden or voice.model_size not in (None, size):
            made_for = size_name(voice.model_size) if voice.model_size else "different"
            raise RequestError(f"this voice was made for a {made_for} model (embedding size "
                               f"{embedding.numel()}); this checkpoint is {size_name(size)} with "
                               f"embedding size {hidden}: create the voice again with this model", "voice")
        # (Values are checked on the CPU only: reading a GPU tensor here would wait for the engine's frames in flight.
        # The voices this package makes hold their codes on the CPU.)
        if embedding.device.type == "cpu" and not torch.isfinite(embedding).all():
            raise RequestError("the voice's ref_spk_embedding holds NaN or infinite values", "voice")
        if voice.icl_mode:
            if voice.ref_code is None or not voice.ref_text or not isinstance(voice.ref_text, str):
                raise RequestError("an in-context voice needs reference codes and reference text", "voice")
            check_unicode(voice.ref_text, "ref_text")
            self._check_ref_code(voice.ref_code)
        return voice

    def _check_ref_code(self, codes: Any) -> None:
        """In-context reference codes: [frames >= 1, num_code_groups] integers, each a codec code (an id beyond the
        codebook would fail the engine's embedding lookup, on a GPU the process's device; the codes of the voices
        this package makes, and of those the server stores, are on the CPU)."""
        groups = self.config.talker_config.num_code_groups
        size = self.config.talker_config.code_predictor_config.vocab_size
        if (not isinstance(codes, torch.Tensor) or codes.dtype == torch.bool or codes.is_floating_point()
                or codes.is_complex() or codes.dim() != 2 or codes.shape[0] < 1 or codes.shape[1] != groups):
            raise RequestError(f"the voice's ref_code must be an integer tensor [frames, {groups}] with at least one "
                               f"frame, got {_describe(codes)}", "voice")
        if codes.device.type != "cpu":
            return
        low, high = (int(x) for x in torch.aminmax(codes))
        if low < 0 or high >= size:
            raise RequestError(f"the voice's ref_code holds codes in [{low}, {high}]; codec codes are 0..{size - 1}",
                               "voice")

    def params(self, arguments: dict[str, Any]) -> SamplingParams:
        """SamplingParams from the caller's sampling arguments (None or absent: the checkpoint's default)."""
        _check_known(arguments)
        defaults = {f.name: getattr(self.generation_config, f.name) for f in fields(GenerationConfig)}
        given = {k: v for k, v in arguments.items() if v is not None}
        # A stage decoded greedily uses none of its sampling arguments: as in transformers, they are ignored with a
        # warning (not checked: temperature=0 beside do_sample=False is no mistake).
        unused = []
        for switch, names in GREEDY_UNUSED.items():
            sampled = given.get(switch, defaults[switch])
            if isinstance(sampled, numbers.Integral) and not sampled:
                unused += [name for name in names if name in given]
        if unused:
            warn_caller(f"{', '.join(f'`{name}`' for name in unused)}: used only when sampling, ignored with "
                        "greedy decoding")
        return SamplingParams(**{**defaults, **{k: v for k, v in given.items() if k not in unused}})

    def sampling(self, arguments: dict[str, Any]) -> SamplingParams:
        """`params`, with a max_new_tokens of at least MIN_FRAMES (the official API fails on 1, in torch.stack)."""
        params = self.params(arguments)
        if arguments.get("max_new_tokens") is not None and params.max_new_tokens < MIN_FRAMES:
            raise RequestError(f"max_new_tokens must be at least {MIN_FRAMES}, got {params.max_new_tokens}: the "
                               f"step that ends the audio is one of them, so N gives at most N - 1 frames",
                               "max_new_tokens")
        return params

    def fit(self, request: Request, context: ContextLimit) -> Request:
        """The length rule: `request` if its prompt and max_new_tokens fit the positions one request may hold;
        with the checkpoint's default max_new_tokens, a copy lowered to fit; else RequestError naming what to change."""
        num_positions, (limit, setting) = request.num_positions, context
        params = request.params
        room = limit - num_positions
        where = f"the {limit} positions a request may hold ({setting})" if setting else \
            f"the model's {limit} positions"
        if room < MIN_FRAMES:
            raise RequestError(f"the prompt takes {num_positions} of {where}: shorten the text (or the voice's "
                               f"reference)" + (f", or raise {setting}" if setting else ""), "text")
        if params.max_new_tokens > room:
            if request.explicit_max_new_tokens:
                raise RequestError(f"max_new_tokens {params.max_new_tokens} does not fit: the prompt takes "
                                   f"{num_positions} of {where}; lower max_new_tokens to at most {room}"
                                   + (f", or raise {setting}" if setting else ""), "max_new_tokens")
            return replace(request, params=replace(params, max_new_tokens=room))
        return request

    def _spec(self, text: str, language: str, non_streaming_mode: bool, instruct: str | None,
              speaker: str | None, voice: Voice | None) -> PromptSpec:
        input_ids = self.text_tokenizer.encode(assistant_text(check_text(text)))
        if len(input_ids) - 8 > MAX_TEXT_TOKENS:
            raise RequestError(f"text is {len(input_ids) - 8} tokens long; the limit is {MAX_TEXT_TOKENS} per request",
                               "text")
        instruct_ids = self.text_tokenizer.encode(instruct_text(instruct)) if instruct else None
        icl = voice is not None and voice.icl_mode
        ref_ids = self.text_tokenizer.encode(ref_text(voice.ref_text)) if icl else None
        if icl and not non_streaming_mode:  # (the transcript's tokens beyond its frames trail before the text)
            ref_tokens, frames = len(ref_ids) - 5, voice.ref_code.shape[0]
            if len(input_ids) - 8 + max(0, ref_tokens - frames) > MAX_TEXT_TOKENS:
                raise RequestError(f"text ({len(input_ids) - 8} tokens) and the {ref_tokens - frames} tokens of the "
                                   f"voice's reference transcript that run past its audio ({ref_tokens} tokens for "
                                   f"{frames} frames) are over the {MAX_TEXT_TOKENS} per request", "text")
        return PromptSpec(
            input_ids=input_ids, language=language, non_streaming_mode=non_streaming_mode,
            instruct_ids=instruct_ids, speaker=speaker,
            # (a voice in neither mode, which only a hand-made official prompt item can be: no speaker position, as
            # the official builds it)
            speaker_embedding=voice.ref_spk_embedding if voice is not None and (voice.x_vector_only_mode or icl)
            else None,
            ref_ids=ref_ids,
            ref_codes=voice.ref_code if icl else None)


def _check_known(arguments: dict[str, Any], others: tuple[str, ...] = ()) -> None:
    """Refuses arguments that are neither sampling arguments nor `others` (a misspelled `speakr`, say: named, with
    the likely intended one, before it can be mistaken for a missing `speaker`)."""
    unknown = sorted(set(arguments) - SAMPLING_ARGS)
    if unknown:
        close = difflib.get_close_matches(unknown[0], [*others, *SAMPLING_ARGS], n=1)
        raise RequestTypeError(f"unexpected generation arguments {unknown}"
                               + (f" (did you mean `{close[0]}`?)" if close else "")
                               + f"; accepted: {sorted(SAMPLING_ARGS)}", unknown[0])


def _is_no_speaker(speaker: Any) -> bool:
    """The official validator's test for "no speaker": None or "" (not any false value: 0 is an unknown speaker)."""
    return speaker is None or (isinstance(speaker, str) and not speaker)


def _describe(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"a {value.dtype} tensor of shape {list(value.shape)}"
    return type(value).__name__


def check_text(text: Any, name: str = "text") -> str:
    if not isinstance(text, str):
        raise RequestTypeError(f"{name} must be a string, got {type(text).__name__}", name)
    if not text.strip():
        raise RequestError(f"{name} is empty", name)
    return check_unicode(text, name)


def check_unicode(text: str, name: str) -> str:
    """`text` if it is valid Unicode: a lone surrogate (JSON's "\\ud800", say) cannot be tokenized."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise RequestError(f"{name} is not valid Unicode: {e.reason} at character {e.start}", name) from e
    return text
