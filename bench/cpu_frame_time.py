"""CPU time per generated frame of the reference (eager, fp32) path: tiny and full-size random models.

usage: python bench/cpu_frame_time.py [--threads 2]
Per-frame time = (T(n_long) - T(n_short)) / (n_long - n_short), so prefill and start-up cancel out.
"""

from __future__ import annotations

import argparse
import time

import torch

from q3tts.benchmarks.random_model import random_model, random_prompt_ids
from q3tts.reference import generate_codes
from q3tts.request.prompt import PromptSpec, build_prompt
from q3tts.sampling import SamplingParams


def per_frame(model, n_short: int, n_long: int) -> float:
    spec = PromptSpec(input_ids=random_prompt_ids(model.config, 20), language="english", non_streaming_mode=False,
                      speaker=model.config.supported_speakers[0] if model.config.supported_speakers else None)
    prompt = build_prompt(model.talker, model.config, spec)
    times = {}
    for n in (n_short, n_long, n_short, n_long):
        start = time.perf_counter()
        generate_codes(model.talker, [prompt], [SamplingParams(max_new_tokens=n + 1, seed=0)])
        times.setdefault(n, []).append(time.perf_counter() - start)
    return (min(times[n_long]) - min(times[n_short])) / (n_long - n_short)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    from q3tts import TTS

    tiny = TTS.from_pretrained("tiny").model
    print(f"tiny (custom voice, 1b7 layout): {per_frame(tiny, 4, 24) * 1e3:.1f} ms per frame")
    full = random_model("0.6B-CustomVoice")
    print(f"full-size 0.6B (random weights, fp32): {per_frame(full, 2, 6) * 1e3:.0f} ms per frame")


if __name__ == "__main__":
    main()
