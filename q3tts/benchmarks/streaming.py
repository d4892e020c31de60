"""`q3tts bench streaming`: time to first audio (request to the first PCM on the host) at 1, 16 and 64
streams, the codec's GPU cost next to the language model's, the streaming loop with and without the codec
overlapped, the bf16 codec's error against fp32, and first audio per voice kind (x-vector, in-context with 3 s
and 10 s references) with the voice's prompt prefix cached and not, at 1 and 64 streams."""

from __future__ import annotations

import itertools
import json
import statistics
import time
from pathlib import Path

import torch

from ..engine import Engine, EngineConfig
from ..engine.runner.codec_stream import StreamingDecoder
from ..engine.runner.readback import Readback
from ..models.speech_tokenizer import SpeechTokenizer
from ..request.prompt import build_prompts
from ..sampling import SamplingParams
from .common import (
    FRAME_SECONDS,
    clone_prompt,
    cuda_device,
    graph_ms,
    load_model,
    random_decoder,
    voice_prompt,
    voice_spec,
)


def bench_streaming(names: list[str], ckpt_root: Path | None, concurrency: tuple[int, ...] = (1, 16, 64),
                    reps: int = 5, log=print) -> list[dict]:
    """Time to first audio (request -> first PCM on the host) and the codec's GPU cost, per model."""
    device = cuda_device("q3tts bench streaming")
    rows: list[dict] = []
    for name in names:
        model = load_model(name, ckpt_root, device)
        st_dir = Path(ckpt_root) / name / "speech_tokenizer" if ckpt_root else None
        decoder = (SpeechTokenizer.from_pretrained(st_dir, device, torch.bfloat16, load_encoder=False).decoder
                   if st_dir else random_decoder(device, torch.bfloat16))
        engine = streaming_engine(model, decoder, concurrency)
        for batch in concurrency:
            row = _streaming_row(engine, model, name, batch, reps)
            rows.append(row)
            parts = ", ".join(f"{k} {row[f'ttfa_{k}_ms_p50']}" for k in ("prompt", "prefill", "frame", "decode"))
            log(f"{name} B={batch}: first audio p50 {row['ttfa_ms_p50']} ms p95 {row['ttfa_ms_p95']} ms ({parts} ms "
                f"synchronised); LM "
                f"{row['lm_frame_gpu_ms']} ms + codec {row['codec_frame_gpu_ms']} ms per frame step "
                f"({row['codec_share_of_lm']:.0%}); streaming loop {row['step_ms_codec_overlapped']} ms per step "
                f"with the codec overlapped, {row['step_ms_codec_sequential']} ms sequential")
        for row in voice_rows(engine, model, name, tuple(b for b in (1, 64) if b in concurrency), reps):
            rows.append(row)
            where = f" ({row['prefix_positions']} of {row['prompt_positions']} positions)" \
                if "prefix_positions" in row else ""
            log(f"{name} B={row['batch']} {row['voice']}, prefix {'cached' if row['prefix_cached'] else 'not cached'}"
                f"{where}: first audio p50 {row['ttfa_ms_p50']} ms p95 {row['ttfa_ms_p95']} ms")
        del engine, model, decoder
        torch.cuda.empty_cache()
    return rows


def streaming_engine(model, decoder, batches) -> Engine:
    """The engine with graphs captured for `batches` (and the powers of two up to 64); its runner and codec
    runner are driven directly here, without the engine's thread."""
    return Engine(model, decoder, EngineConfig(max_rows=max(batches), max_context=512, max_trailing=64,
                                               buckets=tuple(sorted({1, 2, 4, 8, 16, 32, 64, *batches}))))


def _streaming_row(engine, model, name: str, batch: int, reps: int) -> dict:
    first_audio_ms(engine, model, batch)  # warm-up: the first prefill of a new shape compiles and autotunes
    flat = sorted(t for _ in range(reps) for t in first_audio_ms(engine, model, batch))
    phases = [{} for _ in range(reps)]
    for ph in phases:
        first_audio_ms(engine, model, batch, ph)
    lm_ms = graph_ms(lambda: engine.runner.frame(engine.runner.bucket(batch)), 30)
    codec_ms = graph_ms(lambda: engine.codec.decode(engine.runner.bucket(batch)), 30)
    sequential = loop_ms(engine, model, batch, False)
    overlapped = loop_ms(engine, model, batch, True)
    return {"engine": "q3tts", "benchmark": "streaming", "model": name, "batch": batch,
            "ms_per_frame": round(overlapped, 3), "audio_s_per_s": round(batch * FRAME_SECONDS / overlapped * 1e3, 1),
            "ttfa_ms_p50": round(statistics.median(flat), 2),
            "ttfa_ms_p95": round(flat[min(len(flat) - 1, int(0.95 * len(flat)))], 2), "rps": None,
            "behind_realtime_share": None, "gpu_mem_gb": round(torch.cuda.max_memory_allocated() / 1e9, 2),
            "lm_frame_gpu_ms": round(lm_ms, 3), "codec_frame_gpu_ms": round(codec_ms, 3),
            "codec_gpu_ms_per_audio_s": round(codec_ms / (batch * FRAME_SECONDS), 3),
            "codec_share_of_lm": round(codec_ms / lm_ms, 3), "step_ms_codec_overlapped": round(overlapped, 3),
            "step_ms_codec_sequential": round(sequential, 3), "chunk_schedule": "1,2,4,8,16",
            **{f"ttfa_{k}_ms_p50": round(statistics.median(ph[k] for ph in phases), 2) for k in phases[0]}}


def loop_ms(engine, model, batch: int, overlap: bool, frames: int = 40) -> float:
    """Wall ms per frame step of the streaming loop (LM frame, codec decode, PCM to the host one frame
    behind), with the codec on its own stream (overlap) or after the LM on the same stream."""
    runner, codec = engine.runner, engine.codec
    saved = codec.overlap_max_rows
    codec.overlap_max_rows = batch if overlap else 0
    rows = list(range(batch))
    prompt = clone_prompt(model)
    runner.add_rows(rows, [prompt] * batch, [SamplingParams(max_new_tokens=frames + 10, seed=i) for i in rows])
    for row in rows:  # the engine's loop grows rows a block at a time; here they get every block up front
        runner.grow(row, prompt.num_positions + frames + 10)
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


def first_audio_ms(engine, model, batch: int, phases: dict[str, float] | None = None, ref_seconds: float = 0.0,
                   cached: bool = False, new_voices: bool = False) -> list[float]:
    """`batch` requests in one voice with different texts (`new_voices`: each in an x-vector voice never seen before),
    submitted together: ms from submission (text ids and voices in hand) to each stream's first PCM on the host (prompt
    building, prefill, first frame, its decode and the copy included). The voice: an x-vector, or with `ref_seconds`
    an in-context voice with a reference that long. `cached`: the voice's prompt prefix (and an in-context voice's
    codec state) is in the engine's caches beforehand (one earlier request); otherwise the caches are off for the
    run (the burst still decodes its one reference once). With `phases` (a dict to fill) the device is synchronised
    after each phase and its ms recorded: prompt building, prefill (row setup included), the first frame, its decode
    + copy (the syncs keep the GPU from running ahead, so the phases add up to a little more than an unsynchronised
    run)."""
    runner, codec = engine.runner, engine.codec
    sync = torch.cuda.synchronize if runner.device.type == "cuda" else lambda: None
    saved = runner.prefix_cache, codec.references
    if not cached:
        runner.prefix_cache = codec.references = None
    elif saved[0] is not None:  # one earlier request with the voice
        prompt, ref_codes = voice_prompt(model, seed=0, ref_seconds=ref_seconds, text_seed=batch + 1)
        runner.add_rows([0], [prompt], [SamplingParams(max_new_tokens=20)])
        codec.start([0], [ref_codes])
        runner.release_rows([0])
    specs = burst_specs(model, batch, ref_seconds, new_voices)
    try:
        sync()
        start = time.perf_counter()
        marks = [start]

        def phase(name: str) -> None:
            if phases is not None:
                sync()
                marks.append(time.perf_counter())
                phases[name] = (marks[-1] - marks[-2]) * 1e3

        prompts = build_prompts(model.talker, model.config, specs)  # together, as the server builds a burst's
        phase("prompt")
        rows = list(range(batch))
        runner.add_rows(rows, prompts, [SamplingParams(max_new_tokens=20, seed=i) for i in rows])
        codec.start(rows, [spec.ref_codes for spec in specs])
        phase("prefill")
        readback = Readback(runner, depth=2, pcm=codec.pcm, pcm_stream=codec.pcm_stream)
        runner.step(batch)
        phase("frame")
        codec.step(batch)
        readback.push(batch)
        out = readback.pop()
        arrived = (time.perf_counter() - start) * 1e3
        phase("decode")
        assert bool(out.emitted.all()) and out.pcm.abs().sum() > 0
        runner.release_rows(rows)
    finally:
        runner.prefix_cache, codec.references = saved
    return [arrived] * batch


def burst_specs(model, batch: int, ref_seconds: float = 0.0, new_voices: bool = False) -> list:
    """A burst's requests: `batch` texts in one voice (seed 0; an in-context voice with `ref_seconds`), or each
    in an x-vector voice never seen before (`new_voices`). One voice is one set of tensors, as a voice the server
    holds is for all its requests (its digests are computed once)."""
    seeds = [next(_new_voice_seeds) for _ in range(batch)] if new_voices else [0] * batch
    specs = [voice_spec(model, seed=seed, ref_seconds=ref_seconds, text_seed=i + 1) for i, seed in enumerate(seeds)]
    if not new_voices:
        for spec in specs[1:]:
            spec.speaker_embedding, spec.ref_codes = specs[0].speaker_embedding, specs[0].ref_codes
    return specs


_new_voice_seeds = itertools.count(1_000_000)  # speaker embeddings never drawn before in this process


def voice_rows(engine, model, name: str, batches: tuple[int, ...], reps: int,
               references: tuple[float, ...] = (0.0, 3.0, 10.0)) -> list[dict]:
    """First audio per voice kind (x-vector; in-context with 3 s and 10 s references), its prompt prefix cached
    or not, at each batch: `batch` requests in one voice submitted together; and `batch` requests each in an
    x-vector voice never seen before."""
    def row(batch: int, voice: str, cached: bool, about: dict, **kind) -> dict:
        first_audio_ms(engine, model, batch, cached=cached, **kind)  # warm-up
        flat = sorted(t for _ in range(reps) for t in first_audio_ms(engine, model, batch, cached=cached, **kind))
        return {"engine": "q3tts", "benchmark": "first_audio_by_voice", "model": name, "batch": batch,
                "voice": voice, "prefix_cached": cached, **about, "ttfa_ms_p50": round(statistics.median(flat), 2),
                "ttfa_ms_p95": round(flat[min(len(flat) - 1, int(0.95 * len(flat)))], 2),
                "ms_per_frame": None, "audio_s_per_s": None, "rps": None, "gpu_mem_gb": None}

    rows = [row(batch, "x-vector, a new voice per stream", False, {}, new_voices=True) for batch in batches]
    for ref_seconds in references:
        prompt, _ = voice_prompt(model, seed=0, ref_seconds=ref_seconds, text_seed=1)
        about = {"prompt_positions": prompt.num_positions, "prefix_positions": prompt.prefix_len}
        voice = f"in-context {ref_seconds:g} s" if ref_seconds else "x-vector"
        rows += [row(batch, voice, cached, about, ref_seconds=ref_seconds) for batch in batches
                 for cached in (False, True)]
    return rows


def codec_precision(frames: int = 100) -> dict:
    """bf16 vs fp32 incremental decode of the same random codes (conditioned random weights; the peer
    checkpoints' unconditioned random vocoder clips to +-1 and amplifies any rounding into noise): max |diff|
    and SNR of the audio."""
    device = cuda_device("q3tts bench streaming")
    codes = torch.randint(0, 2048, (1, 16, frames), generator=torch.Generator().manual_seed(0)).to(device)
    out = {}
    for dtype in (torch.float32, torch.bfloat16):
        decoder = random_decoder(device, dtype)
        stream = StreamingDecoder(decoder, 1)
        out[dtype] = torch.cat([stream.decode(codes[:, :, t:t + 1]) for t in range(frames)], -1).float()
    diff = out[torch.bfloat16] - out[torch.float32]
    snr = 10 * torch.log10(out[torch.float32].pow(2).mean() / diff.pow(2).mean().clamp(min=1e-30))
    return {"frames": frames, "max_abs_diff": float(diff.abs().max()), "rms_fp32": float(out[torch.float32].pow(2)
            .mean().sqrt()), "snr_db": float(snr)}
