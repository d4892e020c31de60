"""Serving load test: Poisson arrivals of streaming requests into the continuous-batching engine.

For each model and offered rate, requests (x-vector voice clones with random voices, English text, utterance
lengths uniform in 6-14 s, EOS disabled so lengths are exact) arrive as a Poisson process for `--duration`
seconds; each is consumed as a stream. Reported per rate: time to first audio (submission, prompt building
included, to the first 80 ms of PCM in the consumer) p50/p95/p99, the share of streams that ever fell behind
real time (a frame k arriving after first_audio + k x 80 ms), and aggregate audio-seconds per second. The
engine runs in-process (no HTTP): this measures the engine and scheduler, not the HTTP/encoding layer.

usage: python bench/serve_load.py --ckpt-root /tmp/peer_ckpt --sizes 1.7B-Base,0.6B-Base --rates 10,20,40
       [--duration 15] [--max-running 128] [--out results.json]   (GPU machine)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time
from pathlib import Path

import torch

from q3tts import TTS, Voice
from q3tts.serving.engine import AsyncEngine, QueueFull, ServingConfig

WORDS = ("the", "quick", "brown", "fox", "jumps", "over", "a", "lazy", "dog", "while", "seven", "bright", "stars",
         "shine", "above", "quiet", "hills", "and", "rivers", "hello", "world", "this", "is", "a", "test", "of",
         "speech", "synthesis", "please", "speak", "clearly", "slowly", "warmly")
FRAME = 0.08


def make_request(engine: AsyncEngine, tts: TTS, rng: random.Random):
    embedding = torch.randn(tts.config.talker_config.hidden_size,
                            generator=torch.Generator().manual_seed(rng.randrange(1 << 30)))
    voice = Voice(ref_code=None, ref_spk_embedding=embedding, x_vector_only_mode=True, icl_mode=False,
                  model_size=tts.config.tts_model_size)
    text = " ".join(rng.choice(WORDS) for _ in range(rng.randint(15, 35))) + "."
    frames = rng.randint(75, 175)  # 6-14 s
    spec, params = tts._request(text, None, voice, None, "english", None, rng.randrange(1 << 30),
                                {"max_new_tokens": frames + 1})
    return engine.prepare(spec), params, frames


async def consume(engine: AsyncEngine, tts: TTS, rng: random.Random, record: list) -> None:
    start = time.perf_counter()
    prompt, params, frames = make_request(engine, tts, rng)
    try:
        stream = engine.submit(prompt, params)
    except QueueFull:
        record.append({"rejected": True})
        return
    arrivals = []
    async for _ in stream:
        arrivals.append(time.perf_counter())
    first = arrivals[0]
    late = max(a - (first + k * FRAME) for k, a in enumerate(arrivals))
    record.append({"ttfa": first - start, "frames": len(arrivals), "expected": frames, "late_s": late,
                   "start": start, "end": arrivals[-1]})


async def run_rate(engine: AsyncEngine, tts: TTS, rate: float, duration: float, seed: int) -> dict:
    rng = random.Random(seed)
    record: list[dict] = []
    tasks = []
    t0 = time.perf_counter()
    next_arrival = t0
    while next_arrival - t0 < duration:
        await asyncio.sleep(max(0.0, next_arrival - time.perf_counter()))
        tasks.append(asyncio.create_task(consume(engine, tts, rng, record)))
        next_arrival += rng.expovariate(rate)
    await asyncio.gather(*tasks)
    done = [r for r in record if not r.get("rejected")]
    ttfa = sorted(r["ttfa"] * 1e3 for r in done)
    q = lambda p: ttfa[min(len(ttfa) - 1, int(p * len(ttfa)))] if ttfa else None
    audio = sum(r["frames"] for r in done) * FRAME
    span = max(r["end"] for r in done) - min(r["start"] for r in done) if done else 1.0
    assert all(r["frames"] == r["expected"] for r in done), "a stream lost or gained frames"
    return {"rps": rate, "requests": len(record), "rejected": len(record) - len(done),
            "ttfa_ms_p50": round(statistics.median(ttfa), 2) if ttfa else None,
            "ttfa_ms_p95": round(q(0.95), 2) if ttfa else None, "ttfa_ms_p99": round(q(0.99), 2) if ttfa else None,
            "behind_realtime_share": round(sum(r["late_s"] > 0 for r in done) / max(len(done), 1), 4),
            "max_late_ms": round(max((r["late_s"] for r in done), default=0) * 1e3, 1),
            "audio_s_per_s": round(audio / span, 1), "duration_s": duration}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ckpt-root", type=Path, required=True)
    parser.add_argument("--sizes", default="1.7B-Base,0.6B-Base")
    parser.add_argument("--rates", default="10,20,40")
    parser.add_argument("--duration", type=float, default=15.0)
    parser.add_argument("--max-running", type=int, default=128)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    rows = []
    for name in args.sizes.split(","):
        tts = TTS.from_pretrained(args.ckpt_root / name, device="cuda", dtype=torch.bfloat16)
        tts.model.talker.codec_head.weight.data[tts.config.talker_config.codec_eos_token_id] = 0
        engine = AsyncEngine(tts, ServingConfig(max_running=args.max_running, max_waiting=4096, max_context=512))
        engine.start()
        asyncio.run(run_rate(engine, tts, 4.0, 2.0, seed=0))  # warm-up
        for rate in [float(r) for r in args.rates.split(",")]:
            result = asyncio.run(run_rate(engine, tts, rate, args.duration, seed=int(rate)))
            row = {"engine": "q3tts", "benchmark": "serving", "model": name, "batch": args.max_running,
                   "ms_per_frame": None, "gpu_mem_gb": round(torch.cuda.max_memory_allocated() / 1e9, 2),
                   "request_mix": "x-vector clone, English, 6-14 s uniform, EOS off", **result}
            rows.append(row)
            print(json.dumps(row), flush=True)
        engine.stop()
        del engine, tts
        torch.cuda.empty_cache()
    if args.out:
        from q3tts.benchmark import write_results

        write_results(rows, args.out, "python bench/serve_load.py " + " ".join(sys.argv[1:]))


if __name__ == "__main__":
    main()
