"""The engine's admission (`Admission`, a part of `Engine`): at each frame boundary every running row gets the KV
blocks of its next frame, the newest running request preempted (swapped out to host memory) while none are free
(`_grow`); preempted requests come back into the next free rows and the requests the scheduler admitted are
prefilled after them (`_join`), their codec state set up on the codec's stream (`_start_codec`)."""

from __future__ import annotations

import logging
import time

import numpy as np

from .kv_blocks import OutOfBlocks
from .sequence import Sequence

log = logging.getLogger("q3tts.engine")


class Admission:
    """Rows joining and preempted; mixed into `Engine`, which holds `rows`, `table`, `slots`, `delivery`, `runner`,
    `codec`, `scheduler`, `metrics` and the parked live rows (`_parked`)."""

    def _join(self, resumed: list[Sequence], admitted: list[Sequence]) -> None:
        """Brings preempted requests back into the next free rows, then prefills the admitted ones after them
        (the scheduler admitted only what the free KV blocks hold). Call with the lock."""
        kv = self.runner.kv
        for seq in resumed:
            row, p = len(self.rows), seq.payload
            self.runner.swap_in(row, p.swapped[0])
            self.runner.grow(row, min(seq.num_positions + 1, p.max_positions))
            self.rows.append(seq)
            self.table.set(row, seq.num_positions, p.max_positions, len(kv.rows[row]) * kv.block_size, p.slot)
        if admitted:
            start = len(self.rows)
            now = time.perf_counter()
            for seq in admitted:
                seq.payload.channel.admitted = now - seq.payload.channel.submitted
            self.runner.add_rows(list(range(start, start + len(admitted))), [s.payload.prompt for s in admitted],
                                 [s.payload.params for s in admitted])
            for row, seq in enumerate(admitted, start):
                self._open(row, seq)
            self.rows.extend(admitted)

    def _open(self, row: int, seq: Sequence) -> None:
        """The admitted request's slot, and its row's entry."""
        p, kv = seq.payload, self.runner.kv
        p.slot = self.slots.open(seq, p.channel, p.params.max_new_tokens, p.stop_after, p.stop_on_repeats,
                                 seq.realtime)
        self.delivery.ensure(self.slots.size)
        self.delivery.start(p.slot)
        self.table.set(row, seq.num_positions, p.max_positions, len(kv.rows[row]) * kv.block_size, p.slot)

    def _start_codec(self, start: int, resumed: list[Sequence], admitted: list[Sequence]) -> None:
        """Codec state of the rows that joined at `start..` (on the codec's stream: after the decode in flight,
        before their first)."""
        for row, seq in enumerate(resumed, start):
            self.codec.swap_in(row, seq.payload.swapped[1])
            seq.payload.swapped = None
        if admitted:
            first = start + len(resumed)
            tails = self.codec.start(list(range(first, first + len(admitted))),
                                     [s.payload.ref_codes for s in admitted])
            for seq, tail in zip(admitted, tails):
                seq.payload.channel.ref_tail = tail

    def _grow(self) -> None:
        """Gives every running row the KV blocks of its next frame, oldest request first; when none are free,
        the newest running request is preempted (swapped out) until they are. Call with the lock."""
        kv, table, B = self.runner.kv, self.table, len(self.rows)
        wanted = table.wanted(B)
        needy = np.flatnonzero(table.capacity[:B] < wanted)
        if not len(needy):
            return
        blocks = -(-wanted[needy] // kv.block_size)
        if int((blocks - table.capacity[needy] // kv.block_size).sum()) <= kv.num_free:  # (the usual case)
            self.runner.grow_rows(needy.tolist(), wanted[needy].tolist())
            table.capacity[needy] = blocks * kv.block_size
            return
        for seq in sorted((self.rows[row] for row in needy.tolist()), key=lambda s: s.order):
            while seq.request_id in self.scheduler.running:
                row = self.rows.index(seq)
                try:
                    self.runner.grow(row, int(table.wanted(row + 1)[row]))
                    table.capacity[row] = len(kv.rows[row]) * kv.block_size
                    break
                except OutOfBlocks:
                    self._swap_out(self.scheduler.preempt())

    def _swap_out(self, seq: Sequence) -> None:
        if seq.payload.parked is not None:  # (its text had not arrived: its blocks go to host memory too)
            parked, seq.payload.parked = seq.payload.parked, None
            self._parked.remove(seq)
            seq.payload.swapped = (self.runner.swap_out_parked(parked.state, parked.blocks), parked.codec)
            self.metrics.preemptions += 1
            return
        row = self.rows.index(seq)
        seq.num_positions = int(self.table.positions[row])  # (the scheduler weighs its return by it)
        seq.payload.swapped = (self.runner.swap_out(row), self.codec.swap_out(row))
        self._flush.append(seq.payload.slot)
        self._compact([seq], released=False)
        self.metrics.preemptions += 1
        log.info("preempted %s (KV cache full, %d rows running)", seq.request_id, len(self.rows))

    def _min_lead(self, now: float) -> float:
        """The scheduler's smallest lead over real time of the running streams (`Sequence.lead`), from the slots."""
        return self.slots.min_lead(self.table.slot[:len(self.rows)], now)
