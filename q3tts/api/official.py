"""The official `qwen_tts.Qwen3TTSModel` API, as a drop-in: the same methods, arguments, defaults and return
values (`from q3tts import Qwen3TTSModel`). `TTS` inherits these methods; they build requests with
`TTS.request`'s builder and run them on the engine like every other entry point. Loading is the official
`from_pretrained(pretrained_model_name_or_path, **kwargs)` too, with the keywords its callers pass (see
`TTS.from_pretrained`: which are used and which ignored).

Official behaviours kept: lists for batches (scalars and, but for create_voice_clone_prompt's, 1-element lists
broadcast), `language=None`/"auto" (None in a list refused), per-mode text feeding (`non_streaming_mode=True` for
custom voice and voice design, False for cloning; None is False, as the official's truth test reads it), an empty
voice-design instruction allowed, a custom-voice speaker of None or "" allowed (no speaker in the prompt, no dialect
tag, no warning), a 0.6B CustomVoice dropping `instruct` before anything reads it (with a warning), a prompt item in
neither x-vector nor in-context mode giving no speaker position, `eos_token_id` (only the codec's own: the engine
stops there), and the in-context cut of the reference's share of the audio by float truncation (which can keep one
sample of the reference's audio).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from os import PathLike
from typing import Any

import numpy as np

from ..config import ModelConfig
from ..engine.config import ContextLimit
from ..errors import RequestError, RequestTypeError, warn_caller
from ..models.qwen3_tts import Qwen3TTSModel
from ..models.speech_tokenizer import SpeechTokenizer
from ..request.builder import Request, RequestBuilder
from ..request.voice import Voice, clone_voices
from .render import Renderer


class OfficialAPI:
    """The official methods; mixed into `TTS`, which provides what they use."""

    config: ModelConfig
    model: Qwen3TTSModel
    speech_tokenizer: SpeechTokenizer
    sample_rate: int
    builder: RequestBuilder
    renderer: Renderer
    context_limit: Callable[[], ContextLimit]

    def get_supported_speakers(self) -> list[str]:
        """The checkpoint's preset speakers (CustomVoice, and fine-tunes), sorted, lower case as the config has
        them (speaker arguments match case-blind); empty when it has none."""
        return self.config.supported_speakers

    def get_supported_languages(self) -> list[str]:
        """The languages the checkpoint was trained on, in lower case ("auto" lets the model choose)."""
        return self.config.supported_languages

    def generate_custom_voice(self, text: str | list[str], speaker: str | list[str | None] | None,
                              language: str | list[str] | None = None, instruct: str | list[str] | None = None,
                              non_streaming_mode: bool = True, **kwargs: Any) -> tuple[list[np.ndarray], int]:
        """Preset speaker (CustomVoice checkpoints), with an optional instruction on 1.7B. A speaker of None or ""
        leaves the speaker out of the prompt, as the official method does."""
        self.builder.require("custom_voice", "generate_custom_voice")
        if not self.config.supports_instruct and instruct is not None:  # (as the official: before any check)
            if not (isinstance(instruct, (str, list)) and not instruct):  # (an empty one says nothing)
                warn_caller("this 0.6B CustomVoice checkpoint ignores `instruct` (the official API drops it too)")
            instruct = None
        texts = _as_list(text, "text")
        items = zip(texts, _broadcast(speaker, len(texts), "speaker"), _languages(language, len(texts)),
                    _broadcast(instruct, len(texts), "instruct"), _broadcast(kwargs.pop("seed", None), len(texts),
                                                                             "seed"))
        sampling = _sampling(self.config, kwargs)
        requests = [self.builder.build(t, speaker=spk, language=lang, instruct=ins, seed=seed, official=True,
                                        non_streaming_mode=_feeding(non_streaming_mode), sampling=sampling)
                    for t, spk, lang, ins, seed in items]
        return self._render(requests)

    def generate_voice_design(self, text: str | list[str], instruct: str | list[str],
                              language: str | list[str] | None = None, non_streaming_mode: bool = True,
                              **kwargs: Any) -> tuple[list[np.ndarray], int]:
        """A voice described in words (VoiceDesign checkpoints)."""
        self.builder.require("voice_design", "generate_voice_design")
        texts = _as_list(text, "text")
        items = zip(texts, _broadcast(instruct, len(texts), "instruct"), _languages(language, len(texts)),
                    _broadcast(kwargs.pop("seed", None), len(texts), "seed"))
        sampling = _sampling(self.config, kwargs)
        requests = [self.builder.build(t, instruct=ins, language=lang, seed=seed, official=True,
                                        non_streaming_mode=_feeding(non_streaming_mode), sampling=sampling)
                    for t, ins, lang, seed in items]
        return self._render(requests)

    def generate_voice_clone(self, text: str | list[str], language: str | list[str] | None = None,
                             ref_audio: Any = None, ref_text: str | list[str | None] | None = None,
                             x_vector_only_mode: bool | list[bool] = False,
                             voice_clone_prompt: Voice | list[Voice] | dict | None = None,
                             non_streaming_mode: bool = False, **kwargs: Any) -> tuple[list[np.ndarray], int]:
        """Voice cloning (Base checkpoints) from reference audio or from prepared voices."""
        self.builder.require("base", "generate_voice_clone")
        texts = _as_list(text, "text")
        languages = _languages(language, len(texts))
        seeds = _broadcast(kwargs.pop("seed", None), len(texts), "seed")
        kwargs = _sampling(self.config, kwargs)
        self.builder.params(kwargs)  # bad sampling arguments are refused before the voices are made
        if voice_clone_prompt is None:
            if ref_audio is None:
                raise RequestError("generate_voice_clone needs ref_audio or voice_clone_prompt", "ref_audio")
            voices = self.create_voice_clone_prompt(ref_audio, ref_text, x_vector_only_mode)
        else:
            voices = voices_from_prompt(voice_clone_prompt)
        voices = _broadcast(voices, len(texts), "voice_clone_prompt")
        requests: list[Request] = [
            self.builder.build(t, voice=v, language=lang, seed=seed, non_streaming_mode=_feeding(non_streaming_mode),
                                sampling=kwargs, official=True)
            for t, lang, v, seed in zip(texts, languages, voices, seeds)]
        return self._render(requests)

    def _render(self, requests: list[Request]) -> tuple[list[np.ndarray], int]:
        """The requests fitted to the engine's context, their audio cut as the official cuts it, and the rate."""
        limit = self.context_limit()
        fitted = [self.builder.fit(request, limit) for request in requests]
        return self.renderer.render(fitted, official_cut=True), self.sample_rate

    def create_voice_clone_prompt(self, ref_audio: Any, ref_text: str | list[str | None] | None = None,
                                  x_vector_only_mode: bool | list[bool] = False) -> list[Voice]:
        """Reference audio (path, URL, bytes, base64, or (array, sample_rate)) -> voices, as the official API."""
        self.builder.require("base", "create_voice_clone_prompt")
        audios = ref_audio if isinstance(ref_audio, list) else [ref_audio]
        return clone_voices(self.speech_tokenizer, self.model.speaker_encoder, self.config, audios,
                            _broadcast(ref_text, len(audios), "ref_text", "reference audios", stretch=False),
                            _broadcast(x_vector_only_mode, len(audios), "x_vector_only_mode", "reference audios",
                                       stretch=False))


def _as_list(value: Any, name: str) -> list:
    values = value if isinstance(value, list) else [value]
    if not values:
        raise RequestError(f"{name} is an empty list", name)
    return values


def _broadcast(value: Any, n: int, name: str, items: str = "texts", stretch: bool = True) -> list:
    """A scalar (or, with `stretch`, a 1-element list) applies to every item; otherwise the list length must
    match."""
    if not isinstance(value, list):
        return [value] * n
    if len(value) == 1 and stretch:
        return value * n
    if len(value) != n:
        raise RequestError(f"batch size mismatch: {n} {items} but {len(value)} values for {name}", name)
    return value


def _feeding(non_streaming_mode: Any) -> Any:
    """None is False, as the official's `if non_streaming_mode:` reads it (the builder takes None for the mode's
    default); other values go to the builder's check."""
    return False if non_streaming_mode is None else non_streaming_mode


def _languages(language: Any, n: int) -> list:
    """None alone is "auto"; in a list, the official refuses it as an unsupported language."""
    if isinstance(language, list) and any(value is None for value in language):
        raise RequestError("unsupported language None in the `language` list (None alone means auto)", "language")
    return _broadcast(language, n, "language")


def _sampling(config: ModelConfig, kwargs: dict) -> dict:
    """The generation arguments without `eos_token_id`, which the official generate() takes: the codec's own end
    token (or None) is what the engine stops at; any other is refused."""
    kwargs = dict(kwargs)
    eos = kwargs.pop("eos_token_id", None)
    own = config.talker_config.codec_eos_token_id
    if eos is not None and eos != own:
        raise RequestError(f"eos_token_id {eos!r} is not supported: generation stops at the codec's end token "
                           f"({own})", "eos_token_id")
    return kwargs


PROMPT_KEYS = ("ref_spk_embedding", "x_vector_only_mode", "icl_mode")  # (and ref_code, ref_text: None allowed)


def voices_from_prompt(prompt: Voice | Sequence[Voice] | dict | str | PathLike) -> list[Voice]:
    """Accepts our Voice objects (or voice files, as `Voice.load` reads them) and the official
    `voice_clone_prompt` dict of lists."""
    name = "voice_clone_prompt"
    if isinstance(prompt, Voice):
        return [prompt]
    if isinstance(prompt, (str, PathLike)):
        return [Voice.load(prompt)]
    if isinstance(prompt, dict):
        missing = [key for key in PROMPT_KEYS if key not in prompt]
        if missing:
            raise RequestError(f"`{name}` has no {', '.join(missing)}: pass what create_voice_clone_prompt returns "
                               "(a list of voices) or the official dict of lists", name)
        lists = {key: prompt.get(key) for key in (*PROMPT_KEYS, "ref_code", "ref_text")}
        scalar = [key for key, value in lists.items() if value is not None and not hasattr(value, "__len__")]
        if scalar:
            raise RequestError(f"`{name}` needs lists (one item per voice) for {', '.join(scalar)}", name)
        n = len(lists["ref_spk_embedding"])
        lists = {key: [None] * n if value is None else value for key, value in lists.items()}
        uneven = {key: len(value) for key, value in lists.items() if len(value) != n}
        if uneven:
            raise RequestError(f"`{name}` lists of unequal length: {n} ref_spk_embedding but "
                               + ", ".join(f"{length} {key}" for key, length in uneven.items()), name)
        return [Voice(ref_code=lists["ref_code"][i], ref_spk_embedding=lists["ref_spk_embedding"][i],
                      x_vector_only_mode=bool(lists["x_vector_only_mode"][i]), icl_mode=bool(lists["icl_mode"][i]),
                      ref_text=lists["ref_text"][i]) for i in range(n)]
    voices = list(prompt) if isinstance(prompt, Sequence) else [prompt]
    wrong = next((v for v in voices if not isinstance(v, Voice)), None)
    if wrong is not None or not voices:
        raise RequestTypeError(f"`{name}` takes voices (create_voice_clone_prompt's list, a Voice, a voice file's "
                               f"path) or the official dict, not {type(wrong if voices else prompt).__name__}", name)
    return voices
