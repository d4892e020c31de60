"""The speech service: the one place the HTTP and WebSocket routes meet the model and its engine.

It starts the model's engine (graphs captured, one warm-up request through it; `ready` only then), resolves a
request's voice in the server's terms (a `voice` names a preset speaker or a stored voice; `ref_audio` carries a
recording), and submits. Validation is the request builder's (`q3tts.request`): a `RequestError` it raises is
only translated here into the API's error shape, its parameter renamed to the HTTP field.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import gc
import itertools
import logging
import os
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import Any, TypeVar

import torch

from ..audio import AudioError
from ..engine import EngineError, QueueFull, RequestStream
from ..engine.engine import one_cpu_thread_on_gpu
from ..engine.sequence import Prompt
from ..errors import RequestError, quote
from ..fetch import FetchError, FetchPolicy, fetch
from ..pieces import PieceStream
from ..request import Request
from ..voice import Voice
from . import errors
from .config import ServerConfig
from .core import Speech
from .schemas import TASK_TYPES, SpeechRequest, SpeechSettings
from .voice_store import VoiceStore, VoiceStoreError

log = logging.getLogger("q3tts.server")
_ids = itertools.count()
PLACEHOLDER_VOICES = ("", "default")  # `voice` where none applies (VoiceDesign, ref_audio); OpenAI needs one
OPENAI_MODEL_NAMES = ("tts-1", "tts-1-hd", "gpt-4o-mini-tts")  # accepted as aliases of the loaded model
MAX_RESTARTS = 3  # engine rebuilds after failures before the server gives up
PREPARE_THREADS = 2
DOWNLOAD_THREADS = 8  # reference downloads at once; more wait their turn
T = TypeVar("T")
HTTP_NAMES = {"text": "input", "instruct": "instructions", "speaker": "voice"}  # Python argument -> HTTP field
HTTP_VALUES = {"x_vector_only_mode=False": "x_vector_only_mode=false",  # a Python value in JSON's spelling
               "x_vector_only_mode=True": "x_vector_only_mode=true"}
SERVER_FLAGS = {"max_context": "--max-context", "kv_cache_gb": "--kv-cache-gb",
                "gpu_memory_utilization": "--gpu-memory-utilization"}


@dataclass
class VoiceChoice:
    """A request's (or a WebSocket session's) voice, resolved once."""

    speaker: str | None = None
    voice: Voice | None = None
    instruct: str | None = None


@dataclass
class PreparedSpeech:
    """A request's pieces (one, or several for a long input: q3tts.pieces) and their prompts."""

    requests: list[Request]
    prompts: list[Prompt]

    @property
    def input_tokens(self) -> int:
        return sum(max(r.text_tokens, 0) for r in self.requests)


def api_error(e: RequestError) -> errors.APIError:
    """A RequestError in the API's shape: its parameter as the HTTP field, unknown names as 404."""
    param = HTTP_NAMES.get(e.param, e.param)
    message = _http_message(e)
    if e.code == "not_found":
        return errors.not_found(message, param=param, code=f"{param}_not_found")
    return errors.bad_request(message, param=param, code=e.code)


def _http_message(e: RequestError) -> str:
    """The error's message in the API's terms: argument names as HTTP fields, also the bare leading one ("text is
    empty" -> "input is empty"), as the command line does with its flags (cli.py)."""
    message = e.renamed({**HTTP_NAMES, **HTTP_VALUES, **SERVER_FLAGS})
    if e.param in HTTP_NAMES and message.startswith(f"{e.param} "):
        message = HTTP_NAMES[e.param] + message[len(e.param):]
    return message


class SpeechService:
    def __init__(self, tts: Any, config: ServerConfig, voices: VoiceStore, observer: Any = None):
        self.tts, self.config, self.voices, self.observer = tts, config, voices, observer
        self.engine = None
        self.owns_engine = False  # built here (closed at stop), not shared with other users of the same TTS
        self.ready = False
        self.draining = False  # shutting down: running streams finish, new requests are refused
        self.failure: str | None = None
        self.restarts = 0  # engines rebuilt after a failure
        self.on_give_up: Any = None  # called when the engine cannot be rebuilt (serve(): the process exits)
        self._watchdog: asyncio.Task | None = None
        # Prompts are built (and stored voices read) on two threads of the service's own, not asyncio's default
        # pool (up to 32 threads): every thread that holds the interpreter delays the engine thread's next frame.
        # On a GPU they keep no OpenMP teams (each would slow the other's CPU ops).
        self._workers = ThreadPoolExecutor(PREPARE_THREADS, thread_name_prefix="q3tts-prepare",
                                           initializer=one_cpu_thread_on_gpu, initargs=(tts.device,))
        self._prompts = _PromptBatcher(lambda requests: self._in_worker(self.tts.prepare_many, requests))
        # Reference downloads wait on other servers: threads of their own, so that slow ones never hold the default
        # pool, where the audio encoders run (each ends at its deadline: fetch.py).
        self._downloads = ThreadPoolExecutor(DOWNLOAD_THREADS, thread_name_prefix="q3tts-fetch")

    # ---- lifecycle ----------------------------------------------------------------------------------------

    async def start(self) -> None:
        """Builds the engine (captures its graphs), runs one warm-up request through it, then sets `ready`."""
        try:
            if not self.tts.has_engine:
                self.tts.configure_engine(self.config.engine_config())
                self.owns_engine = True
            else:
                log.warning("the model's engine is already running: the server shares it as it is")
            self.engine = await asyncio.to_thread(self.tts.prepare_engine)
            if self.config.warmup:
                await self._warm_up()
            if self.observer is not None:
                self.engine.metrics.observers.append(self.observer)
            # What exists now (the model, the engine, the imports) lives as long as the process: out of the
            # garbage collector's sight, so that its full collections do not stall the engine for tens of ms.
            gc.collect()
            gc.freeze()
            if self.tts.device.type == "cuda":
                # Beside a GPU the process's CPU work is bookkeeping: this thread and the threads started later run
                # torch's CPU ops on one thread each (each thread's OpenMP team stays alive and slows the others';
                # docs/perf-notes.md, entry 73).
                torch.set_num_threads(1)
            self.ready = True
            log.info("engine ready: %s", self.config.model_id)
        except Exception as e:
            log.exception("engine start-up failed")
            self.failure = f"engine start-up failed: {e}"
            return
        if self.owns_engine and self._watchdog is None:
            self._watchdog = asyncio.create_task(self._watch())

    async def _watch(self) -> None:
        """Rebuilds a failed engine (its streams have ended with an error event; meanwhile /ready and new requests
        say 503). After MAX_RESTARTS failures, or if a rebuild fails, gives up: /health says 503 and
        `on_give_up` (the process's exit under `q3tts serve`) lets a supervisor start it afresh."""
        while not self.draining:
            await asyncio.sleep(0.2)
            if self.engine is None or self.engine.healthy:
                continue
            self.ready = False
            self.restarts += 1
            log.error("the engine failed (%d so far); rebuilding it", self.restarts)
            try:
                if self.restarts > MAX_RESTARTS:
                    raise RuntimeError(f"the engine failed {self.restarts} times")
                await asyncio.to_thread(self.tts.close)
                self.tts.configure_engine(self.config.engine_config())
                self.engine = await asyncio.to_thread(self.tts.prepare_engine)
                if self.observer is not None:
                    self.engine.metrics.observers.append(self.observer)
                self.ready = True
            except Exception as e:
                log.exception("giving up on the engine")
                self.failure = f"the engine failed and could not be rebuilt: {e}"
                if self.on_give_up is not None:
                    self.on_give_up()
                return

    async def stop(self) -> None:
        self.ready = False
        if self._watchdog is not None:
            self._watchdog.cancel()
        if self.owns_engine:
            await asyncio.to_thread(self.tts.close)
        self._workers.shutdown(wait=False)
        self._downloads.shutdown(wait=False)

    @property
    def healthy(self) -> bool:
        """Alive: not given up (a failed engine that is being rebuilt counts as alive)."""
        return self.failure is None

    @property
    def task_type(self) -> str:
        return TASK_TYPES[self.tts.config.tts_model_type]

    async def _warm_up(self) -> None:
        kind = self.tts.config.tts_model_type
        choice = VoiceChoice()
        if kind == "custom_voice":
            choice.speaker = self.tts.get_supported_speakers()[0]
        elif kind == "voice_design":
            choice.instruct = "A calm, clear voice."
        else:
            hidden = self.tts.config.talker_config.hidden_size
            choice.voice = Voice(ref_code=None, ref_spk_embedding=torch.zeros(hidden), x_vector_only_mode=True,
                                 icl_mode=False, model_size=self.tts.config.tts_model_size)
        settings = SpeechSettings(max_new_tokens=4, seed=0)
        job = await self.prepare("Hello.", settings, choice)
        await self.engine.submit(job.prompts[0], job.requests[0].params, request_id="warmup",
                                 asyncio_loop=True).aread_all()

    # ---- requests -----------------------------------------------------------------------------------------

    def check_ready(self) -> None:
        if self.draining:
            raise errors.shutting_down()
        if not self.ready or self.engine is None:
            raise errors.engine_failed(self.failure) if self.failure else errors.not_ready()
        if not self.engine.healthy:
            raise errors.engine_failed("the engine has failed; restart the server")

    def check_model(self, name: str | None) -> None:
        if name is not None and name not in (self.config.model_id, *OPENAI_MODEL_NAMES):
            raise errors.not_found(f"model {quote(name)} is not served here; this server serves "
                                   f"{self.config.model_id!r}", param="model", code="model_not_found")

    async def resolve_voice(self, s: SpeechSettings) -> VoiceChoice:
        """The voice a request asks for, in the server's terms, checked against the checkpoint's mode before any
        reference audio is fetched or encoded."""
        if s.task_type is not None and s.task_type != self.task_type:
            raise errors.bad_request(f"task_type {quote(s.task_type)} does not match the loaded {self.task_type} "
                                     f"checkpoint {self.config.model_id!r}", param="task_type")
        kind = self.tts.config.tts_model_type
        cloning = [n for n in ("ref_audio", "ref_text", "x_vector_only_mode") if getattr(s, n) not in (None, False)]
        if kind != "base" and cloning:
            raise errors.bad_request(f"{cloning[0]} is for voice cloning, which needs a Base checkpoint (this one is "
                                     f"{self.task_type})", param=cloning[0])
        if kind == "voice_design" and _named_voice(s) is not None:
            raise errors.bad_request("a VoiceDesign checkpoint has no named voices: describe the voice in "
                                     "`instructions` and omit `voice` (or pass 'default')", param="voice")
        speaker = s.voice_id if kind == "custom_voice" else None
        try:
            instruct = self.tts.builder.check_mode(speaker, kind == "base", s.instructions)
            self.tts.builder.language(s.language)
            if speaker is not None:
                speaker = self.tts.builder.speaker(speaker)
        except RequestError as e:
            raise api_error(e) from e
        if kind == "base":
            return VoiceChoice(voice=await self._clone_voice(s))
        return VoiceChoice(speaker=speaker, instruct=instruct)

    async def _clone_voice(self, s: SpeechSettings) -> Voice:
        if s.ref_audio is not None:
            if _named_voice(s) is not None:
                raise errors.bad_request("pass either `voice` (a stored voice) or `ref_audio`, not both",
                                         param="voice")
            source = _audio_source(s.ref_audio)
            if isinstance(source, str) and not source.startswith("data:"):
                source = await self._download(source)
            return await self.create_voice(source, s.ref_text, s.x_vector_only_mode, "ref_audio")
        if s.ref_text is not None or s.x_vector_only_mode:
            raise errors.bad_request("ref_text and x_vector_only_mode apply only with ref_audio (a stored voice "
                                     "keeps its own)", param="ref_text" if s.ref_text is not None else
                                     "x_vector_only_mode")
        if not s.voice_id:
            raise errors.bad_request("this Base checkpoint clones voices: pass `voice` (an id from POST "
                                     "/v1/audio/voices) or `ref_audio`", param="voice", code="missing")
        try:
            found = await self._in_worker(self.voices.get, s.voice_id)
        except VoiceStoreError as e:
            raise errors.APIError(500, str(e), type=errors.SERVER, param="voice", code="voice_unreadable") from None
        if found is None:
            raise errors.not_found(f"voice {quote(s.voice_id)} not found", param="voice", code="voice_not_found")
        return found[1]

    async def _download(self, url: str) -> bytes:
        """A ref_audio URL's bytes, as this server's settings allow (off by default)."""
        c = self.config
        if not c.ref_audio_urls:
            raise errors.bad_request("ref_audio URLs are turned off on this server (q3tts serve "
                                     "--allow-ref-audio-urls or --ref-audio-hosts turns them on): send the audio "
                                     "as base64 or upload it to /v1/audio/voices", param="ref_audio",
                                     code="urls_disabled")
        policy = FetchPolicy(max_bytes=c.max_upload_bytes, timeout_s=c.ref_audio_timeout_s, hosts=c.ref_audio_hosts,
                             allow_private=False)
        started = time.monotonic()

        def download() -> bytes:  # (the time limit counts from the request: waiting for a thread included)
            return fetch(url, replace(policy, timeout_s=max(policy.timeout_s - (time.monotonic() - started), 0.0)))

        try:
            return await asyncio.get_running_loop().run_in_executor(self._downloads, download)
        except FetchError as e:
            raise errors.bad_request(str(e), param="ref_audio", code="download_failed") from e

    async def create_voice(self, source: str | bytes, ref_text: str | None, x_vector_only: bool,
                           param: str) -> Voice:
        """Clones a voice from reference audio (Base checkpoints), in a worker thread."""
        if self.tts.config.tts_model_type != "base":
            raise errors.bad_request(f"voice cloning needs a Base checkpoint; this one is {self.task_type}",
                                     param=param)
        try:
            return await asyncio.to_thread(self.tts.create_voice, source, ref_text, x_vector_only)
        except AudioError as e:
            raise errors.bad_request(str(e), param=param) from e
        except RequestError as e:
            raise api_error(e) from e

    def check_limits(self, s: SpeechSettings, text: str | None = None) -> None:
        """The lengths of what the client sent, before any work (README: "Limits")."""
        c = self.config
        ref_audio_limit = 2048 if (s.ref_audio or "").startswith(("http://", "https://")) \
            else c.max_upload_bytes * 4 // 3 + 64  # base64 or a data: URL
        for param, value, limit in (("input", text, c.max_input_chars),
                                    ("instructions", s.instructions, c.max_instructions_chars),
                                    ("ref_text", s.ref_text, c.max_ref_text_chars),
                                    ("voice", s.voice_id, c.max_voice_chars),
                                    ("ref_audio", s.ref_audio, ref_audio_limit)):
            if value is not None and len(value) > limit:
                raise errors.bad_request(f"{param} is {len(value)} characters; this server accepts at most {limit}",
                                         param=param, code="input_too_long" if param == "input" else "too_long")

    async def prepare(self, text: str, s: SpeechSettings, choice: VoiceChoice,
                      seed: int | None = None) -> PreparedSpeech:
        """Validates the request (text, voice, sampling, length) in a worker thread and builds its prompt, together
        with those of the requests that arrive meanwhile."""
        seed = s.seed if seed is None else seed
        try:
            requests = await self._in_worker(self._requests, text, s, choice, seed)
            return PreparedSpeech(requests, await self._prompts.build(requests))
        except RequestError as e:
            raise api_error(e) from e

    async def _in_worker(self, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._workers, fn, *args)

    def _requests(self, text: str, s: SpeechSettings, choice: VoiceChoice, seed: int | None) -> list[Request]:
        return self.tts.pieces(text, speaker=choice.speaker, voice=choice.voice, instruct=choice.instruct,
                               language=s.language, non_streaming_mode=s.non_streaming_mode, seed=seed,
                               runaway_guard=self.config.runaway_guard, **s.sampling())

    async def speak(self, body: SpeechRequest, request_id: str) -> Speech:
        """A speech request checked, prepared and submitted: no audio is made before all of it passes."""
        self.check_limits(body, body.input)
        self.check_ready()
        self.check_model(body.model)
        choice = await self.resolve_voice(body)
        job = await self.prepare(body.input, body, choice)
        return Speech(self.submit(job, request_id), job.input_tokens, self.tts.sample_rate)

    def submit(self, job: PreparedSpeech, request_id: str) -> RequestStream | PieceStream:
        """Queues a prepared request on the engine (429 when the queue is full); read it with `async for`. A long
        input's pieces play back to back, the next one queued while one plays."""
        self.check_ready()
        base = f"{request_id}#{next(_ids)}"

        def one(k: int) -> RequestStream:
            return self.tts.submit(job.requests[k], f"{base}.{k}" if len(job.requests) > 1 else base,
                                   asyncio_loop=True, prompt=job.prompts[k])

        try:
            return one(0) if len(job.requests) == 1 else PieceStream(one, len(job.requests))
        except QueueFull as e:
            raise errors.queue_full(retry_after_s=1) from e
        except EngineError as e:
            raise errors.engine_failed(str(e)) from e
        except RequestError as e:
            raise api_error(e) from e

    def random_seed(self) -> int:
        return int.from_bytes(os.urandom(4), "little") & 0x7FFFFFFF


def _named_voice(s: SpeechSettings) -> str | None:
    """`voice`, unless it is a placeholder (OpenAI's client always sends one) where no name applies."""
    return None if s.voice_id in (None, *PLACEHOLDER_VOICES) else s.voice_id


def _audio_source(ref_audio: str) -> str | bytes:
    """A URL or data URL as it is; anything else must be base64 audio (never a path on this machine)."""
    text = ref_audio.strip()
    if text.startswith(("http://", "https://", "data:")):
        return text
    try:
        return base64.b64decode("".join(text.split()), validate=True)
    except (binascii.Error, ValueError) as e:
        raise errors.bad_request("ref_audio must be an http(s) URL, a data: URL or base64-encoded audio",
                                 param="ref_audio") from e


class _PromptBatcher:
    """Builds prompts in batches, on the event loop's side: a request whose prompt is wanted while a batch is being
    built waits for the next batch, which takes every request that arrived meanwhile (a burst's prompts are built
    in a few calls of `TTS.prepare_many`, not one by one); a lone request is built at once. A batch that fails is
    built again request by request, so that one bad request fails alone."""

    MAX_BATCH = 256

    def __init__(self, prepare_many: Callable[[list[Request]], Any]):
        self._prepare_many = prepare_many  # async: the prompts of a list of requests
        self._pending: list[tuple[Request, asyncio.Future]] = []
        self._draining = False

    async def build(self, requests: list[Request]) -> list[Prompt]:
        loop = asyncio.get_running_loop()
        futures = [loop.create_future() for _ in requests]
        self._pending += zip(requests, futures)
        if not self._draining:
            self._draining = True
            loop.create_task(self._drain())
        return [await f for f in futures]

    async def _drain(self) -> None:
        try:
            while self._pending:
                batch, self._pending = self._pending[:self.MAX_BATCH], self._pending[self.MAX_BATCH:]
                try:
                    results = list(zip(batch, await self._prepare_many([r for r, _ in batch])))
                except Exception:
                    results = []
                    for item in batch:
                        try:
                            results.append((item, (await self._prepare_many([item[0]]))[0]))
                        except Exception as e:
                            results.append((item, e))
                for (_, future), result in results:
                    if future.done():  # its caller went away
                        continue
                    if isinstance(result, Exception):
                        future.set_exception(result)
                    else:
                        future.set_result(result)
        finally:
            self._draining = False
