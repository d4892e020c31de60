"""`q3tts bench decode`: the language model's decode speed on one GPU, per model and batch size.

Random weights at the real configs (or a checkpoint folder, e.g. the one the peer harness builds, so that
both engines run the same weights), EOS disabled, so every run lasts exactly the requested number of frames.
For each batch size B, B identical x-vector voice-clone requests (streaming text, English) are admitted
together and run for n_short and n_long frames; ms per frame = (T(n_long) - T(n_short)) / (n_long - n_short)
with T the wall time from admission (prefill included) to the last frame's codes in host memory, as the peer
harness measures. Also: time to the first codec frame (admission to the first codes on the host), peak GPU
memory, and a per-component breakdown from separately captured graphs of the talker step, the code
predictor (with its sampling) and the sampling kernels alone.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from .config import ModelConfig
from .engine.runner import EngineConfig, ModelRunner, Readback
from .models.qwen3_tts import Qwen3TTSModel
from .prompt import PromptSpec, build_prompt
from .random_model import random_model, random_prompt_ids
from .sampling import SamplingParams

FRAME_SECONDS = 0.08  # one codec frame = 80 ms of audio


@dataclass
class DecodeRow:
    engine: str
    benchmark: str
    model: str
    batch: int
    ms_per_frame: float
    audio_s_per_s: float
    x_realtime_per_stream: float
    ttff_ms: float
    gpu_mem_gb: float
    frames_long: int
    frames_short: int
    reps: int
    breakdown_ms: dict | None = None
    ttfa_ms_p50: float | None = None
    ttfa_ms_p95: float | None = None
    rps: float | None = None
    behind_realtime_share: float | None = None


def load_model(name: str, ckpt_root: Path | None, device: torch.device) -> Qwen3TTSModel:
    """bf16 model with EOS disabled: from `ckpt_root/name` if given, else random weights at the real config."""
    if ckpt_root is None:
        return random_model(name, device=device, dtype=torch.bfloat16, disable_eos=True)
    folder = Path(ckpt_root) / name
    model = Qwen3TTSModel.from_folder(folder, ModelConfig.from_file(folder / "config.json"), device, torch.bfloat16)
    model.talker.codec_head.weight.data[model.config.talker_config.codec_eos_token_id] = 0
    return model


def clone_prompt(model: Qwen3TTSModel, num_text_tokens: int = 30):
    """An x-vector voice-clone prompt (random speaker embedding), streaming text, English."""
    g = torch.Generator().manual_seed(0)
    spec = PromptSpec(input_ids=random_prompt_ids(model.config, num_text_tokens), language="english",
                      non_streaming_mode=False,
                      speaker_embedding=torch.randn(model.config.talker_config.hidden_size, generator=g))
    return build_prompt(model.talker, model.config, spec)


def time_request(runner: ModelRunner, prompt, batch: int, frames: int) -> tuple[float, float]:
    """Admits `batch` copies of the prompt, decodes `frames` frames; returns (total s, time to first frame s)."""
    params = [SamplingParams(max_new_tokens=frames + 1, seed=i) for i in range(batch)]
    readback = Readback(runner, depth=2)
    torch.cuda.synchronize()
    start = time.perf_counter()
    runner.add_rows(list(range(batch)), [prompt] * batch, params)
    first = None
    for i in range(frames):
        runner.step(batch)
        readback.push(batch)
        if i > 0 or frames == 1:
            readback.pop()
            first = first or time.perf_counter()
    if readback.pending:
        readback.pop()
    first = first or time.perf_counter()
    total = time.perf_counter() - start
    runner.release_rows(list(range(batch)))
    return total, first - start


def bench_batch(runner: ModelRunner, prompt, batch: int, n_short: int, n_long: int, reps: int) -> dict:
    time_request(runner, prompt, batch, 4)  # warm-up
    short = [time_request(runner, prompt, batch, n_short) for _ in range(reps)]
    long = [time_request(runner, prompt, batch, n_long) for _ in range(reps)]
    ms = (statistics.median(t for t, _ in long) - statistics.median(t for t, _ in short)) / (n_long - n_short) * 1e3
    ttff = statistics.median(f for _, f in short + long) * 1e3
    return {"ms_per_frame": ms, "ttff_ms": ttff}


def breakdown(runner: ModelRunner, prompt, batch: int, replays: int = 50) -> dict:
    """GPU time of the frame's parts, each captured as its own graph over a live batch."""
    rows = list(range(batch))
    runner.add_rows(rows, [prompt] * batch, [SamplingParams(max_new_tokens=256, seed=0)] * batch)
    B = runner.bucket(batch)
    c0, c0_embed = runner._sample_codebook0(B)
    codes, frame = runner._predict_residual_codes(B, c0, c0_embed)
    vocab = runner.model.talker.config.vocab_size
    logits_c0 = torch.randn(B, vocab, device=runner.device)
    logits_cp = torch.randn(B, runner.model.talker.code_predictor.config.vocab_size, device=runner.device)

    def sampling_only():
        from .engine.sampler import sample_tokens

        s = runner.state
        sample_tokens(logits_c0, s.talker_sampler.prefix(B), s.seeds[:B], s.steps[:B])
        for g in range(15):
            sample_tokens(logits_cp, s.cp_sampler.prefix(B), s.seeds[:B], s.steps[:B] + g)

    parts = {"frame": lambda: runner._frame(B), "talker": lambda: runner._talker_step(B, c0, codes, frame),
             "code_predictor": lambda: runner._predict_residual_codes(B, c0, c0_embed), "sampling": sampling_only}
    times = {name: _graph_ms(fn, replays) for name, fn in parts.items()}
    runner.release_rows(rows)
    sampling_per_call = times["sampling"] / 16
    cp_net = times["code_predictor"] - 15 * sampling_per_call
    return {"frame": times["frame"], "talker": times["talker"], "code_predictor": cp_net,
            "sampling": times["sampling"],
            "overhead": times["frame"] - times["talker"] - cp_net - times["sampling"]}


def _graph_ms(fn, replays: int) -> float:
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / replays


def bench_decode(names: list[str], batches: list[int], n_short: int = 50, n_long: int = 200, reps: int = 2,
                 ckpt_root: Path | None = None, breakdown_batches: tuple[int, ...] = (1, 64),
                 log=print) -> list[DecodeRow]:
    device = torch.device("cuda")
    rows: list[DecodeRow] = []
    for name in names:
        model = load_model(name, ckpt_root, device)
        prompt = clone_prompt(model)
        config = EngineConfig(max_rows=max(batches), max_context=512, block_size=64,
                              max_trailing=64, buckets=tuple(batches))
        start = time.perf_counter()
        runner = ModelRunner(model, config)
        runner.capture_graphs()
        log(f"{name}: {len(runner.graphs)} graphs captured in {time.perf_counter() - start:.1f} s")
        for batch in batches:
            torch.cuda.reset_peak_memory_stats()
            result = bench_batch(runner, prompt, batch, n_short, n_long, reps)
            parts = breakdown(runner, prompt, batch) if batch in breakdown_batches else None
            ms = result["ms_per_frame"]
            row = DecodeRow(engine="q3tts", benchmark="decode", model=name, batch=batch, ms_per_frame=round(ms, 3),
                            audio_s_per_s=round(batch * FRAME_SECONDS / ms * 1e3, 2),
                            x_realtime_per_stream=round(FRAME_SECONDS / ms * 1e3, 2),
                            ttff_ms=round(result["ttff_ms"], 2),
                            gpu_mem_gb=round(torch.cuda.max_memory_allocated() / 1e9, 2), frames_long=n_long,
                            frames_short=n_short, reps=reps,
                            breakdown_ms={k: round(v, 3) for k, v in parts.items()} if parts else None)
            rows.append(row)
            log(f"{name} B={batch}: {row.ms_per_frame:.2f} ms/frame, {row.audio_s_per_s:.1f} audio-s/s, "
                f"first frame {row.ttff_ms:.1f} ms" + (f", breakdown {row.breakdown_ms}" if parts else ""))
        del runner, model
        torch.cuda.empty_cache()
    return rows


def write_results(rows: list, path: Path, command: str, extra_rows: list[dict] | None = None) -> dict:
    """One JSON file in the shared/bench/RESULTS.md format (ours first, then any peer rows of the same run)."""
    # The GPU machine gets a copy of the working tree without .git: the caller passes the commit there.
    commit = os.environ.get("Q3TTS_COMMIT") or subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    doc = {"card": torch.cuda.get_device_name(), "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
           "commit": commit or None, "command": command,
           "env": {"torch": torch.__version__, "cuda": torch.version.cuda},
           "results": [asdict(r) if isinstance(r, DecodeRow) else r for r in rows] + (extra_rows or [])}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=2))
    return doc


def side_by_side(rows: list[dict]) -> str:
    """A table of every engine's decode rows, by model and batch size (same run, same card)."""
    lines = [f"{'model':<12} {'B':>4} {'engine':<24} {'ms/frame':>9} {'audio-s/s':>10} {'x-RT/stream':>11} "
             f"{'first frame ms':>14} {'GPU GB':>7}"]
    for r in sorted(rows, key=lambda r: (r["model"], r["batch"], r["engine"] != "q3tts", r["engine"])):
        ms = r["ms_per_frame"]
        engine = r["engine"] + (" " + r["scheduler"][:9] if r.get("scheduler") else "")
        lines.append(f"{r['model']:<12} {r['batch']:>4} {engine:<24} "
                     f"{ms:>9.2f} {r['audio_s_per_s']:>10.1f} {FRAME_SECONDS / ms * 1e3:>11.2f} "
                     f"{r.get('ttff_ms') or float('nan'):>14.1f} {r.get('gpu_mem_gb') or float('nan'):>7.2f}")
    return "\n".join(lines)


def bench_streaming(names: list[str], ckpt_root: Path | None, concurrency: tuple[int, ...] = (1, 16, 64),
                    reps: int = 5, log=print) -> list[dict]:
    """Time to first audio (request -> first PCM on the host) and the codec's GPU cost, per model."""
    from .models.speech_tokenizer import SpeechTokenizer
    from .streaming import Engine

    device = torch.device("cuda")
    rows: list[dict] = []
    for name in names:
        model = load_model(name, ckpt_root, device)
        st_dir = Path(ckpt_root) / name / "speech_tokenizer" if ckpt_root else None
        decoder = (SpeechTokenizer.from_pretrained(st_dir, device, torch.bfloat16, load_encoder=False).decoder
                   if st_dir else _random_decoder(device, torch.bfloat16))
        engine = Engine(model, decoder, EngineConfig(max_rows=max(concurrency), max_context=512, max_trailing=64,
                                                     buckets=tuple(sorted({1, 2, 4, 8, 16, 32, 64, *concurrency}))))
        engine.capture_graphs()
        for batch in concurrency:
            row = _streaming_row(engine, model, name, batch, reps)
            rows.append(row)
            log(f"{name} B={batch}: first audio p50 {row['ttfa_ms_p50']} ms p95 {row['ttfa_ms_p95']} ms; LM "
                f"{row['lm_frame_gpu_ms']} ms + codec {row['codec_frame_gpu_ms']} ms per frame step "
                f"({row['codec_share_of_lm']:.0%}); streaming loop {row['step_ms_codec_overlapped']} ms per step "
                f"with the codec overlapped, {row['step_ms_codec_sequential']} ms sequential")
        del engine, model, decoder
        torch.cuda.empty_cache()
    return rows


def _streaming_row(engine, model, name: str, batch: int, reps: int) -> dict:
    first_audio_ms(engine, model, batch)  # warm-up: the first prefill of a new shape compiles and autotunes
    flat = sorted(t for _ in range(reps) for t in first_audio_ms(engine, model, batch))
    lm_ms = _graph_ms(lambda: engine.runner._frame(engine.runner.bucket(batch)), 30)
    codec_ms = _graph_ms(lambda: engine.codec._decode(engine.runner.bucket(batch)), 30)
    sequential = _loop_ms(engine, model, batch, False)
    # Overlap is measured where the engine uses it (see CodecRunner.overlap_max_rows).
    overlapped = _loop_ms(engine, model, batch, True) if batch <= engine.codec.overlap_max_rows else sequential
    return {"engine": "q3tts", "benchmark": "streaming", "model": name, "batch": batch,
            "ms_per_frame": round(overlapped, 3), "audio_s_per_s": round(batch * FRAME_SECONDS / overlapped * 1e3, 1),
            "ttfa_ms_p50": round(statistics.median(flat), 2),
            "ttfa_ms_p95": round(flat[min(len(flat) - 1, int(0.95 * len(flat)))], 2), "rps": None,
            "behind_realtime_share": None, "gpu_mem_gb": round(torch.cuda.max_memory_allocated() / 1e9, 2),
            "lm_frame_gpu_ms": round(lm_ms, 3), "codec_frame_gpu_ms": round(codec_ms, 3),
            "codec_gpu_ms_per_audio_s": round(codec_ms / (batch * FRAME_SECONDS), 3),
            "codec_share_of_lm": round(codec_ms / lm_ms, 3), "step_ms_codec_overlapped": round(overlapped, 3),
            "step_ms_codec_sequential": round(sequential, 3), "chunk_schedule": "1,2,4,8,16"}


def _loop_ms(engine, model, batch: int, overlap: bool, frames: int = 40) -> float:
    """Wall ms per frame step of the streaming loop (LM frame, codec decode, PCM to the host one frame
    behind), with the codec on its own stream (overlap) or after the LM on the same stream."""
    runner, codec = engine.runner, engine.codec
    saved = codec.overlap_max_rows
    codec.overlap_max_rows = batch if overlap else 0
    rows = list(range(batch))
    runner.add_rows(rows, [clone_prompt(model)] * batch,
                    [SamplingParams(max_new_tokens=frames + 10, seed=i) for i in rows])
    codec.start(rows, [None] * batch)
    readback = Readback(runner, depth=2, pcm=codec.pcm, pcm_stream=codec.pcm_stream)
    start = None
    for i in range(frames + 5):
        if i == 5:
            start = time.perf_counter()
        runner.step(batch)
        codec.step(batch)
        readback.push(batch)
        if len(readback.pending) == 2:
            readback.pop()
    while readback.pending:
        readback.pop()
    elapsed = time.perf_counter() - start
    runner.release_rows(rows)
    codec.overlap_max_rows = saved
    return elapsed / frames * 1e3


def peer_streaming_rows(paths: list[Path]) -> list[dict]:
    """faster-qwen3-tts's streaming time to first audio from the peer harness's peer_<config>.json files."""
    rows = []
    for path in paths:
        data = json.loads(Path(path).read_text())
        for r in data["results"]:
            if not r.get("audio_streaming") or r.get("ttfa_ms") is None:
                continue
            rows.append({"engine": r["engine"].split("(")[0], "benchmark": "streaming", "model": r["model"],
                         "batch": 1, "ms_per_frame": None, "audio_s_per_s": None,
                         "ttfa_ms_p50": round(r["ttfa_ms"], 2), "ttfa_ms_p95": None, "rps": None,
                         "behind_realtime_share": None, "gpu_mem_gb": None, "mode": r.get("mode"),
                         "chunk_size": 12, "ttfa_chunk8_ms": round(r["ttfa_chunk8_ms"], 2)
                         if r.get("ttfa_chunk8_ms") is not None else None,
                         "ttfa_all_ms": [round(t, 2) for t in r.get("ttfa_ms_all", [])], "source": "this run"})
    return rows


def first_audio_ms(engine, model, batch: int) -> list[float]:
    """`batch` requests submitted together: ms from submission (text ids in hand) to each stream's first PCM
    on the host (prompt building, prefill, first frame, its decode and the copy included)."""
    runner, codec = engine.runner, engine.codec
    torch.cuda.synchronize()
    start = time.perf_counter()
    prompts = [clone_prompt(model) for _ in range(batch)]
    rows = list(range(batch))
    runner.add_rows(rows, prompts, [SamplingParams(max_new_tokens=20, seed=i) for i in rows])
    codec.start(rows, [None] * batch)
    readback = Readback(runner, depth=2, pcm=codec.pcm, pcm_stream=codec.pcm_stream)
    runner.step(batch)
    codec.step(batch)
    readback.push(batch)
    out = readback.pop()
    arrived = (time.perf_counter() - start) * 1e3
    assert bool(out.emitted.all()) and out.pcm.abs().sum() > 0
    runner.release_rows(rows)
    return [arrived] * batch


def _random_decoder(device: torch.device, dtype: torch.dtype):
    """The full-size codec decoder with random weights, conditioned as the tiny checkpoints are (each
    upsampling block rescaled to unit output, the waveform peaking at 0.5), so that its audio is not clipped
    noise and precision comparisons mean something."""
    from .checkpoint import instantiate
    from .config import SpeechTokenizerConfig
    from .models.codec_decoder import CodecDecoder
    from .random_model import CONFIG_DIR
    from .tiny.random_init import random_state_dict
    from .tiny.speech_tokenizer import condition_vocoder

    config = SpeechTokenizerConfig.from_file(CONFIG_DIR / "speech_tokenizer.json")
    with torch.device("meta"):
        shapes = {"decoder." + k: tuple(v.shape) for k, v in CodecDecoder(config.decoder_config).state_dict().items()}
    tensors = random_state_dict(shapes, 0, device)
    condition_vocoder(tensors, config, 0)
    tensors = {k.removeprefix("decoder."): v.to(dtype) for k, v in tensors.items()}
    return instantiate(lambda: CodecDecoder(config.decoder_config), tensors, device).eval()


def codec_precision(frames: int = 100) -> dict:
    """bf16 vs fp32 incremental decode of the same random codes (conditioned random weights; the peer
    checkpoints' unconditioned random vocoder clips to +-1 and amplifies any rounding into noise): max |diff|
    and SNR of the audio."""
    from .models.codec_streaming import StreamingDecoder

    device = torch.device("cuda")
    codes = torch.randint(0, 2048, (1, 16, frames), generator=torch.Generator().manual_seed(0)).to(device)
    out = {}
    for dtype in (torch.float32, torch.bfloat16):
        decoder = _random_decoder(device, dtype)
        stream = StreamingDecoder(decoder, 1)
        out[dtype] = torch.cat([stream.decode(codes[:, :, t:t + 1]) for t in range(frames)], -1).float()
    diff = out[torch.bfloat16] - out[torch.float32]
    snr = 10 * torch.log10(out[torch.float32].pow(2).mean() / diff.pow(2).mean().clamp(min=1e-30))
    return {"frames": frames, "max_abs_diff": float(diff.abs().max()), "rms_fp32": float(out[torch.float32].pow(2)
            .mean().sqrt()), "snr_db": float(snr)}
