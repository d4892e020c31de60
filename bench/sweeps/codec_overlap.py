"""The streaming loop's wall ms per frame step with the codec decoding on its own stream while the language
model computes the next frame (overlap) and after it (sequential), per batch size: decides
`CodecRunner.overlap_max_rows`. Random full-size weights, EOS off. GPU machine only.

usage: python bench/sweeps/codec_overlap.py [--size 1.7B-Base] [--batches 16,32,64,128]
"""

from __future__ import annotations

import argparse

import torch

from q3tts.benchmarks.common import load_model, random_decoder
from q3tts.benchmarks.streaming import loop_ms, streaming_engine


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--size", default="1.7B-Base")
    parser.add_argument("--batches", default="16,32,64,128")
    args = parser.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    device = torch.device("cuda")
    model = load_model(args.size, None, device)
    engine = streaming_engine(model, random_decoder(device, torch.bfloat16), batches)
    for b in batches:
        sequential = loop_ms(engine, model, b, False)
        overlapped = loop_ms(engine, model, b, True)
        print(f"{args.size} B={b}: {overlapped:.2f} ms per step overlapped, {sequential:.2f} sequential", flush=True)


if __name__ == "__main__":
    main()
