"""The sampling kernel alone (q3tts/kernels/sampler.py): a frame's 16 draws (the talker's over 3,072 ids with its
processors, the code predictor's 15 over 2,048, each gathering its code's embedding row) in one CUDA graph, ms per
frame, at the default sampling (temperature 0.9, top-k 50), with top-p 0.9 (with and without top-k), without top-k
and without sampling, over logits N(0, s^2).
For A/B runs: run it once per tree, alternating, as bench/frame_parts.py. GPU machine only.

usage: python bench/sampling.py [--batches 1,64] [--scales 1,3] [--set kernels.sampler.NAME=VALUE ...] [--label NAME]
"""

from __future__ import annotations

import argparse

import torch

from q3tts.benchmarks.common import ab_label, add_ab_options, graph_ms
from q3tts.kernels.sampler import TalkerProcessors, sample_tokens
from q3tts.sampling import SamplerTensors, SamplingParams


def frame_draws(batch: int, scale: float, params: SamplingParams):
    """A function that makes a frame's 16 draws for `batch` rows."""
    g = torch.Generator("cuda").manual_seed(0)
    talker = torch.randn(batch, 3072, device="cuda", generator=g) * scale
    cp = torch.randn(batch, 2048, device="cuda", generator=g) * scale
    talker_params = SamplerTensors.build([params] * batch, False, "cuda")
    cp_params = SamplerTensors.build([params] * batch, True, "cuda")
    seeds, counters = torch.arange(batch, device="cuda"), torch.zeros(batch, dtype=torch.long, device="cuda")
    suppress = torch.zeros(3072, dtype=torch.bool, device="cuda")
    suppress[2048:] = True
    procs = TalkerProcessors(torch.zeros(batch, 3072, dtype=torch.bool, device="cuda"),
                             torch.full((batch,), 1.05, device="cuda"), torch.full((batch,), 10, device="cuda"),
                             suppress, 2150, 2)
    table = torch.randn(3072, 1024, device="cuda", dtype=torch.bfloat16)
    rows = torch.empty(batch, 1024, device="cuda", dtype=torch.bfloat16)

    def draws():
        sample_tokens(talker, talker_params, seeds, counters, procs, gather=[(table, rows)])
        for g in range(15):
            sample_tokens(cp, cp_params, seeds, counters, offset=g + 1, gather=[(table[:2048], rows)])

    return draws


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", default="1,64")
    parser.add_argument("--scales", default="1,3", help="the logits' standard deviations")
    add_ab_options(parser)
    args = parser.parse_args()
    label = ab_label(args)
    settings = {"top-k 50": SamplingParams(), "top-k 50, top-p 0.9": SamplingParams(top_p=0.9, subtalker_top_p=0.9),
                "top-p 0.9": SamplingParams(top_k=0, subtalker_top_k=0, top_p=0.9, subtalker_top_p=0.9),
                "top-k off": SamplingParams(top_k=0, subtalker_top_k=0),
                "greedy": SamplingParams(do_sample=False, subtalker_dosample=False)}
    for batch in (int(b) for b in args.batches.split(",")):
        for scale in (float(s) for s in args.scales.split(",")):
            times = {name: round(graph_ms(frame_draws(batch, scale, p), 50, reps=3), 4) for name, p in settings.items()}
            print(label, f"batch {batch}, scale {scale}:", times, flush=True)


if __name__ == "__main__":
    main()
