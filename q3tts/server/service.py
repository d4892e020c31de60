"""The speech service: the one place the HTTP and WebSocket routes meet the model and its engine.

Its engine's life (built and warmed up, rebuilt after a failure, closed) is `EngineKeeper`'s (engine_keeper.py).
Here a request meets it: the service resolves the request's voice and language in the server's terms
(voice_choice.py), checks its `model` (model_ids.py), and submits. Validation is the request builder's
(`q3tts.request`): a `RequestError` it raises is only translated here into the API's error shape, its parameter
renamed to the HTTP field.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

import torch

from ..api.live import LiveRequest
from ..api.pieces import PieceStream
from ..engine import EngineError, QueueFull, RequestStream
from ..engine.engine import one_cpu_thread_on_gpu
from ..engine.prompt import Prompt
from ..errors import RequestError, quote
from ..request.builder import Request
from ..request.voice import Voice
from . import errors
from .config import ServerConfig
from .engine_keeper import EngineKeeper
from .model_ids import is_served, model_ids
from .schemas import TASK_TYPES, SpeechRequest, SpeechSettings
from .speech import RefusedAt, Speech
from .voice_choice import VoiceChoice, VoiceResolver
from .voice_store import VoiceStore

if TYPE_CHECKING:
    from ..api.tts import TTS  # (the server loads it; the front, which imports this module, does not)

log = logging.getLogger("q3tts.server")
_ids = itertools.count()
PREPARE_THREADS = 2
LIVE_START_THREADS = 32  # (they wait in TTS.prepare's batches: see Preparation)
T = TypeVar("T")
HTTP_NAMES = {"text": "input", "instruct": "instructions", "speaker": "voice"}  # Python argument -> HTTP field
HTTP_VALUES = {"x_vector_only_mode=False": "x_vector_only_mode=false",  # a Python value in JSON's spelling
               "x_vector_only_mode=True": "x_vector_only_mode=true"}
SERVER_FLAGS = {"max_context": "--max-context", "kv_cache_gb": "--kv-cache-gb",
                "gpu_memory_utilization": "--gpu-memory-utilization"}


@dataclass
class PreparedSpeech:
    """A request's pieces (one, or several for a long input: q3tts.api.pieces) and their prompts."""

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


class SpeechService(EngineKeeper):
    """The routes' way to the model: a request checked (`check_*`, `resolve_voice`), prepared (`preparation`) and
    submitted (`submit`), or all three (`speak`, `speak_all`). Its engine's life is `EngineKeeper`'s."""

    def __init__(self, tts: TTS, config: ServerConfig, voices: VoiceStore, observer: Any = None):
        super().__init__(tts, config, observer)
        self.voices = voices
        self.preparation = Preparation(tts, config)
        # (ValueError: an alias or default voice this checkpoint cannot use)
        self.resolver = VoiceResolver(tts, config, voices, self.preparation.in_worker, api_error)
        self.model_ids = model_ids(config.model_id, config.model, tts.config.tts_model_type,
                                   tts.config.tts_model_size)

    async def stop(self) -> None:
        """Closes the engine if it was built here, and the service's worker threads."""
        await super().stop()
        self.preparation.close()
        self.resolver.close()

    @property
    def task_type(self) -> str:
        return TASK_TYPES[self.tts.config.tts_model_type]

    async def warm_up(self) -> None:
        """A four-frame request in the checkpoint's first voice, through the new engine."""
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
        job = await self.preparation.prepare("Hello.", settings, choice)
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
        if name is not None and not is_served(name, self.model_ids):
            raise errors.not_found(f"model {quote(name)} is not served here; this server serves "
                                   f"{self.config.model_id!r} (also as {', '.join(self.model_ids[1:])} or OpenAI's "
                                   "tts-1, tts-1-hd, gpt-4o-mini-tts and their snapshots)", param="model",
                                   code="model_not_found")

    async def resolve_voice(self, s: SpeechSettings) -> VoiceChoice:
        """The voice and language a request asks for, in the server's terms (voice_choice.py)."""
        with s.names_as_sent():
            return await self.resolver.resolve(s)

    async def create_voice(self, source: str | bytes, ref_text: str | None, x_vector_only: bool,
                           param: str) -> Voice:
        """Clones a voice from reference audio (Base checkpoints), in a worker thread."""
        return await self.resolver.create_voice(source, ref_text, x_vector_only, param)

    def check_limits(self, s: SpeechSettings, text: str | None = None) -> None:
        """The lengths of what the client sent, before any work (README: "Limits")."""
        c = self.config
        ref_audio_limit = 2048 if (s.reference[0] or "").startswith(("http://", "https://")) \
            else c.max_upload_bytes * 4 // 3 + 64  # base64 or a data: URL
        lengths = (("input", text, c.max_input_chars), ("instructions", s.instructions, c.max_instructions_chars),
                   ("ref_text", s.reference[1], c.max_ref_text_chars), ("voice", s.voice_id, c.max_voice_chars),
                   ("ref_audio", s.reference[0], ref_audio_limit))
        with s.names_as_sent():
            for param, value, limit in lengths:
                if value is not None and len(value) > limit:
                    raise errors.bad_request(f"{param} is {len(value)} characters; this server accepts at most "
                                             f"{limit}", param=param,
                                             code="input_too_long" if param == "input" else "too_long")

    def live(self, s: SpeechSettings, choice: VoiceChoice, seed: int, max_text_wait_s: float,
             pcm_format: str = "float32") -> LiveRequest:
        """A live request (q3tts.api.live) with these settings and voice, in streaming-text mode: the WebSocket
        sessions' (nari.py, websocket.py) one generation fed with text as it arrives."""
        try:
            return self.tts.live(speaker=choice.speaker, voice=choice.voice, instruct=choice.instruct,
                                 language=choice.language, seed=seed, pcm_format=pcm_format,
                                 max_text_wait_s=max_text_wait_s, runaway_guard=self.config.runaway_guard,
                                 **s.sampling())
        except RequestError as e:
            with s.names_as_sent():
                raise api_error(e) from e

    async def speak(self, body: SpeechRequest, request_id: str) -> Speech:
        """A speech request checked, prepared and submitted: no audio is made before all of it passes."""
        job = await self._checked(body)
        return Speech(self.submit(job, request_id), job.input_tokens, self.tts.sample_rate)

    async def speak_all(self, bodies: list[SpeechRequest], request_id: str) -> list[Speech]:
        """Requests spoken together (a dialogue's turns): every one checked, its voice resolved and its prompt
        built (together, in one batch of prompts) and checked against the engine's limits before any is
        submitted; the first refusal by index is RefusedAt and the engine has seen none of them."""
        jobs = await asyncio.gather(*(self._checked(body) for body in bodies), return_exceptions=True)
        for i, job in enumerate(jobs):
            if isinstance(job, errors.APIError):
                raise RefusedAt(i, job)
            if isinstance(job, BaseException):
                raise job
        speeches: list[Speech] = []
        try:
            for i, job in enumerate(jobs):
                speeches.append(Speech(self.submit(job, f"{request_id}.{i}"), job.input_tokens, self.tts.sample_rate))
        except errors.APIError:  # (the queue is full, or the engine failed meanwhile: the server's, no request's)
            for speech in speeches:
                speech.stream.cancel()
            raise
        return speeches

    async def _checked(self, body: SpeechRequest) -> PreparedSpeech:
        """The request checked and prepared (its prompts fit the engine), not submitted; errors name the fields as
        the client sent them."""
        self.check_limits(body, body.input)
        self.check_ready()
        self.check_model(body.model)
        choice = await self.resolve_voice(body)
        with body.names_as_sent():
            job = await self.preparation.prepare(body.input, body, choice)
            try:
                for request, prompt in zip(job.requests, job.prompts):  # (a long input's later pieces too)
                    self.engine.check_prompt(prompt, request.params)
            except RequestError as e:
                raise api_error(e) from e
        return job

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


class Preparation:
    """Where requests are validated and their prompts built, off the event loop: on two threads of the service's own,
    not asyncio's default pool (up to 32 threads): every thread that holds the interpreter delays the engine thread's
    next frame (on a GPU they keep no OpenMP teams: each would slow the other's CPU ops); the prompts of requests
    that arrive together are built in one batch (`PromptBatcher`). A live request's appends until its prompt is
    built run on threads of their own, as many as sessions start together (up to 32): the append that completes a
    prompt builds it through `TTS.prepare`, which builds the prompts that threads ask for meanwhile in one batch,
    so those threads wait there and do not hold the interpreter (on two threads, a burst of sessions would build
    its prompts one after another)."""

    def __init__(self, tts: TTS, config: ServerConfig):
        self.tts, self.config = tts, config
        self._workers = _threads(PREPARE_THREADS, "q3tts-prepare", tts)
        self._live_starts = _threads(LIVE_START_THREADS, "q3tts-live-start", tts)
        self._prompts = PromptBatcher(lambda requests: self.in_worker(self.tts.prepare_many, requests))

    async def prepare(self, text: str, s: SpeechSettings, choice: VoiceChoice,
                      seed: int | None = None) -> PreparedSpeech:
        """Validates the request (text, voice, sampling, length) in a worker thread and builds its prompt, together
        with those of the requests that arrive meanwhile."""
        seed = s.seed if seed is None else seed
        try:
            requests = await self.in_worker(self._requests, text, s, choice, seed)
            return PreparedSpeech(requests, await self._prompts.build(requests))
        except RequestError as e:
            raise api_error(e) from e

    async def feed_live(self, live: LiveRequest, method: Callable[..., None], *args: Any) -> None:
        """`method(*args)` of a live request (its append or end): in a thread of its own while the request's prompt
        is still to be built (the text token that completes it builds it: device work, kept off the event loop as
        `prepare` keeps it), inline once it is built (then an append only tokenizes)."""
        if not live.started:
            await asyncio.get_running_loop().run_in_executor(self._live_starts, method, *args)
        else:
            method(*args)

    async def in_worker(self, fn: Callable[..., T], *args: Any) -> T:
        """`fn(*args)` on one of the worker threads."""
        return await asyncio.get_running_loop().run_in_executor(self._workers, fn, *args)

    def close(self) -> None:
        self._workers.shutdown(wait=False)
        self._live_starts.shutdown(wait=False)

    def _requests(self, text: str, s: SpeechSettings, choice: VoiceChoice, seed: int | None) -> list[Request]:
        return self.tts.pieces(text, speaker=choice.speaker, voice=choice.voice, instruct=choice.instruct,
                               language=choice.language, non_streaming_mode=s.non_streaming_mode, seed=seed,
                               runaway_guard=self.config.runaway_guard, **s.sampling())


def _threads(n: int, name: str, tts: TTS) -> ThreadPoolExecutor:
    return ThreadPoolExecutor(n, thread_name_prefix=name, initializer=one_cpu_thread_on_gpu, initargs=(tts.device,))


class PromptBatcher:
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
