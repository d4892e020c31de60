"""The engine loop's host state as arrays (engine/rows.py, stream.Delivery) against the per-row rules they replace:
compaction one row at a time, `Sequence.lead`, the runaway guard's run of identical frames, `deliver`. No model:
random schedules, ~1 s in all."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from q3tts.engine.rows import NEVER, RowTable, SlotTable, remove_rows
from q3tts.engine.sequence import Sequence
from q3tts.engine.stream import END, Channel, Delivery, Frames, deliver
from q3tts.transfer import pack_bytes, unpack_bytes


def one_by_one(rows: list, leaving: list, state: list) -> None:
    """The engine's compaction before: each leaving row's hole takes the last row (its state copied)."""
    for item in leaving:
        row, last = rows.index(item), len(rows) - 1
        if row != last:
            rows[row], state[row] = rows[last], state[last]
        rows.pop()


@pytest.mark.parametrize("seed", range(40))
def test_rows_leave_together_as_one_by_one(seed):
    rng = random.Random(seed)
    before = [f"r{i}" for i in range(rng.randint(1, 24))]
    leaving = rng.sample(before, rng.randint(1, len(before)))
    want, state = list(before), list(before)
    one_by_one(want, leaving, state)
    got = list(before)
    gone, moves = remove_rows(got, leaving)
    assert got == want and gone == [before.index(x) for x in leaving]
    device = list(before)  # each row's state, moved as the device's copies move it
    for src, dst in moves:
        assert src >= len(got) > dst and device[dst] in leaving
        device[dst] = device[src]
    assert device[:len(got)] == state[:len(got)] == got
    assert len({src for src, _ in moves}) == len(moves)


def test_row_table_moves_and_advances():
    t = RowTable(8)
    for row in range(4):
        t.set(row, positions=10 + row, max_positions=12, capacity=16, slot=row + 5)
    t.advance(4)
    assert t.positions[:4].tolist() == [11, 12, 12, 12] and t.wanted(4).tolist() == [12] * 4
    t.move([(3, 0)])
    assert t.slot[0] == 8 and t.positions[0] == 12


def test_a_slot_is_reused_only_after_the_next_boundary():
    t = SlotTable(2)
    a, b = (t.open(object(), None, 10, None, None, True) for _ in range(2))
    t.close(a, muted=False)
    c = t.open(object(), None, 10, 5, 3, False)  # none free: the table grows
    assert t.size == 4 and c not in (a, b) and t.stop_after[c] == 5 and t.stop_on_repeats[c] == 3
    t.boundary()
    assert a not in [t.open(object(), None, 1, None, None, True)]  # (the frame after its end may still name it)
    t.boundary()
    assert t.open(object(), None, 1, None, None, True) == a
    assert t.stop_after[a] == NEVER and t.live[[a, b, c]].all()


def test_min_lead_is_the_sequences_smallest_lead():
    rng = random.Random(0)
    t, seqs, slots = SlotTable(16), [], []
    for i in range(12):
        seq = Sequence(f"r{i}", 10, 0.0, realtime=rng.random() < 0.8)
        slot = t.open(seq, None, 100, None, None, seq.realtime)
        if rng.random() < 0.7:
            seq.first_audio = t.first_audio[slot] = rng.uniform(0, 5)
            seq.frames = t.frames[slot] = rng.randint(1, 90)
        seqs.append(seq)
        slots.append(slot)
    for now in (5.0, 7.5, 20.0):
        assert t.min_lead(np.array(slots), now) == min(s.lead(now) for s in seqs)
    assert t.min_lead(np.zeros(0, dtype=np.int64), 1.0) == float("inf")


def test_record_counts_runs_of_identical_frames():
    """As the engine counted per row: a frame equal to the stream's last one extends its run, else starts one."""
    t = SlotTable(4)
    slots = np.array([t.open(object(), None, 100, None, None, True) for _ in range(3)])
    rng = np.random.default_rng(0)
    last, runs = [None] * 3, [0] * 3
    for _ in range(30):
        codes = rng.integers(0, 2, (3, 16)) * (rng.random((3, 1)) < 0.5)  # often all zeros: runs
        for i in range(3):
            same = last[i] is not None and np.array_equal(last[i], codes[i])
            runs[i], last[i] = runs[i] + 1 if same else 1, codes[i]
        t.record(slots, codes)
        assert t.repeats[slots].tolist() == runs
    assert t.frames[slots].tolist() == [30] * 3


def schedule(seed: int) -> list[tuple[float, list[int], list[int], list[int]]]:
    """(time, streams producing a frame, streams ending, streams preempted) per boundary: 6 streams made at
    ~10x real time, some ending and some preempted for a while."""
    rng, out, alive, away = random.Random(seed), [], set(range(6)), {}
    for k in range(300):
        now = k * 0.008 + rng.uniform(0, 0.004)
        preempted = [s for s in sorted(alive - set(away)) if rng.random() < 0.01]
        away.update({s: k + rng.randint(1, 40) for s in preempted})
        away = {s: until for s, until in away.items() if until > k}
        producing = sorted(alive - set(away))
        ending = [s for s in producing if rng.random() < 0.005] if k < 299 else sorted(alive)
        alive -= set(ending)
        out.append((now, producing, ending, preempted))
    return out


@pytest.mark.parametrize("seed,hold_s", [(0, 1.0), (1, 1.0), (2, 0.3), (3, 0.0)])
def test_delivery_hands_out_as_deliver(seed, hold_s):
    """Every stream gets the same hand-outs at the same boundaries from `Delivery` (arrays, frames named by
    boundary and row, read out by `Frames.read`) as from `deliver` (the rule per channel)."""
    events = schedule(seed)
    ref = [Channel(f"r{s}", None) for s in range(6)]
    got = [Channel(f"r{s}", None) for s in range(6)]
    delivery, want_log, got_log = Delivery(hold_s, 6), [], []
    for s in range(6):
        delivery.start(s)
    for k, (now, producing, ending, preempted) in enumerate(events):
        pcm = np.array([[k * 10 + s] * 1920 for s in range(6)], dtype=np.float32)  # frame k of stream s: 10k + s
        codes = pcm[:, :16].astype(np.int64)
        rows = np.array(producing, dtype=np.int64)  # (row r of this boundary: stream r)
        items = [(ref[s], pcm[s]) for s in producing] + [(ref[s], END) for s in ending]
        want_log += [(k, ch.request_id, [int(f[0]) for f in item]) for ch, item in
                     deliver(items, now, hold_s, [ref[s] for s in preempted]) if item is not END]
        delivery.add(pcm, codes, rows, rows, np.ones(len(rows), dtype=bool))
        go, held, counts = delivery.hand_out(rows, now, ending + preempted)
        frames = Frames([got[s] for s in go.tolist()], held, counts, tuple(delivery.ring))
        got_log += [(k, ch.request_id, [int(x) for x in chunk[::1920]]) for ch, chunk in frames.read()]
    assert sorted(got_log) == sorted(want_log) and len(want_log) > 50
    for s in range(6):  # every frame's codes, in order, once
        assert [int(c[0]) for c in got[s].codes] == [f for _, r, fs in sorted(want_log) if r == f"r{s}" for f in fs]


def test_muted_frames_keep_their_codes_only():
    delivery, channel = Delivery(1.0, 2), Channel("r", None)
    delivery.start(1)
    pcm, codes = np.ones((3, 1920), dtype=np.float32), np.arange(48).reshape(3, 16)
    delivery.add(pcm, codes, np.array([1]), np.array([2]), np.array([True]))
    delivery.add(pcm * 2, codes + 100, np.array([1]), np.array([0]), np.array([False]))  # cancelled meanwhile
    go, held, counts = delivery.hand_out(np.array([1]), 0.0, [1])
    chunks = Frames([channel], held, counts, tuple(delivery.ring)).read()
    assert len(chunks) == 1 and chunks[0][1].tolist() == [1.0] * 1920
    assert [c[0] for c in channel.codes] == [32, 100]


def test_bytes_pack_and_unpack_aligned():
    tensors = [torch.tensor([True, False]), torch.arange(3, dtype=torch.int32), torch.zeros(2, 0, dtype=torch.int32),
               torch.tensor([1.5, -2.0]), torch.tensor([[2**40, -7]])]
    flat, layout = pack_bytes(tensors)
    assert flat.dtype == torch.uint8 and flat.numel() == sum(t.numel() * t.element_size() for t in tensors)
    for t, u in zip(tensors, unpack_bytes(flat, layout)):
        assert u.dtype == t.dtype and torch.equal(u, t)
