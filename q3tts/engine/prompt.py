"""What the engine is given per request: its talker input (`Prompt`), which `q3tts.request.prompt` builds.

Apart from `sequence.py`, which the scheduler reads and which loads no torch."""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch


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
