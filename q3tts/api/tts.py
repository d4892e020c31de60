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
import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..checkpoint import CheckpointError, resolve_model_dir
from ..config import GenerationConfig, ModelConfig
from ..engine import Engine, EngineConfig, QueueFull, RequestStream
from ..engine.sequence import Prompt
from ..errors import RequestError, RequestTypeError
from ..models.qwen3_tts import Qwen3TTSModel
from ..models.speech_tokenizer import SpeechTokenizer
from ..reference import generate_codes
from ..request.builder import Request, RequestBuilder, RunawayGuard
from ..request.prompt import build_prompts
from ..request.text_segmenter import split_text
from ..request.text_tokenizer import TextTokenizer
from ..request.voice import Voice, clone_voices
from .dialogue import render_dialogue, stream_dialogue
from .official import OfficialAPI
from .pieces import LONG_TEXT_CHARS, PIECE_CHARS, PieceStream, join
from .streaming import DEFAULT_SCHEDULE, AudioStream, check_chunking


class TTS(OfficialAPI):
    """A loaded Qwen3-TTS checkpoint (any of Base, CustomVoice, VoiceDesign; 0.6B or 1.7B) and its engine."""

    def __init__(self, model: Qwen3TTSModel, speech_tokenizer: SpeechTokenizer, text_tokenizer: TextTokenizer,
                 generation_config: GenerationConfig, engine_config: EngineConfig | None = None,
                 reference: bool = False):
        self.model = model
        self.config: ModelConfig = model.config
        self.speech_tokenizer = speech_tokenizer
        self.text_tokenizer = text_tokenizer
        self.generation_config = generation_config
        self.device = model.talker.codec_head.weight.device
        self.sample_rate = speech_tokenizer.sample_rate
        self.engine_config = engine_config or EngineConfig()
        self.reference = reference
        self.builder = RequestBuilder(self.config, text_tokenizer, generation_config, self._context_limit)
        self._engine: Engine | None = None
        self._engine_lock = threading.Lock()
        self._prompt_stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None

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
        options = {k: v for k, v in dict(max_rows=max_rows, max_context=max_context, kv_cache_gb=kv_cache_gb,
                                         gpu_memory_utilization=gpu_memory_utilization).items() if v is not None}
        engine_config = replace(engine_config or EngineConfig(), **options)
        device = resolve_device(device if device is not None else device_map)
        dtype = resolve_dtype(dtype if dtype is not None else torch_dtype, device)
        folder = resolve_checkpoint(pretrained_model_name_or_path, revision=revision, cache_dir=cache_dir,
                                    local_files_only=local_files_only, token=token)
        config = ModelConfig.from_file(folder / "config.json")
        adapter = None if lora is None else resolve_checkpoint(lora, cache_dir=cache_dir,
                                                               local_files_only=local_files_only, token=token)
        model = Qwen3TTSModel.from_folder(folder, config, device=device, dtype=dtype, lora=adapter)
        speech_tokenizer = SpeechTokenizer.from_pretrained(folder / "speech_tokenizer", device=device, dtype=dtype,
                                                           load_encoder=config.is_base)
        return cls(model, speech_tokenizer, TextTokenizer.from_folder(folder),
                   GenerationConfig.from_file(folder / "generation_config.json"), engine_config, reference)

    # ---- the engine ---------------------------------------------------------------------------------------

    @property
    def engine(self) -> Engine:
        """The model's engine, built on first use (on a GPU that captures its CUDA graphs: seconds)."""
        if self._engine is None:
            with self._engine_lock:
                if self._engine is None:
                    self._engine = Engine(self.model, self.speech_tokenizer.decoder, self.engine_config)
        return self._engine

    def prepare_engine(self) -> Engine:
        """Builds the engine now (fused weights, KV cache sized from the memory budget, CUDA graphs of every batch
        bucket) and starts its thread, rather than on the first request."""
        self.engine.start()
        return self.engine

    @property
    def has_engine(self) -> bool:
        """Whether the engine is built (it is built on first use)."""
        return self._engine is not None

    def configure_engine(self, config: EngineConfig) -> None:
        """Sets the engine's settings before it is built (after `close()`, for the next one)."""
        with self._engine_lock:
            if self._engine is not None:
                raise RuntimeError("the engine is already built: close() it first")
            self.engine_config = config

    def close(self) -> None:
        """Stops the engine (requests still open end with EngineError) and lets it go; the model stays loaded and
        the next request builds a new engine."""
        with self._engine_lock:
            engine, self._engine = self._engine, None
        if engine is not None:
            engine.stop()

    def __enter__(self) -> TTS:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _context_limit(self) -> tuple[int, str | None]:
        if self.reference:
            return self.config.talker_config.max_position_embeddings, None
        return self.engine.context_limit()

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
        return self.builder.build(text, speaker=speaker, voice=voice, instruct=instruct, language=language,
                                   non_streaming_mode=non_streaming_mode, seed=seed, sampling=sampling,
                                   runaway_guard=runaway_guard)

    def pieces(self, text: str, **kwargs: Any) -> list[Request]:
        """`request` for a text of any length: one request, or for a text longer than LONG_TEXT_CHARS one per piece
        of at most PIECE_CHARS characters, cut at sentence ends (q3tts.api.pieces), all validated now."""
        if not isinstance(text, str) or len(text) <= LONG_TEXT_CHARS:
            return [self.request(text, **kwargs)]
        return [self.request(piece, **kwargs) for piece in split_text(text, PIECE_CHARS)]

    def prepare(self, request: Request) -> Prompt:
        """The request's prompt embeddings (see `prepare_many`)."""
        return self.prepare_many([request])[0]

    def prepare_many(self, requests: list[Request]) -> list[Prompt]:
        """The requests' prompt embeddings, built together (`q3tts.request.prompt.build_prompts`: in bf16/fp16 their
        text is projected in one call) on a CUDA stream of their own (so that they do not queue behind the frames the
        engine has in flight)."""
        specs = [r.spec for r in requests]
        if self._prompt_stream is None:
            return build_prompts(self.model.talker, self.config, specs)
        with torch.cuda.stream(self._prompt_stream):
            prompts = build_prompts(self.model.talker, self.config, specs)
        self._prompt_stream.synchronize()
        return prompts

    def submit(self, request: Request, request_id: str | None = None, asyncio_loop: bool = False,
               prompt: Prompt | None = None, realtime: bool = True) -> RequestStream:
        """Queues a request on the engine; returns its stream of 1920-sample float32 frames (`asyncio_loop=True`
        from a running event loop: read it with `async for`). `prompt`: the request's prompt if already built
        (`prepare`). `realtime=False`: the audio is read whole, not played as it comes (no lead to keep ahead of
        playback when the engine admits others). Raises QueueFull when the engine's queue is at its limit."""
        guard = request.guard
        return self.engine.submit(prompt or self.prepare(request), request.params, request.spec.ref_codes, request_id,
                                  asyncio_loop, stop_after=guard.frame_limit(request.text_tokens) if guard else None,
                                  stop_on_repeats=guard.repeated_frames if guard else None, realtime=realtime)

    # ---- our API ------------------------------------------------------------------------------------------

    def create_voice(self, ref_audio: Any, ref_text: str | None = None, x_vector_only: bool = False) -> Voice:
        """One voice from one reference recording (Base checkpoints); save it with `voice.save(path)`."""
        self.require("base", "create_voice")
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
        wrong = next((r for r in requests if not isinstance(r, Request)), None)
        if wrong is not None:
            raise RequestTypeError(f"synthesize_all takes requests made by TTS.request, not {type(wrong).__name__} "
                                   "(for texts: TTS.synthesize, or TTS.request for each)", "requests")
        return self._render(requests, official_cut=False, on_frame=on_frame)

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
        return AudioStream(lambda: self._submit_pieces(requests), schedule, pcm_format, self.sample_rate, started)

    def astream(self, text: str, **kwargs: Any) -> AudioStream:
        """`stream` for asyncio: `async for chunk in tts.astream(...)`, the same chunks, no thread per stream."""
        started = time.perf_counter()
        pcm_format = kwargs.pop("pcm_format", "float32")
        schedule = check_chunking(kwargs.pop("chunk_schedule", DEFAULT_SCHEDULE), pcm_format)
        requests = self.pieces(text, **kwargs)
        return AudioStream(lambda: self._submit_pieces(requests, asyncio_loop=True), schedule, pcm_format,
                           self.sample_rate, started, submit_now=_loop_running())

    def _submit_pieces(self, requests: list[Request], asyncio_loop: bool = False) -> RequestStream | PieceStream:
        if len(requests) == 1:
            return self.submit(requests[0], asyncio_loop=asyncio_loop)
        return PieceStream(lambda k: self.submit(requests[k], asyncio_loop=asyncio_loop), len(requests))

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

    # ---- rendering ----------------------------------------------------------------------------------------

    def _render(self, requests: list[Request], official_cut: bool,
                on_frame: Callable[[int], None] | None = None) -> list[np.ndarray]:
        """The audio of `requests`. `official_cut`: an in-context voice's reference share is cut as the
        official code does (float truncation, which can keep the reference audio's last sample).

        On the CPU the finished codes are decoded again as the official code decodes a call's items (one padded
        batch, `_decode`): in float32 the vocoder amplifies rounding, so the engine's incremental decode, as exact
        as the official one against float64, can be ~1e-4 away from it, while this decode is the official's,
        bit for bit at equal thread counts (docs/faithfulness.md). On a GPU the streamed decode is returned: a
        second decode would cost as much GPU time as the first, for no gain in bfloat16."""
        if self.reference:
            return self._render_reference(requests, official_cut, on_frame)
        streams = self.submit_all(requests)
        whole = self.engine.device.type == "cpu"
        wavs = []
        with _cancelled_on_exit(streams):
            for request, stream in zip(requests, streams):
                frames = []
                for frame in stream:
                    frames.append(frame)
                    if on_frame is not None:
                        on_frame(len(frames))
                if whole:  # (decoded below, all together)
                    continue
                wav = np.concatenate(frames) if frames else np.zeros(0, dtype=np.float32)
                ref = request.spec.ref_codes
                if official_cut and ref is not None and _official_extra(ref.shape[0], len(frames), self._spf):
                    wav = np.concatenate([stream.channel.ref_tail.numpy(), wav])
                wavs.append(wav)
        if whole:
            codes = [torch.from_numpy(np.stack(s.channel.codes)) if s.channel.codes else
                     torch.zeros(0, 16, dtype=torch.long) for s in streams]
            return self._decode(requests, codes, official_cut)
        return wavs

    def submit_all(self, requests: list[Request]) -> list[RequestStream]:
        """Submits every request (their prompts built together); when the engine's queue is full, waits for earlier
        ones before going on."""
        streams: list[RequestStream] = []
        with _cancelled_on_exit(streams):
            for request, prompt in zip(requests, self.prepare_many(requests)):
                while True:
                    try:
                        streams.append(self.submit(request, prompt=prompt, realtime=False))
                        break
                    except QueueFull:
                        if all(s.finished for s in streams):
                            raise
                        time.sleep(0.01)
        return streams

    def _render_reference(self, requests: list[Request], official_cut: bool,
                          on_frame: Callable[[int], None] | None) -> list[np.ndarray]:
        prompts = build_prompts(self.model.talker, self.config, [r.spec for r in requests])
        steps = iter(range(1, 1 << 62))
        codes = generate_codes(self.model.talker, prompts, [r.params for r in requests],
                               on_frame and (lambda _: on_frame(next(steps))))
        return self._decode(requests, codes, official_cut)

    def _decode(self, requests: list[Request], codes: list[torch.Tensor], official_cut: bool) -> list[np.ndarray]:
        """The requests' generated codes (each after its in-context reference's) decoded as the official code
        decodes one call's items, then each cut to its own share."""
        refs = [r.spec.ref_codes for r in requests]
        full = [torch.cat([r.cpu(), c]) if r is not None else c for r, c in zip(refs, codes)]
        wavs = self.speech_tokenizer.decode(full)
        cuts = [0 if r is None else r.shape[0] * self._spf - (official_cut and _official_extra(
                r.shape[0], c.shape[0], self._spf)) for r, c in zip(refs, codes)]
        return [w[cut:] for w, cut in zip(wavs, cuts)]

    @property
    def _spf(self) -> int:
        return self.speech_tokenizer.decoder.samples_per_frame

    def require(self, kind: str, method: str) -> None:
        """Raises RequestError if this checkpoint is not of `kind` (base, custom_voice, voice_design)."""
        if self.config.tts_model_type != kind:
            raise RequestError(f"{method} needs a {kind} checkpoint; this one is {self.config.tts_model_type} "
                               f"({self.config.tts_model_size})")


@contextlib.contextmanager
def _cancelled_on_exit(streams: list[RequestStream]) -> Iterator[None]:
    """Cancels `streams` (as they are then) if the block raises, Ctrl-C included: an interrupted `synthesize`
    frees its rows at once (the caller's traceback, which a REPL keeps, would otherwise keep them generating)."""
    try:
        yield
    except BaseException:
        for stream in streams:
            stream.cancel()
        raise


def _official_extra(ref_frames: int, new_frames: int, samples_per_frame: int) -> bool:
    """Whether the official in-context cut, int(ref / total * len(audio)) in floating point, keeps one sample of
    the reference's audio (the product can round just below ref * samples_per_frame; never by more than one)."""
    total = ref_frames + new_frames
    return int(ref_frames / total * (total * samples_per_frame)) < ref_frames * samples_per_frame


def _loop_running() -> bool:
    try:
        asyncio.get_running_loop()
        return True
    except RuntimeError:
        return False


def resolve_checkpoint(name_or_path: str | Path, revision: str | None = None, cache_dir: str | Path | None = None,
                       local_files_only: bool = False, token: str | bool | None = None) -> Path:
    """The folder of a checkpoint folder, hub id (fetched) or built-in tiny model name, without loading it."""
    from ..tiny import TINY_NAMES, tiny_checkpoint

    if str(name_or_path) in TINY_NAMES:
        return tiny_checkpoint(str(name_or_path))
    return resolve_model_dir(name_or_path, revision=revision, cache_dir=cache_dir, local_files_only=local_files_only,
                             token=token)


def check_checkpoint(name_or_path: str | Path) -> ModelConfig:
    """A checkpoint's config, checked without loading its weights (seconds sooner than `from_pretrained` fails):
    the folder is there (a hub id is fetched), its config.json reads, and its safetensors files are whole."""
    from safetensors import SafetensorError, safe_open

    folder = resolve_checkpoint(name_or_path)
    config = ModelConfig.from_file(folder / "config.json")
    for path in (folder / "model.safetensors", folder / "speech_tokenizer" / "model.safetensors"):
        if not path.is_file():
            raise CheckpointError(f"{path}: file not found")
        try:
            with safe_open(str(path), framework="pt"):  # (reads the header: a truncated file fails here)
                pass
        except SafetensorError as e:
            raise CheckpointError(f"{path}: not a readable safetensors file (truncated or corrupt?): {e}") from e
    return config


def resolve_device(device: str | torch.device | None) -> torch.device:
    """A device argument (None / "auto": a GPU if there is one), refused with a clear error if unusable here."""
    if isinstance(device, dict):
        raise ValueError("device_map as a dict (model sharding) is not supported: pass one device, e.g. 'cuda:0'")
    if device is None or device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise ValueError(f"unknown device {device!r}: use cpu, cuda or cuda:N") from e
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"device {str(device)!r} is not supported: use cpu, cuda or cuda:N")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {str(device)!r} asked for, but this machine has no usable CUDA GPU "
                         f"(torch {torch.__version__}); use device 'cpu'")
    if device.type == "cuda" and (device.index or 0) >= torch.cuda.device_count():
        raise ValueError(f"device {str(device)!r} asked for, but this machine has {torch.cuda.device_count()} GPU(s)")
    return device


def resolve_dtype(dtype: torch.dtype | str | None, device: torch.device) -> torch.dtype:
    """A dtype argument (None / "auto": bfloat16 on a GPU, float32 on the CPU)."""
    if dtype is None or dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if isinstance(dtype, str):
        value = getattr(torch, dtype.removeprefix("torch."), None)
        if not isinstance(value, torch.dtype):
            raise ValueError(f"unknown dtype {dtype!r}: use float32, bfloat16 or float16")
        dtype = value
    if dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"dtype {dtype} is not supported (float32, bfloat16, float16)")
    return dtype
