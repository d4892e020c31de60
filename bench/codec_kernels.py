"""Tile shapes for the vocoder's time-major convolution kernel: every convolution shape of the real codec at a
one-frame step for B streams, timed with each candidate (BM, BN, BK, warps, stages); prints the best per shape
with its TFLOP/s next to the current choice (`CONV_CONFIGS` or the heuristic). GPU machine only.

usage: python bench/codec_kernels.py [--batches 1,64]
"""

from __future__ import annotations

import argparse
import itertools

import torch

from q3tts.config import CodecDecoderConfig
from q3tts.engine import codec_kernels

CANDIDATES = [(bm, bn, bk, w, s) for bm, bn, bk, (w, s) in
              itertools.product((16, 64, 128), (32, 64, 128), (32, 64), ((4, 3), (8, 3), (4, 4)))]


def shapes(config: CodecDecoderConfig, batch: int) -> list[tuple[str, int, int, int, int, int]]:
    """(name, rows, k, dilation, C_in, C_out) of each distinct vocoder convolution for one frame per stream."""
    dims = [config.decoder_dim // 2 ** i for i in range(len(config.upsample_rates) + 1)]
    steps = 1
    for r in config.upsampling_ratios:
        steps *= r
    out = [("conv_in", batch * steps, 7, 1, config.latent_dim, dims[0])]
    for i, r in enumerate(config.upsample_rates):
        steps *= r
        out += [(f"block{i + 1} k7 d9", batch * steps, 7, 9, dims[i + 1], dims[i + 1]),
                (f"block{i + 1} k1", batch * steps, 1, 1, dims[i + 1], dims[i + 1])]
    return out + [("conv_out", batch * steps, 7, 1, dims[-1], 1)]


def time_ms(fn, reps: int = 20) -> float:
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps


def sweep(batch: int, name: str, R: int, k: int, d: int, c_in: int, c_out: int) -> None:
    dev, dt = torch.device("cuda"), torch.bfloat16
    x = torch.randn(batch, R // batch, c_in, device=dev, dtype=dt)
    state = torch.randn(batch, (k - 1) * d, c_in, device=dev, dtype=dt) if k > 1 else None
    w = torch.randn(k, c_in, c_out, device=dev, dtype=dt) * 0.02
    bias = torch.zeros(c_out, device=dev, dtype=dt)
    snake = codec_kernels.snake_params(torch.zeros(c_out, device=dev), torch.zeros(c_out, device=dev))
    run = lambda: codec_kernels.causal_conv(x, state, w, bias, d, snake=snake, keep_out=False)
    results, tuned = {}, dict(codec_kernels.CONV_CONFIGS)
    for cfg in [None, *CANDIDATES]:
        if cfg is not None and (cfg[1] > 2 * max(c_out, 16) or cfg[0] > max(16, 2 * R)):
            continue
        codec_kernels.CONV_CONFIGS.clear()
        codec_kernels.CONV_CONFIGS.update(tuned if cfg is None else {(k, c_in, c_out): cfg})
        try:
            results[cfg] = time_ms(run)
        except Exception as e:  # noqa: BLE001 - a tile that does not fit the shared memory
            print(f"  {cfg}: {type(e).__name__}")
    codec_kernels.CONV_CONFIGS.clear()
    codec_kernels.CONV_CONFIGS.update(tuned)
    best = min((c for c in results if c is not None), key=results.get)
    flops = 2 * R * k * c_in * c_out
    print(f"B={batch} {name} (R={R}, k={k}, {c_in}->{c_out}): current {codec_kernels.conv_config(R, k, c_in, c_out)} "
          f"{results[None] * 1e3:.1f} us {flops / results[None] / 1e9:.0f} TFLOP/s; best {best} "
          f"{results[best] * 1e3:.1f} us {flops / results[best] / 1e9:.0f} TFLOP/s", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--batches", default="1,64")
    args = parser.parse_args()
    for batch in (int(b) for b in args.batches.split(",")):
        for shape in shapes(CodecDecoderConfig(), batch):
            sweep(batch, *shape)


if __name__ == "__main__":
    main()
