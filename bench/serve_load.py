"""Serving load test: Poisson arrivals of streaming requests into the continuous-batching engine.

For each model and offered rate, requests (x-vector voice clones with random voices, English text, utterance
lengths uniform in 6-14 s, EOS disabled so lengths are exact) arrive as a Poisson process for `--duration`
seconds; each is consumed as a stream. Reported per rate: time to first audio (submission, prompt building
included, to the first 80 ms of PCM in the consumer) p50/p95/p99, the share of streams that ever fell behind
real time (a frame k arriving after first_audio + k x 80 ms), and aggregate audio-seconds per second. The
engine runs in-process (engine and scheduler only), or, with `--http URL`, requests go to a running
`q3tts serve` as OpenAI speech requests streamed as raw PCM (the whole serving path: HTTP, validation,
encoding, the client's own parsing), with a voice uploaded once at the start. `--profile-loop` (in-process)
adds where the engine thread's time goes per loop iteration (host phases, and the waits for the device).

usage: python bench/serve_load.py --ckpt-root /tmp/peer_ckpt --sizes 1.7B-Base,0.6B-Base --rates 10,20,40
       [--duration 15] [--max-running 128] [--profile-loop] [--out results.json]   (GPU machine)
       python bench/serve_load.py --http http://127.0.0.1:8000 --rates 10,20,40 [--clients 4] [--out results.json]
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import gc
import io
import json
import random
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import soundfile as sf
import torch

from q3tts import TTS, EngineConfig, QueueFull, Voice

WORDS = ("the", "quick", "brown", "fox", "jumps", "over", "a", "lazy", "dog", "while", "seven", "bright", "stars",
         "shine", "above", "quiet", "hills", "and", "rivers", "hello", "world", "this", "is", "a", "test", "of",
         "speech", "synthesis", "please", "speak", "clearly", "slowly", "warmly")
FRAME = 0.08
BYTES_PER_FRAME = 1920 * 2  # 24 kHz 16-bit mono


def make_request(tts: TTS, rng: random.Random):
    embedding = torch.randn(tts.config.talker_config.hidden_size,
                            generator=torch.Generator().manual_seed(rng.randrange(1 << 30)))
    voice = Voice(ref_code=None, ref_spk_embedding=embedding, x_vector_only_mode=True, icl_mode=False,
                  model_size=tts.config.tts_model_size)
    text = " ".join(rng.choice(WORDS) for _ in range(rng.randint(15, 35))) + "."
    frames = rng.randint(75, 175)  # 6-14 s
    request = tts.request(text, voice=voice, language="english", seed=rng.randrange(1 << 30),
                          max_new_tokens=frames + 1)
    return request, tts.prepare(request), frames


async def consume(tts: TTS, rng: random.Random, record: list) -> None:
    start = time.perf_counter()
    request, prompt, frames = make_request(tts, rng)
    try:
        submitted = time.perf_counter()
        stream = tts.engine.submit(prompt, request.params, asyncio_loop=True)
    except QueueFull:
        record.append({"rejected": True})
        return
    arrivals = []
    async for _ in stream:
        arrivals.append(time.perf_counter())
    first = arrivals[0]
    late = max(a - (first + k * FRAME) for k, a in enumerate(arrivals))
    record.append({"ttfa": first - start, "frames": len(arrivals), "expected": frames, "late_s": late,
                   "start": start, "end": arrivals[-1], "prepare": submitted - start,
                   "queue": stream.channel.admitted, "after_admission": first - submitted - stream.channel.admitted})


async def consume_http(client, model: str, voice: str, rng: random.Random, record: list) -> None:
    """One streamed OpenAI speech request (raw 16-bit PCM); frame deadlines checked chunk by chunk. `client`: an
    httpx.AsyncClient on the server, or an openai.AsyncOpenAI (the same request through the openai package)."""
    text = " ".join(rng.choice(WORDS) for _ in range(rng.randint(15, 35))) + "."
    frames = rng.randint(75, 175)
    body = {"model": model, "input": text, "voice": voice, "response_format": "pcm", "language": "english",
            "max_new_tokens": frames + 1, "seed": rng.randrange(1 << 30)}
    start = time.perf_counter()
    received, first, late = 0, None, 0.0
    sdk = hasattr(client, "audio")
    try:
        async with _speech(client, body) as response:
            if response.status_code == 429:  # (the openai package raises it instead)
                record.append({"rejected": True})
                return
            if not sdk:  # (the openai package raises every error status itself)
                response.raise_for_status()
            async for chunk in response.iter_bytes() if sdk else response.aiter_bytes():
                now = time.perf_counter()
                first = first or now
                late = max(late, now - (first + received / BYTES_PER_FRAME * FRAME))
                received += len(chunk)
    except Exception as e:
        if getattr(e, "status_code", None) != 429:
            raise
        record.append({"rejected": True})
        return
    record.append({"ttfa": first - start, "frames": received // BYTES_PER_FRAME, "expected": frames, "late_s": late,
                   "start": start, "end": now})


def _speech(client, body: dict):
    """The streamed response of POST /v1/audio/speech through whichever client."""
    if hasattr(client, "audio"):  # openai.AsyncOpenAI: the extra Qwen3-TTS fields go in extra_body
        known = {k: body[k] for k in ("model", "input", "voice", "response_format")}
        extra = {k: v for k, v in body.items() if k not in known}
        return client.audio.speech.with_streaming_response.create(**known, extra_body=extra)
    return client.stream("POST", "/v1/audio/speech", json=body)


async def run_rate(tts: TTS | None, rate: float, duration: float, seed: int,
                   http: tuple | None = None) -> dict:
    """Poisson arrivals at `rate` for `duration` s, in-process (engine) or over HTTP (http = client, model,
    voice)."""
    return summarize(await arrivals(tts, rate, duration, seed, http), rate, duration)


async def arrivals(tts: TTS | None, rate: float, duration: float, seed: int, http: tuple | None = None) -> list:
    """The per-request records of Poisson arrivals at `rate` for `duration` s."""
    rng = random.Random(seed)
    record: list[dict] = []
    tasks = []
    t0 = time.perf_counter()
    next_arrival = t0
    while next_arrival - t0 < duration:
        await asyncio.sleep(max(0.0, next_arrival - time.perf_counter()))
        job = consume_http(*http, rng, record) if http else consume(tts, rng, record)
        tasks.append(asyncio.create_task(job))
        next_arrival += rng.expovariate(rate)
    await asyncio.gather(*tasks)
    return record


def summarize(record: list[dict], rate: float, duration: float) -> dict:
    """Latency quantiles, lateness and throughput of one rate's records (perf_counter times: comparable across
    processes of one host)."""
    done = [r for r in record if not r.get("rejected")]
    ttfa = sorted(r["ttfa"] * 1e3 for r in done)
    q = lambda p: ttfa[min(len(ttfa) - 1, int(p * len(ttfa)))] if ttfa else None
    audio = sum(r["frames"] for r in done) * FRAME
    span = max(r["end"] for r in done) - min(r["start"] for r in done) if done else 1.0
    assert all(r["frames"] == r["expected"] for r in done), "a stream lost or gained frames"
    parts = {}  # in-process only: where the time to first audio goes
    for part in ("prepare", "queue", "after_admission"):
        values = sorted(r[part] * 1e3 for r in done if part in r)
        if values:
            parts[f"{part}_ms_p50"] = round(statistics.median(values), 2)
            parts[f"{part}_ms_p95"] = round(values[min(len(values) - 1, int(0.95 * len(values)))], 2)
    return {"rps": rate, "requests": len(record), "rejected": len(record) - len(done),
            "ttfa_ms_p50": round(statistics.median(ttfa), 2) if ttfa else None,
            "ttfa_ms_p95": round(q(0.95), 2) if ttfa else None, "ttfa_ms_p99": round(q(0.99), 2) if ttfa else None,
            "behind_realtime_share": round(sum(r["late_s"] > 0 for r in done) / max(len(done), 1), 4),
            "max_late_ms": round(max((r["late_s"] for r in done), default=0) * 1e3, 1),
            "audio_s_per_s": round(audio / span, 1), "duration_s": duration, **parts,
            **({"client_gc_max_ms": round(max(r["client_gc_s"] for r in done) * 1e3, 1)}
               if any("client_gc_s" in r for r in done) else {})}


async def http_setup(url: str) -> tuple[str, str, int | None]:
    """(model id, a voice uploaded for the run, the number of engine processes behind `url`: None for a server of
    one process, a number for a `--devices` front)."""
    import httpx

    async with httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(600.0)) as client:
        model = (await client.get("/v1/models")).json()["data"][0]["id"]
        engines = (await client.get("/ready")).json().get("engines")  # a `--devices` front lists them
        engines = None if engines is None else len(engines)
        t = np.arange(48000) / 24000
        wav = (0.3 * np.sin(2 * np.pi * 140 * t) * (0.6 + 0.4 * np.sin(2 * np.pi * 3 * t))).astype(np.float32)
        buffer = io.BytesIO()
        sf.write(buffer, wav, 24000, format="WAV")
        created = await client.post("/v1/audio/voices", files={"file": ("ref.wav", buffer.getvalue(), "audio/wav")},
                                    data={"x_vector_only_mode": "true", "name": f"load-{time.time_ns()}"})
        created.raise_for_status()
        return model, created.json()["id"], engines


def http_records(url: str, model: str, voice: str, rate: float, duration: float, seed: int,
                 client: str = "httpx") -> list[dict]:
    """One load-generating client (a process of its own when there are several): its requests' records, each with
    the client's longest garbage collection during the run (`client_gc_s`: a stall of the client's own reads that
    would count as the server's lateness). The objects a forked client inherits (torch, numpy, q3tts) are frozen
    first, as `q3tts serve` freezes its own."""
    import httpx

    gc.collect()
    gc.freeze()
    longest, started = [0.0], [0.0]

    def timed(phase: str, info: dict) -> None:
        if phase == "start":
            started[0] = time.perf_counter()
        else:
            longest[0] = max(longest[0], time.perf_counter() - started[0])

    async def run() -> list[dict]:
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
        async with httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(600.0), limits=limits) as http:
            if client == "openai":
                import openai

                sdk = openai.AsyncOpenAI(base_url=url + "/v1", api_key="-", max_retries=0, http_client=http)
                return await arrivals(None, rate, duration, seed, http=(sdk, model, voice))
            return await arrivals(None, rate, duration, seed, http=(http, model, voice))

    gc.callbacks.append(timed)
    try:
        records = asyncio.run(run())
    finally:
        gc.callbacks.remove(timed)
    return [{**r, "client_gc_s": longest[0]} for r in records]


def http_rates(url: str, rates: list[float], duration: float, clients: int = 1, client: str = "httpx",
               warmup_s: float = 2.0) -> list[dict]:
    """Each rate offered by `clients` processes (rate / clients each: still Poisson), so that one Python event
    loop parsing every stream does not become the bottleneck being measured. `client`: httpx (the speech
    request as raw HTTP) or openai (the same through the openai package, its own overhead included). First
    `warmup_s` seconds at 4 requests/s, not counted (0: none)."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    model, voice, engines = asyncio.run(http_setup(url))
    if warmup_s > 0:
        http_records(url, model, voice, 4.0, warmup_s, 0, client)
    rows = []
    with ProcessPoolExecutor(clients, mp_context=multiprocessing.get_context("fork")) as pool:
        for rate in rates:
            parts = pool.map(http_records, *zip(*[(url, model, voice, rate / clients, duration,
                                                   int(rate) * 1000 + i, client) for i in range(clients)]))
            result = summarize([r for part in parts for r in part], rate, duration)
            layout = "one process" if engines is None else f"front + {engines} engine process(es)"
            rows.append({"engine": f"q3tts-serve (HTTP, pcm, {layout})", "benchmark": "serving", "model": model,
                         "gpus": engines or 1, "batch": None, "ms_per_frame": None, "gpu_mem_gb": None,
                         "client_processes": clients, "client": client,
                         "request_mix": "x-vector clone, English, 6-14 s uniform", **result})
            print(json.dumps(rows[-1]), flush=True)
    return rows


def runner_modules() -> list:
    """The model runner's modules (it is one class in several files: each imports the transfers it calls), those
    of the tree this runs against."""
    import importlib
    import importlib.util

    names = ("model_runner", "kv_rows", "prefill", "frame")
    return [importlib.import_module(f"q3tts.engine.runner.{n}") for n in names
            if importlib.util.find_spec(f"q3tts.engine.runner.{n}")]


class LoopProfile:
    """Wall time of the engine loop's phases (its methods wrapped with timers), per loop iteration: host work
    (settle, admit, prefill launch, codec start, audio hand-out) and the waits for the device (`wait.*`). The
    engine thread alone calls these, so no locking."""

    def __init__(self, engine) -> None:
        import q3tts.engine.engine as engine_module
        from q3tts.engine.runner.readback import Readback

        self.totals: collections.Counter = collections.Counter()
        self.rows = 0
        targets = [(engine, name, name) for name in ("_settle", "_grow", "_join", "_start_codec", "_audio",
                                                      "_hand_out")]
        targets += [(engine.scheduler, "admit", "admit"), (engine.codec, "step", "codec.step"),
                    (engine_module, "deliver", "deliver"), (engine_module, "post", "post"),
                    (Readback, "pop", "wait.frame"), (Readback, "pop_pcm", "wait.pcm")]
        # the model runner's admission steps and its transfers, wherever called (grow_rows and to_device serve
        # _grow and the departures too)
        targets += [(engine.runner, name, f"runner.{name}") for name in ("grow_rows", "_reuse_prefixes",
                                                                           "_prefill_tokens", "_keep_prefixes",
                                                                           "_arm_rows", "remove_rows")]
        targets += [(module, name, f"runner.{name}") for module in runner_modules()
                    for name in ("to_device", "write_rows")]
        for owner, name, label in targets:  # (those of the tree it runs: the engine's phases were renamed since)
            if hasattr(owner, name):
                setattr(owner, name, self._timed(label, getattr(owner, name)))
        step = engine.runner.step

        def timed_step(num_rows: int) -> None:
            self.rows += num_rows
            self.totals["iterations"] += 1
            t = time.perf_counter()
            step(num_rows)
            self.totals["runner.step"] += time.perf_counter() - t

        engine.runner.step = timed_step

    def _timed(self, label: str, fn):
        def timed(*args, **kwargs):
            t = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.totals[label] += time.perf_counter() - t
        return timed

    def window(self):
        """Starts a measurement window; the returned function ends it: {phase: ms per iteration, ...}."""
        start, rows, t0 = self.totals.copy(), self.rows, time.perf_counter()

        def end() -> dict:
            d = self.totals - start
            n = max(d.pop("iterations", 0), 1)
            out = {"iterations": n, "rows_mean": round((self.rows - rows) / n, 1),
                   "ms_per_iteration": round((time.perf_counter() - t0) * 1e3 / n, 3)}
            return out | {f"{k}_ms": round(v * 1e3 / n, 3) for k, v in sorted(d.items())}
        return end


def engine_settings(pairs: list[str]) -> dict:
    """--set FIELD=VALUE pairs as EngineConfig keyword arguments (values parsed as Python literals; true/false,
    none accepted)."""
    import ast
    import dataclasses

    fields = {f.name for f in dataclasses.fields(EngineConfig)}
    settings = {}
    for pair in pairs:
        name, _, value = pair.partition("=")
        if name not in fields:
            raise SystemExit(f"--set {pair}: EngineConfig has no field {name!r}")
        value = {"true": "True", "false": "False", "none": "None"}.get(value.lower(), value)
        settings[name] = ast.literal_eval(value)
    return settings


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ckpt-root", type=Path)
    parser.add_argument("--http", help="URL of a running `q3tts serve` to load instead of an in-process engine")
    parser.add_argument("--clients", type=int, default=1, help="--http: load-generating processes (default: 1)")
    parser.add_argument("--client", choices=("httpx", "openai"), default="httpx",
                        help="--http: send the requests as raw HTTP (httpx) or through the openai package")
    parser.add_argument("--sizes", default="1.7B-Base,0.6B-Base")
    parser.add_argument("--rates", default="10,20,40")
    parser.add_argument("--duration", type=float, default=15.0)
    parser.add_argument("--max-running", type=int, default=128)
    parser.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                        help="an EngineConfig setting for the in-process engine, e.g. switch_interval=0.0002 or "
                             "buckets=(64,128,256) (repeatable)")
    parser.add_argument("--overlap-max-rows", type=int, help="the codec runner's overlap_max_rows (default: its own)")
    parser.add_argument("--profile-loop", action="store_true",
                        help="in-process: report the engine loop's phases per iteration (host work, device waits)")
    parser.add_argument("--device-trace", metavar="START,SECONDS",
                        help="in-process: record the GPU's activity for SECONDS from START s into each rate "
                             "(bench/profilers/device_busy.py: busy shares per stream, the main stream's gaps)")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    rates = [float(r) for r in args.rates.split(",")]
    trace = tuple(float(x) for x in args.device_trace.split(",")) if args.device_trace else None  # (start, seconds)
    if trace is not None and len(trace) != 2:
        parser.error("--device-trace takes START,SECONDS")
    extra = engine_settings(args.set)  # (a bad setting is refused before anything loads)
    rows = http_rates(args.http, rates, args.duration, args.clients, args.client) if args.http else []
    for name in [] if args.http else args.sizes.split(","):
        tts = TTS.from_pretrained(args.ckpt_root / name, device="cuda", dtype=torch.bfloat16,
                                  engine_config=EngineConfig(max_rows=args.max_running, max_waiting=4096,
                                                             gpu_memory_utilization=0.9, **extra))
        tts.model.talker.codec_head.weight.data[tts.config.talker_config.codec_eos_token_id] = 0
        engine = tts.prepare_engine()
        if args.overlap_max_rows is not None:
            engine.codec.overlap_max_rows = args.overlap_max_rows
        asyncio.run(run_rate(tts, 4.0, 2.0, seed=0))  # warm-up
        # As `q3tts serve` does after its start-up (server/service.py): the process's long-lived objects out of the
        # garbage collector's sight, so that a full collection (~340,000 objects with a model loaded) does not
        # stall the engine's loop; undone before the next model is loaded.
        gc.collect()
        gc.freeze()
        profile = LoopProfile(engine) if args.profile_loop else None
        for rate in rates:
            window = profile.window() if profile else None
            work = run_rate(tts, rate, args.duration, seed=int(rate))
            if trace:
                from bench.profilers.device_busy import traced

                result, busy = asyncio.run(traced(work, *trace))
                result["device_trace"] = busy
            else:
                result = asyncio.run(work)
            if window:
                result["engine_loop"] = window()
            row = {"engine": "q3tts", "benchmark": "serving", "model": name, "gpus": 1, "batch": args.max_running,
                   "ms_per_frame": None, "gpu_mem_gb": round(torch.cuda.max_memory_allocated() / 1e9, 2),
                   "request_mix": "x-vector clone, English, 6-14 s uniform, EOS off",
                   **({"engine_settings": extra} if extra else {}), **result}
            rows.append(row)
            print(json.dumps(row), flush=True)
        tts.close()
        gc.unfreeze()
        del engine, tts
        torch.cuda.empty_cache()
    if args.out:
        from q3tts.benchmarks.common import write_results

        write_results(rows, args.out, "python bench/serve_load.py " + " ".join(sys.argv[1:]))


if __name__ == "__main__":
    main()
