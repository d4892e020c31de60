"""Per-kernel GPU time of one frame (eager, so every kernel is visible to the profiler; the graph runs the
same kernels without the launch gaps). GPU machine only.

usage: python bench/profilers/profile_frame.py [--model 0.6B-Base] [--batches 1,64]
"""

from __future__ import annotations

import argparse
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile

from q3tts.benchmarks.common import clone_prompt, load_model
from q3tts.engine import EngineConfig
from q3tts.engine.runner.model_runner import ModelRunner
from q3tts.sampling import SamplingParams


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default="0.6B-Base")
    parser.add_argument("--batches", default="1,64")
    parser.add_argument("--frames", type=int, default=3)
    args = parser.parse_args()
    model = load_model(args.model, None, torch.device("cuda"))
    prompt = clone_prompt(model)
    batches = [int(b) for b in args.batches.split(",")]
    runner = ModelRunner(model, EngineConfig(max_rows=max(batches), max_context=512, max_trailing=64,
                                             buckets=tuple(batches)))
    for B in batches:
        runner.add_rows(list(range(B)), [prompt] * B, [SamplingParams(max_new_tokens=100, seed=i) for i in range(B)])
        for row in range(B):
            runner.grow(row, prompt.num_positions + 101)
        for _ in range(3):
            runner.frame(B)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(args.frames):
                runner.frame(B)
            torch.cuda.synchronize()
        runner.release_rows(list(range(B)))
        totals, counts = defaultdict(float), defaultdict(int)
        for e in prof.events():
            if e.device_type == torch.autograd.DeviceType.CUDA:
                totals[e.name] += e.device_time / args.frames
                counts[e.name] += 1
        total = sum(totals.values())
        print(f"\n== {args.model} B={B}: {total / 1e3:.3f} ms of kernel time per frame, "
              f"{sum(counts.values()) // args.frames} kernels per frame")
        for name, t in sorted(totals.items(), key=lambda kv: -kv[1])[:22]:
            n = counts[name] // args.frames
            print(f"{t / 1e3:8.3f} ms {n:5d}x {t / max(n, 1):8.2f} us  {name[:110]}")


if __name__ == "__main__":
    main()
