"""Where the incremental codec decoder's GPU time goes, and which convolution implementation is fastest.

One frame per row per call (the engine's step), random full-size weights, bf16, graph replay timing.
Variants: cuDNN as configured (default), cuDNN with benchmark autotuning, and dense convolutions as one
batched GEMM over gathered taps (grouped/1x1 convolutions stay on cuDNN). GPU machine only.

usage: python bench/profile_codec.py [--batches 1,16,64]
"""

from __future__ import annotations

import argparse
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile

from q3tts.benchmark import _graph_ms, _random_decoder
from q3tts.models.codec_streaming import StreamingDecoder


def gemm_conv(m, x, cursor):
    """Dense causal conv as [Cout, Cin*k] @ [B, Cin*k, T] over the gathered (dilated) taps."""
    if m.left_context == 0 or m.conv.groups != 1:
        return ORIGINAL_CONV(m, x, cursor)
    state = cursor.next_conv()
    full = torch.cat([state, x], dim=-1)
    state.copy_(full[..., full.shape[-1] - m.left_context:])
    c = m.conv
    k, d = c.kernel_size[0], c.dilation[0]
    T = full.shape[-1] - (k - 1) * d
    taps = torch.stack([full[..., j * d: j * d + T] for j in range(k)], dim=2)  # [B, Cin, k, T]
    out = torch.matmul(c.weight.view(c.out_channels, -1), taps.view(full.shape[0], -1, T))
    return out + c.bias[None, :, None]


ORIGINAL_CONV = StreamingDecoder._conv


def time_variant(stream: StreamingDecoder, batch: int) -> float:
    codes = torch.randint(0, 2048, (batch, 16, 1), device="cuda")
    return _graph_ms(lambda: stream.decode(codes), 20)


def top_kernels(stream: StreamingDecoder, batch: int, n: int = 14) -> None:
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
    print(f"  B={batch}: {sum(totals.values()) / 1e3:.2f} ms kernel time, {sum(counts.values())} kernels")
    for name, t in sorted(totals.items(), key=lambda kv: -kv[1])[:n]:
        print(f"  {t / 1e3:7.3f} ms {counts[name]:4d}x  {name[:100]}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--batches", default="1,16,64")
    args = parser.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    decoder = _random_decoder(torch.device("cuda"), torch.bfloat16)
    stream = StreamingDecoder(decoder, max(batches))
    print("profile, default cuDNN:")
    top_kernels(stream, batches[-1])
    results = {}
    for variant in ("cudnn", "cudnn-benchmark", "gemm", "gemm+cudnn-benchmark"):
        torch.backends.cudnn.benchmark = "benchmark" in variant
        StreamingDecoder._conv = staticmethod(gemm_conv if variant.startswith("gemm") else ORIGINAL_CONV)
        results[variant] = [time_variant(stream, b) for b in batches]
        print(f"{variant:22s} " + "  ".join(f"B={b}: {t:6.2f} ms" for b, t in zip(batches, results[variant])))
    StreamingDecoder._conv = staticmethod(gemm_conv)
    print("profile, gemm:")
    top_kernels(stream, batches[-1])
    # Same outputs? (bf16: compare against the default path on identical state)
    codes = torch.randint(0, 2048, (2, 16, 12), device="cuda")
    outs = []
    for conv in (ORIGINAL_CONV, gemm_conv):
        StreamingDecoder._conv = staticmethod(conv)
        s = StreamingDecoder(decoder, 2)
        outs.append(s.decode(codes, clamp=False).float())
    print(f"gemm vs cuDNN conv, 12 frames: max |diff| {float((outs[0] - outs[1]).abs().max()):.3e}, "
          f"rms {float(outs[0].pow(2).mean().sqrt()):.3e}")


if __name__ == "__main__":
    main()
