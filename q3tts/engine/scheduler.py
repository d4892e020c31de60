"""Which requests run at the next frame boundary. Pure Python (no torch, no CUDA), unit-tested on its own.

Policy: first come, first served, bounded by free rows, free KV blocks, a per-boundary prefill token budget and
a deadline rule. A running stream that has started playing has a lead: the audio it has produced minus the time
since its first audio. Admitting requests stalls every running stream for their prefill (~tokens x seconds per
token); a boundary admits only as much prefill as the smallest lead can absorb, keeping a safety margin (a
stream's next frame comes about two frame steps after the stall), but always at least one request when no
running stream is at risk. Holding requests back lets a stream at risk catch up only while frames come faster
than they play: when the last frame took longer than its 80 ms (a slow or overloaded device), one request joins
per boundary regardless, or continuous batching would turn into static batching (every newcomer waiting for the
whole batch to end). Requests read whole (`synthesize`, `q3tts batch`) have no lead to keep.

KV blocks: a request is admitted only if its prompt (and first frame) fit the free blocks with a small reserve
left for the running rows' growth. When a running row needs a block and none is free, the engine preempts the
newest running request (`preempt`): its state goes to host memory and it waits in `swapped`, ahead of every
new request, until enough blocks are free to bring it back where it stopped.

Requests that cannot be admitted wait in a bounded queue; a full queue refuses new ones (backpressure).
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Callable

from .kv_blocks import KVBlocks
from .sequence import FRAME_SECONDS, Sequence


class QueueFull(Exception):
    """The waiting queue is at its limit; the caller should retry later."""


class Scheduler:
    def __init__(self, max_running: int, max_waiting: int, kv: KVBlocks, max_prefill_tokens: int = 4096,
                 prefill_seconds_per_token: float = 1e-4, safety_seconds: float = 0.04,
                 prefill_tokens: Callable[[Sequence], int] = lambda seq: seq.num_positions,
                 min_lead: Callable[[float], float] | None = None):
        """prefill_tokens: the positions a waiting request's prefill will compute (fewer than its prompt when
        part of it is cached). min_lead(now): the smallest `Sequence.lead` of the running requests, for a caller
        that keeps their frames and first audio itself (the engine: in arrays, engine/rows.py); by default the
        running sequences' own."""
        if max_running < 1 or max_waiting < 0 or max_prefill_tokens < 1:
            raise ValueError("max_running and max_prefill_tokens must be >= 1, max_waiting >= 0")
        self.max_running, self.max_waiting, self.kv = max_running, max_waiting, kv
        self.max_prefill_tokens = max_prefill_tokens
        self.prefill_seconds_per_token = prefill_seconds_per_token
        self.safety_seconds = safety_seconds
        self.prefill_tokens = prefill_tokens
        self.min_lead = min_lead or self._min_lead
        self.waiting: deque[Sequence] = deque()
        self.swapped: list[Sequence] = []  # preempted, oldest admission first
        self.running: dict[str, Sequence] = {}
        self._order = itertools.count()

    def add(self, seq: Sequence) -> None:
        if len(self.waiting) >= self.max_waiting:
            raise QueueFull(f"{len(self.waiting)} requests are already waiting")
        self.waiting.append(seq)

    def cancel(self, request_id: str) -> Sequence | None:
        """Drops a waiting or swapped request (returned; the engine ends it), or marks a running one for removal
        at the next boundary."""
        for queue in (self.waiting, self.swapped):
            for seq in queue:
                if seq.request_id == request_id:
                    queue.remove(seq)
                    seq.cancelled = True
                    return seq
        seq = self.running.get(request_id)
        if seq is not None:
            seq.cancelled = True
        return seq

    def finish(self, request_id: str) -> None:
        self.running.pop(request_id, None)

    def preempt(self) -> Sequence:
        """Moves the newest running request to `swapped` (the engine swaps its row out) and returns it."""
        seq = max(self.running.values(), key=lambda s: s.order)
        del self.running[seq.request_id]
        self.swapped.append(seq)
        self.swapped.sort(key=lambda s: s.order)
        return seq

    def admit(self, now: float, frame_seconds: float = 0.0) -> tuple[list[Sequence], list[Sequence]]:
        """(swapped requests to bring back, waiting requests to prefill) at this frame boundary; both become
        running. New requests wait while any preempted one does. frame_seconds: how long the last frame took."""
        free_rows = self.max_running - len(self.running)
        free_blocks = self.kv.num_free
        resumed = []
        while self.swapped and len(resumed) < free_rows:
            need = self.kv.blocks_for(self.swapped[0].num_positions + 1) + self._reserve(len(resumed))
            if need > free_blocks:
                break
            free_blocks -= need - self._reserve(len(resumed))
            resumed.append(self._run(self.swapped.pop(0), keep_order=True))
        if self.swapped:
            return resumed, []
        return resumed, self._admit_waiting(now, free_rows - len(resumed), free_blocks, frame_seconds)

    def _admit_waiting(self, now: float, free_rows: int, free_blocks: int, frame_seconds: float) -> list[Sequence]:
        stall_budget = self.min_lead(now) - self.safety_seconds
        if stall_budget <= 0 and frame_seconds < FRAME_SECONDS:
            return []  # a running stream is about to fall behind: let it catch up first
        admitted, tokens = [], 0
        for seq in [seq for seq in self.waiting if seq.ready] if free_rows > 0 else ():  # (live ones wait for text)
            if len(admitted) >= free_rows:
                break
            blocks = self.kv.blocks_for(seq.num_positions + 1)
            if blocks + self._reserve(len(admitted)) > free_blocks:
                break
            new_tokens = tokens + self.prefill_tokens(seq)
            over_budget = (new_tokens > self.max_prefill_tokens
                           or new_tokens * self.prefill_seconds_per_token > stall_budget)
            if admitted and over_budget:
                break
            self.waiting.remove(seq)
            admitted.append(self._run(seq))
            tokens, free_blocks = new_tokens, free_blocks - blocks
        return admitted

    def _min_lead(self, now: float) -> float:
        return min((s.lead(now) for s in self.running.values()), default=float("inf"))

    def _reserve(self, num_joining: int) -> int:
        """Blocks kept free for the running rows' growth (each takes one every 64 frames)."""
        return 1 + (len(self.running) + num_joining) // 8

    def _run(self, seq: Sequence, keep_order: bool = False) -> Sequence:
        if not keep_order:
            seq.order = next(self._order)
        self.running[seq.request_id] = seq
        return seq

    def has_work(self) -> bool:
        """Whether a request could be admitted or brought back (a live request waits for its first text before)."""
        return bool(self.swapped) or any(seq.ready for seq in self.waiting)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting) + len(self.swapped)

    @property
    def num_running(self) -> int:
        return len(self.running)
