"""A live request's text as the engine takes it: text tokens that arrive while the request runs.

In streaming-text mode (spec section 4.1) the prompt holds the first text token and every frame adds the next one
(`Prompt.trailing_ids`), then TTS_EOS, then TTS_PAD. A live request's prompt is built once its first tokens are
final (`q3tts.api.live`); its trailing tokens come after, as the text does. Before launching a frame, the engine
gives each live row the tokens that arrived (`LiveFeed.ids`); a row whose next token has not arrived is parked:
it leaves the batch (no frame, no codec step: its state and codec state are set aside on the device, its KV blocks
stay its own) and comes back at the boundary after the token arrives. Its codes are thus the whole text's, as the
codes of a preempted request are its own: a row's frame depends on its own state only.

The caller's thread writes a feed (`start`, `extend`, `end`), the engine's reads it at frame boundaries; the
order of the writes (ids before `ended`) is what makes that safe without a lock.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from .prompt import Prompt

TEXT_TIMEOUT = "text_timeout"  # the finish reason of a request that waited too long for its text


class LiveTextTimeout(RuntimeError):
    """A live request waited longer than its limit for its next text; it ended (finish reason "text_timeout")."""


class LiveFeed:
    """One live request's text tokens: its prompt (once built), the trailing text ids after it (TTS_EOS not
    included), whether the text ended; `max_wait_s`: how long a row may wait for text before it ends."""

    def __init__(self, max_wait_s: float):
        self.max_wait_s = max_wait_s
        self.prompt: Prompt | None = None
        self.ids: list[int] = []
        self.ended = False
        self.whole = False  # the prompt holds the whole text and TTS_EOS (see `start`)
        self.stop_after: int | None = None  # the runaway guard's frame limit, known at the end of the text
        self.arrived = time.perf_counter()  # when text last arrived (or the request was made)
        self.wake: Callable[[], None] = lambda: None  # set by the engine: a feed's change wakes its loop

    def start(self, prompt: Prompt, ids: list[int], whole: bool = False) -> None:
        """The prompt is built (its trailing_ids empty); `ids`: the trailing text known so far. `whole`: the text
        ended within the prompt (an in-context voice's short text, TTS_EOS in its prompt): `ids` are all of it."""
        self.ids.extend(ids)
        self.whole = whole
        self.prompt = prompt
        self._arrive()

    def extend(self, ids: list[int]) -> None:
        if ids:
            self.ids.extend(ids)
            self._arrive()

    def end(self, stop_after: int | None = None) -> None:
        """No more text (`stop_after`: the runaway guard's frame limit for the whole text, if any)."""
        self.stop_after = stop_after
        self.ended = True
        self._arrive()

    def _arrive(self) -> None:
        self.arrived = time.perf_counter()
        self.wake()

    def expired(self, now: float) -> bool:
        return not self.ended and now - self.arrived > self.max_wait_s


@dataclass
class ParkedRow:
    """A live row waiting for text, off the batch: its row state (cloned on the device), its KV blocks (still its
    own), its codec state, and the frame it runs next."""

    state: list[torch.Tensor]
    blocks: list[int]
    codec: list[torch.Tensor]
    frame: int
