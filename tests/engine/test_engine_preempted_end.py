"""A request preempted at the boundary its last frame was in flight (the engine learns that it finished only once
it is swapped out): it ends there with its reason and all its audio, exact; nothing else fails. Before the
engine's rows became arrays this failed the engine (`_leave` looked for the row the preemption had removed).
~10 s on the CI machine (two short greedy requests and their reference renderings)."""

from __future__ import annotations

import numpy as np

from q3tts import TTS, EngineConfig
from q3tts.engine import Engine
from q3tts.tiny import tiny_checkpoint

GREEDY = {"do_sample": False, "subtalker_dosample": False}


def test_a_request_preempted_as_it_finishes_ends_exactly(tmp_path):
    tts = TTS.from_pretrained(tiny_checkpoint("tiny", tmp_path), device="cpu")
    reference = TTS.from_pretrained(tiny_checkpoint("tiny", tmp_path), device="cpu", reference=True)
    tc = tts.config.talker_config
    position_bytes = 2 * tc.num_hidden_layers * tc.num_key_value_heads * tc.head_dim * 4  # fp32
    # 7 blocks of 16 (6 usable): both rows need a 3rd block at once, and the newer one's frame then in flight is
    # its last (found by trying lengths on the tree before)
    engine = Engine(tts.model, tts.speech_tokenizer.decoder,
                    EngineConfig(max_rows=2, block_size=16, kv_cache_gb=7 * 16 * position_bytes / 2**30))
    try:
        requests = [tts.request("Hello world.", speaker="ryan", language="english", seed=1, max_new_tokens=40,
                                **GREEDY),
                    tts.request("Good evening.", speaker="eric", language="english", seed=2, max_new_tokens=32,
                                **GREEDY)]
        # The newer request joins once the first has its first audio (a boundary or two in: what these lengths were
        # found with), not whenever the test thread gets to it (a loaded machine admitted both at once, and then
        # neither was preempted).
        prompts = [tts.prepare(r) for r in requests]
        streams = [engine.submit(prompts[0], requests[0].params)]
        first = iter(streams[0])
        head = next(first)
        streams.append(engine.submit(prompts[1], requests[1].params))
        audio = [np.concatenate([head, *first]), streams[1].read_all()]
        assert engine.metrics.preemptions == 1 and engine.healthy
        assert [s.finish_reason for s in streams] == ["length", "length"]
        for got, request in zip(audio, requests):
            want = reference.synthesize_all([request])[0]
            assert got.shape == want.shape and float(np.abs(got - want).max()) < 1e-5
        assert engine.runner.kv.num_free == engine.runner.kv.num_blocks - 1  # every block came back
    finally:
        engine.stop()
