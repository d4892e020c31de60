"""Tile shapes for the vocoder's time-major convolution kernels: every convolution shape of the real codec at a
one-frame step for B streams, timed with each candidate (BM, BN, BK, warps, stages); prints the best per shape
with its TFLOP/s next to the current choice (`CONV_CONFIGS` or the heuristic). `--units`: the fused residual
unit per channel count against the two convolutions it replaces. `--ceiling`: each convolution as one cuBLAS
matrix product of its unrolled input ([rows, k * C_in] @ [k * C_in, C_out], the unrolling not timed), summed
over the vocoder: what a library GEMM would need for the same work. GPU machine only.

usage: python bench/sweeps/codec_kernels.py [--batches 1,64] [--units] [--ceiling] [--no-sweep]
"""

from __future__ import annotations

import argparse
import functools
import itertools

import torch

from q3tts.benchmarks.common import graph_ms
from q3tts.config import CodecDecoderConfig
from q3tts.kernels import codec as codec_kernels

CANDIDATES = [(bm, bn, bk, w, s) for bm, bn, bk, (w, s) in
              itertools.product((64, 128), (32, 64, 128), (32, 64), ((4, 3), (8, 3), (8, 4)))]


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


def time_ms(fn) -> float:
    """GPU ms per call: 10 calls captured in one CUDA graph, replayed 4 times."""
    return graph_ms(fn, replays=4, reps=10)


def sweep(batch: int, name: str, R: int, k: int, d: int, c_in: int, c_out: int) -> tuple:
    """Times every candidate on one convolution shape; returns the best."""
    dev, dt = torch.device("cuda"), torch.bfloat16
    x = torch.randn(batch, (k - 1) * d + R // batch, c_in, device=dev, dtype=dt)  # kept context + new steps
    state = torch.randn(batch, (k - 1) * d, c_in, device=dev, dtype=dt) if k > 1 else None
    w = torch.randn(k, c_in, c_out, device=dev, dtype=dt) * 0.02
    bias = torch.zeros(c_out, device=dev, dtype=dt)
    snake = codec_kernels.snake_params(torch.zeros(c_out, device=dev), torch.zeros(c_out, device=dev))
    run = lambda: codec_kernels.causal_conv(x, state, w, bias, d, snake=snake, keep_out=False)
    results, tuned, wide = {}, dict(codec_kernels.CONV_CONFIGS), dict(codec_kernels.WIDE_CONV_CONFIGS)
    for cfg in [None, *CANDIDATES]:
        if cfg is not None and (cfg[1] > 2 * max(c_out, 16) or cfg[0] > max(16, 2 * R)):
            continue
        codec_kernels.CONV_CONFIGS.clear()
        codec_kernels.CONV_CONFIGS.update(tuned if cfg is None else {(k, c_in, c_out): cfg})
        codec_kernels.WIDE_CONV_CONFIGS.clear()  # (a candidate at every row count; the current choice as shipped)
        codec_kernels.WIDE_CONV_CONFIGS.update(wide if cfg is None else {})
        try:
            results[cfg] = time_ms(run)
        except Exception as e:  # noqa: BLE001 - a tile that does not fit the shared memory
            print(f"  {cfg}: {type(e).__name__}")
    codec_kernels.CONV_CONFIGS.clear()
    codec_kernels.CONV_CONFIGS.update(tuned)
    codec_kernels.WIDE_CONV_CONFIGS.update(wide)
    best = min((c for c in results if c is not None), key=results.get)
    flops = 2 * R * k * c_in * c_out
    print(f"B={batch} {name} (R={R}, k={k}, {c_in}->{c_out}): current {codec_kernels.conv_config(R, k, c_in, c_out)} "
          f"{results[None] * 1e3:.1f} us {flops / results[None] / 1e9:.0f} TFLOP/s; best {best} "
          f"{results[best] * 1e3:.1f} us {flops / results[best] / 1e9:.0f} TFLOP/s", flush=True)
    return best


UNIT_CANDIDATES = [(bm, bk, bn, w, s) for bm, bk, bn, (w, s) in
                   itertools.product((32, 64, 128), (32, 64), (64, 128), ((4, 3), (8, 3)))]


def sweep_units(batch: int, config: CodecDecoderConfig) -> dict[int, tuple]:
    """Each channel count's fused residual unit (dilation 9, C <= 384) against its two convolutions; returns
    the best tiles per channel count."""
    steps = 1
    for r in (*config.upsampling_ratios, *config.upsample_rates):
        steps *= r
    best = {}
    for i, r in reversed(list(enumerate(config.upsample_rates))):
        C = config.decoder_dim // 2 ** (i + 1)
        if C <= 384:
            best[C] = sweep_unit(batch, C, steps)
        steps //= r
    return best


def sweep_unit(batch: int, C: int, T: int) -> tuple:
    dev, dt = torch.device("cuda"), torch.bfloat16
    rnd = lambda *shape: torch.randn(*shape, device=dev, dtype=dt)
    x, res, state = rnd(batch, 54 + T, C), rnd(batch, T, C), rnd(batch, 54, C)
    w1, w2, b = rnd(7, C, C) * 0.02, rnd(1, C, C) * 0.05, rnd(C) * 0.1
    snake = codec_kernels.snake_params(torch.zeros(C, device=dev), torch.zeros(C, device=dev))
    run = lambda: codec_kernels.residual_unit(x, state, w1, b, snake, w2, b, res, snake, 9, keep_out=True)
    saved = (dict(codec_kernels.UNIT_CONFIGS), codec_kernels.UNIT_MAX_CHANNELS)
    codec_kernels.UNIT_MAX_CHANNELS = 0
    unfused = time_ms(run)
    codec_kernels.UNIT_MAX_CHANNELS = 512
    results, cp = {}, 1 << (C - 1).bit_length()
    for cfg in UNIT_CANDIDATES:
        if cfg[2] > cp or cfg[0] * cp > 128 * 256 or (cfg[0] == 32 and cp < 512):
            continue
        codec_kernels.UNIT_CONFIGS.clear()
        codec_kernels.UNIT_CONFIGS[C] = cfg
        try:
            results[cfg] = time_ms(run)
        except Exception as e:  # noqa: BLE001 - a tile that does not fit the shared memory
            print(f"  {cfg}: {type(e).__name__}")
    codec_kernels.UNIT_CONFIGS.clear()
    codec_kernels.UNIT_CONFIGS.update(saved[0])
    codec_kernels.UNIT_MAX_CHANNELS = saved[1]
    flops = 2 * batch * T * 8 * C * C
    ranked = sorted(results, key=results.get)
    print(f"B={batch} unit C={C} T={T}: two convolutions {unfused * 1e3:.1f} us; fused best {ranked[0]} "
          f"{results[ranked[0]] * 1e3:.1f} us ({flops / results[ranked[0]] / 1e9:.0f} TFLOP/s); next "
          + ", ".join(f"{c} {results[c] * 1e3:.1f}" for c in ranked[1:4]), flush=True)
    return ranked[0]


def ceiling(batch: int, config: CodecDecoderConfig) -> None:
    """The vocoder's convolutions and transposed convolutions at one frame step, each as one cuBLAS GEMM."""
    dev, dt = torch.device("cuda"), torch.bfloat16
    gemms = []  # (rows, K, N, count)
    for name, R, k, _, c_in, c_out in shapes(config, batch):
        gemms.append((R, k * c_in, c_out, 3 if name.startswith("block") else 1))
    steps = batch * config.upsampling_ratios[0] * config.upsampling_ratios[1]
    for i, r in enumerate(config.upsample_rates):  # transposed conv: [steps, C_in] @ [C_in, 2r * C_out]
        c_in = config.decoder_dim // 2 ** i
        gemms.append((steps, c_in, 2 * r * (c_in // 2), 1))
        steps *= r
    total_ms = total_flops = 0.0
    for R, K, N, count in gemms:
        a, w = torch.randn(R, K, device=dev, dtype=dt), torch.randn(K, N, device=dev, dtype=dt)
        ms = time_ms(functools.partial(torch.matmul, a, w))
        total_ms, total_flops = total_ms + count * ms, total_flops + count * 2 * R * K * N
        print(f"  cuBLAS [{R}, {K}] @ [{K}, {N}] x{count}: {ms * 1e3:.1f} us ({2 * R * K * N / ms / 1e9:.0f} TFLOP/s)")
    print(f"B={batch} vocoder as cuBLAS GEMMs: {total_ms:.3f} ms for {total_flops / 1e9:.0f} GFLOP "
          f"({total_flops / total_ms / 1e9:.0f} TFLOP/s)", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--batches", default="1,64")
    parser.add_argument("--units", action="store_true", help="sweep the fused residual unit")
    parser.add_argument("--ceiling", action="store_true", help="the same work as cuBLAS GEMMs")
    parser.add_argument("--no-sweep", action="store_true", help="skip the per-convolution sweep")
    args = parser.parse_args()
    config = CodecDecoderConfig()
    for batch in (int(b) for b in args.batches.split(",")):
        if args.ceiling:
            ceiling(batch, config)
        if args.units:
            sweep_units(batch, config)
        if not args.no_sweep:
            for shape in shapes(config, batch):
                if not (shape[0].startswith("block") and shape[4] <= codec_kernels.UNIT_MAX_CHANNELS):
                    sweep(batch, *shape)  # (the residual units' convolutions up to that size run fused)


if __name__ == "__main__":
    main()
