"""How the scheduler sees a request (`Sequence`); pure Python, no torch (the request's tensors: `prompt.py`)."""

from __future__ import annotations

from dataclasses import dataclass, field

FRAME_SECONDS = 0.08  # one codec frame: 1920 samples at 24 kHz


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
