"""How the engine hands frames to streams (engine/stream.py `deliver`): at once while the reader is less than
`hold_s` of audio ahead of real time, in groups beyond; every frame once, in order; ends and preemptions flush."""

from __future__ import annotations

import numpy as np

from q3tts.engine.stream import END, Channel, deliver

STEP = 0.008  # a frame made every 8 ms: 10x real time


def frame(k: int) -> np.ndarray:
    return np.full(1920, k, dtype=np.float32)


def run(hold_s: float, frames: int, end: bool = True, preempt_at: int | None = None):
    """(time, item) of each hand-out to one channel fed a frame per STEP."""
    channel, out = Channel("r", None), []
    for k in range(frames):
        items = [(channel, frame(k))] + ([(channel, END)] if end and k == frames - 1 else [])
        flush = [channel] if k == preempt_at else []
        out += [(k * STEP, item) for _, item in deliver(items, k * STEP, hold_s, flush)]
    return out


def audio(out) -> list[int]:
    return [int(f[0]) for _, item in out if item is not END for f in item]


def test_without_hold_every_frame_goes_out_at_once():
    out = run(0.0, 30)
    assert [[f.shape for f in item] for _, item in out[:-1]] == [[(1920,)]] * 30 and out[-1][1] is END
    assert audio(out) == list(range(30))


def test_a_stream_ahead_of_real_time_gets_groups_and_loses_nothing():
    out = run(1.0, 200)
    sizes = [len(item) for _, item in out if item is not END]
    assert audio(out) == list(range(200)) and out[-1][1] is END
    single = sizes.index(next(s for s in sizes if s > 1))
    assert single >= 12 and all(s == 1 for s in sizes[:single])  # one by one until a second ahead ...
    assert max(sizes) == 12 and len(sizes) < 200 / 5  # ... then about a second at a time
    # never behind: each frame is out before real-time playback (from the first frame) needs it
    start = out[0][0]
    handed = [t for t, item in out if item is not END for _ in item]
    assert all(t <= start + k * 0.08 for k, t in enumerate(handed))


def test_an_end_flushes_what_is_held_first():
    out = run(1.0, 40, end=False)
    held = 40 - len(audio(out))
    assert held > 0
    channel = Channel("r", None)
    channel.held, channel.first_post, channel.posted_frames = [frame(1)] * 3, 0.0, 20
    items = deliver([(channel, END)], 0.1, 1.0)
    assert len(items) == 2 and len(items[0][1]) == 3 and items[1][1] is END


def test_a_preempted_row_hands_out_what_it_holds():
    out = run(1.0, 40, end=False, preempt_at=30)
    assert audio(out)[-1] == 30  # everything up to the preemption is out


def test_engine_streams_equal_with_and_without_holding(tmp_path):
    from q3tts import TTS
    from q3tts.engine import EngineConfig
    from q3tts.tiny import tiny_checkpoint

    wavs, chunks = [], []
    for hold in (0.0, 1.0):
        with TTS.from_pretrained(tiny_checkpoint("tiny", tmp_path), device="cpu",
                                 engine_config=EngineConfig(max_rows=2, stream_hold_s=hold)) as tts:
            stream = tts.submit(tts.request("Hello there, a sentence of some length.", speaker="ryan", seed=1,
                                            max_new_tokens=60))
            got = list(stream.chunks())
            chunks.append(got)
            wavs.append(np.concatenate(got))
    assert all(len(c) % 1920 == 0 for c in chunks[1]) and all(len(c) == 1920 for c in chunks[0])
    np.testing.assert_array_equal(wavs[0], wavs[1])
