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

import numbers
import unicodedata
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any

from ..config import GenerationConfig, ModelConfig
from ..engine.config import ContextLimit
from ..errors import RequestError, RequestTypeError, did_you_mean, quote, warn_caller
from ..sampling import SamplingParams
from .prompt import PromptSpec, prompt_length
from .rules import CheckpointRules, check_unicode, is_no_speaker
from .text_tokenizer import TextTokenizer, assistant_text, instruct_text, ref_text
from .voice import Voice

MAX_TEXT_TOKENS = 4096  # per request; documented in the README
SAMPLING_ARGS = frozenset(f.name for f in fields(SamplingParams))
MIN_FRAMES = 2  # a request must have room for at least this many max_new_tokens


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


class RequestBuilder(CheckpointRules):
    """Validates requests for one loaded checkpoint: its rules (rules.py), the text, the sampling and the length."""

    def __init__(self, config: ModelConfig, text_tokenizer: TextTokenizer, generation_config: GenerationConfig):
        super().__init__(config)
        self.text_tokenizer, self.generation_config = text_tokenizer, generation_config

    def build(self, text: str, *, speaker: str | None = None, voice: Voice | str | Path | None = None,
              instruct: str | None = None, language: str | None = "auto", non_streaming_mode: bool | None = None,
              seed: int | None = None, sampling: dict[str, Any] | None = None, official: bool = False,
              runaway_guard: RunawayGuard | None = None) -> Request:
        """One request in whatever mode the checkpoint offers, its length not yet fitted to the engine's context
        (`fit`). `official`: the official API's leniencies (an empty voice-design instruction; a CustomVoice request
        without a speaker)."""
        _check_known(sampling or {}, ("speaker", "voice", "instruct", "language", "non_streaming_mode", "seed"))
        if runaway_guard is not None and not isinstance(runaway_guard, RunawayGuard):
            raise RequestTypeError(f"runaway_guard must be a RunawayGuard (RunawayGuard() for the defaults) or None, "
                                   f"got {quote(runaway_guard)}", "runaway_guard")
        if isinstance(voice, (str, Path)):
            voice = Voice.load(voice)
        instruct = self.check_mode(speaker, voice is not None, instruct, official)
        if non_streaming_mode is None:
            non_streaming_mode = self.kind != "base"
        elif isinstance(non_streaming_mode, str) or non_streaming_mode not in (True, False):
            raise RequestTypeError(f"non_streaming_mode must be True, False or None, got {quote(non_streaming_mode)}",
                                   "non_streaming_mode")
        speaker = None if is_no_speaker(speaker) else self.speaker(speaker)
        spec = self._spec(text, self.language(language), bool(non_streaming_mode), instruct, speaker,
                          self.voice(voice) if voice is not None else None)
        arguments = {**(sampling or {}), "seed": seed}
        return Request(spec, self.sampling(arguments), prompt_length(self.config, spec), runaway_guard,
                       arguments.get("max_new_tokens") is not None)

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
        if arguments.get("max_new_tokens") is not None:
            check_max_new_tokens(params.max_new_tokens)
        return params

    def fit(self, request: Request, context: ContextLimit) -> Request:
        """The length rule: `request` if its prompt and max_new_tokens fit the positions one request may hold;
        with the checkpoint's default max_new_tokens, a copy lowered to fit; else RequestError naming what to change."""
        num_positions, (limit, setting) = request.num_positions, context
        params = request.params
        room = context.room(num_positions)
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
        raise RequestTypeError(f"unexpected generation arguments {unknown}"
                               + did_you_mean(unknown[0], [*others, *SAMPLING_ARGS])
                               + f"; accepted: {sorted(SAMPLING_ARGS)}", unknown[0])


def check_max_new_tokens(value: int) -> None:
    """A max_new_tokens the caller gives: at least MIN_FRAMES (the official API fails on 1, in torch.stack)."""
    if value < MIN_FRAMES:
        raise RequestError(f"max_new_tokens must be at least {MIN_FRAMES}, got {value}: the step that ends the "
                           "audio is one of them, so N gives at most N - 1 frames", "max_new_tokens")


def check_text(text: Any, name: str = "text") -> str:
    if not isinstance(text, str):
        raise RequestTypeError(f"{name} must be a string, got {type(text).__name__}", name)
    if not text.strip():
        raise RequestError(f"{name} is empty", name)
    if not speaks(text):  # (the model would speak noise for it, as for no text)
        shown = ", ".join(sorted({f"U+{ord(ch):04X}" for ch in text if not ch.isspace()}))
        raise RequestError(f"{name} has nothing to speak: only spaces and invisible characters ({shown})", name)
    return check_unicode(text, name)


def speaks(text: str) -> bool:
    """Whether `text` holds anything to speak: a character other than whitespace, control and format characters
    (NUL, U+200B ZERO WIDTH SPACE, U+FEFF, the direction marks) and separators (a lone surrogate counts: check_unicode
    names it)."""
    return any(not ch.isspace() and unicodedata.category(ch) not in ("Cc", "Cf", "Zs", "Zl", "Zp") for ch in text)
