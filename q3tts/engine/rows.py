"""The running requests' host state as arrays: what the engine's loop reads and writes at every frame boundary for
every row, kept in numpy so that a boundary costs a few vector operations instead of Python per row (the engine
thread's Python is what a GPU's frames wait for: docs/perf-notes.md, entries 103-107 and 109-113).

Two tables:
  * `RowTable`, by batch row (0..B-1 in the model runner's order, compacted as its rows are): the talker positions
    the row holds after the next frame, its request's limit, the positions its KV blocks hold, its request's slot;
  * `SlotTable`, by slot: one per request from its admission until it ends, while it runs and while it is swapped
    out, so that a preempted request keeps its counters and rows can move without moving them. A frame in flight
    names its rows' slots; a slot is reused only after the frame that followed its request's end was settled
    (`free` keeps it back one frame boundary).
"""

from __future__ import annotations

import numpy as np

from .sequence import FRAME_SECONDS

NEVER = np.iinfo(np.int64).max  # a limit that is not set


def remove_rows(rows: list, leaving: list) -> tuple[list[int], list[tuple[int, int]]]:
    """Removes `leaving` from `rows` (in place) one after the other, the last row moving into each hole, so the
    rows stay 0..B-1. Returns where each of `leaving` was (in order) and the rows that moved in all, (from, to):
    each from beyond the rows that remain into a hole, once (a row moved twice one by one moves once here), so
    that the device's copies of them can run together."""
    before = list(rows)
    for item in leaving:
        row, last = rows.index(item), len(rows) - 1
        if row != last:
            rows[row] = rows[last]
        rows.pop()
    n = len(rows)
    gone = [before.index(item) for item in leaving]
    origin = {id(item): i for i, item in enumerate(before[n:], n)}
    return gone, [(origin[id(rows[hole])], hole) for hole in sorted(r for r in gone if r < n)]


class RowTable:
    """Per batch row: positions (held after the next frame), max_positions (prompt + max_new_tokens), capacity (the
    positions its KV blocks hold), slot."""

    def __init__(self, max_rows: int):
        self.positions = np.zeros(max_rows, dtype=np.int64)
        self.max_positions = np.zeros(max_rows, dtype=np.int64)
        self.capacity = np.zeros(max_rows, dtype=np.int64)
        self.slot = np.zeros(max_rows, dtype=np.int64)
        self._columns = (self.positions, self.max_positions, self.capacity, self.slot)

    def set(self, row: int, positions: int, max_positions: int, capacity: int, slot: int) -> None:
        for column, value in zip(self._columns, (positions, max_positions, capacity, slot)):
            column[row] = value

    def move(self, moves: list[tuple[int, int]]) -> None:
        """Row src's values into row dst, for each (src, dst) (sources and destinations apart)."""
        if moves:
            src, dst = np.array(moves).T
            for column in self._columns:
                column[dst] = column[src]

    def wanted(self, num_rows: int) -> np.ndarray:
        """The positions each row must hold for its next frame."""
        return np.minimum(self.positions[:num_rows] + 1, self.max_positions[:num_rows])

    def advance(self, num_rows: int) -> None:
        """After a frame's launch: each row holds one more position (up to its request's limit)."""
        np.minimum(self.positions[:num_rows] + 1, self.max_positions[:num_rows], out=self.positions[:num_rows])


class SlotTable:
    """Per request (slot): frames delivered, identical frames in a row (`repeats`), its limits (max_new_tokens and
    the runaway guard's: NEVER when unset), whether its audio is played as it comes (`realtime`), its first audio
    (perf_counter seconds, NaN before), its last codes, whether it is still live (not ended) and whether its audio
    is wanted (`muted`: cancelled or failed). Grows on demand (swapped-out requests keep their slots)."""

    FIELDS = {"frames": np.int64, "repeats": np.int64, "max_new": np.int64, "stop_after": np.int64,
              "stop_on_repeats": np.int64, "first_audio": np.float64, "realtime": bool, "live": bool, "muted": bool}

    def __init__(self, size: int):
        self.size = 0
        self.last_codes = np.zeros((0, 16), dtype=np.int64)
        for name, dtype in self.FIELDS.items():
            setattr(self, name, np.zeros(0, dtype=dtype))
        # each slot's request (its Sequence) and stream (its Channel), kept after it ends until the slot is reused
        self.seqs: list = []
        self.channels: list = []
        self._free: list[int] = []
        self._freed: list[int] = []  # closed since the last boundary
        self._held_back: list[int] = []  # closed before the last boundary: reusable after the next one
        self._grow(size)

    def _grow(self, size: int) -> None:
        for name in (*self.FIELDS, "last_codes"):
            old = getattr(self, name)
            new = np.zeros((size, *old.shape[1:]), dtype=old.dtype)
            new[:self.size] = old
            setattr(self, name, new)
        self._free = list(range(size - 1, self.size - 1, -1)) + self._free  # (popped from the end: low first)
        self.seqs += [None] * (size - self.size)
        self.channels += [None] * (size - self.size)
        self.size = size

    def open(self, seq, channel, max_new: int, stop_after: int | None, stop_on_repeats: int | None,
             realtime: bool) -> int:
        """A slot for a newly admitted request `seq` and its stream."""
        if not self._free:
            self._grow(2 * self.size)
        slot = self._free.pop()
        self.seqs[slot], self.channels[slot] = seq, channel
        self.frames[slot] = self.repeats[slot] = 0
        self.max_new[slot] = max_new
        self.stop_after[slot] = NEVER if stop_after is None else stop_after
        self.stop_on_repeats[slot] = NEVER if stop_on_repeats is None else stop_on_repeats
        self.first_audio[slot] = np.nan
        self.realtime[slot], self.live[slot], self.muted[slot] = realtime, True, False
        return slot

    def close(self, slot: int, muted: bool) -> None:
        """The request ended: its frames in flight are dropped (and their audio too if `muted`)."""
        self.live[slot], self.muted[slot] = False, muted
        self._freed.append(slot)

    def boundary(self) -> None:
        """A frame boundary passed (every frame launched before the last one is settled): the slots closed before
        the previous boundary may be reused."""
        self._free.extend(self._held_back)
        self._held_back, self._freed = self._freed, []

    def record(self, slots: np.ndarray, codes: np.ndarray) -> None:
        """Each slot produced a frame with these codes [n, 16]: counts it and its run of identical frames."""
        same = (self.frames[slots] > 0) & (codes == self.last_codes[slots]).all(axis=1)
        self.repeats[slots] = np.where(same, self.repeats[slots] + 1, 1)
        self.last_codes[slots] = codes
        self.frames[slots] += 1

    def min_lead(self, slots: np.ndarray, now: float) -> float:
        """The smallest lead over real-time playback among `slots` (`Sequence.lead`, for many at once)."""
        first = self.first_audio[slots]
        lead = self.frames[slots] * FRAME_SECONDS - (now - first)
        lead[np.isnan(first) | ~self.realtime[slots]] = np.inf
        return float(lead.min(initial=np.inf))
