"""The engine's live rows (`LiveRows`, a part of `Engine`): a live request's text (engine/live.py) as the frame loop
takes it at each boundary. A live request becomes admissible once its prompt is built; a running row gets the text
that arrived (`_write_text`); a row whose next text token has not arrived leaves the batch, parked with its KV
blocks (`_park`), and comes back at the boundary after it arrives (`_unpark`); a request that waits too long for its
text ends (`_time_out`)."""

from __future__ import annotations

import time

from .live import TEXT_TIMEOUT, LiveTextTimeout, ParkedRow
from .sequence import Sequence


class LiveRows:
    """Live text at the frame boundaries; mixed into `Engine`, which holds `rows`, `table`, `slots`, `runner`,
    `codec`, `scheduler`, `config`, `metrics`, the lock `_cv` and the live requests (`_live`, `_parked`, `_fed`)."""

    def _wake(self) -> None:
        """A live request's text changed (called from the caller's thread)."""
        with self._cv:
            self._fed = True
            self._cv.notify()

    @property
    def num_parked(self) -> int:
        """Live rows waiting for their next text, off the batch (their KV blocks kept)."""
        return len(self._parked)

    @property
    def num_live(self) -> int:
        """Live requests whose text has not ended (parked or not)."""
        return len(self._live)

    def _serve_live(self, ends: list) -> None:
        """Before a frame's launch: live requests whose prompt was built become admissible; those that waited too
        long for text end; parked rows whose next text arrived come back; running rows get the text that arrived,
        and those whose next text has not arrived are parked. Call with the lock."""
        self._fed, now = False, time.perf_counter()
        for seq in list(self._live.values()):
            p = seq.payload
            if not seq.ready and p.live.prompt is not None:
                self._ready(seq, p.live.prompt)
            if (not seq.ready or p.parked is not None) and p.live.expired(now):
                self._time_out(seq, ends)
        for seq in [seq for seq in self._parked if self._has_text(seq, seq.payload.parked.frame)]:
            self._unpark(seq)
        waiting = []
        for row, seq in enumerate(self.rows):
            if seq.payload.live is not None:
                self._write_text(row, seq)
                if not self._has_text(seq, int(self.table.positions[row]) - seq.payload.prompt.num_positions):
                    waiting.append(seq)
        if waiting:
            self._park(waiting)

    @staticmethod
    def _has_text(seq: Sequence, frame: int) -> bool:
        """Whether the live request's text for `frame` arrived (frame n adds trailing text id n, TTS_PAD after)."""
        feed = seq.payload.live
        return feed.ended or frame < len(feed.ids)

    def _write_text(self, row: int, seq: Sequence) -> None:
        """The row's trailing text that arrived since the last boundary, to the device; at the end TTS_EOS (unless
        the prompt holds it: `LiveFeed.whole`), and the runaway guard's limit for the whole text."""
        p = seq.payload
        if p.text_done:
            return
        feed = p.live
        ended, count = feed.ended, len(feed.ids)  # (ended first: once it is set, every id is in)
        ids = feed.ids[p.written:count] + ([self.runner.model.config.tts_eos_token_id]
                                           if ended and not feed.whole else [])
        if p.written + len(ids) > self.config.max_trailing:
            raise RuntimeError("a live request's text outgrew max_trailing (q3tts.api.live bounds it)")
        if ids:
            self.runner.set_trailing(row, p.written, ids)
            p.written += len(ids)
        if ended:
            p.text_done = True
            if feed.stop_after is not None:
                self.slots.stop_after[p.slot] = feed.stop_after

    def _park(self, seqs: list[Sequence]) -> None:
        """Takes these live rows off the batch until their text arrives (their held frames go out now)."""
        for seq in seqs:
            row, p = self.rows.index(seq), seq.payload
            seq.num_positions = int(self.table.positions[row])
            state, blocks = self.runner.park(row)
            p.parked = ParkedRow(state, blocks, self.codec.swap_out(row), seq.num_positions - p.prompt.num_positions)
            self._flush.append(p.slot)
            self._compact([seq], released=False)
            self._parked.append(seq)

    def _unpark(self, seq: Sequence) -> None:
        """A parked row back into the next free row, as it was; its new text written."""
        row, p, kv = len(self.rows), seq.payload, self.runner.kv
        parked, p.parked = p.parked, None
        self._parked.remove(seq)
        self.runner.unpark(row, parked.state, parked.blocks)
        self.codec.swap_in(row, parked.codec)
        self.rows.append(seq)
        self.table.set(row, seq.num_positions, p.max_positions, len(kv.rows[row]) * kv.block_size, p.slot)

    def _time_out(self, seq: Sequence, ends: list) -> None:
        """A live request that waited longer than its limit for text ends, its stream with LiveTextTimeout."""
        p = seq.payload
        error = LiveTextTimeout(f"no text arrived for {p.live.max_wait_s:g} s (the live request's max_text_wait_s)")
        self.metrics.finish_reasons[TEXT_TIMEOUT] += 1
        if p.parked is None:  # (waiting for its first text: not admitted)
            self.scheduler.cancel(seq.request_id)
            self._end(seq, TEXT_TIMEOUT, error)
            return
        self._leave([(seq, TEXT_TIMEOUT)], ends)
        ends.insert(len(ends) - 1, (p.channel, error))

    def _next_text_deadline(self) -> float | None:
        """Seconds until the first live request waiting for text (not admitted yet, or parked) waits too long."""
        now = time.perf_counter()
        waits = [seq.payload.live.arrived + seq.payload.live.max_wait_s - now for seq in self._live.values()
                 if not seq.ready or seq.payload.parked is not None]
        return max(min(waits), 0.0) + 1e-3 if waits else None
