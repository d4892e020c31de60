"""The profiling tools run on the CPU with a tiny model (numbers on the CPU mean nothing): `bench/serve_load.py
--profile-loop`'s timers around the engine loop, and `bench/profilers/profile_burst.py`'s burst step by step."""

from __future__ import annotations

import asyncio
import random

from bench import serve_load
from bench.profilers import profile_burst
from q3tts import TTS, EngineConfig
from q3tts.benchmarks.streaming import streaming_engine
from q3tts.tiny import tiny_checkpoint


def test_loop_profile(tmp_path, monkeypatch):
    tts = TTS.from_pretrained(tiny_checkpoint("tiny-base", tmp_path), device="cpu",
                              engine_config=EngineConfig(max_rows=4))
    engine = tts.prepare_engine()
    from q3tts.engine.runner.readback import Readback

    transfers = [(module, "to_device") for module in serve_load.runner_modules() if hasattr(module, "to_device")]
    wrapped = [(Readback, "pop"), (Readback, "pop_pcm"), *transfers]
    for owner, name in wrapped:
        monkeypatch.setattr(owner, name, getattr(owner, name))  # (restored after the test: the profile wraps them)
    profile = serve_load.LoopProfile(engine)
    window = profile.window()
    monkeypatch.setattr(random.Random, "randint", lambda self, a, b: a)  # the shortest texts and streams
    record: list = []

    async def two():
        rng = random.Random(0)
        await asyncio.gather(serve_load.consume(tts, rng, record), serve_load.consume(tts, rng, record))

    asyncio.run(two())
    phases = window()
    tts.close()
    assert len(record) == 2 and all(r["frames"] == r["expected"] for r in record)
    assert phases["iterations"] > 0 and phases["rows_mean"] > 0
    assert {"_join_ms", "_settle_ms", "wait.frame_ms", "runner._prefill_tokens_ms"} <= set(phases)
    assert all(0 <= v <= phases["ms_per_iteration"] for k, v in phases.items() if k.endswith("_ms"))


def test_engine_settings_from_the_command_line():
    import pytest

    assert serve_load.engine_settings(["switch_interval=0.0002", "buckets=(64, 128)", "prefix_cache_gb=0"]) == {
        "switch_interval": 0.0002, "buckets": (64, 128), "prefix_cache_gb": 0}
    assert serve_load.engine_settings(["switch_interval=none"]) == {"switch_interval": None}
    with pytest.raises(SystemExit, match="no field 'max_row'"):
        serve_load.engine_settings(["max_row=4"])


def test_burst_steps(tmp_path):
    tts = TTS.from_pretrained(tiny_checkpoint("tiny-base", tmp_path), device="cpu")
    engine = streaming_engine(tts.model, tts.speech_tokenizer.decoder, (4,))
    for cached, new_voices in ((False, False), (True, False), (False, True)):
        steps = profile_burst.burst(engine, tts.model, 4, 0.0, cached, new_voices)
        assert {"build_prompts", "add_rows", "codec.start", "frame", "codec.step", "readback"} <= set(steps)
        assert steps["add_rows._prefill_tokens"] > 0 and steps["add_rows.other"] >= 0
    assert "_prefill_tokens" not in vars(engine.runner)  # the timers are gone afterwards
    engine.stop()


def test_decode_breakdown_runs_the_frame_and_its_parts(tmp_path, monkeypatch):
    """`q3tts bench decode --breakdown`'s parts (the frame, the talker step, the code predictor, the draws with
    their gathers) run against the runner as the frame calls it: each part once, eagerly (graph timing is for the
    GPU), on a tiny bf16 model whose code predictor takes its inputs from the projected tables."""
    import torch

    from q3tts.benchmarks import decode
    from q3tts.benchmarks.common import clone_prompt

    calls = []
    monkeypatch.setattr(decode, "graph_ms", lambda fn, replays: calls.append(fn()) or 1.0)
    model = TTS.from_pretrained(tiny_checkpoint("tiny-base-1.7b", tmp_path), device="cpu", dtype=torch.bfloat16).model
    prompt = clone_prompt(model, num_text_tokens=5)
    runner = decode.decode_runner(model, prompt, [2])
    assert runner.cp_input_tables is not None
    parts = decode.breakdown(runner, prompt, 2, replays=1)
    assert len(calls) == 4 and set(parts) == {"frame", "talker", "code_predictor", "sampling", "overhead"}


def test_device_busy_summary_counts_overlapping_streams_once():
    from bench.profilers.device_busy import summary

    kernel = lambda name, ts, dur, stream: {"ph": "X", "cat": "kernel", "name": name, "ts": ts, "dur": dur,
                                            "args": {"stream": stream}}
    events = [kernel("a", 0, 10, 7), kernel("b", 5, 10, 7), kernel("c", 100, 50, 7), kernel("d", 20, 60, 9),
              {"ph": "X", "cat": "cpu_op", "name": "host", "ts": 0, "dur": 1000}]  # (not the device's)
    got = summary(events)
    assert got["window_ms"] == 0.15 and got["busy_share"] == round(125 / 150, 4)  # [0, 15] + [20, 80] + [100, 150]
    assert got["main_stream"] == "7" and got["main_gaps"] == 1 and got["main_gap_ms_p50"] == 0.085
    assert got["streams"]["7"]["busy_share"] == round(65 / 150, 4) and got["streams"]["9"]["top_ms"] == {"d": 0.06}
    assert summary([]) == {"events": 0}
