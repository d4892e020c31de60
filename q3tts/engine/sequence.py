"""What the engine is given per request (`Prompt`) and how the scheduler sees a request (`Sequence`)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

FRAME_SECONDS = 0.08  # one codec frame: 1920 samples at 24 kHz


@dataclass
class Prompt:
    """A request's talker input, built by `q3tts.prompt.build_prompt`."""

    embeds: torch.Tensor  # [L, H] prefill input
    trailing: torch.Tensor  # [N, H] added to the frame embedding at decode step s < N, TTS_PAD after that
    pad: torch.Tensor  # [H] TTS_PAD
    trailing_ids: list[int]  # text ids whose projections are `trailing` (the engine projects them per step)
    prefix_len: int = 0  # the first positions, which depend on the voice alone (engine/prefix_cache.py)
    prefix_key: str | None = None  # a digest of what they depend on

    @property
    def num_positions(self) -> int:
        return self.embeds.shape[0]


@dataclass
class Sequence:
    """A request as the scheduler sees it. `num_positions` counts the talker positions it holds or will hold
    after the next frame (prompt + frames launched); the engine advances it."""

    request_id: str
    num_positions: int  # the prompt's length until the first frame is launched
    arrival: float
    frames: int = 0  # frames delivered so far
    first_audio: float | None = None  # when the first frame was delivered
    cancelled: bool = False
    order: int = 0  # admission order (preemption takes the newest first)
    payload: object = field(default=None, repr=False)  # the engine's own request data

    def lead(self, now: float) -> float:
        """Seconds of audio produced ahead of real-time playback since the first audio (inf before it)."""
        if self.first_audio is None:
            return float("inf")
        return self.frames * FRAME_SECONDS - (now - self.first_audio)
