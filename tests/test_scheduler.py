"""The scheduler alone: pure Python, no model."""

from __future__ import annotations

import pytest

from q3tts.serving.scheduler import QueueFull, Scheduler, Sequence


def seq(i: int, tokens: int = 50, arrival: float = 0.0) -> Sequence:
    return Sequence(f"r{i}", tokens, arrival)


def test_fifo_up_to_free_rows():
    s = Scheduler(max_running=2, max_waiting=10)
    for i in range(4):
        s.add(seq(i))
    assert [x.request_id for x in s.admit(0.0)] == ["r0", "r1"]
    assert s.admit(0.0) == []  # no free row
    s.finish("r0")
    assert [x.request_id for x in s.admit(0.0)] == ["r2"]
    assert s.num_waiting == 1 and s.num_running == 2


def test_bounded_queue_refuses():
    s = Scheduler(max_running=1, max_waiting=2)
    s.add(seq(0))
    s.add(seq(1))
    with pytest.raises(QueueFull):
        s.add(seq(2))


def test_prefill_token_budget_per_boundary():
    s = Scheduler(max_running=8, max_waiting=10, max_prefill_tokens=120)
    for i in range(4):
        s.add(seq(i, tokens=50))
    assert len(s.admit(0.0)) == 2  # 100 tokens; a third would make 150
    assert len(s.admit(0.0)) == 2
    big = Scheduler(max_running=8, max_waiting=10, max_prefill_tokens=10)
    big.add(seq(9, tokens=500))
    assert len(big.admit(0.0)) == 1  # one request always fits, however long


def test_streams_about_to_fall_behind_block_admission():
    s = Scheduler(max_running=8, max_waiting=10, prefill_seconds_per_token=1e-3, safety_seconds=0.1)
    s.add(seq(0))
    running = s.admit(0.0)[0]
    running.first_audio, running.frames = 0.0, 5  # 0.4 s of audio produced
    s.add(seq(1, tokens=100))
    assert s.admit(0.35) == []  # lead 0.05 s < 0.1 s safety: let the stream catch up
    running.frames = 20  # 1.6 s produced by t = 0.35: lead 1.25 s
    assert [x.request_id for x in s.admit(0.35)] == ["r1"]


def test_stall_budget_limits_how_many_join():
    s = Scheduler(max_running=8, max_waiting=10, prefill_seconds_per_token=1e-3, safety_seconds=0.1)
    s.add(seq(0))
    running = s.admit(0.0)[0]
    running.first_audio, running.frames = 0.0, 10  # lead 0.8 s at t=0
    for i in range(1, 5):
        s.add(seq(i, tokens=300))  # 0.3 s of stall each
    assert len(s.admit(0.0)) == 2  # 0.6 s fits the 0.7 s budget, 0.9 s would not


def test_cancel_waiting_and_running():
    s = Scheduler(max_running=1, max_waiting=10)
    s.add(seq(0))
    s.add(seq(1))
    running = s.admit(0.0)[0]
    waiting = s.cancel("r1")
    assert waiting.cancelled and s.num_waiting == 0
    assert s.cancel("r0") is running and running.cancelled  # removed by the engine at the next boundary
    assert s.cancel("nope") is None
