"""`TTS`: the Python API. A drop-in for the official `Qwen3TTSModel` (same methods, arguments, defaults and
return values) plus a small API of our own (`synthesize`, `create_voice`, `Voice`, per-request seeds)."""

from __future__ import annotations

import time
import warnings
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from dataclasses import fields
from pathlib import Path
from typing import Any

import numpy as np
import torch

from .audio import load_audio, resample
from .checkpoint import resolve_model_dir
from .config import GenerationConfig, ModelConfig
from .engine.runner import EngineConfig
from .generate import generate_codes
from .models.qwen3_tts import Qwen3TTSModel
from .models.speaker_encoder import compute_speaker_embedding
from .models.speech_tokenizer import SpeechTokenizer
from .prompt import PromptSpec, build_prompt
from .sampling import SamplingParams
from .streaming import DEFAULT_SCHEDULE, AudioChunk, Engine, astream, stream_one
from .text_tokenizer import TextTokenizer, assistant_text, instruct_text, ref_text
from .voice import Voice

MAX_TEXT_TOKENS = 4096  # per request; documented in the README
SAMPLING_ARGS = {f.name for f in fields(SamplingParams)}


class TTS:
    """A loaded Qwen3-TTS checkpoint (any of Base, CustomVoice, VoiceDesign; 0.6B or 1.7B)."""

    def __init__(self, model: Qwen3TTSModel, speech_tokenizer: SpeechTokenizer, text_tokenizer: TextTokenizer,
                 generation_config: GenerationConfig):
        self.model = model
        self.config: ModelConfig = model.config
        self.speech_tokenizer = speech_tokenizer
        self.text_tokenizer = text_tokenizer
        self.generation_config = generation_config
        self.device = model.talker.codec_head.weight.device
        self.sample_rate = speech_tokenizer.sample_rate
        self.engine: Engine | None = None  # the fast path, built by prepare_engine

    @classmethod
    def from_pretrained(cls, name_or_path: str | Path, device: str | torch.device | None = None,
                        dtype: torch.dtype | str | None = None, *, device_map: str | torch.device | None = None,
                        torch_dtype: torch.dtype | str | None = None, revision: str | None = None,
                        cache_dir: str | Path | None = None, attn_implementation: str | None = None) -> TTS:
        """Loads a local checkpoint folder, a hub id (fetched through huggingface_hub, `HF_HUB_OFFLINE`
        respected) or a built-in tiny random model (`"tiny"`, `"tiny-base"`, ...; noise only).

        `device_map`, `torch_dtype`/`dtype` and `attn_implementation` are accepted as the official
        `from_pretrained` accepts them; attention always runs on q3tts's own kernels."""
        del attn_implementation
        folder = _resolve(name_or_path, revision, cache_dir)
        device = _device(device if device is not None else device_map)
        dtype = _dtype(dtype if dtype is not None else torch_dtype)
        config = ModelConfig.from_file(folder / "config.json")
        model = Qwen3TTSModel.from_folder(folder, config, device=device, dtype=dtype)
        speech_tokenizer = SpeechTokenizer.from_pretrained(folder / "speech_tokenizer", device=device, dtype=dtype,
                                                           load_encoder=config.is_base)
        return cls(model, speech_tokenizer, TextTokenizer.from_folder(folder),
                   GenerationConfig.from_file(folder / "generation_config.json"))

    # ---- the official API -------------------------------------------------------------------------------

    def get_supported_speakers(self) -> list[str]:
        return self.config.supported_speakers

    def get_supported_languages(self) -> list[str]:
        return self.config.supported_languages

    def generate_custom_voice(self, text: str | list[str], speaker: str | list[str],
                              language: str | list[str] | None = None, instruct: str | list[str] | None = None,
                              non_streaming_mode: bool = True, **kwargs) -> tuple[list[np.ndarray], int]:
        """Preset speaker (CustomVoice checkpoints), with an optional instruction on 1.7B."""
        self._require("custom_voice", "generate_custom_voice")
        texts = _as_list(text, "text")
        speakers = _broadcast(speaker, len(texts), "speaker")
        instructs = _broadcast(instruct, len(texts), "instruct")
        if not self.config.supports_instruct and any(instructs):
            warnings.warn("this 0.6B CustomVoice checkpoint ignores `instruct` (the official API drops it too)",
                          stacklevel=2)
            instructs = [None] * len(texts)
        specs = [self._spec(t, lang, non_streaming_mode, instruct=ins, speaker=self._speaker(spk))
                 for t, lang, spk, ins in zip(texts, self._languages(language, len(texts)), speakers, instructs)]
        return self._synthesize(specs, self._sampling(kwargs, len(texts))), self.sample_rate

    def generate_voice_design(self, text: str | list[str], instruct: str | list[str],
                              language: str | list[str] | None = None, non_streaming_mode: bool = True,
                              **kwargs) -> tuple[list[np.ndarray], int]:
        """A voice described in words (VoiceDesign checkpoints)."""
        self._require("voice_design", "generate_voice_design")
        texts = _as_list(text, "text")
        instructs = _broadcast(instruct, len(texts), "instruct")
        specs = [self._spec(t, lang, non_streaming_mode, instruct=ins)
                 for t, lang, ins in zip(texts, self._languages(language, len(texts)), instructs)]
        return self._synthesize(specs, self._sampling(kwargs, len(texts))), self.sample_rate

    def generate_voice_clone(self, text: str | list[str], language: str | list[str] | None = None,
                             ref_audio: Any = None, ref_text: str | list[str | None] | None = None,
                             x_vector_only_mode: bool | list[bool] = False,
                             voice_clone_prompt: Voice | list[Voice] | dict | None = None,
                             non_streaming_mode: bool = False, **kwargs) -> tuple[list[np.ndarray], int]:
        """Voice cloning (Base checkpoints) from reference audio or from prepared voices."""
        self._require("base", "generate_voice_clone")
        texts = _as_list(text, "text")
        languages = self._languages(language, len(texts))
        sampling = self._sampling(kwargs, len(texts))
        if voice_clone_prompt is None:
            if ref_audio is None:
                raise ValueError("generate_voice_clone needs `ref_audio` or `voice_clone_prompt`")
            voices = self.create_voice_clone_prompt(ref_audio, ref_text, x_vector_only_mode)
        else:
            voices = _voices_from_prompt(voice_clone_prompt)
        voices = _broadcast(voices, len(texts), "voice_clone_prompt")
        specs = [self._spec(t, lang, non_streaming_mode, voice=self._check_voice(v))
                 for t, lang, v in zip(texts, languages, voices)]
        return self._synthesize(specs, sampling), self.sample_rate

    def create_voice_clone_prompt(self, ref_audio: Any, ref_text: str | list[str | None] | None = None,
                                  x_vector_only_mode: bool | list[bool] = False) -> list[Voice]:
        """Reference audio (path, URL, bytes, base64, or (array, sample_rate)) -> voices, as the official API."""
        self._require("base", "create_voice_clone_prompt")
        audios = ref_audio if isinstance(ref_audio, list) else [ref_audio]
        texts = _broadcast(ref_text, len(audios), "ref_text")
        xvec = _broadcast(x_vector_only_mode, len(audios), "x_vector_only_mode")
        for i, (t, x) in enumerate(zip(texts, xvec)):
            if not x and (t is None or not str(t).strip()):
                raise ValueError(f"ref_text is required for in-context voice cloning (x_vector_only_mode=False); "
                                 f"missing for reference {i}")
        loaded = [load_audio(a) for a in audios]
        # The official code encodes same-rate references as one padded batch (which can change the last
        # reference frame of shorter items) and mixed rates one by one; so do we.
        if len({sr for _, sr in loaded}) == 1:
            codes = self.speech_tokenizer.encode([resample(w, sr, self.sample_rate) for w, sr in loaded])
        else:
            codes = [self.speech_tokenizer.encode([resample(w, sr, self.sample_rate)])[0] for w, sr in loaded]
        target_sr = self.config.speaker_encoder_config.sample_rate
        return [Voice(ref_code=None if x else c, icl_mode=not x, x_vector_only_mode=bool(x), ref_text=t,
                      ref_spk_embedding=compute_speaker_embedding(self.model.speaker_encoder,
                                                                  resample(w, sr, target_sr)),
                      model_size=self.config.tts_model_size)
                for (w, sr), c, t, x in zip(loaded, codes, texts, xvec)]

    # ---- our API ------------------------------------------------------------------------------------------

    def create_voice(self, ref_audio: Any, ref_text: str | None = None, x_vector_only: bool = False) -> Voice:
        """One voice from one reference recording; save it with `voice.save(path)`."""
        return self.create_voice_clone_prompt(ref_audio, ref_text, x_vector_only)[0]

    def synthesize(self, text: str, *, speaker: str | None = None, voice: Voice | str | Path | None = None,
                   instruct: str | None = None, language: str = "auto", non_streaming_mode: bool | None = None,
                   seed: int | None = None, on_frame: Callable[[int], None] | None = None,
                   **sampling: Any) -> np.ndarray:
        """One utterance as float32 audio at `self.sample_rate`, in whatever mode the checkpoint offers."""
        spec, params = self._request(text, speaker, voice, instruct, language, non_streaming_mode, seed, sampling)
        return self._synthesize([spec], [params], on_frame)[0]

    def stream(self, text: str, *, speaker: str | None = None, voice: Voice | str | Path | None = None,
               instruct: str | None = None, language: str = "auto", non_streaming_mode: bool | None = None,
               seed: int | None = None, chunk_schedule: tuple[int, ...] = DEFAULT_SCHEDULE,
               pcm_format: str = "float32", **sampling: Any) -> Iterator[AudioChunk]:
        """Like `synthesize`, but yields `AudioChunk`s while the speech is generated (frames per chunk follow
        `chunk_schedule`; the last value repeats). Bad input raises here, before the stream opens. Runs on the
        fast path (`prepare_engine`); the concatenated chunks equal that path's offline decode."""
        started = time.perf_counter()
        spec, params = self._request(text, speaker, voice, instruct, language, non_streaming_mode, seed, sampling)
        self._check_budget(spec, params)
        prompt = build_prompt(self.model.talker, self.config, spec)
        engine = self.engine or self.prepare_engine()
        return stream_one(engine, prompt, params, spec.ref_codes, tuple(chunk_schedule), pcm_format, started)

    async def astream(self, text: str, **kwargs: Any) -> AsyncIterator[AudioChunk]:
        """`stream` for asyncio: the same chunks, produced in a worker thread."""
        async for chunk in astream(self.stream(text, **kwargs)):
            yield chunk

    def prepare_engine(self, max_rows: int = 4, max_context: int = 4096) -> Engine:
        """Builds the fast path once: fused weights, paged KV cache, and on a GPU the CUDA graphs of every batch
        bucket (captured now, never under traffic). `stream` calls it with the defaults if needed."""
        config = EngineConfig(max_rows=max_rows, max_context=max_context, buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256))
        engine = Engine(self.model, self.speech_tokenizer.decoder, config)
        engine.capture_graphs()
        self.engine = engine
        return engine

    # ---- internals ----------------------------------------------------------------------------------------

    def _request(self, text: str, speaker: str | None, voice: Voice | str | Path | None, instruct: str | None,
                 language: str, non_streaming_mode: bool | None, seed: int | None,
                 sampling: dict[str, Any]) -> tuple[PromptSpec, SamplingParams]:
        """Validates one request of our own API against the checkpoint's mode."""
        if isinstance(voice, (str, Path)):
            voice = Voice.load(voice)
        kind = self.config.tts_model_type
        if kind == "base" and voice is None:
            raise ValueError("this Base checkpoint clones voices: pass `voice` (see TTS.create_voice)")
        if kind != "base" and voice is not None:
            raise ValueError(f"this {kind} checkpoint cannot clone voices; use a Base checkpoint")
        if kind == "custom_voice" and not speaker:
            raise ValueError(f"this CustomVoice checkpoint needs `speaker`, one of {self.get_supported_speakers()}")
        if kind != "custom_voice" and speaker:
            raise ValueError(f"`speaker` needs a CustomVoice checkpoint (this one is {kind})")
        if kind == "voice_design" and not instruct:
            raise ValueError("this VoiceDesign checkpoint needs `instruct`, a description of the voice")
        if instruct and kind == "base":
            raise ValueError("Base checkpoints take no `instruct`")
        if instruct and not self.config.supports_instruct:
            warnings.warn("this 0.6B CustomVoice checkpoint ignores `instruct`", stacklevel=3)
            instruct = None
        non_streaming = non_streaming_mode if non_streaming_mode is not None else kind != "base"
        spec = self._spec(text, self._languages(language, 1)[0], non_streaming, instruct=instruct,
                          speaker=self._speaker(speaker) if speaker else None,
                          voice=self._check_voice(voice) if voice is not None else None)
        return spec, self._sampling({**sampling, "seed": seed}, 1)[0]

    def _synthesize(self, specs: list[PromptSpec], params: list[SamplingParams],
                    on_frame: Callable[[int], None] | None = None) -> list[np.ndarray]:
        for spec, p in zip(specs, params):
            self._check_budget(spec, p)
        talker = self.model.talker
        prompts = [build_prompt(talker, self.config, s) for s in specs]
        codes = generate_codes(talker, prompts, params, on_frame)
        refs = [s.ref_codes for s in specs]
        full = [torch.cat([r.cpu(), c]) if r is not None else c for r, c in zip(refs, codes)]
        wavs = self.speech_tokenizer.decode(full)
        # ICL: the reference's share of the audio is cut exactly as the official code does (float truncation).
        return [w[int(r.shape[0] / max(f.shape[0], 1) * w.shape[0]):] if r is not None else w
                for w, r, f in zip(wavs, refs, full)]

    def _spec(self, text: str, language: str, non_streaming_mode: bool, instruct: str | None = None,
              speaker: str | None = None, voice: Voice | None = None) -> PromptSpec:
        input_ids = self.text_tokenizer.encode(assistant_text(_check_text(text, "text")))
        if len(input_ids) - 8 > MAX_TEXT_TOKENS:
            raise ValueError(f"text is {len(input_ids) - 8} tokens long; the limit is {MAX_TEXT_TOKENS} per request")
        instruct_ids = self.text_tokenizer.encode(instruct_text(instruct)) if instruct else None
        icl = voice is not None and voice.icl_mode
        return PromptSpec(
            input_ids=input_ids, language=language, non_streaming_mode=bool(non_streaming_mode),
            instruct_ids=instruct_ids, speaker=speaker,
            speaker_embedding=voice.ref_spk_embedding if voice is not None else None,
            ref_ids=self.text_tokenizer.encode(ref_text(voice.ref_text)) if icl else None,
            ref_codes=voice.ref_code if icl else None)

    def _check_budget(self, spec: PromptSpec, params: SamplingParams) -> None:
        limit = self.config.talker_config.max_position_embeddings
        prompt_len = len(spec.input_ids) + len(spec.instruct_ids or ()) + 8
        if spec.ref_codes is not None:
            prompt_len += len(spec.ref_ids) + spec.ref_codes.shape[0]
        if prompt_len + params.max_new_tokens > limit:
            raise ValueError(f"prompt (~{prompt_len} positions) + max_new_tokens ({params.max_new_tokens}) exceed "
                             f"the model's {limit} positions; lower max_new_tokens or shorten the input")

    def _require(self, kind: str, method: str) -> None:
        if self.config.tts_model_type != kind:
            raise ValueError(f"{method} needs a {kind} checkpoint; this one is {self.config.tts_model_type} "
                             f"({self.config.tts_model_size})")

    def _languages(self, language: str | list[str] | None, n: int) -> list[str]:
        languages = _broadcast(language if language is not None else "auto", n, "language")
        supported = self.get_supported_languages()
        for lang in languages:
            if not isinstance(lang, str) or lang.lower() not in supported:
                raise ValueError(f"unsupported language {lang!r}; supported: {supported}")
        return [lang.lower() for lang in languages]

    def _speaker(self, speaker: str | None) -> str:
        supported = self.get_supported_speakers()
        if not isinstance(speaker, str) or speaker.lower() not in supported:
            raise ValueError(f"unknown speaker {speaker!r}; supported: {supported}")
        return speaker.lower()

    def _check_voice(self, voice: Voice) -> Voice:
        if not isinstance(voice, Voice):
            raise TypeError(f"expected a Voice / VoiceClonePromptItem, got {type(voice).__name__}")
        hidden = self.config.talker_config.hidden_size
        if voice.ref_spk_embedding.numel() != hidden or (voice.model_size not in (None, self.config.tts_model_size)):
            raise ValueError(f"this voice was made for a {voice.model_size or 'different'} model "
                             f"(embedding size {voice.ref_spk_embedding.numel()}); this checkpoint is "
                             f"{self.config.tts_model_size} with embedding size {hidden}: create it again")
        if voice.icl_mode and (voice.ref_code is None or not voice.ref_text):
            raise ValueError("an in-context voice needs reference codes and reference text")
        return voice

    def _sampling(self, kwargs: dict[str, Any], n: int) -> list[SamplingParams]:
        unknown = sorted(set(kwargs) - SAMPLING_ARGS)
        if unknown:
            raise TypeError(f"unexpected generation arguments {unknown}; accepted: {sorted(SAMPLING_ARGS)}")
        defaults = {f.name: getattr(self.generation_config, f.name) for f in fields(GenerationConfig)}
        merged = {**defaults, **{k: v for k, v in kwargs.items() if v is not None and k != "seed"}}
        seeds = _broadcast(kwargs.get("seed"), n, "seed")
        return [SamplingParams(**merged, seed=s) for s in seeds]


def _resolve(name_or_path: str | Path, revision: str | None, cache_dir: str | Path | None) -> Path:
    from .tiny import TINY_NAMES, tiny_checkpoint

    if str(name_or_path) in TINY_NAMES:
        return tiny_checkpoint(str(name_or_path))
    return resolve_model_dir(name_or_path, revision=revision, cache_dir=cache_dir)


def _device(device: str | torch.device | None) -> torch.device:
    if isinstance(device, dict):
        raise ValueError("device_map as a dict (model sharding) is not supported: pass one device, e.g. 'cuda:0'")
    if device is None or device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def _dtype(dtype: torch.dtype | str | None) -> torch.dtype:
    if dtype is None or dtype == "auto":
        return torch.float32
    if isinstance(dtype, str):
        value = getattr(torch, dtype.removeprefix("torch."), None)
        if not isinstance(value, torch.dtype):
            raise ValueError(f"unknown dtype {dtype!r}")
        dtype = value
    if dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"dtype {dtype} is not supported (float32, bfloat16, float16)")
    return dtype


def _check_text(text: Any, name: str) -> str:
    if not isinstance(text, str):
        raise TypeError(f"{name} must be a string, got {type(text).__name__}")
    if not text.strip():
        raise ValueError(f"{name} is empty")
    return text


def _as_list(value: Any, name: str) -> list:
    values = value if isinstance(value, list) else [value]
    if not values:
        raise ValueError(f"{name} is an empty list")
    return values


def _broadcast(value: Any, n: int, name: str) -> list:
    """A scalar or a 1-element list applies to every item; otherwise the list length must match."""
    values = value if isinstance(value, list) else [value]
    if len(values) == 1:
        return values * n
    if len(values) != n:
        raise ValueError(f"batch size mismatch: {n} texts but {len(values)} values for {name}")
    return values


def _voices_from_prompt(prompt: Voice | Sequence[Voice] | dict) -> list[Voice]:
    """Accepts our Voice objects and the official `voice_clone_prompt` dict of lists."""
    if isinstance(prompt, Voice):
        return [prompt]
    if isinstance(prompt, dict):
        n = len(prompt["ref_spk_embedding"])
        codes = prompt.get("ref_code") or [None] * n
        return [Voice(ref_code=codes[i], ref_spk_embedding=prompt["ref_spk_embedding"][i],
                      x_vector_only_mode=bool(prompt["x_vector_only_mode"][i]), icl_mode=bool(prompt["icl_mode"][i]),
                      ref_text=(prompt.get("ref_text") or [None] * n)[i]) for i in range(n)]
    return list(prompt)
