"""GPU tests (run on the GPU machine with Q3TTS_GPU_TESTS=1): the graph-captured fast path and numerics."""

from __future__ import annotations

import pytest
import torch

from q3tts import TTS
from q3tts.benchmarks.random_model import random_model, random_prompt_ids
from q3tts.engine import EngineConfig
from q3tts.engine.runner.model_runner import ModelRunner
from q3tts.reference import generate_codes
from q3tts.request.prompt import build_prompt
from q3tts.sampling import SamplingParams
from q3tts.teacher_forcing import teacher_forced_logits
from tests.api import test_entry_points as entry
from tests.engine.test_model_runner import run_engine, tiny_requests

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def exact_fp32():
    """fp32 comparisons need true fp32 convolutions (cuDNN uses TF32 by default)."""
    saved = torch.backends.cudnn.allow_tf32
    torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cudnn.allow_tf32 = saved


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("cache")


def load(name: str, cache, **kwargs) -> TTS:
    from q3tts.tiny import tiny_checkpoint

    return TTS.from_pretrained(tiny_checkpoint(name, cache), device="cuda", dtype=torch.float32, **kwargs)


@pytest.fixture(scope="module")
def tiny_cuda(cache):
    return load("tiny", cache)


@pytest.fixture
def on_gpu(monkeypatch):
    """The entry-point checks of tests/api/test_entry_points.py, with the GPU's fp32 tolerance."""
    monkeypatch.setitem(entry.CURRENT, "device", "cuda")


@pytest.mark.parametrize("fused", ["off", "attention", "all"])
def test_graphs_match_reference_loop(tiny_cuda, fused):
    """fp32 on the GPU: the captured frame graphs give the reference loop's codes (greedy and seeded), with the
    decode steps' attention as two kernels or as one (EngineConfig.fused_decode; "all" keeps fp32 products on
    cuBLAS)."""
    prompts, params = tiny_requests(tiny_cuda)
    reference = generate_codes(tiny_cuda.model.talker, prompts, params)
    runner = ModelRunner(tiny_cuda.model, EngineConfig(max_rows=8, max_context=256, block_size=16, max_trailing=64,
                                                       buckets=(1, 2, 4, 8), fused_decode=fused))
    runner.capture_graphs()
    assert set(runner.graphs) == {1, 2, 4, 8}
    ours = run_engine(runner, prompts, params)
    for a, b in zip(ours, reference):
        assert torch.equal(a, b.cpu())


@pytest.mark.parametrize("name", ["0.6B-CustomVoice", "1.7B-CustomVoice"])
def test_fp32_gpu_reference_matches_cpu(name):
    """Full-size random weights: our fp32 path on the GPU within 1e-4 (relative) of the CPU reference."""
    from q3tts.request.prompt import PromptSpec

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


@pytest.mark.parametrize("fused", ["off", "all"])
def test_bf16_graph_path_runs_and_stays_close(fused):
    """Full-size 0.6B in bf16 with graphs: frames come out for every row and the teacher-forced logits of the
    fused path (through the decode steps, as generated) stay close to the fp32 reference (the official-vs-ours
    comparison is bench/faithfulness.py)."""
    model = random_model("0.6B-Base", device="cuda", dtype=torch.bfloat16)
    spec_embedding = torch.randn(model.config.talker_config.hidden_size, generator=torch.Generator().manual_seed(0))
    from q3tts.request.prompt import PromptSpec

    spec = PromptSpec(input_ids=random_prompt_ids(model.config, 20), language="english", non_streaming_mode=False,
                      speaker_embedding=spec_embedding)
    prompt = build_prompt(model.talker, model.config, spec)
    runner = ModelRunner(model, EngineConfig(max_rows=4, max_context=256, buckets=(1, 2, 4), max_trailing=64,
                                             fused_decode=fused))
    runner.capture_graphs()
    frames = run_engine(runner, [prompt] * 3, [SamplingParams(max_new_tokens=21, seed=i) for i in range(3)])
    assert [f.shape for f in frames] == [(20, 16)] * 3
    assert not torch.equal(frames[0], frames[1])  # different seeds
    ours = runner.teacher_forced_logits(prompt, frames[0])
    ref_model = random_model("0.6B-Base", device="cuda", dtype=torch.float32)
    ref = teacher_forced_logits(ref_model.talker, build_prompt(ref_model.talker, ref_model.config, spec), frames[0])
    for a, b in zip(ours, ref):
        rel = (a - b).abs().amax(-1) / b.abs().amax(-1)
        assert float(rel.median()) < 0.05
        assert float((a.argmax(-1) == b.argmax(-1)).float().mean()) > 0.8


@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "sampled"])
def test_entry_points_on_the_engine_equal_the_reference_loop(cache, on_gpu, tmp_path, sampled):
    """fp32 on the GPU: every entry point through the engine (captured LM and codec graphs, the codec overlapped on
    its own stream, rows joining and leaving) gives the reference loop's audio."""
    import soundfile as sf

    from tests.equivalence.test_equivalence import speech_like

    ref_wav = tmp_path / "ref.wav"
    sf.write(ref_wav, speech_like(1.0, 24000, 5), 24000)
    for name, check in (("tiny", entry.check_custom_voice), ("tiny-voice-design", entry.check_voice_design),
                        ("tiny-base", entry.check_voice_clone)):
        ours, ref = load(name, cache, max_rows=4), load(name, cache, reference=True)
        ours.prepare_engine()
        assert set(ours.engine.runner.graphs) == {1, 2, 4} and set(ours.engine.codec.graphs) == {1, 2, 4}
        check(ours, ref, *([ref_wav] if name == "tiny-base" else []), sampled)
        ours.close()


def test_the_engine_thread_keeps_no_cpu_thread_team(cache, on_gpu):
    """On a GPU the engine's thread computes on the device: its CPU ops run on one thread (no OpenMP team beside
    the caller's), and the caller's setting is untouched."""
    threads = torch.get_num_threads()
    tts = load("tiny", cache)
    tts.prepare_engine()
    assert tts.engine.host_threads == 1 and torch.get_num_threads() == threads
    tts.close()


def test_a_server_on_the_gpu_runs_its_threads_cpu_ops_on_one_thread(cache, tmp_path):
    """After start-up the server's process is bookkeeping beside the GPU: its event loop's thread, its prompt
    workers and every thread started later run torch's CPU ops on one thread each."""
    import asyncio
    import threading

    pytest.importorskip("fastapi")  # (the server's extra: q3tts[server])
    from q3tts.server.config import ServerConfig
    from q3tts.server.service import SpeechService
    from q3tts.server.voice_store import VoiceStore

    def threads_in_new_thread() -> int:
        got = []
        thread = threading.Thread(target=lambda: got.append(torch.get_num_threads()))
        thread.start()
        thread.join()
        return got[0]

    every = torch.get_num_threads()
    config = ServerConfig(model="tiny", device="cuda", max_running=2, voices_dir=str(tmp_path))
    service = SpeechService(load("tiny", cache), config, VoiceStore(config.voices_dir))
    try:
        asyncio.run(service.start())  # this thread runs the event loop
        assert service.ready and torch.get_num_threads() == 1
        assert asyncio.run(service.in_worker(torch.get_num_threads)) == 1
        assert threads_in_new_thread() == 1
    finally:
        service.tts.close()
        torch.set_num_threads(every)  # this thread's and later threads' setting, as the other tests expect


def test_concurrency_and_closing_on_the_gpu(cache, on_gpu):
    """Threads batch, two generators in one thread both finish, closed and abandoned streams free their rows."""
    ref = load("tiny", cache, reference=True)
    entry.check_concurrent_streams(load("tiny", cache), ref)
    ours = load("tiny", cache)
    entry.check_two_generators(ours, ref)
    entry.check_closed_streams(ours)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs a second GPU")
def test_an_engine_on_the_second_gpu(cache):
    """An engine on cuda:1, built and fed from threads whose current device is cuda:0 (as `q3tts serve --device
    cuda:1` does from its worker threads), gives the same audio as on cuda:0."""
    import threading

    from q3tts.tiny import tiny_checkpoint

    def render(device: str) -> list:
        tts = TTS.from_pretrained(tiny_checkpoint("tiny", cache), device=device, dtype=torch.float32, max_rows=4)
        out = {}
        thread = threading.Thread(target=lambda: out.update(wavs=tts.synthesize_all(
            [tts.request(t, speaker="ryan", seed=3) for t in ("Hello there.", "A second, longer sentence.")])))
        thread.start()
        thread.join()
        tts.close()
        return out["wavs"]

    for a, b in zip(render("cuda:0"), render("cuda:1")):
        assert a.shape == b.shape and float(abs(a - b).max()) < 1e-4


def test_preemption_on_the_gpu(cache, on_gpu):
    """A KV cache of a few blocks: rows are swapped out to host memory and back (non-blocking copies on the
    engine's stream, the codec state on the codec's) and every request still equals its solo rendering."""
    tc = load("tiny", cache, reference=True)
    per_position = 2 * tc.config.talker_config.num_hidden_layers * tc.config.talker_config.num_key_value_heads \
        * tc.config.talker_config.head_dim * 4
    ours = load("tiny", cache, max_rows=4, kv_cache_gb=12 * 64 * per_position / 2**30)
    kw = {"max_new_tokens": 200, "seed": 1}
    speakers = ["ryan", "eric", "serena", "vivian"]
    wavs = ours.synthesize_all([ours.request("Hello there, a long one.", speaker=s, **kw) for s in speakers])
    assert ours.engine.metrics.preemptions > 0
    entry.same(wavs, [tc.synthesize("Hello there, a long one.", speaker=s, **kw) for s in speakers])
    ours.close()


def test_memory_fits_the_budget():
    """1.7B in bf16 at batch 1 (max_rows=1, the default KV cache): a 10 s request runs with under 8 GB of GPU
    memory, weights, KV cache, CUDA graphs and codec included. Counted as PyTorch's peak allocation from the
    loaded model on, with 0.5 GB to spare for the allocator's cache: the random weights' initialisation leaves
    fp32 temporaries' segments behind (loaded from a checkpoint, `q3tts bench api` measures 7.5 GB reserved in
    all, bench/results/2026-11-26-api-h100.json)."""
    import gc

    from q3tts.benchmarks.common import clone_prompt, load_model, random_decoder
    from q3tts.engine import Engine

    gc.collect()
    torch.cuda.empty_cache()
    before = torch.cuda.memory_allocated()  # what earlier tests of this process left behind
    device = torch.device("cuda")
    model = load_model("1.7B-Base", None, device)
    decoder = random_decoder(device, torch.bfloat16)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    weights = torch.cuda.memory_allocated() - before
    engine = Engine(model, decoder, EngineConfig(max_rows=1))
    kv = engine.runner.kv.num_blocks * engine.runner.kv_bytes_per_block
    audio = engine.submit(clone_prompt(model), SamplingParams(max_new_tokens=126, seed=0)).read_all()
    assert audio.shape == (125 * 1920,)
    peak = torch.cuda.max_memory_allocated() - before
    print(f"weights {weights / 1e9:.2f} GB, KV cache {kv / 1e9:.2f} GB, peak allocated {peak / 1e9:.2f} GB")
    assert peak < 7.5e9
    engine.stop()


def test_bf16_at_least_as_faithful_as_official(tmp_path):
    """Teacher forcing on random full-size 0.6B weights: q3tts's bf16 fast path is at least as close to the
    fp32 reference as the official implementation in bf16 (needs qwen-tts-hf and the peer harness, as the GPU
    machine has them; see bench/faithfulness.py). Top-1 agreement gets 1 point of slack for sampling noise
    (~1,500 code-predictor rows)."""
    import subprocess
    import sys
    from pathlib import Path

    pytest.importorskip("qwen_tts")
    repo = Path(__file__).resolve().parents[2]
    harness = repo / ".peers/peer_bench.py"
    if not harness.exists():
        pytest.skip("the peer harness (.peers/peer_bench.py) is not here")
    from bench.faithfulness import measure

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


def test_the_rows_arming_in_one_transfer_on_the_gpu():
    """The host values of a boundary's new rows go to the device packed in one transfer (transfer.py
    `to_device_together`, CPU tensors elsewhere returned as they are): unpacked there, each has its values, dtype
    and shape, whatever the mix and order of dtypes (each part aligned for its own)."""
    from q3tts.transfer import to_device_together

    tensors = [torch.tensor([True, False, True]), torch.arange(5, dtype=torch.int32) - 2,
               torch.zeros(2, 0, dtype=torch.int32), torch.tensor([1.5, -2.25]), torch.tensor([[2**40, -7], [3, 4]])]
    for order in (tensors, tensors[::-1]):
        got = to_device_together(order, "cuda")
        assert all(g.is_cuda and g.dtype == t.dtype and torch.equal(g.cpu(), t) for g, t in zip(got, order))
