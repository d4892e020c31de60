"""What the engine is given per request (`Prompt`) and how the scheduler sees a request (`Sequence`)."""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch

FRAME_SECONDS = 0.08  # one codec frame: 1920 samples at 24 kHz


@dataclass(eq=False)
class Prompt:
    """A request's talker input, built by `q3tts.request.prompt.build_prompt`. Its embeddings are kept as the pieces
    they were built from (a voice's head is one tensor shared by all its prompts); `embeds` and `trailing` join them on
    first use, and the engine joins a whole batch's pieces at once (`embeds_from`)."""

    parts: tuple[torch.Tensor, ...]  # [L_i, H] each: the prefill input, in order
    trailing_parts: tuple[torch.Tensor, ...]  # [N_i, H]: added at decode step s < N (TTS_PAD after)
    pad: torch.Tensor  # [H] TTS_PAD
    trailing_ids: list[int]  # text ids whose projections are `trailing` (the engine projects them per step)
    prefix_len: int = 0  # the first positions, which depend on the voice alone (engine/runner/prefix_cache.py)
    prefix_key: str | None = None  # a digest of what they depend on

    def __post_init__(self):
        self.num_positions = sum(part.shape[0] for part in self.parts)

    @functools.cached_property
    def embeds(self) -> torch.Tensor:
        """[L, H] prefill input."""
        return torch.cat(self.parts) if len(self.parts) > 1 else self.parts[0]

    @functools.cached_property
    def trailing(self) -> torch.Tensor:
        """[N, H]"""
        return torch.cat(self.trailing_parts) if len(self.trailing_parts) > 1 else self.trailing_parts[0]

    def embeds_from(self, start: int) -> list[torch.Tensor]:
        """The pieces of embeds[start:], without joining them."""
        out, offset = [], 0
        for part in self.parts:
            n = part.shape[0]
            if offset + n > start:
                out.append(part[start - offset:] if start > offset else part)
            offset += n
        return out


@dataclass(eq=False)
class Sequence:
    """A request as the scheduler sees it. `num_positions` counts the talker positions it holds or will hold
    after the next frame (prompt + frames launched), `frames` the frames delivered, `first_audio` when the first
    was. While the request holds a row the engine keeps these three in its arrays (engine/rows.py) and writes them
    here when it gives the row up (preempted: `num_positions`; ended: all). Compared by identity (the engine looks
    rows up with `in` and `index`: field-by-field equality cost ~1 us per row compared)."""

    request_id: str
    num_positions: int  # the prompt's length until the first frame is launched
    arrival: float
    frames: int = 0  # frames delivered so far
    first_audio: float | None = None  # when the first frame was delivered
    cancelled: bool = False
    order: int = 0  # admission order (preemption takes the newest first)
    ready: bool = True  # its prompt is known (a live request's once its first text arrived: engine/live.py)
    realtime: bool = True  # its audio is played as it comes (False: read whole, e.g. `synthesize`: no lead to keep)
    payload: object = field(default=None, repr=False)  # the engine's own request data

    def lead(self, now: float) -> float:
        """Seconds of audio produced ahead of real-time playback since the first audio (inf before it, and for a
        request whose audio is not played as it comes)."""
        if self.first_audio is None or not self.realtime:
            return float("inf")
        return self.frames * FRAME_SECONDS - (now - self.first_audio)
