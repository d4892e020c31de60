"""Live text against sentence cuts: how soon speech follows an LLM's words (docs/streaming.md#live-text).

Words of a paragraph arrive one every `--intervals` ms (10: tts-bench's WebSocket pace; 100: a slow LLM's). Live:
one `TTS.live` request fed as they come. Sentence cut: the words go through the WebSocket's segmenter
(q3tts.request.text_segmenter) and each segment is a `TTS.stream` request once cut, spoken one after another, as
the q3tts WebSocket protocol does. Both on the same engine, same voice, same seed, the same runaway guard (so the
same frames per text token). `--sessions N`: N sessions started together (one feeding thread each). Measured per
session, from the caller's side (p50 and p95 over sessions and runs):
  first_audio_after_first_word_ms: the first word sent -> the first audio chunk;
  final_text_latency_ms: the end of the text -> the first audio chunk after it (tts-bench's "final text to first
  playable": how long the listener waits once the LLM is done);
  final_text_to_done_ms: the end of the text -> the last audio.
`--prompts combined separate`: each setting twice on the same engine, with the prompts that sessions ask for at once
built together (`combined`: TTS.prepare's PromptCombiner, the default) and each built alone (`separate`: the
tree before it, `prepare_many([request])` per session), the row's "prompts" field saying which.
Prints a table and writes JSON in the shared results format (bench/results/, /work/shared/bench/RESULTS.md).

    python bench/live_text.py --model tiny --runs 3 --out bench/results/2026-12-02-live-text-cpu.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import queue
import statistics
import subprocess
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from q3tts import TTS, RunawayGuard
from q3tts.request.text_segmenter import TextSegmenter

PARAGRAPH = ("Sure, I can help with that. The next train to the airport leaves at seven forty five from platform "
             "two, and it takes about half an hour. If you miss it, there is another one twenty minutes later, "
             "so you have plenty of time")
GUARD = RunawayGuard(frames_per_token=1.0, min_frames=2)  # the random tiny model never ends on its own


def words() -> list[str]:
    parts = PARAGRAPH.split(" ")
    return [parts[0]] + [" " + w for w in parts[1:]]


def feed(send, end, interval_s: float) -> dict[str, float]:
    """Sends the words at the pace (in this thread); returns when the first was sent and when the text ended."""
    times = {}
    for i, word in enumerate(words()):
        if i:
            time.sleep(interval_s)
        send(word)
        times.setdefault("first", time.perf_counter())
    end()
    times["end"] = time.perf_counter()
    return times


def run_live(tts: TTS, interval_s: float, kwargs: dict) -> tuple[dict, list[float]]:
    live = tts.live(runaway_guard=GUARD, **kwargs)
    times: dict = {}
    feeder = threading.Thread(target=lambda: times.update(feed(live.append, live.end, interval_s)))
    feeder.start()
    arrivals = [time.perf_counter() for chunk in live if len(chunk.pcm)]
    feeder.join()
    return times, arrivals


def run_sentence_cut(tts: TTS, interval_s: float, kwargs: dict) -> tuple[dict, list[float]]:
    segmenter, segments = TextSegmenter(), queue.Queue()

    def send(word: str) -> None:
        for segment in segmenter.push(word):
            segments.put(segment)

    def end() -> None:
        for segment in segmenter.flush():
            segments.put(segment)
        segments.put(None)

    times: dict = {}
    feeder = threading.Thread(target=lambda: times.update(feed(send, end, interval_s)))
    feeder.start()
    arrivals = []
    while (segment := segments.get()) is not None:
        stream = tts.stream(segment, non_streaming_mode=False, runaway_guard=GUARD, **kwargs)
        arrivals += [time.perf_counter() for chunk in stream if len(chunk.pcm)]
    feeder.join()
    return times, arrivals


def p95(values: list[float]) -> float:
    return sorted(values)[min(len(values) - 1, round(0.95 * (len(values) - 1)))]


def measure(tts: TTS, mode: str, interval_ms: float, runs: int, sessions: int, kwargs: dict) -> dict:
    """`runs` rounds of `sessions` sessions started together (each its own feeding thread), per-session times."""
    run = run_live if mode == "live" else run_sentence_cut
    first, final, done = [], [], []
    for _ in range(runs):
        with ThreadPoolExecutor(sessions) as pool:
            outcomes = list(pool.map(lambda _: run(tts, interval_ms / 1000, kwargs), range(sessions)))
        for times, arrivals in outcomes:
            first.append((arrivals[0] - times["first"]) * 1000)
            after = [t for t in arrivals if t >= times["end"]]
            final.append(((after[0] if after else times["end"]) - times["end"]) * 1000)
            done.append((arrivals[-1] - times["end"]) * 1000)
    return {"engine": "q3tts", "benchmark": "live_text", "model": args.model, "batch": sessions, "mode": mode,
            "word_interval_ms": interval_ms, "words": len(words()),
            "first_audio_after_first_word_ms_p50": round(statistics.median(first), 1),
            "first_audio_after_first_word_ms_p95": round(p95(first), 1),
            "final_text_latency_ms_p50": round(statistics.median(final), 1),
            "final_text_latency_ms_p95": round(p95(final), 1),
            "final_text_to_done_ms_p50": round(statistics.median(done), 1),
            "ms_per_frame": None, "audio_s_per_s": None, "ttfa_ms_p50": round(statistics.median(first), 1),
            "ttfa_ms_p95": round(p95(first), 1), "rps": None, "behind_realtime_share": None, "gpu_mem_gb": None}


def main() -> None:
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if args.model == "tiny":
        from q3tts.tiny import tiny_checkpoint
        tts = TTS.from_pretrained(tiny_checkpoint("tiny"), device=device)
    else:
        tts = TTS.from_pretrained(args.model, device=device)
    kwargs = {"speaker": "ryan", "language": "english", "seed": 1}
    list(tts.stream("Warm up.", **kwargs, max_new_tokens=4))
    rows = []
    for prompts in args.prompts:
        if prompts == "separate":
            tts.prepare = lambda request: tts.prepare_many([request])[0]
        else:
            vars(tts).pop("prepare", None)
        rows += [{**measure(tts, mode, interval, args.runs, sessions, kwargs), "prompts": prompts}
                 for sessions in args.sessions for interval in args.intervals for mode in args.modes]
    print(f"{'prompts':<10}{'sessions':>8} {'mode':<14}{'word every':>12}{'first audio after 1st word':>30}"
          f"{'final-text latency':>22}{'final text -> done':>22}")
    for r in rows:
        print(f"{r['prompts']:<10}{r['batch']:>8} {r['mode']:<14}{r['word_interval_ms']:>9.0f} ms"
              f"{r['first_audio_after_first_word_ms_p50']:>27.1f} ms"
              f"{r['final_text_latency_ms_p50']:>19.1f} ms{r['final_text_to_done_ms_p50']:>19.1f} ms")
    if args.out:
        card = torch.cuda.get_device_name() if device.startswith("cuda") else "cpu"
        commit = os.environ.get("COMMIT") or subprocess.run(["git", "rev-parse", "--short", "HEAD"],
                                                            capture_output=True, text=True).stdout.strip()
        result = {"card": card, "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
                  "commit": commit, "command": "python bench/live_text.py " + " ".join(ARGV), "results": rows}
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    import sys

    ARGV = sys.argv[1:]
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny", help="a checkpoint, or tiny (the random tiny model)")
    parser.add_argument("--device", default=None)
    parser.add_argument("--intervals", type=float, nargs="+", default=[10.0, 100.0], help="ms between words")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--sessions", type=int, nargs="+", default=[1], help="sessions at once (started together)")
    parser.add_argument("--modes", nargs="+", default=["live", "sentence_cut"], choices=["live", "sentence_cut"])
    parser.add_argument("--prompts", nargs="+", default=["combined"], choices=["combined", "separate"],
                        help="prompts asked for at once built together (combined) or each alone (separate)")
    parser.add_argument("--out", default=None, help="the JSON result file")
    args = parser.parse_args()
    main()
