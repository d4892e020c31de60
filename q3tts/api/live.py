"""`TTS.live`: one generation fed with text while it runs (an LLM's tokens as they come), from the first word.

The request runs in streaming-text mode (`non_streaming_mode=False`): its prompt holds the first text token, each
frame adds the next one. Text is tokenized as it arrives (`q3tts.request.live_text`): a token goes to the engine
once no later text can change it, and the prompt is built from the first one (`q3tts.engine.live` says how a row
waits for the rest). The codes are those of the whole text submitted at once in streaming-text mode, whatever the
chunking and the timing of the appends.

Limits, checked as text arrives (a RequestError naming `text`): at most MAX_TEXT_TOKENS text tokens in all, at
most MAX_APPEND_CHARS characters per append, no text after `end()`. A row that waits longer than
`max_text_wait_s` for its next text ends (its stream raises `LiveTextTimeout`); the wait does not count against
the runaway guard, whose frame limit is the whole text's, set at `end()`.
"""

from __future__ import annotations

import threading
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from ..engine.live import LiveFeed
from ..engine.prompt import Prompt
from ..engine.stream import RequestStream
from ..errors import RequestError, RequestTypeError
from ..request.builder import MAX_TEXT_TOKENS, Request, check_unicode, speaks
from ..request.live_text import LiveText
from ..request.voice import Voice
from .streaming import AudioChunk, AudioStream

if TYPE_CHECKING:
    from ..engine import Engine
    from ..request.text_tokenizer import TextTokenizer


class LiveHost(Protocol):
    """What a live request needs of `TTS` (which it cannot import: `TTS.live` builds it)."""

    text_tokenizer: TextTokenizer
    sample_rate: int

    @property
    def engine(self) -> Engine: ...

    def request(self, text: str, **kwargs: Any) -> Request: ...

    def prepare(self, request: Request) -> Prompt: ...

MAX_APPEND_CHARS = 4096  # one append
MAX_TEXT_WAIT_S = 60.0  # the default wait for the next text


def open_live(tts: LiveHost, voice: Voice | str | Path | None, speaker: str | None, instruct: str | None, language: str,
              seed: int | None, max_text_wait_s: float, schedule: tuple[int, ...], pcm_format: str,
              sampling: dict) -> LiveRequest:
    """`TTS.live`'s request, validated now (the mode, voice, language, sampling) in streaming-text mode."""
    if isinstance(voice, (str, Path)):
        voice = Voice.load(voice)
    if isinstance(max_text_wait_s, bool) or not isinstance(max_text_wait_s, (int, float)) or not max_text_wait_s > 0:
        raise RequestError(f"max_text_wait_s must be a positive number of seconds, got {max_text_wait_s!r}",
                           "max_text_wait_s")
    sampling = dict(sampling)
    if sampling.pop("non_streaming_mode", False) not in (False, None):  # (not a TypeError from `request`)
        raise RequestError("a live request runs in streaming-text mode (non_streaming_mode=False): its text arrives "
                           "while it speaks; for the whole text up front use stream", "non_streaming_mode")
    request = tts.request("a", speaker=speaker, voice=voice, instruct=instruct, language=language,
                          non_streaming_mode=False, seed=seed, **sampling)
    return LiveRequest(tts, request, float(max_text_wait_s), schedule, pcm_format)


class LiveRequest:
    """A live request (`TTS.live`): `append(text)` as text arrives, `end()` after the last, `cancel()` to stop;
    its audio is read as `AudioChunk`s, `for chunk in live` or `async for chunk in live` (the request is submitted
    when the reading starts; appends before it are kept)."""

    def __init__(self, tts: LiveHost, request: Request, max_text_wait_s: float, schedule: tuple[int, ...],
                 pcm_format: str):
        """`request`: the mode, voice and sampling, validated (with any text: its text is replaced)."""
        self._tts, self._request, self._schedule, self._pcm_format = tts, request, schedule, pcm_format
        self._text = LiveText(tts.text_tokenizer)
        self._held: list[int] = []  # text tokens before the prompt is built
        self._has_words = False
        self.feed = LiveFeed(max_text_wait_s)
        self._lock = threading.Lock()
        self._cancelled = False
        self._stream: AudioStream | None = None
        self._started = time.perf_counter()

    @property
    def num_tokens(self) -> int:
        """Text tokens that became final so far."""
        return self._text.num_tokens

    @property
    def ended(self) -> bool:
        return self._text.ended

    @property
    def started(self) -> bool:
        """Whether the request's prompt is built (its first text tokens were final): from then on an append only
        tokenizes and hands tokens on; before, the append that completes the prompt builds it (device work)."""
        return self.feed.prompt is not None

    def append(self, text: str) -> None:
        """Adds text (any piece: a token, a word, several sentences); speech follows as soon as its tokens are
        final. Raises RequestError for text after `end()` or `cancel()`, an append over MAX_APPEND_CHARS
        characters, or text beyond MAX_TEXT_TOKENS tokens in all."""
        if not isinstance(text, str):
            raise RequestTypeError(f"text must be a string, got {type(text).__name__}", "text")
        if len(text) > MAX_APPEND_CHARS:
            raise RequestError(f"one append takes at most {MAX_APPEND_CHARS} characters, got {len(text)}: append "
                               "the text in smaller pieces", "text", "too_long")
        check_unicode(text, "text")
        with self._lock:
            self._check_open()
            self._has_words = self._has_words or speaks(text)
            self._give(self._text.append(text))

    def end(self) -> None:
        """No more text: the rest is spoken, then the audio ends. Raises RequestError if no text was given."""
        with self._lock:
            self._check_open()
            if not self._has_words:
                raise RequestError("the live text is empty (nothing but spaces and invisible characters): append "
                                   "text before end()", "text", "missing")
            self._give(self._text.end())
            guard = self._request.guard
            self.feed.end(guard.frame_limit(self._text.num_tokens) if guard else None)

    def cancel(self) -> None:
        """Stops the request: its row is freed at the next frame boundary, its audio ends."""
        with self._lock:
            self._cancelled = True
            stream = self._stream
        if stream is not None:
            stream.close()

    def _check_open(self) -> None:
        if self._cancelled:
            raise RequestError("text appended to a cancelled live request", "text")
        if self._text.ended:
            raise RequestError("text appended after end()", "text")

    def _give(self, ids: list[int]) -> None:
        """Newly final text tokens to the engine: the first builds the prompt, the rest trail."""
        if self._text.num_tokens > MAX_TEXT_TOKENS:
            self._cancelled = True
            if self._stream is not None:
                self._stream.close()
            raise RequestError(f"the live text is over {MAX_TEXT_TOKENS} tokens, the limit per request (the "
                               "request was cancelled)", "text", "too_long")
        if self.started:
            self.feed.extend(ids)
            return
        self._held += ids
        need = self._prompt_tokens()
        if len(self._held) >= need:  # the prompt's text is known: its trailing text comes after it
            prompt = self._prompt(self._held[:need])
            self.feed.start(prompt, prompt.trailing_ids[:-1] + self._held[need:])  # (TTS_EOS: at the end)
            prompt.trailing_ids = []
        elif self._text.ended:  # all of it fits the prompt: the whole text's
            prompt = self._prompt(self._held)
            self.feed.start(prompt, prompt.trailing_ids, whole=True)
            prompt.trailing_ids = []

    def _prompt_tokens(self) -> int:
        """The text tokens the prompt holds in streaming-text mode (spec section 4.1): the first; with an
        in-context voice, those beside its reference frames (codec_bos and one per frame, its transcript's tokens
        first)."""
        spec = self._request.spec
        if spec.ref_codes is None:
            return 1
        return max(1, 1 + spec.ref_codes.shape[0] - (len(spec.ref_ids) - 5))

    def _prompt(self, ids: list[int]) -> Prompt:
        spec = self._request.spec
        text = spec.input_ids[:3] + ids + spec.input_ids[-5:]
        return self._tts.prepare(Request(replace(spec, input_ids=text), self._request.params,
                                         self._request.num_positions))

    # ---- audio ------------------------------------------------------------------------------------------

    def _open(self, asyncio_loop: bool) -> RequestStream:
        guard = self._request.guard
        return self._tts.engine.submit(None, self._request.params, self._request.spec.ref_codes,
                                       asyncio_loop=asyncio_loop, live=self.feed,
                                       stop_on_repeats=guard.repeated_frames if guard else None)

    def _audio(self, asyncio_loop: bool) -> AudioStream:
        with self._lock:
            if self._stream is None:
                self._stream = AudioStream(lambda: self._open(asyncio_loop), self._schedule, self._pcm_format,
                                           self._tts.sample_rate, self._started, submit_now=not asyncio_loop)
                if self._cancelled:
                    self._stream.close()
            return self._stream

    @property
    def stream(self) -> AudioStream | None:
        """The audio stream, once reading started (its `frames.channel` has the request's timings and codes)."""
        return self._stream

    def __iter__(self) -> Iterator[AudioChunk]:
        if self._cancelled and self._stream is None:
            return iter(())
        return iter(self._audio(asyncio_loop=False))

    def __aiter__(self) -> AsyncIterator[AudioChunk]:
        return self._audio(asyncio_loop=True).__aiter__()
