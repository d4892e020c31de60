"""`q3tts bench streaming`'s first audio per voice kind, cached and not, run on the CPU with a tiny model: the
rows come out, and the engine's prefix cache is as it was afterwards (numbers on the CPU mean nothing)."""

from __future__ import annotations

from q3tts import TTS
from q3tts.benchmarks.streaming import streaming_engine, voice_rows
from q3tts.tiny import tiny_checkpoint


def test_first_audio_by_voice_rows(tmp_path):
    tts = TTS.from_pretrained(tiny_checkpoint("tiny-base", tmp_path), device="cpu")
    engine = streaming_engine(tts.model, tts.speech_tokenizer.decoder, (1, 4))
    prefixes = engine.runner.prefix_cache
    rows = voice_rows(engine, tts.model, "tiny-base", (1, 4), reps=1, references=(0.0, 1.0))
    assert engine.runner.prefix_cache is prefixes and prefixes.hits > 0
    new_voices = [(r["voice"], r["batch"]) for r in rows[:2]]
    assert new_voices == [("x-vector, a new voice per stream", 1), ("x-vector, a new voice per stream", 4)]
    assert [(r["voice"], r["batch"], r["prefix_cached"]) for r in rows[2:]] == [
        (voice, batch, cached) for voice in ("x-vector", "in-context 1 s") for batch in (1, 4)
        for cached in (False, True)]
    assert all(0 < r["prefix_positions"] < r["prompt_positions"] for r in rows[2:])
    assert all(r["ttfa_ms_p50"] > 0 for r in rows)
    engine.stop()
