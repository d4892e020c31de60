"""What a live-text WebSocket session costs the processes of `q3tts serve` behind its front, on the CPU: the
front and one engine process (`--devices cpu`, the layout a GPU runs), tiny CustomVoice model, nari's
nari.speech.v1 protocol as tts-bench drives it (one `input_text.append` per word, each acknowledged before the
next). Reports each process's CPU milliseconds per session by thread kind (the event loop, the engine thread, the
rest), from /proc, over `--sessions` sessions after a warm-up, `--concurrency` at a time.

Each `--tree` (a source folder: this checkout, or a worktree of another commit) is served in turn and measured in
the same call; trees alternate over `--rounds` and the medians are reported.

usage: python bench/ws_relay_cpu.py [--tree . --tree /tmp/ws-base] [--sessions 60] [--rounds 3] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

WORDS = ["Hello", "world,", "this", "is", "a", "test", "of", "live", "text", "over", "the", "WebSocket,", "one", "word",
         "at", "a", "time."]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def threads_cpu(pids: list[int]) -> dict[str, float]:
    """CPU seconds of every thread of `pids` so far, by 'pid/tid'."""
    tick, out = os.sysconf("SC_CLK_TCK"), {}
    for pid in pids:
        try:
            for tid in os.listdir(f"/proc/{pid}/task"):
                with open(f"/proc/{pid}/task/{tid}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
                out[f"{pid}/{tid}"] = (int(fields[11]) + int(fields[12])) / tick
        except FileNotFoundError:
            pass
    return out


def children(pid: int) -> list[int]:
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout.split()
    return [int(p) for p in out]


def session(url: str) -> int:
    """One nari.speech.v1 session; returns the audio bytes received."""
    from websockets.sync.client import connect

    audio = 0
    with connect(url + "/v1/audio/speech/ws", subprotocols=["nari.speech.v1"], compression=None) as ws:
        ws.send(json.dumps({"type": "request.start", "voice": "ryan", "language": "english", "seed": 1,
                            "max_new_tokens": 20}))
        for i, word in enumerate(WORDS):
            ws.send(json.dumps({"type": "input_text.append", "sequence": i, "text": word if i == 0 else " " + word}))
            while True:  # (its ack)
                message = ws.recv(timeout=60)
                if isinstance(message, bytes):
                    audio += len(message)
                    continue
                if json.loads(message)["type"] == "input_text.ack":
                    break
        ws.send(json.dumps({"type": "input_text.end", "sequence": len(WORDS)}))
        try:
            while True:
                message = ws.recv(timeout=60)
                audio += len(message) if isinstance(message, bytes) else 0
        except Exception:
            pass
    return audio


def run_sessions(url: str, n: int, concurrency: int) -> None:
    left = iter(range(n))
    lock, errors = threading.Lock(), []

    def worker() -> None:
        while True:
            with lock:
                if next(left, None) is None:
                    return
            try:
                assert session(url) > 0, "a session with no audio"
            except Exception as e:  # (reported after)
                errors.append(e)

    threads = [threading.Thread(target=worker) for _ in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise RuntimeError(f"{len(errors)} of {n} sessions failed: {errors[0]!r}")


def measure(tree: Path, checkpoint: Path, sessions: int, concurrency: int) -> dict:
    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(tree), "OMP_NUM_THREADS": "1"}
    server = subprocess.Popen([sys.executable, "-m", "q3tts.cli", "serve", str(checkpoint), "--devices", "cpu",
                               "--port", str(port), "--max-running", "8", "--log-level", "warning"],
                              env=env, cwd=tempfile.gettempdir(), stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL)
    url = f"ws://127.0.0.1:{port}"
    try:
        import httpx

        deadline = time.time() + 180
        while True:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/ready", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert server.poll() is None and time.time() < deadline, "the server did not get ready"
            time.sleep(0.2)
        run_sessions(url, 2 * concurrency, concurrency)  # warm-up
        pids = [server.pid, *children(server.pid)]
        before, t0 = threads_cpu(pids), time.perf_counter()
        run_sessions(url, sessions, concurrency)
        wall = time.perf_counter() - t0
        after = threads_cpu(pids)
    finally:
        server.terminate()
        server.wait(timeout=60)
    out: dict[str, float] = {}
    for key, seconds in after.items():
        pid, tid = key.split("/")
        process = "front" if int(pid) == server.pid else "engine"
        kind = "event_loop" if pid == tid else "other_threads"  # (the engine process's: its engine thread's model)
        label = f"{process}_{kind}_ms_per_session"
        out[label] = out.get(label, 0) + (seconds - before.get(key, 0)) * 1e3 / sessions
    out = {k: round(v, 2) for k, v in sorted(out.items())}
    out["wall_ms_per_session"] = round(wall * 1e3 / sessions * concurrency, 1)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tree", action="append", type=Path, help="source folders (default: this checkout)")
    parser.add_argument("--sessions", type=int, default=60)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    trees = args.tree or [Path(__file__).resolve().parent.parent]
    from q3tts.tiny import tiny_checkpoint

    checkpoint = tiny_checkpoint("tiny-custom-voice", Path(tempfile.mkdtemp()))
    runs: dict[Path, list[dict]] = {tree: [] for tree in trees}
    for r in range(args.rounds):
        for tree in trees:
            row = measure(tree, checkpoint, args.sessions, args.concurrency)
            runs[tree].append(row)
            print(f"round {r} {tree}: {row}", flush=True)
    results = []
    for tree, rows in runs.items():
        commit = subprocess.run(["git", "-C", str(tree), "rev-parse", "--short", "HEAD"], capture_output=True,
                                text=True).stdout.strip()
        medians = {k: round(statistics.median(row[k] for row in rows if k in row), 2)
                   for k in sorted({k for row in rows for k in row})}
        results.append({"engine": "q3tts", "benchmark": "ws-relay", "tree": str(tree), "commit": commit,
                        "model": "tiny-custom-voice", "batch": args.concurrency, "ms_per_frame": None,
                        "audio_s_per_s": None, "ttfa_ms_p50": None, "ttfa_ms_p95": None, "rps": None,
                        "behind_realtime_share": None, "gpu_mem_gb": None, "sessions": args.sessions,
                        "rounds": args.rounds, **medians, "rounds_rows": rows})
        print(json.dumps({k: v for k, v in results[-1].items() if k != "rounds_rows"}))
    if args.out:
        args.out.write_text(json.dumps({"card": f"CPU ({platform.processor() or platform.machine()})",
                                        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                                        "commit": results[-1]["commit"], "command": " ".join(sys.argv),
                                        "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
