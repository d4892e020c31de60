"""Whole frames of the model runner on the fused products in the Triton interpreter against the reference model
(tests/kernels/twins.py)."""

from __future__ import annotations

import pytest
import torch

triton = pytest.importorskip("triton")

from q3tts.kernels import attention, linear, norm  # noqa: E402
from q3tts.sampling import SamplingParams  # noqa: E402
from tests.kernels.twins import DEVICE, twin  # noqa: E402


@pytest.mark.slow(reason="whole frames in the Triton interpreter (tests/SLOW.md)")
@pytest.mark.parametrize("part", ["teacher_forced", "engine"])  # (a test each: the interpreter takes a while)
@pytest.mark.parametrize("kind", ["tiny", "tiny-custom-voice-0.6b"])
def test_the_runner_on_the_fused_products(monkeypatch, tmp_path, kind, part):
    """The frame on the fused products (one or two streams; fp32 here, where the runner keeps them off, so that
    the interpreter can run them and the reference is exact): the code predictor's first pass and steps and the
    heads with the final norm inside their products, ("tiny": a code predictor narrower than the talker) its
    inputs looked up projected, its steps' first qkv products looked up, and its first pass's attention in pairs
    (pair_attention), give the reference model's
    teacher-forced logits (part "teacher_forced"), and the codes of two streams are the reference loop's ("engine")."""
    from q3tts import TTS
    from q3tts.engine import EngineConfig
    from q3tts.engine.runner import frame as frame_step
    from q3tts.engine.runner import transformer as decoder
    from q3tts.engine.runner.model_runner import ModelRunner
    from q3tts.reference import generate_codes
    from q3tts.request.prompt import build_prompt
    from q3tts.teacher_forcing import teacher_forced_logits
    from q3tts.tiny import tiny_checkpoint
    from tests.engine.test_model_runner import run_engine

    tts = TTS.from_pretrained(tiny_checkpoint(kind, tmp_path), device=DEVICE, dtype=torch.float32)
    talker = tts.model.talker
    specs = [tts.request(text, speaker="ryan", language="english").spec for text in ("Hello there.", "Thank you.")]
    prompts = [build_prompt(talker, tts.config, spec) for spec in specs]
    params = [SamplingParams(do_sample=False, subtalker_dosample=False, max_new_tokens=3, seed=1),  # (a frame
              SamplingParams(max_new_tokens=2, seed=4)]  # is ~20-30 s in the interpreter: two lengths, no more)
    reference = generate_codes(talker, prompts, params)
    if DEVICE == "cpu":
        # The norm runs a program a row: the code predictor's qkv tables (a norm of every codebook entry, ~30,000
        # rows) were 3/4 of this test's time in the interpreter, so calls of more than a frame's rows run as its
        # twin (the kernel: tests/kernels/test_norm_activation_kernels.py); the frames' (2-4 rows) on the kernel.
        def add_rmsnorm(x, *args):
            return norm.add_rmsnorm(x, *args) if x.shape[0] <= 4 else twin(monkeypatch, norm.add_rmsnorm, x, *args)

        from q3tts.engine.runner import codec_stream, model_runner
        for module in (decoder, model_runner, codec_stream):
            monkeypatch.setattr(module, "add_rmsnorm", add_rmsnorm)
    runner = ModelRunner(tts.model, EngineConfig(max_rows=2, max_context=128, block_size=16, max_trailing=64))
    runner.decode_modes = {"decode": True, "fused": True}
    runner.cp_input_tables = runner.prepare_cp_input_tables()
    assert (runner.cp_input_tables is not None) == (kind == "tiny")
    runner.cp_qkv_tables = runner.prepare_cp_qkv_tables()
    if DEVICE == "cpu":  # one program per product (the interpreter runs programs one by one)
        monkeypatch.setattr(linear, "_gemv_tiles", lambda N, K, swiglu, rows: (triton.next_power_of_2(N),
                                                                                triton.next_power_of_2(K), 4, 1))
    calls, fused_linear = [], linear.fused_linear
    for module in (frame_step, decoder):
        monkeypatch.setattr(module, "fused_linear", lambda *a, **k: calls.append((a, k)) or fused_linear(*a, **k))
    pairs = []
    monkeypatch.setattr(decoder, "pair_attention", lambda *a, **k: pairs.append(1) or attention.pair_attention(*a, **k))
    if part == "engine":
        for a, b in zip(run_engine(runner, prompts, params), reference):
            assert torch.equal(a, b)
        assert calls and pairs  # (the engine's frames ran on the fused products)
        return
    ours = runner.teacher_forced_logits(prompts[0], reference[0])
    for a, b in zip(ours, teacher_forced_logits(talker, prompts[0], reference[0])):
        assert a.shape == b.shape and float((a - b).abs().max() / b.abs().max()) < 1e-5
    assert any(k.get("fp32_out") and k.get("norm") is not None for _, k in calls)  # the heads norm their input
    # the code predictor's first qkv product runs in each frame's first pass only: its steps look theirs up
    assert sum(a[1] is runner.cp.layers[0].qkv for a, _ in calls) == len(reference[0])
    assert len(pairs) == len(reference[0]) * len(runner.cp.layers)  # (the first passes' attention)
