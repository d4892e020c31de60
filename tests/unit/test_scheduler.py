"""The scheduler alone: pure Python, no model."""

from __future__ import annotations

import pytest

from q3tts.engine.kv_blocks import KVBlocks, OutOfBlocks
from q3tts.engine.scheduler import QueueFull, Scheduler
from q3tts.engine.sequence import Sequence


def seq(i: int, tokens: int = 50, arrival: float = 0.0) -> Sequence:
    return Sequence(f"r{i}", tokens, arrival)


def scheduler(max_running: int, max_waiting: int = 10, blocks: int = 1000, **kwargs) -> Scheduler:
    return Scheduler(max_running, max_waiting, KVBlocks(blocks, 64, max_running), **kwargs)


def admitted(s: Scheduler, now: float = 0.0) -> list[Sequence]:
    resumed, new = s.admit(now)
    assert not resumed
    return new


def test_fifo_up_to_free_rows():
    s = scheduler(max_running=2)
    for i in range(4):
        s.add(seq(i))
    assert [x.request_id for x in admitted(s)] == ["r0", "r1"]
    assert admitted(s) == []  # no free row
    s.finish("r0")
    assert [x.request_id for x in admitted(s)] == ["r2"]
    assert s.num_waiting == 1 and s.num_running == 2


def test_bounded_queue_refuses():
    s = scheduler(max_running=1, max_waiting=2)
    s.add(seq(0))
    s.add(seq(1))
    with pytest.raises(QueueFull):
        s.add(seq(2))


def test_prefill_token_budget_per_boundary():
    s = scheduler(max_running=8, max_prefill_tokens=120)
    for i in range(4):
        s.add(seq(i, tokens=50))
    assert len(admitted(s)) == 2  # 100 tokens; a third would make 150
    assert len(admitted(s)) == 2
    big = scheduler(max_running=8, max_prefill_tokens=10)
    big.add(seq(9, tokens=500))
    assert len(admitted(big)) == 1  # one request always fits, however long


def test_streams_about_to_fall_behind_block_admission():
    s = scheduler(max_running=8, prefill_seconds_per_token=1e-3, safety_seconds=0.1)
    s.add(seq(0))
    running = admitted(s)[0]
    running.first_audio, running.frames = 0.0, 5  # 0.4 s of audio produced
    s.add(seq(1, tokens=100))
    assert admitted(s, 0.35) == []  # lead 0.05 s < 0.1 s safety: let the stream catch up
    running.frames = 20  # 1.6 s produced by t = 0.35: lead 1.25 s
    assert [x.request_id for x in admitted(s, 0.35)] == ["r1"]


def test_stall_budget_limits_how_many_join():
    s = scheduler(max_running=8, prefill_seconds_per_token=1e-3, safety_seconds=0.1)
    s.add(seq(0))
    running = admitted(s)[0]
    running.first_audio, running.frames = 0.0, 10  # lead 0.8 s at t=0
    for i in range(1, 5):
        s.add(seq(i, tokens=300))  # 0.3 s of stall each
    assert len(admitted(s)) == 2  # 0.6 s fits the 0.7 s budget, 0.9 s would not


def test_cancel_waiting_and_running():
    s = scheduler(max_running=1)
    s.add(seq(0))
    s.add(seq(1))
    running = admitted(s)[0]
    waiting = s.cancel("r1")
    assert waiting.cancelled and s.num_waiting == 0
    assert s.cancel("r0") is running and running.cancelled  # removed by the engine at the next boundary
    assert s.cancel("nope") is None


def test_admission_needs_free_kv_blocks():
    """A request joins only if its prompt and first frame fit the free blocks with a reserve for the running
    rows' growth (1 block + 1 per 8 rows)."""
    s = scheduler(max_running=8, blocks=6)  # 5 usable blocks of 64 positions
    s.add(seq(0, tokens=150))  # 3 blocks (+1 reserve): fits
    s.add(seq(1, tokens=150))  # 3 more (+1 reserve): 4 > 2 left
    assert [x.request_id for x in admitted(s)] == ["r0"]
    s.kv.grow(0, 151)  # the engine gives the admitted row its blocks
    assert admitted(s) == [] and s.num_waiting == 1
    s.finish("r0")
    s.kv.release(0)
    assert [x.request_id for x in admitted(s)] == ["r1"]


def test_preempted_requests_come_back_first():
    """`preempt` takes the newest running request; it comes back, ahead of every new request, once its blocks
    (and its next frame's) are free, and keeps its place in the admission order."""
    s = scheduler(max_running=4, blocks=10)  # 9 usable blocks
    for i in range(3):
        s.add(seq(i, tokens=60))
    first = admitted(s)
    assert [x.request_id for x in first] == ["r0", "r1", "r2"]
    for row in range(3):
        s.kv.grow(row, 61)  # what the engine does on admission: 6 blocks left
    victim = s.preempt()
    s.kv.release(2)  # swapped out: 7 free
    assert victim.request_id == "r2" and s.num_running == 2 and s.num_waiting == 1
    victim.num_positions = 200  # it had run: 4 blocks to come back with its next frame, + 1 reserve
    s.kv.grow(0, 4 * 64)  # meanwhile r0 grew: 4 free
    s.add(seq(3, tokens=10))
    assert s.admit(0.0) == ([], [])  # r2 does not fit yet, and r3 may not overtake it
    s.finish("r1")
    s.kv.release(1)  # 5 free
    resumed, new = s.admit(0.0)
    assert resumed == [victim] and new == [] and victim.order == first[2].order
    assert "r2" in s.running and s.num_waiting == 1


def test_kv_blocks_grow_release_move():
    kv = KVBlocks(num_blocks=5, block_size=64, num_rows=3)
    assert kv.grow(0, 65) == (0, [1, 2]) and kv.num_free == 2
    assert kv.grow(0, 100) == (2, [])  # already held
    with pytest.raises(OutOfBlocks):
        kv.grow(1, 64 * 3)
    assert kv.num_free == 2  # nothing taken by the failed grow
    kv.move(0, 2)
    assert kv.rows[2] == [1, 2] and kv.rows[0] == []
    assert kv.release(2) == [1, 2] and kv.num_free == 4
    assert kv.capacity_positions == 4 * 64



def test_kv_blocks_grow_rows_is_grow_one_after_the_other():
    """The batched grow hands out the same blocks as `grow` row by row, and stops where it would: the rows before
    the one short of blocks keep theirs (listed), that one and those after are unchanged."""
    import random

    rng = random.Random(0)
    for _ in range(200):
        one, many = (KVBlocks(num_blocks=24, block_size=16, num_rows=6) for _ in range(2))
        held = 16 * rng.randint(0, 3)
        for kv in (one, many):
            kv.grow(5, held)
        rows = rng.sample(range(5), rng.randint(1, 5))
        wanted = [rng.randint(0, 16 * 8) for _ in rows]
        expected, failed = ([], [], []), False
        for row, n in zip(rows, wanted):
            try:
                start, new = one.grow(row, n)
            except OutOfBlocks:
                failed = True
                break
            expected[0].extend([row] * len(new))
            expected[1].extend(range(start, start + len(new)))
            expected[2].extend(new)
        cells = ([], [], [])
        if failed:
            with pytest.raises(OutOfBlocks):
                many.grow_rows(rows, wanted, cells)
        else:
            many.grow_rows(rows, wanted, cells)
        assert cells == expected and many.rows == one.rows and many.free == one.free

def test_the_prefill_budget_counts_what_will_be_computed():
    """With a prompt's prefix cached, only the rest counts against max_prefill_tokens."""
    seqs = [Sequence(f"r{i}", 100, 0.0) for i in range(3)]
    for cached, expected in ((False, 1), (True, 3)):
        s = scheduler(max_running=8, max_prefill_tokens=150,
                      prefill_tokens=lambda seq, cached=cached: 40 if cached else seq.num_positions)
        for seq in seqs:
            s.add(Sequence(seq.request_id, seq.num_positions, 0.0))
        assert len(s.admit(0.0)[1]) == expected


def test_streams_behind_slower_than_real_time_frames_do_not_stop_admission():
    """Waiting lets a stream catch up only while frames outpace playback: on a device slower than real time the
    running streams never catch up, and holding every newcomer back would wait for the whole batch to end."""
    s = scheduler(max_running=8, prefill_seconds_per_token=1e-3, safety_seconds=0.1)
    s.add(seq(0))
    running = admitted(s)[0]
    running.first_audio, running.frames = 0.0, 5  # 0.4 s of audio by t = 1.0: 0.6 s behind
    for i in (1, 2):
        s.add(seq(i, tokens=100))
    assert s.admit(1.0, frame_seconds=0.05) == ([], [])  # frames faster than playback: it catches up first
    resumed, new = s.admit(1.0, frame_seconds=0.12)
    assert not resumed and [x.request_id for x in new] == ["r1"]  # one per boundary, not all at once


def test_a_request_read_whole_has_no_lead_to_keep():
    s = scheduler(max_running=8, prefill_seconds_per_token=1e-3, safety_seconds=0.1)
    s.add(Sequence("r0", 50, 0.0, realtime=False))
    running = admitted(s)[0]
    running.first_audio, running.frames = 0.0, 5  # 0.6 s "behind" at t = 1.0: nobody plays it
    s.add(seq(1, tokens=100))
    assert [x.request_id for x in admitted(s, 1.0)] == ["r1"]


def test_a_live_request_waiting_for_its_first_text_holds_no_one_up():
    """A request whose prompt is not known yet (live text before its first token: engine/live.py) keeps its place
    in the queue without being admitted; the ones behind it are, and it is once ready."""
    s = scheduler(max_running=2)
    live = seq(0)
    live.ready = False
    for x in (live, seq(1)):
        s.add(x)
    assert s.has_work() and [x.request_id for x in admitted(s)] == ["r1"]
    assert s.num_waiting == 1 and not s.has_work()
    live.ready = True
    assert s.has_work() and [x.request_id for x in admitted(s)] == ["r0"]
