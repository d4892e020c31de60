"""Frame results to the host without stalling the GPU: pinned buffers and events, read one frame behind."""

from __future__ import annotations

from contextlib import nullcontext
from typing import NamedTuple

import torch

from .model_runner import ModelRunner


class FrameOut(NamedTuple):
    codes: torch.Tensor  # [n, 16]
    emitted: torch.Tensor  # [n] bool: this step produced a frame for the row
    done: torch.Tensor  # [n] bool
    pcm: torch.Tensor | None  # [n, samples per frame] when a codec runner decodes alongside


class Readback:
    """Frame results copied to the host without stalling the GPU: a ring of pinned buffers, one event each.

    `push(n)` (right after the step) queues the copy of rows 0..n-1; `pop()` returns the oldest queued frame
    once its copy has landed. The host therefore runs one or more frames behind the device. `pop(wait_pcm=False)`
    returns the frame's codes and flags as soon as the language model's part has landed and keeps its PCM for
    `pop_pcm()`: the codec's decode of that frame then overlaps whatever is launched in between.

    The PCM lands in a buffer of its own per frame (pinned, from torch's caching host allocator, on a GPU), which
    `pop_pcm` returns as it is (a ring slot would have to be copied on the host first: at 256 rows 2 MB a frame,
    ~0.3 ms of the engine thread's time). Its rows are held for their streams (`stream.Delivery`: at most about
    `EngineConfig.stream_hold_s` of frames) until the engine's hand-out thread copies them out for their readers
    (`stream.Dispatcher`), so a buffer lives ~1 s at most, whatever its readers do.
    """

    def __init__(self, runner: ModelRunner, depth: int = 4, pcm: torch.Tensor | None = None,
                 pcm_stream: torch.cuda.Stream | None = None):
        """pcm: the codec runner's output to copy too, from `pcm_stream` if it decodes on its own stream."""
        rows, pinned = runner.config.max_rows, runner.device.type == "cuda"
        self.state, self.depth, self.cuda, self.source_pcm = runner.state, depth, pinned, pcm
        self.pcm_stream = pcm_stream
        self.codes = torch.zeros(depth, rows, 16, dtype=torch.int64, pin_memory=pinned)
        self.emitted = torch.zeros(depth, rows, dtype=torch.bool, pin_memory=pinned)
        self.done = torch.zeros(depth, rows, dtype=torch.bool, pin_memory=pinned)
        self.events = [torch.cuda.Event() if pinned else None for _ in range(depth)]
        self.pcm_events = [torch.cuda.Event() if pinned else None for _ in range(depth)]
        self.pending: list[tuple[int, int, torch.Tensor | None]] = []  # (slot, rows, the PCM's buffer)
        self.pcm_pending: list[tuple[int, torch.Tensor]] = []  # popped without their PCM: (slot, its buffer)
        self.next = 0

    def push(self, num_rows: int) -> None:
        if len(self.pending) + len(self.pcm_pending) == self.depth:
            raise RuntimeError("readback ring is full: pop() before pushing more frames")
        slot, s = self.next, self.state
        self.codes[slot, :num_rows].copy_(s.codes[:num_rows], non_blocking=True)
        self.emitted[slot, :num_rows].copy_(s.emitted[:num_rows], non_blocking=True)
        self.done[slot, :num_rows].copy_(s.done[:num_rows], non_blocking=True)
        if self.cuda:
            self.events[slot].record()
        pcm = None
        if self.source_pcm is not None:
            with torch.cuda.stream(self.pcm_stream) if self.pcm_stream is not None else nullcontext():
                pcm = torch.empty(num_rows, self.source_pcm.shape[1], pin_memory=self.cuda)
                pcm.copy_(self.source_pcm[:num_rows], non_blocking=True)  # (the allocator keeps it until done)
                if self.cuda:
                    self.pcm_events[slot].record()
        self.pending.append((slot, num_rows, pcm))
        self.next = (slot + 1) % self.depth

    def pop(self, wait_pcm: bool = True) -> FrameOut:
        """The oldest pushed frame; waits only for that frame's copy (without its PCM if `wait_pcm` is False). Its
        codes are a copy, its flags views of the ring (read them before `depth` more frames are pushed)."""
        slot, n, pcm = self.pending.pop(0)
        if self.cuda:
            self.events[slot].synchronize()
        # (the codes copied, for keeping; the flags as views: valid until `depth` more frames are pushed)
        out = FrameOut(self.codes[slot, :n].clone(), self.emitted[slot, :n], self.done[slot, :n], None)
        if pcm is None:
            return out
        self.pcm_pending.append((slot, pcm))
        return out if not wait_pcm else out._replace(pcm=self.pop_pcm())

    def pop_pcm(self) -> torch.Tensor:
        """The PCM of the oldest frame popped without it: [n, samples per frame]."""
        slot, pcm = self.pcm_pending.pop(0)
        if self.cuda:
            self.pcm_events[slot].synchronize()
        return pcm
