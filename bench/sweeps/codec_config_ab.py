"""The streaming codec's frame step with its convolution tiles as they are (A: `CONV_CONFIGS` and `WIDE_CONV_CONFIGS`)
against proposed ones (B: `--set`, at every row count): its graph-replay time per batch, A and B alternated, and
whether B's audio and state equal A's bit for bit. Random full-size weights, bf16. GPU machine only.

usage: python bench/sweeps/codec_config_ab.py --batches 64,128,256 --set 7,768,768=64,128,64,4,3 [--set ...]
"""

from __future__ import annotations

import argparse

import torch

from q3tts.benchmarks.common import graph_ms, random_decoder
from q3tts.engine.runner.codec_stream import StreamingDecoder
from q3tts.kernels import codec as codec_kernels


def parse(item: str) -> tuple[tuple[int, int, int], tuple[int, ...]]:
    shape, tile = item.split("=")
    return tuple(int(x) for x in shape.split(",")), tuple(int(x) for x in tile.split(","))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--batches", default="64,128,256")
    parser.add_argument("--set", action="append", required=True, metavar="K,C_IN,C_OUT=BM,BN,BK,WARPS,STAGES")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    wide = dict(codec_kernels.WIDE_CONV_CONFIGS)
    configs = {"A": wide, "B": {**wide, **{shape: (0, tile) for shape, tile in map(parse, args.set)}}}
    batches = [int(b) for b in args.batches.split(",")]
    stream = StreamingDecoder(random_decoder(torch.device("cuda"), torch.bfloat16), max(batches))

    def use(name: str) -> None:
        codec_kernels.WIDE_CONV_CONFIGS.clear()
        codec_kernels.WIDE_CONV_CONFIGS.update(configs[name])

    for b in batches:
        codes = torch.randint(0, 2048, (b, 16, 3), device="cuda", generator=torch.Generator("cuda").manual_seed(b))
        outputs = {}
        for name in "AB":  # the same three frames from a fresh state: audio and state compared
            use(name)
            stream.reset(list(range(b)))
            audio = torch.cat([stream.decode(codes[:, :, t:t + 1]) for t in range(3)], dim=1)
            outputs[name] = (audio, [t[:b].clone() for t in stream.state.tensors()])
        same = torch.equal(outputs["A"][0], outputs["B"][0]) and all(
            torch.equal(x, y) for x, y in zip(outputs["A"][1], outputs["B"][1]))
        diff = (outputs["A"][0].float() - outputs["B"][0].float()).abs().max().item()
        times = {"A": [], "B": []}
        one = codes[:, :, :1]
        for _ in range(args.rounds):
            for name in "AB":
                use(name)
                times[name].append(graph_ms(lambda one=one: stream.decode(one), 20))
        a, b_ms = min(times["A"]), min(times["B"])
        print(f"B={b}: step A {a:.3f} ms, B {b_ms:.3f} ms ({100 * (b_ms / a - 1):+.1f}%); audio and state "
              f"{'identical' if same else f'differ (audio max |diff| {diff:.3g})'}", flush=True)
    use("A")


if __name__ == "__main__":
    main()
