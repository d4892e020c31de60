"""The rules a request must follow on one checkpoint, written once: its kind (`require`), the mode (speaker, voice,
instruction: `check_mode`), the language, the preset speaker and the voice. The request builder (builder.py) is
built on them; the command line checks its flags with them before the model loads, and the server resolves its
voices with them (through the builder), translating only the names of the fields at fault."""

from __future__ import annotations

from typing import Any

import torch

from ..config import ModelConfig
from ..errors import RequestError, RequestTypeError, quote
from .voice import Voice, size_name

_KIND_NAMES = {"base": "Base", "custom_voice": "CustomVoice", "voice_design": "VoiceDesign"}
_KIND_METHODS = {"base": "generate_voice_clone (a reference recording)", "voice_design": "generate_voice_design (a "
                 "voice described in words)", "custom_voice": "generate_custom_voice (a preset speaker)"}


class CheckpointRules:
    """The request rules of the checkpoint whose config is `config`; each raises RequestError naming the argument at
    fault."""

    def __init__(self, config: ModelConfig):
        self.config = config

    @property
    def kind(self) -> str:
        return self.config.tts_model_type

    def require(self, kind: str, method: str) -> None:
        """Raises RequestError if this checkpoint is not of `kind` (base, custom_voice, voice_design), naming the
        checkpoints `method` needs and what this one offers instead."""
        if self.kind != kind:
            size = size_name(self.config.tts_model_size)
            example = f"Qwen/Qwen3-TTS-12Hz-{'1.7B' if kind == 'voice_design' else size}-{_KIND_NAMES[kind]}"
            raise RequestError(f"{method} needs a {_KIND_NAMES[kind]} checkpoint (e.g. {example}); this one is "
                               f"{size}-{_KIND_NAMES[self.kind]}: use {_KIND_METHODS[self.kind]}", "model")

    def check_mode(self, speaker: str | None, has_voice: bool, instruct: str | None, official: bool = False
                   ) -> str | None:
        """Whether speaker / voice / instruction suit this checkpoint's mode; returns the instruction to use."""
        kind = self.kind
        self.check_voice_mode(has_voice)
        # The official `generate_custom_voice` takes None or "" for a speaker and builds the prompt without a
        # speaker position (the voice then comes from the instruction alone, as in VoiceDesign): the drop-in does too.
        if kind == "custom_voice" and is_no_speaker(speaker) and not official:
            raise RequestError(f"this CustomVoice checkpoint needs `speaker`, one of {self.config.supported_speakers}",
                               "speaker", "missing")
        if kind != "custom_voice" and not is_no_speaker(speaker):
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

    def check_voice_mode(self, has_voice: bool) -> None:
        """A Base checkpoint clones a voice (RequestError, code "missing", without one); the others take none."""
        if self.kind == "base" and not has_voice:
            raise RequestError("this Base checkpoint clones voices: pass `voice` (see TTS.create_voice)", "voice",
                               "missing")
        if self.kind != "base" and has_voice:
            raise RequestError(f"this {self.kind} checkpoint cannot clone voices; use a Base checkpoint", "voice")

    def language(self, language: str | None) -> str:
        supported = self.config.supported_languages
        language = "auto" if language is None else language
        if not isinstance(language, str):
            raise RequestTypeError(f"language must be a string, one of {supported}; got {type(language).__name__}",
                                   "language")
        if language.lower() not in supported:
            raise RequestError(f"unsupported language {quote(language)}; supported: {supported}", "language")
        return language.lower()

    def speaker(self, speaker: str) -> str:
        supported = self.config.supported_speakers
        if not isinstance(speaker, str):
            raise RequestTypeError(f"speaker must be a string, one of {supported}; got {type(speaker).__name__}",
                                   "speaker")
        if speaker.lower() not in supported:
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
            self.check_ref_code(voice.ref_code)
        return voice

    def check_ref_code(self, codes: Any) -> None:
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


def is_no_speaker(speaker: Any) -> bool:
    """The official validator's test for "no speaker": None or "" (not any false value: 0 is an unknown speaker)."""
    return speaker is None or (isinstance(speaker, str) and not speaker)


def _describe(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"a {value.dtype} tensor of shape {list(value.shape)}"
    return type(value).__name__


def check_unicode(text: str, name: str) -> str:
    """`text` if it is valid Unicode: a lone surrogate (JSON's "\\ud800", say) cannot be tokenized."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise RequestError(f"{name} is not valid Unicode: {e.reason} at character {e.start}", name) from e
    return text
