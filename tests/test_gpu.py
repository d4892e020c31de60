"""GPU tests (run on the GPU machine with Q3TTS_GPU_TESTS=1): the graph-captured fast path and numerics."""

from __future__ import annotations

import pytest
import torch

from q3tts import TTS
from q3tts.engine.runner import EngineConfig, ModelRunner
from q3tts.generate import generate_codes
from q3tts.prompt import build_prompt
from q3tts.random_model import random_model, random_prompt_ids
from q3tts.sampling import SamplingParams
from q3tts.teacher_forcing import teacher_forced_logits
from tests.test_engine import _requests, _run_engine

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def exact_fp32():
    """fp32 comparisons need true fp32 convolutions (cuDNN uses TF32 by default)."""
    saved = torch.backends.cudnn.allow_tf32
    torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cudnn.allow_tf32 = saved


@pytest.fixture(scope="module")
def tiny_cuda(tmp_path_factory):
    from q3tts.tiny import tiny_checkpoint

    return TTS.from_pretrained(tiny_checkpoint("tiny", tmp_path_factory.mktemp("cache")), device="cuda")


def test_graphs_match_reference_loop(tiny_cuda):
    """fp32 on the GPU: the captured frame graphs give the reference loop's codes (greedy and seeded)."""
    prompts, params = _requests(tiny_cuda)
    reference = generate_codes(tiny_cuda.model.talker, prompts, params)
    runner = ModelRunner(tiny_cuda.model, EngineConfig(max_rows=8, max_context=256, block_size=16, max_trailing=64,
                                                       buckets=(1, 2, 4, 8)))
    runner.capture_graphs()
    assert set(runner.graphs) == {1, 2, 4, 8}
    ours = _run_engine(runner, prompts, params)
    for a, b in zip(ours, reference):
        assert torch.equal(a, b.cpu())


@pytest.mark.parametrize("name", ["0.6B-CustomVoice", "1.7B-CustomVoice"])
def test_fp32_gpu_reference_matches_cpu(name):
    """Full-size random weights: our fp32 path on the GPU within 1e-4 (relative) of the CPU reference."""
    from q3tts.prompt import PromptSpec

    cpu = random_model(name, device="cpu", dtype=torch.float32)
    spec = PromptSpec(input_ids=random_prompt_ids(cpu.config, 20), language="english", non_streaming_mode=False,
                      speaker="ryan")
    prompt = build_prompt(cpu.talker, cpu.config, spec)
    codes = torch.randint(0, 2048, (12, 16), generator=torch.Generator().manual_seed(0))
    ref = teacher_forced_logits(cpu.talker, prompt, codes)
    gpu = cpu.to("cuda")
    ours = teacher_forced_logits(gpu.talker, build_prompt(gpu.talker, gpu.config, spec), codes)
    for a, b in zip(ours, ref):
        assert float((a.cpu() - b).abs().max() / b.abs().max()) < 1e-4


def test_bf16_graph_path_runs_and_stays_close():
    """Full-size 0.6B in bf16 with graphs: frames come out for every row and the teacher-forced logits of the
    fused path stay close to the fp32 reference (the official-vs-ours comparison is bench/faithfulness.py)."""
    model = random_model("0.6B-Base", device="cuda", dtype=torch.bfloat16)
    spec_embedding = torch.randn(model.config.talker_config.hidden_size, generator=torch.Generator().manual_seed(0))
    from q3tts.prompt import PromptSpec

    spec = PromptSpec(input_ids=random_prompt_ids(model.config, 20), language="english", non_streaming_mode=False,
                      speaker_embedding=spec_embedding)
    prompt = build_prompt(model.talker, model.config, spec)
    runner = ModelRunner(model, EngineConfig(max_rows=4, max_context=256, buckets=(1, 2, 4), max_trailing=64))
    runner.capture_graphs()
    frames = _run_engine(runner, [prompt] * 3, [SamplingParams(max_new_tokens=21, seed=i) for i in range(3)])
    assert [f.shape for f in frames] == [(20, 16)] * 3
    assert not torch.equal(frames[0], frames[1])  # different seeds
    ours = runner.teacher_forced_logits(prompt, frames[0])
    ref_model = random_model("0.6B-Base", device="cuda", dtype=torch.float32)
    ref = teacher_forced_logits(ref_model.talker, build_prompt(ref_model.talker, ref_model.config, spec), frames[0])
    for a, b in zip(ours, ref):
        rel = (a - b).abs().amax(-1) / b.abs().amax(-1)
        assert float(rel.median()) < 0.05
        assert float((a.argmax(-1) == b.argmax(-1)).float().mean()) > 0.8


def test_streaming_with_graphs_equals_offline(tiny_cuda):
    """fp32 on the GPU: the graph-captured LM + codec steps stream exactly the offline audio."""
    import numpy as np

    tiny_cuda.prepare_engine(max_rows=4, max_context=256)
    assert set(tiny_cuda.engine.codec.graphs) == {1, 2, 4}
    kwargs = {"speaker": "ryan", "max_new_tokens": 30, "seed": 3}
    audio = np.concatenate([c.pcm for c in tiny_cuda.stream("Hello world, streaming on the GPU.", **kwargs)])
    offline = tiny_cuda.synthesize("Hello world, streaming on the GPU.", **kwargs)
    assert audio.shape == offline.shape
    assert float(np.abs(audio - offline).max()) < 1e-4


def test_bf16_at_least_as_faithful_as_official(tmp_path):
    """Teacher forcing on random full-size 0.6B weights: q3tts's bf16 fast path is at least as close to the
    fp32 reference as the official implementation in bf16 (needs qwen-tts-hf and the peer harness, as the GPU
    machine has them; see bench/faithfulness.py). Top-1 agreement gets 1 point of slack for sampling noise
    (~1,500 code-predictor rows)."""
    import subprocess
    import sys
    from pathlib import Path

    pytest.importorskip("qwen_tts")
    harness = Path(".peers/peer_bench.py")
    if not harness.exists():
        pytest.skip("the peer harness (.peers/peer_bench.py) is not here")
    sys.path.insert(0, str(Path("bench").resolve()))
    from faithfulness import measure

    ckpt = tmp_path / "0.6B-Base"
    subprocess.run([sys.executable, str(harness), "build", "--config", "0.6B-Base", "--out", str(ckpt)], check=True)
    result = measure(ckpt, frames=100)
    assert "error" not in result["official_bf16_vs_ref_gpu"], result["official_bf16_vs_ref_gpu"]
    for part in ("talker", "code_predictor"):
        ours, official = result["q3tts_bf16_vs_ref_gpu"][part], result["official_bf16_vs_ref_gpu"][part]
        assert ours["rel_error"]["median"] <= official["rel_error"]["median"]
        assert ours["rel_error"]["p99"] <= official["rel_error"]["p99"]
        assert ours["top1_agreement"] >= official["top1_agreement"] - 0.01
    assert max(result["ref_gpu_vs_ref_cpu"][p]["rel_error"]["max"] for p in ("talker", "code_predictor")) < 1e-4


def test_serving_engine_with_graphs_equals_solo(tiny_cuda):
    """fp32 on the GPU: six requests through four rows of the serving engine (captured LM and codec graphs, the
    codec overlapped on its own stream, rows joining and leaving) each stream their solo offline audio."""
    import asyncio

    import numpy as np

    from q3tts.serving.engine import AsyncEngine, ServingConfig
    from tests.test_serving_engine import TEXTS, _alone, _request

    engine = AsyncEngine(tiny_cuda, ServingConfig(max_running=4, max_waiting=8, max_context=256))
    assert engine.codec.graphs and engine.codec.overlap_max_rows is None
    engine.start()

    async def run():
        streams = [engine.submit(*_request(tiny_cuda, i, True)) for i in range(len(TEXTS))]
        return await asyncio.gather(*(s.read_all() for s in streams))

    try:
        outputs = asyncio.run(run())
    finally:
        engine.stop()
    for i, audio in enumerate(outputs):
        solo = _alone(tiny_cuda, i, True)
        assert audio.shape == solo.shape and float(np.abs(audio - solo).max()) < 1e-4, i
