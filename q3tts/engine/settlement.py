"""The engine's settlement (`Settlement`, a part of `Engine`): a frame's codes and flags read back are settled
(each request's frame counted, finished ones leaving with their finish reasons: `_settle`), its audio held for its
streams and handed out (`_audio`, `_hand_out`: engine/stream.py's `Delivery`), cancelled and dropped requests
leave, the running rows staying 0..B-1 (`_leave`, `_compact`), and a request's stream ends (`_end`)."""

from __future__ import annotations

import threading
import time

import numpy as np

from .rows import remove_rows
from .runner.readback import FrameOut
from .sequence import Sequence
from .stream import END, Frames


class Settlement:
    """Frames settled and handed out, requests leaving; mixed into `Engine`, which holds `rows`, `table`, `slots`,
    `delivery`, `runner`, `codec`, `scheduler`, `metrics`, the engine thread (`_thread`), the hand-out thread
    (`_dispatcher`) and the boundary's queues (`_flush`, `_cancelling`, `_dropped`, `_live`, `_parked`)."""

    def _settle(self, out: FrameOut, slots: np.ndarray, ends: list
                ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Takes frame n's codes and flags (`slots`: its rows' requests): each live request's frame is counted
        (and its run of identical frames); finished requests leave (their last audio went out with frame n - 1).
        Returns (the frame's codes, and the index in the frame and slot of each frame produced), which `_audio`
        hands out. Call with the lock."""
        emitted, done, codes = out.emitted.numpy(), out.done.numpy(), out.codes.numpy()
        t = self.slots
        live = t.live[slots]
        index = np.flatnonzero(live & emitted)
        produced = slots[index]
        t.record(produced, codes[index])
        self.metrics.frames += len(index)
        over = (t.frames[slots] >= t.stop_after[slots]) | (t.repeats[slots] >= t.stop_on_repeats[slots])
        ending = np.flatnonzero(live & (done | over))
        if len(ending):
            self._finish([(int(slots[i]), bool(done[i])) for i in ending.tolist()], ends)
        return codes, index, produced

    def _finish(self, finished: list[tuple[int, bool]], ends: list) -> None:
        """The requests in these (slot, done) leave with their finish reasons, in order. Call with the lock."""
        t, now, leaving = self.slots, time.perf_counter(), []
        for slot, done in finished:
            frames = int(t.frames[slot])
            reason = _finish_reason(done, frames, int(t.max_new[slot]), int(t.stop_after[slot]),
                                    int(t.repeats[slot]), int(t.stop_on_repeats[slot]))
            self.metrics.requests_finished += 1
            self.metrics.finish_reasons[reason] += 1
            self.metrics.notify("on_finish", frames * 0.08, now - t.channels[slot].submitted)
            leaving.append((t.seqs[slot], reason))
        self._leave(leaving, ends)

    def _audio(self, pcm: np.ndarray, codes: np.ndarray, index: np.ndarray, slots: np.ndarray) -> None:
        """Each produced frame (row index[i] of pcm [n, 1920] and codes [n, 16], for slots[i]) to its stream's held
        frames, as its codes only for a stream cancelled or failed meanwhile (`muted`); first audio noted."""
        if not len(index):
            return
        t = self.slots
        audio = ~t.muted[slots]
        self.delivery.add(pcm, codes, slots, index, audio)
        first = slots[audio & np.isnan(t.first_audio[slots])]
        if len(first):
            now = time.perf_counter()
            t.first_audio[first] = now
            for slot in first.tolist():
                channel = t.channels[slot]
                channel.first_audio = now - channel.submitted
                self.metrics.notify("on_first_audio", channel.first_audio)

    def _hand_out(self, produced: np.ndarray | None) -> Frames | None:
        """The frames that go out now (engine/stream.py `Delivery`): of the streams that got one, and all held by
        streams that end or were preempted (`_flush`) at this boundary."""
        delivery = self.delivery
        slots = produced if produced is not None else np.zeros(0, dtype=np.int64)
        go, held, counts = delivery.hand_out(slots, time.perf_counter(), self._flush)
        self._flush = []
        if not len(go):
            return None
        channels = self.slots.channels
        return Frames([channels[slot] for slot in go.tolist()], held, counts, tuple(delivery.ring))

    def _drop_abandoned(self) -> None:
        """Ends the requests whose streams were dropped unread or whose event loop closed. Call with the lock."""
        while self._dropped:
            self._cancel(self._dropped.popleft())

    def _leave_cancelled(self, ends: list) -> None:
        """The running requests cancelled since the last boundary leave, in their rows' order (a preempted one
        when it is back in a row). Call with the lock."""
        waiting = [seq for seq in dict.fromkeys(self._cancelling) if not seq.payload.channel.finished]
        running = sorted((seq for seq in waiting if seq.payload.swapped is None and seq.payload.parked is None),
                         key=self.rows.index) + [seq for seq in waiting if seq.payload.parked is not None]
        self._cancelling = [seq for seq in waiting if seq.payload.swapped is not None]
        if running:
            self.metrics.requests_cancelled += len(running)
            self._leave([(seq, "cancelled") for seq in running], ends)

    def _leave(self, leaving: list[tuple[Sequence, str]], ends: list) -> None:
        """Frees the rows of these (sequence, finish reason), in order, and ends their streams through `ends`. A
        request preempted at this boundary has no row: it leaves the swapped ones. Call with the lock."""
        self._compact([seq for seq, _ in leaving if seq.payload.swapped is None and seq.payload.parked is None])
        for seq, reason in leaving:
            if seq.payload.swapped is not None:
                self.scheduler.swapped.remove(seq)
            if seq.payload.parked is not None:
                self._parked.remove(seq)
                self.runner.kv.release_blocks(seq.payload.parked.blocks)
                seq.payload.parked = None
            self.scheduler.finish(seq.request_id)
            self._end(seq, reason, outbox=ends)

    def _compact(self, leaving: list[Sequence], released: bool = True) -> None:
        """Removes the rows of `leaving` (`rows.remove_rows`: as one after the other, the running rows staying
        0..B-1 and each request's row, so its batch neighbours, as before) with one batch of device copies
        (`released`: their KV blocks are freed here, else they were)."""
        if leaving:
            gone, moves = remove_rows(self.rows, leaving)
            self.runner.remove_rows(gone if released else [], moves)
            self.codec.move_rows(moves)
            self.table.move(moves)

    def _end(self, seq: Sequence, reason: str, error: BaseException | None = None, outbox: list | None = None
             ) -> None:
        """Ends the request's stream (through `outbox` if given; its held frames go out first there). Call with the
        lock."""
        channel, p = seq.payload.channel, seq.payload
        if channel.finished:
            return
        channel.finished, channel.finish_reason = True, reason
        p.swapped = None
        self._live.pop(seq.request_id, None)
        frames = None
        if p.slot is not None:
            seq.frames = int(self.slots.frames[p.slot])  # (what the slot counted, on the sequence from now on)
            first = self.slots.first_audio[p.slot]
            seq.first_audio = None if np.isnan(first) else float(first)
            self.slots.close(p.slot, muted=reason in ("cancelled", "error"))
            if outbox is not None:
                self._flush.append(p.slot)  # (what it holds goes out before its end)
            elif self.delivery.count[p.slot] and self._owns_delivery():  # (ended at once: what it holds, as codes)
                _, held, counts = self.delivery.take(p.slot)
                frames = Frames([channel], held, counts, tuple(self.delivery.ring))
            p.slot = None
        items = [(channel, error)] if error is not None else []
        items.append((channel, END))
        if outbox is None:
            self._dispatcher.put(frames, items)  # (after what the engine handed out before: in order)
        else:
            outbox.extend(items)

    def _owns_delivery(self) -> bool:
        """Whether this thread may touch the hand-out state (the engine thread's, outside the lock too): the engine
        thread, or any once it ended. (Another thread ending a request at once leaves what it holds: a preempted
        request's frames went out at its preemption.)"""
        return threading.current_thread() is self._thread or not self._thread.is_alive()


def _finish_reason(done: bool, frames: int, max_new: int, stop_after: int, repeats: int, stop_on_repeats: int
                   ) -> str | None:
    """Why a request ends after this frame, if it does (`frames` delivered so far, `repeats` identical frames in a
    row; the runaway guard's limits NEVER when unset)."""
    if done:
        return "length" if frames + 1 >= max_new else "eos"
    if frames >= stop_after:
        return "runaway"
    if repeats >= stop_on_repeats:
        return "repetition"
    return None
