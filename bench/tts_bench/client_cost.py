"""What one tts-bench client process costs per request, against a stand-in server that costs next to nothing.

tts-bench is one asyncio process: per response chunk it builds a pydantic event, hashes the chunk and tracks
playback; per request it hashes and writes the audio and fsyncs three files. At q3tts's rates (hundreds of
requests per second) that process can saturate its core and its own lateness would read as the server's
TTFA. This serves `POST /v1/audio/speech` as the nari/vllm-omni targets expect (raw PCM16, `frames` chunks of
one 80 ms codec frame each, `interval` seconds apart) and runs the real `bench run` against it at each rate,
printing the client's CPU seconds per request and its p95 first-playable time (the stand-in answers at once,
so anything above a millisecond or two is the client's). run_q3tts.sh's PER_CLIENT comes from this.

    python bench/tts_bench/client_cost.py --rates 20,50,100 --duration 10   # PYTHON with tts-bench installed
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

FRAME_BYTES = 1920 * 2  # one 12.5 Hz codec frame of 24 kHz PCM16


async def serve(port: int, frames: int, interval: float) -> None:
    from aiohttp import web

    chunk = os.urandom(FRAME_BYTES)

    async def speech(request: web.Request) -> web.StreamResponse:
        await request.read()
        response = web.StreamResponse(headers={"Content-Type": "audio/pcm"})
        await response.prepare(request)
        for _ in range(frames):
            await response.write(chunk)
            await asyncio.sleep(interval)
        await response.write_eof()
        return response

    async def health(_: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    app = web.Application()
    app.add_routes([web.post("/v1/audio/speech", speech), web.get("/health", health)])
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    await asyncio.Event().wait()


def bench(python: str, port: int, rps: float, duration: float, dataset: Path, out: Path) -> dict:
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    subprocess.run([python, "-m", "tts_bench", "run", "--target", "nari", "--base-url", f"http://127.0.0.1:{port}",
                    "--dataset", str(dataset), "--rps", str(rps), "--warmup", "2s", "--duration", f"{duration}s",
                    "--output", str(out)], check=True, stdout=subprocess.DEVNULL)
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    s = json.loads((out / "summary.json").read_text())
    requests = sum(1 for line in (out / "requests.jsonl").read_text().splitlines() if line.strip())  # both phases
    return {"rps": rps, "actual_rps": round(s["actual_rps"], 1), "client_cpu_s": round(cpu, 2),
            "wall_s": round(wall, 1),
            "cpu_ms_per_request": round(1000 * cpu / max(1, requests), 2),
            "first_playable_p50": s["first_playable_ms"]["p50"], "first_playable_p95": s["first_playable_ms"]["p95"],
            "lag_p95": s["scheduling_lag_ms"]["p95"], "underrun_requests": s["underrun_requests"],
            "requests": requests}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rates", default="20,50,100")
    parser.add_argument("--duration", type=float, default=10)
    parser.add_argument("--frames", type=int, default=50)
    parser.add_argument("--interval", type=float, default=0.01, help="seconds between a response's chunks")
    parser.add_argument("--port", type=int, default=8199)
    parser.add_argument("--dataset", type=Path, default=Path(__file__).with_name("prompts-en.jsonl"))
    parser.add_argument("--python", default=sys.executable, help="the python that has tts-bench")
    parser.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        asyncio.run(serve(args.port, args.frames, args.interval))
        return
    server = subprocess.Popen([sys.executable, __file__, "--serve", "--port", str(args.port), "--frames",
                               str(args.frames), "--interval", str(args.interval)])
    try:
        time.sleep(2)
        with tempfile.TemporaryDirectory() as tmp:
            for i, rps in enumerate(float(r) for r in args.rates.split(",")):
                print(json.dumps(bench(args.python, args.port, rps, args.duration, args.dataset,
                                       Path(tmp) / f"r{i}")), flush=True)
    finally:
        server.terminate()


if __name__ == "__main__":
    main()
