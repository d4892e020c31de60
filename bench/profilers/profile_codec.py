"""Where the incremental codec decoder's GPU time goes: per-kernel profile of one frame step, graph-replay
time per batch size and per stage (random full-size weights, bf16, one frame per row per call). GPU machine only.

usage: python bench/profilers/profile_codec.py [--batches 1,16,64]
"""

from __future__ import annotations

import argparse
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile

from q3tts.benchmarks.common import graph_ms, random_decoder
from q3tts.engine.runner.codec_stream import StreamingDecoder


def top_kernels(stream: StreamingDecoder, batch: int, n: int = 24) -> None:
    codes = torch.randint(0, 2048, (batch, 16, 1), device="cuda")
    for _ in range(2):
        stream.decode(codes)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        stream.decode(codes)
        torch.cuda.synchronize()
    totals, counts = defaultdict(float), defaultdict(int)
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            totals[e.name] += e.device_time
            counts[e.name] += 1
    print(f"B={batch}: {sum(totals.values()) / 1e3:.2f} ms kernel time, {sum(counts.values())} kernels")
    for name, t in sorted(totals.items(), key=lambda kv: -kv[1])[:n]:
        print(f"  {t / 1e3:7.3f} ms {counts[name]:4d}x  {name[:100]}")


def stage_ms(stream: StreamingDecoder, batch: int) -> None:
    """Graph replay of the step cut after each stage (quantizer + pre-conv + transformer, + upsampling, + the
    vocoder), so the differences are each stage's time."""
    codes = torch.randint(0, 2048, (batch, 16, 1), device="cuda")
    state = stream.state.view(batch)
    times = [graph_ms(lambda n=n: stream.run_stages(codes, state, n), 20) for n in (1, 2, 3)]
    print(f"B={batch} stages: quantizer + transformer {times[0]:.3f} ms, upsampling {times[1] - times[0]:.3f} ms, "
          f"vocoder {times[2] - times[1]:.3f} ms (whole {times[2]:.3f})", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--batches", default="1,16,64")
    args = parser.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    stream = StreamingDecoder(random_decoder(torch.device("cuda"), torch.bfloat16), max(batches))
    top_kernels(stream, batches[-1])
    for b in batches:
        codes = torch.randint(0, 2048, (b, 16, 1), device="cuda")
        print(f"graph replay, B={b}: {graph_ms(lambda c=codes: stream.decode(c), 20):.2f} ms per frame step")
        stage_ms(stream, b)


if __name__ == "__main__":
    main()
