"""The engine on the CPU (tiny model, eager path): continuous batching, cancellation, preemption, shutdown."""

from __future__ import annotations

import asyncio
import dataclasses
import gc
import sys
import threading
import time

import numpy as np
import pytest

from q3tts import TTS, EngineConfig, RequestError
from q3tts.engine import Engine, EngineError, QueueFull, scheduler
from q3tts.tiny import tiny_checkpoint

TEXTS = ["Hello world.", "Thank you very much.", "Good morning, seven bright stars.", "One two three four.",
         "The quick brown fox.", "Good evening."]
SPEAKERS = ["ryan", "eric", "serena", "vivian", "aiden", "dylan"]
GREEDY = {"do_sample": False, "subtalker_dosample": False}


@pytest.fixture(scope="module")
def tts(tmp_path_factory) -> TTS:
    return TTS.from_pretrained(tiny_checkpoint("tiny", tmp_path_factory.mktemp("cache")), device="cpu")


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> TTS:
    return TTS.from_pretrained(tiny_checkpoint("tiny", tmp_path_factory.mktemp("cache")), device="cpu",
                               reference=True)


def make_engine(tts: TTS, **config) -> Engine:
    return Engine(tts.model, tts.speech_tokenizer.decoder, EngineConfig(**config))


@pytest.fixture
def engine(tts):
    eng = make_engine(tts, max_rows=4, max_waiting=8, block_size=16)
    yield eng
    eng.stop()


def request(tts: TTS, i: int, greedy: bool, max_new: int = 16):
    return tts.request(TEXTS[i], speaker=SPEAKERS[i], language="english", seed=100 + i, max_new_tokens=max_new,
                       **(GREEDY if greedy else {}))


def submit(engine: Engine, tts: TTS, i: int, greedy: bool, max_new: int = 16, asyncio_loop: bool = False):
    r = request(tts, i, greedy, max_new)
    return engine.submit(tts.prepare(r), r.params, asyncio_loop=asyncio_loop)


def alone(reference: TTS, i: int, greedy: bool, max_new: int = 16) -> np.ndarray:
    """The request's audio from the reference loop, as if it were alone."""
    return reference.synthesize_all([request(reference, i, greedy, max_new)])[0]


def assert_close(audio: np.ndarray, expected: np.ndarray, what: object = "") -> None:
    assert audio.shape == expected.shape, what
    assert float(np.abs(audio - expected).max(initial=0.0)) < 1e-5, what


@pytest.mark.parametrize("greedy", [True, False])
def test_each_request_gets_its_own_audio(tts, reference, engine, greedy):
    """Six requests with distinct voices and seeds, four rows: they join as rows free up; every request's
    audio equals its solo rendering by the reference loop (so none received another's, and the batch did not
    change it)."""
    async def run():
        streams = [submit(engine, tts, i, greedy, asyncio_loop=True) for i in range(len(TEXTS))]
        return await asyncio.gather(*(s.aread_all() for s in streams))

    for i, audio in enumerate(asyncio.run(run())):
        assert_close(audio, alone(reference, i, greedy), i)
    assert engine.num_running == 0 and engine.metrics.requests_finished == 6 and engine.metrics.max_batch == 4


def test_requests_join_a_running_batch(tts, reference, engine):
    """A request submitted while another streams joins at a frame boundary and both stay exact."""
    first = submit(engine, tts, 0, True, max_new=40)
    frames = []
    for k, frame in enumerate(first):  # sync iteration from this thread
        frames.append(frame)
        if k == 5:
            second = submit(engine, tts, 1, True, max_new=20)
    assert_close(np.concatenate(frames), alone(reference, 0, True, 40))
    assert_close(second.read_all(), alone(reference, 1, True, 20))
    assert list(first) == []  # a stream read to its end stays ended


@pytest.mark.parametrize("case", ["frames slower than real time", "read whole"])
def test_requests_join_a_batch_whose_streams_are_behind(tts, monkeypatch, case):
    """A running stream behind real time holds newcomers back only while frames outpace its playback (it then
    catches up); on frames slower than that (every frame, here) a newcomer joins at the next boundary instead of
    waiting for the batch to end, and a request read whole (realtime=False) has no lead to keep at all."""
    slow = case == "frames slower than real time"
    if slow:
        monkeypatch.setattr(scheduler, "FRAME_SECONDS", 0.0)
    engine = make_engine(tts, max_rows=4, max_waiting=8, block_size=16, safety_seconds=1e3)  # always "at risk"
    try:
        r = request(tts, 0, True, 200)
        first = engine.submit(tts.prepare(r), r.params, realtime=slow)
        for _ in zip(range(3), first):  # its first audio: from now on it has a lead (negative with this safety)
            pass
        second = submit(engine, tts, 1, True, max_new=4)
        assert len(second.read_all()) == 3 * 1920
        assert not first.channel.finished  # (it had ~190 frames to go)
    finally:
        engine.stop()


def test_an_engine_on_the_cpu_computes_with_every_thread(engine):
    """Only a GPU engine's thread runs its CPU ops on one thread; on the CPU it computes the model with torch's
    threads."""
    import torch

    assert engine.host_threads == torch.get_num_threads()


def test_threads_that_drive_a_gpu_keep_one_cpu_thread_each():
    """The engine's thread and the server's prompt workers on a GPU: one CPU thread each, other threads untouched;
    for the CPU every thread."""
    import threading

    import torch

    from q3tts.engine.engine import one_cpu_thread_on_gpu

    def threads_after(device: str) -> tuple[int, int]:
        """A thread's CPU threads after the call, and after a parallel op of its own."""
        got = []

        def work():
            one_cpu_thread_on_gpu(torch.device(device))
            got.append(torch.get_num_threads())
            torch.randn(512, 512).exp().sum()
            got.append(torch.get_num_threads())
        worker = threading.Thread(target=work)
        worker.start()
        worker.join()
        return tuple(got)

    before = torch.get_num_threads()
    every = max(before, 2)  # (on a one-core host too, one thread must differ from every thread)
    torch.set_num_threads(every)
    try:
        assert threads_after("cuda") == (1, 1)
        assert threads_after("cpu") == (every, every) and torch.get_num_threads() == every  # later threads too
    finally:
        torch.set_num_threads(before)


def test_cancel_frees_the_row(tts, reference, engine):
    stream = submit(engine, tts, 2, False, max_new=200)
    got = []
    for frame in stream:
        got.append(frame)
        if len(got) == 3:
            stream.cancel()
    wait_until(lambda: engine.num_running == 0)
    assert 3 <= len(got) < 199 and engine.metrics.requests_cancelled == 1
    assert stream.channel.finish_reason == "cancelled"
    assert_close(submit(engine, tts, 3, True).read_all(), alone(reference, 3, True))


def test_a_dropped_stream_frees_its_row(tts, engine):
    """A stream dropped without being read (or half read) is ended at the next frame boundary."""
    submit(engine, tts, 0, True, max_new=400)  # dropped at once
    half = submit(engine, tts, 1, True, max_new=400)
    next(iter(half))
    del half
    gc.collect()
    wait_until(lambda: engine.num_running == 0 and engine.num_waiting == 0)
    assert engine.metrics.requests_cancelled == 2


def test_a_closed_event_loop_does_not_stop_the_engine(tts, reference, engine):
    """Requests submitted from an event loop that is then closed are ended; the engine keeps serving."""
    loop = asyncio.new_event_loop()

    async def start_and_leave():
        stream = submit(engine, tts, 0, True, max_new=400, asyncio_loop=True)
        await stream.__aiter__().__anext__()
        return stream

    kept = loop.run_until_complete(start_and_leave())
    loop.close()
    # (its row goes before its stream is ended, in one boundary: wait for both, not the row count alone)
    wait_until(lambda: kept.channel.finished and engine.num_running == 0)
    assert engine.healthy and kept.channel.finish_reason == "cancelled"
    assert_close(submit(engine, tts, 3, True).read_all(), alone(reference, 3, True))


def test_bounded_queue_and_context_limit(tts):
    eng = make_engine(tts, max_rows=1, max_waiting=1, max_context=256)
    running = submit(eng, tts, 0, True, max_new=200)
    wait_until(lambda: eng.num_running == 1)
    waiting = submit(eng, tts, 1, True)
    with pytest.raises(QueueFull):
        submit(eng, tts, 2, True)
    r = request(tts, 2, True)
    too_long = dataclasses.replace(r.params, max_new_tokens=300)
    with pytest.raises(RequestError, match="exceed the 256 positions a request may hold here") as e:
        eng.submit(tts.prepare(r), too_long)
    assert e.value.param == "max_new_tokens"
    long_text = dataclasses.replace(tts.prepare(r), trailing_ids=[0] * (eng.config.max_trailing + 1))
    with pytest.raises(RequestError, match="text is too long"):  # refused at submission, not in the engine thread
        eng.submit(long_text, r.params)
    running.cancel()
    assert waiting.read_all().shape == (15 * 1920,)
    eng.stop()


def test_submit_from_many_threads(tts, reference, engine):
    results = {}

    def worker(i):
        results[i] = submit(engine, tts, i, True).read_all()

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for i in range(4):
        assert_close(results[i], alone(reference, i, True), i)


def test_preemption_swaps_rows_out_and_back_exactly(tts, reference):
    """A KV cache too small for every running request: rows grow until no block is free, the newest is swapped
    out to host memory and comes back later; every request's audio is still its solo rendering."""
    eng = make_engine(tts, max_rows=4, block_size=16, kv_cache_gb=12 * 16 * _bytes_per_position(tts) / 2**30)
    streams = [submit(eng, tts, i, greedy, max_new=60) for i, greedy in zip(range(4), (True, False, True, False))]
    outputs = [s.read_all() for s in streams]
    assert eng.metrics.preemptions > 0 and eng.metrics.requests_finished == 4
    for i, (audio, greedy) in enumerate(zip(outputs, (True, False, True, False))):
        assert_close(audio, alone(reference, i, greedy, 60), i)
    assert eng.runner.kv.num_free == eng.runner.kv.num_blocks - 1  # every block came back
    eng.stop()


def _bytes_per_position(tts: TTS) -> int:
    tc = tts.config.talker_config
    return 2 * tc.num_hidden_layers * tc.num_key_value_heads * tc.head_dim * 4  # fp32


def test_stop_ends_open_streams(tts):
    """Stopping the engine ends every running and waiting request with EngineError (no consumer waits forever),
    later submissions are refused, and the interpreter's switch interval is given back."""
    switch_interval = sys.getswitchinterval()
    eng = make_engine(tts, max_rows=1, max_waiting=4)
    eng.start()
    assert sys.getswitchinterval() == min(switch_interval, 0.001)
    streams = [submit(eng, tts, i, True, max_new=400) for i in range(2)]
    frames = iter(streams[0])
    next(frames)  # the first request is running, the second waiting
    outcomes = {}

    def consume(name, it):
        try:
            list(it)
            outcomes[name] = "ended"
        except EngineError as e:
            outcomes[name] = str(e)

    readers = [threading.Thread(target=consume, args=(n, it), daemon=True)
               for n, it in (("running", frames), ("waiting", iter(streams[1])))]
    for r in readers:
        r.start()
    eng.stop()
    for r in readers:
        r.join(timeout=30)
    assert outcomes == {"running": "the engine was stopped", "waiting": "the engine was stopped"}
    with pytest.raises(EngineError, match="stopped"):
        submit(eng, tts, 2, True)
    assert sys.getswitchinterval() == switch_interval


def wait_until(condition, timeout: float = 30) -> None:
    deadline = time.time() + timeout
    while not condition():
        assert time.time() < deadline, "timed out"
        time.sleep(0.01)


def test_runaway_guard_ends_long_and_repeating_audio(tts, tmp_path):
    """A frame limit from the text's length, and a run of identical frames, end a request with its reason (the
    last allowed frame's audio delivered); counted by finish reason."""
    from q3tts import RunawayGuard

    guard = RunawayGuard(frames_per_token=1.0, min_frames=3, repeated_frames=50)
    request = tts.request(TEXTS[2], speaker="ryan", seed=1, max_new_tokens=200, runaway_guard=guard)
    stream = tts.submit(request)
    audio = stream.read_all()
    limit = guard.frame_limit(request.text_tokens)
    assert audio.shape == (limit * 1920,) and stream.channel.finish_reason == "runaway"
    assert tts.engine.metrics.finish_reasons["runaway"] >= 1

    import shutil

    from safetensors.torch import load_file, save_file

    folder = shutil.copytree(tiny_checkpoint("tiny"), tmp_path / "flat")
    tensors = load_file(folder / "model.safetensors")
    for name in tensors:  # every head predicts the same code whatever the input: one frame, repeated
        if name == "talker.codec_head.weight" or name.startswith("talker.code_predictor.lm_head"):
            tensors[name].zero_()
    save_file(tensors, folder / "model.safetensors")
    flat = TTS.from_pretrained(folder, device="cpu")
    repeat = flat.submit(flat.request("Hello.", speaker="ryan", max_new_tokens=100, runaway_guard=RunawayGuard(
        repeated_frames=6), **GREEDY))
    assert repeat.read_all().shape == (6 * 1920,) and repeat.channel.finish_reason == "repetition"
    unguarded = flat.submit(flat.request("Hello.", speaker="ryan", max_new_tokens=20, **GREEDY))
    assert unguarded.read_all().shape == (19 * 1920,) and unguarded.channel.finish_reason == "length"
    flat.close()
