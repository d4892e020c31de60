"""`q3tts bench api`: every public entry point on the same checkpoint, as a user calls it.

Per model: the drop-in `generate_voice_clone` with one text, with 8 and with 64 texts, `TTS.synthesize`, and
`TTS.stream` consumed whole, all through the model's one engine (bf16, CUDA graphs), x-vector voice clones
(the voice prepared once with `create_voice_clone_prompt`, as the official API reuses a voice), English text,
EOS disabled so that every call lasts exactly the requested frames. For each entry point and batch B:
T(N) = wall time of the call for N frames per text (audio returned as numpy, codec included), medians over
`reps`; ms per frame = (T(N_long) - T(N_short)) / (N_long - N_short), the steady cost of one frame step of all B
rows, as the peer harness measures it; audio-s/s = B x N_long x 0.08 / T(N_long), end to end. GPU memory: the
peak reserved by PyTorch's allocator while the entry point ran (weights, KV cache, graphs and codec state of
the engine included), and once more for an engine built for one row (`max_rows=1`).
"""

from __future__ import annotations

import gc
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from ..api.tts import TTS
from .common import FRAME_SECONDS, cuda_device

TEXT = ("Hello world, this is a test of speech synthesis in a voice cloned from a short reference, spoken at an "
        "even pace from the first word to the last one.")


def load(folder: Path, **engine) -> TTS:
    """The checkpoint in bf16 with EOS disabled (fixed lengths)."""
    tts = TTS.from_pretrained(folder, device="cuda", dtype=torch.bfloat16, **engine)
    tts.model.talker.codec_head.weight.data[tts.config.talker_config.codec_eos_token_id] = 0
    return tts


def entry_points(tts: TTS, voice) -> dict[str, tuple[int, Callable[[int], list[np.ndarray]]]]:
    """name -> (texts per call, call(frames) returning the audio)."""
    common = {"language": "english", "seed": 1}

    def clone(n: int) -> Callable[[int], list[np.ndarray]]:
        return lambda frames: tts.generate_voice_clone([TEXT] * n, voice_clone_prompt=voice,
                                                       max_new_tokens=frames + 1, **common)[0]

    def stream(frames: int) -> list[np.ndarray]:
        return [np.concatenate([c.pcm for c in tts.stream(TEXT, voice=voice[0], max_new_tokens=frames + 1,
                                                          **common)])]

    return {"generate_voice_clone": (1, clone(1)), "generate_voice_clone x8": (8, clone(8)),
            "generate_voice_clone x64": (64, clone(64)),
            "synthesize": (1, lambda frames: [tts.synthesize(TEXT, voice=voice[0], max_new_tokens=frames + 1,
                                                              **common)]),
            "stream": (1, stream)}


def time_entry(call: Callable[[int], list[np.ndarray]], batch: int, n_short: int, n_long: int, reps: int) -> dict:
    def timed(frames: int) -> float:
        torch.cuda.synchronize()
        start = time.perf_counter()
        wavs = call(frames)
        elapsed = time.perf_counter() - start
        assert len(wavs) == batch and all(w.shape[0] == frames * 1920 for w in wavs), "frame count varied"
        return elapsed

    timed(n_short)  # warm-up (the first call of a new batch size prefills new shapes)
    short = statistics.median(timed(n_short) for _ in range(reps))
    long = statistics.median(timed(n_long) for _ in range(reps))
    ms = (long - short) / (n_long - n_short) * 1e3
    return {"ms_per_frame": round(ms, 3), "audio_s_per_s": round(batch * n_long * FRAME_SECONDS / long, 2),
            "wall_long_s": round(long, 4), "wall_short_s": round(short, 4)}


def bench_api(names: list[str], ckpt_root: Path, n_short: int = 50, n_long: int = 125, reps: int = 2,
              log=print) -> list[dict]:
    cuda_device("q3tts bench api")  # (a clear error on a machine without a GPU, before any checkpoint loads)
    rows = []
    for name in names:
        rows += _bench_model(Path(ckpt_root) / name, name, n_short, n_long, reps, log)
        gc.collect()  # the model of the last run goes before the next is loaded
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        rows.append(_bench_small(Path(ckpt_root) / name, name, n_short, n_long, reps, log))
        gc.collect()
        torch.cuda.empty_cache()
    return rows


def _voice(tts: TTS):
    reference = (np.sin(np.arange(72000) / 24000 * 2 * np.pi * 140) * 0.3).astype(np.float32)
    return tts.create_voice_clone_prompt((reference, 24000), x_vector_only_mode=True)


def _bench_model(folder: Path, name: str, n_short: int, n_long: int, reps: int, log) -> list[dict]:
    """Every entry point with the default engine (64 rows)."""
    tts, rows = load(folder), []
    voice = _voice(tts)
    start = time.perf_counter()
    tts.prepare_engine()
    log(f"{name}: engine built in {time.perf_counter() - start:.1f} s "
        f"({tts.engine.runner.kv.num_blocks} KV blocks, buckets {tts.engine.config.buckets})")
    for entry, (batch, call) in entry_points(tts, voice).items():
        torch.cuda.reset_peak_memory_stats()
        result = time_entry(call, batch, n_short, n_long, reps)
        rows.append(_row(name, entry, batch, result, n_short, n_long, reps))
        log(f"{name} {entry}: {result}")
    tts.close()
    return rows


def _bench_small(folder: Path, name: str, n_short: int, n_long: int, reps: int, log) -> dict:
    """`synthesize` with an engine built for one row: the memory a single-stream user needs."""
    tts = load(folder, max_rows=1)
    result = time_entry(entry_points(tts, _voice(tts))["synthesize"][1], 1, n_short, n_long, reps)
    log(f"{name} synthesize, max_rows=1: {result}")
    tts.close()
    return _row(name, "synthesize (max_rows=1)", 1, result, n_short, n_long, reps)


def _row(model: str, entry: str, batch: int, result: dict, n_short: int, n_long: int, reps: int) -> dict:
    return {"engine": "q3tts", "benchmark": "api", "entry": entry, "model": model, "batch": batch, **result,
            "ttfa_ms_p50": None, "ttfa_ms_p95": None, "rps": None, "behind_realtime_share": None,
            "gpu_mem_gb": round(torch.cuda.max_memory_reserved() / 1e9, 2), "frames_long": n_long,
            "frames_short": n_short, "reps": reps, "voice": "x-vector clone (prepared once)"}


def peer_api_rows(paths: list[Path]) -> list[dict]:
    """faster-qwen3-tts's `generate_voice_clone` (whole audio, x-vector) rows of the peer harness's
    peer_<config>.json files of the same run, as api rows."""
    import json

    rows = []
    for path in paths:
        for r in json.loads(Path(path).read_text())["results"]:
            if r.get("audio_streaming") or r.get("mode") != "xvec" or r.get("batch", 1) != 1:
                continue
            rows.append({"engine": r["engine"].split("(")[0].strip(), "benchmark": "api",
                         "entry": "generate_voice_clone", "model": r["model"], "batch": 1,
                         "ms_per_frame": round(r["ms_per_frame_steady"], 3),
                         "audio_s_per_s": round(r["audio_s_per_s"], 2), "ttfa_ms_p50": None, "ttfa_ms_p95": None,
                         "rps": None, "behind_realtime_share": None,
                         "gpu_mem_gb": round(r["peak_gpu_mem_gib"] * 2**30 / 1e9, 2)
                         if r.get("peak_gpu_mem_gib") else None,
                         "frames_long": r["frames_long"], "frames_short": r["frames_short"], "reps": r["reps"],
                         "source": "this run"})
    return rows


def table(rows: list[dict]) -> str:
    lines = [f"{'model':<11} {'entry':<28} {'engine':<18} {'B':>3} {'ms/frame':>9} {'audio-s/s':>10} {'GPU GB':>7}"]
    for r in sorted(rows, key=lambda r: (r["model"], r["engine"] != "q3tts", r["batch"], r["entry"])):
        lines.append(f"{r['model']:<11} {r['entry']:<28} {r['engine']:<18} {r['batch']:>3} {r['ms_per_frame']:>9.2f} "
                     f"{r['audio_s_per_s']:>10.1f} {r['gpu_mem_gb'] or float('nan'):>7.2f}")
    return "\n".join(lines)
