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

import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from ..engine import EngineConfig
from ..engine.runner.model_runner import ModelRunner, frame_sum
from ..engine.runner.readback import Readback
from ..kernels.sampler import sample_tokens
from ..sampling import SamplingParams
from .common import FRAME_SECONDS, clone_prompt, cuda_device, graph_ms, load_model


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


def time_request(runner: ModelRunner, prompt, batch: int, frames: int) -> tuple[float, float]:
    """Admits `batch` copies of the prompt, decodes `frames` frames; returns (total s, time to first frame s)."""
    params = [SamplingParams(max_new_tokens=frames + 1, seed=i) for i in range(batch)]
    readback = Readback(runner, depth=2)
    torch.cuda.synchronize()
    start = time.perf_counter()
    runner.add_rows(list(range(batch)), [prompt] * batch, params)
    for row in range(batch):  # the engine's loop grows rows a block at a time; here they get every block up front
        runner.grow(row, prompt.num_positions + frames + 1)
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
    for row in rows:
        runner.grow(row, prompt.num_positions + 257)
    B = runner.bucket(batch)
    embeds, counters = runner.frame_inputs(B)
    c0 = runner.sample_codebook0(B, counters, embeds[0])
    codes = runner.predict_residual_codes(B, c0, counters, embeds)
    frame = frame_sum(embeds)
    vocab = runner.model.talker.config.vocab_size
    logits_c0 = torch.randn(B, vocab, device=runner.device)
    logits_cp = torch.randn(B, runner.model.talker.code_predictor.config.vocab_size, device=runner.device)

    scratch = torch.empty_like(embeds)  # (the draws as the frame makes them, gathering into scratch rows)

    def sampling_only():
        s = runner.state
        sample_tokens(logits_c0, s.talker_sampler.prefix(B), s.seeds[:B], counters,
                      gather=[(runner.model.talker.model.codec_embedding.weight, scratch[0])])
        for g in range(15):
            sample_tokens(logits_cp, s.cp_sampler.prefix(B), s.seeds[:B], counters, offset=g + 1,
                          gather=runner.cp_gather(g, scratch)[0])

    parts = {"frame": lambda: runner.frame(B), "talker": lambda: runner.talker_step(B, c0, codes, frame),
             "code_predictor": lambda: runner.predict_residual_codes(B, c0, counters, embeds),
             "sampling": sampling_only}
    times = {name: graph_ms(fn, replays) for name, fn in parts.items()}
    runner.release_rows(rows)
    sampling_per_call = times["sampling"] / 16
    cp_net = times["code_predictor"] - 15 * sampling_per_call
    return {"frame": times["frame"], "talker": times["talker"], "code_predictor": cp_net,
            "sampling": times["sampling"],
            "overhead": times["frame"] - times["talker"] - cp_net - times["sampling"]}


def bench_decode(names: list[str], batches: list[int], n_short: int = 50, n_long: int = 200, reps: int = 2,
                 ckpt_root: Path | None = None, breakdown_batches: tuple[int, ...] = (1, 64),
                 fused: tuple[str, ...] = (EngineConfig.fused_decode,), log=print) -> list[DecodeRow]:
    """`fused`: the EngineConfig.fused_decode settings to run, each in its own rows (engine "q3tts" for the
    default, "q3tts, fused_decode=X" for the others). The prefix cache is off: every admission prefills its
    whole prompt, as the peers do."""
    device = cuda_device("q3tts bench decode")
    rows: list[DecodeRow] = []
    for name in names:
        model = load_model(name, ckpt_root, device)
        prompt = clone_prompt(model)
        for fuse in fused:
            rows += _decode_rows(model, name, prompt, batches, n_short, n_long, reps, breakdown_batches, fuse, log)
        del model
        torch.cuda.empty_cache()
    return rows


def decode_runner(model, prompt, batches: list[int], fused: str = EngineConfig.fused_decode,
                  frames: int = 257) -> ModelRunner:
    """The decode benchmark's runner (graphs not yet captured): a bucket per batch size, the prefix cache off, and
    every row of the largest batch holding its prompt and `frames` frames at once (the breakdown's rows: 257)."""
    config = EngineConfig(max_rows=max(batches), max_context=512, block_size=64, max_trailing=64,
                          buckets=tuple(batches), prefix_cache_gb=0, fused_decode=fused)
    per_row = -(-(prompt.num_positions + frames) // config.block_size)
    return ModelRunner(model, config, kv_blocks=max(batches) * per_row + 1)


def _decode_rows(model, name: str, prompt, batches: list[int], n_short: int, n_long: int, reps: int,
                 breakdown_batches: tuple[int, ...], fused: str, log) -> list[DecodeRow]:
    engine = "q3tts" if fused == EngineConfig.fused_decode else f"q3tts, fused_decode={fused}"
    start = time.perf_counter()
    runner = decode_runner(model, prompt, batches, fused, max(n_long + 1, 257))
    runner.capture_graphs()
    log(f"{name} ({engine}): {len(runner.graphs)} graphs captured in {time.perf_counter() - start:.1f} s")
    rows = []
    for batch in batches:
        torch.cuda.reset_peak_memory_stats()
        result = bench_batch(runner, prompt, batch, n_short, n_long, reps)
        parts = breakdown(runner, prompt, batch) if batch in breakdown_batches else None
        ms = result["ms_per_frame"]
        row = DecodeRow(engine=engine, benchmark="decode", model=name, batch=batch, ms_per_frame=round(ms, 3),
                        audio_s_per_s=round(batch * FRAME_SECONDS / ms * 1e3, 2),
                        x_realtime_per_stream=round(FRAME_SECONDS / ms * 1e3, 2),
                        ttff_ms=round(result["ttff_ms"], 2),
                        gpu_mem_gb=round(torch.cuda.max_memory_allocated() / 1e9, 2), frames_long=n_long,
                        frames_short=n_short, reps=reps,
                        breakdown_ms={k: round(v, 3) for k, v in parts.items()} if parts else None)
        rows.append(row)
        log(f"{name} B={batch} ({engine}): {row.ms_per_frame:.2f} ms/frame, {row.audio_s_per_s:.1f} audio-s/s, "
            f"first frame {row.ttff_ms:.1f} ms" + (f", breakdown {row.breakdown_ms}" if parts else ""))
    del runner
    torch.cuda.empty_cache()
    return rows


def side_by_side(rows: list[dict]) -> str:
    """A table of every engine's decode rows, by model and batch size (same run, same card)."""
    lines = [f"{'model':<12} {'B':>4} {'engine':<24} {'ms/frame':>9} {'audio-s/s':>10} {'x-RT/stream':>11} "
             f"{'first frame ms':>14} {'GPU GB':>7}"]
    rows = [r for r in rows if r.get("ms_per_frame") is not None]  # (a peer file's other rows, e.g. streaming)
    for r in sorted(rows, key=lambda r: (r["model"], r["batch"], r["engine"] != "q3tts", r["engine"])):
        ms = r["ms_per_frame"]
        engine = r["engine"] + (" " + r["scheduler"][:9] if r.get("scheduler") else "")
        lines.append(f"{r['model']:<12} {r['batch']:>4} {engine:<24} "
                     f"{ms:>9.2f} {r['audio_s_per_s']:>10.1f} {FRAME_SECONDS / ms * 1e3:>11.2f} "
                     f"{r.get('ttff_ms') or float('nan'):>14.1f} {r.get('gpu_mem_gb') or float('nan'):>7.2f}")
    return "\n".join(lines)
