"""Capacity of one engine against several behind `q3tts serve --devices`, in one run on one host.

Starts `q3tts serve MODEL --device <one>`, offers it each of `--rates-one` over HTTP (bench/serve_load.py's
Poisson mix of streamed PCM requests, from `--clients` load-generating processes), stops it; then the same with
`--devices <many>` and `--rates-many`. Capacity: the highest offered rate whose p95 time to first audio is at
most `--ttfa-ms` (50) with nothing refused. Rows carry `gpus` (engines behind the endpoint); the file's
`capacity` gives each and their ratio.

usage (GPU machine, a checkpoint with EOS disabled, e.g. the peer harness's):
  python bench/scale_out.py --model /tmp/peer_ckpt/1.7B-Base --one cuda:0 --many cuda:0,cuda:1 \\
      --rates-one 40,60,80,100 --rates-many 80,120,160,200 --clients 4 --out results.json
CPU check of the script itself:
  python bench/scale_out.py --model tiny-base --one cpu --many cpu,cpu --rates-one 1 --rates-many 2 --duration 3
"""

from __future__ import annotations

import argparse
import json
import signal
import socket
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import httpx

try:
    from serve_load import http_rates  # (run as a script: bench/, its folder, is first on sys.path)
except ModuleNotFoundError:  # (imported from the repository's root, as the tests do)
    from bench.serve_load import http_rates

from q3tts.benchmarks.common import write_results


@contextmanager
def server(model: str, placement: list[str], flags: list[str], log: Path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "q3tts.cli", "serve", model, *placement, "--port", str(port), *flags]
    with log.open("w") as out:
        process = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 600
        while True:
            if process.poll() is not None:
                raise SystemExit(f"{' '.join(cmd)} exited:\n{log.read_text()[-3000:]}")
            try:
                if httpx.get(url + "/ready", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise SystemExit(f"{' '.join(cmd)} never became ready")
            time.sleep(0.5)
        print(f"ready: {' '.join(cmd)}", file=sys.stderr, flush=True)
        yield url
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            process.kill()


def capacity(rows: list[dict], ttfa_ms: float) -> float | None:
    ok = [r["rps"] for r in rows if not r["rejected"] and r["ttfa_ms_p95"] is not None
          and r["ttfa_ms_p95"] <= ttfa_ms]
    return max(ok, default=None)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True)
    parser.add_argument("--one", default="cuda:0", help="the single engine's device")
    parser.add_argument("--many", default="cuda:0,cuda:1", help="the devices of the data-parallel run")
    parser.add_argument("--rates-one", default="40,60,80,100")
    parser.add_argument("--rates-many", default="80,120,160,200")
    parser.add_argument("--duration", type=float, default=10.0)
    parser.add_argument("--warmup", type=float, default=2.0,
                        help="seconds at 4 requests/s before the first rate of each server, not counted (0: none)")
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--client", choices=("httpx", "openai"), default="httpx",
                        help="send the requests as raw HTTP (httpx) or through the openai package")
    parser.add_argument("--ttfa-ms", type=float, default=50.0)
    parser.add_argument("--serve-flags", default="--max-running 128 --max-waiting 4096 --log-level warning",
                        help="flags for every `q3tts serve` (default: %(default)s)")
    parser.add_argument("--logs", type=Path, default=Path("."), help="folder for the servers' logs")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    flags = args.serve_flags.split()
    args.logs.mkdir(parents=True, exist_ok=True)
    rows, found = [], {}
    for name, placement, rates in (("one", ["--device", args.one], args.rates_one),
                                   ("many", ["--devices", args.many], args.rates_many)):
        with server(args.model, placement, flags, args.logs / f"serve-{name}.log") as url:
            measured = http_rates(url, [float(r) for r in rates.split(",")], args.duration, args.clients,
                                  args.client, args.warmup)
        rows += measured
        found[measured[0]["gpus"]] = capacity(measured, args.ttfa_ms)
    one, many = found.values()
    summary = {"ttfa_ms_p95_max": args.ttfa_ms, "capacity_rps": {str(k): v for k, v in found.items()},
               "ratio": round(many / one, 2) if one and many else None}
    print(json.dumps(summary), flush=True)
    if args.out:
        doc = write_results(rows, args.out, "python bench/scale_out.py " + " ".join(sys.argv[1:]))
        doc["capacity"] = summary
        args.out.write_text(json.dumps(doc, indent=2))


if __name__ == "__main__":
    main()
