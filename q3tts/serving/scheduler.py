"""Which waiting requests join the running batch at the next frame boundary. Pure Python (no torch, no CUDA),
unit-tested on its own.

Policy: first come, first served, bounded by free rows, a per-boundary prefill token budget, and a deadline
rule. A running stream that has started playing has a lead: the audio it has produced minus the time since
its first audio. Admitting requests stalls every running stream for their prefill (~tokens x seconds per
token); a boundary admits only as much prefill as the smallest lead can absorb, keeping a safety margin (a
stream's next frame comes about two frame steps after the stall), but always at least one request when no
running stream is at risk. Requests that cannot be admitted wait in a bounded queue; a full queue refuses new
ones (backpressure).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

FRAME_SECONDS = 0.08


class QueueFull(Exception):
    """The waiting queue is at its limit; the caller should retry later."""


@dataclass
class Sequence:
    """A request as the scheduler sees it."""

    request_id: str
    prompt_tokens: int
    arrival: float
    frames: int = 0  # frames delivered so far
    first_audio: float | None = None  # when the first frame was delivered
    cancelled: bool = False
    payload: object = field(default=None, repr=False)  # the engine's own request data

    def lead(self, now: float) -> float:
        """Seconds of audio produced ahead of real-time playback since the first audio (inf before it)."""
        if self.first_audio is None:
            return float("inf")
        return self.frames * FRAME_SECONDS - (now - self.first_audio)


class Scheduler:
    def __init__(self, max_running: int, max_waiting: int, max_prefill_tokens: int = 4096,
                 prefill_seconds_per_token: float = 1e-4, safety_seconds: float = 0.04):
        if max_running < 1 or max_waiting < 0 or max_prefill_tokens < 1:
            raise ValueError("max_running and max_prefill_tokens must be >= 1, max_waiting >= 0")
        self.max_running, self.max_waiting = max_running, max_waiting
        self.max_prefill_tokens = max_prefill_tokens
        self.prefill_seconds_per_token = prefill_seconds_per_token
        self.safety_seconds = safety_seconds
        self.waiting: deque[Sequence] = deque()
        self.running: dict[str, Sequence] = {}

    def add(self, seq: Sequence) -> None:
        if len(self.waiting) >= self.max_waiting:
            raise QueueFull(f"{len(self.waiting)} requests are already waiting")
        self.waiting.append(seq)

    def cancel(self, request_id: str) -> Sequence | None:
        """Drops a waiting request, or marks a running one for removal at the next boundary."""
        for seq in self.waiting:
            if seq.request_id == request_id:
                self.waiting.remove(seq)
                seq.cancelled = True
                return seq
        seq = self.running.get(request_id)
        if seq is not None:
            seq.cancelled = True
        return seq

    def finish(self, request_id: str) -> None:
        self.running.pop(request_id, None)

    def admit(self, now: float) -> list[Sequence]:
        """The waiting requests to prefill at this frame boundary (they become running)."""
        free = self.max_running - len(self.running)
        lead = min((s.lead(now) for s in self.running.values()), default=float("inf"))
        stall_budget = lead - self.safety_seconds
        if stall_budget <= 0:
            return []  # a running stream is about to fall behind: let it catch up first
        admitted, tokens = [], 0
        while self.waiting and len(admitted) < free:
            seq = self.waiting[0]
            new_tokens = tokens + seq.prompt_tokens
            over_budget = (new_tokens > self.max_prefill_tokens
                           or new_tokens * self.prefill_seconds_per_token > stall_budget)
            if admitted and over_budget:
                break
            self.waiting.popleft()
            admitted.append(seq)
            self.running[seq.request_id] = seq
            tokens = new_tokens
        return admitted

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)
