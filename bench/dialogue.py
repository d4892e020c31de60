"""A dialogue of N turns takes about as long as its longest turn, not the sum: `TTS.dialogue` submits every turn at
once and the engine decodes them as rows of one batch. On the CPU with a tiny model (its numbers are only
ratios): per N, the wall time of one turn alone (every turn is as long), of the dialogue, and of the turns one
after another.

usage: python bench/dialogue.py [--turns 1,2,4,8] [--frames 40] [--rounds 3] [--out FILE.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import time
from datetime import datetime, timezone

import torch

from q3tts import TTS

SPEAKERS = ("ryan", "vivian", "serena", "aiden")


def turns_of(n: int) -> list[dict]:
    return [{"speaker": SPEAKERS[i % len(SPEAKERS)], "text": f"Turn number {i} of the dialogue.", "pause": 0.1}
            for i in range(n)]


def timed(fn, rounds: int) -> float:
    best = float("inf")
    for _ in range(rounds):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def measure(tts: TTS, n: int, frames: int, rounds: int) -> dict:
    """Every turn `frames` frames long (the tiny random model never ends before max_new_tokens): the longest turn
    is any one of them. Streamed (the engine's own decode; `TTS.dialogue` on the CPU decodes the codes a second
    time, the official way, whose cost grows with the audio), and the engine's largest batch of the dialogue."""
    turns = turns_of(n)
    sampling = {"do_sample": False, "subtalker_dosample": False, "max_new_tokens": frames + 1}

    def one(turn: dict) -> list:
        return list(tts.stream(turn["text"], speaker=turn["speaker"], **sampling))

    longest = timed(lambda: one(turns[0]), rounds)
    tts.engine.metrics.max_batch = 0
    together = timed(lambda: list(tts.stream_dialogue(turns, **sampling)), rounds)
    max_batch = tts.engine.metrics.max_batch
    sequential = timed(lambda: [one(t) for t in turns], rounds)
    return {"engine": "q3tts", "benchmark": "dialogue", "model": "tiny (CustomVoice, 1b7 layout)", "batch": n,
            "ms_per_frame": None, "audio_s_per_s": round(n * frames * 0.08 / together, 3), "ttfa_ms_p50": None,
            "ttfa_ms_p95": None, "rps": None, "behind_realtime_share": None, "gpu_mem_gb": None,
            "turns": n, "frames_per_turn": frames, "engine_max_batch": max_batch,
            "longest_turn_s": round(longest, 4), "dialogue_s": round(together, 4),
            "sequential_s": round(sequential, 4), "dialogue_over_longest": round(together / longest, 3),
            "sequential_over_dialogue": round(sequential / together, 3)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--turns", default="1,2,4,8")
    parser.add_argument("--frames", type=int, default=40)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    tts = TTS.from_pretrained("tiny", device="cpu")
    measure(tts, 2, 8, 1)  # (warm-up)
    rows = [measure(tts, int(n), args.frames, args.rounds) for n in args.turns.split(",")]
    print(f"{'turns':>5} {'rows at once':>12} {'one turn s':>11} {'dialogue s':>11} {'one by one s':>13} "
          f"{'dialogue/one turn':>18}")
    for r in rows:
        print(f"{r['turns']:>5} {r['engine_max_batch']:>12} {r['longest_turn_s']:>11.3f} {r['dialogue_s']:>11.3f} "
              f"{r['sequential_s']:>13.3f} {r['dialogue_over_longest']:>18.2f}")
    if args.out:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
        result = {"card": f"CPU ({platform.machine()}, {os.cpu_count()} cores, {args.threads} threads, no GPU)",
                  "date": datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"), "commit": commit,
                  "command": "python bench/dialogue.py " + " ".join(
                      f"--{k} {v}" for k, v in (("turns", args.turns), ("frames", args.frames),
                                                ("rounds", args.rounds), ("threads", args.threads), ("out", args.out))),
                  "load_average_1m": round(os.getloadavg()[0], 2),  # (a shared machine: wall times are noisy)
                  "results": rows}
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
            f.write("\n")


if __name__ == "__main__":
    main()
