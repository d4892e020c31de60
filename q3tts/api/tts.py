"""`TTS`: the Python API, a thin facade over one loaded checkpoint and its engine.

Which path runs: every entry point (`synthesize`, `synthesize_all`, `stream`, `astream` and the official
drop-in methods of `q3tts.api.official`) submits its requests to the model's one engine (`q3tts.engine`):
continuous batching on the model's device, CUDA graphs on a GPU, plain PyTorch on the CPU. Calls from any
number of threads or event loops batch together. `TTS(reference=True)` (or `from_pretrained(...,
reference=True)`) runs the offline entry points on the eager fp32 reference loop (`q3tts.reference`) instead,
the implementation the engine is tested against; streaming always runs on the engine.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterator
from dataclasses import replace
from os import PathLike
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..config import GenerationConfig, ModelConfig
from ..engine import EngineConfig
from ..errors import RequestTypeError, quote
from ..models.qwen3_tts import Qwen3TTSModel
from ..models.speech_tokenizer import SpeechTokenizer
from ..request.builder import Request, RequestBuilder, RunawayGuard
from ..request.text_segmenter import split_text
from ..request.text_tokenizer import TextTokenizer
from ..request.voice import Voice, clone_voices
from .dialogue import render_dialogue, stream_dialogue
from .engine_host import EngineHost
from .live import MAX_TEXT_WAIT_S, LiveRequest, open_live
from .loading import check_adapter, resolve_checkpoint, resolve_device, resolve_dtype
from .official import OfficialAPI
from .pieces import LONG_TEXT_CHARS, PIECE_CHARS, join
from .render import Renderer
from .streaming import DEFAULT_SCHEDULE, AudioStream, check_chunking


class TTS(OfficialAPI, EngineHost):
    """A loaded Qwen3-TTS checkpoint (any of Base, CustomVoice, VoiceDesign; 0.6B or 1.7B) and its engine."""

    def __init__(self, model: Qwen3TTSModel, speech_tokenizer: SpeechTokenizer, text_tokenizer: TextTokenizer,
                 generation_config: GenerationConfig, engine_config: EngineConfig | None = None,
                 reference: bool = False):
        super().__init__(model, speech_tokenizer, engine_config, reference)
        self.config: ModelConfig = model.config
        self.text_tokenizer = text_tokenizer
        self.generation_config = generation_config
        self.sample_rate = speech_tokenizer.sample_rate
        self.builder = RequestBuilder(self.config, text_tokenizer, generation_config)
        self.renderer = Renderer(self)

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path: str | Path, device: str | torch.device | None = None,
                        dtype: torch.dtype | str | None = None, *, device_map: str | torch.device | None = None,
                        torch_dtype: torch.dtype | str | None = None, revision: str | None = None,
                        cache_dir: str | Path | None = None, local_files_only: bool = False,
                        token: str | bool | None = None, attn_implementation: str | None = None,
                        trust_remote_code: bool | None = None, low_cpu_mem_usage: bool | None = None,
                        max_rows: int | None = None, max_context: int | None = None,
                        kv_cache_gb: float | None = None, gpu_memory_utilization: float | None = None,
                        engine_config: EngineConfig | None = None, reference: bool = False,
                        lora: str | Path | None = None) -> TTS:
        """Loads a local checkpoint folder, a hub id (fetched through huggingface_hub, `HF_HUB_OFFLINE`
        respected) or a built-in tiny random model (`"tiny"`, `"tiny-base"`, ...; noise only).

        The official `from_pretrained(pretrained_model_name_or_path, **kwargs)` keywords are accepted: `device_map`,
        `torch_dtype`/`dtype`; for a hub id `revision`, `cache_dir`, `local_files_only` (only the local hub
        cache) and `token` are used as huggingface_hub uses them. `attn_implementation`, `trust_remote_code` and
        `low_cpu_mem_usage` only tune how transformers builds its model and are ignored: q3tts builds its own,
        with its own attention kernels. Any other keyword is a TypeError. The default dtype is bfloat16 on a GPU
        and float32 on the CPU. The engine's size: `max_rows` (requests decoded together, default 64),
        `max_context` (positions per request, default the model's 32,768), and its KV cache's memory,
        `kv_cache_gb` or `gpu_memory_utilization` (the fraction of the GPU this process may hold); or an
        `engine_config` with every setting (see `q3tts.engine.EngineConfig`). `lora`: a PEFT LoRA adapter of the
        talker and/or code predictor (a folder or hub id with adapter_config.json and adapter_model.safetensors),
        merged into the weights at load (`q3tts.models.lora`; peft is not needed)."""
        del attn_implementation, trust_remote_code, low_cpu_mem_usage
        if not isinstance(pretrained_model_name_or_path, (str, PathLike)):
            raise TypeError("pretrained_model_name_or_path must be a checkpoint folder, a hub id or a tiny model's "
                            f"name (a str or Path), got {type(pretrained_model_name_or_path).__name__}")
        if engine_config is not None and not isinstance(engine_config, EngineConfig):
            raise TypeError(f"engine_config must be a q3tts.EngineConfig (EngineConfig(max_rows=...)), got "
                            f"{type(engine_config).__name__}; or pass its settings as keywords (max_rows=...)")
        options = {k: v for k, v in dict(max_rows=max_rows, max_context=max_context, kv_cache_gb=kv_cache_gb,
                                         gpu_memory_utilization=gpu_memory_utilization).items() if v is not None}
        engine_config = replace(engine_config or EngineConfig(), **options)
        device = resolve_device(device if device is not None else device_map)
        dtype = resolve_dtype(dtype if dtype is not None else torch_dtype, device)
        folder = resolve_checkpoint(pretrained_model_name_or_path, revision=revision, cache_dir=cache_dir,
                                    local_files_only=local_files_only, token=token)
        config = ModelConfig.from_file(folder / "config.json")
        if lora is not None:
            check_adapter(lora)
        adapter = None if lora is None else resolve_checkpoint(lora, cache_dir=cache_dir,
                                                               local_files_only=local_files_only, token=token)
        model = Qwen3TTSModel.from_folder(folder, config, device=device, dtype=dtype, lora=adapter)
        speech_tokenizer = SpeechTokenizer.from_pretrained(folder / "speech_tokenizer", device=device, dtype=dtype,
                                                           load_encoder=config.is_base)
        return cls(model, speech_tokenizer, TextTokenizer.from_folder(folder),
                   GenerationConfig.from_file(folder / "generation_config.json"), engine_config, reference)

    # ---- requests -----------------------------------------------------------------------------------------

    def request(self, text: str, *, speaker: str | None = None, voice: Voice | str | Path | None = None,
                instruct: str | None = None, language: str = "auto", non_streaming_mode: bool | None = None,
                seed: int | None = None, runaway_guard: RunawayGuard | None = None, **sampling: Any) -> Request:
        """Validates one request against this checkpoint and engine (raises RequestError naming the argument at
        fault). `voice` is a Voice or a saved voice file (Base checkpoints); `speaker` a preset speaker
        (CustomVoice); `instruct` a style (1.7B CustomVoice) or the voice's description (VoiceDesign).
        `sampling`: any generation_config field (`do_sample`, `temperature`, `top_k`, `top_p`,
        `repetition_penalty`, the `subtalker_*` ones, `max_new_tokens`); unset ones take the checkpoint's.
        `runaway_guard` (a `RunawayGuard`) ends audio that grows far beyond what the text needs, or repeats."""
        request = self.builder.build(text, speaker=speaker, voice=voice, instruct=instruct, language=language,
                                     non_streaming_mode=non_streaming_mode, seed=seed, sampling=sampling,
                                     runaway_guard=runaway_guard)
        return self.builder.fit(request, self.context_limit())

    def pieces(self, text: str, **kwargs: Any) -> list[Request]:
        """`request` for a text of any length: one request, or for a text longer than LONG_TEXT_CHARS one per piece
        of at most PIECE_CHARS characters, cut at sentence ends (q3tts.api.pieces), all validated now."""
        if not isinstance(text, str) or len(text) <= LONG_TEXT_CHARS:
            return [self.request(text, **kwargs)]
        return [self.request(piece, **kwargs) for piece in split_text(text, PIECE_CHARS)]

    # ---- our API ------------------------------------------------------------------------------------------

    def create_voice(self, ref_audio: Any, ref_text: str | None = None, x_vector_only: bool = False) -> Voice:
        """One voice from one reference recording (Base checkpoints); save it with `voice.save(path)`."""
        self.builder.require("base", "create_voice")
        if isinstance(x_vector_only, str) or x_vector_only not in (True, False):  # ("no" would read as True)
            raise RequestTypeError(f"x_vector_only must be True or False, got {quote(x_vector_only)}",
                                   "x_vector_only")
        return clone_voices(self.speech_tokenizer, self.model.speaker_encoder, self.config, [ref_audio], [ref_text],
                            [x_vector_only])[0]

    def synthesize(self, text: str, *, speaker: str | None = None, voice: Voice | str | Path | None = None,
                   instruct: str | None = None, language: str = "auto", non_streaming_mode: bool | None = None,
                   seed: int | None = None, on_frame: Callable[[int], None] | None = None,
                   **sampling: Any) -> np.ndarray:
        """One utterance as float32 audio at `self.sample_rate`, in whatever mode the checkpoint offers (see
        `request` for the arguments; a long text is spoken as pieces, see `pieces`). `on_frame(n)` is called as
        frames are produced (n: frames so far of the piece)."""
        requests = self.pieces(text, speaker=speaker, voice=voice, instruct=instruct, language=language,
                               non_streaming_mode=non_streaming_mode, seed=seed, **sampling)
        return join(self.synthesize_all(requests, on_frame))

    def synthesize_all(self, requests: list[Request], on_frame: Callable[[int], None] | None = None
                       ) -> list[np.ndarray]:
        """Many requests (from `request`) at once: they run as rows of one batch, and beyond the engine's rows
        through continuous batching. Returns their audio in order."""
        if on_frame is not None and not callable(on_frame):
            raise RequestTypeError(f"on_frame must be a function (called with the frames so far) or None, got "
                                   f"{type(on_frame).__name__}", "on_frame")
        wrong = next((r for r in requests if not isinstance(r, Request)), None)
        if wrong is not None:
            raise RequestTypeError(f"synthesize_all takes requests made by TTS.request, not {type(wrong).__name__} "
                                   "(for texts: TTS.synthesize, or TTS.request for each)", "requests")
        return self.renderer.render(requests, official_cut=False, on_frame=on_frame)

    def stream(self, text: str, *, speaker: str | None = None, voice: Voice | str | Path | None = None,
               instruct: str | None = None, language: str = "auto", non_streaming_mode: bool | None = None,
               seed: int | None = None, chunk_schedule: tuple[int, ...] | int = DEFAULT_SCHEDULE,
               pcm_format: str = "float32", **sampling: Any) -> AudioStream:
        """Like `synthesize`, but yields `AudioChunk`s while the speech is generated (frames per chunk follow
        `chunk_schedule`; the last value repeats). Bad input raises here, before the stream opens. The
        concatenated chunks equal `synthesize`'s audio (the same codes; for a long text the samples within ~2e-6:
        its pieces are decoded in batches of other sizes). Leaving the loop early (or `close()`) frees the row."""
        started = time.perf_counter()
        schedule = check_chunking(chunk_schedule, pcm_format)
        requests = self.pieces(text, speaker=speaker, voice=voice, instruct=instruct, language=language,
                               non_streaming_mode=non_streaming_mode, seed=seed, **sampling)
        return AudioStream(lambda: self.submit_pieces(requests), schedule, pcm_format, self.sample_rate, started)

    def astream(self, text: str, **kwargs: Any) -> AudioStream:
        """`stream` for asyncio: `async for chunk in tts.astream(...)`, the same chunks, no thread per stream."""
        started = time.perf_counter()
        pcm_format = kwargs.pop("pcm_format", "float32")
        schedule = check_chunking(kwargs.pop("chunk_schedule", DEFAULT_SCHEDULE), pcm_format)
        requests = self.pieces(text, **kwargs)
        return AudioStream(lambda: self.submit_pieces(requests, asyncio_loop=True), schedule, pcm_format,
                           self.sample_rate, started, submit_now=_loop_running())

    def live(self, *, speaker: str | None = None, voice: Voice | str | Path | None = None,
             instruct: str | None = None, language: str = "auto", seed: int | None = None,
             max_text_wait_s: float = MAX_TEXT_WAIT_S, chunk_schedule: tuple[int, ...] | int = DEFAULT_SCHEDULE,
             pcm_format: str = "float32", **sampling: Any) -> LiveRequest:
        """One generation whose text arrives while it runs (q3tts.api.live): `append(text)` as it comes, `end()`
        after the last; read the audio with `for` or `async for` (the same `AudioChunk`s as `stream`). The codes
        are those of the whole text in streaming-text mode (`non_streaming_mode=False`). The mode, voice and
        sampling arguments are `request`'s, checked now."""
        schedule = check_chunking(chunk_schedule, pcm_format)
        return open_live(self, voice, speaker, instruct, language, seed, max_text_wait_s, schedule, pcm_format,
                         sampling)

    def dialogue(self, turns: Any, **defaults: Any) -> np.ndarray:
        """A script of turns (dicts or `Turn`s: text, speaker or voice, instruct, language, pause after it) as one
        audio. The turns run at once, as rows of one batch, and are joined in script order with their pauses.
        `defaults`: `request`'s arguments for every turn (a turn's own fields win). Every turn is checked before
        anything runs (RequestError, param `turns[i].field`)."""
        return render_dialogue(self, turns, defaults)

    def stream_dialogue(self, turns: Any, **defaults: Any) -> Iterator[np.ndarray]:
        """`dialogue` as float32 frames in script order while it is generated (every turn generating at once; a
        later turn's frames wait until the turns before it are out). Closing it early cancels the rest."""
        return stream_dialogue(self, turns, defaults)


def _loop_running() -> bool:
    try:
        asyncio.get_running_loop()
        return True
    except RuntimeError:
        return False
